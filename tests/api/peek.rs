//! `/limits` shows the remaining of the last allowed request, also on a
//! cluster, where the keys of one page live on different masters. (The peek
//! itself, against decisions, is the library's own test:
//! floodgate/tests/peek.rs.)

use crate::cluster_helpers::Cluster;
use crate::helpers::{remaining, spawn_app, spawn_app_with};

/// `/limits` after two allowed requests shows, for each algorithm, the
/// units the second request's `RateLimit` field left.
#[actix_web::test]
async fn the_limits_page_shows_the_remaining_of_the_last_allowed_request() {
    for algorithm in [
        "limit = 5\nwindow = \"1m\"",
        "algorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1m\"",
        "algorithm = \"token_bucket\"\nrate = 0.01\nburst = 5",
    ] {
        let app = spawn_app(&format!(
            "[[rule]]\nname = \"r\"\npaths = [\"/check\"]\ncost = 2\n{algorithm}\n"
        ))
        .await;
        assert_eq!(app.get("/check").await.status(), 200);
        let last = app.get("/check").await;
        assert_eq!(last.status(), 200);
        let left = remaining(&last, "r").unwrap();
        assert_eq!(left, 1, "{algorithm}");
        let page = app.get("/limits").await.text().await.unwrap();
        let card = page.split("id=\"rule-r\"").nth(1).unwrap();
        assert!(
            card.contains(&format!("{} of 5 used", 5 - left)),
            "{algorithm}: {card}"
        );
        // Looking counted nothing.
        let again = app.get("/limits").await.text().await.unwrap();
        assert!(again.contains("4 of 5 used"), "{algorithm}");
    }
}

/// On a cluster, `/limits` peeks at keys that live on different masters
/// (one call per key) and shows each rule's usage.
#[actix_web::test]
async fn the_limits_page_peeks_across_slots_on_a_cluster() {
    let cluster = Cluster::start();
    let seeds = cluster.seeds();
    let app = spawn_app_with(
        r#"
[[rule]]
name = "per-user"
paths = ["/check"]
key = "header:x-user"
limit = 5
window = "1m"

[[rule]]
name = "per-address"
paths = ["/check"]
key = "ip"
algorithm = "fixed_window"
limit = 7
window = "1m"
"#,
        move |c| c.filter.redis.cluster = seeds,
    )
    .await;
    let get = |path: &'static str| app.client.get(app.url(path)).header("x-user", "ann").send();
    let mut last = None;
    for _ in 0..2 {
        let res = get("/check").await.unwrap();
        assert_eq!(res.status(), 200);
        last = Some(res);
    }
    let last = last.unwrap();
    assert_eq!(remaining(&last, "per-user"), Some(3));
    assert_eq!(remaining(&last, "per-address"), Some(5));
    let res = get("/limits").await.unwrap();
    assert_eq!(res.status(), 200);
    let page = res.text().await.unwrap();
    let card = |rule: &str| {
        page.split(&format!("id=\"rule-{rule}\""))
            .nth(1)
            .and_then(|rest| rest.split("</section>").next())
            .unwrap()
            .to_string()
    };
    let user = card("per-user");
    assert!(
        user.contains("your x-user header</strong>: 2 of 5 used"),
        "{user}"
    );
    assert!(card("per-address").contains("2 of 7 used"), "{page}");
}
