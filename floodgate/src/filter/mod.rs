//! The rate-limit filter: an actix-service `Transform` that wraps the whole
//! app, so rules apply before routing (and guard paths with no handler).
//!
//! For each request: find the rules that match its method and decoded path;
//! build each rule's key; ask the [`Limiter`] once for all of them; then
//! pass the request on with `RateLimit` fields, or answer a denial (303 to
//! the error page, or 429), or apply the Redis error policy (see `policy.rs`:
//! the denial cache, and `on_redis_error`).

mod builder;
mod fields;
mod json;
pub(crate) mod key;
mod limits;
mod operator;
mod policy;
mod text;

pub use self::builder::{FilterBuilder, Limit, SetupError};
pub use self::key::Unreadable;
pub use self::limits::{Limits, RuleState};
pub use self::operator::{ban_action, operator_check, override_action, OperatorError};

use std::collections::HashMap;
use std::future::{ready, Future, Ready};
use std::net::{IpAddr, Ipv4Addr};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;

use actix_service::{Service, Transform};
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::web::{Bytes, BytesMut};
use actix_web::{Error, HttpMessage, HttpRequest, HttpResponse};
use futures_util::StreamExt;

use crate::limit::{Check, Decision, Limiter, Outcome};
use crate::logging::{self, Escaped};
use crate::metrics::{Metrics, Outcome as Counted};
use crate::net::{self, Cidr, ProxyHeader};
use crate::rule::{self, Count, Deny, KeyKind, Mode, OnMissingKey, Rule};
use policy::Verdict;

/// Renders the HTML error page for a denial: `(rule, retry_after_secs)`.
pub type DenialPage = dyn Fn(&Rule, u64) -> String + Send + Sync;

/// Tells who is signed in, for `key = "session"`: the account ID or `None`.
pub type SessionLookup = dyn Fn(&HttpRequest) -> Option<String> + Send + Sync;

/// Answers a denied request in place of the filter's own 303 / 429: given
/// the denial and the request, the whole response. The filter still adds
/// `Retry-After` and `Cache-Control: no-store` when the response lacks them,
/// and the rate-limit fields of the matching rules (as on every denial).
pub type DenialResponder = dyn Fn(&Denial, &HttpRequest) -> HttpResponse + Send + Sync;

/// A denied request, as a [`DenialResponder`] sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Denial {
    /// The denying rule that frees last.
    pub rule: Rule,
    /// Seconds until the same request would be allowed (at least 1).
    pub retry_after: u64,
}

impl std::fmt::Debug for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.rules().iter().map(|r| r.name.clone()).collect();
        f.debug_struct("Filter").field("rules", &names).finish()
    }
}

/// The filter's shared state: rules (replaceable at run time), the limiter,
/// and what keys and denials need. Clone it freely; `.wrap()` it into an app.
#[derive(Clone)]
pub struct Filter {
    rules: Arc<RwLock<Arc<Vec<Rule>>>>,
    state: Arc<FilterState>,
}

struct FilterState {
    limiter: Arc<Limiter>,
    metrics: Arc<Metrics>,
    trusted_proxies: Vec<Cidr>,
    proxy_header: ProxyHeader,
    max_form: usize,
    key_prefix: String,
    denial_page: Box<DenialPage>,
    session: Option<Box<SessionLookup>>,
    responder: Option<Box<DenialResponder>>,
    unguarded: Option<String>,
    /// Every rule name in use: the filter's own rules and the limits made
    /// from it in code. Read only while limits are made, never per request.
    names: Mutex<HashMap<String, NameOwner>>,
}

/// Who holds a rule name.
#[derive(PartialEq, Eq)]
enum NameOwner {
    /// One of the filter's own rules (a file's or a builder's).
    Filter,
    /// A limit made in code at `at`, with these settings.
    Code {
        at: &'static std::panic::Location<'static>,
        settings: String,
    },
}

/// What the filter needs besides its rules.
pub struct FilterOptions {
    /// Proxies whose forwarding header is believed.
    pub trusted_proxies: Vec<Cidr>,
    /// The forwarding header those proxies write; the other is ignored.
    pub proxy_header: ProxyHeader,
    /// Largest form body read for `form:` keys.
    pub max_form: usize,
    /// First component of every Redis key.
    pub key_prefix: String,
    /// The HTML shown with a 429.
    pub denial_page: Box<DenialPage>,
    /// Who is signed in (`None`: `session` keys by client address).
    pub session: Option<Box<SessionLookup>>,
    /// The whole response to a denial (`None`: 303 to the error page or 429).
    pub responder: Option<Box<DenialResponder>>,
    /// A path prefix no rule guards and no request under it is counted
    /// (an admin API, such as `/admin`); `None`: every path is matched.
    pub unguarded: Option<String>,
}

