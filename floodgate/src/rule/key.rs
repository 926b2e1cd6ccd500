//! What a rule counts by: the kinds of key (address, form field, header…),
//! composite keys, and the Redis key `PREFIX:RULE:KIND:ID` they make.

use std::fmt;
use std::sync::Arc;

use crate::head::RequestHead;

use sha2::{Digest, Sha256};

use super::options::LookupFn;

/// Longest ID kept as is in a Redis key; longer ones are hashed.
pub(super) const MAX_ID_BYTES: usize = 64;

/// What identifies the caller for a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyKind {
    /// The client address (behind trusted proxies).
    Ip,
    /// One key for the whole rule.
    Global,
    /// The request path.
    Path,
    /// The signed-in account, else the client address.
    Session,
    /// A request header's value.
    Header(String),
    /// A query-string parameter.
    Query(String),
    /// A field of an urlencoded form body.
    Form(String),
    /// A top-level member of a JSON object body (a string, or a number as
    /// its JSON text).
    Json(String),
    /// `Form` for a form body and `Json` for a JSON body, one counter for
    /// both: a route offered as a form and as a JSON API shares its limit.
    Body(String),
    /// The application's own function of the request (see [`Key::custom`]).
    Custom(CustomKey),
}

/// A key function of the application's own: the ID of a request, or
/// `None` to key it by its client address. Named, so that two functions
/// never share counters and messages can say which one a rule uses.
#[derive(Clone)]
pub struct CustomKey {
    name: String,
    f: KeyImpl,
}

/// A key function, called as the request comes in or awaited.
#[derive(Clone)]
enum KeyImpl {
    Sync(Arc<dyn KeyFn>),
    Lookup(Arc<dyn LookupFn>),
}

/// What [`Key::custom`] accepts: any `Fn(&RequestHead) -> Option<String>`
/// that can be shared between threads, or a type of your own. The same
/// function serves the actix-web filter and the tower layer.
///
/// ```
/// use floodgate_limiter::{KeyFn, RequestHead};
///
/// struct ApiKey;
/// impl KeyFn for ApiKey {
///     fn key(&self, req: &RequestHead) -> Option<String> {
///         req.header("x-api-key").map(str::to_owned)
///     }
/// }
/// let key = floodgate_limiter::Key::custom("api-key", ApiKey);
/// assert_eq!(key.to_string(), "custom:api-key");
/// ```
pub trait KeyFn: Send + Sync + 'static {
    /// The ID of this request for the rule, or `None`.
    fn key(&self, req: &RequestHead) -> Option<String>;
}

impl<F> KeyFn for F
where
    F: Fn(&RequestHead) -> Option<String> + Send + Sync + 'static,
{
    fn key(&self, req: &RequestHead) -> Option<String> {
        self(req)
    }
}

impl CustomKey {
    /// The function's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The ID of `req` (prefixed with the name, so two functions never
    /// share a counter), or `None`; always `None` for a [`Key::lookup`],
    /// whose ID is awaited as the request is decided.
    pub fn key(&self, req: &RequestHead) -> Option<String> {
        match &self.f {
            KeyImpl::Sync(f) => f.key(req).map(|id| self.prefixed(&id)),
            KeyImpl::Lookup(_) => None,
        }
    }

    /// Whether this is an asynchronous [`Key::lookup`].
    pub fn is_lookup(&self) -> bool {
        matches!(self.f, KeyImpl::Lookup(_))
    }

    /// Who `req` comes from, for a [`Key::lookup`] (`None` for the others).
    pub(crate) fn lookup(&self, req: &RequestHead) -> Option<crate::rule::LookupFuture> {
        match &self.f {
            KeyImpl::Lookup(f) => Some(f.lookup(req.clone())),
            KeyImpl::Sync(_) => None,
        }
    }

    /// An ID as the Redis key holds it: with the function's name.
    pub(crate) fn prefixed(&self, id: &str) -> String {
        format!("{}={id}", self.name)
    }
}

impl fmt::Debug for CustomKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CustomKey").field(&self.name).finish()
    }
}

