//! An axum 0.8 app whose every route is behind one tower layer built from a
//! floodgate configuration file: `[server] bind`, `trusted_proxies`,
//! `proxy_header` and `max_form`, `[redis]`, `[limiter]`, `[defaults]` and
//! the `[[rule]]`s. The demo site's own settings (`[server] workers`,
//! `secret`, `body_timeout`, `[sms]`, `[site]`) are checked as the site
//! checks them, and not used.
//!
//! ```sh
//! cargo run --release -p floodgate-limiter --example axum -- config/default.toml
//! curl -i localhost:8080/check
//! ```
//!
//! Routes: `GET /healthz` (200 `ok`), `GET /readyz` (200 while Redis
//! answers, else 503), `GET /check` (200 `ok`), `POST /echo` with a form or
//! a JSON body (200 `{"phone": VALUE}`, VALUE as axum's `Form` or `Json`
//! read it, `null` when absent); any other path is 404. The client address
//! is the TCP peer from `ConnectInfo`, behind the file's trusted proxies.
//! `FLOODGATE_REDIS_URL` and `FLOODGATE_BIND` override the file.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Json, Router};
use floodgate_limiter::config::{duration_at_most, AppConfig, Config, ConfigError};
use floodgate_limiter::Filter;
use serde_json::{json, Value};

/// mimalloc, as the `floodgate` binary uses: a guarded request's few
/// allocations (its job for Redis, the reply's channel), made on one runtime
/// thread and freed on another, cost less than with the system allocator.
/// Optional: the layer works with any allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// What the example reads of the file besides the library's settings.
struct Server {
    bind: String,
}

/// (The site's settings are only deserialized, to check them.)
#[derive(serde::Deserialize)]
#[allow(dead_code)]
struct RawFile {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    sms: RawSms,
    #[serde(default)]
    site: RawSite,
}

/// `[server]` beyond the library's keys: `bind`, and the demo site's own
/// (checked as the site checks them, so that a file one refuses the other
/// refuses too, and not used: the example has no workers to size, no
/// cookies, and leaves slow bodies to the server in front of it).
#[derive(serde::Deserialize, Default)]
#[allow(dead_code)]
struct RawServer {
    bind: Option<String>,
    workers: Option<usize>,
    secret: Option<String>,
    body_timeout: Option<String>,
}

/// The demo site's `[sms]`, checked and not used.
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct RawSms {
    provider: Option<SmsProvider>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum SmsProvider {
    Outbox,
    Log,
}

/// The demo site's `[site]`, checked and not used.
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct RawSite {
    title: Option<String>,
    secure_cookies: Option<bool>,
    public_outbox: Option<bool>,
}

/// The file may be the demo site's own (`config/default.toml`): the site's
/// settings are accepted when the site would accept them.
impl AppConfig for Server {
    const SECTIONS: &'static [&'static str] = &["sms", "site"];
    const SERVER_KEYS: &'static [&'static str] = &["bind", "workers", "secret", "body_timeout"];
    type Raw = RawFile;

    fn check(raw: RawFile, file: &str) -> Result<Server, ConfigError> {
        let err = |place: &str, what: String| ConfigError {
            file: file.to_string(),
            place: place.to_string(),
            what,
        };
        let s = raw.server;
        if let Some(n) = s.workers.filter(|&n| n > 512) {
            let what = format!("must be between 0 and 512 (0 = one per CPU core), got {n}");
            return Err(err("[server] workers", what));
        }
        if let Some(text) = &s.body_timeout {
            duration_at_most(text, Duration::from_secs(3600))
                .map_err(|what| err("[server] body_timeout", what))?;
        }
        Ok(Server {
            bind: s.bind.unwrap_or_else(|| "127.0.0.1:8080".to_string()),
        })
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let path = std::env::args_os()
        .nth(1)
        .map_or_else(|| PathBuf::from("config/default.toml"), PathBuf::from);
    let (config, server) = match Config::load_with::<Server>(&path) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let filter = match Filter::from_config(&config) {
        Ok(filter) => filter,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let bind = std::env::var("FLOODGATE_BIND")
        .ok()
        .filter(|b| !b.is_empty())
        .unwrap_or(server.bind);
    let ready = filter.clone();
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(move || readyz(ready.clone())))
        .route("/check", get(|| async { "ok" }))
        .route("/echo", post(echo))
        .layer(filter);
    let listener = match tokio::net::TcpListener::bind(&bind).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{bind}: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    println!("listening on http://{bind}/check");
    let served = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await;
    match served {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// 200 while Redis answers the library's readiness PING, else 503.
async fn readyz(filter: Filter) -> Response {
    match filter.limiter().ready().await {
        Ok(()) => (StatusCode::OK, "ready").into_response(),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "redis is not answering").into_response(),
    }
}

/// `{"phone": VALUE}`: the `phone` field as axum's `Json` (a body whose
/// `Content-Type` is JSON by axum's own rule: `application/json`, or any
/// `application/...+json`) or `Form` (any other) read it.
async fn echo(req: Request) -> Response {
    let is_json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<mime::Mime>().ok())
        .is_some_and(|m| {
            m.type_() == "application"
                && (m.subtype() == "json" || m.suffix().is_some_and(|s| s == "json"))
        });
    let phone = if is_json {
        match Json::<Value>::from_request(req, &()).await {
            Ok(Json(body)) => body.get("phone").cloned().unwrap_or(Value::Null),
            Err(rejection) => return rejection.into_response(),
        }
    } else {
        match Form::<HashMap<String, String>>::from_request(req, &()).await {
            Ok(Form(fields)) => fields
                .get("phone")
                .cloned()
                .map_or(Value::Null, Value::String),
            Err(rejection) => return rejection.into_response(),
        }
    };
    Json(json!({ "phone": phone })).into_response()
}
