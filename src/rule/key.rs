//! What a rule counts by: the kinds of key (address, form field, header…),
//! composite keys, and the Redis key `PREFIX:RULE:KIND:ID` they make.

use std::fmt;

use sha2::{Digest, Sha256};

/// Longest ID kept as is in a Redis key; longer ones are hashed.
pub const MAX_ID_BYTES: usize = 64;

/// What identifies the caller for a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

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
        }
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyKind::Header(n) => write!(f, "header:{n}"),
            KeyKind::Query(n) => write!(f, "query:{n}"),
            KeyKind::Form(n) => write!(f, "form:{n}"),
            other => f.write_str(other.kind()),
        }
    }
}

/// What a rule counts by: one kind, or several (one counter per
/// combination of their values, e.g. per phone number per address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key(pub Vec<KeyKind>);

impl Key {
    /// The kinds, in the order written (never empty).
    pub fn kinds(&self) -> &[KeyKind] {
        &self.0
    }

    /// Whether any part reads the form body.
    pub fn reads_form(&self) -> bool {
        self.0.iter().any(|k| matches!(k, KeyKind::Form(_)))
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
    /// `session`, `header:NAME`, `query:NAME` or `form:NAME`.
    ///
    /// ```
    /// use floodgate::KeyKind;
    /// assert_eq!(KeyKind::parse("form:phone"), Ok(KeyKind::Form("phone".into())));
    /// assert!(KeyKind::parse("cookie:x").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<KeyKind, String> {
        let named = |n: &str, make: fn(String) -> KeyKind| -> Result<KeyKind, String> {
            if n.is_empty()
                || n.len() > 128
                || !n
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.[]".contains(&b))
            {
                Err(format!("key {text:?}: the name after the colon must be 1 to 128 characters from A-Z, a-z, 0-9, \"-\", \"_\", \".\", \"[\" and \"]\""))
            } else {
                Ok(make(n.to_string()))
            }
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
            _ => Err(format!(
                "unknown key {text:?}, expected \"ip\", \"global\", \"path\", \"session\", \"header:NAME\", \"query:NAME\" or \"form:NAME\""
            )),
        },
    }
    }
}

/// `PREFIX:RULE:KIND:ID`, with an ID longer than 64 bytes replaced by
/// `~` and 40 hex digits of its SHA-256.
pub fn redis_key(prefix: &str, rule: &str, kind: &str, id: &str) -> String {
    if id.len() <= MAX_ID_BYTES {
        format!("{prefix}:{rule}:{kind}:{id}")
    } else {
        let digest = Sha256::digest(id.as_bytes());
        let hex: String = digest[..20].iter().map(|b| format!("{b:02x}")).collect();
        format!("{prefix}:{rule}:{kind}:~{hex}")
    }
}

/// Joins the parts of a composite key: KIND is the kinds joined by `+`, ID
/// the IDs joined by `|`, each with `%` and `|` percent-escaped so that no
/// two different combinations make the same ID.
pub fn compose(parts: &[(&str, String)]) -> (String, String) {
    let kind = parts.iter().map(|(k, _)| *k).collect::<Vec<_>>().join("+");
    let id = parts
        .iter()
        .map(|(_, id)| id.replace('%', "%25").replace('|', "%7C"))
        .collect::<Vec<_>>()
        .join("|");
    (kind, id)
}
