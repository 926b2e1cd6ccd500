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
/// use floodgate::limit::without_password;
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
