//! The API a JSON service needs, against a real redis-server: keys read
//! from JSON bodies (`json:NAME`, and `body:NAME` shared with forms),
//! bodies refused rather than read otherwise than the handler reads them,
//! `on_missing_key = "reject"`, key functions that look the caller up and
//! choose its quota, skip predicates, TOML text whose every setting is
//! used, and key values kept out of Redis key names.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpResponse, HttpServer};
use floodgate_limiter::rule::{Identity, OnMissingKey};
use floodgate_limiter::{Filter, Key, Limit};
use serde::Deserialize;

use common::RedisServer;

fn filter(redis: &RedisServer, rules: &str) -> Filter {
    let text = format!("[redis]\nurl = \"{}\"\n{rules}", redis.url());
    Filter::builder()
        .toml_rules(&text, "app.toml")
        .build()
        .unwrap()
}

/// `POST /echo`: the body exactly as the handler received it.
async fn echo(body: web::Bytes) -> HttpResponse {
    HttpResponse::Ok().body(body)
}

#[derive(Deserialize)]
struct Login {
    username: String,
    #[allow(dead_code)]
    password: String,
}

/// `POST /login`: every password is wrong.
async fn login(body: web::Json<Login>) -> HttpResponse {
    HttpResponse::Unauthorized().body(format!("wrong password for {}", body.username))
}

fn json_post(uri: &str, body: &'static str) -> test::TestRequest {
    test::TestRequest::post()
        .uri(uri)
        .insert_header(("content-type", "application/json"))
        .set_payload(body)
}

