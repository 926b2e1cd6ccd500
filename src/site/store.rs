//! The site's data in Redis: accounts, SMS codes and sessions. Every
//! function here blocks on Redis: call them inside `web::block`.
//!
//! Keys live under `PREFIX:@site:` (`@` cannot start a rule name, so they
//! never meet the limiter's `PREFIX:RULE:KIND:ID`); on a Redis Cluster under
//! `PREFIX:{@site}:`, one hash tag, so that every key a pipeline or
//! transaction here touches is in one slot:
//! - `account:+DIGITS`         hash {id, phone (E.164), password (Argon2id PHC), created}
//! - `code:PURPOSE:+DIGITS`    hash {mac, owner (keyed hash of the asking
//!   session), own, others (wrong tries of that session, of all others)},
//!   5-minute TTL
//! - `session:SID`             hash {account, phone}, 7-day TTL
//! - `sessions-of:ID`          sorted set of the account's SIDs by sign-in
//!   time (at most `MAX_SESSIONS`; a session not in it is signed out)
//! - `outbox`                  list of JSON messages (see `sms`)

use redis::{Commands, RedisResult};

use super::phone::Phone;
use super::session::{hex, random_bytes, same, Secret, SESSION_TTL_SECS};
use floodgate::limiter::RedisConn;

/// How long a code is valid.
pub const CODE_TTL_SECS: u64 = 300;
/// Wrong attempts at a code from the session that asked for it, after
/// which the code is gone; every other session together has as many more,
/// after which the code refuses them (and stays good for its own session).
pub const MAX_ATTEMPTS: i64 = 5;
/// Signed-in sessions one account keeps; a new sign-in beyond them signs
/// the oldest out.
pub const MAX_SESSIONS: usize = 10;

/// What a code is for; sign-in and reset codes are separate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Signing in.
    SignIn,
    /// Resetting the password.
    Reset,
}

impl Purpose {
    fn name(self) -> &'static str {
        match self {
            Purpose::SignIn => "signin",
            Purpose::Reset => "reset",
        }
    }
}

/// An account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// Random ID (what sessions and the `session` key kind name).
    pub id: String,
    /// The phone in E.164 (`+DIGITS`).
    pub phone: String,
    /// Argon2id PHC string, if a password was set.
    pub password: Option<String>,
}

/// The result of checking a code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeCheck {
    /// Right; the code is now used up.
    Valid,
    /// Wrong; this many attempts are left (0: the code is gone).
    Wrong(i64),
    /// No code: never sent, expired, used, or too many wrong attempts.
    Missing,
}

/// Takes one attempt at a code: counts it against the asking session's
/// tries (`own`) when the session is the one the code was sent for, else
/// against the tries every other session shares (`others`), and returns the
/// stored MAC, the attempt number and whether the asker is the owner; nil
/// when there is no code, or when the asker's side has used up its tries.
/// Counting and refusing happen in one atomic step, so that however many
/// guesses arrive at once, at most `ARGV[1]` per side are ever compared
/// with the code. The owner's last wrong try deletes the code (the
/// handler does that); the strangers' never do.
const TAKE_ATTEMPT: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then return nil end
local mine = redis.call('HGET', KEYS[1], 'owner') == ARGV[2]
local field = mine and 'own' or 'others'
local n = redis.call('HINCRBY', KEYS[1], field, 1)
if n > tonumber(ARGV[1]) then
  if mine then redis.call('DEL', KEYS[1]) end
  return nil
end
return { redis.call('HGET', KEYS[1], 'mac'), n, mine and 1 or 0 }
";

/// Redis access for the site.
#[derive(Clone)]
pub struct Store {
    base: String,
    secret: Secret,
}

impl Store {
    /// Keys under `PREFIX:@site:`, codes keyed under `secret`.
    pub fn new(prefix: &str, secret: Secret) -> Store {
        Store {
            base: format!("{prefix}:@site:"),
            secret,
        }
    }

    /// On a Redis Cluster (`yes`): every key under one hash tag, as the
    /// site's pipelines and transactions need their keys in one slot.
    pub fn clustered(mut self, yes: bool) -> Store {
        if yes {
            if let Some(prefix) = self.base.strip_suffix(":@site:") {
                self.base = format!("{prefix}:{{@site}}:");
            }
        }
        self
    }

    /// The outbox list's key.
    pub fn outbox_key(&self) -> String {
        format!("{}outbox", self.base)
    }

    fn account_key(&self, phone: &Phone) -> String {
        format!("{}account:{}", self.base, phone.e164())
    }

    /// The account of a phone, if there is one.
    pub fn account(&self, conn: &mut RedisConn, phone: &Phone) -> RedisResult<Option<Account>> {
        let (id, password): (Option<String>, Option<String>) = redis::cmd("HMGET")
            .arg(self.account_key(phone))
            .arg("id")
            .arg("password")
            .query(conn)?;
        Ok(id.map(|id| Account {
            id,
            phone: phone.e164().to_string(),
            password: password.filter(|p| !p.is_empty()),
        }))
    }

