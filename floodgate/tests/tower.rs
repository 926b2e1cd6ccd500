//! The tower door: a `Filter` as the layer of an axum 0.8 router, served on
//! a real socket (the client address from `ConnectInfo`) against a real
//! redis-server: the decisions, answers and fields the actix door gives,
//! body keys read as axum's `Form` and `Json` read them, proxies, Redis
//! down, give-backs, the decision in handlers, exact counts under
//! concurrency, and one Redis shared with an actix app.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::{FromRequest, Query, Request};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Json, Router};
use floodgate_limiter::limiter::Action;
use floodgate_limiter::{Filter, Usage};
use serde_json::{json, Value};

use common::RedisServer;

fn filter(redis: &RedisServer, toml: &str) -> Filter {
    let text = format!("[redis]\nurl = \"{}\"\n{toml}", redis.url());
    Filter::from_toml_str(&text, "app.toml").unwrap()
}

/// `/check`, `/free`, `/login?ok=1` (200, else 401), `/usage` (the
/// decision as the handler reads it) and `POST /echo` (the `phone` field
/// as axum's `Form` or `Json` read it), behind `filter`.
fn app(filter: Filter) -> Router {
    Router::new()
        .route("/check", get(|| async { "ok" }))
        .route("/free", get(|| async { "free" }))
        .route(
            "/login",
            get(|q: Query<HashMap<String, String>>| async move {
                if q.contains_key("ok") {
                    (axum::http::StatusCode::OK, "welcome")
                } else {
                    (axum::http::StatusCode::UNAUTHORIZED, "no")
                }
            }),
        )
        .route(
            "/usage",
            get(|usage: Usage| async move {
                let check = usage.get("check").map(|r| r.remaining);
                Json(json!({ "remaining": check }))
            }),
        )
        .route("/echo", post(echo))
        .layer(filter)
}

async fn echo(req: Request) -> Response {
    let is_json = req
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let phone = if is_json {
        match Json::<Value>::from_request(req, &()).await {
            Ok(Json(v)) => v.get("phone").cloned().unwrap_or(Value::Null),
            Err(r) => return r.into_response(),
        }
    } else {
        match Form::<HashMap<String, String>>::from_request(req, &()).await {
            Ok(Form(f)) => f.get("phone").cloned().map_or(Value::Null, Value::String),
            Err(r) => return r.into_response(),
        }
    };
    Json(json!({ "phone": phone })).into_response()
}

/// Serves `router` on a free port of 127.0.0.1; the server stops with the
/// test's runtime.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    format!("http://127.0.0.1:{port}")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn get_json(base: &str, path: &str) -> reqwest::Response {
    client()
        .get(format!("{base}{path}"))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap()
}

fn header(res: &reqwest::Response, name: &str) -> Option<String> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

