//! Login limits as a JSON API team writes them: per account and per
//! address, the address's threshold from a TOML file and the account's in
//! code (one filter, one all-or-nothing decision), only failed attempts
//! counted, JSON answers by default, and a bypass for the test suite.
//!
//! ```sh
//! cargo run -p floodgate-limiter --example login
//! for i in $(seq 6); do
//!   curl -s -H 'content-type: application/json' -d '{"email":"Ann@Example.com","password":"x"}' \
//!     localhost:8080/login; echo
//! done   # the 6th: 429 {"error":"rate_limited","rule":"login-per-account",...}
//! curl -s -H 'x-test-run: t-1' -H 'content-type: application/json' \
//!   -d '{"email":"ann@example.com","password":"x"}' localhost:8080/login   # never counted
//! ```

use actix_web::{web, App, HttpResponse, HttpServer};
use floodgate_limiter::rule::Normalize;
use floodgate_limiter::{Filter, Key, Limit};

/// The per-address threshold, as operators keep it in a file: hidden from
/// the rate-limit fields (an abuse threshold), counting failures only.
const RULES: &str = r#"
[[rule]]
name = "login-per-address"
paths = ["/login"]
methods = ["POST"]
key = "ip"
limit = 20
window = "15m"
count = "failures"
headers = "none"
"#;

#[derive(serde::Deserialize)]
struct Login {
    email: String,
    password: String,
}

async fn login(body: web::Json<Login>) -> HttpResponse {
    // (A real app checks the password; this one knows one.)
    if body.email.eq_ignore_ascii_case("ann@example.com") && body.password == "right" {
        HttpResponse::Ok().json(serde_json::json!({"signed_in": true}))
    } else {
        // A failure: counted by both rules (a success is given back).
        HttpResponse::Unauthorized().json(serde_json::json!({"error": "wrong email or password"}))
    }
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let redis =
        std::env::var("FLOODGATE_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".into());
    let test_run = std::env::var("LOGIN_TEST_RUN").unwrap_or_else(|_| "t-1".into());
    let filter = Filter::builder()
        .redis_url(&redis)
        .toml_rules(RULES, "login.toml")
        // Per account: the e-mail of the JSON body, lower-cased, hashed in
        // Redis's keys; 5 failures per 15 minutes.
        .rule(
            "/login",
            Limit::new(5, std::time::Duration::from_secs(15 * 60))
                .methods(&["POST"])
                .key(Key::json("email"))
                .normalize(Normalize::Lowercase)
                .hash_key_values()
                .count_failures_only()
                .name("login-per-account"),
        )
        // The test suite's requests pass every rule, uncounted.
        .bypass(move |req| req.header("x-test-run") == Some(test_run.as_str()))
        .build()
        .map_err(std::io::Error::other)?;
    let bind = std::env::var("FLOODGATE_BIND").unwrap_or_else(|_| "127.0.0.1:8080".into());
    println!("listening on http://{bind}/login");
    HttpServer::new(move || {
        App::new()
            .wrap(filter.clone())
            .route("/login", web::post().to(login))
    })
    .bind(bind)?
    .run()
    .await
}
