//! The rate-limit filter, and its doors: an actix-service `Transform`
//! (`actix/`) and a `tower::Layer` (`tower.rs`), each wrapping the whole
//! app, so rules apply before routing (and guard paths with no handler).
//!
//! Each request goes through stages (`request.rs`): find the rules that
//! match its method and decoded path; read the body their keys need (each
//! door: `actix/body.rs`, `tower.rs`); build each rule's key from the values
//! it reads (`values.rs`, `json.rs`); decide all of them at once
//! (`crate::gate`: the denial cache, one [`Limiter`] call, else each rule's
//! `on_redis_error`);
//! then pass the request on with `RateLimit` fields (`fields.rs`), or deny
//! it (`deny.rs`: 303 to the error page, 429, or 503). The filter is built
//! by `builder.rs` (a file, or code), and `code_limit.rs` holds the
//! [`Limit`] declared in code beside a handler.

// Without a door (no feature `actix` nor `tower`) the filter can be built
// and operated, but no request goes through its stages.
#![cfg_attr(not(any(feature = "actix", feature = "tower")), allow(dead_code))]

#[cfg(feature = "actix")]
mod actix;
mod builder;
mod code_limit;
mod deny;
mod error;
mod fields;
mod head;
mod json;
mod operator;
mod recalled;
mod request;
mod text;
#[cfg(feature = "tower")]
pub(crate) mod tower;
mod usage;
mod values;

#[cfg(feature = "actix")]
pub use self::actix::{accepts, FilterService};
pub use self::builder::FilterBuilder;
pub use self::code_limit::Limit;
pub use self::error::SetupError;
pub use self::operator::{ban_action, operator_check, override_action, OperatorError};
pub use self::usage::{RuleState, Usage};
pub use self::values::Unreadable;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::head::RequestHead;

use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::net::{self, Cidr, ProxyHeader};
use crate::rule::Rule;

/// Renders the HTML page of a 429 for a browser, given the denial (its
/// rule, seconds to wait, whether the identity is banned).
pub(crate) type DenialPage = dyn Fn(&Denial) -> String + Send + Sync;

/// A predicate on the whole filter: a request for which it holds is
/// neither counted nor denied by any rule (tests, health checkers).
pub(crate) type Bypass = dyn Fn(&RequestHead) -> bool + Send + Sync;

/// Tells who is signed in, for `key = "session"`: the account ID or `None`.
pub(crate) type SessionLookup = dyn Fn(&RequestHead) -> Option<String> + Send + Sync;

/// Answers a denied request in place of the filter's own 303 / 429: given
/// the denial and the request, the whole response, as the `http` crate
/// writes one (both doors send it). The filter still adds `Retry-After` and
/// `Cache-Control: no-store` when the response lacks them, and the
/// rate-limit fields of the matching rules (as on every denial).
pub(crate) type DenialResponder =
    dyn Fn(&Denial, &RequestHead) -> http::Response<String> + Send + Sync;

/// A media type the app's `web::Json` reads besides the JSON ones: the
/// predicate the app gives `JsonConfig::content_type` (see
/// [`FilterBuilder::json_content_type`]).
pub(crate) type JsonContentType = dyn Fn(mime::Mime) -> bool + Send + Sync;

/// A denied request, as a [denial responder](FilterBuilder::denial_responder)
/// sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Denial {
    /// The denying rule that frees last.
    pub rule: Rule,
    /// Seconds until the same request would be allowed (at least 1).
    pub retry_after: u64,
    /// The identity is banned under the rule (by an operator or the rule's
    /// penalty), not only over its limit: the answer says so
    /// (`"error":"banned"`, a page that says the client is blocked).
    pub banned: bool,
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
    #[cfg_attr(not(feature = "actix"), allow(dead_code))]
    json: json::JsonBodies,
    key_prefix: String,
    denial_page: Box<DenialPage>,
    session: Option<Box<SessionLookup>>,
    responder: Option<Box<DenialResponder>>,
    unguarded: Option<String>,
    bypass: Option<Box<Bypass>>,
    /// Every rule name in use: the filter's own rules and the limits made
    /// from it in code. Read only while limits are made, never per request.
    names: Mutex<HashMap<String, NameOwner>>,
    /// What the other rules held at a request's last denial by Redis,
    /// for the fields of the denials remembered after it.
    recalled: recalled::Recalled,
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
pub(crate) struct FilterOptions {
    /// Proxies whose forwarding header is believed.
    pub trusted_proxies: Vec<Cidr>,
    /// The forwarding header those proxies write; the other is ignored.
    pub proxy_header: ProxyHeader,
    /// Largest form body read for `form:` keys.
    pub max_form: usize,
    /// As the app's `JsonConfig::content_type_required` (actix's default:
    /// `true`): `false` reads every body as JSON for `json:` and `body:`
    /// keys, whatever its `Content-Type` (see
    /// [`FilterBuilder::json_content_type_required`]).
    pub json_content_type_required: bool,
    /// As the app's `JsonConfig::content_type` (actix's default: `None`):
    /// more media types read as JSON (see
    /// [`FilterBuilder::json_content_type`]).
    pub json_content_type: Option<Box<JsonContentType>>,
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
    /// A request is under it when the path actix's router routes is
    /// (percent-decoded but for `%2F`, `%25` and `%2B`, as
    /// `web::scope(prefix)` matches it): `/admin%2Fx` is not.
    pub unguarded: Option<String>,
    pub bypass: Option<Box<Bypass>>,
}

impl Filter {
    /// A filter over `rules`, deciding with `limiter`.
    pub(crate) fn new(
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
                json: json::JsonBodies {
                    required: options.json_content_type_required,
                    content_type: options.json_content_type,
                },
                key_prefix: options.key_prefix,
                denial_page: options.denial_page,
                session: options.session,
                responder: options.responder,
                unguarded: options.unguarded,
                bypass: options.bypass,
                names: Mutex::new(names),
                recalled: recalled::Recalled::default(),
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

    /// The client address of a request as any door reads it. A request
    /// with no peer address is from `0.0.0.0`; the first one a process
    /// sees is logged, since an axum app served without `ConnectInfo`
    /// would have every client share one counter.
    pub(crate) fn client_of<H: head::Head>(&self, req: &H) -> IpAddr {
        let peer = req.peer().unwrap_or_else(|| {
            static TOLD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !TOLD.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!(
                    "a request came with no peer address: it is keyed as 0.0.0.0, as every such \
                     request is (an axum app serves its clients' addresses with \
                     into_make_service_with_connect_info::<SocketAddr>())"
                );
            }
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        });
        net::client_addr(
            peer,
            req.headers(),
            &self.state.trusted_proxies,
            self.state.proxy_header,
        )
    }
}

/// Largest header block accepted (names, values and separators): a larger
/// one gets 431, well below actix-http's own 128 KiB bound.
pub(crate) const MAX_HEADER_BYTES: usize = 32 * 1024;

/// A lock that a panic elsewhere does not make unusable.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}