    /// The ID a `session` rule keys the account `value` names by, as an
    /// operator names an account: its phone number (in any spelling the
    /// sign-in form takes, read in `region`), or its ID (32 hex digits, in
    /// either case). An address names none: a visitor nobody signed in as
    /// is counted by address, not as an account. `Ok(Err(why))`: the value
    /// names no account.
    pub fn session_id(
        &self,
        conn: &mut RedisConn,
        value: &str,
        region: floodgate::rule::Region,
    ) -> RedisResult<Result<String, String>> {
        let value = value.trim();
        if value.len() == 32 && value.bytes().all(|b| b.is_ascii_hexdigit()) {
            // (IDs are written in lowercase.)
            return Ok(Ok(value.to_ascii_lowercase()));
        }
        if value.parse::<std::net::IpAddr>().is_ok() {
            return Ok(Err(format!(
                "{value:?} is an address: a session rule's identities are accounts (a visitor \
                 nobody signed in as is counted by address, under the rule's ip identities)"
            )));
        }
        let Some(phone) = Phone::parse(value, region) else {
            return Ok(Err(format!(
                "{value:?} names no account: give its phone number or its ID"
            )));
        };
        Ok(match self.account(conn, &phone)? {
            Some(account) => Ok(account.id),
            None => Err(format!("no account has the phone number {}", phone.e164())),
        })
    }

    /// The account of a phone, created on first sign-in.
    pub fn find_or_create(&self, conn: &mut RedisConn, phone: &Phone) -> RedisResult<Account> {
        let key = self.account_key(phone);
        let id = hex(&random_bytes::<16>().map_err(io_error)?);
        // HSETNX: two first sign-ins at once still make one account.
        let _: bool = conn.hset_nx(&key, "id", &id)?;
        let _: bool = conn.hset_nx(&key, "phone", phone.e164())?;
        let _: bool = conn.hset_nx(&key, "created", super::sms::now_rfc3339())?;
        match self.account(conn, phone)? {
            Some(a) => Ok(a),
            None => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "account vanished after creation",
            ))),
        }
    }

    /// Stores a new password hash.
    pub fn set_password(&self, conn: &mut RedisConn, phone: &Phone, phc: &str) -> RedisResult<()> {
        conn.hset(self.account_key(phone), "password", phc)
    }

    fn code_key(&self, purpose: Purpose, phone: &Phone) -> String {
        format!("{}code:{}:{}", self.base, purpose.name(), phone.e164())
    }

    fn code_mac(&self, purpose: Purpose, phone: &Phone, code: &str) -> String {
        self.secret
            .mac_hex("sms-code", &[purpose.name(), phone.e164(), code])
    }

    /// Who asked for a code, as stored with it: a keyed hash of the session
    /// ID (the ID itself signs that session in, so it is not written here).
    fn code_owner(&self, sid: &str) -> String {
        self.secret.mac_hex("sms-code-owner", &[sid])
    }

    /// A new 6-digit code from the CSPRNG for the session `sid`, replacing
    /// any earlier one. Only its keyed hash is stored; the code itself is
    /// returned to be sent.
    pub fn issue_code(
        &self,
        conn: &mut RedisConn,
        purpose: Purpose,
        phone: &Phone,
        sid: &str,
    ) -> RedisResult<String> {
        let code = random_code().map_err(io_error)?;
        let key = self.code_key(purpose, phone);
        redis::pipe()
            .atomic()
            .del(&key)
            .hset(&key, "mac", self.code_mac(purpose, phone, &code))
            .hset(&key, "owner", self.code_owner(sid))
            .hset(&key, "own", 0)
            .hset(&key, "others", 0)
            .expire(&key, CODE_TTL_SECS as i64)
            .exec(conn)?;
        Ok(code)
    }

    /// Checks a code sent from session `sid`: single use, constant-time
    /// comparison. The session the code was sent for has
    /// [`MAX_ATTEMPTS`] tries, after which the code is gone; every other
    /// session together has as many more, after which the code refuses
    /// them, right or wrong, and stays good for its own session.
    pub fn check_code(
        &self,
        conn: &mut RedisConn,
        purpose: Purpose,
        phone: &Phone,
        code: &str,
        sid: &str,
    ) -> RedisResult<CodeCheck> {
        let key = self.code_key(purpose, phone);
        let taken: Option<(String, i64, i64)> = redis::Script::new(TAKE_ATTEMPT)
            .key(&key)
            .arg(MAX_ATTEMPTS)
            .arg(self.code_owner(sid))
            .invoke(conn)?;
        let Some((stored, attempt, mine)) = taken else {
            return Ok(CodeCheck::Missing);
        };
        let code = code.trim();
        if code.len() == 6 && same(&stored, &self.code_mac(purpose, phone, code)) {
            // DEL decides between two simultaneous right answers.
            let deleted: i64 = conn.del(&key)?;
            return Ok(if deleted == 1 {
                CodeCheck::Valid
            } else {
                CodeCheck::Missing
            });
        }
        let left = (MAX_ATTEMPTS - attempt).max(0);
        if left == 0 && mine == 1 {
            let _: i64 = conn.del(&key)?;
        }
        Ok(CodeCheck::Wrong(left))
    }

    fn session_key(&self, sid: &str) -> String {
        format!("{}session:{sid}", self.base)
    }

    fn account_sessions_key(&self, account_id: &str) -> String {
        format!("{}sessions-of:{account_id}", self.base)
    }

    /// Records a signed-in session. The account keeps at most
    /// [`MAX_SESSIONS`]: the oldest beyond them are signed out, in the
    /// same step, so that repeated sign-ins cannot grow Redis without
    /// bound.
    pub fn start_session(
        &self,
        conn: &mut RedisConn,
        sid: &str,
        account: &Account,
    ) -> RedisResult<()> {
        let key = self.session_key(sid);
        let set = self.account_sessions_key(&account.id);
        let evicted: Vec<String> = redis::Script::new(ADD_SESSION)
            .key(&set)
            .arg(sid)
            .arg(SESSION_TTL_SECS)
            .arg(MAX_SESSIONS)
            .invoke(conn)?;
        // A session counts only while its ID is in the account's set
        // (`session_phone`), so the evicted ones are signed out already;
        // their hashes go now rather than at their TTL.
        let mut pipe = redis::pipe();
        pipe.atomic()
            .hset(&key, "account", &account.id)
            .hset(&key, "phone", &account.phone)
            .expire(&key, SESSION_TTL_SECS as i64);
        for old in &evicted {
            pipe.del(self.session_key(old));
        }
        pipe.exec(conn)
    }

    /// The phone of a live session of `account_id`, if the session is live:
    /// its hash names the account, and the account still lists it.
    pub fn session_phone(
        &self,
        conn: &mut RedisConn,
        sid: &str,
        account_id: &str,
    ) -> RedisResult<Option<String>> {
        let ((account, phone), listed): ((Option<String>, Option<String>), Option<f64>) =
            redis::pipe()
                .cmd("HMGET")
                .arg(self.session_key(sid))
                .arg("account")
                .arg("phone")
                .zscore(self.account_sessions_key(account_id), sid)
                .query(conn)?;
        Ok(match (account, phone, listed) {
            (Some(a), Some(p), Some(_)) if a == account_id => Some(p),
            _ => None,
        })
    }

    /// Ends one session.
    pub fn end_session(
        &self,
        conn: &mut RedisConn,
        sid: &str,
        account_id: &str,
    ) -> RedisResult<()> {
        redis::pipe()
            .del(self.session_key(sid))
            .zrem(self.account_sessions_key(account_id), sid)
            .exec(conn)
    }

    /// Ends every session of an account except `keep`; returns how many ended.
    pub fn end_sessions(
        &self,
        conn: &mut RedisConn,
        account_id: &str,
        keep: Option<&str>,
    ) -> RedisResult<usize> {
        let set = self.account_sessions_key(account_id);
        let sids: Vec<String> = conn.zrange(&set, 0, -1)?;
        let mut ended = 0;
        for sid in sids.iter().filter(|s| Some(s.as_str()) != keep) {
            let _: () = self.end_session(conn, sid, account_id)?;
            ended += 1;
        }
        Ok(ended)
    }
}

