//! What the two admin APIs (the site's, and `floodgate rls`'s on its
//! `http_bind`) answer and check alike: JSON that is never cached, the
//! bearer token compared in time that depends on neither side, failed
//! tokens counted per address in Redis (429 past [`FAILURES`] a minute),
//! bodies read up to [`MAX_BODY`], an action's body taking exactly the
//! command line's fields, and every action written to the audit trail.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use floodgate::limiter::{Action, Check, Limiter};
use floodgate::logging::Escaped;
use floodgate::rule::Algorithm;
use floodgate::{ban_action, override_action};

use crate::listings;

/// `body` (JSON) with `status`, never cached.
pub fn json(status: StatusCode, body: String) -> HttpResponse {
    HttpResponse::build(status)
        .content_type("application/json")
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .body(body)
}

/// `{"error": what}` with `status`.
pub fn error(status: StatusCode, what: &str) -> HttpResponse {
    json(status, serde_json::json!({ "error": what }).to_string())
}

/// Whether `given` is `token`, in time that depends on neither.
pub fn token_matches(given: &[u8], token: &str) -> bool {
    let a = Sha256::digest(given);
    let b = Sha256::digest(token.as_bytes());
    bool::from(a.ct_eq(&b))
}

/// The token of an `Authorization: Bearer TOKEN` field.
pub fn bearer(req: &HttpRequest) -> Option<&[u8]> {
    let value = req.headers().get(header::AUTHORIZATION)?.as_bytes();
    let scheme = value.get(..7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| &value[7..])
}

/// Failed authentications (no or a wrong token) one client address other
/// than loopback may make in [`FAILURE_WINDOW`]; more get 429 until the
/// oldest leaves it.
pub const FAILURES: u32 = 5;

/// The window [`FAILURES`] are counted in.
pub const FAILURE_WINDOW: Duration = Duration::from_secs(60);

/// The name failures are counted under in Redis keys
/// (`PREFIX:admin.auth:ip:ADDRESS`): no rule can have it (rule names have
/// no `.`), so no rule shares its counts.
const FAILURE_NAME: &str = "admin.auth";

/// Largest body read (after the address and token are checked): 413.
pub const MAX_BODY: usize = 64 * 1024;

/// The body of an action (`POST /admin/ACTION`), as both APIs read it.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionBody {
    pub rule: String,
    #[serde(default)]
    pub values: Vec<String>,
    #[serde(default, rename = "for")]
    pub lasts: Option<String>,
    #[serde(default)]
    pub limit: Option<i64>,
    #[serde(default)]
    pub window: Option<String>,
    /// Given (`true` or `false`) only to `override`.
    #[serde(default)]
    pub clear: Option<bool>,
}

/// The action `what` asks for, from exactly its own fields, as the
/// command line takes them (`src/operator.rs`): `inspect`, `reset` and
/// `unban` none; `ban` `for`; `override` `limit` (with `window` and `for`)
/// or `clear: true` alone. Any other field given is refused.
pub fn action_of(what: &str, body: &ActionBody) -> Result<Action, String> {
    let given = [
        ("for", body.lasts.is_some()),
        ("limit", body.limit.is_some()),
        ("window", body.window.is_some()),
        ("clear", body.clear.is_some()),
    ];
    let only = |takes: &[&str], doing: &str| -> Result<(), String> {
        match given.iter().find(|(name, is)| *is && !takes.contains(name)) {
            Some((name, _)) => Err(format!("{doing} takes no \"{name}\"")),
            None => Ok(()),
        }
    };
    match what {
        "inspect" | "reset" | "unban" => {
            only(&[], what)?;
            Ok(match what {
                "inspect" => Action::Inspect,
                "reset" => Action::Reset,
                _ => Action::Unban,
            })
        }
        "ban" => {
            only(&["for"], what)?;
            ban_action(
                body.lasts
                    .as_deref()
                    .ok_or("ban needs \"for\", like \"10m\"")?,
            )
        }
        _ if body.clear == Some(true) => {
            only(&["clear"], "override with \"clear\"")?;
            Ok(Action::Clear)
        }
        _ => {
            only(&["limit", "window", "for", "clear"], what)?;
            override_action(
                body.limit
                    .ok_or("override needs \"limit\", or \"clear\": true")?,
                body.window.as_deref(),
                body.lasts.as_deref(),
            )
        }
    }
}

/// 400 for an action refused before it runs (a body that is not JSON, a
/// field the action does not take, a bad value), logged as an action's
/// outcome is.
pub fn refused_action(what: &str, client: IpAddr, why: &str) -> HttpResponse {
    log::info!(
        "{}: refused ({})",
        Escaped(&format!("admin {what} from {client}")),
        Escaped(why)
    );
    error(StatusCode::BAD_REQUEST, why)
}

