//! What a rule does besides counting: what a request without its key value
//! gets, a predicate that lets a request skip the rule, and key functions
//! that look the caller up (asynchronously) and may choose its quota.

use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;

use crate::head::RequestHead;

/// What a request gets when a value its rule keys by is absent (no such
/// header, field or member, an empty value, a number `e164` cannot read,
/// nobody signed in, a key function's `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum OnMissingKey {
    /// Keyed by its client address under the same rule.
    #[default]
    Ip,
    /// Refused: `400` with
    /// `{"error":"missing_key","rule":NAME,"key":KIND,"detail":TEXT}` (a
    /// page for a client whose `Accept` names `text/html`).
    Reject,
}

impl OnMissingKey {
    /// The value as the configuration file writes it.
    pub fn as_str(&self) -> &'static str {
        match self {
            OnMissingKey::Ip => "ip",
            OnMissingKey::Reject => "reject",
        }
    }
}

impl fmt::Display for OnMissingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A predicate that lets a request skip a rule: the rule neither counts
/// nor denies it (see `Limit::skip_if`). Named for messages; two rules
/// with predicates of one name are told apart by their other settings.
#[derive(Clone)]
pub struct Skip {
    name: String,
    f: Arc<dyn Fn(&RequestHead) -> bool + Send + Sync>,
}

impl Skip {
    /// A predicate named `name`.
    pub fn new(name: &str, f: impl Fn(&RequestHead) -> bool + Send + Sync + 'static) -> Skip {
        Skip {
            name: name.to_string(),
            f: Arc::new(f),
        }
    }

    /// Whether `req` skips the rule.
    pub fn skips(&self, req: &RequestHead) -> bool {
        (self.f)(req)
    }

    /// The predicate's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Debug for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Skip").field(&self.name).finish()
    }
}

/// Who a key function found: the ID the rule counts by and, optionally,
/// the quota this identity gets instead of the rule's own (the limit of a
/// window, the burst of a token bucket, whose rate then scales with it).
///
/// ```
/// use floodgate_limiter::rule::Identity;
/// let paying = Identity::new("key-7").with_limit(100);
/// assert_eq!(paying.id(), "key-7");
/// assert_eq!(paying.limit(), Some(100));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    id: String,
    limit: Option<NonZeroU32>,
}

impl Identity {
    /// The caller `id`, with the rule's own quota.
    pub fn new(id: impl Into<String>) -> Identity {
        Identity {
            id: id.into(),
            limit: None,
        }
    }

    /// This identity's quota instead of the rule's. A quota of 0, above
    /// the most a rule may have, or below the rule's cost is not used (the
    /// rule's own applies, with a warning in the log).
    pub fn with_limit(mut self, limit: u32) -> Identity {
        self.limit = NonZeroU32::new(limit);
        self
    }

    /// The ID.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The quota chosen for it, if any.
    pub fn limit(&self) -> Option<u32> {
        self.limit.map(NonZeroU32::get)
    }
}

/// The future a [`LookupFn`] returns. It is `Send`, as a tower service's
/// future must be, and must not block the thread (await an asynchronous
/// client, or `tokio::task::spawn_blocking` a synchronous one).
pub type LookupFuture = Pin<Box<dyn Future<Output = Option<Identity>> + Send>>;

/// What [`Key::lookup`](crate::Key::lookup) accepts: any
/// `Fn(RequestHead) -> impl Future<Output = Option<Identity>> + Send` that can be
/// shared between workers, or a type of your own. `None` is an absent
/// value (the rule's `on_missing_key` applies: keyed by address, or 400).
pub trait LookupFn: Send + Sync + 'static {
    /// Finds who `req` comes from.
    fn lookup(&self, req: RequestHead) -> LookupFuture;
}

impl<F, Fut> LookupFn for F
where
    F: Fn(RequestHead) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<Identity>> + Send + 'static,
{
    fn lookup(&self, req: RequestHead) -> LookupFuture {
        Box::pin(self(req))
    }
}