/// Adds session `ARGV[1]` to an account's sessions (a sorted set scored by
/// sign-in time on Redis's clock, in microseconds), forgets those older
/// than the session lifetime `ARGV[2]` (seconds), and removes the oldest
/// beyond `ARGV[3]`; returns the IDs removed for being too many.
const ADD_SESSION: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl * 1000000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('EXPIRE', KEYS[1], ttl)
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[3])
if over <= 0 then return {} end
local evicted = redis.call('ZRANGE', KEYS[1], 0, over - 1)
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1)
return evicted
";

/// Six uniform random digits.
fn random_code() -> Result<String, getrandom::Error> {
    loop {
        let n = u32::from_le_bytes(random_bytes::<4>()?);
        // Reject the top sliver so that every code is equally likely.
        if n < 4_294_000_000 {
            return Ok(format!("{:06}", n % 1_000_000));
        }
    }
}

/// The OS gave no randomness. Not an I/O error on the Redis connection, so
/// that the connection, which is fine, goes back to the pool.
fn io_error(e: getrandom::Error) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Client,
        "no randomness from the OS",
        e.to_string(),
    ))
}

/// Where the `session` value is among the `values` values of an operator's
/// action under the rule `rule`, which [`Store::session_id`] then reads:
/// none when the rule has no `session` kind (or is unknown, or the values
/// are not one per kind: the action refuses those itself).
pub fn session_position(
    rules: &[floodgate::rule::Rule],
    rule: &str,
    values: usize,
) -> Option<usize> {
    use floodgate::rule::KeyKind;
    // (A `global` part takes no value.)
    let kinds: Vec<&KeyKind> = rules
        .iter()
        .find(|r| r.name() == rule)?
        .key()
        .kinds()
        .iter()
        .filter(|k| **k != KeyKind::Global)
        .collect();
    if kinds.len() != values {
        return None;
    }
    kinds.iter().position(|k| matches!(k, KeyKind::Session))
}
