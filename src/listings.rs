//! What operators see, for the command line (`floodgate bans | overrides |
//! audit`, one JSON object per line) and the admin API (`GET /admin/bans |
//! overrides | audit`, one JSON array): the objects built from the
//! library's listings, and the audit entries operators' actions write.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use floodgate::limiter::{
    split_state_key, Action, AuditEntry, Check, Limiter, LimiterError, Listed,
};
use serde_json::{json, Value};

/// The most audit entries a listing shows.
pub const AUDIT_MOST: usize = 1000;

/// What to list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    /// Active bans.
    Bans,
    /// Active overrides.
    Overrides,
}

/// A rule as the listings know it: its name and its window in whole
/// seconds (what an override without a window of its own has).
pub type Known = (String, u64);

/// The rules of a config file as the listings know them.
pub fn known(rules: &[floodgate::rule::Rule]) -> Vec<Known> {
    rules
        .iter()
        .map(|r| (r.name().to_string(), r.algorithm().window_seconds()))
        .collect()
}

/// Refuses a rule name that is not one of `rules` (with the names there are).
pub fn known_rule(rules: &[Known], rule: &str) -> Result<(), String> {
    if rules.iter().any(|(name, _)| name == rule) {
        return Ok(());
    }
    let names: Vec<&str> = rules.iter().map(|(name, _)| name.as_str()).collect();
    Err(format!(
        "unknown rule {rule:?} (the rules are: {})",
        names.join(", ")
    ))
}

/// The objects of `what` found in `listed`, for `rule` alone when given:
/// bans `{"rule","id","banned_s","source","level"}`, overrides
/// `{"rule","id","limit","window_s","expires_s"}` (the window the
/// override sets, else its rule's). Records of rules no longer in `rules`
/// are listed too (their state is still in Redis).
pub fn objects(
    what: Listing,
    listed: &[Listed],
    rules: &[Known],
    rule: Option<&str>,
) -> Vec<Value> {
    let secs = |ms: u64| ms.div_ceil(1000);
    listed
        .iter()
        .filter(|l| rule.is_none_or(|r| l.rule == r))
        .filter_map(|l| match what {
            Listing::Bans => (l.banned_ms > 0).then(|| {
                json!({
                    "rule": l.rule,
                    "id": l.id,
                    "banned_s": secs(l.banned_ms),
                    "source": l.ban_source.as_deref().unwrap_or("operator"),
                    "level": l.level,
                })
            }),
            Listing::Overrides => l.override_state.map(|o| {
                let window_s = o.window_ms.map(secs).or_else(|| {
                    rules
                        .iter()
                        .find(|(name, _)| *name == l.rule)
                        .map(|(_, window)| *window)
                });
                json!({
                    "rule": l.rule,
                    "id": l.id,
                    "limit": o.limit,
                    "window_s": window_s,
                    "expires_s": o.expires_ms.map(secs),
                })
            }),
        })
        .collect()
}

/// One walk over the operator records at a time, in this process: a flood
/// of scrapes must not take the pool's connections from the requests.
static READING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// How long a scrape waits for another's walk before it leaves the gauges
/// out.
const READ_WAIT: Duration = Duration::from_secs(2);

/// The bans and overrides gauges for `/metrics`, read from Redis's operator
/// records (a walk over the keys, on a blocking thread, one at a time in
/// the process); `None` while Redis does not answer, or while other
/// scrapes' walks have kept this one waiting for 2 s.
pub async fn active_gauges(
    limiter: &std::sync::Arc<floodgate::limiter::Limiter>,
    prefix: &str,
    rules: &[Known],
) -> Option<String> {
    let Ok(Ok(_turn)) = tokio::time::timeout(READ_WAIT, READING.acquire()).await else {
        log::debug!("metrics: bans and overrides not read: other scrapes are reading them");
        return None;
    };
    let (limiter, prefix) = (std::sync::Arc::clone(limiter), prefix.to_string());
    let read = actix_web::web::block(move || limiter.listed_blocking(&prefix))
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()));
    match read {
        Ok(listed) => Some(gauges(&listed, rules)),
        Err(e) => {
            log::debug!("metrics: bans and overrides not read: {e}");
            None
        }
    }
}

