//! The operators' HTTP API: `POST /admin/{inspect,reset,ban,unban,override}`
//! over the library's operator actions ([`Filter::operate`]). It exists
//! only with `[admin] token` set (else every `/admin` path is 404), answers
//! only the `[admin] allow` addresses (403) bearing the token (401), and is
//! never rate limited nor counted (the filter leaves [`PATH`] unguarded).
//! JSON in and out, never cached; one log line per action.

use std::net::IpAddr;

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::Site;
use floodgate::filter::{ban_action, override_action, Filter, OperatorError};
use floodgate::limiter::Action;
use floodgate::logging::Escaped;

/// Where the admin API lives.
pub const PATH: &str = "/admin";

/// Registers the admin API (one handler for every path under [`PATH`]).
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(web::scope(PATH).default_service(web::to(handle)));
}

fn json(status: StatusCode, body: String) -> HttpResponse {
    HttpResponse::build(status)
        .content_type("application/json")
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .body(body)
}

fn error(status: StatusCode, what: &str) -> HttpResponse {
    json(
        status,
        format!(
            "{{\"error\":{}}}",
            floodgate::limiter::operator::json_string(what)
        ),
    )
}

/// Whether `given` is `token`, in time that depends on neither.
fn token_matches(given: &[u8], token: &str) -> bool {
    let a = Sha256::digest(given);
    let b = Sha256::digest(token.as_bytes());
    bool::from(a.ct_eq(&b))
}

fn bearer(req: &HttpRequest) -> Option<&[u8]> {
    let value = req.headers().get(header::AUTHORIZATION)?.as_bytes();
    let scheme = value.get(..7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| &value[7..])
}

/// A request's body, as the API reads it.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    rule: String,
    #[serde(default)]
    values: Vec<String>,
    #[serde(default, rename = "for")]
    lasts: Option<String>,
    #[serde(default)]
    limit: Option<i64>,
    #[serde(default)]
    window: Option<String>,
    #[serde(default)]
    clear: bool,
}

async fn handle(site: web::Data<Site>, req: HttpRequest, body: web::Bytes) -> HttpResponse {
    let Some(token) = site.config.filter.admin.token.as_deref() else {
        return super::pages::not_found(req).await;
    };
    let client = site.filter.client_addr(&req);
    if !allowed(&site, client) {
        crate::repeated!(
            &floodgate::logging::ADMIN_REFUSED,
            "admin: {} from {client}: refused (address not allowed)",
            Escaped(req.path())
        );
        return error(StatusCode::FORBIDDEN, "forbidden");
    }
    if !bearer(&req).is_some_and(|given| token_matches(given, token)) {
        crate::repeated!(
            &floodgate::logging::ADMIN_REFUSED,
            "admin: {} from {client}: refused (no or wrong token)",
            Escaped(req.path())
        );
        let mut res = error(StatusCode::UNAUTHORIZED, "unauthorized");
        res.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return res;
    }
    // The path as the router routed it here (`%61dmin` is `admin`).
    let what = req
        .match_info()
        .as_str()
        .strip_prefix(PATH)
        .unwrap_or_default();
    let what = what.strip_prefix('/').unwrap_or(what);
    if !["inspect", "reset", "ban", "unban", "override"].contains(&what) {
        return error(StatusCode::NOT_FOUND, "no such admin action");
    }
    if req.method() != actix_web::http::Method::POST {
        return error(StatusCode::METHOD_NOT_ALLOWED, "use POST");
    }
    let body: Body = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("bad JSON body: {e}")),
    };
    let action = match action_of(what, &body) {
        Ok(a) => a,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    let result = run(&site.filter, &body, action).await;
    let shown = format!(
        "admin {} rule={} values={:?} from {client}",
        action.name(),
        body.rule,
        body.values
    );
    match result {
        Ok(answer) => {
            log::info!("{}: ok", Escaped(&shown));
            json(StatusCode::OK, answer)
        }
        Err(OperatorError::Input(e)) => {
            log::info!("{}: refused ({})", Escaped(&shown), Escaped(&e));
            error(StatusCode::BAD_REQUEST, &e)
        }
        Err(OperatorError::Redis(e)) => {
            log::info!("{}: failed ({})", Escaped(&shown), Escaped(&e.to_string()));
            error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string())
        }
    }
}

fn allowed(site: &Site, client: IpAddr) -> bool {
    let ip = floodgate::net::canonical_ip(client);
    site.config
        .filter
        .admin
        .allow
        .iter()
        .any(|c| c.contains(ip))
}

fn action_of(what: &str, body: &Body) -> Result<Action, String> {
    match what {
        "inspect" => Ok(Action::Inspect),
        "reset" => Ok(Action::Reset),
        "unban" => Ok(Action::Unban),
        "ban" => ban_action(
            body.lasts
                .as_deref()
                .ok_or("ban needs \"for\", like \"10m\"")?,
        ),
        _ if body.clear => {
            if body.limit.is_some() || body.window.is_some() {
                return Err("\"clear\" takes no limit or window".into());
            }
            Ok(Action::Clear)
        }
        _ => override_action(
            body.limit
                .ok_or("override needs \"limit\", or \"clear\": true")?,
            body.window.as_deref(),
            body.lasts.as_deref(),
        ),
    }
}

async fn run(filter: &Filter, body: &Body, action: Action) -> Result<String, OperatorError> {
    let values: Vec<&str> = body.values.iter().map(String::as_str).collect();
    let seen = filter.operate(&body.rule, &values, action).await?;
    Ok(seen.to_json(&body.rule))
}
