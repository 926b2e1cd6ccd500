//! floodgate as a library: apps that use only the crate's public API
//! (rules from TOML, limits in code on resources and scopes, both at once),
//! against a real redis-server. Requests go through `actix_web::test`.

mod common;

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpResponse};
use floodgate_limiter::{Filter, Key, Limit, RequestHead, Usage};

use common::RedisServer;

fn toml_filter(redis: &RedisServer, rules: &str) -> Filter {
    let text = format!("[redis]\nurl = \"{}\"\n{rules}", redis.url());
    Filter::from_toml_str(&text, "app.toml").unwrap()
}

async fn ok() -> HttpResponse {
    HttpResponse::Ok().body("ok")
}

#[actix_web::test]
async fn toml_rules_wrapped_on_an_app_deny_past_the_limit_with_429() {
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "[[rule]]\nname = \"hello\"\npaths = [\"/hello\"]\ndeny = \"status\"\nlimit = 2\nwindow = \"1m\"\n",
    );
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/hello", web::get().to(ok))
            .route("/free", web::get().to(ok)),
    )
    .await;
    for _ in 0..2 {
        let res =
            test::call_service(&app, test::TestRequest::get().uri("/hello").to_request()).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    let res = test::call_service(&app, test::TestRequest::get().uri("/hello").to_request()).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().contains_key("retry-after"));
    let res = test::call_service(&app, test::TestRequest::get().uri("/free").to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
}

/// `GET /user/{id}`: the id as the router gave it.
async fn user(id: web::Path<String>) -> HttpResponse {
    HttpResponse::Ok().body(id.into_inner())
}

#[actix_web::test]
async fn a_rule_guards_every_path_the_router_sends_to_its_handler() {
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "[[rule]]\nname = \"user\"\npaths = [\"/user/:id\"]\nkey = \"global\"\ndeny = \"status\"\nlimit = 3\nwindow = \"1m\"\n",
    );
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/user/{id}", web::get().to(user)),
    )
    .await;
    // actix routes a path with `%2F` kept encoded: one segment, the
    // handler's `{id}`. The rule (one segment too) counts it.
    for (path, id) in [
        ("/user/a%2Fb", "a/b"),
        ("/user/%2F", "/"),
        ("/user/a%2F..%2F..%2Fx", "a/../../x"),
    ] {
        let res = test::call_service(&app, test::TestRequest::get().uri(path).to_request()).await;
        assert_eq!(res.status(), StatusCode::OK, "{path}");
        assert_eq!(test::read_body(res).await, id.as_bytes(), "{path}");
    }
    let res = test::call_service(&app, test::TestRequest::get().uri("/user/7").to_request()).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(redis.llen("floodgate:user:global:all"), 3);
}

#[actix_web::test]
async fn a_redis_without_functions_is_decided_with_scripts() {
    // A server that answers FCALL and FUNCTION "unknown command", as Redis
    // 6 does: the filter's decisions fall back to EVALSHA, with exact counts.
    let redis = RedisServer::start_without_functions();
    let filter = toml_filter(
        &redis,
        "[[rule]]\nname = \"old\"\npaths = [\"/hello\"]\ndeny = \"status\"\nlimit = 2\nwindow = \"1m\"\n",
    );
    let app = test::init_service(App::new().wrap(filter).route("/hello", web::get().to(ok))).await;
    for status in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let res =
            test::call_service(&app, test::TestRequest::get().uri("/hello").to_request()).await;
        assert_eq!(res.status(), status);
    }
    // And a limiter's own dispatcher threads, off any worker.
    let limiter = common::pinned::pinned_limiter(&redis);
    let check = || {
        vec![common::pinned::check(
            "p:old:ip:1",
            common::pinned::sliding(1, 60_000),
            1,
        )]
    };
    let first = limiter
        .decide_at(common::pinned::T0, check())
        .await
        .unwrap();
    let second = limiter
        .decide_at(common::pinned::T0 + 1, check())
        .await
        .unwrap();
    assert!(first.allowed && !second.allowed);
    assert_eq!(redis.llen("p:old:ip:1"), 1);
}

#[actix_web::test]
async fn toml_errors_from_the_library_read_file_where_what() {
    let err = Filter::from_toml_str(
        "[[rule]]\nname = \"x\"\npaths = [\"/x\"]\nlimit = 1\nwindw = \"1m\"\n",
        "mine.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("mine.toml: line 5, column 1: unknown field \"windw\""),
        "{err}"
    );
}

