//! Passwords: the length rule, Argon2id hashing and verification, and the
//! bound on how many hashes run at once (memory stays bounded whatever the
//! load).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use actix_web::web;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;

use super::session::random_bytes;
use super::SiteError;

/// Shortest and longest password accepted (NIST SP 800-63B: at least 8,
/// allow long ones).
const PASSWORD_CHARS: std::ops::RangeInclusive<usize> = 8..=128;

/// A hash to verify against when there is no account, so that unknown and
/// known phones take the same time.
pub(super) fn dummy_hash() -> &'static str {
    static DUMMY: OnceLock<String> = OnceLock::new();
    DUMMY.get_or_init(|| hash_password("not a password of anyone").unwrap_or_default())
}

pub(super) fn hash_password(password: &str) -> Result<String, SiteError> {
    let salt_bytes = random_bytes::<16>().map_err(|e| SiteError::internal(e.to_string()))?;
    let salt =
        SaltString::encode_b64(&salt_bytes).map_err(|e| SiteError::internal(e.to_string()))?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| SiteError::internal(e.to_string()))
}

pub(super) fn verify_password(password: &str, phc: &str) -> bool {
    PasswordHash::new(phc).is_ok_and(|hash| {
        Argon2::default()
            .verify_password(password.as_bytes(), &hash)
            .is_ok()
    })
}

/// The password rule, as the message the form shows when it is broken.
pub(super) fn check_password(password: &str) -> Result<(), String> {
    let n = password.chars().count();
    if PASSWORD_CHARS.contains(&n) {
        Ok(())
    } else {
        Err(format!(
            "Choose a password of {} to {} characters (yours has {n}).",
            PASSWORD_CHARS.start(),
            PASSWORD_CHARS.end()
        ))
    }
}

/// Password hashes (Argon2id, 19 MiB each) that may run at once. The
/// memory they take is bounded by this, whatever the load.
pub const HASH_PERMITS: usize = 2;
/// Password checks that may wait for a permit; more get 503 at once.
pub const HASH_QUEUE: usize = 32;

/// Bounds the password hashing of the whole site: at most
/// [`HASH_PERMITS`] run at once, at most [`HASH_QUEUE`] wait, and the rest
/// are refused with 503 and `Retry-After: 1`. Counts what it does for
/// `/metrics`.
#[derive(Debug)]
pub struct Hashing {
    permits: tokio::sync::Semaphore,
    waiting: AtomicUsize,
    running: AtomicUsize,
    peak: AtomicUsize,
    refused: AtomicU64,
}

impl Default for Hashing {
    fn default() -> Hashing {
        Hashing {
            permits: tokio::sync::Semaphore::new(HASH_PERMITS),
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
        }
    }
}

/// Takes one off a counter when dropped (also when the request is dropped
/// while it waits).
struct Held<'a>(&'a AtomicUsize);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Hashing {
    /// Runs `work` (a hash or a verification) on the blocking pool once a
    /// permit is free; 503 when too many are already waiting.
    pub async fn run<T, F>(&self, work: F) -> Result<T, SiteError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= HASH_QUEUE {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(SiteError::unavailable(
                "too many password checks waiting; refused".into(),
            ));
        }
        let waiting = Held(&self.waiting);
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|e| SiteError::internal(e.to_string()))?;
        drop(waiting);
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        let _running = Held(&self.running);
        self.peak.fetch_max(now, Ordering::SeqCst);
        web::block(work)
            .await
            .map_err(|e| SiteError::internal(e.to_string()))
    }

    /// Prometheus lines: running, waiting, the most ever running at once,
    /// and how many were refused.
    pub fn render(&self) -> String {
        format!(
            "# HELP floodgate_password_hashes_running Password hashes running now.\n\
             # TYPE floodgate_password_hashes_running gauge\n\
             floodgate_password_hashes_running {}\n\
             # HELP floodgate_password_hashes_waiting Password checks waiting for a permit.\n\
             # TYPE floodgate_password_hashes_waiting gauge\n\
             floodgate_password_hashes_waiting {}\n\
             # HELP floodgate_password_hashes_peak The most password hashes ever running at once.\n\
             # TYPE floodgate_password_hashes_peak gauge\n\
             floodgate_password_hashes_peak {}\n\
             # HELP floodgate_password_hashes_refused_total Password checks refused with 503 (queue full).\n\
             # TYPE floodgate_password_hashes_refused_total counter\n\
             floodgate_password_hashes_refused_total {}\n",
            self.running.load(Ordering::SeqCst),
            self.waiting.load(Ordering::SeqCst),
            self.peak.load(Ordering::SeqCst),
            self.refused.load(Ordering::Relaxed),
        )
    }
}
