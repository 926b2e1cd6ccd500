//! What a request gets from the filter:
//! RateLimit fields, the three kinds of denial, the error page, rules before
//! routing, form keys (normalized, body handed on byte for byte, 413 when too
//! large, client address when not a form), the client address behind
//! trusted proxies, and the operational endpoints.

use std::path::Path;

use floodgate_site::config::Config;

use crate::helpers::{header, metric, remaining, spawn_app, TestApp};

/// `GET path` with the given headers.
async fn get_with(app: &TestApp, path: &str, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut req = app.client.get(app.url(path));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap()
}

// ---------------------------------------------------------------------------
// Allowed: RateLimit fields
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn allowed_responses_list_every_matching_enforce_rule() {
    let app = spawn_app(
        r#"
[[rule]]
name = "a"
paths = ["/check"]
limit = 5
window = "10s"

[[rule]]
name = "b"
paths = ["/check", "/api/*"]
algorithm = "token_bucket"
rate = 2.0
burst = 4

[[rule]]
name = "hush"
paths = ["/check"]
limit = 1
window = "10s"
mode = "shadow"

[[rule]]
name = "elsewhere"
paths = ["/nowhere"]
limit = 1
window = "1m"
"#,
    )
    .await;
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        header(&res, "ratelimit-policy").as_deref(),
        Some("\"a\";q=5;w=10, \"b\";q=4;w=2")
    );
    assert_eq!(
        header(&res, "ratelimit").as_deref(),
        Some("\"a\";r=4;t=10, \"b\";r=3;t=1")
    );
    // The shadow rule is over its limit now; still not listed, still no denial.
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    let field = header(&res, "ratelimit").unwrap();
    let items: Vec<&str> = field.split(", ").collect();
    assert_eq!(items.len(), 2, "{field}");
    assert!(items[0].starts_with("\"a\";r=3;t="), "{field}");
    assert!(items[1].starts_with("\"b\";r=2;t="), "{field}");
    for item in items {
        let t: u64 = item.rsplit("t=").next().unwrap().parse().unwrap();
        assert!((1..=10).contains(&t), "{field}");
    }
    // One rule only on /api/ping; none at all on an unguarded path.
    let res = app.get("/api/ping").await;
    assert_eq!(
        header(&res, "ratelimit-policy").as_deref(),
        Some("\"b\";q=4;w=2")
    );
    let res = app.get("/healthz").await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "ratelimit-policy"), None);
    assert_eq!(header(&res, "ratelimit"), None);
}

// ---------------------------------------------------------------------------
// Denied: redirect, JSON, HTML
// ---------------------------------------------------------------------------

const DENIALS: &str = r#"
[[rule]]
name = "check"
paths = ["/check"]
limit = 1
window = "10s"

[[rule]]
name = "custom"
paths = ["/"]
limit = 1
window = "10s"
error_page = "/sorry"

[[rule]]
name = "quokka"
paths = ["/api/*"]
limit = 1
window = "10s"
deny = "status"
"#;

fn retry_after(res: &reqwest::Response) -> u64 {
    let n: u64 = header(res, "retry-after").unwrap().parse().unwrap();
    assert!((1..=10).contains(&n), "Retry-After: {n}");
    n
}

#[actix_web::test]
async fn redirect_rules_send_browsers_to_the_error_page() {
    let app = spawn_app(DENIALS).await;
    assert_eq!(app.get("/check").await.status(), 200);
    let browser = "text/html,application/xhtml+xml,application/json;q=0.9,*/*;q=0.8";
    for accept in [None, Some(browser), Some("text/html")] {
        let headers: Vec<(&str, &str)> = accept.map(|a| ("accept", a)).into_iter().collect();
        let res = get_with(&app, "/check", &headers).await;
        assert_eq!(res.status(), 303, "Accept: {accept:?}");
        let n = retry_after(&res);
        assert_eq!(
            header(&res, "location"),
            Some(format!("/err?rule=check&retry_after={n}"))
        );
        assert_eq!(header(&res, "cache-control").as_deref(), Some("no-store"));
    }
    // The rule's own error page.
    assert_eq!(app.get("/").await.status(), 200);
    let res = app.get("/").await;
    assert_eq!(res.status(), 303);
    let n = retry_after(&res);
    assert_eq!(
        header(&res, "location"),
        Some(format!("/sorry?rule=custom&retry_after={n}"))
    );
}

