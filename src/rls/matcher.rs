//! The compiled descriptor tree of every domain, and how a request's
//! descriptor walks it: at each level an entry takes the node with its key
//! and value, else the first wildcard node of its key (in file order) whose
//! pattern the value matches, else the node with its key and no value. The
//! node the last entry reaches gives the limit. Each limit is a rule with a
//! name; the values of the entries that count apart (keys without a value,
//! wildcards without `share_threshold`) name the identity, so that calls
//! and operators make the same Redis key.

use std::borrow::Cow;
use std::collections::HashMap;
use std::time::Duration;

use floodgate::rule::{compose, redis_key_for};
use floodgate::rule::{Algorithm, Penalty};

use super::proto::{Entry, Unit};

/// A `value` with `*` in it: each `*` matches any run of characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    text: String,
    parts: Vec<String>,
}

impl Pattern {
    /// The pattern written as `text`.
    pub fn new(text: &str) -> Pattern {
        Pattern {
            text: text.to_string(),
            parts: text.split('*').map(str::to_string).collect(),
        }
    }

    /// The pattern as written.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether `value` matches: it starts with the first literal part,
    /// ends with the last, and holds the middle ones in order between.
    pub fn matches(&self, value: &str) -> bool {
        let (first, rest) = match self.parts.split_first() {
            Some(p) => p,
            None => return value.is_empty(),
        };
        let Some((last, middle)) = rest.split_last() else {
            return value == first;
        };
        if value.len() < first.len() + last.len() {
            return false;
        }
        if !value.starts_with(first.as_str()) || !value.ends_with(last.as_str()) {
            return false;
        }
        let mut inner = &value[first.len()..value.len() - last.len()];
        for part in middle {
            match inner.find(part.as_str()) {
                Some(at) => inner = &inner[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

/// How a node matches an entry of its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeKind {
    /// That value exactly.
    Exact(String),
    /// Any value the pattern matches; `shared`: all of them share one
    /// count (`share_threshold`), else each value counts apart.
    Wildcard {
        /// The pattern.
        pattern: Pattern,
        /// `share_threshold`.
        shared: bool,
    },
    /// Any value, each counted apart.
    KeyOnly,
}

impl NodeKind {
    /// Whether each value matched here counts apart (names the identity).
    fn apart(&self) -> bool {
        matches!(
            self,
            NodeKind::KeyOnly | NodeKind::Wildcard { shared: false, .. }
        )
    }
}

/// One limit of the descriptor files, checked.
#[derive(Debug, Clone)]
pub struct Limit {
    /// Its rule name: `name`, else the descriptor path (with `#2`, `#3`...
    /// after it when an earlier limit, or a given name, has that name
    /// already: see [`Matcher::check_names`]).
    pub name: String,
    /// Whether the file gave the name.
    pub named: bool,
    /// Its domain.
    pub domain: String,
    /// The descriptor path, `DOMAIN.KEY_VALUE.KEY`.
    pub path: String,
    /// As written (0: every request is over).
    pub requests_per_unit: u32,
    /// The unit answered in `current_limit` (`Unknown` for a `window` that
    /// no unit divides, and for `unlimited`).
    pub unit: Unit,
    /// The window.
    pub window: Duration,
    /// The algorithm; `None` for `unlimited` and `requests_per_unit: 0`.
    pub algorithm: Option<Algorithm>,
    /// Always OK, no Redis work.
    pub unlimited: bool,
    /// `shadow_mode`: counted, never over.
    pub shadow: bool,
    /// Names of limits this one replaces when both match one call.
    pub replaces: Vec<String>,
    /// Count decisions per descriptor value in metrics.
    pub detailed_metric: bool,
    /// Escalating bans of a value denied again and again (floodgate's).
    pub penalty: Option<Penalty>,
}

/// One node of a domain's tree.
#[derive(Debug)]
struct Node {
    key: String,
    kind: NodeKind,
    parent: Option<usize>,
    limit: Option<usize>,
    value_to_metric: bool,
    children: Level,
}

/// The nodes under one node, by how they match.
#[derive(Debug, Default)]
struct Level {
    exact: HashMap<String, HashMap<String, usize>>,
    wildcards: HashMap<String, Vec<usize>>,
    key_only: HashMap<String, usize>,
    filled: bool,
}

impl Level {
    fn is_empty(&self) -> bool {
        !self.filled
    }
}

/// Every domain's tree and every limit.
#[derive(Debug, Default)]
pub struct Matcher {
    nodes: Vec<Node>,
    domains: HashMap<String, usize>,
    /// The file that gave each domain (for the message refusing another).
    domain_files: HashMap<String, String>,
    limits: Vec<Limit>,
    /// The limits without a name whose path was another's name already:
    /// (path, the name they were given).
    renamed: Vec<(String, String)>,
}

/// A descriptor key whose value names an identity, with the pattern the
/// value must match (a wildcard) or `None` (any value).
pub type Slot<'a> = (String, Option<&'a Pattern>);

/// What one request descriptor matched.
#[derive(Debug, Clone)]
pub struct Matched<'a> {
    /// The limit.
    pub limit: &'a Limit,
    /// The values that name the identity, in order.
    pub values: Vec<&'a str>,
    /// The rule label its decisions are counted under in metrics.
    pub metric: String,
}

/// The Redis key of the identity `values` under the limit named `rule`:
/// `PREFIX:RULE:KIND:ID`, KIND `global` (ID `all`) when no value names it,
/// else `rls`.
pub fn state_key(hash_tags: bool, prefix: &str, rule: &str, values: &[&str]) -> String {
    match values {
        [] => redis_key_for(hash_tags, prefix, rule, "global", "all"),
        _ => redis_key_for(hash_tags, prefix, rule, "rls", &id_of(values)),
    }
}

/// The Redis key of the identity `values` on the counter of a limit a
/// call brings (a descriptor's own `limit`), named `counter`: KIND `own`
/// (ID `all` when no value names it), so that no name a descriptor file
/// gives a limit, and no values, can spell a key of such a counter.
pub fn own_key(hash_tags: bool, prefix: &str, counter: &str, values: &[&str]) -> String {
    let id = if values.is_empty() {
        Cow::Borrowed("all")
    } else {
        id_of(values)
    };
    redis_key_for(hash_tags, prefix, counter, "own", &id)
}

/// The ID of `values` (at least one): the one, or all joined by `|`.
fn id_of<'v>(values: &[&'v str]) -> Cow<'v, str> {
    match values {
        [one] => Cow::Borrowed(one),
        many => {
            let parts: Vec<(&str, String)> = many.iter().map(|v| ("rls", v.to_string())).collect();
            Cow::Owned(compose(&parts).1)
        }
    }
}