impl Filter {
    /// A filter over `rules`, deciding with `limiter`.
    pub fn new(
        rules: Vec<Rule>,
        limiter: Arc<Limiter>,
        metrics: Arc<Metrics>,
        options: FilterOptions,
    ) -> Filter {
        metrics.watch(&limiter);
        let names = rules
            .iter()
            .map(|r| (r.name.clone(), NameOwner::Filter))
            .collect();
        Filter {
            rules: Arc::new(RwLock::new(Arc::new(rules))),
            state: Arc::new(FilterState {
                limiter,
                metrics,
                trusted_proxies: options.trusted_proxies,
                proxy_header: options.proxy_header,
                max_form: options.max_form,
                key_prefix: options.key_prefix,
                denial_page: options.denial_page,
                session: options.session,
                responder: options.responder,
                unguarded: options.unguarded,
                names: Mutex::new(names),
            }),
        }
    }

    /// The rules in force now.
    pub fn rules(&self) -> Arc<Vec<Rule>> {
        match self.rules.read() {
            Ok(r) => Arc::clone(&r),
            Err(p) => Arc::clone(&p.into_inner()),
        }
    }

    /// Puts new rules in force; requests already deciding keep the old ones.
    /// What the process remembered about keys under the old rules (cached
    /// denials, local counts) is forgotten.
    pub fn replace_rules(&self, rules: Vec<Rule>) {
        let mut slot = match self.rules.write() {
            Ok(r) => r,
            Err(p) => p.into_inner(),
        };
        {
            let mut names = lock(&self.state.names);
            names.retain(|_, owner| *owner != NameOwner::Filter);
            for r in &rules {
                if names.contains_key(&r.name) {
                    log::error!(
                        "rule {:?} has the name of a limit made in code: they share one count",
                        r.name
                    );
                } else {
                    names.insert(r.name.clone(), NameOwner::Filter);
                }
            }
        }
        *slot = Arc::new(rules);
        drop(slot);
        self.state.limiter.forget_keys();
    }

    /// The limiter the filter decides with.
    pub fn limiter(&self) -> &Arc<Limiter> {
        &self.state.limiter
    }

