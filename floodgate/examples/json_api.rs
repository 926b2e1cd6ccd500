//! An API with its own JSON answer to a denied request
//! (`{"error":"slow down","limit":"…","retry_in":N}` with status 429), and
//! a quota per caller: [`Key::lookup`] finds who sends an API key (an
//! async function, as a database or cache lookup would be) and gives them
//! 100 requests a minute; anonymous callers get 10, counted by address.
//!
//! ```sh
//! cargo run -p floodgate-limiter --example json_api
//! for i in $(seq 12); do curl -s localhost:8080/v1/ping; echo; done
//! for i in $(seq 12); do curl -s -H 'x-api-key: k-alice' localhost:8080/v1/ping; echo; done
//! ```

use actix_web::{web, App, HttpResponse, HttpServer};
use floodgate_limiter::rule::Identity;
use floodgate_limiter::{http, Filter, Key, Limit, RequestHead};

/// The API keys this example knows (a real API would look them up).
const API_KEYS: &[&str] = &["k-alice", "k-bob"];

/// The caller's identity and quota; `None` (no key, or one we do not
/// know) counts the request by its address, at the limit's own quota.
async fn caller(req: RequestHead) -> Option<Identity> {
    let key = req.header("x-api-key")?;
    API_KEYS
        .contains(&key)
        .then(|| Identity::new(key).with_limit(100))
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let redis =
        std::env::var("FLOODGATE_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".into());
    let filter = Filter::builder()
        .redis_url(&redis)
        .denial_responder(|denial, _req| {
            let body = serde_json::json!({
                "error": "slow down",
                "limit": denial.rule.name(),
                "retry_in": denial.retry_after,
            });
            let mut res = http::Response::new(body.to_string());
            *res.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
            res.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            res
        })
        .build()
        .map_err(std::io::Error::other)?;
    let bind = std::env::var("FLOODGATE_BIND").unwrap_or_else(|_| "127.0.0.1:8080".into());
    println!("listening on http://{bind}/v1/ping");
    HttpServer::new(move || {
        // Anonymous: 10 a minute; a known key: the 100 its identity asks
        // for. Redis keys hold a hash of the API key, never the key itself.
        let per_caller = Limit::per_minute(10)
            .key(Key::lookup("api-key", caller))
            .hash_key_values()
            .name("v1");
        App::new().service(web::scope("/v1").wrap(filter.limit(per_caller)).route(
            "/ping",
            web::get().to(|| async { HttpResponse::Ok().json(serde_json::json!({"ok": true})) }),
        ))
    })
    .bind(bind)?
    .run()
    .await
}
