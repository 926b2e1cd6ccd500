//! What a request the filter refuses gets: a denial (303 to the error page,
//! 429, or the application's own response), or the answer to a request the
//! filter cannot read (400, 413, 415, 431).

use http::StatusCode;

use super::head::Head;
use super::{values, Denial, Filter};
use crate::limiter::{Decision, LimiterError, Outcome};
use crate::logging::{self, Escaped};
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

/// Each rule's name and whether it was over, for the log.
pub(super) fn summary(rules: &[&Rule], outcomes: &[Outcome]) -> String {
    rules
        .iter()
        .zip(outcomes)
        .map(|(r, o)| format!("{}={}", r.name, if o.allowed { "ok" } else { "over" }))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A request over its limits, or that no one could decide, as every door
/// answers it.
pub(super) enum Denied<'r> {
    /// Over a limit.
    Limited {
        /// The denying rule that frees last: it names the denial, so that
        /// `Retry-After` holds for every rule.
        rule: &'r Rule,
        /// Seconds until the request would be allowed.
        retry: u64,
        /// The rules whose `RateLimit` fields the denial carries, and
        /// their outcomes (one each).
        rules: Vec<&'r Rule>,
        outcomes: Vec<Outcome>,
        /// Who decided.
        by: DecidedBy,
    },
    /// Redis did not decide and an enforce rule says `on_redis_error =
    /// "deny"`: 503.
    Unavailable(LimiterError),
}

/// Who denied a request.
pub(super) enum DecidedBy {
    /// Redis: the denying rules are counted here (bans too).
    Redis,
    /// The denial cache (counted where it was looked up).
    Remembered,
    /// This process, for Redis did not answer (`on_redis_error = "local"`;
    /// counted where it was decided).
    Here(LimiterError),
}

impl Denied<'_> {
    /// The answer to the denial (its fields not yet written): the
    /// application's, or the filter's own.
    pub(super) fn answer(&self, filter: &Filter, req: &impl Head) -> Answer {
        match self {
            Denied::Limited {
                rule,
                retry,
                rules,
                outcomes,
                ..
            } => {
                let banned = is_banned(rule, rules, outcomes);
                denial(filter, req, rule, *retry, banned)
            }
            Denied::Unavailable(_) => unavailable(req.headers()),
        }
    }
}

/// Logs a denial of `method` `path` (decoded), as every door does (the
/// gate counted it).
pub(super) fn noted(method: &str, path: &str, denied: &Denied<'_>) {
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
    /// Input the filter cannot read at all (no rule's key is at fault).
    Input(Input),
    /// A key value that cannot be read, or is missing for a rule that
    /// rejects those (the rule, when one rule's key is at fault).
    Unreadable(values::Unreadable, Option<&'r Rule>),
}

/// Input the filter cannot read, whatever the rules' keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Input {
    /// 431: a header block over [`MAX_HEADER_BYTES`](super::MAX_HEADER_BYTES).
    HeadersTooLarge,
    /// 400: a path whose percent-decoding is not UTF-8.
    BadPath,
    /// 413: a body over `max_form` (the bound, in bytes).
    BodyTooLarge(usize),
    /// 400: a body that broke off before its end.
    BrokenBody,
    /// 415: a `Content-Type` that both a form reader and a JSON reader
    /// take (`application/x-www-form-urlencoded+json`, to axum's `Form`
    /// and `Json`), so that the filter cannot know which one the handler
    /// reads the body with. (The actix door's form reader takes only
    /// `application/x-www-form-urlencoded` itself.)
    #[cfg_attr(not(feature = "tower"), allow(dead_code))]
    AmbiguousBody,
}

/// Whether `path` (as received) is `page` (as the rules read paths, decoded).
fn is_error_page(path: &str, page: &str) -> bool {
    path == page || percent_encoding::percent_decode_str(path).decode_utf8_lossy() == page
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
}