    /// The counters of its decisions, for a `/metrics` page.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.state.metrics
    }

    /// A filter with only `rules`, sharing everything else with this one
    /// (limiter, pool, dispatcher, responses, metrics).
    pub(crate) fn with_rules(&self, rules: Vec<Rule>) -> Filter {
        Filter {
            rules: Arc::new(RwLock::new(Arc::new(rules))),
            state: Arc::clone(&self.state),
        }
    }

    /// Takes the names of `rules`, limits made in code at `at`: refused
    /// when a name is one of the filter's own rules, or another limit's
    /// (other settings, or made elsewhere in the code). The same limit made
    /// again at the same place (once per worker) is the same limit.
    pub(crate) fn claim_names(
        &self,
        rules: &[Rule],
        at: &'static std::panic::Location<'static>,
    ) -> Result<(), String> {
        let mut names = lock(&self.state.names);
        for r in rules {
            let mine = NameOwner::Code {
                at,
                settings: format!("{r:?}"),
            };
            match names.get(&r.name) {
                None => {}
                Some(owner) if *owner == mine => {}
                Some(NameOwner::Filter) => {
                    return Err(format!(
                        "{:?}: the filter already has a rule of this name; give the limit its own with .name()",
                        r.name
                    ))
                }
                Some(NameOwner::Code { at: other, .. }) => {
                    return Err(format!(
                        "{:?}: another limit (made at {other}) has this name, and one name is one count; give each its own with .name()",
                        r.name
                    ))
                }
            }
        }
        for r in rules {
            names.insert(
                r.name.clone(),
                NameOwner::Code {
                    at,
                    settings: format!("{r:?}"),
                },
            );
        }
        Ok(())
    }

    /// Whether `ip` is one of the trusted proxies.
    pub fn is_trusted_proxy(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.state.trusted_proxies.iter().any(|c| c.contains(ip))
    }

    /// The client address of a request, behind trusted proxies.
    pub fn client_addr(&self, req: &HttpRequest) -> IpAddr {
        let peer = req
            .peer_addr()
            .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |a| a.ip());
        net::client_addr(
            peer,
            req.headers(),
            &self.state.trusted_proxies,
            self.state.proxy_header,
        )
    }

    /// The Redis key a rule uses for a request. `form` is the urlencoded
    /// body already decoded from its charset (see `form_text`), when one
    /// was read. A value the rule must read but cannot read exactly as a
    /// handler would is an error: the request is refused, never keyed by
    /// something else.
    pub fn key_for(
        &self,
        rule: &Rule,
        req: &HttpRequest,
        path: &str,
        form: Option<&[u8]>,
    ) -> Result<String, key::Unreadable> {
        let body = key::BodyRead { form, json: None };
        self.key_of(rule, req, path, &body, &[]).map(|k| k.key)
    }

    /// [`Filter::key_for`], with the JSON body too, and what the rule's
    /// [`Key::lookup`](crate::Key::lookup) parts found (in their order).
    pub(crate) fn key_of(
        &self,
        rule: &Rule,
        req: &HttpRequest,
        path: &str,
        body: &key::BodyRead<'_>,
        looked_up: &[Option<rule::Identity>],
    ) -> Result<key::Keyed, key::Unreadable> {
        let mut parts: Vec<(&'static str, String)> = Vec::with_capacity(rule.key.kinds().len());
        let mut lookups = looked_up.iter();
        let mut limit = None;
        let normalize = |v: Option<String>| v.and_then(|v| rule::normalize(&v, rule.normalize));
        for (at, kind) in rule.key.kinds().iter().enumerate() {
            let value = match kind {
                KeyKind::Ip => Some(net::ip_id(self.client_addr(req))),
                KeyKind::Global => Some("all".to_string()),
                KeyKind::Path => Some(path.to_string()),
                KeyKind::Session => self.state.session.as_ref().and_then(|f| f(req)),
                KeyKind::Header(name) => normalize(key::header_value(req.headers(), name)?),
                KeyKind::Query(name) => {
                    normalize(key::urlencoded_value(req.query_string().as_bytes(), name)?)
                }
                KeyKind::Form(name) => match body.form {
                    Some(form) => normalize(key::urlencoded_value(form, name)?),
                    None => None,
                },
                KeyKind::Json(name) => match body.json {
                    Some(json) => normalize(json::json_value(json, name)?),
                    None => None,
                },
                KeyKind::Body(name) => match (body.form, body.json) {
                    (Some(form), _) => normalize(key::urlencoded_value(form, name)?),
                    (None, Some(json)) => normalize(json::json_value(json, name)?),
                    (None, None) => None,
                },
                KeyKind::Custom(f) if f.is_lookup() => match lookups.next() {
                    Some(Some(found)) => {
                        limit = found.limit().or(limit);
                        Some(f.prefixed(found.id()))
                    }
                    _ => None,
                },
                KeyKind::Custom(f) => f.key(req),
            };
            match value.filter(|v| !v.is_empty()) {
                Some(v) => parts.push((kind.kind(), v)),
                None if rule.on_missing_key == OnMissingKey::Reject => {
                    return Err(key::Unreadable::Missing(at));
                }
                // Without a value of its own kind, a request is keyed by
                // its address alone (a part missing makes no combination),
                // with the rule's own quota.
                None => {
                    log::debug!(
                        "rule {}: no {kind} value, keyed by the client address",
                        rule.name
                    );
                    parts.clear();
                    parts.push(("ip", net::ip_id(self.client_addr(req))));
                    limit = None;
                    break;
                }
            }
        }
        let (kind, mut id) = match parts.as_slice() {
            [(kind, id)] => ((*kind).to_string(), id.clone()),
            _ => rule::compose(&parts),
        };
        if rule.hash_key {
            id = rule::hashed_id(&id);
        }
        Ok(key::Keyed {
            key: rule::redis_key_for(
                self.state.limiter.hash_tags(),
                &self.state.key_prefix,
                &rule.name,
                &kind,
                &id,
            ),
            limit,
        })
    }
}

