//! An app guarded by rules in TOML: `GET /hello` at most 3 times per 10
//! seconds per client address; the fourth gets a 429.
//!
//! ```sh
//! cargo run -p floodgate-limiter --example toml_minimal        # then: curl -i localhost:8080/hello
//! ```
//!
//! `FLOODGATE_REDIS_URL` (default redis://127.0.0.1:6379/0) names Redis and
//! `FLOODGATE_BIND` (default 127.0.0.1:8080) the address to listen on.

use actix_web::{get, App, HttpServer, Responder};
use floodgate_limiter::Filter;

const RULES: &str = r#"
[defaults]
deny = "status"            # 429, not a redirect to an error page

[[rule]]
name = "hello"
paths = ["/hello"]
key = "ip"
limit = 3
window = "10s"
"#;

#[get("/hello")]
async fn hello() -> impl Responder {
    "hello\n"
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    // FLOODGATE_REDIS_URL overrides [redis] url; errors read FILE: WHERE: WHAT.
    let filter = Filter::from_toml_str(RULES, "rules.toml").map_err(std::io::Error::other)?;
    let bind = std::env::var("FLOODGATE_BIND").unwrap_or_else(|_| "127.0.0.1:8080".into());
    println!("listening on http://{bind}/hello");
    HttpServer::new(move || App::new().wrap(filter.clone()).service(hello))
        .bind(bind)?
        .run()
        .await
}
