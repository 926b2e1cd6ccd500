//! What the actix door writes besides the handler's response: denials,
//! refusals, and the rules' fields, merged with a nested filter's through
//! the request's extensions.

use actix_web::body::EitherBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::{HttpMessage, HttpRequest, HttpResponse};

use crate::filter::deny::{refusal, Denied, Refused};
use crate::filter::fields::{expose_unavailable, write_noted, Noted};
use crate::filter::{values, Filter, Usage};
use crate::limiter::Outcome;
use crate::logging::Escaped;
use crate::rule::Rule;

/// The denial of `req` (counted and logged by `settle`):
/// answered (303 to the error page, 429, 503, or the application's own
/// response) with `Retry-After` and the rules' fields, and the units an
/// outer filter took for the request given back.
pub(super) fn deny<B>(
    filter: &Filter,
    req: ServiceRequest,
    denied: Denied<'_>,
) -> ServiceResponse<EitherBody<B>> {
    let mut response = denied.answer(filter, req.request()).to_actix();
    match &denied {
        Denied::Limited {
            rules, outcomes, ..
        } => on_denial(&mut response, req.request(), rules, outcomes),
        Denied::Unavailable(_) => on_unavailable(&mut response, req.request()),
    }
    // Units an outer filter already took for this request go back.
    Usage::deny_outer(req.request());
    req.into_response(response).map_into_right_body()
}

/// The answer to a [`Refused`] request, as the actix door sends it.
pub(super) fn refuse<B>(
    req: ServiceRequest,
    refused: Refused<'_>,
) -> ServiceResponse<EitherBody<B>> {
    if let Refused::Unreadable(values::Unreadable::Missing(at), rule) = &refused {
        log::debug!(
            "{} {}: refused by rule {}: no {} value",
            req.method(),
            Escaped(req.path()),
            rule.map_or("", |r| r.name.as_str()),
            rule.and_then(|r| r.key.kinds().get(*at))
                .map_or("key".to_string(), ToString::to_string)
        );
    }
    let response = refusal(&refused, req.headers()).to_actix();
    req.into_response(response).map_into_right_body()
}

/// Adds the fields of `rules` (with their `outcomes`) to a response the
/// filter passed on. `nothing_taken`: an inner filter denied the request
/// and this filter's units went back.
pub(super) fn on_response<B>(
    res: &mut ServiceResponse<B>,
    rules: &[&Rule],
    outcomes: &[Outcome],
    nothing_taken: bool,
) {
    let req = res.request().clone();
    noted(&req, res.headers_mut(), rules, outcomes, nothing_taken);
}

/// Adds the fields of `rules` (with their `outcomes`) to a denial of `req`.
pub(super) fn on_denial(
    res: &mut HttpResponse,
    req: &HttpRequest,
    rules: &[&Rule],
    outcomes: &[Outcome],
) {
    noted(req, res.headers_mut(), rules, outcomes, true);
}

/// Names `Retry-After` in `Access-Control-Expose-Headers` of the `503` a
/// request with an `Origin` gets when no one could decide it.
pub(super) fn on_unavailable(res: &mut HttpResponse, req: &HttpRequest) {
    let earlier = req.extensions_mut().remove::<Noted>();
    let now = expose_unavailable(res.headers_mut(), earlier, has_origin(req));
    req.extensions_mut().insert(now);
}

/// Whether the request names the origin of a page's script.
fn has_origin(req: &HttpRequest) -> bool {
    req.headers().contains_key(actix_web::http::header::ORIGIN)
}

/// [`write_noted`], with what a filter inside noted taken from, and what
/// this one writes noted in, the request's extensions.
fn noted(
    req: &HttpRequest,
    headers: &mut actix_web::http::header::HeaderMap,
    rules: &[&Rule],
    outcomes: &[Outcome],
    denied: bool,
) {
    let earlier = req.extensions_mut().remove::<Noted>();
    if let Some(now) = write_noted(headers, earlier, has_origin(req), (rules, outcomes), denied) {
        req.extensions_mut().insert(now);
    }
}
