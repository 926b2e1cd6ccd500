//! The service's HTTP listener (`[rls] http_bind`): `/healthz`, `/readyz`,
//! `/metrics` (with the bans and overrides in force) and, with `[admin]
//! token` set, the operators' API on the service's identities
//! (`POST /admin/{inspect,reset,ban,unban,override}`, `GET
//! /admin/{bans,overrides,top,find,audit}`), checked, read and written to
//! the audit trail as the site's (see `admin_http.rs`). It runs on its own actix system thread, apart
//! from gRPC.

use std::net::IpAddr;
use std::sync::Arc;

use actix_web::dev::ServerHandle;
use actix_web::http::StatusCode;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};

use floodgate::logging::Escaped;

use super::config::RlsConfig;
use super::service::Rls;
use crate::admin_http::{
    action_of, audit, bearer, error, json, listing, read_body, refuse_authentication,
    refused_action, token_matches, ActionBody,
};

/// The running listener.
pub struct Http {
    /// Its port.
    pub port: u16,
    handle: ServerHandle,
    thread: std::thread::JoinHandle<()>,
}

impl Http {
    /// Stops it, finishing requests in flight.
    pub async fn stop(self) {
        self.handle.stop(true).await;
        let _ = tokio::task::spawn_blocking(move || self.thread.join()).await;
    }
}

/// What the handlers share.
struct State {
    rls: Arc<Rls>,
    token: Option<String>,
    allow: Vec<floodgate::net::Cidr>,
}

/// Binds `[rls] http_bind` and serves it on a thread of its own.
pub fn start(rls: Arc<Rls>, config: &RlsConfig) -> std::io::Result<Http> {
    let listener = std::net::TcpListener::bind(&config.rls.http_bind)?;
    let port = listener.local_addr()?.port();
    let state = web::Data::new(State {
        rls,
        token: config.filter.admin.token.clone(),
        allow: config.filter.admin.allow.clone(),
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("floodgate-rls-http".into())
        .spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let server = HttpServer::new(move || {
                    App::new()
                        .app_data(state.clone())
                        // Load balancers probe with HEAD as well as GET.
                        .route(
                            "/healthz",
                            web::route().guard(crate::get_or_head()).to(healthz),
                        )
                        .route(
                            "/readyz",
                            web::route().guard(crate::get_or_head()).to(readyz),
                        )
                        .route("/metrics", web::get().to(metrics))
                        .service(web::scope("/admin").default_service(web::to(admin)))
                })
                .workers(1)
                .disable_signals()
                .listen(listener);
                match server {
                    Ok(s) => {
                        let s = s.run();
                        let _ = tx.send(Ok(s.handle()));
                        let _ = s.await;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            });
        })?;
    let handle = rx
        .recv()
        .map_err(|_| std::io::Error::other("the HTTP thread stopped"))??;
    Ok(Http {
        port,
        handle,
        thread,
    })
}

fn text(status: StatusCode, body: &'static str) -> HttpResponse {
    HttpResponse::build(status)
        .content_type("text/plain; charset=utf-8")
        .body(body)
}

async fn healthz() -> HttpResponse {
    text(StatusCode::OK, "ok\n")
}

/// 200 when Redis answers PING within the timeout, else 503.
async fn readyz(state: web::Data<State>) -> HttpResponse {
    match state.rls.limiter.ready().await {
        Ok(()) => text(StatusCode::OK, "ready\n"),
        Err(_) => text(StatusCode::SERVICE_UNAVAILABLE, "redis unavailable\n"),
    }
}

async fn metrics(state: web::Data<State>) -> HttpResponse {
    let rls = &state.rls;
    let mut body = rls.metrics.render(rls.limiter.error_count());
    body.push_str(&rls.calls.render());
    // Bans and overrides in force, as the site shows them: read from
    // Redis's operator records at each scrape; left out while Redis does
    // not answer.
    let known = crate::listings::known_limits(&rls.matcher());
    if let Some(gauges) = crate::listings::active_gauges(&rls.limiter, &rls.prefix, &known).await {
        body.push_str(&gauges);
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(body)
}

async fn admin(state: web::Data<State>, req: HttpRequest, payload: web::Payload) -> HttpResponse {
    let Some(token) = state.token.as_deref() else {
        return text(StatusCode::NOT_FOUND, "not found\n");
    };
    let allowed = |ip: &IpAddr| {
        let ip = floodgate::net::canonical_ip(*ip);
        state.allow.iter().any(|c| c.contains(ip))
    };
    let Some(client) = req.peer_addr().map(|a| a.ip()).filter(allowed) else {
        return error(StatusCode::FORBIDDEN, "forbidden");
    };
    let rls = &state.rls;
    if !bearer(&req).is_some_and(|given| token_matches(given, token)) {
        return refuse_authentication(&rls.limiter, &rls.prefix, &req, client).await;
    }
    let what = req.path().strip_prefix("/admin/").unwrap_or_default();
    if ["bans", "overrides", "audit", "find", "top"].contains(&what) {
        if req.method() != actix_web::http::Method::GET {
            return error(StatusCode::METHOD_NOT_ALLOWED, "use GET");
        }
        let matcher = rls.matcher();
        let known = crate::listings::known_limits(&matcher);
        let searched = move |value: &str| crate::listings::searched_limits(&matcher, value);
        let limiter = Arc::clone(&rls.limiter);
        return listing(
            limiter,
            rls.prefix.clone(),
            known,
            searched,
            what,
            req.query_string(),
        )
        .await;
    }
    if !["inspect", "reset", "ban", "unban", "override"].contains(&what) {
        return error(StatusCode::NOT_FOUND, "no such admin action");
    }
    if req.method() != actix_web::http::Method::POST {
        return error(StatusCode::METHOD_NOT_ALLOWED, "use POST");
    }
    let body = match read_body(&req, payload).await {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let refused = |e: &str| refused_action(what, client, e);
    let body: ActionBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return refused(&format!("bad JSON body: {e}")),
    };
    let action = match action_of(what, &body) {
        Ok(a) => a,
        Err(e) => return refused(&e),
    };
    let values: Vec<&str> = body.values.iter().map(String::as_str).collect();
    let matcher = rls.matcher();
    let check = match super::operator::check_for(
        &matcher,
        &rls.prefix,
        rls.limiter.hash_tags(),
        rls.settings.shadow,
        &body.rule,
        &values,
        &action,
    ) {
        Ok(c) => c,
        Err(e) => return refused(&e),
    };
    let shown = format!(
        "admin {} rule={} values={:?} from {}",
        action.name(),
        body.rule,
        body.values,
        client
    );
    match rls.limiter.operate(check, action).await {
        Ok(seen) => {
            log::info!("{}: ok", Escaped(&shown));
            let (rule, key) = (body.rule.clone(), seen.key.clone());
            audit(
                Arc::clone(&rls.limiter),
                rls.prefix.clone(),
                action,
                (rule, key),
                client.to_string(),
            )
            .await;
            json(StatusCode::OK, seen.to_json(&body.rule))
        }
        Err(e) => {
            log::info!("{}: failed ({})", Escaped(&shown), Escaped(&e.to_string()));
            error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string())
        }
    }
}
