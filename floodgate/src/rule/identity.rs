//! An identity named from outside a request: the values an operator types
//! for a rule's key kinds, turned into the Redis key a request carrying
//! them would be counted under (the rule's `normalize` applies, addresses
//! are keyed as clients are).

use std::net::IpAddr;

use super::{compose, normalize, KeyKind, Normalize, Rule};

/// The Redis key of the identity whose values, one per key kind of `rule`
/// in the rule's order, are `values` (`global` takes none). Errors say
/// which value is wrong, in one sentence.
pub(crate) fn identity_key(
    rule: &Rule,
    values: &[&str],
    key_prefix: &str,
    hash_tags: bool,
) -> Result<String, String> {
    let kinds: Vec<&KeyKind> = rule
        .key
        .kinds()
        .iter()
        .filter(|k| **k != KeyKind::Global)
        .collect();
    if values.len() != kinds.len() {
        let wanted: Vec<String> = kinds.iter().map(|k| k.to_string()).collect();
        return Err(format!(
            "rule {:?} takes {} value{} ({}), got {}",
            rule.name,
            kinds.len(),
            if kinds.len() == 1 { "" } else { "s" },
            if wanted.is_empty() {
                "its key is global".to_string()
            } else {
                wanted.join(", ")
            },
            values.len()
        ));
    }
    let mut parts: Vec<(&'static str, String)> = Vec::with_capacity(rule.key.kinds().len());
    let mut given = values.iter();
    for kind in rule.key.kinds() {
        if *kind == KeyKind::Global {
            parts.push((kind.kind(), "all".to_string()));
            continue;
        }
        let value = given.next().copied().unwrap_or_default();
        parts.push((kind.kind(), identity_value(kind, rule.normalize, value)?));
    }
    let (kind, id) = match parts.as_slice() {
        [(kind, id)] => ((*kind).to_string(), id.clone()),
        _ => compose(&parts),
    };
    Ok(rule.state_key(hash_tags, key_prefix, &kind, &id))
}

/// Where `value`, written as a request carries it, shows in the IDs of
/// `rule`'s identities: what `floodgate find` looks for. Empty for a rule
/// whose IDs are hashed (`hash_key`): they cannot be recognized.
#[doc(hidden)] // the floodgate binary's, not part of the API
#[derive(Debug, Default, PartialEq, Eq)]
pub struct IdForms {
    /// A composite key's: for each of its kinds that takes such a value,
    /// one part of the ID (normalized, then escaped as the parts are).
    pub parts: Vec<String>,
    /// Whole IDs: a key of one kind's (normalized, not escaped, hashed when
    /// over 64 bytes); and, under a key that may fall back to the client
    /// address, the address's.
    pub wholes: Vec<String>,
}

#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn id_forms_of(rule: &Rule, value: &str) -> IdForms {
    if rule.hash_key {
        return IdForms::default();
    }
    let kinds = rule.key.kinds();
    let read = |k: &KeyKind| {
        if matches!(k, KeyKind::Global | KeyKind::Custom(_)) {
            return None;
        }
        identity_value(k, rule.normalize, value).ok()
    };
    let mut forms = IdForms::default();
    match kinds {
        [one] => forms.wholes.extend(read(one).map(|v| super::stored_id(&v))),
        many => {
            forms.parts = many
                .iter()
                .filter_map(read)
                .map(|v| v.replace('%', "%25").replace('|', "%7C"))
                .collect();
        }
    }
    // A request without the value a kind reads (or with one that does not
    // normalize) is keyed by its client address under the same rule.
    if kinds.iter().any(may_fall_back) {
        if let Ok(ip) = value.trim().parse::<IpAddr>() {
            forms.wholes.push(crate::net::ip_id(ip));
        }
    }
    for list in [&mut forms.parts, &mut forms.wholes] {
        list.sort();
        list.dedup();
    }
    forms
}

/// Whether a request may lack the value `kind` reads, and be keyed by its
/// client address instead (every kind says, so that a new one must).
fn may_fall_back(kind: &KeyKind) -> bool {
    match kind {
        KeyKind::Ip | KeyKind::Global | KeyKind::Path => false,
        KeyKind::Session
        | KeyKind::Header(_)
        | KeyKind::Query(_)
        | KeyKind::Form(_)
        | KeyKind::Json(_)
        | KeyKind::Body(_)
        | KeyKind::Custom(_) => true,
    }
}

/// One value as a request would be keyed by it.
fn identity_value(kind: &KeyKind, how: Normalize, value: &str) -> Result<String, String> {
    match kind {
        KeyKind::Ip => value
            .trim()
            .parse::<IpAddr>()
            .map(crate::net::ip_id)
            .map_err(|_| format!("{value:?} is not an IP address")),
        KeyKind::Global => Ok("all".to_string()),
        KeyKind::Path => {
            // Written as a request carries it: percent-encoded, as the
            // filter decodes it before keying.
            if value.starts_with('/') {
                percent_encoding::percent_decode_str(value)
                    .decode_utf8()
                    .map(|p| p.into_owned())
                    .map_err(|_| format!("{value:?} is not a path (it decodes to no UTF-8 text)"))
            } else {
                Err(format!(
                    "{value:?} is not a path (it must start with \"/\")"
                ))
            }
        }
        KeyKind::Session => {
            if value.is_empty() {
                Err("the account must not be empty".to_string())
            } else {
                Ok(value.to_string())
            }
        }
        KeyKind::Header(_)
        | KeyKind::Query(_)
        | KeyKind::Form(_)
        | KeyKind::Json(_)
        | KeyKind::Body(_) => normalize(value, how).ok_or_else(|| match how {
            #[cfg(feature = "e164")]
            Normalize::E164(_) => format!("{value:?} is not a possible phone number"),
            _ => format!("{value:?} leaves nothing to key by for {kind}"),
        }),
        KeyKind::Custom(c) => Err(format!(
            "the key function {:?} reads requests only; its identities cannot be named",
            c.name()
        )),
    }
}
