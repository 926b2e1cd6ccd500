//! The tower door: a [`Filter`] is a `tower::Layer`, so axum (0.8), tonic
//! and hyper services are guarded by the same rules, keys, decisions,
//! responses and fields as the actix-web filter, on the same Redis counts.
//!
//! A request goes through the same stages as under actix (`request.rs`):
//! the rules that match its method and path, the body its keys read
//! (exactly as axum's `Form` and `Json` read it, then handed on intact),
//! its keys, one decision for all its rules, and the answer: the inner
//! service's response with the rules' fields, or the filter's own denial
//! (303 to the error page, 429, 503), or its refusal (400, 413, 415, 431).
//! The client address is the peer from axum's `ConnectInfo` (feature
//! `axum`) or a [`SocketAddr`] request extension, behind the trusted
//! proxies. Handlers read the decision as a [`Usage`] request extension
//! (an axum extractor with the feature `axum`).
//!
//! The application's own functions (a [`DenialResponder`], a
//! [`SessionLookup`], [`Key::custom`](crate::Key::custom) and
//! [`Key::lookup`](crate::Key::lookup) key functions, `skip_if` predicates)
//! see the same [`RequestHead`](crate::RequestHead) under both doors. What
//! only the actix door has, for now: limits made in code
//! ([`Limit`](crate::Limit)) wrapped on single routes.
//!
//! [`DenialResponder`]: super::DenialResponder
//! [`SessionLookup`]: super::SessionLookup

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, Limited};

use super::decision::{self, Verdict};
use super::deny::{self, denying, refusal, unavailable, Answer, DecidedBy, Denied, Input, Refused};
use super::head::Head;
use super::request::{checks, count_allowed, give_back, guarding, lookups, Checked};
use super::{fields, json, values, Filter, Usage};
use crate::head::RequestHead;
use crate::limiter::{Decision, Outcome};
use crate::logging::{self, Escaped};
use crate::rule::{Count, Rule};

/// The error type of bodies: what a body's error is turned into.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a guarded service's responses: the inner service's, or the
/// filter's own answer.
pub type GuardedBody<B> = Either<B, Full<Bytes>>;

impl<S> tower_layer::Layer<S> for Filter {
    type Service = Guarded<S>;

    fn layer(&self, inner: S) -> Guarded<S> {
        Guarded {
            inner,
            filter: self.clone(),
        }
    }
}

/// A service behind the filter: what [`Filter`] as a `tower::Layer` makes.
#[derive(Clone)]
pub struct Guarded<S> {
    inner: S,
    filter: Filter,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Guarded<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guarded")
            .field("inner", &self.inner)
            .field("filter", &self.filter)
            .finish()
    }
}

impl<S, B, RB> tower_service::Service<Request<B>> for Guarded<S>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<GuardedBody<RB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The service that was polled ready serves this request; a clone
        // stays for the next (tower's usual hand-over).
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let filter = self.filter.clone();
        Box::pin(guard(filter, inner, req))
    }
}

/// A request's head as the tower door reads it.
struct TowerHead<'a> {
    parts: &'a Parts,
    peer: Option<IpAddr>,
}

impl<'a> TowerHead<'a> {
    fn new(parts: &'a Parts) -> TowerHead<'a> {
        TowerHead {
            parts,
            peer: peer(parts),
        }
    }
}

/// The TCP peer: axum's `ConnectInfo<SocketAddr>` (feature `axum`), or a
/// `SocketAddr` extension (what a hyper service inserts itself).
fn peer(parts: &Parts) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0.ip());
    }
    parts.extensions.get::<SocketAddr>().map(SocketAddr::ip)
}

