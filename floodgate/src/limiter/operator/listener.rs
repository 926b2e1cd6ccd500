//! The listener: one subscriber connection (a thread) per [`Limiter`]
//! that hears every operator change on the channel, forgets the changed
//! keys' remembered denials, keeps the bans the local fallback enforces,
//! and claims operator bans to count them (see the module above).
//!
//! [`Limiter`]: crate::limiter::Limiter

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::{channel, claim, Action};
use crate::limiter::local::Bans;
use crate::limiter::shared::Shared;
use crate::limiter::topology::{Link, Master, RedisConn, Source};
use crate::limiter::RedisConfig;
use crate::logging::Escaped;

/// What a listener hears of one change (see the module's docs).
#[derive(Debug, PartialEq, Eq)]
enum Heard<'m> {
    /// A key alone: forget its remembered denial.
    Key(&'m str),
    /// Banned for this long from when it is heard.
    Ban(Duration, &'m str),
    /// Its ban ended (an unban, a reset).
    Unbanned(&'m str),
    /// Its override changed: forget its remembered denial.
    Changed(&'m str),
    /// An announcement of a later version: nothing this one understands.
    Unknown,
}

/// The announcement of `action` on `key`, as [`heard`] reads it.
pub(super) fn announcement(action: Action, key: &str) -> String {
    match action {
        Action::Ban(d) => format!("!ban {} {key}", d.as_millis()),
        Action::Clear => format!("!clear {key}"),
        other => format!("!{} {key}", other.name()),
    }
}

/// Reads one message on the operator channel.
fn heard(message: &str) -> Heard<'_> {
    let Some(news) = message.strip_prefix('!') else {
        return Heard::Key(message);
    };
    let Some((what, rest)) = news.split_once(' ') else {
        return Heard::Unknown;
    };
    match what {
        "ban" => match rest.split_once(' ') {
            Some((ms, key)) => match ms.parse::<u64>() {
                Ok(ms) => Heard::Ban(Duration::from_millis(ms), key),
                Err(_) => Heard::Unknown,
            },
            None => Heard::Unknown,
        },
        "unban" | "reset" => Heard::Unbanned(rest),
        "override" | "clear" => Heard::Changed(rest),
        _ => Heard::Unknown,
    }
}

/// Starts the thread that listens for operator changes: it forgets the
/// changed keys' remembered denials in `shared`'s cache, keeps the bans it
/// hears of in `bans`, and claims operator bans to count them. It ends
/// once the limiter is dropped.
pub(in crate::limiter) fn listen(
    config: &RedisConfig,
    source: Source,
    shared: &Arc<Shared>,
    bans: &Arc<Bans>,
) {
    let listener = Listener {
        seeds: config.cluster.clone(),
        source,
        channel: channel(&config.key_prefix),
        prefix: config.key_prefix.clone(),
        timeout: config.timeout,
        shared: Arc::downgrade(shared),
        bans: Arc::clone(bans),
        commands: None,
    };
    let started = std::thread::Builder::new()
        .name("floodgate-operator".into())
        .spawn(move || listener.run());
    if let Err(e) = started {
        log::warn!("cannot start the operator listener ({e}); operator changes reach this process's denial cache only when the denials expire");
    }
}

struct Listener {
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    seeds: Vec<String>,
    source: Source,
    channel: String,
    /// `[redis] key_prefix`: state keys are PREFIX:RULE:KIND:ID.
    prefix: String,
    timeout: Duration,
    shared: Weak<Shared>,
    bans: Arc<Bans>,
    /// A connection for claims (a subscribed one sends no commands),
    /// opened when first needed.
    commands: Option<RedisConn>,
}

/// How long the listener waits for a message before it checks that the
/// limiter still exists and its server is still the one to listen to.
const LISTEN_TICK: Duration = Duration::from_millis(500);

impl Listener {
    fn run(mut self) {
        let mut seed = 0;
        let mut failing_since: Option<Instant> = None;
        loop {
            if self.shared.strong_count() == 0 {
                return;
            }
            match self.connect(&mut seed) {
                Ok((conn, master)) => {
                    failing_since = None;
                    if self.listen(conn, master.as_ref()) {
                        return;
                    }
                }
                Err(e) => {
                    if failing_since.is_none() {
                        log::debug!("operator listener: cannot connect ({e}); retrying");
                        failing_since = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    /// A connection to listen on: the server (or the master the Sentinels
    /// name); on a Cluster, a seed node (a Cluster delivers every message
    /// to every node).
    #[cfg_attr(not(feature = "cluster"), allow(unused_variables))]
    fn connect(&self, seed: &mut usize) -> redis::RedisResult<(redis::Connection, Option<Master>)> {
        #[cfg(feature = "cluster")]
        if let Source::Cluster(_) = self.source {
            let url = &self.seeds[*seed % self.seeds.len().max(1)];
            *seed += 1;
            let conn =
                redis::Client::open(url.as_str())?.get_connection_with_timeout(self.timeout)?;
            return Ok((conn, None));
        }
        match self.source.open(self.timeout, self.timeout)? {
            (RedisConn(Link::Single(conn)), master) => Ok((conn, master)),
            #[cfg(feature = "cluster")]
            (RedisConn(Link::Cluster(_)), _) => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "a cluster connection cannot subscribe",
            ))),
        }
    }

    /// Claims the operator ban on `key` for this process's count, on the
    /// listener's own command connection (opened again after an error).
    fn claim(&mut self, key: &str) {
        if self.commands.is_none() {
            match self.source.open(self.timeout, self.timeout) {
                Ok((conn, _)) => self.commands = Some(conn),
                Err(e) => {
                    log::debug!("operator listener: cannot connect to claim a ban ({e})");
                    return;
                }
            }
        }
        let Some(conn) = self.commands.as_mut() else {
            return;
        };
        if let Err(e) = claim(conn, &self.bans, &self.prefix, key) {
            log::debug!(
                "operator listener: could not claim the ban of {} ({e})",
                Escaped(key)
            );
            self.commands = None;
        }
    }

    /// Acts on one message: the denial cache forgets, the bans learn or
    /// forget, a ban is claimed.
    fn hear(&mut self, shared: &Shared, message: &str) {
        let forget = |key: &str| {
            if let Some(cache) = &shared.deny_cache {
                cache.forget(key);
            }
        };
        match heard(message) {
            Heard::Key(key) | Heard::Changed(key) => forget(key),
            Heard::Ban(wait, key) => {
                forget(key);
                let now = Instant::now();
                self.bans.learn(key, wait, now, now);
                if self.bans.counting() {
                    self.claim(key);
                }
            }
            Heard::Unbanned(key) => {
                forget(key);
                self.bans.forget(key);
            }
            Heard::Unknown => {}
        }
    }

    /// Listens until the connection fails (false) or the limiter is gone (true).
    fn listen(&mut self, mut conn: redis::Connection, master: Option<&Master>) -> bool {
        let mut pubsub = conn.as_pubsub();
        if pubsub.subscribe(&self.channel).is_err()
            || pubsub.set_read_timeout(Some(LISTEN_TICK)).is_err()
        {
            return false;
        }
        // Messages may have been missed while no connection listened.
        match self.shared.upgrade() {
            Some(shared) => {
                if let Some(cache) = &shared.deny_cache {
                    cache.clear();
                }
                self.bans.clear();
            }
            None => return true,
        }
        loop {
            let message = pubsub.get_message();
            let Some(shared) = self.shared.upgrade() else {
                return true;
            };
            match message {
                Ok(msg) => {
                    if let Ok(text) = std::str::from_utf8(msg.get_payload_bytes()) {
                        self.hear(&shared, text);
                    }
                }
                Err(e) if e.is_timeout() => {
                    if !self.source.still_named(master) {
                        // A failover: listen to the new master.
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_read_back_as_they_were_written() {
        let key = "fg:check:ip:203.0.113.7";
        let ban = Action::Ban(Duration::from_secs(90));
        assert_eq!(
            heard(&announcement(ban, key)),
            Heard::Ban(Duration::from_secs(90), key)
        );
        for action in [Action::Unban, Action::Reset] {
            assert_eq!(heard(&announcement(action, key)), Heard::Unbanned(key));
        }
        let over = Action::Override {
            limit: 5,
            window: None,
            lasts: None,
        };
        for action in [over, Action::Clear] {
            assert_eq!(heard(&announcement(action, key)), Heard::Changed(key));
        }
        // What the previous version publishes: the key alone.
        assert_eq!(heard(key), Heard::Key(key));
        // A later version's news, or a garbled ban: nothing.
        assert_eq!(heard("!pause 10 k"), Heard::Unknown);
        assert_eq!(heard("!ban soon k"), Heard::Unknown);
        assert_eq!(heard("!ban"), Heard::Unknown);
        // A key with spaces (a header value) stays whole.
        assert_eq!(
            heard("!ban 5 fg:h:header:a b"),
            Heard::Ban(Duration::from_millis(5), "fg:h:header:a b")
        );
    }
}