impl PartialEq for CustomKey {
    fn eq(&self, other: &CustomKey) -> bool {
        self.name == other.name
    }
}

impl Eq for CustomKey {}

impl KeyKind {
    /// The KIND component of the Redis key.
    pub fn kind(&self) -> &'static str {
        match self {
            KeyKind::Ip => "ip",
            KeyKind::Global => "global",
            KeyKind::Path => "path",
            KeyKind::Session => "session",
            KeyKind::Header(_) => "header",
            KeyKind::Query(_) => "query",
            KeyKind::Form(_) => "form",
            KeyKind::Json(_) => "json",
            KeyKind::Body(_) => "body",
            KeyKind::Custom(_) => "custom",
        }
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyKind::Header(n) => write!(f, "header:{n}"),
            KeyKind::Query(n) => write!(f, "query:{n}"),
            KeyKind::Form(n) => write!(f, "form:{n}"),
            KeyKind::Json(n) => write!(f, "json:{n}"),
            KeyKind::Body(n) => write!(f, "body:{n}"),
            KeyKind::Custom(c) => write!(f, "custom:{}", c.name),
            other => f.write_str(other.kind()),
        }
    }
}

/// What a rule counts by: one kind, or several (one counter per
/// combination of their values, e.g. per phone number per address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key(pub Vec<KeyKind>);

impl Key {
    /// The client address, behind trusted proxies (IPv6 by its /64).
    ///
    /// ```
    /// use floodgate_limiter::Key;
    /// assert_eq!(Key::ip().to_string(), "ip");
    /// assert_eq!(Key::form("phone").and(Key::ip()).to_string(), r#"["form:phone", "ip"]"#);
    /// ```
    pub fn ip() -> Key {
        Key(vec![KeyKind::Ip])
    }

    /// One counter for everyone.
    pub fn global() -> Key {
        Key(vec![KeyKind::Global])
    }

    /// The decoded request path.
    pub fn path() -> Key {
        Key(vec![KeyKind::Path])
    }

    /// The signed-in account (through the filter's session lookup), else
    /// the client address.
    pub fn session() -> Key {
        Key(vec![KeyKind::Session])
    }

    /// A request header (case-insensitive name).
    pub fn header(name: &str) -> Key {
        Key(vec![KeyKind::Header(name.to_ascii_lowercase())])
    }

    /// A query-string parameter.
    pub fn query(name: &str) -> Key {
        Key(vec![KeyKind::Query(name.to_string())])
    }

    /// A field of an urlencoded form body, read as the handler's
    /// `web::Form` reads it.
    pub fn form(name: &str) -> Key {
        Key(vec![KeyKind::Form(name.to_string())])
    }

    /// A top-level member of a JSON object body (`Content-Type:
    /// application/json`), read as `web::Json` reads it: a string as is, a
    /// number as its JSON text; anything else is absent. A body that is not
    /// valid JSON, or that names the member twice, is refused (400).
    ///
    /// ```
    /// use floodgate_limiter::Key;
    /// assert_eq!(Key::json("username").to_string(), "json:username");
    /// ```
    pub fn json(name: &str) -> Key {
        Key(vec![KeyKind::Json(name.to_string())])
    }

    /// The field `name` of a form body or the member `name` of a JSON body,
    /// whichever the request sends, as one counter: a route offered as a
    /// form and as a JSON API shares its limit.
    ///
    /// ```
    /// use floodgate_limiter::Key;
    /// assert_eq!(Key::body("phone").and(Key::ip()).to_string(), r#"["body:phone", "ip"]"#);
    /// ```
    pub fn body(name: &str) -> Key {
        Key(vec![KeyKind::Body(name.to_string())])
    }