#[actix_web::test]
async fn a_json_login_is_limited_per_account_under_concurrency() {
    let redis = RedisServer::start();
    let filter = filter(
        &redis,
        "[[rule]]\nname = \"login\"\npaths = [\"/login\"]\nkey = \"json:username\"\nlimit = 5\nwindow = \"1m\"\ncount = \"failures\"\ndeny = \"status\"\n",
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = HttpServer::new(move || {
        App::new()
            .wrap(filter.clone())
            .route("/login", web::post().to(login))
    })
    .workers(2)
    .listen(listener)
    .unwrap()
    .run();
    let handle = server.handle();
    actix_web::rt::spawn(server);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/login");
    let send = |user: &'static str| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            http.post(&url)
                .header("content-type", "application/json")
                .body(format!(r#"{{"username":"{user}","password":"guess"}}"#))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let all = futures_util::future::join_all((0..30).map(|_| send("alice"))).await;
    let admitted = all.iter().filter(|s| **s == 401).count();
    let denied = all.iter().filter(|s| **s == 429).count();
    assert_eq!((admitted, denied), (5, 25), "{all:?}");
    // Another account from the same address has its own five.
    assert_eq!(send("bob").await, 401);
    // Five units (entries are `TIME:TOTAL:UNITS`; one call may merge the
    // requests it admits at one moment).
    let newest: String = redis::cmd("LINDEX")
        .arg("floodgate:login:json:alice")
        .arg(0)
        .query(&mut redis.connection())
        .unwrap();
    assert_eq!(newest.split(':').nth(1), Some("5"));
    drop(handle.stop(false));
}

/// A `json:username` rule on `/login`, 2 a minute, for `configure`d
/// builder (told what the app's `web::Json` reads).
fn login_filter(
    redis: &RedisServer,
    configure: impl FnOnce(floodgate_limiter::FilterBuilder) -> floodgate_limiter::FilterBuilder,
) -> Filter {
    let text = format!(
        "[redis]\nurl = \"{}\"\n[[rule]]\nname = \"login\"\npaths = [\"/login\"]\nkey = \"json:username\"\nlimit = 2\nwindow = \"1m\"\ndeny = \"status\"\n",
        redis.url()
    );
    configure(Filter::builder().toml_rules(&text, "app.toml"))
        .build()
        .unwrap()
}

/// `POST /login` as `user`, with `content_type` (`None`: no Content-Type).
fn login_as(user: &str, content_type: Option<&str>) -> test::TestRequest {
    let req = test::TestRequest::post()
        .uri("/login")
        .set_payload(format!(r#"{{"username":"{user}","password":"guess"}}"#));
    match content_type {
        Some(ct) => req.insert_header(("content-type", ct.to_string())),
        None => req,
    }
}

#[actix_web::test]
async fn json_keys_read_every_body_the_handlers_web_json_reads() {
    let redis = RedisServer::start();
    // actix's default JsonConfig reads any `*/json` and `*+json` type.
    let filter = login_filter(&redis, |b| b);
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/login", web::post().to(login)),
    )
    .await;
    let types = [
        "text/json",
        "application/json+x",
        "application/vnd.api+json",
    ];
    for ct in types {
        let (alice, bob) = (format!("alice-{ct}"), format!("bob-{ct}"));
        for user in [&alice, &alice, &bob] {
            let res = test::call_service(&app, login_as(user, Some(ct)).to_request()).await;
            assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{ct} {user}");
        }
        let res = test::call_service(&app, login_as(&alice, Some(ct)).to_request()).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{ct}");
    }
    assert_eq!(redis.keys("floodgate:login:json:*").len(), 2 * types.len());
    // A type the handler refuses is not read (the handler answers 400).
    let res = test::call_service(&app, login_as("carol", Some("text/plain")).to_request()).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(redis.keys("floodgate:login:ip:*").len(), 1);

    // An app whose JsonConfig reads bodies without a Content-Type (and so
    // of any type): the filter, told so, reads them too.
    let redis = RedisServer::start();
    let filter = login_filter(&redis, |b| b.json_content_type_required(false));
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .app_data(web::JsonConfig::default().content_type_required(false))
            .route("/login", web::post().to(login)),
    )
    .await;
    let types = [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
    ];
    for (i, ct) in types.into_iter().enumerate() {
        let (dave, erin) = (format!("dave-{i}"), format!("erin-{i}"));
        for user in [&dave, &dave, &erin] {
            let res = test::call_service(&app, login_as(user, ct).to_request()).await;
            assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{ct:?} {user}");
        }
        let res = test::call_service(&app, login_as(&dave, ct).to_request()).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{ct:?}");
    }
    // An empty body names no one: keyed by address, as before.
    let res = test::call_service(&app, test::TestRequest::post().uri("/login").to_request()).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(redis.keys("floodgate:login:ip:*").len(), 1);

    // A content-type predicate (JsonConfig::content_type's): text/plain too.
    let redis = RedisServer::start();
    let filter = login_filter(&redis, |b| {
        b.json_content_type(|mime| mime == actix_web::mime::TEXT_PLAIN)
    });
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .app_data(
                web::JsonConfig::default().content_type(|mime| mime == actix_web::mime::TEXT_PLAIN),
            )
            .route("/login", web::post().to(login)),
    )
    .await;
    for user in ["frank", "frank", "grace"] {
        let res = test::call_service(&app, login_as(user, Some("text/plain")).to_request()).await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{user}");
    }
    let res = test::call_service(&app, login_as("frank", Some("text/plain")).to_request()).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    // Still not a type the handler refuses.
    let res = test::call_service(&app, login_as("heidi", Some("text/html")).to_request()).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(redis.keys("floodgate:login:json:*").len(), 2);
}

// Phone numbers as keys: the `e164` feature.
#[cfg(feature = "e164")]
#[actix_web::test]
async fn a_form_and_a_json_body_share_one_body_counter() {
    let redis = RedisServer::start();
    let filter = filter(
        &redis,
        "[[rule]]\nname = \"sms\"\npaths = [\"/echo\"]\nkey = \"body:phone\"\nnormalize = \"e164\"\nlimit = 3\nwindow = \"1m\"\ndeny = \"status\"\n",
    );
    let app =
        test::init_service(App::new().wrap(filter).route("/echo", web::post().to(echo))).await;
    let form = |body: &'static str| {
        test::TestRequest::post()
            .uri("/echo")
            .insert_header(("content-type", "application/x-www-form-urlencoded"))
            .set_payload(body)
            .to_request()
    };
    for req in [
        form("phone=%2B1+555+010+7777"),
        form("phone=15550107777"),
        json_post("/echo", r#"{"phone":"(555) 010-7777"}"#).to_request(),
    ] {
        let res = test::call_service(&app, req).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    let res = test::call_service(
        &app,
        json_post("/echo", r#"{"phone":"+15550107777"}"#).to_request(),
    )
    .await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let res = test::call_service(&app, form("phone=%2B15550107777")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(redis.llen("floodgate:sms:body:+15550107777"), 3);
    // Another number has its own counter; the handler gets the body unchanged.
    let body = r#" {"phone": "+15550107778", "x": [1, 2]} "#;
    let res = test::call_service(&app, json_post("/echo", body).to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(test::read_body(res).await, body.as_bytes());
}

#[actix_web::test]
async fn json_bodies_the_handler_could_read_otherwise_are_refused() {
    let redis = RedisServer::start();
    let text = format!(
        "[server]\nmax_form = \"1KiB\"\n[redis]\nurl = \"{}\"\n[[rule]]\nname = \"u\"\npaths = [\"/echo\"]\nkey = \"json:user\"\nlimit = 100\nwindow = \"1m\"\ndeny = \"status\"\n",
        redis.url()
    );
    let filter = Filter::builder()
        .toml_rules(&text, "app.toml")
        .build()
        .unwrap();
    let app =
        test::init_service(App::new().wrap(filter).route("/echo", web::post().to(echo))).await;
    for (body, status) in [
        (r#"{"user":"a"}"#, StatusCode::OK),
        (r#"{"user":"a","user":"b"}"#, StatusCode::BAD_REQUEST),
        (r#"{"user":"a","us\u0065r":"a"}"#, StatusCode::BAD_REQUEST),
        (r#"{"user":"a""#, StatusCode::BAD_REQUEST),
        (r#"{"user":"a"} {}"#, StatusCode::BAD_REQUEST),
        ("\u{feff}{\"user\":\"a\"}", StatusCode::BAD_REQUEST),
        // Other members may repeat; nested ones are not the key.
        (
            r#"{"a":1,"a":2,"b":{"user":"x"},"user":"c"}"#,
            StatusCode::OK,
        ),
    ] {
        let res = test::call_service(&app, json_post("/echo", body).to_request()).await;
        assert_eq!(res.status(), status, "{body}");
    }
    let res = test::call_service(
        &app,
        json_post("/echo", "")
            .set_payload(b"{\"user\":\"\xff\"}".to_vec())
            .to_request(),
    )
    .await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let big = format!(r#"{{"user":"a","pad":"{}"}}"#, "x".repeat(2000));
    let res = test::call_service(&app, json_post("/echo", "").set_payload(big).to_request()).await;
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let res = test::call_service(
        &app,
        json_post("/echo", r#"{"user":"a"}"#)
            .insert_header(("content-type", "application/json; charset=utf-16"))
            .to_request(),
    )
    .await;
    assert_eq!(res.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    // A number keys by its JSON text; a body of another type has no such
    // member, and is keyed by address.
    let res = test::call_service(&app, json_post("/echo", r#"{"user":42}"#).to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let res = test::call_service(
        &app,
        test::TestRequest::post()
            .uri("/echo")
            .insert_header(("content-type", "text/plain"))
            .set_payload(r#"{"user":"a","user":"b"}"#)
            .to_request(),
    )
    .await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(redis.llen("floodgate:u:json:a"), 1);
    assert_eq!(redis.llen("floodgate:u:json:c"), 1);
    assert_eq!(redis.llen("floodgate:u:json:42"), 1);
    assert_eq!(redis.keys("floodgate:u:ip:*").len(), 1);
}

#[actix_web::test]
async fn a_rule_that_rejects_missing_keys_answers_400_json() {
    let redis = RedisServer::start();
    let filter = filter(
        &redis,
        "[defaults]\non_missing_key = \"reject\"\n[[rule]]\nname = \"by-user\"\npaths = [\"/echo\"]\nkey = [\"json:user\", \"ip\"]\nlimit = 5\nwindow = \"1m\"\n[[rule]]\nname = \"by-token\"\npaths = [\"/other\"]\nkey = \"header:x-token\"\nlimit = 5\nwindow = \"1m\"\non_missing_key = \"ip\"\n",
    );
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/echo", web::post().to(echo))
            .route("/other", web::get().to(HttpResponse::Ok)),
    )
    .await;
    for body in [
        r#"{"name":"a"}"#,
        r#"{"user":null}"#,
        r#"{"user":""}"#,
        "[]",
    ] {
        let res = test::call_service(&app, json_post("/echo", body).to_request()).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{body}");
        let mut v: serde_json::Value = test::read_body_json(res).await;
        let detail = v["detail"].take();
        assert!(
            detail.as_str().is_some_and(|d| d.contains("json:user")),
            "{detail}"
        );
        assert_eq!(
            v,
            serde_json::json!({"error": "missing_key", "rule": "by-user", "key": "json:user", "detail": null})
        );
    }
    let res = test::call_service(&app, json_post("/echo", r#"{"user":"a"}"#).to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    // The rule's own setting wins over [defaults].
    let res = test::call_service(&app, test::TestRequest::get().uri("/other").to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(redis.keys("floodgate:by-user:*").len() == 1);
}

#[actix_web::test]
async fn an_async_key_function_chooses_each_callers_quota() {
    let redis = RedisServer::start();
    let filter = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let key = Key::lookup(
        "api-key",
        |req: floodgate_limiter::RequestHead| async move {
            let token = req.header("x-api-key")?.to_owned();
            // A lookup that takes a while, as a database's would.
            actix_web::rt::time::sleep(Duration::from_millis(1)).await;
            token
                .starts_with("k-")
                .then(|| Identity::new(token).with_limit(100))
        },
    );
    let limit = Limit::per_minute(10).key(key).name("api");
    let app = test::init_service(
        App::new()
            .wrap(filter.limit(limit))
            .route("/a", web::get().to(HttpResponse::Ok)),
    )
    .await;
    let get = |token: Option<&'static str>| {
        let mut req = test::TestRequest::get().uri("/a");
        if let Some(t) = token {
            req = req.insert_header(("x-api-key", t));
        }
        req.to_request()
    };
    for _ in 0..10 {
        assert_eq!(
            test::call_service(&app, get(None)).await.status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        test::call_service(&app, get(None)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // An unknown token is anonymous: keyed by address, already used up.
    assert_eq!(
        test::call_service(&app, get(Some("nope"))).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    for i in 0..100 {
        let res = test::call_service(&app, get(Some("k-1"))).await;
        assert_eq!(res.status(), StatusCode::OK, "request {i}");
        if i == 0 {
            let policy = res.headers().get("ratelimit-policy").unwrap();
            assert_eq!(policy.to_str().unwrap(), "\"api\";q=100;w=60");
        }
    }
    assert_eq!(
        test::call_service(&app, get(Some("k-1"))).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(redis.llen("floodgate:api:custom:api-key=k-1"), 100);
}

#[actix_web::test]
async fn a_skip_predicate_lets_requests_past_a_limit() {
    let redis = RedisServer::start();
    let filter = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let limit = Limit::per_minute(1)
        .name("one")
        .skip_if(|req| req.headers().contains_key("x-internal-job"));
    let app = test::init_service(
        App::new()
            .wrap(filter.limit(limit))
            .route("/a", web::get().to(HttpResponse::Ok)),
    )
    .await;
    let internal = || {
        test::TestRequest::get()
            .uri("/a")
            .insert_header(("x-internal-job", "1"))
            .to_request()
    };
    for _ in 0..3 {
        let res = test::call_service(&app, internal()).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(!res.headers().contains_key("ratelimit"));
    }
    let plain = || test::TestRequest::get().uri("/a").to_request();
    assert_eq!(
        test::call_service(&app, plain()).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        test::call_service(&app, plain()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        test::call_service(&app, internal()).await.status(),
        StatusCode::OK
    );
}

#[actix_web::test]
async fn toml_text_given_to_the_builder_is_used_whole() {
    let redis = RedisServer::start();
    let text = format!(
        "[server]\ntrusted_proxies = [\"10.0.0.0/8\"]\n[redis]\nurl = \"{}\"\nkey_prefix = \"myapp\"\n[[rule]]\nname = \"r\"\npaths = [\"/a\"]\nlimit = 1\nwindow = \"1m\"\ndeny = \"status\"\n",
        redis.url()
    );
    let filter = Filter::builder()
        .toml_rules(&text, "app.toml")
        .build()
        .unwrap();
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .route("/a", web::get().to(HttpResponse::Ok)),
    )
    .await;
    let from = |client: &'static str| {
        test::TestRequest::get()
            .uri("/a")
            .peer_addr("10.0.0.1:4000".parse().unwrap())
            .insert_header(("x-forwarded-for", client))
            .to_request()
    };
    assert_eq!(
        test::call_service(&app, from("9.9.9.9")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        test::call_service(&app, from("8.8.8.8")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        test::call_service(&app, from("9.9.9.9")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        redis.keys("*"),
        vec![
            "myapp:r:ip:8.8.8.8".to_string(),
            "myapp:r:ip:9.9.9.9".to_string()
        ]
    );

    // What it cannot use, or what code sets too, is refused with the reason.
    let err = |text: &str, builder: floodgate_limiter::FilterBuilder| {
        builder
            .toml_rules(text, "app.toml")
            .build()
            .unwrap_err()
            .to_string()
    };
    let e = err("[server]\nbind = \"0.0.0.0:80\"\n", Filter::builder());
    assert!(
        e.starts_with("app.toml: [server] bind: is a setting of the floodgate server"),
        "{e}"
    );
    let e = err("[site]\ntitle = \"x\"\n", Filter::builder());
    assert!(e.starts_with("app.toml: [site] title:"), "{e}");
    let e = err(
        "[redis]\nkey_prefix = \"a\"\n",
        Filter::builder().key_prefix("b"),
    );
    assert!(
        e.starts_with("app.toml: [redis]: is set here and in code"),
        "{e}"
    );
    let e = err(
        "[server]\ntrusted_proxies = [\"10.0.0.0/33\"]\n",
        Filter::builder(),
    );
    assert_eq!(
        e,
        "app.toml: [server] trusted_proxies: \"10.0.0.0/33\" is not an IP address or CIDR: the prefix length must be at most 32 for IPv4"
    );
    let e = Filter::builder()
        .toml_file("/nonexistent/limits.toml")
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("/nonexistent/limits.toml: cannot read the file"),
        "{e}"
    );
}

#[actix_web::test]
async fn hashed_key_values_never_appear_in_redis_key_names() {
    let redis = RedisServer::start();
    let filter = filter(
        &redis,
        "[[rule]]\nname = \"tok\"\npaths = [\"/a\"]\nkey = [\"header:x-api-key\", \"ip\"]\nhash_key = true\nlimit = 2\nwindow = \"1m\"\ndeny = \"status\"\n",
    );
    let code = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let app = test::init_service(
        App::new()
            .wrap(filter)
            .service(
                web::resource("/b")
                    .wrap(
                        code.limit(
                            Limit::per_minute(2)
                                .key(Key::header("x-api-key"))
                                .name("code")
                                .hash_key_values(),
                        ),
                    )
                    .route(web::get().to(HttpResponse::Ok)),
            )
            .route("/a", web::get().to(HttpResponse::Ok)),
    )
    .await;
    let get = |path: &'static str, key: &'static str| {
        test::TestRequest::get()
            .uri(path)
            .insert_header(("x-api-key", key))
            .to_request()
    };
    for path in ["/a", "/b"] {
        for _ in 0..2 {
            let res = test::call_service(&app, get(path, "sk-live-secret-1")).await;
            assert_eq!(res.status(), StatusCode::OK, "{path}");
        }
        let res = test::call_service(&app, get(path, "sk-live-secret-1")).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{path}");
        let res = test::call_service(&app, get(path, "sk-live-secret-2")).await;
        assert_eq!(res.status(), StatusCode::OK, "{path}");
    }
    let keys = redis.keys("*");
    assert_eq!(keys.len(), 4, "{keys:?}");
    for key in &keys {
        assert!(!key.contains("secret"), "{key}");
        let id = key.rsplit(':').next().unwrap();
        assert!(id.starts_with('~') && id.len() == 41, "{key}");
    }
}

#[actix_web::test]
async fn limits_in_code_take_methods_and_every_redis_error_policy() {
    let redis = RedisServer::start();
    let filter = Filter::builder().redis_url(&redis.url()).build().unwrap();
    let limit = Limit::per_minute(1)
        .name("posts")
        .methods(&["POST"])
        .on_redis_error(floodgate_limiter::rule::OnRedisError::Local)
        .on_missing_key(OnMissingKey::Reject)
        .key(Key::json("user"));
    let app = test::init_service(
        App::new()
            .wrap(filter.limit(limit))
            .route("/a", web::to(HttpResponse::Ok)),
    )
    .await;
    for _ in 0..3 {
        let res = test::call_service(&app, test::TestRequest::get().uri("/a").to_request()).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    let res = test::call_service(&app, json_post("/a", r#"{"user":"u"}"#).to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let res = test::call_service(&app, json_post("/a", r#"{"user":"u"}"#).to_request()).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let res = test::call_service(&app, json_post("/a", r#"{}"#).to_request()).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
}