impl Head for TowerHead<'_> {
    type Headers = http::HeaderMap;

    fn method(&self) -> &str {
        self.parts.method.as_str()
    }

    fn raw_path(&self) -> &str {
        self.parts.uri.path()
    }

    /// axum's router matches the path as received.
    fn routed_path(&self) -> &str {
        self.parts.uri.path()
    }

    fn query(&self) -> &str {
        self.parts.uri.query().unwrap_or("")
    }

    fn headers(&self) -> &http::HeaderMap {
        &self.parts.headers
    }

    fn header_bytes(&self) -> usize {
        self.parts
            .headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum()
    }

    fn peer(&self) -> Option<IpAddr> {
        self.peer
    }

    fn request_head(&self, client: IpAddr) -> RequestHead {
        RequestHead::new(
            self.parts.method.clone(),
            self.parts.uri.clone(),
            self.parts.headers.clone(),
            Some(client),
        )
    }
}

/// One request through the filter, in the stages the actix door has.
async fn guard<S, B, RB>(
    filter: Filter,
    inner: S,
    req: Request<B>,
) -> Result<Response<GuardedBody<RB>>, S::Error>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>>,
    B: Body<Data = Bytes> + From<Bytes>,
    B::Error: Into<BoxError>,
{
    let rules = filter.rules();
    let (mut parts, body) = req.into_parts();
    let guarded = guarding(&filter, &TowerHead::new(&parts), &rules);
    let (matched, path) = match guarded {
        Ok(Some(guarded)) => guarded,
        Ok(None) => return pass(inner, Request::from_parts(parts, body)).await,
        Err(refused) => return Ok(written(refusal(&refused, &parts.headers))),
    };
    let (read, body) = match read_body(&filter, &parts, body, &matched).await {
        Ok(read) => read,
        Err(refused) => return Ok(written(refusal(&refused, &parts.headers))),
    };
    let looked_up = lookups(&filter, &TowerHead::new(&parts), &matched).await;
    let head = TowerHead::new(&parts);
    let keyed = checks(&filter, &head, &path, &read.read(), &looked_up, &matched);
    let Checked { checks, own } = match keyed {
        Ok(keyed) => keyed,
        Err(refused) => return Ok(written(refusal(&refused, &parts.headers))),
    };
    let mut matched = matched;
    for (i, r) in &own {
        matched[*i] = r;
    }
    let metrics = &filter.state.metrics;
    let started = Instant::now();
    let verdict =
        decision::decide(&filter.state.limiter, metrics, &matched, &checks, started).await;
    metrics.observe(started.elapsed());
    let method = parts.method.clone();
    // Whether the fields are named for a page's script (the request moves
    // on to the inner service before they are written).
    let origin = parts.headers.contains_key(http::header::ORIGIN);
    let denial = |denied: Denied<'_>, parts: &Parts| {
        deny::noted(&filter, method.as_str(), &path, &denied);
        match denied {
            Denied::Limited {
                rule,
                retry,
                rules,
                outcomes,
                ..
            } => {
                let banned = deny::is_banned(rule, rules, outcomes);
                let mut answered =
                    deny::denial(&filter, &TowerHead::new(parts), rule, retry, banned);
                with_fields(&mut answered.headers, origin, rules, outcomes, true);
                written(answered)
            }
            Denied::Unavailable(_) => {
                let mut answered = unavailable();
                if origin {
                    let mut exposed = fields::Exposed::of(&answered.headers);
                    fields::expose(&mut answered.headers, &mut exposed, true);
                }
                written(answered)
            }
        }
    };
    match verdict {
        Verdict::Redis(decision) if decision.allowed => {
            count_allowed(metrics, &matched, &decision);
            log::debug!(
                "{} {}: allowed ({})",
                method,
                Escaped(&path),
                super::decision::summary(&matched, &decision.outcomes)
            );
            let usage = Usage::default();
            let taken = usage.add(
                filter.limiter(),
                &matched,
                (checks, &looked_up),
                &decision,
                started,
            );
            parts.extensions.insert(usage);
            let charged = matched.iter().any(|r| r.count == Count::Failures);
            let mut res = call(inner, Request::from_parts(parts, body)).await?;
            let mut decision = decision;
            if charged && res.status().as_u16() < 400 {
                give_back(&filter, &matched, &taken, &mut decision).await;
            }
            with_fields(
                res.headers_mut(),
                origin,
                &matched,
                &decision.outcomes,
                false,
            );
            Ok(res)
        }
        Verdict::Redis(decision) => {
            let Some((rule, outcome)) = denying(&matched, &decision) else {
                return pass(inner, Request::from_parts(parts, body)).await;
            };
            let denied = Denied::Limited {
                rule,
                retry: outcome.retry_after_secs(),
                rules: &matched,
                outcomes: &decision.outcomes,
                by: DecidedBy::Redis,
            };
            Ok(denial(denied, &parts))
        }
        Verdict::Cached {
            rule,
            wait,
            quota,
            banned,
        } => {
            let rule = matched[rule];
            let remembered = Outcome {
                allowed: false,
                remaining: 0,
                wait,
                banned,
                ban_started: false,
                quota,
            };
            let denied = Denied::Limited {
                rule,
                retry: remembered.retry_after_secs(),
                rules: &[rule],
                outcomes: &[remembered],
                by: DecidedBy::Remembered,
            };
            Ok(denial(denied, &parts))
        }
        Verdict::Unavailable(e) => Ok(denial(Denied::Unavailable(&e), &parts)),
        Verdict::Fallback {
            error,
            local,
            checks,
            decision,
            at,
        } => {
            let rules: Vec<&Rule> = local.iter().map(|&i| matched[i]).collect();
            if !decision.allowed {
                let Some((rule, outcome)) = denying(&rules, &decision) else {
                    return pass(inner, Request::from_parts(parts, body)).await;
                };
                let denied = Denied::Limited {
                    rule,
                    retry: outcome.retry_after_secs(),
                    rules: &rules,
                    outcomes: &decision.outcomes,
                    by: DecidedBy::Here(&error),
                };
                return Ok(denial(denied, &parts));
            }
            logging::repeated!(
                &logging::NO_DECISION,
                "{} {}: no decision ({}), allowed{}",
                method,
                Escaped(&path),
                Escaped(&error.to_string()),
                if rules.is_empty() { "" } else { " here" }
            );
            let mut res = call(inner, Request::from_parts(parts, body)).await?;
            let mut decision: Decision = decision;
            if res.status().as_u16() < 400 {
                // Units taken here go back here; Redis took none.
                for ((r, c), o) in rules.iter().zip(&checks).zip(&mut decision.outcomes) {
                    if r.count == Count::Failures && o.allowed {
                        filter.state.limiter.local().give_back(c, at);
                        o.remaining =
                            (o.remaining + u64::from(c.cost)).min(u64::from(o.limit(&r.algorithm)));
                    }
                }
            }
            with_fields(res.headers_mut(), origin, &rules, &decision.outcomes, false);
            Ok(res)
        }
    }
}

