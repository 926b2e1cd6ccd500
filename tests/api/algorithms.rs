//! `gcra` and `sliding_counter` over HTTP, as a rule in the site's file:
//! their limit, then 429 with `Retry-After`, their RateLimit fields, one
//! identity's quota apart from another's, an operator's override, and
//! `count = "failures"` giving units back. (Their decisions against
//! reference models, and their largest limits, are the library's tests:
//! floodgate/tests/model.rs and floodgate/tests/algorithms.rs.)

use std::path::Path;

use floodgate::limiter::Action;
use floodgate_site::config::Config;

use crate::helpers::{header, remaining, spawn_app, TestApp};

const RULES: &str = r#"
[[rule]]
name = "g"
paths = ["/check"]
key = "header:x-user"
algorithm = "gcra"
limit = 3
window = "1h"
deny = "status"

[[rule]]
name = "c"
paths = ["/login"]
key = "header:x-user"
algorithm = "sliding_counter"
limit = 3
window = "1h"
deny = "status"

[[rule]]
name = "g-failures"
paths = ["/healthz"]
key = "header:x-user"
algorithm = "gcra"
limit = 2
window = "1h"
count = "failures"
deny = "status"

[[rule]]
name = "c-failures"
paths = ["/readyz"]
key = "header:x-user"
algorithm = "sliding_counter"
limit = 2
window = "1h"
count = "failures"
deny = "status"
"#;

async fn as_user(app: &TestApp, path: &str, user: &str) -> reqwest::Response {
    app.client
        .get(app.url(path))
        .header("x-user", user)
        .header("accept", "application/json")
        .send()
        .await
        .unwrap()
}

/// `limit` allowed for `user` on `path`, counting down, then a 429 whose
/// Retry-After lies within `retry` (seconds); another user is unaffected.
async fn limit_then_429(app: &TestApp, path: &str, rule: &str, limit: u64, retry: (u64, u64)) {
    for left in (0..limit).rev() {
        let res = as_user(app, path, "alice").await;
        assert_eq!(res.status(), 200, "{rule}: allowed with {left} left");
        assert_eq!(remaining(&res, rule), Some(left), "{rule}");
        let policy = header(&res, "ratelimit-policy").unwrap();
        assert!(
            policy.contains(&format!("\"{rule}\";q={limit};w=3600")),
            "{rule}: {policy}"
        );
    }
    let res = as_user(app, path, "alice").await;
    assert_eq!(res.status(), 429, "{rule}: over its limit");
    let after: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert!(
        (retry.0..=retry.1).contains(&after),
        "{rule}: Retry-After {after} outside {retry:?}"
    );
    assert_eq!(as_user(app, path, "bob").await.status(), 200, "{rule}: bob");
}

#[actix_web::test]
async fn gcra_and_sliding_counter_allow_their_limit_then_answer_429_with_their_fields() {
    let app = spawn_app(RULES).await;
    // GCRA: the burst of 3 is used; the next unit comes one emission
    // interval (1 h / 3 = 1200 s) after the theoretical arrival time.
    limit_then_429(&app, "/check", "g", 3, (1199, 1200)).await;
    // The sliding counter: its window is aligned to the epoch, so the wait
    // is until enough of the current window has slid out (at most two
    // windows).
    limit_then_429(&app, "/login", "c", 3, (1, 7200)).await;
}

#[actix_web::test]
async fn an_override_gives_a_gcra_or_sliding_counter_identity_its_own_limit() {
    let app = spawn_app(RULES).await;
    for (rule, path) in [("g", "/check"), ("c", "/login")] {
        let raise = Action::Override {
            limit: 5,
            window: None,
            lasts: None,
        };
        app.filter.operate(rule, &["carol"], raise).await.unwrap();
        for i in 0..5 {
            let res = as_user(&app, path, "carol").await;
            assert_eq!(res.status(), 200, "{rule}: request {i} under the override");
            let policy = header(&res, "ratelimit-policy").unwrap();
            assert!(
                policy.contains(&format!("\"{rule}\";q=5;w=3600")),
                "{policy}"
            );
        }
        assert_eq!(as_user(&app, path, "carol").await.status(), 429, "{rule}");
    }
}

#[actix_web::test]
async fn gcra_and_sliding_counter_give_back_what_a_success_took_under_count_failures() {
    let app = spawn_app(RULES).await;
    for (rule, path) in [("g-failures", "/healthz"), ("c-failures", "/readyz")] {
        // Each answer is a success (below 400): its unit goes back, so ten
        // requests never use up a limit of 2.
        for i in 0..10 {
            let res = as_user(&app, path, "dave").await;
            assert_eq!(res.status(), 200, "{rule}: request {i}");
        }
    }
}

#[test]
fn the_file_takes_a_billion_for_the_constant_state_algorithms_only() {
    let rule = |algorithm: &str, limit: u64| {
        format!(
            "[[rule]]\nname = \"r\"\npaths = [\"/check\"]\nalgorithm = \"{algorithm}\"\n\
             limit = {limit}\nwindow = \"1m\"\n"
        )
    };
    for algorithm in ["gcra", "sliding_counter"] {
        let text = rule(algorithm, 1_000_000_000);
        Config::parse(&text, Path::new("t.toml")).expect(algorithm);
        let over = rule(algorithm, 1_000_000_001);
        assert!(
            Config::parse(&over, Path::new("t.toml")).is_err(),
            "{algorithm}"
        );
    }
    let log = rule("sliding_window", 1_000_000_000);
    let refused = Config::parse(&log, Path::new("t.toml")).unwrap_err();
    assert!(refused.to_string().contains("limit"), "{refused}");
    // A window over 366 days is refused for them as for the others.
    let long = "[[rule]]\nname = \"r\"\npaths = [\"/check\"]\nalgorithm = \"gcra\"\n\
                limit = 3\nwindow = \"367d\"\n";
    assert!(Config::parse(long, Path::new("t.toml")).is_err());
}