/// The text of an urlencoded body as `web::Form` reads it: the charset of
/// `Content-Type` (actix's own `encoding()`, through `encoding_rs` labels),
/// decoded without replacement; UTF-8 as it is. A body with a content
/// coding, an unknown charset, or bytes its charset cannot decode is
/// refused (415) rather than read in some other way than the handler's.
pub(crate) fn form_text<'a>(
    req: &impl HttpMessage,
    body: &'a [u8],
) -> Result<std::borrow::Cow<'a, [u8]>, key::Unreadable> {
    use std::borrow::Cow;
    let unsupported = key::Unreadable::Unsupported;
    for coding in req.headers().get_all(header::CONTENT_ENCODING) {
        let identity = coding
            .to_str()
            .is_ok_and(|c| c.trim().eq_ignore_ascii_case("identity"));
        if !identity {
            return Err(unsupported("a form with a content coding cannot be read\n"));
        }
    }
    let encoding = req
        .encoding()
        .map_err(|_| unsupported("unknown form charset\n"))?;
    // actix hands UTF-8 bodies to serde as bytes, anything else decoded.
    if encoding.name() == "UTF-8" {
        return Ok(Cow::Borrowed(body));
    }
    match encoding.decode_without_bom_handling_and_without_replacement(body) {
        Some(text) => Ok(Cow::Owned(text.into_owned().into_bytes())),
        None => Err(unsupported("the form is not in its charset\n")),
    }
}

impl<S, B> Transform<S, ServiceRequest> for Filter
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Transform = FilterService<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(FilterService {
            service: Rc::new(service),
            filter: self.clone(),
        }))
    }
}

/// The per-worker service the [`Filter`] transform builds.
#[doc(hidden)]
pub struct FilterService<S> {
    service: Rc<S>,
    filter: Filter,
}

type LocalBoxFuture<T> = Pin<Box<dyn Future<Output = T>>>;

impl<S, B> Service<ServiceRequest> for FilterService<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Future = LocalBoxFuture<Result<Self::Response, Self::Error>>;

    actix_service::forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        let service = Rc::clone(&self.service);
        let filter = self.filter.clone();
        Box::pin(async move { filter_request(filter, service, req).await })
    }
}

/// Largest header block accepted (names, values and separators): a larger
/// one gets 431, well below actix-http's own 128 KiB bound.
pub const MAX_HEADER_BYTES: usize = 32 * 1024;

/// Why a body could not be read for a `form:` key.
enum BodyError {
    TooLarge,
    Broken,
}