#[actix_web::test]
async fn json_clients_get_429_json_even_from_redirect_rules() {
    let app = spawn_app(DENIALS).await;
    for path in ["/check", "/api/ping"] {
        assert_eq!(app.get(path).await.status(), 200);
        for accept in ["application/json", "application/json; charset=utf-8"] {
            let res = get_with(&app, path, &[("accept", accept)]).await;
            assert_eq!(res.status(), 429, "{path} {accept}");
            let n = retry_after(&res);
            assert_eq!(
                header(&res, "content-type").as_deref(),
                Some("application/json")
            );
            assert_eq!(header(&res, "cache-control").as_deref(), Some("no-store"));
            let rule = if path == "/check" { "check" } else { "quokka" };
            assert_eq!(
                res.text().await.unwrap(),
                format!("{{\"error\":\"rate_limited\",\"rule\":\"{rule}\",\"retry_after\":{n}}}")
            );
        }
    }
}

#[actix_web::test]
async fn status_rules_show_browsers_the_html_page() {
    let app = spawn_app(DENIALS).await;
    assert_eq!(app.get("/api/ping").await.status(), 200);
    let browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8";
    for accept in ["text/html", browser] {
        let res = get_with(&app, "/api/ping", &[("accept", accept)]).await;
        assert_eq!(res.status(), 429, "Accept: {accept}");
        retry_after(&res);
        assert_eq!(header(&res, "cache-control").as_deref(), Some("no-store"));
        let ct = header(&res, "content-type").unwrap();
        assert!(ct.starts_with("text/html"), "{ct}");
        let body = res.text().await.unwrap();
        assert!(body.to_lowercase().contains("<html"), "{body}");
        assert!(body.contains("quokka"), "the page names the rule: {body}");
    }
}

#[actix_web::test]
async fn status_rules_answer_clients_that_ask_for_no_html_with_json() {
    let app = spawn_app(DENIALS).await;
    assert_eq!(app.get("/api/ping").await.status(), 200);
    // curl sends */*, a script's fetch */* or nothing.
    for accept in [None, Some("*/*"), Some("text/plain, */*")] {
        let headers: Vec<(&str, &str)> = accept.map(|a| ("accept", a)).into_iter().collect();
        let res = get_with(&app, "/api/ping", &headers).await;
        assert_eq!(res.status(), 429, "Accept: {accept:?}");
        let n = retry_after(&res);
        assert_eq!(header(&res, "cache-control").as_deref(), Some("no-store"));
        assert_eq!(
            header(&res, "content-type").as_deref(),
            Some("application/json"),
            "Accept: {accept:?}"
        );
        assert_eq!(
            res.text().await.unwrap(),
            format!("{{\"error\":\"rate_limited\",\"rule\":\"quokka\",\"retry_after\":{n}}}")
        );
    }
}

/// How often `n` appears in `text` as a whole number.
fn count_number(text: &str, n: u64) -> usize {
    let digits = n.to_string();
    text.match_indices(&digits)
        .filter(|(i, _)| {
            let before = text[..*i].chars().next_back();
            let after = text[i + digits.len()..].chars().next();
            !before.is_some_and(|c| c.is_ascii_digit())
                && !after.is_some_and(|c| c.is_ascii_digit())
        })
        .count()
}