const CHECK: &str = r#"
[[rule]]
name = "check"
paths = ["/check", "/usage"]
limit = 3
window = "1h"
deny = "status"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_behind_the_layer_gets_429_json_with_retry_after_and_fields() {
    let redis = RedisServer::start();
    let base = serve(app(filter(&redis, CHECK))).await;
    for left in [2, 1, 0] {
        let res = get_json(&base, "/check").await;
        assert_eq!(res.status(), 200);
        assert_eq!(
            header(&res, "ratelimit").unwrap(),
            format!("\"check\";r={left};t=3600")
        );
        assert_eq!(
            header(&res, "ratelimit-policy").unwrap(),
            "\"check\";q=3;w=3600"
        );
    }
    let res = get_json(&base, "/check").await;
    assert_eq!(res.status(), 429);
    let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert!((3599..=3600).contains(&retry), "{retry}");
    assert_eq!(header(&res, "cache-control").unwrap(), "no-store");
    assert_eq!(header(&res, "ratelimit").unwrap(), "\"check\";r=0;t=3600");
    let body: Value = res.json().await.unwrap();
    assert_eq!(
        body,
        json!({"error": "rate_limited", "rule": "check", "retry_after": retry})
    );
    // A path no rule guards passes untouched.
    let res = get_json(&base, "/free").await;
    assert_eq!(res.status(), 200);
    assert!(header(&res, "ratelimit").is_none());
    // Unknown paths are the router's 404, guarded or not.
    assert_eq!(get_json(&base, "/nowhere").await.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_request_takes_nothing_from_any_rule() {
    let redis = RedisServer::start();
    let f = filter(
        &redis,
        r#"
[defaults]
deny = "status"

[[rule]]
name = "wide"
paths = ["/check", "/free"]
limit = 10
window = "1h"

[[rule]]
name = "narrow"
paths = ["/check"]
limit = 2
window = "1h"
"#,
    );
    let base = serve(app(f.clone())).await;
    let codes: Vec<u16> = {
        let mut codes = Vec::new();
        for _ in 0..4 {
            codes.push(get_json(&base, "/check").await.status().as_u16());
        }
        codes
    };
    assert_eq!(codes, [200, 200, 429, 429]);
    let wide = f.operate("wide", &["127.0.0.1"], Action::Inspect).await;
    assert_eq!(wide.unwrap().used, 2);
}

/// The `RateLimit` field's items without their reset times.
fn remaining(res: &reqwest::Response) -> String {
    let field = header(res, "ratelimit").unwrap();
    let items: Vec<&str> = field
        .split(", ")
        .map(|item| item.split(";t=").next().unwrap())
        .collect();
    items.join(", ")
}

/// A denial answered from the in-process memory of denials carries the
/// fields of every matching rule, as the denial Redis answered before it:
/// the other rules as that denial left them (it took nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_denial_shows_every_rule_as_redis_left_them() {
    let redis = RedisServer::start();
    let f = filter(
        &redis,
        "[defaults]\ndeny = \"status\"\n\
         [[rule]]\nname = \"one\"\npaths = [\"/check\"]\nlimit = 1\nwindow = \"1h\"\n\
         [[rule]]\nname = \"big\"\npaths = [\"/check\"]\nlimit = 50\nwindow = \"1h\"\n",
    );
    let base = serve(app(f.clone())).await;
    let first = get_json(&base, "/check").await;
    assert_eq!(first.status(), 200);
    assert_eq!(remaining(&first), r#""one";r=0, "big";r=49"#);
    for (n, hits) in [(2, 0), (3, 1), (4, 2)] {
        let res = get_json(&base, "/check").await;
        assert_eq!(res.status(), 429, "request {n}");
        assert_eq!(remaining(&res), r#""one";r=0, "big";r=49"#, "request {n}");
        let shown = f.metrics().render(0);
        let line = format!("floodgate_deny_cache_hits_total{{rule=\"one\"}} {hits}");
        assert!(hits == 0 || shown.contains(&line), "{line} in {shown}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_made_in_code_on_one_route_nests_in_the_routers_filter() {
    let redis = RedisServer::start();
    let outer = filter(
        &redis,
        "[[rule]]\nname = \"outer\"\npaths = [\"/*\"]\nlimit = 10\nwindow = \"1m\"\ndeny = \"status\"\n",
    );
    let inner = outer.limit(floodgate_limiter::Limit::per_minute(1).name("inner"));
    let router = Router::new()
        .route("/one", get(|| async { "one" }).route_layer(inner.clone()))
        .route("/two", get(|| async { "two" }))
        .layer(outer.clone());
    let base = serve(router).await;
    let res = get_json(&base, "/one").await;
    assert_eq!(res.status(), 200);
    // (The reset times depend on when each request came: only the units.)
    assert_eq!(remaining(&res), "\"outer\";r=9, \"inner\";r=0");
    // Denied by the inner limit: the outer rule gave its unit back and says so.
    let res = get_json(&base, "/one").await;
    assert_eq!(res.status(), 429);
    // (The reset times depend on when each request came: only the units.)
    assert_eq!(remaining(&res), "\"outer\";r=9, \"inner\";r=0");
    assert_eq!(
        header(&res, "ratelimit-policy").unwrap(),
        "\"outer\";q=10;w=60, \"inner\";q=1;w=60"
    );
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["rule"], "inner");
    let used = |f: &Filter, rule: &'static str| {
        let f = f.clone();
        async move {
            let state = f.operate(rule, &["127.0.0.1"], Action::Inspect).await;
            state.unwrap().used
        }
    };
    assert_eq!(used(&outer, "outer").await, 1);
    // The other route is the outer filter's alone.
    let res = get_json(&base, "/two").await;
    assert_eq!(res.status(), 200);
    assert_eq!(remaining(&res), "\"outer\";r=8");
    assert_eq!(used(&inner, "inner").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_under_300_concurrent_requests() {
    let redis = RedisServer::start();
    let toml = "[[rule]]\nname = \"check\"\npaths = [\"/check\"]\nlimit = 100\nwindow = \"1h\"\ndeny = \"status\"\n";
    let base = serve(app(filter(&redis, toml))).await;
    let client = client();
    let mut tasks = Vec::new();
    for _ in 0..300 {
        let (client, url) = (client.clone(), format!("{base}/check"));
        tasks.push(tokio::spawn(async move {
            client.get(url).send().await.unwrap().status().as_u16()
        }));
    }
    let mut allowed = 0;
    for t in tasks {
        match t.await.unwrap() {
            200 => allowed += 1,
            429 => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(allowed, 100);
}

/// Decisions are made on the runtime's own threads, as an actix worker
/// makes them: the worker lane writes a marker script (`EVAL "return 0"`)
/// before each call it sends itself, which the dispatcher threads never
/// send. (A lane's first calls go through its helper thread, which opens
/// the connection and leaves it for the lane: hence the wait.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_are_made_on_the_runtimes_threads() {
    let redis = RedisServer::start();
    let toml =
        "[[rule]]\nname = \"check\"\npaths = [\"/check\"]\nlimit = 100000\nwindow = \"1h\"\n";
    let base = serve(app(filter(&redis, toml))).await;
    let client = client();
    let mut conn = redis.connection();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let res = client.get(format!("{base}/check")).send().await.unwrap();
        assert_eq!(res.status(), 200);
        let stats: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut conn)
            .unwrap();
        if stats.contains("cmdstat_eval:") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no call came from a worker lane:\n{stats}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_header_dialect_shows_as_under_actix() {
    let redis = RedisServer::start();
    for (dialect, fields) in [
        (
            "draft-6",
            vec![
                ("ratelimit-limit", "3"),
                ("ratelimit-remaining", "2"),
                ("ratelimit-reset", "60"),
                ("ratelimit-policy", "3;w=60"),
            ],
        ),
        (
            "draft-7",
            vec![
                ("ratelimit", "limit=3, remaining=2, reset=60"),
                ("ratelimit-policy", "3;w=60"),
            ],
        ),
        (
            "x-ratelimit",
            vec![("x-ratelimit-limit", "3"), ("x-ratelimit-remaining", "2")],
        ),
        ("none", vec![]),
    ] {
        let toml = format!(
            "[[rule]]\nname = \"d{}\"\npaths = [\"/check\"]\nlimit = 3\nwindow = \"1m\"\nheaders = \"{dialect}\"\n",
            dialect.replace('-', "")
        );
        let base = serve(app(filter(&redis, &toml))).await;
        let res = get_json(&base, "/check").await;
        assert_eq!(res.status(), 200);
        for (name, value) in &fields {
            assert_eq!(
                header(&res, name).as_deref(),
                Some(*value),
                "{dialect} {name}"
            );
        }
        if dialect == "x-ratelimit" {
            let reset: u64 = header(&res, "x-ratelimit-reset").unwrap().parse().unwrap();
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            assert!(reset >= now + 58 && reset <= now + 61, "{reset} {now}");
        }
        if dialect == "none" {
            assert!(res
                .headers()
                .keys()
                .all(|k| !k.as_str().contains("ratelimit")));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_keys_read_forms_and_json_as_axum_does_and_hand_them_on() {
    let redis = RedisServer::start();
    let f = filter(
        &redis,
        "[[rule]]\nname = \"sms\"\npaths = [\"/echo\"]\nkey = \"body:phone\"\nlimit = 2\nwindow = \"1h\"\ndeny = \"status\"\n",
    );
    let base = serve(app(f.clone())).await;
    let client = client();
    let form = |phone: &str| {
        client
            .post(format!("{base}/echo"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("phone={phone}"))
            .send()
    };
    let res = form("555").await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.json::<Value>().await.unwrap(), json!({"phone": "555"}));
    let res = client
        .post(format!("{base}/echo"))
        .header("content-type", "application/json")
        .body(r#"{"phone":"555"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.json::<Value>().await.unwrap(), json!({"phone": "555"}));
    // The form and the JSON API share one counter per phone.
    assert_eq!(form("555").await.unwrap().status(), 429);
    assert_eq!(form("556").await.unwrap().status(), 200);
    let seen = f.operate("sms", &["555"], Action::Inspect).await.unwrap();
    assert_eq!(seen.used, 2);
    // text/json is no body axum's Json reads: keyed by address, not phone.
    let res = client
        .post(format!("{base}/echo"))
        .header("content-type", "text/json")
        .body(r#"{"phone":"555"}"#)
        .send()
        .await
        .unwrap();
    assert_ne!(res.status(), 429);
    // A body past max_form: 413; broken JSON: 400, before the handler.
    let big = format!("phone={}", "9".repeat(20 * 1024));
    assert_eq!(form(&big[6..]).await.unwrap().status(), 413);
    let res = client
        .post(format!("{base}/echo"))
        .header("content-type", "application/json")
        .body(r#"{"phone":"1","phone":"2"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 400);
    // axum's `Form` reads a GET's query string but a HEAD's body, and
    // `Json` a JSON body whatever the method: the keys read the same.
    let sent = |method: reqwest::Method, query: &str, kind: &str, body: &str| {
        client
            .request(method, format!("{base}/echo?phone={query}"))
            .header("content-type", kind)
            .body(body.to_string())
            .send()
    };
    let form_kind = "application/x-www-form-urlencoded";
    sent(reqwest::Method::GET, "q1", form_kind, "phone=b1")
        .await
        .unwrap();
    sent(reqwest::Method::HEAD, "q2", form_kind, "phone=b2")
        .await
        .unwrap();
    sent(
        reqwest::Method::GET,
        "q3",
        "application/json",
        r#"{"phone":"b3"}"#,
    )
    .await
    .unwrap();
    for (phone, used) in [
        ("q1", 1),
        ("b1", 0),
        ("q2", 0),
        ("b2", 1),
        ("q3", 0),
        ("b3", 1),
    ] {
        let seen = f.operate("sms", &[phone], Action::Inspect).await.unwrap();
        assert_eq!(seen.used, used, "{phone}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_trusted_proxy_the_forwarded_client_is_keyed() {
    let redis = RedisServer::start();
    let toml = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1/32\"]\n{}",
        "[[rule]]\nname = \"check\"\npaths = [\"/check\"]\nlimit = 1\nwindow = \"1h\"\ndeny = \"status\"\n"
    );
    let f = filter(&redis, &toml);
    let base = serve(app(f.clone())).await;
    let from = |client_ip: &'static str| {
        let url = format!("{base}/check");
        async move {
            client()
                .get(url)
                .header("x-forwarded-for", format!("198.51.100.1, {client_ip}"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(from("203.0.113.7").await, 200);
    assert_eq!(from("203.0.113.7").await, 429);
    assert_eq!(from("203.0.113.8").await, 200);
    let seen = f.operate("check", &["203.0.113.7"], Action::Inspect).await;
    assert_eq!(seen.unwrap().used, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_each_rule_applies_its_policy() {
    let mut redis = RedisServer::start();
    // (filter() opens the [redis] table: its timeout follows there.)
    let f = filter(
        &redis,
        r#"timeout = "100ms"

[[rule]]
name = "open"
paths = ["/free"]
limit = 1
window = "1h"
on_redis_error = "allow"

[[rule]]
name = "shut"
paths = ["/check"]
limit = 1
window = "1h"
on_redis_error = "deny"
"#,
    );
    let base = serve(app(f)).await;
    redis.stop();
    let res = get_json(&base, "/free").await;
    assert_eq!(res.status(), 200);
    assert!(header(&res, "ratelimit").is_none());
    let res = get_json(&base, "/check").await;
    assert_eq!(res.status(), 503);
    assert_eq!(header(&res, "retry-after").unwrap(), "1");
    assert_eq!(header(&res, "cache-control").unwrap(), "no-store");
    // JSON as the filter's other refusals, or a page for a browser.
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["error"], "unavailable", "{v}");
    let res = get_with(&base, "/check", &[("accept", BROWSER)]).await;
    assert_eq!(res.status(), 503);
    assert!(header(&res, "content-type")
        .unwrap()
        .starts_with("text/html"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn successes_give_back_under_count_failures_and_handlers_read_the_decision() {
    let redis = RedisServer::start();
    let toml = format!(
        "{CHECK}\n[[rule]]\nname = \"login\"\npaths = [\"/login\"]\nlimit = 3\nwindow = \"1h\"\ncount = \"failures\"\ndeny = \"status\"\n"
    );
    let base = serve(app(filter(&redis, &toml))).await;
    let status = |path: &'static str| {
        let url = format!("{base}{path}");
        async move { client().get(url).send().await.unwrap().status().as_u16() }
    };
    for _ in 0..5 {
        assert_eq!(status("/login?ok=1").await, 200);
    }
    let mut failures = 0;
    for _ in 0..5 {
        if status("/login").await == 401 {
            failures += 1;
        }
    }
    assert_eq!(failures, 3);
    // The handler reads what was decided for its request.
    let res = get_json(&base, "/usage").await;
    assert_eq!(res.json::<Value>().await.unwrap(), json!({"remaining": 2}));
}

#[actix_web::test]
async fn an_actix_app_and_an_axum_app_share_every_counter() {
    use actix_web::{test, web, App, HttpResponse};
    let redis = RedisServer::start();
    let f = filter(&redis, CHECK);
    // The axum app runs on a runtime of its own thread.
    let axum_filter = f.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            tx.send(serve(app(axum_filter)).await).unwrap();
            std::future::pending::<()>().await;
        });
    });
    let base = rx.recv().unwrap();
    let actix = test::init_service(App::new().wrap(filter(&redis, CHECK)).route(
        "/check",
        web::get().to(|| async { HttpResponse::Ok().body("ok") }),
    ))
    .await;
    let from_actix = || async {
        let req = test::TestRequest::get()
            .uri("/check")
            .peer_addr("127.0.0.1:50000".parse().unwrap())
            .to_request();
        test::call_service(&actix, req).await.status().as_u16()
    };
    let from_axum = || {
        let url = format!("{base}/check");
        async move { reqwest::get(url).await.unwrap().status().as_u16() }
    };
    assert_eq!(from_actix().await, 200);
    assert_eq!(from_axum().await, 200);
    assert_eq!(from_actix().await, 200);
    assert_eq!(from_axum().await, 429);
    assert_eq!(from_actix().await, 429);
}

/// The application's own functions (a session lookup, a key function, an
/// awaited lookup choosing the caller's quota, a skip predicate, a denial
/// responder) see the request under the tower door as under actix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_applications_own_functions_key_skip_and_answer() {
    use floodgate_limiter::rule::Identity;
    use floodgate_limiter::{Key, Limit, RequestHead};

    let redis = RedisServer::start();
    let filter = Filter::builder()
        .redis_url(&redis.url())
        .session_lookup(|req: &RequestHead| req.cookie("sid").map(str::to_owned))
        .denial_responder(|denial, req| {
            let body = json!({ "slow_down": denial.rule.name(), "path": req.path() });
            floodgate_limiter::http::Response::builder()
                .status(429)
                .header("content-type", "application/json")
                .body(body.to_string())
                .unwrap()
        })
        .rule(
            "/check",
            Limit::per_minute(1).key(Key::session()).name("acct"),
        )
        .rule(
            "/free",
            Limit::per_minute(1)
                .key(Key::custom("tenant", |req: &RequestHead| {
                    req.header("x-tenant").map(str::to_owned)
                }))
                .name("tenant"),
        )
        .rule(
            "/usage",
            Limit::per_minute(1)
                .key(Key::lookup("api-key", |req: RequestHead| async move {
                    let token = req.header("x-api-key")?.to_owned();
                    tokio::task::yield_now().await;
                    Some(Identity::new(token).with_limit(2))
                }))
                .name("api"),
        )
        .rule(
            "/login",
            Limit::per_minute(1)
                .skip_if(|req: &RequestHead| req.headers().contains_key("x-internal"))
                .name("skip"),
        )
        .build()
        .unwrap();
    let base = serve(app(filter)).await;
    let client = client();
    let get = |path: &str, header: (&str, &str)| {
        client
            .get(format!("{base}{path}"))
            .header(header.0, header.1)
            .send()
    };
    let status = |res: reqwest::Response| res.status().as_u16();

    // One session, one count; another session, its own.
    assert_eq!(
        status(get("/check", ("cookie", "sid=a")).await.unwrap()),
        200
    );
    let denied = get("/check", ("cookie", "x=1; sid=a")).await.unwrap();
    assert_eq!(status_of(&denied), 429);
    assert!(header(&denied, "retry-after").is_some());
    assert_eq!(
        denied.json::<Value>().await.unwrap(),
        json!({ "slow_down": "acct", "path": "/check" })
    );
    assert_eq!(
        status(get("/check", ("cookie", "sid=b")).await.unwrap()),
        200
    );

    // A key function's value.
    assert_eq!(status(get("/free", ("x-tenant", "t1")).await.unwrap()), 200);
    assert_eq!(status(get("/free", ("x-tenant", "t1")).await.unwrap()), 429);
    assert_eq!(status(get("/free", ("x-tenant", "t2")).await.unwrap()), 200);

    // An awaited lookup's identity and quota (2, not the limit's 1).
    for expected in [200, 200, 429] {
        assert_eq!(
            status(get("/usage", ("x-api-key", "k-1")).await.unwrap()),
            expected
        );
    }
    assert!(!redis.keys("floodgate:api:custom:api-key=k-1").is_empty());

    // The skip predicate: neither counted nor denied.
    for _ in 0..3 {
        let res = get("/login?ok=1", ("x-internal", "1")).await.unwrap();
        assert_eq!(status(res), 200);
    }
    assert_eq!(
        status(get("/login?ok=1", ("x-other", "1")).await.unwrap()),
        200
    );
    assert_eq!(
        status(get("/login?ok=1", ("x-other", "1")).await.unwrap()),
        429
    );
}

fn status_of(res: &reqwest::Response) -> u16 {
    res.status().as_u16()
}

// ---------------------------------------------------------------------------
// What a denied or refused request gets, by its Accept; CORS
// ---------------------------------------------------------------------------

/// The Accept a browser sends with a page request.
const BROWSER: &str = "text/html,application/xhtml+xml,*/*;q=0.8";

/// `GET base path` with these header fields.
async fn get_with(base: &str, path: &str, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut req = client().get(format!("{base}{path}"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_is_json_unless_the_client_asks_for_html() {
    let redis = RedisServer::start();
    let toml = "[[rule]]\nname = \"check\"\npaths = [\"/check\"]\ndeny = \"status\"\nlimit = 1\nwindow = \"1m\"\n\
                [[rule]]\nname = \"page\"\npaths = [\"/free\"]\ndeny = \"redirect\"\nerror_page = \"/err\"\nlimit = 1\nwindow = \"1m\"\n";
    let base = serve(app(filter(&redis, toml))).await;
    assert_eq!(get_with(&base, "/check", &[]).await.status(), 200);
    // No Accept (curl), */* (fetch): the 429 JSON.
    for accept in [None, Some("*/*")] {
        let headers: Vec<_> = accept.map(|a| ("accept", a)).into_iter().collect();
        let res = get_with(&base, "/check", &headers).await;
        assert_eq!(res.status(), 429, "{accept:?}");
        let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
        assert!((1..=60).contains(&retry), "{retry}");
        assert_eq!(header(&res, "cache-control").as_deref(), Some("no-store"));
        assert_eq!(
            header(&res, "content-type").as_deref(),
            Some("application/json"),
            "{accept:?}"
        );
        let body: Value = res.json().await.unwrap();
        assert_eq!(
            body,
            json!({"error": "rate_limited", "rule": "check", "retry_after": retry})
        );
    }
    // A browser: the HTML page.
    let res = get_with(&base, "/check", &[("accept", BROWSER)]).await;
    assert_eq!(res.status(), 429);
    assert!(header(&res, "retry-after").is_some());
    assert_eq!(header(&res, "cache-control").as_deref(), Some("no-store"));
    assert!(header(&res, "content-type")
        .unwrap()
        .starts_with("text/html"));
    let page = res.text().await.unwrap();
    assert!(page.to_lowercase().contains("<html"), "{page}");

    // A redirect rule: JSON for a client that asks for JSON only, else 303.
    assert_eq!(get_with(&base, "/free", &[]).await.status(), 200);
    let res = get_with(&base, "/free", &[("accept", "application/json")]).await;
    assert_eq!(res.status(), 429);
    let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    let body: Value = res.json().await.unwrap();
    assert_eq!(
        body,
        json!({"error": "rate_limited", "rule": "page", "retry_after": retry})
    );
    let res = get_with(&base, "/free", &[("accept", BROWSER)]).await;
    assert_eq!(res.status(), 303);
    let retry = header(&res, "retry-after").unwrap();
    assert_eq!(
        header(&res, "location"),
        Some(format!("/err?rule=page&retry_after={retry}"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_is_json_unless_the_client_asks_for_html() {
    let redis = RedisServer::start();
    let toml = "[server]\nmax_form = \"1KiB\"\n[[rule]]\nname = \"sms\"\npaths = [\"/echo\"]\nkey = \"body:phone\"\nlimit = 5\nwindow = \"1h\"\ndeny = \"status\"\n";
    let base = serve(app(filter(&redis, toml))).await;
    let post = |content_type: &'static str, body: String, accept: Option<&'static str>| {
        let mut req = client()
            .post(format!("{base}/echo"))
            .header("content-type", content_type)
            .body(body);
        if let Some(a) = accept {
            req = req.header("accept", a);
        }
        req.send()
    };
    let form = "application/x-www-form-urlencoded";
    let big = || format!("phone=1&pad={}", "a".repeat(2000));
    // 413, 400 (a key member twice: the rule's key is at fault), 415 (a
    // type both `Form` and `Json` take: the handler may read either).
    let cases: [(&str, String, u16, &str, Option<&str>); 3] = [
        (form, big(), 413, "body_too_large", None),
        (
            "application/x-www-form-urlencoded+json",
            r#"{"phone":"1","x":"&phone=2&y="}"#.into(),
            415,
            "unsupported_media_type",
            None,
        ),
        (
            "application/json",
            r#"{"phone":"1","phone":"2"}"#.into(),
            400,
            "bad_request",
            Some("sms"),
        ),
    ];
    for (ct, body, status, error, rule) in cases {
        for accept in [None, Some("*/*")] {
            let res = post(ct, body.clone(), accept).await.unwrap();
            assert_eq!(res.status(), status, "{error} {accept:?}");
            assert_eq!(
                header(&res, "content-type").as_deref(),
                Some("application/json")
            );
            assert_eq!(header(&res, "cache-control").as_deref(), Some("no-store"));
            let v: Value = res.json().await.unwrap();
            assert_eq!(v["error"], error, "{v}");
            assert_eq!(v["rule"], json!(rule), "{v}");
            assert!(!v["detail"].as_str().unwrap().is_empty(), "{v}");
        }
        let res = post(ct, body, Some(BROWSER)).await.unwrap();
        assert_eq!(res.status(), status, "{error}: a browser");
        assert!(header(&res, "content-type")
            .unwrap()
            .starts_with("text/html"));
        let page = res.text().await.unwrap();
        assert!(page.contains("<html"), "{page}");
        assert!(page.contains(&status.to_string()), "{page}");
    }
    // Nothing was counted.
    assert_eq!(redis.keys("floodgate:*"), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_body_is_read_whatever_its_charset_says_and_a_coded_one_refused() {
    // axum's `Json` reads the bytes as they come: a charset label changes
    // nothing, so the filter reads the same value. A body in a content
    // coding is refused (415): a decompression layer inside the filter
    // would hand the handler other bytes than the filter read.
    let redis = RedisServer::start();
    let toml = "[[rule]]\nname = \"sms\"\npaths = [\"/echo\"]\nkey = \"body:phone\"\nlimit = 5\nwindow = \"1h\"\ndeny = \"status\"\n";
    let base = serve(app(filter(&redis, toml))).await;
    for (i, (ct, coding)) in [
        ("application/json; charset=latin1", None),
        ("application/json; charset=utf-16", None),
        ("application/json", Some("identity")),
    ]
    .into_iter()
    .enumerate()
    {
        let mut req = client()
            .post(format!("{base}/echo"))
            .header("content-type", ct)
            .body(format!(r#"{{"phone":"7{i}"}}"#));
        if let Some(c) = coding {
            req = req.header("content-encoding", c);
        }
        let res = req.send().await.unwrap();
        assert_eq!(res.status(), 200, "{ct} {coding:?}");
        assert_eq!(res.text().await.unwrap(), format!(r#"{{"phone":"7{i}"}}"#));
        assert_eq!(redis.llen(&format!("floodgate:sms:body:7{i}")), 1, "{ct}");
    }
    let res = client()
        .post(format!("{base}/echo"))
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(r#"{"phone":"79"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 415);
    assert_eq!(redis.llen("floodgate:sms:body:79"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_rule_guards_head_which_axum_answers_with_the_get_handler() {
    let redis = RedisServer::start();
    let toml = "[[rule]]\nname = \"page\"\npaths = [\"/check\"]\nmethods = [\"GET\"]\nlimit = 2\nwindow = \"1h\"\ndeny = \"status\"\n";
    let router = Router::new()
        .route("/check", get(|| async { "ok" }))
        .layer(filter(&redis, toml));
    let base = serve(router).await;
    let head = || client().head(format!("{base}/check")).send();
    assert_eq!(head().await.unwrap().status(), 200);
    assert_eq!(head().await.unwrap().status(), 200);
    assert_eq!(head().await.unwrap().status(), 429);
    assert_eq!(get_with(&base, "/check", &[]).await.status(), 429);
    // Another method is not the rule's.
    let res = client().post(format!("{base}/check")).send().await.unwrap();
    assert_eq!(res.status(), 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cors_preflight_is_never_counted_nor_denied() {
    let redis = RedisServer::start();
    let toml = "[[rule]]\nname = \"one\"\npaths = [\"/any\"]\nlimit = 1\nwindow = \"1m\"\ndeny = \"status\"\n";
    let router = Router::new()
        .route("/any", axum::routing::any(|| async { "ok" }))
        .layer(filter(&redis, toml));
    let base = serve(router).await;
    for _ in 0..3 {
        let res = client()
            .request(reqwest::Method::OPTIONS, format!("{base}/any"))
            .header("origin", "https://app.example")
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "content-type")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(header(&res, "ratelimit"), None);
    }
    assert_eq!(redis.keys("floodgate:*"), Vec::<String>::new());
    let res = get_with(&base, "/any", &[]).await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        header(&res, "ratelimit").as_deref(),
        Some("\"one\";r=0;t=60")
    );
    // A plain OPTIONS is a request like any other.
    let res = client()
        .request(reqwest::Method::OPTIONS, format!("{base}/any"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 429);
}

/// The names in `Access-Control-Expose-Headers`, lower case and sorted.
fn exposed(res: &reqwest::Response) -> Option<Vec<String>> {
    header(res, "access-control-expose-headers").map(|v| {
        let mut names: Vec<String> = v.split(',').map(|n| n.trim().to_lowercase()).collect();
        names.sort();
        names
    })
}

/// The rate-limit fields a response carries, sorted.
fn rate_limit_fields(res: &reqwest::Response) -> Vec<String> {
    let mut names: Vec<String> = res
        .headers()
        .keys()
        .map(|n| n.as_str().to_string())
        .filter(|n| {
            n.starts_with("ratelimit") || n.starts_with("x-ratelimit") || n == "retry-after"
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_of_other_origins_are_let_read_the_rate_limit_fields() {
    let redis = RedisServer::start();
    let toml = "[defaults]\ndeny = \"status\"\n\
                [[rule]]\nname = \"std\"\npaths = [\"/check\"]\nlimit = 2\nwindow = \"1m\"\n\
                [[rule]]\nname = \"x\"\npaths = [\"/check\"]\nlimit = 5\nwindow = \"1m\"\nheaders = \"x-ratelimit\"\n";
    let base = serve(app(filter(&redis, toml))).await;
    let origin = ("origin", "https://app.example");
    let res = get_with(&base, "/check", &[origin]).await;
    assert_eq!(res.status(), 200);
    let names = exposed(&res).expect("Access-Control-Expose-Headers");
    assert_eq!(
        names,
        [
            "ratelimit",
            "ratelimit-policy",
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset"
        ]
    );
    assert_eq!(names, rate_limit_fields(&res));
    // Without an Origin: nothing to expose.
    let res = get_with(&base, "/check", &[]).await;
    assert_eq!(res.status(), 200);
    assert!(header(&res, "ratelimit").is_some());
    assert_eq!(exposed(&res), None);
    // A denial: Retry-After too.
    let res = get_with(&base, "/check", &[origin]).await;
    assert_eq!(res.status(), 429);
    let names = exposed(&res).expect("Access-Control-Expose-Headers");
    assert!(names.contains(&"retry-after".to_string()), "{names:?}");
    assert_eq!(names, rate_limit_fields(&res));
}

/// A banned identity's 429 says so under the tower door too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_banned_identitys_denial_says_banned() {
    let redis = RedisServer::start();
    let filter = filter(&redis, CHECK);
    filter
        .operate(
            "check",
            &["127.0.0.1"],
            Action::Ban(Duration::from_secs(600)),
        )
        .await
        .unwrap();
    let base = serve(app(filter)).await;
    let res = client().get(format!("{base}/check")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"], "banned", "{body}");
}

/// Any body type goes through the layer, as tonic's and hyper's services
/// take any `http_body::Body`: a plain tower service of a boxed body (no
/// `From<Bytes>`), called directly with the peer as a `SocketAddr`
/// extension, is limited by a body key, and gets the body it was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_of_any_body_type_sits_behind_the_layer() {
    use bytes::Bytes;
    use floodgate_limiter::tower::GuardedRequestBody;
    use http_body_util::combinators::BoxBody;
    use http_body_util::{BodyExt, Full};
    use std::convert::Infallible;
    use tower::{Layer, ServiceExt};

    let redis = RedisServer::start();
    let filter = filter(
        &redis,
        "[[rule]]\nname = \"p\"\npaths = [\"/p\"]\nkey = \"form:phone\"\nlimit = 2\nwindow = \"1m\"\ndeny = \"status\"\n",
    );
    type In = axum::http::Request<GuardedRequestBody<BoxBody<Bytes, Infallible>>>;
    let echo = tower::service_fn(|req: In| async move {
        let sent = req.into_body().collect().await.unwrap().to_bytes();
        Ok::<_, Infallible>(axum::http::Response::new(Full::new(sent)))
    });
    let svc = filter.layer(echo);
    let send = |phone: &str| {
        let req = axum::http::Request::builder()
            .method("POST")
            .uri("/p")
            .header("content-type", "application/x-www-form-urlencoded")
            .extension(SocketAddr::from(([127, 0, 0, 1], 4000)))
            .body(BoxBody::new(Full::new(Bytes::from(format!(
                "phone={phone}"
            )))))
            .unwrap();
        svc.clone().oneshot(req)
    };
    for _ in 0..2 {
        let res = send("555").await.unwrap();
        assert_eq!(res.status(), 200);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"phone=555");
    }
    assert_eq!(send("555").await.unwrap().status(), 429);
    assert_eq!(send("556").await.unwrap().status(), 200);
    // A body in a content coding is refused (a decompression layer inside
    // would give the handler other bytes than the filter read).
    let coded = axum::http::Request::builder()
        .method("POST")
        .uri("/p")
        .header("content-type", "application/x-www-form-urlencoded")
        .header("content-encoding", "gzip")
        .extension(SocketAddr::from(([127, 0, 0, 1], 4000)))
        .body(BoxBody::new(Full::new(Bytes::from_static(b"\x1f\x8b"))))
        .unwrap();
    assert_eq!(svc.clone().oneshot(coded).await.unwrap().status(), 415);
}
