//! Sentinel mode: the master the Sentinels name, asked by one watcher
//! thread, and connections checked against its answer (the `sentinel`
//! feature).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{
    ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo, RedisResult, Role,
};

use super::Master;
use crate::limiter::RedisConfig;

impl Master {
    /// The master a client connects to (a TCP address; `None` for a socket).
    fn of(addr: &ConnectionAddr) -> Option<Master> {
        match addr {
            ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
                Some(Master {
                    host: host.clone(),
                    port: *port,
                })
            }
            _ => None,
        }
    }
}

/// How long the master the Sentinels named is taken as theirs before one
/// of them is asked again. A switchover (the old master still up, and still
/// a master until the Sentinels demote it) moves the writes to the new
/// master this long after the Sentinels name it, at most.
const ASK_EVERY: Duration = Duration::from_millis(250);

/// After no Sentinel answered, the next question waits twice as long as
/// the last, up to this: Sentinels that do not answer at all cost a wait of
/// the timeout on one call now and then, not on every fourth of a second.
const ASK_AT_MOST_EVERY: Duration = Duration::from_secs(4);

/// The Sentinels of one master name, and what they last said.
///
/// Each connection remembers the master it was opened to. Before one is
/// used, [`Sentinels::names`] compares that with the master the Sentinels
/// named when last asked. One watcher thread asks a Sentinel every
/// [`ASK_EVERY`] (`SENTINEL GET-MASTER-ADDR-BY-NAME`, on a connection it
/// keeps, bounded by the timeout, the next Sentinel on error), so no call
/// waits behind the question, even when a Sentinel holds it until the
/// timeout. When no Sentinel answers, the last answer stands: Sentinels
/// that are down do not stop a master that works.
pub(crate) struct Sentinels {
    /// Each Sentinel, as configured.
    nodes: Vec<ConnectionInfo>,
    /// The name the Sentinels know the master by.
    name: String,
    /// The master's database, user and password.
    settings: RedisConnectionInfo,
    /// Bounds connecting to a Sentinel and each question.
    timeout: Duration,
    /// What the Sentinels said last.
    named: Mutex<Named>,
    /// The one thread asking, and its connection to a Sentinel.
    asker: Mutex<Asker>,
    /// Finds the master before any Sentinel has answered our own question.
    client: Mutex<SentinelClient>,
}

/// The master the Sentinels named, and how long that answer stands.
struct Named {
    master: Option<Master>,
    /// How long that answer stands.
    stands: Duration,
}

/// A kept connection to one Sentinel (its index in `nodes`), and how many
/// questions in a row no Sentinel answered.
struct Asker {
    conn: Option<(usize, redis::Connection)>,
    failures: u32,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl Sentinels {
    pub(super) fn from_config(config: &RedisConfig) -> RedisResult<Sentinels> {
        // The master's database, user and password come from `url`.
        let settings = redis::IntoConnectionInfo::into_connection_info(config.url.as_str())
            .map(|info| info.redis_settings().clone())
            .unwrap_or_default();
        let node = redis::sentinel::SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(settings.clone());
        let client = SentinelClient::build(
            config.sentinel.iter().map(String::as_str).collect(),
            config.sentinel_master.clone(),
            Some(node),
            SentinelServerType::Master,
        )?;
        let nodes = config
            .sentinel
            .iter()
            .map(|url| {
                let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())?;
                // A Sentinel has no databases to select.
                let settings = info.redis_settings().clone().set_db(0);
                Ok(info.set_redis_settings(settings))
            })
            .collect::<RedisResult<Vec<_>>>()?;
        Ok(Sentinels {
            nodes,
            name: config.sentinel_master.clone(),
            settings,
            timeout: config.timeout,
            named: Mutex::new(Named {
                master: None,
                stands: ASK_EVERY,
            }),
            asker: Mutex::new(Asker {
                conn: None,
                failures: 0,
            }),
            client: Mutex::new(client),
        })
    }

    /// Whether `master` is the master the Sentinels name (or they have not
    /// named any yet). Cheap: a lock and a comparison; the question itself
    /// is asked by the watcher thread (see [`Sentinels::watch`]).
    pub(crate) fn names(&self, master: &Master) -> bool {
        lock(&self.named)
            .master
            .as_ref()
            .is_none_or(|named| named == master)
    }

    /// The master the Sentinels named when last asked.
    fn named(&self) -> Option<Master> {
        lock(&self.named).master.clone()
    }

    /// Starts the one thread that asks the Sentinels, every [`ASK_EVERY`]
    /// while they answer and less often while they do not. No connection
    /// checkout and no decision ever waits for a Sentinel: a Sentinel that
    /// holds the question until the timeout costs this thread alone. The
    /// thread ends once the last user of `sentinels` is gone.
    pub(super) fn watch(sentinels: &Arc<Sentinels>) -> RedisResult<()> {
        let watched = Arc::downgrade(sentinels);
        std::thread::Builder::new()
            .name("floodgate-sentinels".into())
            .spawn(move || loop {
                let Some(sentinels) = watched.upgrade() else {
                    return;
                };
                let next = sentinels.ask_now();
                drop(sentinels);
                std::thread::sleep(next);
            })?;
        Ok(())
    }