#[actix_web::test]
async fn error_page_names_only_configured_rules() {
    // A distinctive rule name, so that finding it proves the page names it.
    let app = spawn_app(
        r#"
[[rule]]
name = "zebra_rule"
paths = ["/check"]
limit = 5
window = "10s"
"#,
    )
    .await;
    let page = |query: &'static str| {
        let req = app.client.get(app.url(&format!("/err?{query}"))).send();
        async move {
            let res = req.await.unwrap();
            assert_eq!(res.status(), 200, "{query}");
            let ct = header(&res, "content-type").unwrap();
            assert!(ct.starts_with("text/html"), "{ct}");
            res.text().await.unwrap()
        }
    };
    let seven = page("rule=zebra_rule&retry_after=7").await;
    let eight = page("rule=zebra_rule&retry_after=8").await;
    assert!(seven.contains("zebra_rule"), "{seven}");
    // The page shows its N: more 7s with retry_after=7 than with 8, and vice versa.
    assert!(count_number(&seven, 7) > count_number(&eight, 7), "{seven}");
    assert!(count_number(&eight, 8) > count_number(&seven, 8), "{eight}");

    let unknown = page("rule=giraffe_rule&retry_after=7").await;
    assert!(!unknown.contains("giraffe_rule"), "{unknown}");
    let hostile = page("rule=%3Cscript%3Ealert(1)%3C%2Fscript%3E&retry_after=7").await;
    assert!(!hostile.contains("alert(1)"), "{hostile}");
    assert!(!hostile.contains("<script>alert"), "{hostile}");
}

#[actix_web::test]
async fn replaced_rules_apply_to_the_next_request() {
    let app = spawn_app(DENIALS).await;
    assert_eq!(app.get_json("/api/ping").await.status(), 200);
    assert_eq!(app.get_json("/api/ping").await.status(), 429);
    // What SIGHUP does: the same rule with a larger limit, in force at once.
    let wider = DENIALS.replace(
        "limit = 1\nwindow = \"10s\"\ndeny",
        "limit = 3\nwindow = \"10s\"\ndeny",
    );
    let config = Config::parse(&wider, Path::new("wider.toml")).unwrap();
    app.filter.replace_rules(config.filter.rules);
    let res = app.get_json("/api/ping").await;
    assert_eq!(res.status(), 200);
    assert_eq!(remaining(&res, "quokka"), Some(1));
    assert_eq!(app.filter.rules().len(), 3);
}

/// A reload that changes a rule's algorithm but keeps its name meets the
/// old algorithm's key: the key is started afresh, not a failed batch (which
/// would apply the Redis error policy to every request for a whole window).
#[actix_web::test]
async fn a_reload_that_changes_the_algorithm_starts_the_key_afresh() {
    const SLIDING: &str = r#"
[[rule]]
name = "morph"
paths = ["/check"]
limit = 5
window = "1m"
deny = "status"
on_redis_error = "deny"
"#;
    let app = spawn_app(SLIDING).await;
    for _ in 0..3 {
        assert_eq!(app.get("/check").await.status(), 200);
    }
    let key = "floodgate:morph:ip:127.0.0.1";
    assert_eq!(app.redis.llen(key), 3);
    for algorithm in ["fixed_window", "token_bucket", "sliding_window"] {
        let text = if algorithm == "token_bucket" {
            SLIDING.replace(
                "limit = 5\nwindow = \"1m\"",
                "algorithm = \"token_bucket\"\nrate = 1.0\nburst = 5",
            )
        } else {
            SLIDING.replace(
                "limit = 5",
                &format!("algorithm = \"{algorithm}\"\nlimit = 5"),
            )
        };
        let config = Config::parse(&text, Path::new("morph.toml")).unwrap();
        app.filter.replace_rules(config.filter.rules);
        let res = app.get("/check").await;
        assert_eq!(res.status(), 200, "after switching to {algorithm}");
        assert_eq!(
            remaining(&res, "morph"),
            Some(4),
            "{algorithm} starts afresh"
        );
    }
    let metrics = app.metrics().await;
    assert!(!metrics.contains("error_denied"), "{metrics}");
}

