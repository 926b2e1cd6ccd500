//! What a request the filter refuses gets: a denial (303 to the error page,
//! 429, or the application's own response), or the answer to a request the
//! filter cannot read (400, 413, 415, 431).

use actix_web::body::EitherBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode as ActixStatus;
use actix_web::{HttpRequest, HttpResponse};
use http::StatusCode;

use super::decision::summary;
use super::head::Head;
use super::{fields, values, Denial, Filter, Usage};
use crate::limiter::{Decision, LimiterError, Outcome};
use crate::logging::{self, Escaped};
use crate::metrics::DecisionKind as Counted;
use crate::net::HeaderLines;
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

/// A request over its limits, or that no one could decide, as the one
/// place that answers denials ([`deny`]) takes it.
pub(super) enum Denied<'a> {
    /// Over a limit.
    Limited {
        /// The denying rule that frees last: it names the denial, so that
        /// `Retry-After` holds for every rule.
        rule: &'a Rule,
        /// Seconds until the request would be allowed.
        retry: u64,
        /// The rules whose `RateLimit` fields the denial carries, and
        /// their outcomes (one each).
        rules: &'a [&'a Rule],
        outcomes: &'a [Outcome],
        /// Who decided.
        by: DecidedBy<'a>,
    },
    /// Redis did not decide and an enforce rule says `on_redis_error =
    /// "deny"`: 503.
    Unavailable(&'a LimiterError),
}

/// Who denied a request.
#[derive(Clone, Copy)]
pub(super) enum DecidedBy<'a> {
    /// Redis: the denying rules are counted here (bans too).
    Redis,
    /// The denial cache (counted where it was looked up).
    Remembered,
    /// This process, for Redis did not answer (`on_redis_error = "local"`;
    /// counted where it was decided).
    Here(&'a LimiterError),
}

/// The denial of `req`, whose decoded path is `path`: counted and logged,
/// answered (303 to the error page, 429, 503, or the application's own
/// response) with `Retry-After` and the rules' fields, and the units an
/// outer filter took for the request given back.
pub(super) fn deny<B>(
    filter: &Filter,
    req: ServiceRequest,
    path: &str,
    denied: Denied<'_>,
) -> ServiceResponse<EitherBody<B>> {
    noted(filter, req.method().as_str(), path, &denied);
    let response = match denied {
        Denied::Limited {
            rule,
            retry,
            rules,
            outcomes,
            ..
        } => {
            let mut response = denial(filter, req.request(), rule, retry).to_actix();
            fields::on_denial(&mut response, req.request(), rules, outcomes);
            response
        }
        Denied::Unavailable(_) => unavailable().to_actix(),
    };
    // Units an outer filter already took for this request go back.
    Usage::deny_outer(req.request());
    req.into_response(response).map_into_right_body()
}

/// Counts and logs a denial of `method` `path` (decoded), as every door does.
pub(super) fn noted(filter: &Filter, method: &str, path: &str, denied: &Denied<'_>) {
    // The path as the log shows it: a decoded newline cannot forge a line.
    let shown = Escaped(path);
    match denied {
        Denied::Limited {
            rule,
            retry,
            rules,
            outcomes,
            by,
        } => match by {
            DecidedBy::Redis => {
                let metrics = &filter.state.metrics;
                for (r, o) in rules.iter().zip(outcomes.iter()) {
                    if r.mode == Mode::Enforce && !o.allowed {
                        let counted = if o.banned {
                            Counted::Banned
                        } else {
                            Counted::Denied
                        };
                        metrics.decision(&r.name, counted);
                    }
                    if o.ban_started {
                        metrics.ban(&r.name, "penalty");
                    }
                }
                log::debug!(
                    "{method} {shown}: denied by {} for {retry}s ({})",
                    rule.name,
                    summary(rules, outcomes)
                );
            }
            DecidedBy::Remembered => log::debug!(
                "{method} {shown}: denied by {} for {retry}s (remembered denial)",
                rule.name
            ),
            DecidedBy::Here(error) => crate::logging::repeated!(
                &logging::NO_DECISION,
                "{method} {shown}: no decision ({}), denied here by {} for {retry}s",
                Escaped(&error.to_string()),
                rule.name
            ),
        },
        Denied::Unavailable(error) => crate::logging::repeated!(
            &logging::NO_DECISION,
            "{method} {shown}: no decision ({}), error_denied",
            Escaped(&error.to_string())
        ),
    }
}

/// A request refused before it is decided: its input cannot be read as the
/// handler would read it.
pub(super) enum Refused<'r> {
    /// Malformed or oversized input: the status, and a short text.
    Plain(StatusCode, &'static str),
    /// A key value that cannot be read, or is missing for a rule that
    /// rejects those (the rule, when one rule's key is at fault).
    Unreadable(values::Unreadable, Option<&'r Rule>),
}

/// The answer to a [`Refused`] request.
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
    let response = refusal(&refused).to_actix();
    req.into_response(response).map_into_right_body()
}

/// Whether `path` (as received) is `page` (as the rules read paths, decoded).
fn is_error_page(path: &str, page: &str) -> bool {
    path == page || percent_encoding::percent_decode_str(path).decode_utf8_lossy() == page
}

/// Whether the `Accept` field names a media type.
pub fn accepts(req: &HttpRequest, media: &str) -> bool {
    accepts_in(req.headers(), media)
}

/// Whether the `Accept` field of `headers` names a media type.
pub(crate) fn accepts_in(headers: &impl HeaderLines, media: &str) -> bool {
    headers
        .lines("accept")
        .filter_map(|v| std::str::from_utf8(v).ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            item.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case(media))
        })
}

