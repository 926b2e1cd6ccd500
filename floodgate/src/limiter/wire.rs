//! The wire protocol between Rust and the Lua scripts, in one place: the
//! script each call runs, how an algorithm and a check are written as
//! script arguments, and how replies are read back (outcomes, the failed
//! and skipped forms, the error codes' text, and what a Redis error means
//! to the limiter).
//!
//! Every caller goes through here: the dispatchers (one server, the
//! per-worker lane, the cluster), the peek, the give-backs and the
//! operator's actions. An algorithm's code and parameters come from
//! [`Algorithm::wire`].

use std::time::Duration;

use redis::ToRedisArgs;

use super::algorithm::Param;
use super::{Algorithm, Check, Decision, LimiterError, Outcome, Quota};

/// The Lua that Redis runs: one function per algorithm, then the batch
/// driver, called by the last line (see `program.rs` for the library made
/// of it).
pub const SCRIPT_SOURCE: &str =
    concat!(lua_with_algorithms!("lua/batch.lua"), "\nreturn batch()\n");

/// The batch script as a Redis Cluster's masters run it: flagged so that
/// one call may decide the keys of every slot its master serves (Redis 7
/// or later; the shebang must be the script's very first line).
#[cfg(feature = "cluster")]
pub(crate) const CLUSTER_SCRIPT_SOURCE: &str = concat!(
    "#!lua flags=allow-cross-slot-keys\n",
    lua_with_algorithms!("lua/batch.lua"),
    "\nreturn batch()\n"
);

/// Gives back one request's units on one key (`count = "failures"`).
/// It reads a sliding-window log with the decision script's own code.
pub(crate) const GIVE_BACK_SOURCE: &str =
    lua_with_algorithms!("lua/give_back_fn.lua", "lua/give_back.lua");

/// Gives back what the allowed slot groups of a denied request took (a
/// Redis Cluster request whose rules span slots).
#[cfg(feature = "cluster")]
pub(crate) const CLUSTER_GIVE_BACK_SOURCE: &str =
    lua_with_algorithms!("lua/give_back_fn.lua", "lua/cluster_give_back.lua");

/// The Lua of a peek: the decision's algorithm functions, read-only.
pub(crate) const PEEK_SOURCE: &str = lua_with_algorithms!("lua/read_only.lua", "lua/peek.lua");

/// The Lua of an operator's action: the shared helpers, the algorithm
/// files, then the action's driver.
pub(crate) const OPERATOR_SOURCE: &str =
    lua_with_algorithms!("lua/read_only.lua", "lua/operator.lua");

/// Where script arguments are written: a command being built, or a
/// `redis::Script`'s invocation.
pub(crate) trait Args {
    /// Appends one argument.
    fn put<T: ToRedisArgs>(&mut self, value: T) -> &mut Self;

    /// Appends `value`, or `""` for `None` (what the scripts read as "none").
    fn put_opt<T: ToRedisArgs>(&mut self, value: Option<T>) -> &mut Self {
        match value {
            Some(v) => self.put(v),
            None => self.put(""),
        }
    }
}

impl Args for redis::Cmd {
    fn put<T: ToRedisArgs>(&mut self, value: T) -> &mut Self {
        self.arg(value)
    }
}

impl Args for redis::ScriptInvocation<'_> {
    fn put<T: ToRedisArgs>(&mut self, value: T) -> &mut Self {
        self.arg(value)
    }
}

/// Writes an algorithm as the Lua files read it: its code, then `p1`,
/// `p2` as the algorithm's own file names them (see [`Algorithm::wire`]).
pub(crate) fn algorithm<A: Args>(out: &mut A, algorithm: &Algorithm) {
    let (code, p1, p2) = algorithm.wire();
    out.put(code);
    for p in [p1, p2] {
        match p {
            Param::Whole(n) => out.put(n),
            Param::Real(x) => out.put(x),
        };
    }
}