// ---------------------------------------------------------------------------
// Rules before routing
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn rules_guard_paths_without_a_handler() {
    let app = spawn_app(
        r#"
[[rule]]
name = "ghost"
paths = ["/nothing-here/*"]
limit = 1
window = "10s"
deny = "status"
"#,
    )
    .await;
    let res = app.get("/nothing-here/at/all").await;
    assert_eq!(res.status(), 404);
    assert_eq!(remaining(&res, "ghost"), Some(0));
    let res = app.get("/nothing-here/else").await;
    assert_eq!(res.status(), 429);
    assert_eq!(app.redis.llen("floodgate:ghost:ip:127.0.0.1"), 1);
}

// ---------------------------------------------------------------------------
// Form keys
// ---------------------------------------------------------------------------

const FORM: &str = r#"
[server]
max_form = "1KiB"

[[rule]]
name = "sms"
paths = ["/echo"]
methods = ["POST"]
key = "form:phone"
normalize = "digits"
limit = 2
window = "1m"
deny = "status"
"#;

#[actix_web::test]
async fn form_keys_are_normalized_and_the_body_is_handed_on_intact() {
    let app = spawn_app(FORM).await;
    let first: &[u8] =
        b"phone=%2B1+%28555%29+010-9999&note=caf%C3%A9+%26+more&odd=%FF%00%zz&empty=&=&&x";
    let second: &[u8] = b"x=1&phone=15550109999";
    for (body, left) in [(first, 1), (second, 0)] {
        let res = app.post_form(body).await;
        assert_eq!(res.status(), 200);
        assert_eq!(remaining(&res, "sms"), Some(left));
        assert_eq!(res.bytes().await.unwrap().as_ref(), body);
    }
    let res = app.post_form(b"phone=1-555-010-9999").await;
    assert_eq!(res.status(), 429);
    assert_eq!(app.redis.llen("floodgate:sms:form:15550109999"), 2);
    // Another number has its own count.
    let res = app.post_form(b"phone=%2B44+20+7946+0000").await;
    assert_eq!(res.status(), 200);
    assert_eq!(app.redis.llen("floodgate:sms:form:442079460000"), 1);
}

#[actix_web::test]
async fn forms_without_the_field_and_other_bodies_are_keyed_by_address() {
    let app = spawn_app(FORM).await;
    let ip_key = "floodgate:sms:ip:127.0.0.1";
    let res = app.post_form(b"name=x&phone=").await;
    assert_eq!(res.status(), 200);
    assert_eq!(app.redis.llen(ip_key), 1);
    let json = br#"{"phone":"15550109999"}"#;
    let res = app
        .client
        .post(app.url("/echo"))
        .header("content-type", "application/json")
        .body(&json[..])
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.bytes().await.unwrap().as_ref(), json);
    assert_eq!(app.redis.llen(ip_key), 2);
    assert_eq!(app.redis.keys("floodgate:sms:form:*"), Vec::<String>::new());
    // The address is spent: the form key still has its own quota.
    let res = app.post_form(b"phone=15550109999").await;
    assert_eq!(res.status(), 200);
    let res = app.post_form(b"x=y").await;
    assert_eq!(res.status(), 429);
}