/// Writes the fields of `rules` into a response (see [`fields::write`]):
/// this door has no filter inside it, and `origin` says whether the
/// request came with an `Origin`.
fn with_fields(
    headers: &mut http::HeaderMap,
    origin: bool,
    rules: &[&Rule],
    outcomes: &[Outcome],
    denied: bool,
) {
    let mut exposed = origin.then(|| fields::Exposed::of(headers));
    fields::write(headers, None, rules, outcomes, denied, exposed.as_mut());
}

/// The inner service's answer to a request no rule guards.
async fn pass<S, B, RB>(inner: S, req: Request<B>) -> Result<Response<GuardedBody<RB>>, S::Error>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>>,
{
    call(inner, req).await
}

async fn call<S, B, RB>(
    mut inner: S,
    req: Request<B>,
) -> Result<Response<GuardedBody<RB>>, S::Error>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>>,
{
    let res = inner.call(req).await?;
    Ok(res.map(Either::Left))
}

/// The filter's own answer as a response.
fn written<RB>(answered: Answer) -> Response<GuardedBody<RB>> {
    let mut res = Response::new(Either::Right(Full::new(Bytes::from(answered.body))));
    *res.status_mut() = answered.status;
    *res.headers_mut() = answered.headers;
    res
}

/// The bodies a request's keys read, as axum's extractors read them.
#[derive(Default)]
struct Read {
    form: Option<Bytes>,
    json: Option<Bytes>,
}