async fn filter_request<S, B>(
    filter: Filter,
    service: Rc<S>,
    mut req: ServiceRequest,
) -> Result<ServiceResponse<EitherBody<B>>, Error>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error>,
    B: MessageBody,
{
    let header_bytes: usize = req
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    if header_bytes > MAX_HEADER_BYTES {
        return Ok(plain(
            req,
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "request header fields too large\n",
        ));
    }
    let rules = filter.rules();
    // Match on the decoded path; copy it only when a rule matched, so an
    // unguarded request allocates nothing here.
    let (matched, path) = {
        let Ok(decoded) = percent_encoding::percent_decode_str(req.path()).decode_utf8() else {
            return Ok(plain(req, StatusCode::BAD_REQUEST, "bad request path\n"));
        };
        let method = req.method().as_str();
        let unguarded = filter
            .state
            .unguarded
            .as_deref()
            .is_some_and(|p| is_under(&decoded, p) || is_under(req.path(), p));
        let mut matched: Vec<&Rule> = if unguarded {
            Vec::new()
        } else {
            rules
                .iter()
                .filter(|r| r.matches(method, &decoded) && r.applies_to(req.request()))
                .collect()
        };
        // A rule's exempt clients are neither counted nor denied by it.
        if matched.iter().any(|r| !r.exempt.is_empty()) {
            let client = filter.client_addr(req.request());
            matched.retain(|r| !r.exempts(client));
        }
        let path = (!matched.is_empty()).then(|| decoded.into_owned());
        (matched, path)
    };
    let Some(path) = path else {
        return service.call(req).await.map(|r| r.map_into_left_body());
    };
    let method = req.method().clone();
    // The path as the log shows it: a decoded newline cannot forge a line.
    let shown = Escaped(&path);

    // A rule keyed by a body field reads the urlencoded or JSON body (only
    // the types its keys read), then hands it on intact.
    let form_wanted = matched.iter().any(|r| r.key.reads_form()) && is_urlencoded(&req);
    let json_wanted =
        !form_wanted && matched.iter().any(|r| r.key.reads_json()) && json::is_json(req.headers());
    if json_wanted {
        if let Err(e) = json::check_json_headers(req.headers()) {
            return Ok(unreadable(req, e, None));
        }
    }
    let mut body: Option<Bytes> = None;
    if form_wanted || json_wanted {
        match read_body(&mut req, filter.state.max_form).await {
            Ok(read) => {
                req.set_payload(Payload::from(read.clone()));
                body = Some(read);
            }
            Err(BodyError::TooLarge) => {
                return Ok(plain(
                    req,
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body too large\n",
                ))
            }
            Err(BodyError::Broken) => {
                return Ok(plain(req, StatusCode::BAD_REQUEST, "unreadable body\n"))
            }
        }
    }

    // The form as the handler will read it: decoded from its charset.
    let form = match body
        .as_deref()
        .filter(|_| form_wanted)
        .map(|body| form_text(&req, body))
        .transpose()
    {
        Ok(text) => text,
        Err(e) => return Ok(unreadable(req, e, None)),
    };
    let read = key::BodyRead {
        form: form.as_deref(),
        json: body.as_deref().filter(|_| json_wanted),
    };

    // Key functions that look the caller up are awaited first, in order.
    let mut looked_up: Vec<Vec<Option<rule::Identity>>> = Vec::new();
    if matched.iter().any(|r| r.key.has_lookup()) {
        for rule in &matched {
            let mut found = Vec::new();
            for kind in rule.key.kinds() {
                if let KeyKind::Custom(f) = kind {
                    if let Some(lookup) = f.lookup(req.request()) {
                        found.push(lookup.await);
                    }
                }
            }
            looked_up.push(found);
        }
    }

    // A rule whose key chose the identity's own quota decides (and shows)
    // that quota for this request.
    let mut own: Vec<(usize, Rule)> = Vec::new();
    let mut checks: Vec<Check> = Vec::with_capacity(matched.len());
    for (i, rule) in matched.iter().enumerate() {
        let found = looked_up.get(i).map_or(&[][..], Vec::as_slice);
        let keyed = match filter.key_of(rule, req.request(), &path, &read, found) {
            Ok(keyed) => keyed,
            Err(e) => return Ok(unreadable(req, e, Some(rule))),
        };
        let mut algorithm = rule.algorithm;
        if let Some(limit) = keyed.limit {
            match with_quota(rule, limit) {
                Some(a) => {
                    algorithm = a;
                    let mut r = (*rule).clone();
                    r.algorithm = a;
                    own.push((i, r));
                }
                None => crate::logging::repeated!(
                    &logging::BAD_QUOTA,
                    "rule {}: a key function chose the quota {limit}, which the rule cannot have (1 ..= {}, at least its cost {}); the rule's own applies",
                    rule.name,
                    crate::config::MAX_LIMIT,
                    rule.cost
                ),
            }
        }
        checks.push(Check {
            key: keyed.key,
            algorithm,
            cost: rule.cost,
            enforce: rule.mode == Mode::Enforce,
            penalty: rule.penalty,
        });
    }
    drop(form);
    let mut matched = matched;
    for (i, r) in &own {
        matched[*i] = r;
    }

    let metrics = &filter.state.metrics;
    let started = Instant::now();
    // Rules that count failures only need the keys again afterwards.
    let charged = matched.iter().any(|r| r.count == Count::Failures);
    // The keys again, for a give-back and for the handler's `Limits`.
    let kept = checks.clone();
    let verdict = policy::decide(&filter.state.limiter, metrics, &matched, checks, started).await;
    metrics.observe(started.elapsed());

    match verdict {
        Verdict::Redis(decision) if decision.allowed => {
            count_allowed(metrics, &matched, &decision);
            log::debug!(
                "{method} {shown}: allowed ({})",
                summary(&matched, &decision)
            );
            let taken = Limits::record(
                req.request(),
                filter.limiter(),
                &matched,
                &kept,
                &decision,
                started,
            );
            let mut res = service.call(req).await?;
            // Whether an inner filter's denial gave our units back.
            let mut withdrawn = false;
            if res
                .request()
                .extensions()
                .get::<limits::Withdrawn>()
                .is_some()
            {
                // An inner filter denied the request: it takes nothing from us.
                match taken.withdraw(&filter).await {
                    Ok(_) => withdrawn = true,
                    Err(e) => crate::logging::repeated!(
                        &logging::GIVE_BACK_FAILED,
                        "could not give units back ({}); the request stays charged",
                        Escaped(&e.to_string())
                    ),
                }
            }
            let mut decision = decision;
            if charged && res.status().as_u16() < 400 {
                give_back(&filter, &matched, &taken, &mut decision).await;
            }
            fields::on_response(&mut res, &matched, &decision.outcomes, withdrawn);
            Ok(res.map_into_left_body())
        }
        Verdict::Redis(decision) => {
            // The denying rule that frees last names the denial, so that
            // Retry-After holds for every rule.
            let Some((rule, outcome)) = denying(&matched, &decision) else {
                // Not reachable: a request is denied only by an enforce rule.
                return service.call(req).await.map(|r| r.map_into_left_body());
            };
            for (r, o) in matched.iter().zip(&decision.outcomes) {
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
                "{method} {shown}: denied by {} for {}s ({})",
                rule.name,
                outcome.retry_after_secs(),
                summary(&matched, &decision)
            );
            let mut response = denial(&filter, req.request(), rule, outcome.retry_after_secs());
            fields::on_denial(&mut response, req.request(), &matched, &decision.outcomes);
            // Limits an outer filter already took for this request go back.
            Limits::deny_outer(req.request());
            Ok(req.into_response(response).map_into_right_body())
        }
        Verdict::Cached { rule, wait } => {
            let rule = matched[rule];
            let remembered = Outcome {
                allowed: false,
                remaining: 0,
                wait,
                banned: false,
                ban_started: false,
                quota: None,
            };
            let retry = remembered.retry_after_secs();
            log::debug!(
                "{method} {shown}: denied by {} for {retry}s (remembered denial)",
                rule.name
            );
            let mut response = denial(&filter, req.request(), rule, retry);
            // Only the denying rule's state is known without Redis.
            fields::on_denial(&mut response, req.request(), &[rule], &[remembered]);
            Limits::deny_outer(req.request());
            Ok(req.into_response(response).map_into_right_body())
        }
        Verdict::Unavailable(e) => {
            Limits::deny_outer(req.request());
            crate::logging::repeated!(
                &logging::NO_DECISION,
                "{method} {shown}: no decision ({}), error_denied",
                Escaped(&e.to_string())
            );
            let response = HttpResponse::ServiceUnavailable()
                .insert_header((header::RETRY_AFTER, "1"))
                .insert_header((header::CACHE_CONTROL, "no-store"))
                .content_type("text/plain; charset=utf-8")
                .body("the rate limiter is unavailable; try again in a second\n");
            Ok(req.into_response(response).map_into_right_body())
        }
        Verdict::Fallback {
            error,
            local,
            checks,
            decision,
            at,
        } => {
            // Only the rules this process decided have outcomes.
            let rules: Vec<&Rule> = local.iter().map(|&i| matched[i]).collect();
            if !decision.allowed {
                let Some((rule, outcome)) = denying(&rules, &decision) else {
                    return service.call(req).await.map(|r| r.map_into_left_body());
                };
                crate::logging::repeated!(
                    &logging::NO_DECISION,
                    "{method} {shown}: no decision ({}), denied here by {} for {}s",
                    Escaped(&error.to_string()),
                    rule.name,
                    outcome.retry_after_secs()
                );
                let mut response = denial(&filter, req.request(), rule, outcome.retry_after_secs());
                fields::on_denial(&mut response, req.request(), &rules, &decision.outcomes);
                Limits::deny_outer(req.request());
                return Ok(req.into_response(response).map_into_right_body());
            }
            crate::logging::repeated!(
                &logging::NO_DECISION,
                "{method} {shown}: no decision ({}), allowed{}",
                Escaped(&error.to_string()),
                if rules.is_empty() { "" } else { " here" }
            );
            let mut res = service.call(req).await?;
            let mut decision = decision;
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
            fields::on_response(&mut res, &rules, &decision.outcomes, false);
            Ok(res.map_into_left_body())
        }
    }
}