#[actix_web::test]
async fn in_code_limits_on_a_resource_and_a_scope_deny_with_their_own_counts() {
    let redis = RedisServer::start();
    let filter = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let app = test::init_service(
        App::new()
            .service(
                web::resource("/sms")
                    .wrap(filter.limit(Limit::per_minute(2).key(Key::form("phone")).name("sms")))
                    .route(web::post().to(ok)),
            )
            .service(
                web::scope("/api")
                    .wrap(filter.limit(Limit::per_minute(1).name("api")))
                    .route("/a", web::get().to(ok))
                    .route("/b", web::get().to(ok)),
            ),
    )
    .await;
    let sms = |phone: &'static str| {
        test::TestRequest::post()
            .uri("/sms")
            .insert_header(("content-type", "application/x-www-form-urlencoded"))
            .set_payload(phone)
            .to_request()
    };
    assert_eq!(
        test::call_service(&app, sms("phone=1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        test::call_service(&app, sms("phone=1")).await.status(),
        StatusCode::OK
    );
    let denied = test::call_service(&app, sms("phone=1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    // Another phone number has its own counter.
    assert_eq!(
        test::call_service(&app, sms("phone=2")).await.status(),
        StatusCode::OK
    );
    // One counter for the whole scope.
    let a = test::call_service(&app, test::TestRequest::get().uri("/api/a").to_request()).await;
    assert_eq!(a.status(), StatusCode::OK);
    let b = test::call_service(&app, test::TestRequest::get().uri("/api/b").to_request()).await;
    assert_eq!(b.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(redis.llen("floodgate:sms:form:1"), 2);
}

#[actix_web::test]
async fn a_request_an_in_code_limit_denies_takes_nothing_from_the_toml_rules() {
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "[[rule]]\nname = \"outer\"\npaths = [\"/m/*\"]\ndeny = \"status\"\nlimit = 10\nwindow = \"1m\"\n",
    );
    let inner = filter.limit(Limit::per_minute(1).name("inner"));
    let app = test::init_service(
        App::new().wrap(filter.clone()).service(
            web::scope("/m")
                .service(web::resource("/tight").wrap(inner).route(web::get().to(ok)))
                .route(
                    "/state",
                    web::get().to(|limits: Usage| async move {
                        let outer = limits.get("outer").map_or(999, |r| r.remaining);
                        HttpResponse::Ok().body(outer.to_string())
                    }),
                ),
        ),
    )
    .await;
    let get = |uri: &'static str| test::TestRequest::get().uri(uri).to_request();
    let first = test::call_service(&app, get("/m/tight")).await;
    assert_eq!(first.status(), StatusCode::OK);
    // Both rules' fields are on the response, the outer rule first.
    let fields = first
        .headers()
        .get("ratelimit")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        fields.starts_with("\"outer\";r=9") && fields.contains("\"inner\";r=0"),
        "{fields}"
    );
    for _ in 0..3 {
        let denied = test::call_service(&app, get("/m/tight")).await;
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    // One allowed request, three denied: the outer rule has only the
    // allowed one and this one.
    let state = test::call_and_read_body(&app, get("/m/state")).await;
    assert_eq!(state, "8");
    assert_eq!(redis.llen("floodgate:outer:ip:0.0.0.0"), 2);
}

#[actix_web::test]
async fn handlers_read_the_decision_and_give_units_back_or_charge_more() {
    let redis = RedisServer::start();
    let filter = Filter::builder()
        .redis_url(&redis.url())
        .rule("/refund", Limit::per_minute(3).name("refund"))
        .rule("/heavy", Limit::per_minute(5).name("heavy"))
        .rule("/undo", Limit::per_minute(10).name("undo"))
        .build()
        .unwrap();
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route(
                "/refund",
                web::get().to(|limits: Usage| async move {
                    let given = limits.give_back().await.unwrap();
                    let left = limits.get("refund").unwrap().remaining;
                    HttpResponse::Ok().body(format!("{given} {left}"))
                }),
            )
            .route(
                "/heavy",
                web::get().to(|limits: Usage| async move {
                    let charged = limits.charge(3).await.unwrap();
                    HttpResponse::Ok().body(format!("{charged}"))
                }),
            )
            .route(
                "/undo",
                web::get().to(|limits: Usage| async move {
                    // Charged 1 + 4, then all of it given back.
                    assert!(limits.charge(4).await.unwrap());
                    let given = limits.give_back().await.unwrap();
                    let left = limits.get("undo").unwrap().remaining;
                    HttpResponse::Ok().body(format!("{given} {left}"))
                }),
            ),
    )
    .await;
    let get = |uri: &'static str| test::TestRequest::get().uri(uri).to_request();
    for _ in 0..5 {
        let body = test::call_and_read_body(&app, get("/refund")).await;
        assert_eq!(body, "1 3");
    }
    assert_eq!(redis.llen("floodgate:refund:ip:0.0.0.0"), 0);
    // 1 + 3 units, then 1 more leaves no room for 3.
    assert_eq!(test::call_and_read_body(&app, get("/heavy")).await, "true");
    assert_eq!(test::call_and_read_body(&app, get("/heavy")).await, "false");
    // Three admissions, one entry each, carrying 5 units in all.
    assert_eq!(redis.llen("floodgate:heavy:ip:0.0.0.0"), 3);
    // A give-back returns what a charge added too.
    for _ in 0..3 {
        let body = test::call_and_read_body(&app, get("/undo")).await;
        assert_eq!(body, "5 10");
    }
}

#[actix_web::test]
async fn custom_key_functions_session_lookup_and_denial_responders_are_used() {
    let redis = RedisServer::start();
    let filter = Filter::builder()
        .redis_url(&redis.url())
        .session_lookup(|req| req.header("x-user").map(str::to_owned))
        .denial_responder(|denial, _req| {
            floodgate_limiter::http::Response::builder()
                .status(429)
                .header("content-type", "application/json")
                .body(format!("{{\"slow_down\":\"{}\"}}", denial.rule.name()))
                .unwrap()
        })
        .rule(
            "/account",
            Limit::per_minute(1).key(Key::session()).name("acct"),
        )
        .build()
        .unwrap();
    let tenant = Key::custom("tenant", |req: &RequestHead| {
        req.path().strip_prefix("/t/").map(str::to_owned)
    });
    let app = test::init_service(
        App::new()
            .wrap(filter.clone())
            .route("/account", web::get().to(ok))
            .service(
                web::resource("/t/{t}")
                    .wrap(filter.limit(Limit::per_minute(1).key(tenant).name("tenant")))
                    .route(web::get().to(ok)),
            ),
    )
    .await;
    let as_user = |u: &'static str| {
        test::TestRequest::get()
            .uri("/account")
            .insert_header(("x-user", u))
            .to_request()
    };
    assert_eq!(
        test::call_service(&app, as_user("ann")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        test::call_service(&app, as_user("bob")).await.status(),
        StatusCode::OK
    );
    let denied = test::call_service(&app, as_user("ann")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(denied.headers().contains_key("retry-after"));
    assert_eq!(test::read_body(denied).await, "{\"slow_down\":\"acct\"}");
    let get = |uri: &'static str| test::TestRequest::get().uri(uri).to_request();
    assert_eq!(
        test::call_service(&app, get("/t/one")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        test::call_service(&app, get("/t/two")).await.status(),
        StatusCode::OK
    );
    let denied = test::call_service(&app, get("/t/one")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(redis.keys("floodgate:tenant:custom:*").len(), 2);
}

#[actix_web::test]
async fn an_unusable_in_code_limit_is_refused_with_the_reason() {
    let redis = RedisServer::start();
    let filter = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let said =
        panic_message(|| filter.limit(Limit::per_minute(0))).expect("a limit of 0 is refused");
    assert!(
        said.contains("limit must be between 1 and 100000, got 0"),
        "{said}"
    );
    let err = filter
        .try_limit(Limit::per_minute(0).name("zero"))
        .expect_err("a limit of 0 is refused")
        .to_string();
    assert_eq!(
        err,
        "unusable limit \"zero\": limit must be between 1 and 100000, got 0"
    );
    let err = Filter::builder()
        .redis_url(&redis.url())
        .rule("/x", Limit::new(1, Duration::ZERO))
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("window must be greater than 0"), "{err}");
}

/// What a call panicked with, or `None` when it returned.
fn panic_message<T>(f: impl FnOnce() -> T) -> Option<String> {
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).err()?;
    Some(
        caught
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| caught.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
    )
}

/// A sign-in style route under `count = "failures"`: `/login?ok=1`
/// succeeds (and its handler gives its units back itself as well),
/// anything else fails with 401.
async fn login(
    limits: Usage,
    query: web::Query<std::collections::HashMap<String, String>>,
) -> HttpResponse {
    if query.get("ok").is_some() {
        limits.give_back().await.unwrap();
        HttpResponse::Ok().body("welcome")
    } else {
        HttpResponse::Unauthorized().body("no")
    }
}

#[actix_web::test]
async fn a_success_gives_its_units_back_once_however_many_paths_refund_it() {
    let redis = RedisServer::start();
    let filter = Filter::builder()
        .redis_url(&redis.url())
        .rule(
            "/login",
            Limit::per_minute(3).count_failures_only().name("login"),
        )
        .build()
        .unwrap();
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/login", web::get().to(login)),
    )
    .await;
    let get = |uri: &'static str| test::TestRequest::get().uri(uri).to_request();
    let mut failures_admitted = 0;
    for _ in 0..6 {
        let res = test::call_service(&app, get("/login")).await;
        if res.status() == StatusCode::UNAUTHORIZED {
            failures_admitted += 1;
        }
        // The handler and the filter both give this success back: once.
        test::call_service(&app, get("/login?ok=1")).await;
    }
    assert_eq!(failures_admitted, 3);
    assert_eq!(redis.llen("floodgate:login:ip:0.0.0.0"), 3);
}

#[actix_web::test]
async fn an_inner_redirect_denial_under_a_failures_rule_is_given_back_once() {
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "[[rule]]\nname = \"outer\"\npaths = [\"/m/*\"]\ndeny = \"status\"\ncount = \"failures\"\nlimit = 3\nwindow = \"1m\"\n",
    );
    let inner = filter.limit(Limit::per_minute(1).redirect_to("/err").name("inner"));
    let app = test::init_service(
        App::new().wrap(filter.clone()).service(
            web::scope("/m")
                .service(web::resource("/tight").wrap(inner).route(web::get().to(ok)))
                .route("/fail", web::get().to(HttpResponse::Unauthorized)),
        ),
    )
    .await;
    let get = |uri: &'static str| test::TestRequest::get().uri(uri).to_request();
    let mut failures_admitted = 0;
    for _ in 0..6 {
        let res = test::call_service(&app, get("/m/fail")).await;
        if res.status() == StatusCode::UNAUTHORIZED {
            failures_admitted += 1;
        }
        // Allowed once, then denied with a 303 by the inner limit: the
        // outer rule gives its unit back once either way.
        test::call_service(&app, get("/m/tight")).await;
    }
    assert_eq!(failures_admitted, 3);
    assert_eq!(redis.llen("floodgate:outer:ip:0.0.0.0"), 3);
}

#[actix_web::test]
async fn default_names_tell_limits_apart_and_sliding_and_fixed_never_share_state() {
    let redis = RedisServer::start();
    let filter = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let sliding = filter.limit(Limit::per_minute(3));
    let fixed = filter.limit(Limit::per_minute(3).fixed_window());
    let app = test::init_service(
        App::new()
            .service(web::resource("/s").wrap(sliding).route(web::get().to(ok)))
            .service(web::resource("/f").wrap(fixed).route(web::get().to(ok))),
    )
    .await;
    let get = |uri: &'static str| test::TestRequest::get().uri(uri).to_request();
    for uri in ["/s", "/f"] {
        let mut admitted = 0;
        for _ in 0..6 {
            if test::call_service(&app, get(uri)).await.status() == StatusCode::OK {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 3, "{uri}");
    }
    assert_eq!(redis.keys("floodgate:*").len(), 2);
    // Names are never cut so that two limits meet, nor made alike by the
    // characters a rule name cannot hold (another filter: names of its own).
    let filter = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let name = |key: Key| {
        filter.limit(Limit::per_hour(7).key(key)).rules()[0]
            .name()
            .to_string()
    };
    let long = "x".repeat(80);
    let a = name(Key::header(&format!("{long}a")));
    let b = name(Key::header(&format!("{long}b")));
    assert_ne!(a, b);
    assert!(a.len() <= 64, "{a}");
    assert_ne!(name(Key::query("a.b")), name(Key::query("a-b")));
    let rule = |l: Limit| filter.limit(l).rules()[0].name().to_string();
    assert_ne!(
        rule(Limit::per_minute(3).cost(1)),
        rule(Limit::per_minute(3).cost(2))
    );
    assert_ne!(
        rule(Limit::token_bucket(1.5, 3)),
        rule(Limit::token_bucket(2.5, 3))
    );
}

#[actix_web::test]
async fn in_code_limits_with_one_name_and_two_meanings_are_refused() {
    let redis = RedisServer::start();
    let filter = Filter::builder()
        .redis_url(&redis.url())
        .rule("/a", Limit::per_minute(2).name("shared"))
        .build()
        .unwrap();
    // An in-code limit named like a builder rule.
    let said = panic_message(|| filter.limit(Limit::per_minute(5).name("shared")));
    let said = said.expect("a limit named like a builder rule is refused");
    assert!(said.contains("\"shared\""), "{said}");
    // Two resources given the same limit from two places in the code.
    let _first = filter.limit(Limit::per_minute(3).key(Key::path()));
    let said = panic_message(|| filter.limit(Limit::per_minute(3).key(Key::path())));
    let said = said.expect("a second limit of the same name is refused");
    assert!(said.contains("name"), "{said}");
    // One place in the code, run once per worker, is one limit.
    for _ in 0..3 {
        let _ = filter.limit(Limit::per_minute(4).key(Key::path()));
    }
    // Two builder rules of one name are refused too.
    let err = Filter::builder()
        .redis_url(&redis.url())
        .rule("/a", Limit::per_minute(2))
        .rule("/b", Limit::per_minute(2))
        .build()
        .expect_err("two rules of one name are refused")
        .to_string();
    assert!(err.contains("name"), "{err}");
}

#[actix_web::test]
async fn in_code_limits_are_checked_like_toml_rules() {
    let redis = RedisServer::start();
    let build = |limit: Limit| {
        Filter::builder()
            .redis_url(&redis.url())
            .rule("/x", limit)
            .build()
            .err()
            .map(|e| e.to_string())
    };
    let custom = |name: &str| Key::custom(name, |_: &RequestHead| None);
    let tenant =
        |n: &'static str| Key::custom("tenant", move |_: &RequestHead| Some(n.to_string()));
    for (limit, says) in [
        (
            Limit::per_minute(1).redirect_to("/err\r\nSet-Cookie: x=1"),
            "error_page \"/err\\r\\nSet-Cookie: x=1\" may hold only",
        ),
        (
            Limit::per_minute(1).redirect_to("https://elsewhere.example/"),
            "must start with \"/\"",
        ),
        (
            Limit::new(5, Duration::from_micros(500)),
            "window must be a whole number of milliseconds",
        ),
        (
            Limit::new(5, Duration::from_micros(1500)),
            "window must be a whole number of milliseconds",
        ),
        (
            Limit::new(5, Duration::from_secs(400 * 86_400)),
            "window must be at most 366 days, got \"400d\"",
        ),
        (
            Limit::token_bucket(0.0, 5),
            "rate must be greater than 0 and at most 1000000 (tokens per second), got 0",
        ),
        (
            Limit::per_minute(1).key(Key::header("")),
            "key \"header:\": the name after the colon must be",
        ),
        (
            Limit::per_minute(1).key(custom("a b")),
            "key \"custom:a b\": the name after the colon must be",
        ),
        (
            Limit::per_minute(1).key(Key::ip().and(Key::ip())),
            "key lists \"ip\" twice",
        ),
        (
            Limit::per_minute(1).key(tenant("f").and(tenant("g"))),
            "key lists \"custom:tenant\" twice",
        ),
        (
            Limit::per_minute(1).name("no spaces"),
            "name must be 1 to 64 characters",
        ),
    ] {
        let err = build(limit).unwrap_or_else(|| panic!("accepted, should say {says}"));
        assert!(err.contains(says), "{err} (expected {says})");
    }
    // A builder rule that covers its own error page would redirect forever.
    let err = build_loop(&redis).expect("a redirect loop is refused");
    assert!(err.contains("(a loop)"), "{err}");
    // On a resource, the refusal says why.
    let filter = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let said = panic_message(|| filter.limit(Limit::per_minute(1).redirect_to("/e\u{1}")))
        .expect("an unusable limit on a resource is refused");
    assert!(said.contains("error_page"), "{said}");
}

fn build_loop(redis: &RedisServer) -> Option<String> {
    Filter::builder()
        .redis_url(&redis.url())
        .rule("/*", Limit::per_minute(1).redirect_to("/err"))
        .build()
        .err()
        .map(|e| e.to_string())
}

#[actix_web::test]
async fn an_in_code_redirect_limit_on_its_own_error_page_does_not_send_it_to_itself() {
    let redis = RedisServer::start();
    let filter = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let app = test::init_service(
        App::new().service(
            web::resource("/err")
                .wrap(filter.limit(Limit::per_minute(1).redirect_to("/err").name("page")))
                .route(web::get().to(ok)),
        ),
    )
    .await;
    let get = || test::TestRequest::get().uri("/err").to_request();
    assert_eq!(
        test::call_service(&app, get()).await.status(),
        StatusCode::OK
    );
    let denied = test::call_service(&app, get()).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[actix_web::test]
async fn a_handlers_give_back_frees_a_key_whose_denial_was_remembered() {
    use std::sync::Arc;
    use tokio::sync::Notify;

    let redis = RedisServer::start();
    let filter = Filter::builder()
        .redis_url(&redis.url())
        .rule("/r/*", Limit::per_minute(2).name("held"))
        .build()
        .unwrap();
    let entered = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let (e, r) = (Arc::clone(&entered), Arc::clone(&release));
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route(
                "/r/hold",
                web::get().to(move |limits: Usage| {
                    let (e, r) = (Arc::clone(&e), Arc::clone(&r));
                    async move {
                        e.notify_one();
                        r.notified().await;
                        let given = limits.give_back().await.unwrap();
                        HttpResponse::Ok().body(format!("{given}"))
                    }
                }),
            )
            .route("/r/take", web::get().to(ok)),
    )
    .await;
    let get = |uri: &'static str| test::TestRequest::get().uri(uri).to_request();
    let hold = test::call_and_read_body(&app, get("/r/hold"));
    let meanwhile = async {
        entered.notified().await;
        // The held request took one unit, this one the last: the third is
        // denied by Redis, and the denial is remembered.
        assert_eq!(test::call_service(&app, get("/r/take")).await.status(), 200);
        for _ in 0..2 {
            let res = test::call_service(&app, get("/r/take")).await;
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        }
        release.notify_one();
    };
    let (given, ()) = futures_util::future::join(hold, meanwhile).await;
    assert_eq!(given, "1");
    assert_eq!(redis.llen("floodgate:held:ip:0.0.0.0"), 1);
    // The unit given back is there for the next request.
    let res = test::call_service(&app, get("/r/take")).await;
    assert_eq!(
        res.status(),
        StatusCode::OK,
        "the remembered denial outlived the give-back"
    );
}

#[actix_web::test]
async fn units_an_outer_filter_takes_back_free_a_key_whose_denial_was_remembered() {
    use actix_web::body::MessageBody;
    use actix_web::middleware::from_fn;

    let redis = RedisServer::start();
    let filter = Filter::builder()
        .redis_url(&redis.url())
        .rule("/w/*", Limit::per_minute(3).name("outer"))
        .build()
        .unwrap();
    let holds = web::Data::new(Holds::default());
    let (entered, release) = (&holds.entered, &holds.release);
    let app = test::init_service(
        App::new()
            .app_data(holds.clone())
            .wrap(filter.clone())
            .service(
                web::resource("/w/inner")
                    .wrap(filter.limit(Limit::per_minute(1).name("inner")))
                    .wrap(from_fn(hold_marked))
                    .route(web::get().to(ok)),
            )
            .route("/w/other", web::get().to(ok)),
    )
    .await;
    let get = |uri: &'static str| test::TestRequest::get().uri(uri).to_request();
    // The inner limit is used up (and one outer unit with it).
    assert_eq!(
        test::call_service(&app, get("/w/inner")).await.status(),
        200
    );
    let held = test::TestRequest::get()
        .uri("/w/inner")
        .insert_header(("x-hold", "1"))
        .to_request();
    let held = test::call_service(&app, held);
    let meanwhile = async {
        entered.notified().await;
        // The held request took the second outer unit, this one the last;
        // the next is denied by Redis and the denial remembered.
        assert_eq!(
            test::call_service(&app, get("/w/other")).await.status(),
            200
        );
        for _ in 0..2 {
            let res = test::call_service(&app, get("/w/other")).await;
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        }
        release.notify_one();
    };
    let (held, ()) = futures_util::future::join(held, meanwhile).await;
    // The inner filter denies the held request: the outer unit goes back.
    assert_eq!(held.status(), StatusCode::TOO_MANY_REQUESTS);
    let _ = held.into_body().try_into_bytes();
    assert_eq!(redis.llen("floodgate:outer:ip:0.0.0.0"), 2);
    let res = test::call_service(&app, get("/w/other")).await;
    assert_eq!(
        res.status(),
        StatusCode::OK,
        "the remembered denial outlived the withdrawal"
    );
}

/// A request marked `x-hold` waits in [`hold_marked`] until `release`.
#[derive(Default)]
struct Holds {
    entered: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

async fn hold_marked(
    req: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody>,
) -> Result<actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>, actix_web::Error> {
    if req.headers().contains_key("x-hold") {
        if let Some(holds) = req.app_data::<web::Data<Holds>>() {
            holds.entered.notify_one();
            holds.release.notified().await;
        }
    }
    next.call(req).await
}

/// What a file's rule is refused for, after its place (`FILE: rule "x"
/// (rule 1): WHAT`).
fn toml_refusal(rule: &str) -> String {
    let text = format!("[[rule]]\nname = \"x\"\n{rule}");
    let err = Filter::from_toml_str(&text, "same.toml")
        .err()
        .unwrap_or_else(|| panic!("the file accepted {rule:?}"))
        .to_string();
    let (_, what) = err
        .split_once("same.toml: rule \"x\" (rule 1): ")
        .unwrap_or_else(|| panic!("{err}"));
    what.to_string()
}

/// What a builder's rule guarding `path` is refused for, after its name
/// (`unusable limit "x": WHAT`).
fn builder_refusal(path: &str, limit: Limit) -> String {
    let err = Filter::builder()
        .rule(path, limit.name("x"))
        .build()
        .expect_err("the builder accepted it")
        .to_string();
    let (_, what) = err
        .split_once("unusable limit \"x\": ")
        .unwrap_or_else(|| panic!("{err}"));
    what.to_string()
}

#[actix_web::test]
async fn the_builder_refuses_what_a_file_refuses_in_the_same_words() {
    use floodgate_limiter::rule::{Algorithm, Penalty};
    let day = Duration::from_secs(86_400);
    let cases: Vec<(&str, &str, Limit)> = vec![
        (
            "paths = [\"/*\"]\nlimit = 5\nwindow = \"1m\"\ndeny = \"redirect\"\n",
            "/*",
            Limit::per_minute(5).redirect_to("/err"),
        ),
        (
            "paths = [\"/x\"]\nlimit = 5\nwindow = \"367d\"\n",
            "/x",
            Limit::new(5, 367 * day),
        ),
        (
            "paths = [\"/x\"]\nlimit = 0\nwindow = \"1m\"\n",
            "/x",
            Limit::per_minute(0),
        ),
        (
            "paths = [\"/x\"]\nlimit = 5\nwindow = \"1m\"\ncost = 6\n",
            "/x",
            Limit::per_minute(5).cost(6),
        ),
        (
            "paths = [\"/x\"]\nalgorithm = \"token_bucket\"\nrate = 0.0\nburst = 5\n",
            "/x",
            Limit::token_bucket(0.0, 5),
        ),
        (
            "paths = [\"/x\"]\nlimit = 5\nwindow = \"1m\"\ndeny = \"redirect\"\nerror_page = \"err\"\n",
            "/x",
            Limit::per_minute(5).redirect_to("err"),
        ),
        (
            "paths = [\"/x?a\"]\nlimit = 5\nwindow = \"1m\"\n",
            "/x?a",
            Limit::per_minute(5),
        ),
        (
            "paths = [\"/x\"]\nmethods = [\"FETCH\"]\nlimit = 5\nwindow = \"1m\"\n",
            "/x",
            Limit::per_minute(5).methods(&["FETCH"]),
        ),
        (
            "paths = [\"/x\"]\nlimit = 5\nwindow = \"1m\"\nexempt = [\"10.0.0.0/33\"]\n",
            "/x",
            Limit::per_minute(5).exempt("10.0.0.0/33"),
        ),
    ];
    for (rule, path, limit) in cases {
        let file = toml_refusal(rule);
        assert_eq!(builder_refusal(path, limit), file, "for {rule:?}");
    }
    // A penalty or an algorithm made in code is refused where it is made,
    // in the file's words.
    let secs = Duration::from_secs;
    let penalties = [
        (
            "within = \"10m\", ban = \"2h\"",
            Penalty::new(3, secs(600), secs(7200), secs(3600)),
        ),
        (
            "within = \"400d\", ban = \"1m\"",
            Penalty::new(3, 400 * day, secs(60), secs(3600)),
        ),
    ];
    for (written, penalty) in penalties {
        let rule = format!(
            "paths = [\"/x\"]\nlimit = 5\nwindow = \"1m\"\npenalty = {{ after = 3, {written}, max = \"1h\" }}\n"
        );
        assert_eq!(
            penalty.unwrap_err().to_string(),
            toml_refusal(&rule),
            "for {rule:?}"
        );
    }
    let algorithms = [
        (
            "limit = 0\nwindow = \"1m\"",
            Algorithm::sliding_window(0, secs(60)),
        ),
        (
            "limit = 5\nwindow = \"400d\"",
            Algorithm::fixed_window(5, 400 * day),
        ),
        (
            "algorithm = \"token_bucket\"\nrate = 0.0\nburst = 5",
            Algorithm::token_bucket(0.0, 5),
        ),
        (
            "algorithm = \"token_bucket\"\nrate = 1.0\nburst = 0",
            Algorithm::token_bucket(1.0, 0),
        ),
    ];
    for (written, algorithm) in algorithms {
        let rule = format!("paths = [\"/x\"]\n{written}\n");
        assert_eq!(
            algorithm.unwrap_err().to_string(),
            toml_refusal(&rule),
            "for {rule:?}"
        );
    }
    // The loop is the one a redirect to a page the rule covers makes.
    assert!(
        toml_refusal("paths = [\"/*\"]\nlimit = 5\nwindow = \"1m\"\n").contains("(a loop)"),
        "a file's rule redirects by default"
    );
}

/// How many `FCALL`s Redis has run (`INFO commandstats`), failed ones
/// included.
fn fcalls(redis: &RedisServer) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.connection())
        .unwrap();
    stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_fcall:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

#[actix_web::test]
async fn the_decisions_of_one_tick_reach_the_dispatcher_threads_as_one_call() {
    // With dispatcher threads, what the requests of one scheduler tick ask
    // goes to the threads together: one call decides them all, and each
    // key still gets exactly its limit.
    use common::pinned::{check, sliding};
    use floodgate_limiter::limiter::{Dispatch, LimiterOptions};
    let redis = RedisServer::start();
    let mut config =
        floodgate_limiter::config::Config::parse("", std::path::Path::new("test.toml")).unwrap();
    config.redis.url = redis.url();
    config.redis.timeout = Duration::from_secs(5);
    let options = LimiterOptions {
        dispatch: Dispatch::Threads,
        ..LimiterOptions::default()
    };
    let limiter = floodgate_limiter::limiter::Limiter::new(&config.redis, options).unwrap();
    // The library is loaded by the first call.
    let warm = limiter.decide(vec![check("tick:warm", sliding(1, 60_000), 1)]);
    assert!(warm.await.unwrap().allowed);
    let before = fcalls(&redis);
    // Each request spends a moment before it asks, as a handler reading
    // its body would: threads that took the jobs one by one would have
    // sent the first ones by the time the last is asked.
    let limiter = &limiter;
    let asked = (0..200).map(|i| async move {
        let busy = std::time::Instant::now();
        while busy.elapsed() < Duration::from_micros(20) {
            std::hint::spin_loop();
        }
        let key = format!("tick:{}", i % 4);
        limiter
            .decide(vec![check(&key, sliding(30, 60_000), 1)])
            .await
    });
    let decisions = futures_util::future::join_all(asked).await;
    let allowed = decisions
        .iter()
        .filter(|d| d.as_ref().unwrap().allowed)
        .count();
    assert_eq!(allowed, 4 * 30);
    assert_eq!(
        fcalls(&redis) - before,
        1,
        "one call for the tick's 200 decisions"
    );
    for key in 0..4 {
        assert_eq!(redis.units(&format!("tick:{key}")), 30);
    }
}

// ---------------------------------------------------------------------------
// What a denied or refused request gets, by its Accept; CORS
// ---------------------------------------------------------------------------

/// The Accept a browser sends with a page request.
const BROWSER: &str = "text/html,application/xhtml+xml,*/*;q=0.8";

/// `GET uri` with these header fields.
fn get_with(uri: &str, headers: &[(&'static str, &'static str)]) -> actix_http::Request {
    let mut req = test::TestRequest::get().uri(uri);
    for h in headers {
        req = req.insert_header(*h);
    }
    req.to_request()
}

fn field<B>(res: &actix_web::dev::ServiceResponse<B>, name: &str) -> Option<String> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

#[actix_web::test]
async fn a_denial_is_json_unless_the_client_asks_for_html() {
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "[[rule]]\nname = \"api\"\npaths = [\"/api\"]\ndeny = \"status\"\nlimit = 1\nwindow = \"1m\"\n\
         [[rule]]\nname = \"page\"\npaths = [\"/page\"]\ndeny = \"redirect\"\nerror_page = \"/err\"\nlimit = 1\nwindow = \"1m\"\n",
    );
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/api", web::get().to(ok))
            .route("/page", web::get().to(ok)),
    )
    .await;
    let res = test::call_service(&app, get_with("/api", &[])).await;
    assert_eq!(res.status(), StatusCode::OK);
    // No Accept (curl), */* (fetch), JSON: the 429 JSON.
    for accept in [None, Some("*/*"), Some("application/json")] {
        let headers: Vec<_> = accept.map(|a| ("accept", a)).into_iter().collect();
        let res = test::call_service(&app, get_with("/api", &headers)).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{accept:?}");
        let retry: u64 = field(&res, "retry-after").unwrap().parse().unwrap();
        assert!((1..=60).contains(&retry), "{retry}");
        assert_eq!(field(&res, "cache-control").as_deref(), Some("no-store"));
        assert_eq!(
            field(&res, "content-type").as_deref(),
            Some("application/json"),
            "{accept:?}"
        );
        let body: serde_json::Value = test::read_body_json(res).await;
        assert_eq!(
            body,
            serde_json::json!({"error": "rate_limited", "rule": "api", "retry_after": retry})
        );
    }
    // A browser: the HTML page.
    let res = test::call_service(&app, get_with("/api", &[("accept", BROWSER)])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(field(&res, "retry-after").is_some());
    assert_eq!(field(&res, "cache-control").as_deref(), Some("no-store"));
    assert!(field(&res, "content-type")
        .unwrap()
        .starts_with("text/html"));
    let page = String::from_utf8(test::read_body(res).await.to_vec()).unwrap();
    assert!(page.to_lowercase().contains("<html"), "{page}");

    // A redirect rule: JSON for a client that asks for JSON only, else 303.
    let res = test::call_service(&app, get_with("/page", &[])).await;
    assert_eq!(res.status(), StatusCode::OK);
    let res = test::call_service(&app, get_with("/page", &[("accept", "application/json")])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = field(&res, "retry-after").unwrap().parse().unwrap();
    let body: serde_json::Value = test::read_body_json(res).await;
    assert_eq!(
        body,
        serde_json::json!({"error": "rate_limited", "rule": "page", "retry_after": retry})
    );
    for accept in [BROWSER, "text/html"] {
        let res = test::call_service(&app, get_with("/page", &[("accept", accept)])).await;
        assert_eq!(res.status(), StatusCode::SEE_OTHER, "{accept}");
        let retry = field(&res, "retry-after").unwrap();
        assert_eq!(
            field(&res, "location"),
            Some(format!("/err?rule=page&retry_after={retry}"))
        );
    }
}

#[actix_web::test]
async fn a_refusal_is_json_unless_the_client_asks_for_html() {
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "[server]\nmax_form = \"1KiB\"\n[[rule]]\nname = \"sms\"\npaths = [\"/sms\"]\nkey = \"form:phone\"\ndeny = \"status\"\nlimit = 5\nwindow = \"1m\"\n",
    );
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/sms", web::post().to(ok))
            .route("/hello", web::get().to(ok)),
    )
    .await;
    let post = |content_type: &'static str, body: String, accept: Option<&'static str>| {
        let mut req = test::TestRequest::post()
            .uri("/sms")
            .insert_header(("content-type", content_type))
            .set_payload(body);
        if let Some(a) = accept {
            req = req.insert_header(("accept", a));
        }
        req.to_request()
    };
    let form = "application/x-www-form-urlencoded";
    let big = || format!("phone=1&pad={}", "a".repeat(2000));
    // 413, 415, 400 (a key field twice: the rule's key is at fault).
    let cases: [(&str, String, StatusCode, &str, Option<&str>); 3] = [
        (
            form,
            big(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            None,
        ),
        (
            "application/x-www-form-urlencoded; charset=nope",
            "phone=1".into(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            None,
        ),
        (
            form,
            "phone=1&phone=2".into(),
            StatusCode::BAD_REQUEST,
            "bad_request",
            Some("sms"),
        ),
    ];
    for (ct, body, status, error, rule) in cases {
        for accept in [None, Some("*/*")] {
            let res = test::call_service(&app, post(ct, body.clone(), accept)).await;
            assert_eq!(res.status(), status, "{error} {accept:?}");
            assert_eq!(
                field(&res, "content-type").as_deref(),
                Some("application/json")
            );
            assert_eq!(field(&res, "cache-control").as_deref(), Some("no-store"));
            let v: serde_json::Value = test::read_body_json(res).await;
            assert_eq!(v["error"], error, "{v}");
            assert_eq!(v["rule"], serde_json::json!(rule), "{v}");
            assert!(!v["detail"].as_str().unwrap().is_empty(), "{v}");
        }
        let res = test::call_service(&app, post(ct, body, Some(BROWSER))).await;
        assert_eq!(res.status(), status, "{error}: a browser");
        assert!(field(&res, "content-type")
            .unwrap()
            .starts_with("text/html"));
        let page = String::from_utf8(test::read_body(res).await.to_vec()).unwrap();
        assert!(page.contains("<html"), "{page}");
        assert!(page.contains(&status.as_u16().to_string()), "{page}");
    }
    // 431: a header block over 32 KiB.
    let huge: &'static str = Box::leak("a".repeat(33 * 1024).into_boxed_str());
    let res = test::call_service(&app, get_with("/hello", &[("x-pad", huge)])).await;
    assert_eq!(res.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    let v: serde_json::Value = test::read_body_json(res).await;
    assert_eq!(v["error"], "header_fields_too_large");
    assert_eq!(v["rule"], serde_json::Value::Null);
    // Nothing was counted.
    assert_eq!(redis.keys("floodgate:*"), Vec::<String>::new());
}

#[actix_web::test]
async fn a_cors_preflight_is_never_counted_nor_denied() {
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "[[rule]]\nname = \"one\"\npaths = [\"/hello\"]\ndeny = \"status\"\nlimit = 1\nwindow = \"1m\"\n",
    );
    let app =
        test::init_service(App::new().wrap(filter).route("/hello", web::route().to(ok))).await;
    let preflight = || {
        test::TestRequest::default()
            .method(actix_web::http::Method::OPTIONS)
            .uri("/hello")
            .insert_header(("origin", "https://app.example"))
            .insert_header(("access-control-request-method", "GET"))
            .to_request()
    };
    for _ in 0..3 {
        let res = test::call_service(&app, preflight()).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(field(&res, "ratelimit"), None);
    }
    assert_eq!(redis.keys("floodgate:*"), Vec::<String>::new());
    let res = test::call_service(&app, get_with("/hello", &[])).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        field(&res, "ratelimit").as_deref(),
        Some("\"one\";r=0;t=60")
    );
    // A plain OPTIONS is a request like any other.
    let options = test::TestRequest::default()
        .method(actix_web::http::Method::OPTIONS)
        .uri("/hello")
        .to_request();
    let res = test::call_service(&app, options).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// The names in `Access-Control-Expose-Headers`, lower case.
fn exposed<B>(res: &actix_web::dev::ServiceResponse<B>) -> Option<Vec<String>> {
    field(res, "access-control-expose-headers")
        .map(|v| v.split(',').map(|n| n.trim().to_lowercase()).collect())
}

/// The rate-limit fields a response carries, in the order given.
fn rate_limit_fields<B>(res: &actix_web::dev::ServiceResponse<B>) -> Vec<String> {
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

#[actix_web::test]
async fn scripts_of_other_origins_are_let_read_the_rate_limit_fields() {
    let redis = RedisServer::start();
    let filter = toml_filter(
        &redis,
        "[defaults]\ndeny = \"status\"\n\
         [[rule]]\nname = \"std\"\npaths = [\"/hello\"]\nlimit = 2\nwindow = \"1m\"\n\
         [[rule]]\nname = \"own\"\npaths = [\"/own\"]\nlimit = 2\nwindow = \"1m\"\n\
         [[rule]]\nname = \"x\"\npaths = [\"/hello\"]\nlimit = 5\nwindow = \"1m\"\nheaders = \"x-ratelimit\"\n",
    );
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/hello", web::get().to(ok))
            .route(
                "/own",
                web::get().to(|| async {
                    HttpResponse::Ok()
                        .insert_header(("access-control-expose-headers", "X-Request-Id, RateLimit"))
                        .body("ok")
                }),
            ),
    )
    .await;
    let origin = ("origin", "https://app.example");
    let res = test::call_service(&app, get_with("/hello", &[origin])).await;
    assert_eq!(res.status(), StatusCode::OK);
    let mut names = exposed(&res).expect("Access-Control-Expose-Headers");
    names.sort();
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
    let res = test::call_service(&app, get_with("/hello", &[])).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(field(&res, "ratelimit").is_some());
    assert_eq!(exposed(&res), None);
    // A denial: Retry-After too.
    let res = test::call_service(&app, get_with("/hello", &[origin])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let mut names = exposed(&res).expect("Access-Control-Expose-Headers");
    names.sort();
    assert!(names.contains(&"retry-after".to_string()), "{names:?}");
    assert_eq!(names, rate_limit_fields(&res));
    // After the application's own names, none twice.
    let res = test::call_service(&app, get_with("/own", &[origin])).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        exposed(&res).unwrap(),
        ["x-request-id", "ratelimit", "ratelimit-policy"]
    );
}

/// A bypass on the whole filter lets the requests it names past every
/// rule, neither counted nor denied; and a handler reads who a rule's
/// lookup found from `Usage`, without looking the caller up again.
#[actix_web::test]
async fn a_bypass_passes_every_rule_and_handlers_read_the_lookups_identity() {
    use floodgate_limiter::rule::Identity;
    let redis = RedisServer::start();
    let filter = Filter::builder()
        .redis_url(&redis.url())
        .bypass(|req: &RequestHead| req.header("x-test-run") == Some("t-1"))
        .rule("/one", Limit::per_minute(1).name("one"))
        .rule(
            "/api",
            Limit::per_minute(1)
                .key(Key::lookup("api-key", |req: RequestHead| async move {
                    let token = req.header("x-api-key")?.to_owned();
                    Some(Identity::new(token).with_limit(5))
                }))
                .name("api"),
        )
        .build()
        .unwrap();
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/one", web::get().to(ok))
            .route(
                "/api",
                web::get().to(|usage: Usage| async move {
                    let found = usage.get("api").and_then(|r| r.identity);
                    HttpResponse::Ok().body(format!(
                        "{}/{}",
                        found.as_ref().map_or("-", |i| i.id()),
                        found.as_ref().and_then(|i| i.limit()).unwrap_or(0)
                    ))
                }),
            ),
    )
    .await;
    let get = |path: &str, header: Option<(&str, &str)>| {
        let mut req = test::TestRequest::get().uri(path);
        if let Some(h) = header {
            req = req.insert_header(h);
        }
        req.to_request()
    };
    for _ in 0..3 {
        let res = test::call_service(&app, get("/one", Some(("x-test-run", "t-1")))).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().get("ratelimit-policy").is_none());
    }
    assert!(
        redis.keys("floodgate:one:*").is_empty(),
        "bypassed requests counted"
    );
    let wrong = get("/one", Some(("x-test-run", "nope")));
    assert_eq!(
        test::call_service(&app, wrong).await.status(),
        StatusCode::OK
    );
    let again = get("/one", None);
    assert_eq!(
        test::call_service(&app, again).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    let res = test::call_service(&app, get("/api", Some(("x-api-key", "k-9")))).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(test::read_body(res).await, "k-9/5");
    let res = test::call_service(&app, get("/api", None)).await;
    assert_eq!(test::read_body(res).await, "-/0");
}

#[actix_web::test]
async fn checks_of_one_call_on_one_key_never_take_more_than_its_limit() {
    // Two checks on one key in one call are decided as one check of their
    // summed cost: apart, each would see the count before the call, and
    // together they would take more than the limit holds.
    use common::pinned::{bucket, check, sliding};
    use floodgate_limiter::limiter::{LimiterError, LimiterOptions};
    let redis = RedisServer::start();
    let mut config =
        floodgate_limiter::config::Config::parse("", std::path::Path::new("test.toml")).unwrap();
    config.redis.url = redis.url();
    config.redis.timeout = Duration::from_secs(5);
    let limiter =
        floodgate_limiter::limiter::Limiter::new(&config.redis, LimiterOptions::default()).unwrap();
    let key = "twice:k";
    let other = "twice:other";
    let three = sliding(3, 60_000);
    let twice = |cost| {
        vec![
            check(key, three, cost),
            check(other, sliding(10, 60_000), 1),
            check(key, three, cost),
        ]
    };
    // 2 + 2 on a limit of 3 can never fit: refused as a cost above the
    // limit is, and nothing taken.
    let e = limiter.decide(twice(2)).await.unwrap_err();
    assert!(matches!(e, LimiterError::Check(_)), "{e:?}");
    assert_eq!(redis.units(key), 0);
    // 1 + 1: allowed, one outcome per check, the same for both on the key.
    let d = limiter.decide(twice(1)).await.unwrap();
    assert!(d.allowed);
    assert_eq!(d.outcomes.len(), 3);
    assert_eq!(d.outcomes[0].remaining, 1);
    assert_eq!(d.outcomes[0], d.outcomes[2]);
    assert_eq!(d.outcomes[1].remaining, 9);
    assert_eq!(redis.units(key), 2);
    // The peek says what the decision would: 2 do not fit in the 1 left.
    let peeked = limiter.peek(twice(1)).await.unwrap();
    assert_eq!(peeked.len(), 3);
    assert!(!peeked[0].allowed && !peeked[2].allowed && peeked[1].allowed);
    // 1 + 1 more: denied, and nothing taken from either key.
    let d = limiter.decide(twice(1)).await.unwrap();
    assert!(!d.allowed);
    assert_eq!(redis.units(key), 2);
    assert_eq!(redis.units(other), 1);
    // One check on the key still fits.
    assert!(
        limiter
            .decide(vec![check(key, three, 1)])
            .await
            .unwrap()
            .allowed
    );
    assert_eq!(redis.units(key), 3);
    // Two different questions of one key cannot be joined: refused.
    let mixed = vec![check(key, three, 1), check(key, bucket(1.0, 3), 1)];
    assert!(matches!(
        limiter.decide(mixed).await,
        Err(LimiterError::Check(_))
    ));
    // The local fallback joins them the same way.
    let here = "twice:here";
    let d = floodgate_limiter::__private::decide_here(
        &limiter,
        &[check(here, three, 2), check(here, three, 1)],
    )
    .unwrap();
    assert!(d.allowed);
    assert_eq!(d.outcomes[0].remaining, 0);
    let d = floodgate_limiter::__private::decide_here(
        &limiter,
        &[check(here, three, 1), check(here, three, 1)],
    )
    .unwrap();
    assert!(!d.allowed);
}

#[actix_web::test]
async fn a_limiter_refuses_in_code_what_a_file_could_not_hold() {
    // Public fields can be set to anything: the limiter refuses, as the
    // file's checks do, what it could not work with (a pool of 0 would
    // otherwise panic inside the pool).
    use floodgate_limiter::limiter::{Limiter, LimiterError, LimiterOptions};
    let base = floodgate_limiter::config::Config::parse("", std::path::Path::new("t.toml"))
        .unwrap()
        .redis;
    let refused = |redis: &floodgate_limiter::config::RedisConfig, options| match Limiter::new(
        redis, options,
    ) {
        Err(LimiterError::Other(why)) => why,
        other => panic!("{other:?}"),
    };
    let mut r = base.clone();
    r.pool_size = 0;
    assert!(refused(&r, LimiterOptions::default())
        .starts_with("[redis] pool_size: must be between 3 and 1024"));
    let mut r = base.clone();
    r.timeout = Duration::ZERO;
    assert!(refused(&r, LimiterOptions::default()).starts_with("[redis] timeout"));
    let mut r = base.clone();
    r.key_prefix = "!x".into();
    assert!(refused(&r, LimiterOptions::default()).contains("must not start with \"!\""));
    // A Cluster and Sentinels at once, or Sentinels without the master's
    // name: refused rather than half used.
    let mut r = base.clone();
    r.cluster = vec!["redis://127.0.0.1:1".into()];
    r.sentinel = vec!["redis://127.0.0.1:2".into()];
    r.sentinel_master = "m".into();
    assert!(refused(&r, LimiterOptions::default()).contains("cannot both be set"));
    let mut r = base.clone();
    r.sentinel = vec!["redis://127.0.0.1:2".into()];
    assert!(refused(&r, LimiterOptions::default()).contains("needs sentinel_master"));
    let options = LimiterOptions {
        breaker: Duration::from_secs(3600),
        ..LimiterOptions::default()
    };
    assert!(refused(&base, options).starts_with("[limiter] breaker"));
}

#[actix_web::test]
async fn a_builder_refuses_settings_a_file_could_not_hold() {
    // Refused before anything starts: no Redis is needed.
    let refused = |b: floodgate_limiter::FilterBuilder| match b.build() {
        Err(e) => e.to_string(),
        Ok(_) => panic!("built"),
    };
    let why = refused(Filter::builder().max_form(0));
    assert_eq!(
        why,
        "unusable setting max_form: must be between 1 byte and 64MiB, got 0 bytes"
    );
    let why = refused(Filter::builder().max_form(usize::MAX));
    assert!(why.starts_with("unusable setting max_form"), "{why}");
    let why = refused(Filter::builder().pool_size(0));
    assert!(
        why.contains("[redis] pool_size: must be between 3 and 1024"),
        "{why}"
    );
}