    /// The application's own function of the request: a closure
    /// `|req: &RequestHead| -> Option<String>` or a [`KeyFn`]. `None` keys
    /// the request by its client address.
    ///
    /// ```
    /// use floodgate_limiter::{Key, RequestHead};
    /// let tenant = Key::custom("tenant", |req: &RequestHead| {
    ///     req.path().strip_prefix("/t/")?.split('/').next().map(str::to_owned)
    /// });
    /// assert_eq!(tenant.to_string(), "custom:tenant");
    /// ```
    pub fn custom(name: &str, f: impl KeyFn) -> Key {
        Key(vec![KeyKind::Custom(CustomKey {
            name: name.to_string(),
            f: KeyImpl::Sync(Arc::new(f)),
        })])
    }

    /// A key function that may await (an API key looked up in a database or
    /// a cache) and may choose the caller's quota: `|req: RequestHead|
    /// async move { ... }` (a `Send` future) returning `Option<`[`Identity`](crate::rule::Identity)`>`, or a
    /// [`LookupFn`]. `None` is an absent value: the request is keyed by its
    /// address with the limit's own quota (or refused, with
    /// `on_missing_key = reject`). One limit then serves anonymous callers
    /// (by address, 10 a minute, say) and known ones (by key, 100).
    ///
    /// ```
    /// use floodgate_limiter::rule::Identity;
    /// use floodgate_limiter::{Key, Limit, RequestHead};
    ///
    /// let key = Key::lookup("api-key", |req: RequestHead| async move {
    ///     let token = req.header("x-api-key")?.to_owned();
    ///     // Look the token up (here: every token that starts with "k-").
    ///     token.starts_with("k-").then(|| Identity::new(token).with_limit(100))
    /// });
    /// let limit = Limit::per_minute(10).key(key).hash_key_values();
    /// # let _ = limit;
    /// ```
    pub fn lookup(name: &str, f: impl LookupFn) -> Key {
        Key(vec![KeyKind::Custom(CustomKey {
            name: name.to_string(),
            f: KeyImpl::Lookup(Arc::new(f)),
        })])
    }

    /// Whether any part is a [`Key::lookup`].
    pub fn has_lookup(&self) -> bool {
        self.0
            .iter()
            .any(|k| matches!(k, KeyKind::Custom(c) if c.is_lookup()))
    }

    /// One counter per combination of this key's values and `other`'s
    /// (per phone number per address, say). Every kind is kept as given: a
    /// kind named twice (two [`Key::custom`] of one name, say) makes the
    /// filter refuse to build, as a file's `key` list does.
    pub fn and(mut self, other: Key) -> Key {
        self.0.extend(other.0);
        self
    }

    /// The kinds, in the order written (never empty).
    pub fn kinds(&self) -> &[KeyKind] {
        &self.0
    }

    /// Whether any part reads a form body.
    pub fn reads_form(&self) -> bool {
        self.0
            .iter()
            .any(|k| matches!(k, KeyKind::Form(_) | KeyKind::Body(_)))
    }

    /// Whether any part reads a JSON body.
    pub fn reads_json(&self) -> bool {
        self.0
            .iter()
            .any(|k| matches!(k, KeyKind::Json(_) | KeyKind::Body(_)))
    }

    /// Whether any part reads a value a rule's `normalize` applies to.
    pub(crate) fn normalizes(&self) -> bool {
        self.0.iter().any(|k| match k {
            KeyKind::Header(_)
            | KeyKind::Query(_)
            | KeyKind::Form(_)
            | KeyKind::Json(_)
            | KeyKind::Body(_) => true,
            KeyKind::Ip
            | KeyKind::Global
            | KeyKind::Path
            | KeyKind::Session
            | KeyKind::Custom(_) => false,
        })
    }

    /// The only kind, when the key is not composite.
    pub fn single(&self) -> Option<&KeyKind> {
        match self.0.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.single() {
            Some(one) => write!(f, "{one}"),
            None => {
                let parts: Vec<String> = self
                    .0
                    .iter()
                    .map(|k| format!("{:?}", k.to_string()))
                    .collect();
                write!(f, "[{}]", parts.join(", "))
            }
        }
    }
}

