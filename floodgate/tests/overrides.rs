//! What operators' overrides and bans do to an identity's state, against a
//! real redis-server: a give-back under an override gives back what the
//! override charged, a denial under an override that is about to end
//! writes nothing of the rule's numbers, setting, changing or clearing an
//! override never gives back what was used, and operators reach the
//! identities of `hash_key` rules without ever writing their values into
//! Redis.

mod common;

use std::time::{Duration, Instant};

use actix_web::body::{BoxBody, EitherBody};
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpResponse};
use floodgate_limiter::limiter::Action;
use floodgate_limiter::Filter;

use common::RedisServer;

/// The identity of a request made with `actix_web::test` (it has no peer).
const PEER: [&str; 1] = ["0.0.0.0"];

fn toml_filter(redis: &RedisServer, rule: &str) -> Filter {
    let text = format!(
        "[redis]\nurl = \"{}\"\n[[rule]]\nname = \"r\"\npaths = [\"/login\"]\ndeny = \"status\"\n{rule}",
        redis.url()
    );
    Filter::from_toml_str(&text, "app.toml").unwrap()
}

/// The app under test.
trait Guarded:
    Service<
    actix_http::Request,
    Response = ServiceResponse<EitherBody<BoxBody>>,
    Error = actix_web::Error,
>
{
}
impl<S> Guarded for S where
    S: Service<
        actix_http::Request,
        Response = ServiceResponse<EitherBody<BoxBody>>,
        Error = actix_web::Error,
    >
{
}

/// `/login?ok=1` succeeds, anything else fails with 401.
async fn login(query: web::Query<std::collections::HashMap<String, String>>) -> HttpResponse {
    if query.get("ok").is_some() {
        HttpResponse::Ok().body("welcome")
    } else {
        HttpResponse::Unauthorized().body("no")
    }
}

async fn app(filter: &Filter) -> impl Guarded {
    test::init_service(
        App::new()
            .wrap(filter.clone())
            .route("/login", web::get().to(login)),
    )
    .await
}

async fn status(app: &impl Guarded, uri: &str) -> StatusCode {
    test::call_service(app, test::TestRequest::get().uri(uri).to_request())
        .await
        .status()
}

/// How many of `n` failed attempts got past the limit (401, not 429).
async fn failures_admitted(app: &impl Guarded, n: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        match status(app, "/login").await {
            StatusCode::UNAUTHORIZED => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    admitted
}

fn override_of(limit: u32, window: Option<Duration>, lasts: Option<Duration>) -> Action {
    Action::Override {
        limit,
        window,
        lasts,
    }
}

#[actix_web::test]
async fn a_give_back_under_an_override_keeps_the_overrides_window() {
    // The rule's window passes; the override's does not.
    let redis = RedisServer::start();
    let filter = toml_filter(&redis, "limit = 3\nwindow = \"1s\"\ncount = \"failures\"\n");
    let app = app(&filter).await;
    let hour = Some(Duration::from_secs(3600));
    filter
        .operate("r", &PEER, override_of(5, hour, None))
        .await
        .unwrap();
    assert_eq!(failures_admitted(&app, 4).await, 4);
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(1100) {
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
    // Charged, then given back: the four failures still count.
    assert_eq!(status(&app, "/login?ok=1").await, StatusCode::OK);
    assert_eq!(failures_admitted(&app, 7).await, 1);
}

#[actix_web::test]
async fn a_gcra_give_back_under_an_override_moves_its_clock_by_the_overrides_interval() {
    // Rule: one every 8 hours; override: one every 48 minutes.
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "algorithm = \"gcra\"\nlimit = 3\nwindow = \"1d\"\ncount = \"failures\"\n",
    );
    let app = app(&filter).await;
    filter
        .operate("r", &PEER, override_of(30, None, None))
        .await
        .unwrap();
    assert_eq!(failures_admitted(&app, 29).await, 29);
    assert_eq!(status(&app, "/login?ok=1").await, StatusCode::OK);
    assert_eq!(failures_admitted(&app, 5).await, 1);
}

#[actix_web::test]
async fn a_token_bucket_give_back_under_an_override_keeps_the_overrides_burst() {
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "algorithm = \"token_bucket\"\nrate = 0.001\nburst = 3\ncount = \"failures\"\n",
    );
    let app = app(&filter).await;
    // Burst 30, refilled at 0.01 a second: nothing comes back during the test.
    filter
        .operate("r", &PEER, override_of(30, None, None))
        .await
        .unwrap();
    assert_eq!(failures_admitted(&app, 20).await, 20);
    assert_eq!(status(&app, "/login?ok=1").await, StatusCode::OK);
    assert_eq!(failures_admitted(&app, 11).await, 10);
}

