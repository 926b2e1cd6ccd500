//! Where the limiter finds Redis, and the bounds it keeps.

use std::time::Duration;

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
    /// The first mode asked for that this build lacks (its Cargo feature
    /// is off): the `[redis]` key that asks, and why it is refused.
    pub(crate) fn missing_feature(&self) -> Option<(&'static str, &'static str)> {
        missing_feature(&self.cluster, &self.sentinel)
    }
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
