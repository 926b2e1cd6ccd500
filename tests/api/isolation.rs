//! One rule cannot hurt another, over HTTP: a rule whose check the script
//! cannot decide answers its own requests by its error policy, and the
//! other rules of the same requests are decided normally. (The bounded
//! cost of one decision and a broken check failing alone in its batch are
//! the library's own tests: floodgate/tests/isolation.rs.)

use crate::helpers::{decisions, header, metric, remaining, spawn_app};

#[actix_web::test]
async fn a_broken_rule_answers_its_own_requests_by_its_error_policy_only() {
    let app = spawn_app(
        r#"
[[rule]]
name = "broken"
paths = ["/check"]
key = "global"
limit = 5
window = "1m"
deny = "status"
on_redis_error = "deny"

[[rule]]
name = "lenient"
paths = ["/lenient"]
key = "global"
limit = 5
window = "1m"
deny = "status"
on_redis_error = "allow"

[[rule]]
name = "healthy"
paths = ["/api/ping"]
limit = 100
window = "1m"
deny = "status"
on_redis_error = "deny"
"#,
    )
    .await;
    for key in [
        "floodgate:broken:global:all",
        "floodgate:lenient:global:all",
    ] {
        redis::cmd("HSET")
            .arg(key)
            .arg("x")
            .arg("1")
            .query::<()>(&mut app.redis.connection())
            .unwrap();
    }
    // Sent together, so that they share batches.
    let paths = ["/check", "/lenient", "/api/ping"];
    let pending: Vec<_> = (0..30)
        .map(|i| {
            let path = paths[i % 3];
            (
                path,
                actix_web::rt::spawn(app.client.get(app.url(path)).send()),
            )
        })
        .collect();
    let mut healthy = Vec::new();
    for (path, p) in pending {
        let res = p.await.unwrap().unwrap();
        match path {
            "/check" => {
                assert_eq!(res.status(), 503, "{path}");
                assert_eq!(header(&res, "retry-after").as_deref(), Some("1"));
            }
            // Let through, without a decision to report.
            "/lenient" => {
                assert_eq!(res.status(), 404, "{path}");
                assert_eq!(header(&res, "ratelimit"), None);
            }
            _ => {
                assert_eq!(res.status(), 200, "{path}");
                healthy.push(remaining(&res, "healthy").expect("RateLimit field"));
            }
        }
    }
    healthy.sort_unstable();
    assert_eq!(healthy, (90..100).collect::<Vec<u64>>());
    assert_eq!(app.redis.units("floodgate:healthy:ip:127.0.0.1"), 10);
    let metrics = app.metrics().await;
    let m = |rule: &str, d: &str| decisions(&metrics, rule, d);
    assert_eq!(m("broken", "error_denied"), Some(10), "{metrics}");
    assert_eq!(m("lenient", "error_allowed"), Some(10), "{metrics}");
    assert_eq!(m("healthy", "allowed"), Some(10), "{metrics}");
    assert_eq!(
        metric(&metrics, "floodgate_redis_errors_total"),
        Some(20),
        "{metrics}"
    );
}

/// Several rules on one request: the broken one fails alone. One that
/// lets requests pass (`allow`) is left out, and Redis decides the others
/// all or nothing among themselves; one that says `deny` refuses the
/// request, and nothing is charged to the others.
#[actix_web::test]
async fn a_broken_rule_leaves_the_other_rules_of_its_requests_to_redis() {
    let app = spawn_app(
        r#"
[[rule]]
name = "lenient"
paths = ["/two"]
key = "global"
limit = 5
window = "1m"
deny = "status"
on_redis_error = "allow"

[[rule]]
name = "strict"
paths = ["/two"]
limit = 3
window = "1m"
deny = "status"
on_redis_error = "deny"

[[rule]]
name = "shut"
paths = ["/three"]
key = "global"
limit = 5
window = "1m"
deny = "status"
on_redis_error = "deny"

[[rule]]
name = "counted"
paths = ["/three"]
limit = 3
window = "1m"
deny = "status"
"#,
    )
    .await;
    for key in ["floodgate:lenient:global:all", "floodgate:shut:global:all"] {
        redis::cmd("HSET")
            .arg(key)
            .arg("x")
            .arg("1")
            .query::<()>(&mut app.redis.connection())
            .unwrap();
    }
    for left in [2, 1, 0] {
        let res = app.get("/two").await;
        assert_eq!(res.status(), 404);
        assert_eq!(remaining(&res, "strict"), Some(left));
        assert_eq!(remaining(&res, "lenient"), None);
    }
    let res = app.get("/two").await;
    assert_eq!(res.status(), 429);
    let body: serde_json::Value = res.json().await.unwrap();
    assert_eq!(body["rule"], "strict", "{body}");
    assert_eq!(app.redis.units("floodgate:strict:ip:127.0.0.1"), 3);
    let res = app.get("/three").await;
    assert_eq!(res.status(), 503);
    assert_eq!(app.redis.units("floodgate:counted:ip:127.0.0.1"), 0);
    let metrics = app.metrics().await;
    let m = |rule: &str, d: &str| decisions(&metrics, rule, d);
    assert_eq!(m("strict", "allowed"), Some(3), "{metrics}");
    assert_eq!(m("strict", "denied"), Some(1), "{metrics}");
    assert_eq!(m("lenient", "error_allowed"), Some(4), "{metrics}");
    assert_eq!(m("shut", "error_denied"), Some(1), "{metrics}");
}