/// Waits out `ms` of real time (the rule's window has to pass).
async fn wait_ms(ms: u64) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(ms) {
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
}

#[actix_web::test]
async fn a_denial_under_an_ending_override_writes_none_of_the_rules_numbers() {
    // Each rule: 3 a second; the override: 5 an hour, for 30 s. The sixth
    // request's wait under the override (about an hour) is longer than the
    // override lasts, so the rule's own numbers are asked for its wait:
    // they must not be written (a log's TTL, a window's length, a
    // bucket's rate), or the state would free up under them.
    for rule in [
        "limit = 3\nwindow = \"1s\"\n",
        "algorithm = \"fixed_window\"\nlimit = 3\nwindow = \"1s\"\n",
        "algorithm = \"token_bucket\"\nrate = 3.0\nburst = 3\n",
        "algorithm = \"sliding_counter\"\nlimit = 3\nwindow = \"1s\"\n",
    ] {
        let redis = RedisServer::start();
        let filter = toml_filter(&redis, rule);
        let app = app(&filter).await;
        let lasts = Some(Duration::from_secs(30));
        filter
            .operate(
                "r",
                &PEER,
                override_of(5, Some(Duration::from_secs(3600)), lasts),
            )
            .await
            .unwrap();
        for _ in 0..5 {
            assert_eq!(
                status(&app, "/login").await,
                StatusCode::UNAUTHORIZED,
                "{rule}"
            );
        }
        assert_eq!(
            status(&app, "/login").await,
            StatusCode::TOO_MANY_REQUESTS,
            "{rule}"
        );
        let key = "floodgate:r:ip:0.0.0.0";
        assert!(redis.pttl(key) > 10_000, "{rule}: TTL {}", redis.pttl(key));
        // Past the rule's window, inside the override's hour.
        wait_ms(1200).await;
        assert_eq!(
            status(&app, "/login").await,
            StatusCode::TOO_MANY_REQUESTS,
            "{rule}"
        );
        let seen = filter.operate("r", &PEER, Action::Inspect).await.unwrap();
        assert_eq!((seen.limit, seen.remaining), (5, 0), "{rule}");
    }
}

#[actix_web::test]
async fn setting_changing_or_clearing_an_override_gives_no_units_back() {
    // A sliding counter with every unit of its day used.
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "algorithm = \"sliding_counter\"\nlimit = 10\nwindow = \"1d\"\n",
    );
    let app = app(&filter).await;
    assert_eq!(failures_admitted(&app, 11).await, 10);
    let two_days = Some(Duration::from_secs(2 * 86400));
    for (step, action) in [
        ("raised window", override_of(10, two_days, None)),
        ("cleared", Action::Clear),
        ("lowered", override_of(5, two_days, None)),
        ("cleared again", Action::Clear),
    ] {
        filter.operate("r", &PEER, action).await.unwrap();
        assert_eq!(failures_admitted(&app, 5).await, 0, "{step}");
    }
}

#[actix_web::test]
async fn clearing_an_override_of_a_drained_bucket_keeps_what_was_used() {
    // Burst 100 refilled at 1 a second, drained; then its own burst of 10
    // refilled in 1 s (10 a second) for a moment, then the rule's again.
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "algorithm = \"token_bucket\"\nrate = 1.0\nburst = 100\n",
    );
    let app = app(&filter).await;
    let drained = Instant::now();
    assert_eq!(failures_admitted(&app, 100).await, 100);
    filter
        .operate(
            "r",
            &PEER,
            override_of(10, Some(Duration::from_secs(1)), None),
        )
        .await
        .unwrap();
    // Decided under the override (a bucket full under it, once its key
    // has expired, must not read as full under the rule).
    failures_admitted(&app, 1).await;
    wait_ms(1200).await;
    filter.operate("r", &PEER, Action::Clear).await.unwrap();
    let admitted = failures_admitted(&app, 100).await;
    // At most what 10 a second (the faster of the two rates) brought back.
    let bound = (drained.elapsed().as_secs_f64() * 10.0).ceil() as usize + 1;
    assert!(
        admitted <= bound && admitted < 100,
        "{admitted} admitted, at most {bound} refilled"
    );
}