impl Matcher {
    /// Whether a file already gave `domain`.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The file that gave `domain`, if one did.
    pub fn file_of_domain(&self, domain: &str) -> Option<&str> {
        self.domain_files.get(domain).map(String::as_str)
    }

    /// Adds an empty domain, given by `file`; its root node.
    pub fn add_domain(&mut self, domain: &str, file: &str) -> usize {
        let root = self.nodes.len();
        self.nodes.push(Node {
            key: String::new(),
            kind: NodeKind::KeyOnly,
            parent: None,
            limit: None,
            value_to_metric: false,
            children: Level::default(),
        });
        self.domains.insert(domain.to_string(), root);
        self.domain_files
            .insert(domain.to_string(), file.to_string());
        root
    }

    /// Adds a node under `parent`; refuses a second node with the same key
    /// and value at one level.
    pub fn add_node(
        &mut self,
        parent: usize,
        key: &str,
        kind: NodeKind,
        limit: Option<Limit>,
        value_to_metric: bool,
    ) -> Result<usize, String> {
        let at = self.nodes.len();
        let Some(p) = self.nodes.get(parent) else {
            return Err("internal: no such parent".into());
        };
        let level = &p.children;
        let duplicate = match &kind {
            NodeKind::Exact(v) => level
                .exact
                .get(key)
                .is_some_and(|values| values.contains_key(v)),
            NodeKind::KeyOnly => level.key_only.contains_key(key),
            NodeKind::Wildcard { pattern, .. } => level.wildcards.get(key).is_some_and(|w| {
                w.iter().any(|&n| {
                    matches!(&self.nodes[n].kind, NodeKind::Wildcard { pattern: q, .. } if q == pattern)
                })
            }),
        };
        if duplicate {
            return Err(
                "duplicate descriptor: another one at this level has the same key and value".into(),
            );
        }
        let level = &mut self.nodes[parent].children;
        level.filled = true;
        match &kind {
            NodeKind::Exact(v) => {
                level
                    .exact
                    .entry(key.to_string())
                    .or_default()
                    .insert(v.clone(), at);
            }
            NodeKind::KeyOnly => {
                level.key_only.insert(key.to_string(), at);
            }
            NodeKind::Wildcard { .. } => {
                level.wildcards.entry(key.to_string()).or_default().push(at)
            }
        }
        let limit = limit.map(|l| {
            self.limits.push(l);
            self.limits.len() - 1
        });
        self.nodes.push(Node {
            key: key.to_string(),
            kind,
            parent: Some(parent),
            limit,
            value_to_metric,
            children: Level::default(),
        });
        Ok(at)
    }