/// Writes the spec of a batch call's checks as `lua/batch.lua` reads it:
/// the algorithm, cost, and flags (enforce or shadow, the penalty's
/// numbers). Checks name their spec by its place among the call's.
fn spec<A: Args>(out: &mut A, check: &Check) {
    algorithm(out, &check.algorithm);
    out.put(check.cost).put(check.flags().as_ref());
}

/// Whether two checks share a spec: everything but the key.
fn same_spec(a: &Check, b: &Check) -> bool {
    a.algorithm == b.algorithm
        && a.cost == b.cost
        && a.enforce == b.enforce
        && a.penalty == b.penalty
}

/// One job of a batch call as the script sees it.
#[derive(Clone)]
pub(crate) struct JobArgs<C> {
    /// Pinned clock in ms (tests); `None`: Redis `TIME`.
    pub(crate) now_ms: Option<u64>,
    /// Its deadline in ms on Redis's clock: the script skips the job at
    /// or after it. `None`: none.
    pub(crate) deadline: Option<i64>,
    /// Its checks (all of a request's, or those in one cluster slot).
    pub(crate) checks: C,
}

/// Writes a batch as one call of `target` (`FCALL` and the function's
/// name, or `EVALSHA` and the script's SHA) into `cmd`, reusing its two buffers
/// (not one allocation per argument, as a `ScriptInvocation` makes). KEYS
/// and ARGV are laid out as `lua/batch.lua` reads them. Returns the number
/// of values the reply must hold: three per check, then Redis's clock.
pub(crate) fn batch<'a, J, C>(cmd: &mut redis::Cmd, target: (&str, &str), jobs: J) -> usize
where
    J: Iterator<Item = JobArgs<C>> + Clone,
    C: Iterator<Item = &'a Check> + Clone,
{
    cmd.clear();
    let keys: usize = jobs.clone().map(|j| j.checks.count()).sum();
    cmd.arg(target.0).arg(target.1).arg(keys);
    for job in jobs.clone() {
        for c in job.checks {
            cmd.arg(c.key.as_str());
        }
    }
    batch_jobs(cmd, jobs);
    3 * keys + 1
}

/// Writes the jobs of a batch call (the ARGV [`batch`] writes) into `cmd`:
/// the call's distinct check specs, each once (a call's requests mostly
/// match the same few rules, and every argument costs Redis a string), then
/// the jobs, each check as the number of its spec.
pub(crate) fn batch_jobs<'a, J, C>(cmd: &mut redis::Cmd, jobs: J)
where
    J: Iterator<Item = JobArgs<C>> + Clone,
    C: Iterator<Item = &'a Check> + Clone,
{
    // A spec may be written more than once: only the first SHARED are
    // looked through, so a call whose checks all differ (costs charged
    // from handlers) costs no more than SHARED comparisons a check.
    const SHARED: usize = 16;
    let mut specs: Vec<&Check> = Vec::new();
    let mut named: Vec<usize> = Vec::new();
    // A call that pins any job's clock (tests) gives every job a second
    // argument, its clock, and says so by a negative count of jobs.
    let (mut count, mut pinned) = (0i64, false);
    for job in jobs.clone() {
        count += 1;
        pinned |= job.now_ms.is_some();
        for c in job.checks {
            let shared = &specs[..specs.len().min(SHARED)];
            let at = match shared.iter().position(|s| same_spec(s, c)) {
                Some(at) => at,
                None => {
                    specs.push(c);
                    specs.len() - 1
                }
            };
            named.push(at + 1);
        }
    }
    cmd.arg(specs.len());
    for s in &specs {
        spec(cmd, s);
    }
    cmd.arg(if pinned { -count } else { count });
    let mut named = named.into_iter();
    let mut text = String::new();
    for job in jobs {
        let specs = named.by_ref().take(job.checks.count());
        job_text(&mut text, job.deadline, specs);
        cmd.arg(text.as_str());
        if pinned {
            cmd.put_opt(job.now_ms);
        }
    }
}