#[actix_web::test]
async fn operators_reach_hashed_identities_and_no_value_reaches_a_key_name() {
    let redis = RedisServer::start();
    let text = format!(
        "[redis]\nurl = \"{}\"\n[[rule]]\nname = \"hk\"\npaths = [\"/login\"]\ndeny = \"status\"\nkey = \"header:x-api-key\"\nhash_key = true\nlimit = 2\nwindow = \"1h\"\n",
        redis.url()
    );
    let filter = Filter::from_toml_str(&text, "app.toml").unwrap();
    let app = app(&filter).await;
    let secret = "sk_live_other";
    let call = || async {
        test::call_service(
            &app,
            test::TestRequest::get()
                .uri("/login")
                .insert_header(("x-api-key", secret))
                .to_request(),
        )
        .await
        .status()
    };
    assert_eq!(call().await, StatusCode::UNAUTHORIZED);
    let seen = filter
        .operate("hk", &[secret], Action::Inspect)
        .await
        .unwrap();
    assert_eq!((seen.used, seen.remaining), (1, 1));
    assert_eq!(call().await, StatusCode::UNAUTHORIZED);
    assert_eq!(call().await, StatusCode::TOO_MANY_REQUESTS);
    filter
        .operate("hk", &[secret], Action::Reset)
        .await
        .unwrap();
    assert_eq!(call().await, StatusCode::UNAUTHORIZED);
    filter
        .operate("hk", &[secret], Action::Ban(Duration::from_secs(600)))
        .await
        .unwrap();
    assert_eq!(call().await, StatusCode::TOO_MANY_REQUESTS);
    filter
        .operate("hk", &[secret], Action::Unban)
        .await
        .unwrap();
    let seen = filter
        .operate("hk", &[secret], override_of(10, None, None))
        .await
        .unwrap();
    assert_eq!((seen.limit, seen.used), (10, 1));
    assert_eq!(call().await, StatusCode::UNAUTHORIZED);
    let keys = redis.keys("*");
    assert!(!keys.is_empty());
    assert!(
        keys.iter().all(|k| !k.contains(secret)),
        "a key names the secret: {keys:?}"
    );
}

#[actix_web::test]
async fn an_action_no_operators_command_accepts_is_refused_and_does_nothing() {
    // The same bounds as `floodgate ban/override` and the admin API: more
    // than 0 and at most 366 days, a limit of at least 1.
    let redis = RedisServer::start();
    let filter = toml_filter(&redis, "limit = 3\nwindow = \"1m\"\n");
    let day = Duration::from_secs(86_400);
    let bad = [
        Action::Ban(Duration::ZERO),
        Action::Ban(3650 * day),
        Action::Ban(Duration::MAX),
        override_of(0, None, None),
        override_of(5, Some(Duration::ZERO), None),
        override_of(5, Some(400 * day), None),
        override_of(5, None, Some(Duration::ZERO)),
        override_of(5, None, Some(3650 * day)),
    ];
    let check = floodgate_limiter::limiter::Check::new(
        "floodgate:r:ip:0.0.0.0",
        filter.rules()[0].algorithm(),
    );
    for action in bad {
        let e = filter.operate("r", &PEER, action).await.unwrap_err();
        assert!(
            matches!(e, floodgate_limiter::OperatorError::Input(_)),
            "{action:?}: {e}"
        );
        let e = filter
            .limiter()
            .operate(check.clone(), action)
            .await
            .unwrap_err();
        assert!(
            matches!(e, floodgate_limiter::limiter::LimiterError::Invalid(_)),
            "{action:?}: {e}"
        );
    }
    assert_eq!(redis.keys("*"), Vec::<String>::new());
    // At the bounds, accepted.
    let seen = filter
        .operate("r", &PEER, Action::Ban(366 * day))
        .await
        .unwrap();
    assert!(seen.banned_s > 365 * 86_400, "{seen:?}");
}

/// The limiter's own operator entry checks what the filter's does: no
/// override past the algorithm's largest limit or below the rule's cost,
/// and no ban or override under a shadow rule (it would never apply).
#[actix_web::test]
async fn the_limiters_operate_refuses_what_cannot_apply_under_the_rule() {
    use floodgate_limiter::limiter::{Check, LimiterError};
    let redis = RedisServer::start();
    let filter = toml_filter(&redis, "limit = 5\nwindow = \"1m\"\n");
    let limiter = filter.limiter();
    let rule = &filter.rules()[0];
    let check = rule.check("app:r:ip:0.0.0.0".to_string());
    for limit in [0, 5_000_000] {
        let refused = limiter
            .operate(check.clone(), override_of(limit, None, None))
            .await;
        assert!(
            matches!(refused, Err(LimiterError::Invalid(_))),
            "{limit}: {refused:?}"
        );
    }
    assert!(limiter
        .operate(check.clone(), override_of(9, None, None))
        .await
        .is_ok());
    let shadow: Check = check.with_enforce(false);
    let refused = limiter
        .operate(shadow, Action::Ban(Duration::from_secs(60)))
        .await;
    assert!(
        matches!(&refused, Err(LimiterError::Invalid(why)) if why.contains("shadow")),
        "{refused:?}"
    );
}