#[actix_web::test]
async fn oversized_forms_get_413() {
    let app = spawn_app(FORM).await;
    let body = format!("phone=15550109999&pad={}", "a".repeat(2000));
    let res = app
        .client
        .post(app.url("/echo"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 413);
    // Nothing was counted, and the limit of 1 KiB itself is accepted.
    assert_eq!(app.redis.keys("floodgate:*"), Vec::<String>::new());
    let body = format!("phone=15550109999&pad={}", "a".repeat(1024 - 22));
    assert_eq!(body.len(), 1024);
    let res = app
        .client
        .post(app.url("/echo"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.text().await.unwrap(), body);
}

// ---------------------------------------------------------------------------
// Client address
// ---------------------------------------------------------------------------

const PER_IP: &str = r#"
[[rule]]
name = "per_ip"
paths = ["/check"]
limit = 1
window = "1m"
deny = "status"
"#;

#[actix_web::test]
async fn forwarding_headers_are_ignored_without_trusted_proxies() {
    let app = spawn_app(PER_IP).await;
    let res = get_with(&app, "/check", &[("x-forwarded-for", "9.9.9.9")]).await;
    assert_eq!(res.status(), 200);
    for forged in [
        ("x-forwarded-for", "8.8.8.8"),
        ("x-forwarded-for", "1.1.1.1, 2.2.2.2"),
        ("forwarded", "for=7.7.7.7"),
    ] {
        let res = get_with(&app, "/check", &[forged]).await;
        assert_eq!(res.status(), 429, "{forged:?}");
    }
    assert_eq!(
        app.redis.keys("floodgate:*"),
        vec!["floodgate:per_ip:ip:127.0.0.1".to_string()]
    );
}

#[actix_web::test]
async fn behind_trusted_proxies_the_rightmost_untrusted_hop_is_the_client() {
    let toml = format!("[server]\ntrusted_proxies = [\"127.0.0.1\", \"10.0.0.0/8\"]\n{PER_IP}");
    let app = spawn_app(&toml).await;
    let cases: [(&str, &str, u16); 9] = [
        // The proxy appended the real client; the client's own claim is ignored.
        ("x-forwarded-for", "6.6.6.6, 5.5.5.5", 200),
        ("x-forwarded-for", "7.7.7.7, 5.5.5.5", 429),
        ("x-forwarded-for", "5.5.5.6", 200),
        // Trusted hops are skipped.
        ("x-forwarded-for", "4.4.4.4, 10.1.2.3", 200),
        ("x-forwarded-for", "4.4.4.4", 429),
        ("x-forwarded-for", "3.3.3.3, 10.0.0.9", 200),
        // IPv4-mapped IPv6 is IPv4; other IPv6 counts by its /64.
        ("x-forwarded-for", "::ffff:3.3.3.3", 429),
        ("x-forwarded-for", "2001:db8:1:2::5", 200),
        ("x-forwarded-for", "2001:db8:1:2:aaaa::1", 429),
    ];
    for (name, value, status) in cases {
        let res = get_with(&app, "/check", &[(name, value)]).await;
        assert_eq!(res.status(), status, "{name}: {value}");
    }
    // No forwarding header: the peer itself.
    assert_eq!(app.get("/check").await.status(), 200);
    let ids: Vec<String> = app
        .redis
        .keys("floodgate:per_ip:ip:*")
        .iter()
        .map(|k| k["floodgate:per_ip:ip:".len()..].to_string())
        .collect();
    assert_eq!(
        ids,
        [
            "127.0.0.1",
            "2001:db8:1:2::/64",
            "3.3.3.3",
            "4.4.4.4",
            "5.5.5.5",
            "5.5.5.6"
        ]
    );
}

// ---------------------------------------------------------------------------
// Operational endpoints
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn health_readiness_and_metrics() {
    let app = spawn_app(PER_IP).await;
    assert_eq!(app.get("/healthz").await.status(), 200);
    assert_eq!(app.get("/readyz").await.status(), 200);
    assert_eq!(app.get("/check").await.status(), 200);
    assert_eq!(app.get("/check").await.status(), 429);
    let res = app.get("/metrics").await;
    assert_eq!(res.status(), 200);
    assert!(header(&res, "content-type")
        .unwrap()
        .starts_with("text/plain"));
    let text = res.text().await.unwrap();
    let decisions = |d: &str| {
        metric(
            &text,
            &format!("floodgate_decisions_total{{rule=\"per_ip\",decision=\"{d}\"}}"),
        )
    };
    assert_eq!(decisions("allowed"), Some(1), "{text}");
    assert_eq!(decisions("denied"), Some(1), "{text}");
    assert_eq!(
        metric(&text, "floodgate_redis_errors_total"),
        Some(0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "floodgate_decision_duration_seconds_count"),
        Some(2),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "floodgate_decision_duration_seconds_bucket{le=\"+Inf\"}"
        ),
        Some(2),
        "{text}"
    );
}