/// A lock that a panic elsewhere does not make unusable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The enforce rule that denies and frees last, with its outcome.
fn denying<'r>(matched: &[&'r Rule], decision: &Decision) -> Option<(&'r Rule, Outcome)> {
    matched
        .iter()
        .zip(&decision.outcomes)
        .filter(|(r, o)| r.mode == Mode::Enforce && !o.allowed)
        .max_by_key(|(_, o)| o.wait)
        .map(|(r, o)| (*r, *o))
}

/// `count = "failures"`: a request answered below 400 gets back the units
/// its failures-only rules took (those that admitted it, and that nothing
/// gave back already: the handler, or an inner filter's denial), and the
/// `RateLimit` fields then show them as remaining again.
async fn give_back(
    filter: &Filter,
    matched: &[&Rule],
    taken: &limits::Taken,
    decision: &mut Decision,
) {
    let (places, given) = taken
        .give_back(filter, |i| {
            matched.get(i).is_some_and(|r| r.count == Count::Failures)
        })
        .await;
    match given {
        Ok(0) => {}
        Ok(_) => {
            for i in places {
                if let (Some(o), Some(r)) = (decision.outcomes.get_mut(i), matched.get(i)) {
                    o.remaining =
                        (o.remaining + u64::from(r.cost)).min(u64::from(o.limit(&r.algorithm)));
                }
            }
        }
        Err(e) => crate::logging::repeated!(
            &logging::GIVE_BACK_FAILED,
            "could not give units back ({}); the request stays charged",
            Escaped(&e.to_string())
        ),
    }
}

