//! The demo site: pages that show the filter at work, plus the operational
//! endpoints (`/healthz`, `/readyz`, `/metrics`).

pub mod pages;

use std::sync::Arc;

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};

use crate::config::Config;
use crate::filter::Filter;
use crate::metrics::Metrics;

/// What every handler can reach (`web::Data<Site>`).
pub struct Site {
    /// The configuration the site was started with.
    pub config: Config,
    /// The filter (its rules are the ones in force, after reloads).
    pub filter: Filter,
    /// Process counters.
    pub metrics: Arc<Metrics>,
}

/// Registers every route of the site.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/", web::get().to(pages::home))
        .route("/check", web::get().to(pages::check))
        .route("/err", web::get().to(pages::error_page))
        .route("/api/ping", web::get().to(api_ping))
        .route("/healthz", web::get().to(healthz))
        .route("/readyz", web::get().to(readyz))
        .route("/metrics", web::get().to(metrics))
        .route("/static/{file}", web::get().to(static_file));
}

async fn api_ping() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({ "ok": true }))
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; charset=utf-8")
        .body("ok\n")
}

/// 200 when Redis answers PING within the timeout, else 503.
async fn readyz(site: web::Data<Site>) -> HttpResponse {
    let limiter = Arc::clone(site.filter.limiter());
    match web::block(move || limiter.ping()).await {
        Ok(Ok(())) => HttpResponse::Ok()
            .content_type("text/plain; charset=utf-8")
            .body("ready\n"),
        Ok(Err(e)) => {
            log::warn!("readyz: {e}");
            HttpResponse::ServiceUnavailable()
                .content_type("text/plain; charset=utf-8")
                .body("redis unavailable\n")
        }
        Err(e) => {
            log::error!("readyz: {e}");
            HttpResponse::ServiceUnavailable().finish()
        }
    }
}

async fn metrics(site: web::Data<Site>) -> HttpResponse {
    let text = site.metrics.render(site.filter.limiter().error_count());
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(text)
}

const STATIC_FILES: &[(&str, &str, &str)] = &[
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("../../static/style.css"),
    ),
    (
        "countdown.js",
        "text/javascript; charset=utf-8",
        include_str!("../../static/countdown.js"),
    ),
];

/// The stylesheet and scripts, compiled into the binary so it runs from anywhere.
async fn static_file(req: HttpRequest) -> HttpResponse {
    let name = req.match_info().get("file").unwrap_or_default();
    match STATIC_FILES.iter().find(|(n, _, _)| *n == name) {
        Some((_, mime, body)) => HttpResponse::Ok()
            .content_type(*mime)
            .insert_header((header::CACHE_CONTROL, "public, max-age=300"))
            .body(*body),
        None => pages::not_found(req).await,
    }
}