/// A job as one argument, `DEADLINE|SPECS` (see `lua/batch.lua`): its
/// deadline (empty: none), then the numbers of its checks' specs joined by
/// commas. The jobs of a call mostly share one text, which the script
/// reads once.
fn job_text(text: &mut String, deadline: Option<i64>, specs: impl Iterator<Item = usize>) {
    use std::fmt::Write as _;
    text.clear();
    if let Some(deadline) = deadline {
        let _ = write!(text, "{deadline}");
    }
    text.push('|');
    for (i, spec) in specs.enumerate() {
        if i > 0 {
            text.push(',');
        }
        let _ = write!(text, "{spec}");
    }
}

/// A batch script's reply as it comes: its values packed in one string,
/// eight bytes each, little-endian (`lua/batch.lua`: one string costs
/// Redis, and the reader, less than an array of as many integers), or an
/// array of integers (the cluster's early answer that a slot is served
/// elsewhere).
#[derive(Debug)]
pub(crate) struct Values(pub(crate) Vec<i64>);

impl redis::FromRedisValue for Values {
    fn from_redis_value(v: redis::Value) -> Result<Values, redis::ParsingError> {
        match v {
            redis::Value::BulkString(bytes) => {
                if !bytes.len().is_multiple_of(8) {
                    return Err(format!("a packed reply of {} bytes", bytes.len()).into());
                }
                let value =
                    |b: &[u8]| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                Ok(Values(bytes.chunks_exact(8).map(value).collect()))
            }
            other => Vec::<i64>::from_redis_value(other).map(Values),
        }
    }
}

/// A batch script's reply with Redis's clock taken off: three values per
/// check (see [`job`]), then three for each check decided under an
/// operator's override (its index among the call's keys, the override's
/// limit, its window in ms).
#[derive(Debug)]
pub(crate) struct Replied {
    values: Vec<i64>,
    /// Where the override triples start.
    decided: usize,
}

impl Replied {
    /// What the check at `index` among the call's keys was decided under,
    /// when it was an override.
    fn quota(&self, index: usize) -> Option<Quota> {
        self.values[self.decided..]
            .chunks_exact(3)
            .find(|q| usize::try_from(q[0]).is_ok_and(|i| i == index))
            .map(|q| Quota {
                limit: u32::try_from(q[1].max(0)).unwrap_or(u32::MAX),
                window: Duration::from_millis(q[2].max(0) as u64),
            })
    }
}

/// Checks that a batch reply holds the `expected` values [`batch`] said
/// (and whole override triples after them), and takes Redis's clock, in
/// µs, out of it.
pub(crate) fn replied(
    mut values: Vec<i64>,
    expected: usize,
) -> Result<(Replied, i64), LimiterError> {
    if expected == 0 || values.len() < expected || !(values.len() - expected).is_multiple_of(3) {
        return Err(reply_length(values.len(), expected));
    }
    let clock = values.remove(expected - 1);
    Ok((
        Replied {
            values,
            decided: expected - 1,
        },
        clock,
    ))
}

/// A reply of the wrong length.
pub(crate) fn reply_length(got: usize, expected: usize) -> LimiterError {
    LimiterError::Other(format!(
        "the script returned {got} values, expected {expected}"
    ))
}

/// The outcome the scripts write as three numbers: a code (1 allowed,
/// 0 denied, 2 banned, 3 banned from now on), remaining, ms.
pub(crate) fn outcome(code: i64, remaining: i64, ms: i64) -> Outcome {
    Outcome {
        allowed: code == 1,
        remaining: remaining.max(0) as u64,
        wait: Duration::from_millis(ms.max(0) as u64),
        banned: code == 2 || code == 3,
        ban_started: code == 3,
        quota: None,
    }
}

/// Why the script could not decide a check on `key`, from its error code
/// (`ERR_*` in `lua/common.lua`).
pub(crate) fn undecidable(code: i64, key: &str) -> LimiterError {
    LimiterError::Check(match code {
        1 => format!("{key} holds a Redis type that no rate-limit algorithm writes"),
        2 => format!("the parameters of the check on {key} are out of range"),
        3 => format!("{key} holds state that is not made of numbers"),
        _ => format!("the script failed on {key} (the Redis log says why)"),
    })
}