/// Whether the client asks for a page: its `Accept` names `text/html`, as
/// browsers' do. Everyone else (no `Accept`, `*/*`, `application/json`) is
/// answered JSON.
pub(crate) fn wants_html(headers: &impl HeaderLines) -> bool {
    accepts_in(headers, "text/html")
}

/// The filter's own answer to a denied request (no application responder):
/// a 303 to the error page, or a 429: the HTML page for a client whose
/// `Accept` names `text/html`, JSON for every other.
pub(crate) fn answer(
    filter: &Filter,
    headers: &impl HeaderLines,
    raw_path: &str,
    denial: &Denial,
) -> Answer {
    let (rule, retry) = (&denial.rule, denial.retry_after);
    let html = wants_html(headers);
    // A client that asks for JSON and not for HTML is never sent to a page.
    let json_only = !html && accepts_in(headers, "application/json");
    // A limit wrapped on the error page's own resource would send the
    // browser back to the page that denied it, forever: that one gets the
    // 429 instead (a file's or a builder's rule that covers its page is
    // refused when the filter is built).
    let redirect =
        rule.deny == Deny::Redirect && !json_only && !is_error_page(raw_path, &rule.error_page);
    let mut fields = vec![
        ("retry-after", retry.to_string()),
        ("cache-control", "no-store".to_string()),
    ];
    if redirect {
        // Rule names are [A-Za-z0-9_-]: safe in a query as they are.
        let mut location = format!("{}?rule={}&retry_after={retry}", rule.error_page, rule.name);
        if denial.banned {
            location.push_str("&banned=1");
        }
        fields.push(("location", location));
        return Answer::new(StatusCode::SEE_OTHER, fields, String::new());
    }
    if html {
        fields.push(("content-type", "text/html; charset=utf-8".to_string()));
        let page = (filter.state.denial_page)(denial);
        return Answer::new(StatusCode::TOO_MANY_REQUESTS, fields, page);
    }
    fields.push(("content-type", "application/json".to_string()));
    // Rule names are [A-Za-z0-9_-]: nothing to escape; fields in the documented order.
    let body = format!(
        "{{\"error\":\"{}\",\"rule\":\"{}\",\"retry_after\":{retry}}}",
        if denial.banned {
            "banned"
        } else {
            "rate_limited"
        },
        rule.name
    );
    Answer::new(StatusCode::TOO_MANY_REQUESTS, fields, body)
}

/// The answer to a request no one could decide, under a rule whose
/// `on_redis_error` is `deny`: 503 with `Retry-After: 1`, its body as a
/// refusal's (JSON `{"error":"unavailable",...}`, or a page for a browser).
pub(crate) fn unavailable(headers: &impl HeaderLines) -> Answer {
    let told = Refusal {
        status: StatusCode::SERVICE_UNAVAILABLE,
        error: "unavailable",
        rule: None,
        detail: "the rate limiter is unavailable; try again in a second".to_string(),
        key: None,
    };
    let mut answer = told_answer(&told, headers);
    if let Ok(v) = http::HeaderValue::try_from("1") {
        answer.headers.insert(http::header::RETRY_AFTER, v);
    }
    answer
}

/// What a refused request is told: its status, the `error` code of the
/// JSON answer, the rule whose key is at fault (when one is), and why.
struct Refusal<'a> {
    status: StatusCode,
    error: &'static str,
    rule: Option<&'a str>,
    detail: String,
    /// The kind of key value missing (`missing_key` only).
    key: Option<String>,
}

