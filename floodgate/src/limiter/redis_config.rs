//! Where the limiter finds Redis, and the bounds it keeps.

use std::time::Duration;

use crate::units::{amount_of_time, min_pool_size, MAX_POOL_SIZE, MAX_REDIS_TIMEOUT};

/// Where Redis is and how the limiter talks to it (`[redis]` in the file).
#[derive(Clone)]
pub struct RedisConfig {
    /// Single-server URL.
    pub url: String,
    /// Cluster seed URLs (non-empty = cluster mode).
    pub cluster: Vec<String>,
    /// Sentinel URLs (non-empty = Sentinel mode, with `sentinel_master`).
    pub sentinel: Vec<String>,
    /// The master's name at the Sentinels (empty unless `sentinel` is set).
    pub sentinel_master: String,
    /// Pool size.
    pub pool_size: u32,
    /// Bound on connect, pool checkout and each command.
    pub timeout: Duration,
    /// First component of every key.
    pub key_prefix: String,
}

/// Why a file or a builder that names Redis Cluster seeds is refused by a
/// build without the `cluster` feature.
pub(crate) const NO_CLUSTER: &str =
    "this build of floodgate has no Redis Cluster support (feature \"cluster\")";
/// As [`NO_CLUSTER`], for Sentinels and the `sentinel` feature.
pub(crate) const NO_SENTINEL: &str =
    "this build of floodgate has no Redis Sentinel support (feature \"sentinel\")";

impl RedisConfig {
    /// What the file's checks refuse in it, as the `[redis]` key and why:
    /// the Cluster and Sentinel settings [`topology_refused`] refuses, a
    /// pool too small or too large, a timeout of 0 or above a minute, a
    /// key prefix that is empty, too long, has spaces or control
    /// characters, or starts with `!`. [`Limiter::new`](super::Limiter::new)
    /// refuses the same, so that a value built in code cannot do what a
    /// file could not.
    pub(crate) fn refused(&self) -> Option<(&'static str, String)> {
        if let Some(refused) =
            topology_refused(&self.cluster, &self.sentinel, &self.sentinel_master)
        {
            return Some(refused);
        }
        let (least, most) = (min_pool_size(), MAX_POOL_SIZE);
        if !(least..=most).contains(&self.pool_size) {
            return Some((
                "[redis] pool_size",
                format!(
                    "must be between {least} and {most}, got {} (the pool serves the site, \
                     /readyz, give-backs and /limits; with fewer, one stalled call starves the \
                     others)",
                    self.pool_size
                ),
            ));
        }
        if self.timeout.is_zero() || self.timeout > MAX_REDIS_TIMEOUT {
            return Some((
                "[redis] timeout",
                format!(
                    "must be greater than 0 and at most {}, got {:?}",
                    amount_of_time(MAX_REDIS_TIMEOUT),
                    self.timeout
                ),
            ));
        }
        let prefix = &self.key_prefix;
        if prefix.is_empty()
            || prefix.len() > 64
            || prefix.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Some((
                "[redis] key_prefix",
                format!(
                    "must be 1 to 64 bytes without spaces or control characters, got {prefix:?}"
                ),
            ));
        }
        if prefix.starts_with('!') {
            // No state key may look like an operator record ('!' + key).
            return Some((
                "[redis] key_prefix",
                format!("must not start with \"!\" (operator records do), got {prefix:?}"),
            ));
        }
        None
    }

    /// The first mode asked for that this build lacks (its Cargo feature
    /// is off): the `[redis]` key that asks, and why it is refused.
    pub(crate) fn missing_feature(&self) -> Option<(&'static str, &'static str)> {
        missing_feature(&self.cluster, &self.sentinel)
    }
}

/// What is refused in the Cluster and Sentinel settings, as the `[redis]`
/// key and why (a mode this build lacks is [`missing_feature`]'s): both
/// modes at once, Sentinels without the master's name or the reverse, a
/// master name with spaces or control characters (refused rather than
/// half used).
pub(crate) fn topology_refused(
    cluster: &[String],
    sentinel: &[String],
    master: &str,
) -> Option<(&'static str, String)> {
    if !cluster.is_empty() && !sentinel.is_empty() {
        return Some((
            "[redis] cluster",
            "cluster and sentinel cannot both be set: Redis is either a Cluster or a master watched by Sentinels".into(),
        ));
    }
    if !sentinel.is_empty() && master.is_empty() {
        return Some((
            "[redis] sentinel",
            "sentinel needs sentinel_master, the name the Sentinels monitor the master under"
                .into(),
        ));
    }
    if !master.is_empty() && sentinel.is_empty() {
        return Some((
            "[redis] sentinel_master",
            "is set but sentinel lists no Sentinel servers".into(),
        ));
    }
    if master.len() > 256 || master.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Some((
            "[redis] sentinel_master",
            format!("must be a name without spaces or control characters, got {master:?}"),
        ));
    }
    None
}

/// As [`RedisConfig::missing_feature`], from the cluster seeds and the
/// Sentinels alone (the file's check, before the rest is read).
pub(crate) fn missing_feature(
    cluster: &[String],
    sentinel: &[String],
) -> Option<(&'static str, &'static str)> {
    if !cfg!(feature = "cluster") && !cluster.is_empty() {
        return Some(("[redis] cluster", NO_CLUSTER));
    }
    if !cfg!(feature = "sentinel") && !sentinel.is_empty() {
        return Some(("[redis] sentinel", NO_SENTINEL));
    }
    None
}

impl std::fmt::Debug for RedisConfig {
    /// Passwords in URLs are shown as `***`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &without_password(&self.url))
            .field(
                "cluster",
                &self
                    .cluster
                    .iter()
                    .map(|u| without_password(u))
                    .collect::<Vec<_>>(),
            )
            .field(
                "sentinel",
                &self
                    .sentinel
                    .iter()
                    .map(|u| without_password(u))
                    .collect::<Vec<_>>(),
            )
            .field("sentinel_master", &self.sentinel_master)
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("key_prefix", &self.key_prefix)
            .finish()
    }
}

/// A Redis URL with its password replaced by `***`, for logs and `Debug`:
/// `redis://user:secret@host/0` becomes `redis://user:***@host/0`.
///
/// ```
/// use floodgate_limiter::limiter::without_password;
/// assert_eq!(without_password("redis://u:pw@h:6379/0"), "redis://u:***@h:6379/0");
/// assert_eq!(without_password("redis://h:6379/0"), "redis://h:6379/0");
/// ```
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn without_password(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}
