//! Limits declared in code, beside the handlers they guard: one on a
//! resource, one on a scope, and one the builder puts on a path.
//!
//! ```sh
//! cargo run -p floodgate-limiter --example in_code
//! curl -i -X POST -d phone=5550100 localhost:8080/sms/send   # 3 per minute per phone
//! curl -i localhost:8080/api/items                           # token bucket for /api/*
//! curl -i localhost:8080/search                              # 2 per second per address
//! ```

use std::time::Duration;

use actix_web::{web, App, HttpResponse, HttpServer};
use floodgate_limiter::{Filter, Key, Limit, Usage};

async fn send_sms(usage: Usage) -> HttpResponse {
    // The handler sees what the limits said.
    let left: Vec<String> = usage
        .rules()
        .iter()
        .map(|r| format!("{}: {} left", r.name, r.remaining))
        .collect();
    HttpResponse::Ok().body(format!("sent ({})\n", left.join(", ")))
}

async fn items() -> HttpResponse {
    HttpResponse::Ok().body("[]\n")
}

async fn search() -> HttpResponse {
    HttpResponse::Ok().body("nothing found\n")
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let redis =
        std::env::var("FLOODGATE_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".into());
    let filter = Filter::builder()
        .redis_url(&redis)
        .timeout(Duration::from_millis(250))
        // A path rule, as a TOML [[rule]] would be.
        .rule("/search", Limit::per_second(2).name("search"))
        .build()
        .map_err(std::io::Error::other)?;
    let bind = std::env::var("FLOODGATE_BIND").unwrap_or_else(|_| "127.0.0.1:8080".into());
    println!("listening on http://{bind}/");
    HttpServer::new(move || {
        App::new()
            .wrap(filter.clone())
            .service(
                web::resource("/sms/send")
                    .wrap(filter.limit(Limit::per_minute(3).key(Key::form("phone")).name("sms")))
                    .route(web::post().to(send_sms)),
            )
            .service(
                web::scope("/api")
                    .wrap(filter.limit(Limit::token_bucket(5.0, 10).name("api")))
                    .route("/items", web::get().to(items)),
            )
            .route("/search", web::get().to(search))
    })
    .bind(bind)?
    .run()
    .await
}
