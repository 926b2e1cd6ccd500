//! The rate-limit fields of responses in each dialect (`headers`), read
//! back by a real client's parser, on allowed and denied responses; and
//! `exempt` clients, whom a rule neither counts nor denies.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use actix_web::{test as actix_test, web, App, HttpResponse};
use floodgate::config::Config;
use floodgate::rule::HeaderDialect;
use floodgate::{Filter, Limit};

use crate::helpers::{header, spawn_app, RedisServer};

/// Where scripts/test installed ratelimit-header-parser.
const PARSER_DIR: &str = "FLOODGATE_RATELIMIT_PARSER";

/// A response's header fields, names lower-case, repeated lines joined.
fn fields(res: &reqwest::Response) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in res.headers() {
        let value = value.to_str().unwrap().to_string();
        out.entry(name.as_str().to_string())
            .and_modify(|v| {
                v.push_str(", ");
                v.push_str(&value);
            })
            .or_insert(value);
    }
    out
}

/// What ratelimit-header-parser's `parseRateLimit` reads in each response.
fn parse_with_node(responses: &[BTreeMap<String, String>]) -> Vec<serde_json::Value> {
    let dir = std::env::var(PARSER_DIR).unwrap_or_else(|_| {
        panic!(
            "{PARSER_DIR} is not set: it names a directory where \
             `npm install --prefix DIR ratelimit-header-parser@0.1` ran (scripts/test does this)"
        )
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parse_ratelimit.mjs");
    let mut child = Command::new("node")
        .arg(script)
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("node runs (scripts/test installs Node.js)");
    let input = serde_json::to_vec(responses).unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "node: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// One item of an IETF list field: `"NAME";k=v;k=v`, as a structured-field
/// parser reads it (a string, then integer parameters).
fn sf_items(field: &str) -> Vec<(String, BTreeMap<String, u64>)> {
    let mut items = Vec::new();
    let mut rest = field.trim();
    while !rest.is_empty() {
        let body = rest.strip_prefix('"').expect("an item is a string");
        let end = body.find('"').expect("the string ends");
        let name = body[..end].to_string();
        rest = &body[end + 1..];
        let mut params = BTreeMap::new();
        while let Some(p) = rest.strip_prefix(';') {
            let eq = p.find('=').expect("a parameter has a value");
            let key = p[..eq].to_string();
            let digits: String = p[eq + 1..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            assert!(!digits.is_empty(), "{key} is an integer in {field:?}");
            rest = &p[eq + 1 + digits.len()..];
            params.insert(key, digits.parse().unwrap());
        }
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix(',') {
            rest = r.trim_start();
        } else {
            assert!(rest.is_empty(), "junk after an item in {field:?}: {rest:?}");
        }
        items.push((name, params));
    }
    items
}

const DIALECTS: &str = r#"
[defaults]
deny = "status"

[[rule]]
name = "six"
paths = ["/six"]
limit = 3
window = "1m"
headers = "draft-6"

[[rule]]
name = "six-loose"
paths = ["/six"]
limit = 50
window = "1m"
headers = "draft-6"

[[rule]]
name = "seven"
paths = ["/seven"]
limit = 3
window = "1m"
headers = "draft-7"

[[rule]]
name = "x"
paths = ["/x"]
limit = 3
window = "1m"
headers = "x-ratelimit"

[[rule]]
name = "std"
paths = ["/std"]
limit = 3
window = "1m"

[[rule]]
name = "hidden"
paths = ["/six", "/seven", "/x", "/std"]
limit = 1000
window = "1m"
headers = "none"
"#;

#[actix_web::test]
async fn each_dialect_reads_right_in_a_real_clients_parser() {
    let app = spawn_app(DIALECTS).await;
    let mut responses = Vec::new();
    let mut ietf = Vec::new();
    for path in ["/six", "/seven", "/x", "/std"] {
        // Remaining 2, 1, 0, then a denial (0 too).
        for k in 0..4 {
            let res = app.get(path).await;
            // (No handler: rules guard paths before routing.)
            let status = if k == 3 { 429 } else { 404 };
            assert_eq!(res.status(), status, "{path} #{k}");
            let f = fields(&res);
            assert!(
                !f.values().any(|v| v.contains("hidden")) && !f.contains_key("ratelimit-hidden"),
                "a hidden rule shows: {f:?}"
            );
            if path == "/std" {
                ietf.push(f.clone());
            }
            responses.push(f);
        }
    }
    let before = now_ms();
    let parsed = parse_with_node(&responses[..12]);
    assert_eq!(parsed.len(), 12, "{parsed:?}");
    for (i, p) in parsed.iter().enumerate() {
        let path = ["/six", "/seven", "/x"][i / 4];
        let expected = [2, 1, 0, 0][i % 4];
        assert_eq!(p["limit"], 3, "{path} #{i}: {p} from {:?}", responses[i]);
        assert_eq!(p["remaining"], expected, "{path} #{i}: {p}");
        // The window is a minute: the reset is within it, and not past.
        let reset = p["reset"].as_u64().expect("a reset");
        assert!(
            reset + 2000 >= before && reset <= now_ms() + 61_000,
            "{path} #{i}: reset {reset}, now {before}"
        );
    }
    // The draft fields are the ones their drafts define, nothing more.
    assert_eq!(responses[0]["ratelimit-policy"], "3;w=60");
    assert_eq!(responses[4]["ratelimit-policy"], "3;w=60");
    assert!(!responses[0].contains_key("ratelimit"));
    assert!(!responses[8].contains_key("ratelimit-policy"));
    // ietf, by a structured-field reading of its lists.
    for (i, f) in ietf.iter().enumerate() {
        let policy = sf_items(&f["ratelimit-policy"]);
        let state = sf_items(&f["ratelimit"]);
        assert_eq!(policy.len(), 1, "{f:?}");
        assert_eq!(policy[0].0, "std");
        assert_eq!(policy[0].1["q"], 3);
        assert_eq!(policy[0].1["w"], 60);
        assert_eq!(state[0].0, "std");
        assert_eq!(state[0].1["r"], [2, 1, 0, 0][i]);
        assert!((1..=60).contains(&state[0].1["t"]), "{f:?}");
    }
    assert!(ietf[3].contains_key("retry-after"));
}

#[actix_web::test]
async fn denials_carry_the_fields_of_the_matching_rules() {
    let app = spawn_app(
        r#"
[[rule]]
name = "tight"
paths = ["/check"]
limit = 1
window = "1m"

[[rule]]
name = "wide"
paths = ["/check"]
limit = 100
window = "1m"
"#,
    )
    .await;
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        header(&res, "ratelimit").as_deref(),
        Some("\"tight\";r=0;t=60, \"wide\";r=99;t=60")
    );
    // The 303 of a browser: the denying rule at 0, the other with the unit
    // the denied request did not take.
    let res = app.get("/check").await;
    assert_eq!(res.status(), 303);
    let field = header(&res, "ratelimit").unwrap();
    let items = sf_items(&field);
    assert_eq!(items[0].0, "tight");
    assert_eq!(items[0].1["r"], 0);
    let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert_eq!(items[0].1["t"], retry);
    assert_eq!((items[1].0.as_str(), items[1].1["r"]), ("wide", 99));
    assert_eq!(
        header(&res, "ratelimit-policy").as_deref(),
        Some("\"tight\";q=1;w=60, \"wide\";q=100;w=60")
    );
    // Remembered in-process now: the 429 for JSON shows both rules still,
    // the other as the denial by Redis left it.
    let res = app.get_json("/check").await;
    assert_eq!(res.status(), 429);
    let items = sf_items(&header(&res, "ratelimit").unwrap());
    assert_eq!(items.len(), 2, "{items:?}");
    assert_eq!((items[0].0.as_str(), items[0].1["r"]), ("tight", 0));
    assert_eq!((items[1].0.as_str(), items[1].1["r"]), ("wide", 99));
    assert_eq!(
        header(&res, "ratelimit-policy").as_deref(),
        Some("\"tight\";q=1;w=60, \"wide\";q=100;w=60")
    );
    assert!(header(&res, "retry-after").is_some());
}

/// A denial says no units are left in a one-rule dialect, even when the
/// rule that denied hides its numbers; and in the lists, a token bucket
/// that would have admitted the request says what it holds now.
#[actix_web::test]
async fn a_denial_shows_none_left_and_a_bucket_as_it_stands() {
    let app = spawn_app(
        r#"
[defaults]
deny = "status"

[[rule]]
name = "shown"
paths = ["/d"]
limit = 5
window = "1m"
headers = "draft-6"

[[rule]]
name = "hid"
paths = ["/d"]
limit = 2
window = "1m"
headers = "none"

[[rule]]
name = "hid-too"
paths = ["/b"]
limit = 2
window = "1m"
headers = "none"

[[rule]]
name = "hid-e"
paths = ["/e"]
limit = 2
window = "1m"
headers = "none"

[[rule]]
name = "tb6"
paths = ["/e"]
algorithm = "token_bucket"
rate = 1.0
burst = 60
headers = "draft-6"

[[rule]]
name = "tb"
paths = ["/b"]
algorithm = "token_bucket"
rate = 0.05
burst = 3
"#,
    )
    .await;
    for left in [4, 3] {
        let res = app.get("/d").await;
        assert_eq!(res.status(), 404);
        assert_eq!(header(&res, "ratelimit-remaining"), Some(left.to_string()));
    }
    let res = app.get("/d").await;
    assert_eq!(res.status(), 429, "denied by the hidden rule");
    assert_eq!(header(&res, "ratelimit-remaining").as_deref(), Some("0"));
    assert_eq!(header(&res, "ratelimit-limit").as_deref(), Some("5"));
    // Again, answered from the memory of denials: the same fields.
    let res = app.get("/d").await;
    assert_eq!(res.status(), 429);
    assert_eq!(header(&res, "ratelimit-remaining").as_deref(), Some("0"));
    assert_eq!(header(&res, "ratelimit-limit").as_deref(), Some("5"));
    // A bucket shown in a one-rule dialect beside a hidden rule's denial:
    // 0 left, reset no sooner than the retry (the bucket alone would be
    // full in 2 s).
    for _ in 0..2 {
        assert_eq!(app.get("/e").await.status(), 404);
    }
    for _ in 0..2 {
        let res = app.get("/e").await;
        assert_eq!(res.status(), 429);
        assert_eq!(header(&res, "ratelimit-remaining").as_deref(), Some("0"));
        let reset: u64 = header(&res, "ratelimit-reset").unwrap().parse().unwrap();
        let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
        assert!(reset >= retry && retry > 50, "reset {reset}, retry {retry}");
    }

    // The bucket: 20 s a token; two taken, full again in 40 s.
    let mut reset = 0;
    for left in [2, 1] {
        let res = app.get("/b").await;
        let items = sf_items(&header(&res, "ratelimit").unwrap());
        assert_eq!((items[0].0.as_str(), items[0].1["r"]), ("tb", left));
        reset = items[0].1["t"];
    }
    assert_eq!(reset, 40);
    let res = app.get("/b").await;
    assert_eq!(res.status(), 429, "denied by the hidden rule");
    let items = sf_items(&header(&res, "ratelimit").unwrap());
    assert_eq!(items.len(), 1, "{items:?}");
    assert_eq!((items[0].0.as_str(), items[0].1["r"]), ("tb", 1));
    assert!(items[0].1["t"] <= 40, "{items:?}");
}

#[actix_web::test]
async fn an_html_429_carries_the_fields_too() {
    let app = spawn_app(
        "[[rule]]\nname = \"one\"\npaths = [\"/check\"]\nlimit = 1\nwindow = \"1m\"\ndeny = \"status\"\nheaders = \"x-ratelimit\"\n",
    )
    .await;
    assert_eq!(app.get("/check").await.status(), 200);
    let res = app
        .client
        .get(app.url("/check"))
        .header("accept", "text/html")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 429);
    assert!(header(&res, "content-type")
        .unwrap()
        .starts_with("text/html"));
    assert_eq!(header(&res, "x-ratelimit-limit").as_deref(), Some("1"));
    assert_eq!(header(&res, "x-ratelimit-remaining").as_deref(), Some("0"));
    let reset: u64 = header(&res, "x-ratelimit-reset").unwrap().parse().unwrap();
    let now = now_ms() / 1000;
    assert!(reset + 2 >= now && reset <= now + 61, "{reset} vs {now}");
}

#[actix_web::test]
async fn an_ietf_rule_and_a_draft_7_rule_on_one_path_keep_the_ietf_lists() {
    let app = spawn_app(
        r#"
[defaults]
deny = "status"

[[rule]]
name = "std"
paths = ["/check"]
limit = 10
window = "1m"

[[rule]]
name = "seven"
paths = ["/check", "/api/*"]
limit = 2
window = "1m"
headers = "draft-7"

[[rule]]
name = "old"
paths = ["/check"]
limit = 5
window = "1m"
headers = "x-ratelimit"
"#,
    )
    .await;
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    // RateLimit and RateLimit-Policy are the ietf lists; the draft-7 rule
    // is left out; x-ratelimit shares no name and shows.
    let field = header(&res, "ratelimit").unwrap();
    assert!(field.starts_with("\"std\";r=9;t="), "{field}");
    assert_eq!(sf_items(&field).len(), 1, "{field}");
    assert_eq!(
        header(&res, "ratelimit-policy").as_deref(),
        Some("\"std\";q=10;w=60")
    );
    assert_eq!(header(&res, "x-ratelimit-remaining").as_deref(), Some("4"));
    // Where the draft-7 rule is alone, it has the names.
    let res = app.get("/api/ping").await;
    let field = header(&res, "ratelimit").unwrap();
    assert!(field.starts_with("limit=2, remaining=0, reset="), "{field}");
    assert_eq!(header(&res, "ratelimit-policy").as_deref(), Some("2;w=60"));
    // Its denial on /check: still the ietf lists (its own rule left out).
    let res = app.get("/check").await;
    assert_eq!(res.status(), 429);
    let field = header(&res, "ratelimit").unwrap();
    assert!(field.starts_with("\"std\";r=9;t="), "{field}");
    assert_eq!(sf_items(&field).len(), 1, "{field}");
}

#[actix_web::test]
async fn exempt_clients_are_neither_counted_nor_denied() {
    let app = spawn_app(
        r#"
[server]
trusted_proxies = ["127.0.0.1"]

[defaults]
deny = "status"

[[rule]]
name = "open"
paths = ["/check"]
limit = 1
window = "1m"
exempt = ["10.0.0.0/8", "2001:db8::/32"]

[[rule]]
name = "all"
paths = ["/check"]
limit = 100
window = "1m"
"#,
    )
    .await;
    let from = |addr: &'static str| {
        app.client
            .get(app.url("/check"))
            .header("x-forwarded-for", addr)
            .send()
    };
    // Exempt (an IPv4-mapped address counts as IPv4): never denied, never
    // counted, not shown; the other rule still counts them.
    for addr in ["10.1.2.3", "::ffff:10.9.9.9", "2001:db8::7"] {
        for _ in 0..3 {
            let res = from(addr).await.unwrap();
            assert_eq!(res.status(), 200, "{addr}");
            let field = header(&res, "ratelimit").unwrap();
            assert!(
                field.starts_with("\"all\";") && !field.contains("open"),
                "{addr}: {field}"
            );
        }
    }
    assert!(app.redis.keys("floodgate:open:*").is_empty());
    assert_eq!(app.redis.llen("floodgate:all:ip:10.1.2.3"), 3);
    assert_eq!(app.redis.llen("floodgate:all:ip:10.9.9.9"), 3);
    // Not exempt: counted and denied.
    assert_eq!(from("203.0.113.7").await.unwrap().status(), 200);
    assert_eq!(from("203.0.113.7").await.unwrap().status(), 429);
    assert_eq!(app.redis.llen("floodgate:open:ip:203.0.113.7"), 1);
}

#[test]
fn headers_and_exempt_in_defaults_and_rules() {
    let parse = |text: &str| Config::parse(text, Path::new("t.toml"));
    let config = parse(
        "[defaults]\nheaders = \"x-ratelimit\"\nexempt = [\"10.0.0.0/8\"]\n\
         [[rule]]\nname = \"a\"\npaths = [\"/a\"]\nlimit = 1\nwindow = \"1m\"\n\
         [[rule]]\nname = \"b\"\npaths = [\"/b\"]\nlimit = 1\nwindow = \"1m\"\nheaders = \"none\"\nexempt = []\n",
    )
    .unwrap();
    assert_eq!(config.rules[0].headers(), HeaderDialect::XRateLimit);
    assert!(config.rules[0].exempts("10.2.3.4".parse().unwrap()));
    assert!(config.rules[0].exempts("::ffff:10.2.3.4".parse().unwrap()));
    assert!(!config.rules[0].exempts("11.2.3.4".parse().unwrap()));
    // A rule's own list replaces the default one.
    assert_eq!(config.rules[1].headers(), HeaderDialect::None);
    assert!(config.rules[1].exempt().is_empty());
    let err = parse("[defaults]\nexempt = [\"nope\"]\n").unwrap_err();
    assert_eq!(
        err.to_string(),
        "t.toml: [defaults] exempt: \"nope\" is not an IP address or CIDR: the address must be \
         IPv4 (10.0.0.1) or IPv6 (fd00::1), without a port"
    );
}

fn text<B>(res: &actix_web::dev::ServiceResponse<B>, name: &str) -> Option<String> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

async fn ok() -> HttpResponse {
    HttpResponse::Ok().body("ok")
}

#[actix_web::test]
async fn in_code_limits_take_a_dialect_and_exempt_networks() {
    let redis = RedisServer::start();
    let filter = Filter::from_toml_str(
        &format!(
            "[redis]\nurl = \"{}\"\n[[rule]]\nname = \"outer\"\npaths = [\"/*\"]\nlimit = 10\nwindow = \"1m\"\ndeny = \"status\"\nheaders = \"x-ratelimit\"\n",
            redis.url()
        ),
        "app.toml",
    )
    .unwrap();
    let tight = filter.limit(
        Limit::per_minute(2)
            .name("tight")
            .headers(HeaderDialect::XRateLimit),
    );
    // Test requests come from no address: 0.0.0.0.
    let free = filter.limit(Limit::per_minute(1).name("free").exempt("0.0.0.0/32"));
    let app = actix_test::init_service(
        App::new()
            .wrap(filter.clone())
            .service(web::resource("/tight").wrap(tight).route(web::get().to(ok)))
            .service(web::resource("/free").wrap(free).route(web::get().to(ok))),
    )
    .await;
    let get = |uri: &'static str| actix_test::TestRequest::get().uri(uri).to_request();

    // The inner limit is the tighter one: its numbers show, once.
    let res = actix_test::call_service(&app, get("/tight")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(text(&res, "x-ratelimit-limit").as_deref(), Some("2"));
    assert_eq!(text(&res, "x-ratelimit-remaining").as_deref(), Some("1"));
    assert_eq!(res.headers().get_all("x-ratelimit-limit").count(), 1);
    for _ in 0..3 {
        let res = actix_test::call_service(&app, get("/free")).await;
        assert_eq!(res.status(), StatusCode::OK);
        // Only the outer rule: the exempt one neither counts nor shows.
        assert_eq!(text(&res, "x-ratelimit-limit").as_deref(), Some("10"));
    }
    assert!(redis.keys("floodgate:free:*").is_empty());
    let err = filter
        .try_limit(Limit::per_minute(1).name("bad").exempt("10.0.0.0/40"))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "unusable limit \"bad\": exempt: \"10.0.0.0/40\" is not an IP address or CIDR: the \
         prefix length must be at most 32 for IPv4"
    );
}

#[actix_web::test]
async fn an_inner_limits_denial_shows_the_outer_rules_with_nothing_taken() {
    let redis = RedisServer::start();
    let filter = Filter::from_toml_str(
        &format!(
            "[redis]\nurl = \"{}\"\n[[rule]]\nname = \"outer\"\npaths = [\"/*\"]\nlimit = 10\nwindow = \"1m\"\ndeny = \"status\"\n",
            redis.url()
        ),
        "app.toml",
    )
    .unwrap();
    let inner = filter.limit(Limit::per_minute(1).name("inner"));
    let app = actix_test::init_service(
        App::new()
            .wrap(filter.clone())
            .service(web::resource("/one").wrap(inner).route(web::get().to(ok))),
    )
    .await;
    let get = || actix_test::TestRequest::get().uri("/one").to_request();
    let res = actix_test::call_service(&app, get()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let first = sf_items(&text(&res, "ratelimit").unwrap());
    assert_eq!((first[0].0.as_str(), first[0].1["r"]), ("outer", 9));
    assert_eq!((first[1].0.as_str(), first[1].1["r"]), ("inner", 0));
    // Denied by the inner limit: the outer rule gave its unit back and says so.
    let res = actix_test::call_service(&app, get()).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let denied = sf_items(&text(&res, "ratelimit").unwrap());
    assert_eq!((denied[0].0.as_str(), denied[0].1["r"]), ("outer", 9));
    assert_eq!((denied[1].0.as_str(), denied[1].1["r"]), ("inner", 0));
    assert_eq!(
        text(&res, "ratelimit-policy").as_deref(),
        Some("\"outer\";q=10;w=60, \"inner\";q=1;w=60")
    );
    assert_eq!(redis.llen("floodgate:outer:ip:0.0.0.0"), 1);
}

#[actix_web::test]
async fn a_denial_responders_answer_carries_the_fields() {
    let redis = RedisServer::start();
    let filter = Filter::builder()
        .redis_url(&redis.url())
        .rule(
            "/one",
            Limit::per_minute(1)
                .name("one")
                .headers(HeaderDialect::Draft6),
        )
        .denial_responder(|denial, _| {
            let mut res =
                floodgate::http::Response::new(format!("slow down: {}", denial.rule.name()));
            *res.status_mut() = floodgate::http::StatusCode::TOO_MANY_REQUESTS;
            res
        })
        .build()
        .unwrap();
    let app =
        actix_test::init_service(App::new().wrap(filter).route("/one", web::get().to(ok))).await;
    let get = || actix_test::TestRequest::get().uri("/one").to_request();
    assert_eq!(
        actix_test::call_service(&app, get()).await.status(),
        StatusCode::OK
    );
    let res = actix_test::call_service(&app, get()).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let h = res.headers();
    assert_eq!(h.get("ratelimit-limit").unwrap(), "1");
    assert_eq!(h.get("ratelimit-remaining").unwrap(), "0");
    assert_eq!(h.get("ratelimit-policy").unwrap(), "1;w=60");
    let reset: u64 = h
        .get("ratelimit-reset")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&reset), "{reset}");
    assert!(h.contains_key("retry-after"));
}