/// The answer to a request whose key value cannot be read as the handler
/// would read it: 415 for a charset or coding, 400 for the rest; and to a
/// request without the key value of a rule (`rule`) that rejects those.
fn unreadable<B>(
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

/// The rule's algorithm with `limit` as its quota (a token bucket's rate
/// scales with its burst), when the rule can have that quota.
fn with_quota(rule: &Rule, limit: u32) -> Option<crate::limit::Algorithm> {
    use crate::limit::Algorithm;
    let quota = std::num::NonZeroU32::new(limit)
        .filter(|q| q.get() <= crate::config::MAX_LIMIT && q.get() >= rule.cost)?;
    Some(match rule.algorithm {
        Algorithm::SlidingWindow { window, .. } => Algorithm::SlidingWindow {
            limit: quota,
            window,
        },
        Algorithm::FixedWindow { window, .. } => Algorithm::FixedWindow {
            limit: quota,
            window,
        },
        Algorithm::TokenBucket { rate, burst } => Algorithm::TokenBucket {
            rate: rate * f64::from(quota.get()) / f64::from(burst.get()),
            burst: quota,
        },
    })
}

/// Answer `status` with a short text body (malformed or oversized input).
fn plain<B>(
    req: ServiceRequest,
    status: StatusCode,
    text: &'static str,
) -> ServiceResponse<EitherBody<B>> {
    let response = HttpResponse::build(status)
        .content_type("text/plain; charset=utf-8")
        .body(text);
    req.into_response(response).map_into_right_body()
}

fn is_urlencoded(req: &ServiceRequest) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.split(';').next().is_some_and(|m| {
                m.trim()
                    .eq_ignore_ascii_case("application/x-www-form-urlencoded")
            })
        })
}

async fn read_body(req: &mut ServiceRequest, max: usize) -> Result<Bytes, BodyError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(BodyError::TooLarge);
    }
    let mut payload = req.take_payload();
    let mut body = BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|_| BodyError::Broken)?;
        if body.len() + chunk.len() > max {
            return Err(BodyError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

fn count_allowed(metrics: &Metrics, matched: &[&Rule], decision: &Decision) {
    for (r, o) in matched.iter().zip(&decision.outcomes) {
        let outcome = match (o.allowed, r.mode) {
            (true, _) => Counted::Allowed,
            (false, Mode::Shadow) => Counted::ShadowDenied,
            (false, Mode::Enforce) => Counted::Denied,
        };
        metrics.decision(&r.name, outcome);
    }
}

fn summary(matched: &[&Rule], decision: &Decision) -> String {
    matched
        .iter()
        .zip(&decision.outcomes)
        .map(|(r, o)| format!("{}={}", r.name, if o.allowed { "ok" } else { "over" }))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether `path` is `prefix` or below it.
fn is_under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}
/// Whether `req` asks for `page` (as the rules read paths, decoded).
fn is_error_page(req: &HttpRequest, page: &str) -> bool {
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
fn denial(filter: &Filter, req: &HttpRequest, rule: &Rule, retry: u64) -> HttpResponse {
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