    /// Asks a Sentinel which server is the master, keeps the answer (or
    /// the last one, when none answers) and returns how long it stands.
    fn ask_now(&self) -> Duration {
        let mut asker = lock(&self.asker);
        let answer = self.ask(&mut asker);
        let mut named = lock(&self.named);
        match answer {
            Ok(master) => {
                if named.master.as_ref() != Some(&master) {
                    log::info!(
                        "the Sentinels name {master} as the master of \"{}\"",
                        self.name
                    );
                }
                named.master = Some(master);
                named.stands = ASK_EVERY;
                asker.failures = 0;
            }
            Err(e) => {
                if asker.failures == 0 {
                    log::warn!(
                        "no Sentinel says which server is the master of \"{}\" ({e}); \
                         connections stay with the last one named",
                        self.name
                    );
                }
                asker.failures = asker.failures.saturating_add(1);
                named.stands = ASK_EVERY
                    .saturating_mul(1 << asker.failures.min(8))
                    .min(ASK_AT_MOST_EVERY);
            }
        }
        named.stands
    }

    /// Asks the Sentinels in turn, starting with the one that answered
    /// last, which server is the master now.
    fn ask(&self, asker: &mut Asker) -> RedisResult<Master> {
        let first = asker.conn.as_ref().map_or(0, |(at, _)| *at);
        let mut last = None;
        for i in 0..self.nodes.len() {
            let at = (first + i) % self.nodes.len();
            match self.ask_one(asker, at) {
                Ok(master) => return Ok(master),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            redis::RedisError::from((redis::ErrorKind::EmptySentinelList, "no Sentinel"))
        }))
    }

    /// Asks Sentinel `at`, on the kept connection when it goes there (a
    /// kept connection found broken is opened again once), else on a new one.
    fn ask_one(&self, asker: &mut Asker, at: usize) -> RedisResult<Master> {
        if let Some((kept_at, conn)) = asker.conn.as_mut() {
            if *kept_at == at {
                match self.question(conn) {
                    Ok(master) => return Ok(master),
                    Err(e) => {
                        asker.conn = None;
                        // A Sentinel that does not answer in time would not
                        // answer a new connection sooner.
                        if e.is_timeout()
                            || e.kind() == redis::ErrorKind::MasterNameNotFoundBySentinel
                        {
                            return Err(e);
                        }
                    }
                }
            }
        }
        asker.conn = None;
        let node = self.nodes.get(at).ok_or_else(|| {
            redis::RedisError::from((redis::ErrorKind::EmptySentinelList, "no such Sentinel"))
        })?;
        let mut conn =
            redis::Client::open(node.clone())?.get_connection_with_timeout(self.timeout)?;
        conn.set_read_timeout(Some(self.timeout))?;
        conn.set_write_timeout(Some(self.timeout))?;
        let master = self.question(&mut conn)?;
        asker.conn = Some((at, conn));
        Ok(master)
    }

    fn question(&self, conn: &mut redis::Connection) -> RedisResult<Master> {
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.name)
            .query(conn)?;
        match addr {
            Some((host, port)) => Ok(Master { host, port }),
            None => Err(redis::RedisError::from((
                redis::ErrorKind::MasterNameNotFoundBySentinel,
                "the Sentinel knows no master by the name",
                self.name.clone(),
            ))),
        }
    }

    /// A connection, open within `within`, to the master the Sentinels
    /// name, confirmed by its own `ROLE`. Before any Sentinel has answered
    /// our own question, the Sentinel client finds the master.
    pub(super) fn open(
        &self,
        within: Duration,
    ) -> RedisResult<(redis::Connection, Option<Master>)> {
        if let Some(master) = self.named() {
            let info = ConnectionAddr::Tcp(master.host.clone(), master.port)
                .into_connection_info()?
                .set_redis_settings(self.settings.clone());
            let mut conn = redis::Client::open(info)?.get_connection_with_timeout(within)?;
            conn.set_read_timeout(Some(self.timeout))?;
            conn.set_write_timeout(Some(self.timeout))?;
            return match redis::cmd("ROLE").query::<Role>(&mut conn)? {
                Role::Primary { .. } => Ok((conn, Some(master))),
                _ => Err(redis::RedisError::from((
                    redis::ErrorKind::MasterNameNotFoundBySentinel,
                    "the server the Sentinels name is not a master (yet)",
                    master.to_string(),
                ))),
            };
        }
        // Which server is master now, confirmed by its own ROLE.
        let client = lock(&self.client).get_client()?;
        let master = Master::of(client.get_connection_info().addr());
        Ok((client.get_connection_with_timeout(within)?, master))
    }
}