/// The `floodgate_bans_active` and `floodgate_overrides_active` gauges of
/// `/metrics`: per rule of `rules`, the identities `listed` as banned and
/// with an override in force now.
fn gauges(listed: &[Listed], rules: &[Known]) -> String {
    let mut text = String::new();
    for (name, help, counts) in [
        (
            "floodgate_bans_active",
            "Identities banned now (by an operator or a penalty), per rule.",
            &(|l: &Listed| l.banned_ms > 0) as &dyn Fn(&Listed) -> bool,
        ),
        (
            "floodgate_overrides_active",
            "Identities with an override in force now, per rule.",
            &|l: &Listed| l.override_state.is_some(),
        ),
    ] {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (rule, _) in rules {
            let n = listed
                .iter()
                .filter(|l| l.rule == *rule && counts(l))
                .count();
            text.push_str(&format!("{name}{{rule=\"{rule}\"}} {n}\n"));
        }
    }
    text
}

/// A listing asked for, its parameters checked: `what` it is (`bans`,
/// `overrides`, `top`, `find` or `audit`), as the command line and the
/// admin API take it.
pub struct Asked<'a> {
    /// Which listing.
    pub what: &'a str,
    /// `bans`, `overrides`: this rule's alone; `top`: the rule.
    pub rule: Option<&'a str>,
    /// `find`: what each rule is searched for.
    pub searched: &'a [Searched],
    /// `audit`: the entries since then (seconds since the epoch).
    pub since: u64,
    /// `top`: the denials within this long.
    pub top_since: Duration,
}

/// The objects a listing shows (one per line on the command line, a JSON
/// array from the admin API), over the rules `known`. Blocking.
pub fn list(
    limiter: &Limiter,
    prefix: &str,
    known: &[Known],
    asked: &Asked<'_>,
) -> Result<Vec<Value>, LimiterError> {
    match asked.what {
        "top" => top(
            limiter,
            prefix,
            asked.rule.unwrap_or_default(),
            asked.top_since,
        ),
        "find" => find_in(limiter, prefix, asked.searched),
        "audit" => limiter
            .audit_trail_blocking(prefix, asked.since, AUDIT_MOST)
            .map(|entries| audit_objects(&entries)),
        other => {
            let listing = if other == "bans" {
                Listing::Bans
            } else {
                Listing::Overrides
            };
            limiter
                .listed_blocking(prefix)
                .map(|listed| objects(listing, &listed, known, asked.rule))
        }
    }
}

/// What `find` looks for in each of a site's rules: `value` as the rule's
/// key would read it from a request.
pub fn searched_rules(rules: &[floodgate::rule::Rule], value: &str) -> Vec<Searched> {
    rules
        .iter()
        .map(|rule| {
            let forms = floodgate::rule::id_forms_of(rule, value);
            Searched {
                name: rule.name().to_string(),
                parts: forms.parts,
                wholes: forms.wholes,
                inspect: rule.check(String::new()),
            }
        })
        .collect()
}

/// Whether `rule`'s key has a `session` kind (keys an account).
pub fn has_session(rule: &floodgate::rule::Rule) -> bool {
    rule.key()
        .kinds()
        .iter()
        .any(|k| matches!(k, floodgate::rule::KeyKind::Session))
}

/// Adds to `searched` (made by [`searched_rules`] from the same `rules`)
/// the forms of the account ID `id` in the rules with a `session` kind.
pub fn search_session_id(searched: &mut [Searched], rules: &[floodgate::rule::Rule], id: &str) {
    for (s, rule) in searched.iter_mut().zip(rules) {
        if has_session(rule) {
            let forms = floodgate::rule::id_forms_of(rule, id);
            s.parts.extend(forms.parts);
            s.wholes.extend(forms.wholes);
        }
    }
}