impl KeyKind {
    /// Reads a kind as the configuration writes it: `ip`, `global`, `path`,
    /// `session`, `header:NAME`, `query:NAME`, `form:NAME`, `json:NAME` or
    /// `body:NAME`.
    ///
    /// ```
    /// use floodgate_limiter::rule::KeyKind;
    /// assert_eq!(KeyKind::parse("form:phone"), Ok(KeyKind::Form("phone".into())));
    /// assert!(KeyKind::parse("cookie:x").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<KeyKind, String> {
        let named = |n: &str, make: fn(String) -> KeyKind| -> Result<KeyKind, String> {
            check_name(text, n)?;
            Ok(make(n.to_string()))
        };
        match text {
            "ip" => Ok(KeyKind::Ip),
            "global" => Ok(KeyKind::Global),
            "path" => Ok(KeyKind::Path),
            "session" => Ok(KeyKind::Session),
            _ => match text.split_once(':') {
                Some(("header", n)) => named(n, |n| KeyKind::Header(n.to_ascii_lowercase())),
                Some(("query", n)) => named(n, KeyKind::Query),
                Some(("form", n)) => named(n, KeyKind::Form),
                Some(("json", n)) => named(n, KeyKind::Json),
                Some(("body", n)) => named(n, KeyKind::Body),
                _ => Err(format!(
                    "unknown key {text:?}, expected \"ip\", \"global\", \"path\", \"session\", \"header:NAME\", \"query:NAME\", \"form:NAME\", \"json:NAME\" or \"body:NAME\""
                )),
            },
        }
    }

    /// Whether the kind's name (a header's, a field's, a key function's)
    /// is one a rule may use: the check a file's `key` gets, for kinds
    /// made in code.
    pub fn check(&self) -> Result<(), String> {
        match self {
            KeyKind::Header(n)
            | KeyKind::Query(n)
            | KeyKind::Form(n)
            | KeyKind::Json(n)
            | KeyKind::Body(n) => check_name(&self.to_string(), n),
            KeyKind::Custom(c) => check_name(&self.to_string(), &c.name),
            _ => Ok(()),
        }
    }
}

/// The NAME of `KIND:NAME`: 1 to 128 characters from A-Z, a-z, 0-9 and
/// `-_.[]`; `text` is the whole kind, for the message.
fn check_name(text: &str, n: &str) -> Result<(), String> {
    if n.is_empty()
        || n.len() > 128
        || !n
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.[]".contains(&b))
    {
        Err(format!("key {text:?}: the name after the colon must be 1 to 128 characters from A-Z, a-z, 0-9, \"-\", \"_\", \".\", \"[\" and \"]\""))
    } else {
        Ok(())
    }
}

/// The bytes a rule name may not carry into a Redis key as they are, and
/// what stands for each there: `:` (the key's parts are split at their
/// first colons), `{` and `}` (Redis Cluster places a key by the first
/// braces in it, which must be the ID's) and `%`, which escapes them.
/// The site's rule names have none of them; an Envoy descriptor file's may.
const SEGMENT_ESCAPES: [(char, &str); 4] = [('%', "%25"), (':', "%3A"), ('{', "%7B"), ('}', "%7D")];

/// Appends rule name `rule` to `key` as a key segment (see
/// [`SEGMENT_ESCAPES`]).
fn push_rule_segment(key: &mut String, rule: &str) {
    if !escapes(rule) {
        // Every name of the site's rules (and most others): as it is.
        key.push_str(rule);
        return;
    }
    for c in rule.chars() {
        match SEGMENT_ESCAPES.iter().find(|(e, _)| *e == c) {
            Some((_, text)) => key.push_str(text),
            None => key.push(c),
        }
    }
}

/// Whether rule name `rule` has a character to escape in a key.
fn escapes(rule: &str) -> bool {
    // (The characters of SEGMENT_ESCAPES, written out: this runs for every
    // check of every request, and a match on bytes is the fastest test.)
    rule.bytes().any(|b| matches!(b, b'%' | b':' | b'{' | b'}'))
}

/// Rule name `rule` as it stands in a Redis key.
pub(crate) fn rule_segment(rule: &str) -> std::borrow::Cow<'_, str> {
    if escapes(rule) {
        let mut out = String::with_capacity(rule.len() + 8);
        push_rule_segment(&mut out, rule);
        out.into()
    } else {
        rule.into()
    }
}