/// A response the filter writes itself, as any door sends it: the status,
/// the header fields, the body.
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: http::HeaderMap,
    pub(crate) body: String,
}

impl Answer {
    fn new(status: StatusCode, fields: Vec<(&'static str, String)>, body: String) -> Answer {
        let mut headers = http::HeaderMap::with_capacity(fields.len());
        for (name, value) in fields {
            if let Ok(v) = http::HeaderValue::try_from(value) {
                headers.insert(http::HeaderName::from_static(name), v);
            }
        }
        Answer {
            status,
            headers,
            body,
        }
    }

    /// The answer as an actix-web response.
    fn to_actix(&self) -> HttpResponse {
        let status =
            ActixStatus::from_u16(self.status.as_u16()).unwrap_or(ActixStatus::TOO_MANY_REQUESTS);
        let mut builder = HttpResponse::build(status);
        for (name, value) in &self.headers {
            builder.insert_header((name.as_str(), value.as_bytes()));
        }
        builder.body(self.body.clone())
    }
}

/// The filter's own answer to a denied request (no application responder):
/// a 303 to the error page, or a 429 (JSON or the HTML page, by `Accept`).
pub(crate) fn answer(
    filter: &Filter,
    headers: &impl HeaderLines,
    raw_path: &str,
    rule: &Rule,
    retry: u64,
) -> Answer {
    let json = accepts_in(headers, "application/json");
    // A limit wrapped on the error page's own resource would send the
    // browser back to the page that denied it, forever: that one gets the
    // 429 instead (a file's or a builder's rule that covers its page is
    // refused when the filter is built).
    let redirect = rule.deny == Deny::Redirect
        && (!json || accepts_in(headers, "text/html"))
        && !is_error_page(raw_path, &rule.error_page);
    let mut fields = vec![
        ("retry-after", retry.to_string()),
        ("cache-control", "no-store".to_string()),
    ];
    if redirect {
        // Rule names are [A-Za-z0-9_-]: safe in a query as they are.
        let location = format!("{}?rule={}&retry_after={retry}", rule.error_page, rule.name);
        fields.push(("location", location));
        return Answer::new(StatusCode::SEE_OTHER, fields, String::new());
    }
    if json {
        fields.push(("content-type", "application/json".to_string()));
        // Rule names are [A-Za-z0-9_-]: nothing to escape; fields in the documented order.
        let body = format!(
            "{{\"error\":\"rate_limited\",\"rule\":\"{}\",\"retry_after\":{retry}}}",
            rule.name
        );
        return Answer::new(StatusCode::TOO_MANY_REQUESTS, fields, body);
    }
    fields.push(("content-type", "text/html; charset=utf-8".to_string()));
    let page = (filter.state.denial_page)(rule, retry);
    Answer::new(StatusCode::TOO_MANY_REQUESTS, fields, page)
}

/// The answer to a request no one could decide, under a rule whose
/// `on_redis_error` is `deny`.
pub(crate) fn unavailable() -> Answer {
    Answer::new(
        StatusCode::SERVICE_UNAVAILABLE,
        vec![
            ("retry-after", "1".to_string()),
            ("cache-control", "no-store".to_string()),
            ("content-type", "text/plain; charset=utf-8".to_string()),
        ],
        "the rate limiter is unavailable; try again in a second\n".to_string(),
    )
}

/// The answer to a request refused before it is decided.
pub(crate) fn refusal(refused: &Refused<'_>) -> Answer {
    let plain = |status: StatusCode, text: &str| {
        Answer::new(
            status,
            vec![("content-type", "text/plain; charset=utf-8".to_string())],
            text.to_string(),
        )
    };
    match refused {
        Refused::Plain(status, text) => plain(*status, text),
        Refused::Unreadable(values::Unreadable::Malformed(why), _) => {
            plain(StatusCode::BAD_REQUEST, why)
        }
        Refused::Unreadable(values::Unreadable::Unsupported(why), _) => {
            plain(StatusCode::UNSUPPORTED_MEDIA_TYPE, why)
        }
        Refused::Unreadable(values::Unreadable::Missing(at), rule) => {
            let (name, kind) = match rule {
                Some(r) => (
                    r.name.as_str(),
                    r.key.kinds().get(*at).map(ToString::to_string),
                ),
                None => ("", None),
            };
            let body = serde_json::json!({
                "error": "missing_key",
                "rule": name,
                "key": kind.unwrap_or_default(),
            });
            Answer::new(
                StatusCode::BAD_REQUEST,
                vec![
                    ("cache-control", "no-store".to_string()),
                    ("content-type", "application/json".to_string()),
                ],
                body.to_string(),
            )
        }
    }
}

/// The response to a denied request, as every door sends it: the
/// application's responder's (with `Retry-After` and `Cache-Control` added
/// where it has none), or the filter's own [`answer`].
pub(crate) fn denial<H: Head>(filter: &Filter, req: &H, rule: &Rule, retry: u64) -> Answer {
    let Some(respond) = &filter.state.responder else {
        return answer(filter, req.headers(), req.raw_path(), rule, retry);
    };
    let denial = Denial {
        rule: rule.clone(),
        retry_after: retry,
    };
    let (parts, body) = respond(&denial, &req.request_head(filter.client_of(req))).into_parts();
    let mut headers = parts.headers;
    if !headers.contains_key(http::header::RETRY_AFTER) {
        headers.insert(http::header::RETRY_AFTER, http::HeaderValue::from(retry));
    }
    if !headers.contains_key(http::header::CACHE_CONTROL) {
        headers.insert(
            http::header::CACHE_CONTROL,
            http::HeaderValue::from_static("no-store"),
        );
    }
    Answer {
        status: parts.status,
        headers,
        body,
    }
}
