//! `floodgate rls`: Envoy's rate-limit service (gRPC
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`) over the
//! library's [`floodgate::limiter::Limiter`], reading envoyproxy/ratelimit's YAML
//! descriptor files. Beside the gRPC listener (with `grpc.health.v1`), an
//! HTTP listener answers `/healthz`, `/readyz`, `/metrics` and the admin API.
//! SIGHUP, or a change to the descriptor files, reloads them; SIGTERM stops
//! accepting and finishes the calls in flight.

pub mod config;
pub mod descriptors;
pub mod http;
pub mod matcher;
pub mod operator;
pub mod proto;
pub mod service;
mod workers;

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use floodgate::limiter::Limiter;
use floodgate::limiter::{Dispatch, LimiterOptions};
use floodgate::metrics::Metrics;

pub use self::config::{is_rls_file, RlsConfig};
use self::matcher::Matcher;
use self::service::{CallCounts, Rls};
use crate::config::cannot_listen;

/// How often the descriptor files are looked at for changes.
const WATCH_EVERY: Duration = Duration::from_millis(500);

/// How often Redis's health is asked for the gRPC health service.
const HEALTH_EVERY: Duration = Duration::from_secs(1);

/// Why the service could not start or stopped badly.
#[derive(Debug)]
pub enum ServeError {
    /// The file or the descriptor files cannot be used (exit 2).
    Config(floodgate::config::ConfigError),
    /// Anything else (exit 1).
    Other(String),
}

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServeError::Config(e) => write!(f, "{e}"),
            ServeError::Other(e) => f.write_str(e),
        }
    }
}

/// Loads the configuration at `path` and its descriptor files.
pub fn load(path: &Path) -> Result<(RlsConfig, Matcher), floodgate::config::ConfigError> {
    let config = RlsConfig::load(path)?;
    let matcher = descriptors::load(&config.rls.descriptors, &config.rls.algorithm)?;
    Ok((config, matcher))
}

/// What `check-config` warns of in a configuration `load` read: the
/// entries of the descriptor folder not read, and an empty set.
pub fn warnings(config: &RlsConfig, matcher: &Matcher) -> Vec<String> {
    descriptors::warnings(&config.rls.descriptors, matcher)
}

/// Each descriptor file's path, length, modification time, inode (a file
/// replaced by a rename is a new inode) and a hash of its contents (a file
/// rewritten in place at its old length, within the clock's granularity or
/// with its time put back, as `cp -p` and `rsync -t --inplace` do).
type Signature = Vec<(PathBuf, u64, Option<SystemTime>, u64, u64)>;

/// A hash of the file's contents (0 when it cannot be read).
fn contents_hash(path: &Path) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::fs::read(path).unwrap_or_default().hash(&mut h);
    h.finish()
}

/// The inode of a file (0 where there is none).
fn inode(meta: &std::fs::Metadata) -> u64 {
    #[cfg(unix)]
    {
        std::os::unix::fs::MetadataExt::ino(meta)
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        0
    }
}

/// What the descriptor files look like on disk now (a change to any part
/// of it is a reload).
fn signature(path: &Path) -> Signature {
    descriptors::files_of(path)
        .unwrap_or_default()
        .into_iter()
        .map(|f| {
            let meta = std::fs::metadata(&f).ok();
            let len = meta.as_ref().map_or(0, std::fs::Metadata::len);
            let ino = meta.as_ref().map_or(0, inode);
            let modified = meta.and_then(|m| m.modified().ok());
            let hash = contents_hash(&f);
            (f, len, modified, ino, hash)
        })
        .collect()
}

/// Reloads the descriptor files into `rls`; a set that fails to load
/// leaves the old one in force, logged with the reason.
fn reload(rls: &Rls, why: &str) {
    match descriptors::load(&rls.settings.descriptors, &rls.settings.algorithm) {
        Ok(m) => {
            let n = m.limits().len();
            match rls.matcher.write() {
                Ok(mut g) => *g = Arc::new(m),
                Err(p) => *p.into_inner() = Arc::new(m),
            }
            rls.limiter.forget_keys();
            log::info!("rls: descriptors reloaded ({why}): {n} limits");
            warn_of(&rls.settings.descriptors, &rls.matcher());
        }
        Err(e) => log::error!("rls: descriptors not reloaded ({why}), the old ones stay: {e}"),
    }
}

/// Logs what in the descriptor folder was not read, and an empty set.
fn warn_of(path: &Path, matcher: &Matcher) {
    for w in descriptors::warnings(path, matcher) {
        log::warn!("rls: {w}");
    }
}

/// Serves until SIGTERM or Ctrl-C.
pub fn serve(path: &Path) -> Result<(), ServeError> {
    let config = RlsConfig::load(path).map_err(ServeError::Config)?;
    // Taken before the files are read: a change made while they are read,
    // or before the watcher starts, is a change it sees.
    let seen = signature(&config.rls.descriptors);
    let matcher = descriptors::load(&config.rls.descriptors, &config.rls.algorithm)
        .map_err(ServeError::Config)?;
    let options = LimiterOptions {
        deny_cache: config.filter.limiter.deny_cache,
        breaker: config.filter.limiter.breaker,
        // Each runtime thread batches its tick's calls on a connection
        // of its own, as the site's workers do (a stalled Redis hands the
        // call to the lane's helper thread).
        dispatch: Dispatch::Worker,
    };
    let limiter = Arc::new(
        Limiter::new(&config.filter.redis, options)
            .map_err(|e| ServeError::Other(format!("redis: {e}")))?,
    );
    let metrics = Arc::new(Metrics::default());
    metrics.watch(&limiter);
    warn_of(&config.rls.descriptors, &matcher);
    let limits = matcher.limits().len();
    let domains = matcher.domains().len();
    let rls = Arc::new(Rls {
        limiter,
        metrics,
        calls: CallCounts::default(),
        matcher: RwLock::new(Arc::new(matcher)),
        settings: config.rls.clone(),
        prefix: config.filter.redis.key_prefix.clone(),
    });
    // This runtime accepts the gRPC connections and runs the watchers; the
    // calls are served on threads of their own (`workers.rs`).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("floodgate-rls")
        .build()
        .map_err(|e| ServeError::Other(format!("cannot start the runtime: {e}")))?;
    let target = crate::config::redis_target(&config.filter.redis);
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&config.rls.bind)
            .await
            .map_err(|e| {
                ServeError::Config(cannot_listen(path, "[rls] bind", &config.rls.bind, &e))
            })?;
        let local = listener
            .local_addr()
            .map_err(|e| ServeError::Other(e.to_string()))?;
        let http = http::start(Arc::clone(&rls), &config)
            .map_err(|e| {
                ServeError::Config(cannot_listen(path, "[rls] http_bind", &config.rls.http_bind, &e))
            })?;
        log::info!(
            "floodgate rls serving {} on {} (port {}), http on {} (port {}), redis {target}, {domains} domains, {limits} limits",
            path.display(),
            config.rls.bind,
            local.port(),
            config.rls.http_bind,
            http.port
        );
        let (reporter, health) = tonic_health::server::health_reporter();
        tokio::spawn(watch_health(Arc::clone(&rls), reporter));
        tokio::spawn(watch_files(Arc::clone(&rls), seen));
        tokio::spawn(reload_on_sighup(Arc::clone(&rls)));
        // A stop waits for the calls in flight, which end within the Redis
        // timeout.
        let grace = config.filter.redis.timeout + Duration::from_secs(1);
        let result = workers::serve(listener, &rls, health, grace, stop_signal()).await;
        http.stop().await;
        result
    })
}

/// Resolves on SIGTERM or Ctrl-C.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Reloads the descriptor files on each SIGHUP.
async fn reload_on_sighup(rls: Arc<Rls>) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            log::warn!("rls: cannot listen for SIGHUP; file changes still reload");
            return;
        };
        while hup.recv().await.is_some() {
            let rls = Arc::clone(&rls);
            let _ = tokio::task::spawn_blocking(move || reload(&rls, "SIGHUP")).await;
        }
    }
    #[cfg(not(unix))]
    drop(rls);
}

/// Reloads the descriptor files when they change on disk.
async fn watch_files(rls: Arc<Rls>, mut seen: Signature) {
    let path = rls.settings.descriptors.clone();
    loop {
        tokio::time::sleep(WATCH_EVERY).await;
        let p = path.clone();
        let now = match tokio::task::spawn_blocking(move || signature(&p)).await {
            Ok(s) => s,
            Err(_) => continue,
        };
        if now != seen {
            seen = now;
            let rls = Arc::clone(&rls);
            let _ = tokio::task::spawn_blocking(move || reload(&rls, "the files changed")).await;
        }
    }
}

/// Keeps `grpc.health.v1` in step with Redis: `SERVING` while it answers.
async fn watch_health(rls: Arc<Rls>, reporter: tonic_health::server::HealthReporter) {
    let mut last = None;
    loop {
        let ready = rls.limiter.ready().await.is_ok();
        if last != Some(ready) {
            let status = if ready {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            reporter.set_service_status("", status).await;
            reporter.set_service_status(proto::SERVICE, status).await;
            last = Some(ready);
        }
        tokio::time::sleep(HEALTH_EVERY).await;
    }
}
