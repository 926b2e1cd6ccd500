//! The operators' HTTP API: `POST /admin/{inspect,reset,ban,unban,override}`
//! over the library's operator actions
//! ([`Filter::operate`](floodgate::Filter::operate)); the listings `GET
//! /admin/{bans,overrides,top,find,audit}` (see [`crate::listings`]),
//! `GET /admin/{rules,decisions}` and the operators' page, `GET /admin`,
//! whose script calls them. It exists
//! only with `[admin] token` set (else every `/admin` path is 404), answers
//! only the `[admin] allow` addresses (403; behind a proxy, an address the
//! proxy named) bearing the token (401; after
//! [`FAILURES`](crate::admin_http::FAILURES) failures a
//! minute from one address, 429), and reads the body only then. Each
//! action takes exactly the fields the command line takes (else 400). The
//! filter never counts it (it leaves [`PATH`] unguarded). JSON in and out,
//! never cached; one log line per action.

use std::net::IpAddr;

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};

use std::sync::Arc;

use super::Site;
use crate::admin_http::{
    action_of, audit, bearer, error, json, read_body, refuse_authentication, refused_action,
    token_matches, ActionBody,
};
use crate::listings;
use floodgate::limiter::Action;
use floodgate::logging::Escaped;
use floodgate::OperatorError;

/// Where the admin API lives.
pub const PATH: &str = "/admin";

/// Registers the admin API (one handler for every path under [`PATH`]).
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(web::scope(PATH).default_service(web::to(handle)));
}

async fn handle(site: web::Data<Site>, req: HttpRequest, payload: web::Payload) -> HttpResponse {
    let Some(token) = site.config.filter.admin.token.as_deref() else {
        return super::pages::not_found(req).await;
    };
    // Behind a proxy that could not name the client, no address is allowed
    // (the proxy's own is not the client's).
    let Some(client) = site.named_client(&req).filter(|c| allowed(&site, *c)) else {
        crate::repeated!(
            &crate::log_kinds::ADMIN_REFUSED,
            "admin: {} from {}: refused (address not allowed)",
            Escaped(req.path()),
            site.filter.client_addr(&req)
        );
        return error(StatusCode::FORBIDDEN, "forbidden");
    };
    // The operators' page itself holds nothing secret: it asks for the
    // token, and its script sends it with each call below.
    if matches!(req.match_info().as_str(), "/admin" | "/admin/")
        && req.method() == actix_web::http::Method::GET
    {
        return page(&site);
    }
    if !bearer(&req).is_some_and(|given| token_matches(given, token)) {
        let prefix = &site.config.filter.redis.key_prefix;
        return refuse_authentication(site.filter.limiter(), prefix, &req, client).await;
    }
    let what = req
        .match_info()
        .as_str()
        .strip_prefix(PATH)
        .unwrap_or_default();
    let what = what.strip_prefix('/').unwrap_or(what);
    if ["rules", "decisions"].contains(&what) && req.method() == actix_web::http::Method::GET {
        let answer = if what == "rules" {
            rules_json(&site)
        } else {
            site.history.json()
        };
        return json(StatusCode::OK, answer.to_string());
    }
    if ["bans", "overrides", "audit", "find", "top"].contains(&what) {
        if req.method() != actix_web::http::Method::GET {
            return error(StatusCode::METHOD_NOT_ALLOWED, "use GET");
        }
        return listing(&site, what, req.query_string()).await;
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
    let result = run(&site, &body, action, client).await;
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

/// Runs `action` and records it in the audit trail, by `client`.
async fn run(
    site: &Site,
    body: &ActionBody,
    action: Action,
    client: IpAddr,
) -> Result<String, OperatorError> {
    let mut values = body.values.clone();
    // A `session` rule's account, named by its phone number: its ID.
    let rules = site.filter.rules();
    if let Some(i) = super::store::session_position(&rules, &body.rule, values.len()) {
        let (store, value, region) = (site.store.clone(), values[i].clone(), site.region());
        let id = site
            .filter
            .limiter()
            .with_redis(move |conn| store.session_id(conn, &value, region))
            .await
            .map_err(OperatorError::Redis)?
            .map_err(|e| OperatorError::Redis(e.into()))?;
        values[i] = id.map_err(OperatorError::Input)?;
    }
    let values: Vec<&str> = values.iter().map(String::as_str).collect();
    let seen = site.filter.operate(&body.rule, &values, action).await?;
    audit(
        Arc::clone(site.filter.limiter()),
        site.config.filter.redis.key_prefix.clone(),
        action,
        (body.rule.clone(), seen.key.clone()),
        client.to_string(),
    )
    .await;
    Ok(seen.to_json(&body.rule))
}

/// `GET /admin`: the operators' page (its script calls the API below).
fn page(site: &Site) -> HttpResponse {
    let mut res = super::pages::render(
        &AdminPage {
            site_title: site.config.site.title.clone(),
            signed_in: false,
        },
        StatusCode::OK,
    );
    res.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    res
}

/// The operators' page.
#[derive(askama::Template)]
#[template(path = "admin.html")]
struct AdminPage {
    site_title: String,
    signed_in: bool,
}

/// `GET /admin/rules`: the rules in force, for the page's forms and charts.
fn rules_json(site: &Site) -> serde_json::Value {
    let rules: Vec<serde_json::Value> = site
        .filter
        .rules()
        .iter()
        .map(|r| {
            serde_json::json!({
                "name": r.name(),
                "key": r.key().to_string(),
                "algorithm": r.algorithm().name(),
                "limit": r.algorithm().quota(),
                "window_s": r.algorithm().window_seconds(),
                "mode": r.mode().to_string(),
            })
        })
        .collect();
    serde_json::Value::Array(rules)
}

/// `GET /admin/bans|overrides|top|find|audit` over the site's rules.
async fn listing(site: &Site, what: &str, query: &str) -> HttpResponse {
    let rules = site.filter.rules();
    let known = listings::known(&rules);
    let searched = move |value: &str| listings::searched_rules(&rules, value);
    let limiter = Arc::clone(site.filter.limiter());
    let prefix = site.config.filter.redis.key_prefix.clone();
    crate::admin_http::listing(limiter, prefix, known, searched, what, query).await
}