    /// Names must be unique: they name the counters. Two names a file
    /// gives are refused: `(WHERE, WHAT)`. A limit without a name is named
    /// by its path, and paths can meet (`a_b` = `c` and `a` = `b_c` both
    /// make `D.a_b_c`), or meet a given name: then, in file order, the
    /// later ones are named `PATH#2`, `PATH#3`... (see [`Matcher::renamed`]).
    pub fn check_names(&mut self) -> Result<(), (String, String)> {
        let mut given: HashMap<&str, &Limit> = HashMap::new();
        for l in self.limits.iter().filter(|l| l.named) {
            if let Some(other) = given.insert(&l.name, l) {
                return Err((
                    format!("descriptor {:?}", l.path),
                    format!(
                        "the limit name {:?} is also the name of descriptor {:?}'s limit (names must be unique: they name the counters)",
                        l.name, other.path
                    ),
                ));
            }
        }
        let mut taken: std::collections::HashSet<String> =
            given.into_keys().map(str::to_string).collect();
        self.renamed.clear();
        for l in self.limits.iter_mut().filter(|l| !l.named) {
            let mut name = l.path.clone();
            let mut n = 1;
            while taken.contains(&name) {
                n += 1;
                name = format!("{}#{n}", l.path);
            }
            if n > 1 {
                self.renamed.push((l.path.clone(), name.clone()));
            }
            taken.insert(name.clone());
            l.name = name;
        }
        Ok(())
    }

    /// The limits without a name that could not be named by their path
    /// alone: (path, name).
    pub fn renamed(&self) -> &[(String, String)] {
        &self.renamed
    }

    /// Every limit, in file order.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// The domains, sorted.
    pub fn domains(&self) -> Vec<&str> {
        let mut d: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        d.sort_unstable();
        d
    }

    /// The node a limit hangs on.
    fn node_of(&self, limit: usize) -> Option<usize> {
        self.nodes.iter().position(|n| n.limit == Some(limit))
    }

    /// The keys whose values name an identity under the limit named
    /// `rule`, in order, each with the pattern its value must match.
    pub fn slots(&self, rule: &str) -> Option<(&Limit, Vec<Slot<'_>>)> {
        let index = self.limits.iter().position(|l| l.name == rule)?;
        let mut node = self.node_of(index);
        let mut slots = Vec::new();
        while let Some(n) = node {
            let nd = &self.nodes[n];
            if nd.parent.is_none() {
                break;
            }
            match &nd.kind {
                NodeKind::KeyOnly => slots.push((nd.key.clone(), None)),
                NodeKind::Wildcard {
                    pattern,
                    shared: false,
                } => slots.push((nd.key.clone(), Some(pattern))),
                _ => {}
            }
            node = nd.parent;
        }
        slots.reverse();
        Some((&self.limits[index], slots))
    }