impl Refused<'_> {
    fn told(&self) -> Refusal<'_> {
        let plain = |status, error, detail: &str| Refusal {
            status,
            error,
            rule: None,
            detail: detail.to_string(),
            key: None,
        };
        match self {
            Refused::Input(Input::HeadersTooLarge) => plain(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "header_fields_too_large",
                &format!(
                    "the request's header fields are over {} KiB",
                    super::MAX_HEADER_BYTES / 1024
                ),
            ),
            Refused::Input(Input::BadPath) => plain(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "the request path does not percent-decode to UTF-8",
            ),
            Refused::Input(Input::BodyTooLarge(max)) => plain(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                &format!("the body is over the {max} bytes the filter reads (max_form)"),
            ),
            Refused::Input(Input::BrokenBody) => plain(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "the body could not be read to its end",
            ),
            Refused::Input(Input::AmbiguousBody) => plain(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "the Content-Type names both a form and JSON; send one of them",
            ),
            Refused::Unreadable(values::Unreadable::Malformed(why), rule) => Refusal {
                rule: rule.map(|r| r.name.as_str()),
                ..plain(StatusCode::BAD_REQUEST, "bad_request", why)
            },
            Refused::Unreadable(values::Unreadable::Unsupported(why), rule) => Refusal {
                rule: rule.map(|r| r.name.as_str()),
                ..plain(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    why,
                )
            },
            Refused::Unreadable(values::Unreadable::Missing(at), rule) => {
                let kind = rule
                    .and_then(|r| r.key.kinds().get(*at))
                    .map(ToString::to_string)
                    .unwrap_or_default();
                let detail = match rule {
                    Some(r) => format!(
                        "the request has no {kind} value, and rule {} refuses requests without one",
                        r.name
                    ),
                    None => "the request has no value for a rule's key".to_string(),
                };
                Refusal {
                    status: StatusCode::BAD_REQUEST,
                    error: "missing_key",
                    rule: rule.map(|r| r.name.as_str()),
                    detail,
                    key: Some(kind),
                }
            }
        }
    }
}

/// The answer to a request refused before it is decided: JSON
/// (`{"error":CODE,"rule":NAME_OR_NULL,"detail":TEXT}`, and `"key"` for a
/// missing key), or a small HTML page saying the same to a client whose
/// `Accept` (in `headers`) names `text/html`.
pub(crate) fn refusal(refused: &Refused<'_>, headers: &impl HeaderLines) -> Answer {
    told_answer(&refused.told(), headers)
}

/// A refusal's answer, JSON or a page as `headers` ask.
fn told_answer(told: &Refusal<'_>, headers: &impl HeaderLines) -> Answer {
    let mut fields = vec![("cache-control", "no-store".to_string())];
    if wants_html(headers) {
        fields.push(("content-type", "text/html; charset=utf-8".to_string()));
        return Answer::new(told.status, fields, refusal_page(told));
    }
    // The fields in the documented order (a struct keeps its order; a
    // JSON map would sort them).
    #[derive(serde::Serialize)]
    struct Body<'a> {
        error: &'a str,
        rule: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        key: Option<&'a str>,
        detail: &'a str,
    }
    let body = Body {
        error: told.error,
        rule: told.rule,
        key: told.key.as_deref(),
        detail: &told.detail,
    };
    let body = serde_json::to_string(&body).unwrap_or_default();
    fields.push(("content-type", "application/json".to_string()));
    Answer::new(told.status, fields, body)
}

/// The page a browser is shown for a refusal: the status, and why.
fn refusal_page(told: &Refusal<'_>) -> String {
    let code = told.status.as_u16();
    let reason = told.status.canonical_reason().unwrap_or("Refused");
    let rule = match told.rule {
        Some(name) => format!("<p>Rule: {}</p>\n", Html(name)),
        None => String::new(),
    };
    format!(
        "<!doctype html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>{code} {reason}</title></head>\n<body>\n<h1>{code} {reason}</h1>\n<p>{}</p>\n{rule}</body>\n</html>\n",
        Html(&told.detail)
    )
}

/// Text written into HTML: `&`, `<`, `>` and quotes escaped.
pub(crate) struct Html<'a>(pub(crate) &'a str);