/// Reads the decision for one job's `checks` from a batch reply at `at`
/// (three values per check, laid out as `lua/batch.lua` writes them) and
/// moves `at` past it: decided, failed (`-1`, code, index of the failing
/// check: [`LimiterError::Check`]) or skipped as late (`-2`:
/// [`LimiterError::Late`]).
pub(crate) fn job<'a, C>(
    checks: C,
    reply: &Replied,
    at: &mut usize,
) -> Result<Decision, LimiterError>
where
    C: ExactSizeIterator<Item = &'a Check> + Clone,
{
    let start = *at;
    *at += 3 * checks.len();
    let Some(values) = reply.values[..reply.decided].get(start..*at) else {
        return Err(LimiterError::Other(
            "the script's reply is too short".into(),
        ));
    };
    if let [-2, ..] = *values {
        // Skipped: it reached Redis after its deadline.
        return Err(LimiterError::Late);
    }
    if let [-1, code, index, ..] = *values {
        let key = usize::try_from(index)
            .ok()
            .and_then(|i| checks.clone().nth(i))
            .map_or("a key", |c| c.key.as_str());
        return Err(undecidable(code, key));
    }
    let overridden = reply.values.len() > reply.decided;
    let mut outcomes = Vec::with_capacity(checks.len());
    let mut allowed = true;
    for (i, (check, v)) in checks.zip(values.chunks_exact(3)).enumerate() {
        let mut outcome = outcome(v[0], v[1], v[2]);
        if overridden {
            outcome.quota = reply.quota(start / 3 + i);
        }
        if check.enforce && !outcome.allowed {
            allowed = false;
        }
        outcomes.push(outcome);
    }
    Ok(Decision { outcomes, allowed })
}

