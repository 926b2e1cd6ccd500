//! What a request the filter refuses gets: a denial (303 to the error page,
//! 429, or the application's own response), or the answer to a request the
//! filter cannot read (400, 413, 415, 431).

use actix_web::body::EitherBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse};

use super::{key, Denial, Filter};
use crate::limit::{Decision, Outcome};
use crate::logging::Escaped;
use crate::rule::{Deny, Mode, Rule};

/// The enforce rule that denies and frees last, with its outcome.
pub(super) fn denying<'r>(
    matched: &[&'r Rule],
    decision: &Decision,
) -> Option<(&'r Rule, Outcome)> {
    matched
        .iter()
        .zip(&decision.outcomes)
        .filter(|(r, o)| r.mode == Mode::Enforce && !o.allowed)
        .max_by_key(|(_, o)| o.wait)
        .map(|(r, o)| (*r, *o))
}

/// The answer to a request whose key value cannot be read as the handler
/// would read it: 415 for a charset or coding, 400 for the rest; and to a
/// request without the key value of a rule (`rule`) that rejects those.
pub(super) fn unreadable<B>(
    req: ServiceRequest,
    e: key::Unreadable,
    rule: Option<&Rule>,
) -> ServiceResponse<EitherBody<B>> {
    match e {
        key::Unreadable::Malformed(why) => plain(req, StatusCode::BAD_REQUEST, why),
        key::Unreadable::Unsupported(why) => plain(req, StatusCode::UNSUPPORTED_MEDIA_TYPE, why),
        key::Unreadable::Missing(at) => {
            let (name, kind) = match rule {
                Some(r) => (
                    r.name.as_str(),
                    r.key.kinds().get(at).map(ToString::to_string),
                ),
                None => ("", None),
            };
            log::debug!(
                "{} {}: refused by rule {name}: no {} value",
                req.method(),
                Escaped(req.path()),
                kind.as_deref().unwrap_or("key")
            );
            let body = serde_json::json!({
                "error": "missing_key",
                "rule": name,
                "key": kind.unwrap_or_default(),
            });
            let response = HttpResponse::BadRequest()
                .insert_header((header::CACHE_CONTROL, "no-store"))
                .content_type("application/json")
                .body(body.to_string());
            req.into_response(response).map_into_right_body()
        }
    }
}

/// Answer `status` with a short text body (malformed or oversized input).
pub(super) fn plain<B>(
    req: ServiceRequest,
    status: StatusCode,
    text: &'static str,
) -> ServiceResponse<EitherBody<B>> {
    let response = HttpResponse::build(status)
        .content_type("text/plain; charset=utf-8")
        .body(text);
    req.into_response(response).map_into_right_body()
}

/// Whether `req` asks for `page` (as the rules read paths, decoded).
pub(super) fn is_error_page(req: &HttpRequest, page: &str) -> bool {
    req.path() == page
        || percent_encoding::percent_decode_str(req.path()).decode_utf8_lossy() == page
}

/// Whether the `Accept` field names a media type.
pub fn accepts(req: &HttpRequest, media: &str) -> bool {
    req.headers()
        .get_all(header::ACCEPT)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            item.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case(media))
        })
}

/// The response to a denied request: a 303 to the error page, or a 429.
pub(super) fn denial(filter: &Filter, req: &HttpRequest, rule: &Rule, retry: u64) -> HttpResponse {
    if let Some(respond) = &filter.state.responder {
        let denial = Denial {
            rule: rule.clone(),
            retry_after: retry,
        };
        let mut res = respond(&denial, req);
        let headers = res.headers_mut();
        if !headers.contains_key(header::RETRY_AFTER) {
            if let Ok(v) = HeaderValue::try_from(retry.to_string()) {
                headers.insert(header::RETRY_AFTER, v);
            }
        }
        if !headers.contains_key(header::CACHE_CONTROL) {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        return res;
    }
    let json = accepts(req, "application/json");
    // A limit wrapped on the error page's own resource would send the
    // browser back to the page that denied it, forever: that one gets the
    // 429 instead (a file's or a builder's rule that covers its page is
    // refused when the filter is built).
    let redirect = rule.deny == Deny::Redirect
        && (!json || accepts(req, "text/html"))
        && !is_error_page(req, &rule.error_page);
    if redirect {
        // Rule names are [A-Za-z0-9_-]: safe in a query as they are.
        let location = format!("{}?rule={}&retry_after={retry}", rule.error_page, rule.name);
        return HttpResponse::SeeOther()
            .insert_header((header::LOCATION, location))
            .insert_header((header::RETRY_AFTER, retry.to_string()))
            .insert_header((header::CACHE_CONTROL, "no-store"))
            .finish();
    }
    let mut builder = HttpResponse::TooManyRequests();
    builder
        .insert_header((header::RETRY_AFTER, retry.to_string()))
        .insert_header((header::CACHE_CONTROL, "no-store"));
    if json {
        // Rule names are [A-Za-z0-9_-]: nothing to escape; fields in the documented order.
        builder.content_type("application/json").body(format!(
            "{{\"error\":\"rate_limited\",\"rule\":\"{}\",\"retry_after\":{retry}}}",
            rule.name
        ))
    } else {
        builder
            .content_type("text/html; charset=utf-8")
            .body((filter.state.denial_page)(rule, retry))
    }
}
