//! The peer that scripts/bench measures floodgate against: `actix-limitation`
//! (Redis fixed window) guarding `GET /check`, on the same Redis, with as
//! many workers as floodgate.
//!
//! Not a Criterion bench: a server that scripts/bench starts and drives with
//! wrk. Usage (every flag also reads an environment variable):
//!
//! ```text
//! peer_actix_limitation --port 8081 --redis redis://127.0.0.1:6379/0 \
//!     --workers 2 --limit 100000 --period-secs 3600
//! ```

use std::time::Duration;

use actix_limitation::{Limiter, RateLimiter};
use actix_web::{web, App, HttpResponse, HttpServer};

fn arg(args: &[String], flag: &str, env: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
        .or_else(|| std::env::var(env).ok())
        .unwrap_or_else(|| default.to_string())
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() || args.iter().any(|a| a == "--bench") {
        // `cargo bench` runs every bench target: this one is a server that
        // only scripts/bench knows how to drive.
        println!("peer_actix_limitation: a server for scripts/bench (see its source for flags)");
        return Ok(());
    }
    let port = arg(&args, "--port", "BENCH_PORT", "8081");
    let redis = arg(
        &args,
        "--redis",
        "BENCH_REDIS_URL",
        "redis://127.0.0.1:6379/0",
    );
    let workers: usize = arg(&args, "--workers", "BENCH_WORKERS", "2")
        .parse()
        .expect("--workers: a number");
    let limit: usize = arg(&args, "--limit", "BENCH_LIMIT", "100000")
        .parse()
        .expect("--limit: a number");
    let period: u64 = arg(&args, "--period-secs", "BENCH_PERIOD_SECS", "3600")
        .parse()
        .expect("--period-secs: a number");

    // Without `key_by` the limiter keys by a session cookie, finds none and
    // never talks to Redis: key by client address, as floodgate's `ip` does.
    let limiter = web::Data::new(
        Limiter::builder(redis)
            .key_by(|req| req.peer_addr().map(|a| format!("peer:{}", a.ip())))
            .limit(limit)
            .period(Duration::from_secs(period))
            .build()
            .expect("a Redis URL"),
    );
    actix_web::rt::System::new().block_on(async move {
        HttpServer::new(move || {
            App::new()
                .app_data(limiter.clone())
                .wrap(RateLimiter::default())
                .route(
                    "/check",
                    web::get().to(|| async {
                        HttpResponse::Ok()
                            .content_type("text/plain; charset=utf-8")
                            .body("ok\n")
                    }),
                )
        })
        .workers(workers)
        .bind(("127.0.0.1", port.parse::<u16>().expect("--port: a port")))?
        .run()
        .await
    })
}