/// Reads a peek's reply (see `lua/peek.lua`): three values per check,
/// each decided alone, or `-1`, code for a check it could not read.
pub(crate) fn peek(
    checks: &[Check],
    values: &[i64],
    into: &mut Vec<Outcome>,
) -> Result<(), LimiterError> {
    if values.len() != 3 * checks.len() {
        return Err(reply_length(values.len(), 3 * checks.len()));
    }
    for (check, v) in checks.iter().zip(values.chunks_exact(3)) {
        if v[0] == -1 {
            return Err(undecidable(v[1], &check.key));
        }
        into.push(outcome(v[0], v[1], v[2]));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    fn check(key: &str, algorithm: Algorithm, cost: u32, enforce: bool) -> Check {
        Check {
            key: key.to_string(),
            algorithm,
            cost,
            enforce,
            penalty: None,
        }
    }

    fn n(v: u32) -> NonZeroU32 {
        NonZeroU32::new(v).unwrap()
    }

    #[test]
    fn a_batch_is_one_call_laid_out_as_batch_lua_reads_it() {
        let first = [
            check(
                "p:a:ip:1",
                Algorithm::SlidingWindow {
                    limit: n(5),
                    window: Duration::from_secs(10),
                },
                1,
                true,
            ),
            check(
                "p:b:ip:1",
                Algorithm::TokenBucket {
                    rate: 2.5,
                    burst: n(20),
                },
                2,
                false,
            ),
        ];
        let second = [check(
            "p:c:global:all",
            Algorithm::FixedWindow {
                limit: n(3),
                window: Duration::from_millis(1500),
            },
            1,
            true,
        )];
        let jobs = [
            JobArgs {
                now_ms: Some(1_700_000_000_123),
                deadline: Some(1_700_000_000_300),
                checks: first.iter(),
            },
            JobArgs {
                now_ms: None,
                deadline: None,
                checks: second.iter(),
            },
        ];
        let mut cmd = redis::Cmd::new();
        // A reused command starts afresh.
        cmd.arg("LEFTOVER");
        assert_eq!(batch(&mut cmd, ("FCALL", "NAME"), jobs.into_iter()), 10);
        let mut expected = redis::Cmd::new();
        for arg in [
            "FCALL",
            "NAME",
            "3",
            "p:a:ip:1",
            "p:b:ip:1",
            "p:c:global:all",
            // Three specs: algorithm, p1, p2, cost, flags.
            "3",
            "1",
            "5",
            "10000",
            "1",
            "1",
            "3",
            "2.5",
            "20",
            "2",
            "0",
            "2",
            "3",
            "1500",
            "1",
            "1",
            // Two jobs, one of them with a pinned clock: each job's
            // deadline|specs, then its clock ("" = Redis's).
            "-2",
            "1700000000300|1,2",
            "1700000000123",
            "|3",
            "",
        ] {
            expected.arg(arg);
        }
        assert_eq!(
            String::from_utf8_lossy(&cmd.get_packed_command()),
            String::from_utf8_lossy(&expected.get_packed_command())
        );
    }

    #[test]
    fn a_failed_job_is_an_error_naming_its_key_and_the_next_job_is_read_after_it() {
        let w = Algorithm::SlidingWindow {
            limit: n(5),
            window: Duration::from_secs(1),
        };
        let failed = [check("p:a:ip:1", w, 1, true), check("p:b:ip:1", w, 1, true)];
        let decided = [
            check("p:a:ip:2", w, 1, true),
            check("p:b:ip:2", w, 1, false),
        ];
        let late = [check("p:a:ip:3", w, 1, true)];
        // Job one failed on its second check (type error); job two
        // decided, its second check under an override; job three was
        // skipped as late.
        let values = vec![
            -1, 1, 1, -1, 1, 1, 1, 4, 900, 0, 0, 250, -2, 0, 0, 77, 3, 2, 60_000,
        ];
        let (reply, clock) = replied(values, 16).unwrap();
        assert_eq!(clock, 77);
        let mut at = 0;
        match job(failed.iter(), &reply, &mut at) {
            Err(LimiterError::Check(text)) => assert!(text.contains("p:b:ip:1"), "{text}"),
            other => panic!("{other:?}"),
        }
        let d = job(decided.iter(), &reply, &mut at).unwrap();
        assert!(d.allowed, "a shadow check's denial does not deny");
        assert_eq!(d.outcomes[0].remaining, 4);
        assert_eq!(d.outcomes[0].quota, None);
        assert_eq!(d.outcomes[1].wait, Duration::from_millis(250));
        assert_eq!(
            d.outcomes[1].quota,
            Some(Quota {
                limit: 2,
                window: Duration::from_secs(60)
            })
        );
        assert_eq!(job(late.iter(), &reply, &mut at), Err(LimiterError::Late));
        assert_eq!(at, 15);
        // A reply too short for the checks is an error, not a panic.
        assert!(matches!(
            job(decided.iter(), &reply, &mut at),
            Err(LimiterError::Other(_))
        ));
    }

    #[test]
    fn the_clock_comes_off_a_reply_of_the_right_length() {
        let (reply, clock) = replied(vec![1, 4, 900, 123], 4).unwrap();
        assert_eq!(clock, 123);
        assert_eq!(reply.values, [1, 4, 900]);
        assert!(matches!(
            replied(vec![1, 4, 900], 4),
            Err(LimiterError::Other(_))
        ));
        assert!(matches!(
            replied(vec![1, 4, 900, 123, 0], 4),
            Err(LimiterError::Other(_))
        ));
    }

    #[test]
    fn a_packed_reply_reads_as_the_integers_packed() {
        let values: [i64; 4] = [1, -2, 0, 1_796_441_138_021_123];
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let read: Values = redis::from_redis_value(redis::Value::BulkString(bytes)).unwrap();
        assert_eq!(read.0, values);
        // The cluster's early answer is an array.
        let early = redis::Value::Array(vec![redis::Value::Int(-3)]);
        assert_eq!(redis::from_redis_value::<Values>(early).unwrap().0, [-3]);
        let torn = redis::Value::BulkString(vec![0; 12]);
        assert!(redis::from_redis_value::<Values>(torn).is_err());
    }
}