impl std::fmt::Display for Html<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for c in self.0.chars() {
            match c {
                '&' => f.write_str("&amp;")?,
                '<' => f.write_str("&lt;")?,
                '>' => f.write_str("&gt;")?,
                '"' => f.write_str("&quot;")?,
                '\'' => f.write_str("&#39;")?,
                c => std::fmt::Write::write_char(f, c)?,
            }
        }
        Ok(())
    }
}

/// Whether the denying `rule` denied because the identity is banned (its
/// outcome among `rules`' `outcomes`).
pub(super) fn is_banned(rule: &Rule, rules: &[&Rule], outcomes: &[Outcome]) -> bool {
    rules
        .iter()
        .zip(outcomes)
        .any(|(r, o)| std::ptr::eq(*r, rule) && o.banned)
}

/// The response to a denied request, as every door sends it: the
/// application's responder's (with `Retry-After` and `Cache-Control` added
/// where it has none), or the filter's own [`answer`].
pub(crate) fn denial<H: Head>(
    filter: &Filter,
    req: &H,
    rule: &Rule,
    retry: u64,
    banned: bool,
) -> Answer {
    let denial = Denial {
        rule: rule.clone(),
        retry_after: retry,
        banned,
    };
    let Some(respond) = &filter.state.responder else {
        return answer(filter, req.headers(), req.raw_path(), &denial);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn accepting(accept: Option<&str>) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        if let Some(a) = accept {
            headers.insert(http::header::ACCEPT, a.parse().unwrap());
        }
        headers
    }

    fn field<'a>(answer: &'a Answer, name: &str) -> Option<&'a str> {
        answer.headers.get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn refusals_are_json_unless_the_client_asks_for_html() {
        let refused = Refused::Input(Input::BodyTooLarge(1024));
        for accept in [None, Some("*/*"), Some("application/json")] {
            let answer = refusal(&refused, &accepting(accept));
            assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
            assert_eq!(field(&answer, "content-type"), Some("application/json"));
            assert_eq!(field(&answer, "cache-control"), Some("no-store"));
            let body: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
            assert_eq!(body["error"], "body_too_large", "{accept:?}");
            assert_eq!(body["rule"], serde_json::Value::Null);
            assert!(body["detail"].as_str().unwrap().contains("1024"), "{body}");
        }
        let browser = "text/html,application/xhtml+xml,*/*;q=0.8";
        let answer = refusal(&refused, &accepting(Some(browser)));
        assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            field(&answer, "content-type"),
            Some("text/html; charset=utf-8")
        );
        assert_eq!(field(&answer, "cache-control"), Some("no-store"));
        assert!(answer.body.contains("<html"), "{}", answer.body);
        assert!(answer.body.contains("1024 bytes"), "{}", answer.body);
    }

    #[test]
    fn every_refusal_has_its_code() {
        let cases = [
            (
                Refused::Input(Input::HeadersTooLarge),
                431,
                "header_fields_too_large",
            ),
            (Refused::Input(Input::BadPath), 400, "bad_request"),
            (Refused::Input(Input::BrokenBody), 400, "bad_request"),
            (
                Refused::Input(Input::AmbiguousBody),
                415,
                "unsupported_media_type",
            ),
            (
                Refused::Unreadable(
                    values::Unreadable::Malformed("a key field is repeated"),
                    None,
                ),
                400,
                "bad_request",
            ),
            (
                Refused::Unreadable(
                    values::Unreadable::Unsupported("unknown form charset"),
                    None,
                ),
                415,
                "unsupported_media_type",
            ),
        ];
        for (refused, status, error) in cases {
            let answer = refusal(&refused, &accepting(None));
            assert_eq!(answer.status.as_u16(), status, "{error}");
            let body: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
            assert_eq!(body["error"], error);
            assert!(!body["detail"].as_str().unwrap().is_empty(), "{body}");
        }
    }

    #[test]
    fn html_escapes_what_it_echoes() {
        assert_eq!(
            Html("<a href=\"x\">&'</a>").to_string(),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;"
        );
    }
}