/// The limits of the rate-limit service's descriptor files as the
/// listings know them.
pub fn known_limits(matcher: &crate::rls::matcher::Matcher) -> Vec<Known> {
    matcher
        .limits()
        .iter()
        .map(|l| (l.name.clone(), l.window.as_secs().max(1)))
        .collect()
}

/// What `find` looks for in each of the service's limits: `value` as a
/// descriptor value, as written or as it is escaped in an ID.
pub fn searched_limits(matcher: &crate::rls::matcher::Matcher, value: &str) -> Vec<Searched> {
    // One descriptor value is the ID as it is; several are escaped and
    // joined (see `matcher.rs`).
    let parts = vec![value.replace('%', "%25").replace('|', "%7C")];
    let wholes = vec![floodgate::rule::stored_id(value)];
    matcher
        .limits()
        .iter()
        .filter_map(|l| {
            Some(Searched {
                name: l.name.clone(),
                parts: parts.clone(),
                wholes: wholes.clone(),
                inspect: Check::new(String::new(), l.algorithm?).with_enforce(!l.shadow),
            })
        })
        .collect()
}

/// One rule (or a rate-limit service's limit) as `find` searches it: its
/// name, the parts the value is in its identities' IDs, and the check an
/// identity of it is inspected with (its key left to fill).
pub struct Searched {
    /// The rule's name.
    pub name: String,
    /// The forms the value takes as one part of a composite ID.
    pub parts: Vec<String>,
    /// The forms the value takes as a whole ID (a rule keyed by one kind).
    pub wholes: Vec<String>,
    /// The rule's check, without a key.
    pub inspect: Check,
}

/// `find` over `searched`, in its order: each identity whose ID holds one
/// of a rule's parts, as its `inspect` object.
pub fn find_in(
    limiter: &Limiter,
    prefix: &str,
    searched: &[Searched],
) -> Result<Vec<Value>, LimiterError> {
    let mut found = Vec::new();
    for rule in searched
        .iter()
        .filter(|s| !(s.parts.is_empty() && s.wholes.is_empty()))
    {
        for key in limiter.state_keys_blocking(prefix, &rule.name)? {
            let Some((_, _, id)) = split_state_key(prefix, &key) else {
                continue;
            };
            let holds = rule.wholes.iter().any(|w| w == id)
                || id
                    .split('|')
                    .any(|part| rule.parts.iter().any(|p| p == part));
            if !holds {
                continue;
            }
            let check = rule.inspect.clone().with_key(key.clone());
            let seen = limiter.operate_blocking(&check, Action::Inspect)?;
            found.push(serde_json::from_str(&seen.to_json(&rule.name)).unwrap_or(Value::Null));
        }
    }
    Ok(found)
}

/// The audit entries as JSON objects.
pub fn audit_objects(entries: &[AuditEntry]) -> Vec<Value> {
    entries
        .iter()
        .map(|e| serde_json::to_value(e).unwrap_or(Value::Null))
        .collect()
}

/// `floodgate top RULE [--since D]`: the identities denied most under
/// `rule` since `since` ago (default 10 minutes, at most a day), most
/// first: `{"rule","id","denied","last_s"}`. Blocking.
pub fn top(
    limiter: &Limiter,
    prefix: &str,
    rule: &str,
    since: Duration,
) -> Result<Vec<Value>, LimiterError> {
    Ok(limiter
        .top_blocking(prefix, rule, since)?
        .into_iter()
        .map(|e| json!({"rule": rule, "id": e.id, "denied": e.denied, "last_s": e.last_s}))
        .collect())
}