impl Read {
    fn read(&self) -> values::BodyRead<'_> {
        values::BodyRead {
            form: self.form.as_deref(),
            json: self.json.as_deref(),
        }
    }
}

/// Whether axum's `Json` reads the body: a `Content-Type` that parses as
/// `application/json` or `application/*+json` (axum's `json_content_type`).
fn axum_reads_json(headers: &http::HeaderMap) -> bool {
    let Some(mime) = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<mime::Mime>().ok())
    else {
        return false;
    };
    mime.type_() == "application"
        && (mime.subtype() == "json" || mime.suffix().is_some_and(|s| s == "json"))
}

/// Whether axum's `Form` reads the body: a `Content-Type` that starts with
/// `application/x-www-form-urlencoded` (axum's `has_content_type`); a `GET`
/// or `HEAD` form is its query string, read by `form:` keys from there.
fn axum_reads_form_body(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"))
}

/// Stage 2 under this door: a rule keyed by a body field reads the body
/// axum's `Form` or `Json` would read (up to `max_form`), and the body is
/// handed on intact. Refused as under actix: 413 past `max_form`, 400 for
/// a broken body, 415 for a JSON body in another charset or coding.
async fn read_body<B>(
    filter: &Filter,
    parts: &Parts,
    body: B,
    matched: &[&Rule],
) -> Result<(Read, B), Refused<'static>>
where
    B: Body<Data = Bytes> + From<Bytes>,
    B::Error: Into<BoxError>,
{
    let wants_form = matched.iter().any(|r| r.key.reads_form());
    let wants_json = matched.iter().any(|r| r.key.reads_json());
    if wants_form && (parts.method == http::Method::GET || parts.method == http::Method::HEAD) {
        // axum's `Form` reads a GET's query string.
        let query = Bytes::copy_from_slice(parts.uri.query().unwrap_or("").as_bytes());
        let read = Read {
            form: Some(query),
            json: None,
        };
        return Ok((read, body));
    }
    let form_wanted = wants_form && axum_reads_form_body(&parts.headers);
    let json_wanted = !form_wanted && wants_json && axum_reads_json(&parts.headers);
    if json_wanted {
        json::check_json_headers(&parts.headers).map_err(|e| Refused::Unreadable(e, None))?;
    }
    if !form_wanted && !json_wanted {
        return Ok((Read::default(), body));
    }
    let max = filter.state.max_form;
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = Refused::Input(Input::BodyTooLarge(max));
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large);
    }
    let bytes = match Limited::new(body, max).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => return Err(too_large),
        Err(_) => return Err(Refused::Input(Input::BrokenBody)),
    };
    let read = if json_wanted {
        Read {
            form: None,
            json: Some(bytes.clone()),
        }
    } else {
        Read {
            form: Some(bytes.clone()),
            json: None,
        }
    };
    Ok((read, B::from(bytes)))
}

#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Usage {
    type Rejection = std::convert::Infallible;

    /// The decision the filter put in the request (empty when no rule
    /// matched, or the filter is not in front of the handler).
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Usage, Self::Rejection> {
        Ok(parts.extensions.get::<Usage>().cloned().unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bodies_read_are_those_axums_extractors_read() {
        let with = |ct: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(http::header::CONTENT_TYPE, ct.parse().unwrap());
            h
        };
        for (ct, json, form) in [
            ("application/json", true, false),
            ("application/json; charset=utf-8", true, false),
            ("application/problem+json", true, false),
            ("text/json", false, false),
            ("application/x-www-form-urlencoded", false, true),
            (
                "application/x-www-form-urlencoded; charset=utf-8",
                false,
                true,
            ),
            ("text/plain", false, false),
        ] {
            assert_eq!(axum_reads_json(&with(ct)), json, "{ct}");
            assert_eq!(axum_reads_form_body(&with(ct)), form, "{ct}");
        }
        assert!(!axum_reads_json(&http::HeaderMap::new()));
    }
}
