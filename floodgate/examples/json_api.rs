//! An API with its own JSON answer to a denied request:
//! `{"error":"slow down","limit":"…","retry_in":N}` with status 429.
//!
//! ```sh
//! cargo run --example json_api
//! for i in 1 2 3 4 5 6; do curl -s -H 'x-api-key: k1' localhost:8080/v1/ping; echo; done
//! ```

use actix_web::{web, App, HttpResponse, HttpServer};
use floodgate::{Filter, Key, Limit};

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let redis =
        std::env::var("FLOODGATE_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".into());
    let filter = Filter::builder()
        .redis_url(&redis)
        .denial_responder(|denial, _req| {
            HttpResponse::TooManyRequests().json(serde_json::json!({
                "error": "slow down",
                "limit": denial.rule.name,
                "retry_in": denial.retry_after,
            }))
        })
        .build()
        .map_err(std::io::Error::other)?;
    let bind = std::env::var("FLOODGATE_BIND").unwrap_or_else(|_| "127.0.0.1:8080".into());
    println!("listening on http://{bind}/v1/ping");
    HttpServer::new(move || {
        App::new().service(
            web::scope("/v1")
                // Per API key; requests without one are counted per address.
                .wrap(
                    filter.limit(
                        Limit::per_minute(5)
                            .key(Key::header("x-api-key"))
                            .name("v1"),
                    ),
                )
                .route(
                    "/ping",
                    web::get()
                        .to(|| async { HttpResponse::Ok().json(serde_json::json!({"ok": true})) }),
                ),
        )
    })
    .bind(bind)?
    .run()
    .await
}