/// How far back `top` looks: `since` as written (default 10 minutes, at
/// most a day); `name` is what the caller called it (`--since` on the
/// command line, `since` over HTTP), for the message.
pub fn top_since(name: &str, since: Option<&str>) -> Result<Duration, String> {
    let Some(text) = since else {
        return Ok(Duration::from_secs(600));
    };
    let d = floodgate::config::operator_duration(name, text)?;
    if d > floodgate::limiter::TOP_SINCE_MOST {
        return Err(format!("top looks back at most 24h, not {text}"));
    }
    Ok(d)
}

/// Seconds since the epoch `since` ago (a duration as the config writes
/// them, like `10m`); everything when `None`. `name` as for [`top_since`].
pub fn since(name: &str, text: Option<&str>) -> Result<u64, String> {
    let Some(text) = text else {
        return Ok(0);
    };
    let d: Duration = floodgate::config::operator_duration(name, text)?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |n| n.as_secs());
    Ok(now.saturating_sub(d.as_secs()))
}

/// What an action did, in words, for the audit trail (`None`: `inspect`,
/// which changes nothing and is not recorded).
pub fn audit_detail(action: &Action) -> Option<String> {
    let words = |d: Duration| floodgate::config::format_duration(d);
    Some(match *action {
        Action::Inspect => return None,
        Action::Reset | Action::Unban | Action::Clear => String::new(),
        Action::Ban(d) => format!("for {}", words(d)),
        Action::Override {
            limit,
            window,
            lasts,
        } => {
            let mut text = format!("limit {limit}");
            if let Some(w) = window {
                text.push_str(&format!(" window {}", words(w)));
            }
            match lasts {
                Some(l) => text.push_str(&format!(" for {}", words(l))),
                None => text.push_str(" until cleared"),
            }
            text
        }
    })
}

/// Writes an action on the identity whose state key is `key` to the audit
/// trail under `prefix` (blocking; logs and carries on if Redis fails:
/// the action itself is done).
pub fn record(
    limiter: &Limiter,
    prefix: &str,
    action: &Action,
    rule: &str,
    key: &str,
    by: &str,
) -> Result<(), LimiterError> {
    let Some(detail) = audit_detail(action) else {
        return Ok(());
    };
    let id = split_state_key(prefix, key).map_or(key, |(_, _, id)| id);
    let name = match action {
        Action::Clear => "clear",
        other => other.name(),
    };
    limiter.audit_blocking(prefix, &AuditEntry::now(name, rule, id, by, &detail))
}

/// Who runs a command: `cli:` and the OS user, the name the system's
/// user list gives the process's user id (`$USER` or `$LOGNAME` where the
/// list has none, then `uid:N`).
pub fn cli_user() -> String {
    let uid = process_uid();
    let named = uid.and_then(|uid| {
        let users = std::fs::read_to_string("/etc/passwd").ok()?;
        user_named(&users, uid)
    });
    let user = named
        .or_else(|| {
            ["USER", "LOGNAME"]
                .iter()
                .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()))
        })
        .or_else(|| uid.map(|uid| format!("uid:{uid}")))
        .unwrap_or_else(|| "unknown".to_string());
    format!("cli:{user}")
}

/// The user id this process runs as: the owner of its `/proc` entry.
fn process_uid() -> Option<u32> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").ok().map(|m| m.uid())
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The name `/etc/passwd`'s text `users` gives user id `uid`.
fn user_named(users: &str, uid: u32) -> Option<String> {
    let uid = uid.to_string();
    users.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let _password = fields.next()?;
        (fields.next()? == uid && !name.is_empty()).then(|| name.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::user_named;

    #[test]
    fn the_user_list_names_a_user_id() {
        let users = "root:x:0:0:root:/root:/bin/bash\n\
                     daemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n\
                     ana:x:1000:1000:Ana:/home/ana:/bin/sh\n";
        assert_eq!(user_named(users, 0).as_deref(), Some("root"));
        assert_eq!(user_named(users, 1000).as_deref(), Some("ana"));
        assert_eq!(user_named(users, 10), None);
        assert_eq!(user_named("broken\n", 0), None);
    }
}