    /// The limit `entries` reach in `domain`, if any.
    pub fn find<'a>(&'a self, domain: &str, entries: &'a [Entry]) -> Option<Matched<'a>> {
        let mut node = *self.domains.get(domain)?;
        let mut values = Vec::new();
        let mut detailed = String::from(domain);
        let mut to_metric = String::from(domain);
        let mut any_to_metric = false;
        for (i, e) in entries.iter().enumerate() {
            let level = &self.nodes[node].children;
            let next = level
                .exact
                .get(&e.key)
                .and_then(|v| v.get(&e.value))
                .copied()
                .or_else(|| {
                    level.wildcards.get(&e.key).and_then(|w| {
                        w.iter().copied().find(|&n| match &self.nodes[n].kind {
                            NodeKind::Wildcard { pattern, .. } => pattern.matches(&e.value),
                            _ => false,
                        })
                    })
                })
                .or_else(|| level.key_only.get(&e.key).copied())?;
            let nd = &self.nodes[next];
            if nd.kind.apart() {
                values.push(e.value.as_str());
            }
            detailed.push('.');
            detailed.push_str(&e.key);
            to_metric.push('.');
            to_metric.push_str(&e.key);
            let shown = match &nd.kind {
                NodeKind::Wildcard { pattern, shared } => {
                    if *shared || !nd.value_to_metric {
                        pattern.text()
                    } else {
                        &e.value
                    }
                }
                NodeKind::Exact(v) => v,
                NodeKind::KeyOnly if nd.value_to_metric => &e.value,
                NodeKind::KeyOnly => "",
            };
            if nd.value_to_metric {
                any_to_metric = true;
            }
            match &nd.kind {
                NodeKind::Wildcard {
                    pattern,
                    shared: true,
                } => {
                    detailed.push('_');
                    detailed.push_str(pattern.text());
                }
                _ if !e.value.is_empty() => {
                    detailed.push('_');
                    detailed.push_str(&e.value);
                }
                _ => {}
            }
            if !shown.is_empty() {
                to_metric.push('_');
                to_metric.push_str(shown);
            }
            if i + 1 == entries.len() {
                let limit = &self.limits[nd.limit?];
                let metric = if limit.detailed_metric {
                    detailed
                } else if any_to_metric {
                    to_metric
                } else {
                    limit.name.clone()
                };
                return Some(Matched {
                    limit,
                    values,
                    metric,
                });
            }
            if nd.children.is_empty() {
                return None;
            }
            node = next;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        let p = Pattern::new("files/*");
        assert!(p.matches("files/"));
        assert!(p.matches("files/a/b"));
        assert!(!p.matches("file/a"));
        let p = Pattern::new("/api*v1");
        assert!(p.matches("/apiv1"));
        assert!(p.matches("/api/x/v1"));
        assert!(!p.matches("/api/x/v2"));
        let p = Pattern::new("a*b*c");
        assert!(p.matches("abc"));
        assert!(p.matches("axxbyyc"));
        assert!(!p.matches("acb"));
        assert!(!p.matches("ab"));
        let p = Pattern::new("*");
        assert!(p.matches(""));
        assert!(p.matches("anything"));
        let p = Pattern::new("ab*ba");
        assert!(!p.matches("aba"));
        assert!(p.matches("abba"));
    }

    #[test]
    fn state_keys() {
        assert_eq!(state_key(false, "fg", "d.k", &[]), "fg:d.k:global:all");
        assert_eq!(state_key(false, "fg", "d.k", &["v"]), "fg:d.k:rls:v");
        assert_eq!(
            state_key(false, "fg", "d.k", &["a|b", "c"]),
            "fg:d.k:rls:a%7Cb|c"
        );
        assert_eq!(state_key(true, "fg", "d.k", &["v"]), "fg:d.k:rls:{v}");
        assert_eq!(
            own_key(false, "fg", "d.k~3/minute", &["v"]),
            "fg:d.k~3/minute:own:v"
        );
        assert_eq!(
            own_key(false, "fg", "d.k~3/minute", &[]),
            "fg:d.k~3/minute:own:all"
        );
        assert_eq!(
            own_key(true, "fg", "d.k~3/minute", &["a", "b"]),
            "fg:d.k~3/minute:own:{a|b}"
        );
    }
}