/// A request without the right token: 401, or 429 once its address has
/// failed [`FAILURES`] times in [`FAILURE_WINDOW`]. A loopback client (this
/// machine: an operator's shell, a check script) always gets 401 and is
/// not counted: whoever can reach loopback can read the token's file
/// anyway, and its scripts must see a wrong token as 401. Failures are counted in
/// Redis through the library's [`Limiter`] (a sliding
/// window keyed by the address), so every serving process shares one
/// count and the process keeps nothing per address; a request with the
/// right token never gets here, so it is never limited nor counted. When
/// Redis cannot count, the answer is 401 (the token is still needed).
pub async fn refuse_authentication(
    limiter: &Limiter,
    prefix: &str,
    req: &HttpRequest,
    client: IpAddr,
) -> HttpResponse {
    if client.is_loopback() {
        return unauthorized(req, client);
    }
    let key = floodgate::rule::redis_key_for(
        limiter.hash_tags(),
        prefix,
        FAILURE_NAME,
        "ip",
        &floodgate::net::ip_id(client),
    );
    let decided = match Algorithm::sliding_window(FAILURES, FAILURE_WINDOW) {
        Ok(algorithm) => limiter
            .decide(vec![Check::new(key, algorithm)])
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let over = match decided {
        Ok(decision) if !decision.allowed => {
            decision.outcomes.first().map(|o| o.retry_after_secs())
        }
        Ok(_) => None,
        Err(e) => {
            log::warn!(
                "admin: cannot count a failed authentication ({})",
                Escaped(&e)
            );
            None
        }
    };
    if let Some(retry) = over {
        crate::repeated!(
            &crate::log_kinds::ADMIN_REFUSED,
            "admin: {} from {client}: refused (too many failed authentications)",
            Escaped(req.path())
        );
        let mut res = json(
            StatusCode::TOO_MANY_REQUESTS,
            format!("{{\"error\":\"rate_limited\",\"retry_after\":{retry}}}"),
        );
        res.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(retry));
        return res;
    }
    unauthorized(req, client)
}

/// 401, asking for a bearer token.
fn unauthorized(req: &HttpRequest, client: IpAddr) -> HttpResponse {
    crate::repeated!(
        &crate::log_kinds::ADMIN_REFUSED,
        "admin: {} from {client}: refused (no or wrong token)",
        Escaped(req.path())
    );
    let mut res = error(StatusCode::UNAUTHORIZED, "unauthorized");
    res.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    res
}

/// The body, up to [`MAX_BODY`] (413 beyond; 400 when the connection breaks).
pub async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
) -> Result<Vec<u8>, HttpResponse> {
    let too_large = || error(StatusCode::PAYLOAD_TOO_LARGE, "body too large");
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|_| error(StatusCode::BAD_REQUEST, "unreadable body"))?;
        if body.len() + chunk.len() > MAX_BODY {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Writes an operator's `action` on `key` (under `rule`), by `by`, to the
/// audit trail; a failure is logged (the action itself was done).
pub async fn audit(
    limiter: Arc<Limiter>,
    prefix: String,
    action: Action,
    (rule, key): (String, String),
    by: String,
) {
    let recorded =
        web::block(move || listings::record(&limiter, &prefix, &action, &rule, &key, &by)).await;
    if let Err(e) = recorded
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()))
    {
        log::warn!(
            "admin {}: done, but not written to the audit trail: {e}",
            action.name()
        );
    }
}

/// `GET /admin/bans|overrides[?rule=R]`, `GET /admin/top?rule=R[&since=D]`,
/// `GET /admin/find?value=V`, `GET /admin/audit[?since=D]`: a JSON array,
/// as the command line lists them, over the rules `known` (`searched`
/// tells what `find` looks for in each of them).
pub async fn listing(
    limiter: Arc<Limiter>,
    prefix: String,
    known: Vec<listings::Known>,
    searched: impl FnOnce(&str) -> Vec<listings::Searched> + Send + 'static,
    what: &str,
    query: &str,
) -> HttpResponse {
    let mut rule = None;
    let mut since = None;
    let mut found = None;
    for (name, value) in form_urlencoded::parse(query.as_bytes()) {
        match (what, name.as_ref()) {
            ("bans" | "overrides" | "top", "rule") if rule.is_none() => {
                rule = Some(value.into_owned())
            }
            ("top", "since") if since.is_none() => since = Some(value.into_owned()),
            ("find", "value") if found.is_none() => found = Some(value.into_owned()),
            ("audit", "since") if since.is_none() => since = Some(value.into_owned()),
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &format!("{what} takes no parameter {name:?} (or takes it once)"),
                )
            }
        }
    }
    if let Some(rule) = &rule {
        if let Err(e) = listings::known_rule(&known, rule) {
            return error(StatusCode::BAD_REQUEST, &e);
        }
    }
    if what == "top" && rule.is_none() {
        return error(StatusCode::BAD_REQUEST, "top needs ?rule=R");
    }
    let looked = if what == "top" {
        listings::top_since("since", since.as_deref()).map(|d| (0, d))
    } else {
        listings::since("since", since.as_deref()).map(|s| (s, Duration::ZERO))
    };
    let (since, top_since) = match looked {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    if what == "find" && found.is_none() {
        return error(StatusCode::BAD_REQUEST, "find needs ?value=V");
    }
    let what = what.to_string();
    let found = web::block(move || {
        let searched = found.as_deref().map(searched).unwrap_or_default();
        let asked = listings::Asked {
            what: &what,
            rule: rule.as_deref(),
            searched: &searched,
            since,
            top_since,
        };
        listings::list(&limiter, &prefix, &known, &asked)
    })
    .await;
    match found {
        Ok(Ok(objects)) => json(
            StatusCode::OK,
            serde_json::Value::Array(objects).to_string(),
        ),
        Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}
