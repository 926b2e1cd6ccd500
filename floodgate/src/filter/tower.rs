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
//! see the same [`RequestHead`](crate::RequestHead) under both doors.
//!
//! Filters nest: a limit made in code ([`Filter::limit`]) is a layer of
//! its own on one route (`route_layer`) inside the router's filter. The
//! inner filter notes in its response's extensions what it showed and
//! whether it denied, so that the outer one merges the fields and gives
//! its units back when the inner one denied (all or nothing).
//!
//! [`DenialResponder`]: super::DenialResponder
//! [`SessionLookup`]: super::SessionLookup

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, Limited};

use super::deny::{refusal, Answer, Denied, Input, Refused};
use super::head::Head;
use super::request::{checks, decided, guarding, lookups, Admitted, Settled};
use super::usage::Withdrawn;
use super::{fields, values, Filter, Usage};
use crate::head::RequestHead;
use crate::limiter::Outcome;
use crate::rule::Rule;

/// The error type of bodies: what a body's error is turned into.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a guarded service's responses: the inner service's, or the
/// filter's own answer.
pub type GuardedBody<B> = Either<B, Full<Bytes>>;

/// The body of the requests the service behind the filter gets: the
/// request's own (`Left`), or, where a rule read it for a key, the same
/// bytes again (`Right`). Any body type goes through, so axum's, tonic's
/// and hyper's services (which take any `http_body::Body`) sit behind the
/// filter alike.
pub type GuardedRequestBody<B> = Either<B, Full<Bytes>>;

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
    S: tower_service::Service<Request<GuardedRequestBody<B>>, Response = Response<RB>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
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
    S: tower_service::Service<Request<GuardedRequestBody<B>>, Response = Response<RB>>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let rules = filter.rules();
    let (mut parts, body) = req.into_parts();
    let guarded = guarding(&filter, &TowerHead::new(&parts), &rules);
    let (matched, path) = match guarded {
        Ok(Some(guarded)) => guarded,
        Ok(None) => return call(inner, Request::from_parts(parts, Either::Left(body))).await,
        Err(refused) => return Ok(written(refusal(&refused, &parts.headers))),
    };
    let (read, body) = match read_body(&filter, &parts, body, &matched).await {
        Ok(read) => read,
        Err(refused) => return Ok(written(refusal(&refused, &parts.headers))),
    };
    let looked_up = lookups(&filter, &TowerHead::new(&parts), &matched).await;
    let head = TowerHead::new(&parts);
    let keyed = checks(&filter, &head, &path, &read.read(), &looked_up, &matched);
    let mut checked = match keyed {
        Ok(keyed) => keyed,
        Err(refused) => return Ok(written(refusal(&refused, &parts.headers))),
    };
    let method = parts.method.clone();
    let (settled, started) =
        decided(&filter, matched, &mut checked, (method.as_str(), &path)).await;
    // Whether the fields are named for a page's script (the request moves
    // on to the inner service before they are written).
    let origin = parts.headers.contains_key(http::header::ORIGIN);
    let mut admitted = match settled {
        Settled::Admitted(admitted) => admitted,
        Settled::Denied(denied) => {
            let mut answered = denied.answer(&filter, &TowerHead::new(&parts));
            let mut noted = http::Extensions::new();
            match &denied {
                Denied::Limited {
                    rules, outcomes, ..
                } => with_fields(
                    &mut answered.headers,
                    &mut noted,
                    origin,
                    rules,
                    outcomes,
                    true,
                ),
                Denied::Unavailable(_) => {
                    noted.insert(fields::expose_unavailable(
                        &mut answered.headers,
                        None,
                        origin,
                    ));
                }
            }
            // The filters around this one give back what they took.
            noted.insert(Withdrawn);
            let mut res = written(answered);
            res.extensions_mut().extend(noted);
            return Ok(res);
        }
    };
    // A filter around this one already holds the request's `Usage`.
    let usage = parts.extensions.get::<Usage>().cloned().unwrap_or_default();
    let taken = admitted.record(&filter, &usage, &looked_up, started);
    parts.extensions.insert(usage);
    let res = call(inner, Request::from_parts(parts, body)).await?;
    // A filter inside denied the request: it takes nothing from this one's.
    let inner_denied = res.extensions().get::<Withdrawn>().is_some();
    let withdrawn = inner_denied && Admitted::withdraw(&filter, taken.as_ref()).await;
    admitted
        .answered(&filter, res.status().as_u16(), taken.as_ref())
        .await;
    let (mut head, body) = res.into_parts();
    with_fields(
        &mut head.headers,
        &mut head.extensions,
        origin,
        &admitted.rules,
        &admitted.decision.outcomes,
        withdrawn,
    );
    Ok(Response::from_parts(head, body))
}

/// Writes the fields of `rules` into a response (see [`fields::write`]),
/// merged with what a filter inside this one showed and exposed, noted in
/// the response's `extensions` for a filter around it. `origin`: the
/// request came with an `Origin`.
fn with_fields(
    headers: &mut http::HeaderMap,
    extensions: &mut http::Extensions,
    origin: bool,
    rules: &[&Rule],
    outcomes: &[Outcome],
    denied: bool,
) {
    let earlier = extensions.remove::<fields::Noted>();
    if let Some(now) = fields::write_noted(headers, earlier, origin, (rules, outcomes), denied) {
        extensions.insert(now);
    }
}

/// The inner service's answer.
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
/// form is its query string, read by `form:` keys from there (a `HEAD`'s
/// is its body, as axum's `RawForm` reads it).
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
) -> Result<(Read, GuardedRequestBody<B>), Refused<'static>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let wants_form = matched.iter().any(|r| r.key.reads_form());
    let wants_json = matched.iter().any(|r| r.key.reads_json());
    // A body both of axum's extractors take (`Content-Type:
    // application/x-www-form-urlencoded+json`) could be read by the
    // handler either way, and the filter's key would not be the handler's
    // value: refused, as a body in a charset the filter cannot read.
    if (wants_form || wants_json)
        && axum_reads_form_body(&parts.headers)
        && axum_reads_json(&parts.headers)
    {
        return Err(Refused::Input(Input::AmbiguousBody));
    }
    // axum's `Form` reads a GET's query string (a HEAD's body, as any
    // other method's); `Json` reads the body whatever the method.
    let json_body = wants_json && axum_reads_json(&parts.headers);
    if wants_form && parts.method == http::Method::GET && !json_body {
        let query = Bytes::copy_from_slice(parts.uri.query().unwrap_or("").as_bytes());
        let read = Read {
            form: Some(query),
            json: None,
        };
        return Ok((read, Either::Left(body)));
    }
    let form_wanted = wants_form && axum_reads_form_body(&parts.headers);
    // (As axum's `Json`, whatever charset or content coding the headers
    // name: see `json::check_json_headers`, which the actix door applies.)
    let json_wanted = !form_wanted && json_body;
    if !form_wanted && !json_wanted {
        return Ok((Read::default(), Either::Left(body)));
    }
    // A body in a content coding: a decompression layer inside the filter
    // would hand the handler other bytes than the filter reads (and a
    // key the filter cannot find would fall back to the address): refused,
    // as the actix door refuses it.
    if values::content_coded(&parts.headers) {
        let why = "a body with a content coding cannot be read";
        return Err(Refused::Unreadable(
            values::Unreadable::Unsupported(why),
            None,
        ));
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
    Ok((read, Either::Right(Full::new(bytes))))
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
