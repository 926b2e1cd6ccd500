//! Rule changes (reloads) over HTTP meet state already in Redis: a lowered
//! limit forgets nothing still in the window, a shorter fixed window closes
//! the open one, and the /limits page reads a fixed window. (The
//! pinned-clock tests of the same changes are the library's own:
//! floodgate/tests/changes.rs.)

use std::path::Path;
use std::time::Duration;

use floodgate_site::config::Config;

use crate::helpers::{header, remaining, spawn_app};

#[actix_web::test]
async fn a_lowered_limit_reloaded_over_http_forgets_nothing_in_the_window() {
    const RULE: &str = r#"
[[rule]]
name = "lowered"
paths = ["/check"]
limit = 6
window = "1m"
deny = "status"
"#;
    let app = spawn_app(RULE).await;
    let key = "floodgate:lowered:ip:127.0.0.1";
    async fn statuses(app: &crate::helpers::TestApp, n: usize) -> Vec<u16> {
        let mut s = Vec::new();
        for _ in 0..n {
            s.push(app.get("/check").await.status().as_u16());
        }
        s
    }
    assert_eq!(statuses(&app, 7).await, [200, 200, 200, 200, 200, 200, 429]);
    let reload = |limit: u32| {
        let text = RULE.replace("limit = 6", &format!("limit = {limit}"));
        app.filter.replace_rules(
            Config::parse(&text, Path::new("reload.toml"))
                .unwrap()
                .filter
                .rules,
        );
    };
    reload(3);
    assert_eq!(statuses(&app, 1).await, [429]);
    assert_eq!(app.redis.llen(key), 6);
    reload(6);
    // Six admissions within the minute: the limit in force allows none.
    assert_eq!(statuses(&app, 3).await, [429, 429, 429]);
    let res = app.get("/check").await;
    assert_eq!(res.status(), 429);
    let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert!((55..=60).contains(&retry), "Retry-After: {retry}");
    assert_eq!(app.redis.llen(key), 6);
}

#[actix_web::test]
async fn a_shorter_fixed_window_reloaded_over_http_closes_the_open_window() {
    const RULE: &str = r#"
[[rule]]
name = "hourly"
paths = ["/check"]
algorithm = "fixed_window"
limit = 2
window = "1h"
deny = "status"
"#;
    let app = spawn_app(RULE).await;
    for expected in [200, 200, 429] {
        assert_eq!(app.get("/check").await.status(), expected);
    }
    let res = app.get("/check").await;
    assert_eq!(header(&res, "retry-after").as_deref(), Some("3600"));
    let text = RULE.replace("window = \"1h\"", "window = \"3s\"");
    app.filter.replace_rules(
        Config::parse(&text, Path::new("reload.toml"))
            .unwrap()
            .filter
            .rules,
    );
    // The open window is now 3 s long: the wait is what is left of it (the
    // two requests and the reload take a few ms, far inside those 3 s).
    let res = app.get("/check").await;
    assert_eq!(res.status(), 429);
    let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert!((1..=3).contains(&retry), "Retry-After: {retry}");
    let ttl = app.redis.pttl("floodgate:hourly:ip:127.0.0.1");
    assert!(ttl > 0 && ttl <= 3000, "PTTL {ttl}");
    // Sleeping is the subject here: the wait the server asked for.
    actix_web::rt::time::sleep(Duration::from_secs(retry)).await;
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    assert_eq!(remaining(&res, "hourly"), Some(1));
}

#[actix_web::test]
async fn the_limits_page_reads_a_fixed_window() {
    let app = spawn_app(
        r#"
[[rule]]
name = "fixed"
paths = ["/check"]
algorithm = "fixed_window"
limit = 3
window = "1m"
"#,
    )
    .await;
    for _ in 0..2 {
        assert_eq!(app.get("/check").await.status(), 200);
    }
    let page = app.get("/limits").await.text().await.unwrap();
    assert!(page.contains("2 of 3 used"), "{page}");
    assert!(page.contains("the window closes in"), "{page}");
}