/// The rule name a key segment stands for (the reverse of
/// [`rule_segment`]; a `%` that starts no escape is kept as it is).
pub(crate) fn rule_of_segment(segment: &str) -> std::borrow::Cow<'_, str> {
    if !segment.contains('%') {
        return segment.into();
    }
    let mut out = String::with_capacity(segment.len());
    let mut rest = segment;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        match SEGMENT_ESCAPES
            .iter()
            .find(|(_, text)| rest.starts_with(text))
        {
            Some((c, text)) => {
                out.push(*c);
                rest = &rest[text.len()..];
            }
            None => {
                out.push('%');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out.into()
}

/// `PREFIX:RULE:KIND:ID`, with the rule name's `:`, `{`, `}` and `%`
/// percent-encoded in RULE, and an ID longer than 64 bytes, or one that
/// starts with `~`, replaced by `~` and 40 hex digits of its SHA-256 (so
/// that no value written as `~` and a hash shares the counter of the long
/// value it is the hash of); with `hash_tag` (Redis Cluster) the ID in braces,
/// `PREFIX:RULE:KIND:{ID}`: Redis Cluster then places a key by its ID
/// alone, so the rules that key one request by the same value share a slot
/// (and are decided in one atomic call), while different IDs spread over
/// the masters.
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn redis_key_for(hash_tag: bool, prefix: &str, rule: &str, kind: &str, id: &str) -> String {
    let hashed;
    let id = if is_stored_as_is(id) {
        id
    } else {
        hashed = hashed_id(id);
        &hashed
    };
    key_of_stored_id(hash_tag, prefix, rule, kind, id)
}

/// [`redis_key_for`] with an ID already as the key holds it.
pub(crate) fn key_of_stored_id(
    hash_tag: bool,
    prefix: &str,
    rule: &str,
    kind: &str,
    id: &str,
) -> String {
    // Built in one allocation of the right size (a `format!` grows its
    // buffer as it goes): this runs for every check of every request.
    let braces = if hash_tag { 2 } else { 0 };
    let mut key =
        String::with_capacity(prefix.len() + rule.len() + kind.len() + id.len() + 3 + braces);
    key.push_str(prefix);
    key.push(':');
    push_rule_segment(&mut key, rule);
    for part in [":", kind, ":"] {
        key.push_str(part);
    }
    if hash_tag {
        key.push('{');
        key.push_str(id);
        key.push('}');
    } else {
        key.push_str(id);
    }
    key
}

/// An ID as a Redis key holds it (see [`redis_key_for`]): as it is, or
/// hashed when over 64 bytes or starting with `~`.
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn stored_id(id: &str) -> String {
    if is_stored_as_is(id) {
        id.to_string()
    } else {
        hashed_id(id)
    }
}

/// Whether an ID is kept as it is in a key name: at most 64 bytes, and
/// not starting with `~`, which marks a hash.
fn is_stored_as_is(id: &str) -> bool {
    id.len() <= MAX_ID_BYTES && !id.starts_with('~')
}

/// An ID that is not to be read in Redis (an API key, say): `~` and 40
/// hex digits of its SHA-256, whatever its length.
pub(crate) fn hashed_id(id: &str) -> String {
    let digest = Sha256::digest(id.as_bytes());
    let hex: String = digest[..20].iter().map(|b| format!("{b:02x}")).collect();
    format!("~{hex}")
}

/// Joins the parts of a composite key: KIND is the kinds joined by `+`, ID
/// the IDs joined by `|`, each with `%` and `|` percent-escaped so that no
/// two different combinations make the same ID.
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn compose(parts: &[(&str, String)]) -> (String, String) {
    let kind = parts.iter().map(|(k, _)| *k).collect::<Vec<_>>().join("+");
    let id = parts
        .iter()
        .map(|(_, id)| id.replace('%', "%25").replace('|', "%7C"))
        .collect::<Vec<_>>()
        .join("|");
    (kind, id)
}
