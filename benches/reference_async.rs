//! The reference design that scripts/bench measures floodgate against, and
//! the probe of what each algorithm's script costs Redis per decision.
//!
//! Not a Criterion bench: a program that scripts/bench starts. Two commands
//! (every flag also reads an environment variable):
//!
//! ```text
//! reference_async serve --port 8082 --redis URL --workers 2 --limit 100000 --window-ms 1000
//! reference_async cost  --redis URL --limit 10 --calls 20000
//! ```
//!
//! `serve` guards `GET /check` with floodgate's own batch function
//! ([`floodgate::__private::batch_function`], one job per `FCALL`)
//! through the redis crate's async multiplexed connection, one connection
//! per actix worker: the best async design, to measure floodgate's pooled
//! synchronous connections and batching dispatcher against. It does what
//! floodgate does per request: key by client address, a decision bounded by
//! a 250 ms timeout (Redis errors let the request through), the RateLimit
//! fields on allowed responses, 429 with Retry-After on denied ones.
//!
//! `cost` measures what one decision costs Redis, for each algorithm at
//! `--limit` (the logs only up to 100 000) and for the plain sliding-log
//! floor (`floor_sliding_log.lua`) it is compared with: see [`measure`].
//! It prints one line of `name=value` pairs per algorithm.

use std::time::Duration;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use actix_web::middleware::{from_fn, Next};
use actix_web::{web, App, Error, HttpResponse, HttpServer};
use floodgate::__private::batch_function;
use redis::aio::MultiplexedConnection;

const TIMEOUT: Duration = Duration::from_millis(250);

fn arg(args: &[String], flag: &str, env: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
        .or_else(|| std::env::var(env).ok())
        .unwrap_or_else(|| default.to_string())
}

fn number(args: &[String], flag: &str, env: &str, default: &str) -> u64 {
    arg(args, flag, env, default)
        .parse()
        .unwrap_or_else(|_| panic!("{flag}: a number"))
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("serve") => serve(&args),
        Some("cost") => actix_web::rt::System::new().block_on(cost(&args)),
        _ => {
            // `cargo bench` runs every bench target with `--bench`: this one
            // is a program that only scripts/bench knows how to drive.
            println!("reference_async: a server and a probe for scripts/bench (see its source)");
            Ok(())
        }
    }
}

/// What the middleware needs, one per worker.
struct Guard {
    conn: MultiplexedConnection,
    /// The batch function's name.
    function: &'static str,
    limit: u64,
    window_ms: u64,
    policy: HeaderValue,
}

fn serve(args: &[String]) -> std::io::Result<()> {
    let port = number(args, "--port", "BENCH_PORT", "8082") as u16;
    let url = arg(
        args,
        "--redis",
        "BENCH_REDIS_URL",
        "redis://127.0.0.1:6379/0",
    );
    let workers = number(args, "--workers", "BENCH_WORKERS", "2") as usize;
    let limit = number(args, "--limit", "BENCH_LIMIT", "100000");
    let window_ms = number(args, "--window-ms", "BENCH_WINDOW_MS", "1000");
    let client = redis::Client::open(url).expect("a Redis URL");
    actix_web::rt::System::new().block_on(async move {
        HttpServer::new(move || {
            let client = client.clone();
            App::new()
                // One multiplexed connection per worker, opened as it starts.
                .data_factory(move || {
                    let client = client.clone();
                    async move {
                        let mut conn = client.get_multiplexed_async_connection().await?;
                        load_library(&mut conn).await?;
                        let policy =
                            format!("\"check\";q={limit};w={}", window_ms.div_ceil(1000).max(1));
                        Ok::<_, redis::RedisError>(Guard {
                            conn,
                            function: batch_function().1,
                            limit,
                            window_ms,
                            policy: HeaderValue::from_str(&policy).expect("a header value"),
                        })
                    }
                })
                .wrap(from_fn(guard))
                .route(
                    "/check",
                    web::get().to(|| async {
                        HttpResponse::Ok()
                            .content_type("text/plain; charset=utf-8")
                            .body("ok\n")
                    }),
                )
        })
        .workers(workers)
        .bind(("127.0.0.1", port))?
        .run()
        .await
    })
}

/// Writes the ARGV of floodgate's batch function for jobs of one check each
/// under one rule (algorithm `code`, parameters `p1`, `p2`, cost 1,
/// enforced): the rule's spec once, then each job as one argument,
/// `DEADLINE|SPECS` (no deadline, its one check naming that spec), and
/// where any job pins its clock (`None`: Redis `TIME`) each job's clock
/// after it, the count of jobs then written negative.
fn one_rule_jobs(
    call: &mut redis::Cmd,
    code: u8,
    p1: impl redis::ToRedisArgs,
    p2: impl redis::ToRedisArgs,
    nows: &[Option<u64>],
) {
    call.arg(1).arg(code).arg(p1).arg(p2).arg(1).arg(1);
    let pinned = nows.iter().any(Option::is_some);
    let count = nows.len() as i64;
    call.arg(if pinned { -count } else { count });
    for now in nows {
        call.arg("|1");
        if pinned {
            match now {
                Some(ms) => call.arg(ms),
                None => call.arg(""),
            };
        }
    }
}

/// The values of a reply of floodgate's batch function: one string of
/// little-endian 8-byte integers.
fn unpacked(reply: redis::Value) -> Option<Vec<i64>> {
    let redis::Value::BulkString(bytes) = reply else {
        return None;
    };
    let values = bytes.chunks_exact(8).map(|b| {
        let mut v = [0; 8];
        v.copy_from_slice(b);
        i64::from_le_bytes(v)
    });
    (bytes.len() % 8 == 0).then(|| values.collect())
}

/// Allowed, remaining, ms (as the script returns them).
async fn decide(guard: &Guard, key: &str) -> Option<(bool, i64, i64)> {
    let mut call = redis::cmd("FCALL");
    call.arg(guard.function).arg(1).arg(key);
    one_rule_jobs(&mut call, 1, guard.limit, guard.window_ms, &[None]);
    let mut conn = guard.conn.clone();
    let reply = tokio::time::timeout(TIMEOUT, call.query_async::<redis::Value>(&mut conn)).await;
    match reply.ok()?.ok().and_then(unpacked) {
        // Three values, then Redis's clock.
        Some(v) if v.len() == 4 => Some((v[0] == 1, v[1], v[2])),
        _ => None,
    }
}

async fn guard(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, Error> {
    let Some(guard) = req.app_data::<web::Data<Guard>>().cloned() else {
        return next.call(req).await.map(|r| r.map_into_left_body());
    };
    let ip = req
        .peer_addr()
        .map_or_else(|| "0.0.0.0".to_string(), |a| a.ip().to_string());
    let key = format!("reference:check:ip:{ip}");
    match decide(&guard, &key).await {
        Some((true, remaining, ms)) => {
            let mut res = next.call(req).await?;
            let state = format!(
                "\"check\";r={remaining};t={}",
                (ms.max(0) as u64).div_ceil(1000)
            );
            let headers = res.headers_mut();
            headers.insert(
                HeaderName::from_static("ratelimit-policy"),
                guard.policy.clone(),
            );
            if let Ok(v) = HeaderValue::from_str(&state) {
                headers.insert(HeaderName::from_static("ratelimit"), v);
            }
            Ok(res.map_into_left_body())
        }
        Some((false, _, ms)) => {
            let retry = (ms.max(0) as u64).div_ceil(1000).max(1);
            let response = HttpResponse::TooManyRequests()
                .insert_header((RETRY_AFTER, retry.to_string()))
                .finish();
            Ok(req.into_response(response).map_into_right_body())
        }
        // Redis failed or was slow: let the request through, as floodgate's
        // default `on_redis_error = "allow"` does.
        None => next.call(req).await.map(|r| r.map_into_left_body()),
    }
}

/// What `cost` measures: one of floodgate's algorithms through its own batch
/// script, or the plain sliding-log floor (`benches/floor_sliding_log.lua`).
#[derive(Clone, Copy)]
enum Subject {
    /// An algorithm's code on the wire (see floodgate's `limiter/algorithm.rs`).
    Floodgate(&'static str, u8),
    Floor,
}

/// The plain sliding-window log: LLEN/LINDEX, then LPUSH/LTRIM/PEXPIRE.
const FLOOR_SOURCE: &str = include_str!("floor_sliding_log.lua");

/// The subjects and the largest limit each takes (the log keeps an entry per
/// unit, so floodgate allows it 100 000 at most).
const SUBJECTS: [(Subject, u64); 6] = [
    (Subject::Floodgate("sliding_window", 1), 100_000),
    (Subject::Floor, 100_000),
    (Subject::Floodgate("fixed_window", 2), 100_000),
    (Subject::Floodgate("token_bucket", 3), 100_000),
    (Subject::Floodgate("gcra", 4), 1_000_000_000),
    (Subject::Floodgate("sliding_counter", 5), 1_000_000_000),
];

impl Subject {
    fn name(self) -> &'static str {
        match self {
            Subject::Floodgate(name, _) => name,
            Subject::Floor => "floor",
        }
    }
}

/// Loads floodgate's function library (the same source replaces itself).
async fn load_library(conn: &mut MultiplexedConnection) -> redis::RedisResult<()> {
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(batch_function().0)
        .query_async::<String>(conn)
        .await
        .map(drop)
}

/// Microseconds of Redis time spent in script and function calls (EVALSHA
/// and FCALL) since the last CONFIG RESETSTAT, and Redis's own CPU time
/// (user + system) so far.
async fn redis_usec(conn: &mut MultiplexedConnection) -> redis::RedisResult<(f64, f64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .arg("cpu")
        .query_async(conn)
        .await?;
    let evalsha = info
        .lines()
        .filter_map(|l| {
            l.strip_prefix("cmdstat_evalsha:")
                .or_else(|| l.strip_prefix("cmdstat_fcall:"))
        })
        .flat_map(|l| l.split(','))
        .filter_map(|kv| kv.strip_prefix("usec="))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum();
    let cpu = info
        .lines()
        .filter_map(|l| {
            l.strip_prefix("used_cpu_user:")
                .or_else(|| l.strip_prefix("used_cpu_sys:"))
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum::<f64>()
        * 1e6;
    Ok((evalsha, cpu))
}

/// Microseconds of EVALSHA time since the last CONFIG RESETSTAT.
async fn evalsha_usec(conn: &mut MultiplexedConnection) -> redis::RedisResult<u64> {
    Ok(redis_usec(conn).await?.0 as u64)
}

/// The keys one subject is measured on, and one EVALSHA deciding jobs on
/// them: each job names its key (by index) and its pinned time.
struct Probe<'a> {
    conn: &'a mut MultiplexedConnection,
    /// `FCALL` and the batch function, or `EVALSHA` and the floor's SHA.
    target: (&'static str, String),
    subject: Subject,
    keys: Vec<String>,
    p1: f64,
    p2: f64,
}

impl Probe<'_> {
    /// One allowed flag per job.
    async fn decide(&mut self, jobs: &[(usize, u64)]) -> redis::RedisResult<Vec<bool>> {
        let mut call = redis::cmd(self.target.0);
        call.arg(&self.target.1).arg(jobs.len());
        for &(key, _) in jobs {
            call.arg(&self.keys[key]);
        }
        match self.subject {
            Subject::Floodgate(_, code) => {
                let nows: Vec<Option<u64>> = jobs.iter().map(|&(_, now)| Some(now)).collect();
                one_rule_jobs(&mut call, code, self.p1, self.p2, &nows);
            }
            Subject::Floor => {
                call.arg(jobs.len());
                for &(_, now) in jobs {
                    call.arg(now).arg(self.p1).arg(self.p2);
                }
            }
        }
        Ok(match self.subject {
            // Three values per job, Redis's clock last.
            Subject::Floodgate(..) => {
                let reply = call.query_async(&mut *self.conn).await?;
                let out = unpacked(reply).ok_or_else(|| {
                    redis::RedisError::from((redis::ErrorKind::Client, "not a packed reply"))
                })?;
                out.chunks_exact(3).map(|c| c[0] == 1).collect()
            }
            Subject::Floor => {
                let out: Vec<i64> = call.query_async(&mut *self.conn).await?;
                out.iter().map(|&v| v == 1).collect()
            }
        })
    }
}

async fn cost(args: &[String]) -> std::io::Result<()> {
    let url = arg(
        args,
        "--redis",
        "BENCH_REDIS_URL",
        "redis://127.0.0.1:6379/0",
    );
    let limit = number(args, "--limit", "BENCH_LIMIT", "10");
    let calls = number(args, "--calls", "BENCH_CALLS", "20000");
    let run = async {
        let client = redis::Client::open(url.as_str())?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        let mut lines = Vec::new();
        for (subject, max) in SUBJECTS {
            if limit <= max {
                lines.push(measure(&mut conn, subject, limit, calls).await?);
            }
        }
        Ok::<_, redis::RedisError>(lines)
    };
    match run.await {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            Ok(())
        }
        Err(e) => Err(std::io::Error::other(e.to_string())),
    }
}

/// How many jobs one call carries in the batched figures, and on how many
/// keys the spread figure runs (one job per key per call).
const BATCH: usize = 20;

/// Fills BATCH keys to their limit on a pinned clock, each key's requests
/// spaced so that its whole limit fits one window exactly, then decides
/// `calls` more on the same schedule (for the logs: each lets exactly one
/// old entry out and one new one in, the most work an allowed decision
/// does): on one key one per call, on one key BATCH per call, and on the
/// BATCH keys one job each per call; and, for the logs, `calls` denied ones
/// on one key with the clock standing still. Prints one line of
/// `name=value` pairs.
async fn measure(
    conn: &mut MultiplexedConnection,
    subject: Subject,
    limit: u64,
    calls: u64,
) -> redis::RedisResult<String> {
    // Ten minutes at the small limits; at 10^9 one request per ms.
    let window_ms: u64 = 600_000_u64.max(limit);
    let spacing = window_ms / limit;
    let (p1, p2) = match subject {
        // Rate per second, burst.
        Subject::Floodgate("token_bucket", _) => {
            ((limit * 1000) as f64 / window_ms as f64, limit as f64)
        }
        _ => (limit as f64, window_ms as f64),
    };
    let (target, prefix) = match subject {
        Subject::Floor => {
            let sha: String = redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(FLOOR_SOURCE)
                .query_async(&mut *conn)
                .await?;
            (("EVALSHA", sha), "floor")
        }
        Subject::Floodgate(name, _) => {
            load_library(conn).await?;
            (("FCALL", batch_function().1.to_string()), name)
        }
    };
    let keys: Vec<String> = (0..BATCH)
        .map(|i| format!("costprobe:{prefix}:{limit}:{i}"))
        .collect();
    for key in &keys {
        redis::cmd("DEL")
            .arg(key)
            .query_async::<()>(&mut *conn)
            .await?;
    }
    let (secs, _): (u64, u64) = redis::cmd("TIME").query_async(&mut *conn).await?;
    let t0 = secs * 1000 - window_ms;
    let mut probe = Probe {
        conn,
        target,
        subject,
        keys,
        p1,
        p2,
    };
    let is_log = matches!(
        subject,
        Subject::Floor | Subject::Floodgate("sliding_window", _)
    );
    let fail =
        |what: &str| Err(std::io::Error::other(format!("{}: {what}", subject.name())).into());

    // Fill every key to its limit (the logs; the other algorithms' cost
    // does not depend on how full they are: 1000 requests each).
    let fill = if is_log { limit } else { limit.min(1000) };
    for key in 0..BATCH {
        let mut done = 0;
        while done < fill {
            let n = (fill - done).min(1000);
            let jobs: Vec<(usize, u64)> =
                (done..done + n).map(|i| (key, t0 + i * spacing)).collect();
            done += n;
            if is_log && probe.decide(&jobs).await?.contains(&false) {
                return fail("filling: a request was denied");
            }
        }
    }
    let mut steps = [fill; BATCH];
    let entries: u64 = if is_log {
        redis::cmd("LLEN")
            .arg(&probe.keys[0])
            .query_async(&mut *probe.conn)
            .await?
    } else {
        fill
    };

    // (EVALSHA µs, Redis CPU µs) per decision: one key, 1 per call; one
    // key, BATCH per call; BATCH keys, one each per call.
    let mut figures = Vec::new();
    let mut allowed = 0;
    let mut decided = 0;
    for shape in 0..3 {
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async::<()>(&mut *probe.conn)
            .await?;
        let (_, cpu0) = redis_usec(probe.conn).await?;
        let mut n = 0;
        while n < calls {
            let jobs: Vec<(usize, u64)> = match shape {
                0 => vec![(0, t0 + steps[0] * spacing)],
                1 => (0..BATCH as u64)
                    .map(|i| (0, t0 + (steps[0] + i) * spacing))
                    .collect(),
                _ => (0..BATCH).map(|k| (k, t0 + steps[k] * spacing)).collect(),
            };
            for &(key, _) in &jobs {
                steps[key] += 1;
            }
            let out = probe.decide(&jobs).await?;
            if is_log && out.contains(&false) {
                return fail("at the limit: a request was denied");
            }
            allowed += out.iter().filter(|&&a| a).count() as u64;
            n += jobs.len() as u64;
        }
        decided += n;
        let (evalsha, cpu1) = redis_usec(probe.conn).await?;
        figures.push((evalsha / n as f64, (cpu1 - cpu0) / n as f64));
    }
    // One key's size after the run (the log's at its limit).
    let memory: Option<u64> = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&probe.keys[0])
        .arg("SAMPLES")
        .arg(0)
        .query_async(&mut *probe.conn)
        .await?;

    let mut denied = String::new();
    if is_log {
        // Denied at the limit: the clock stands still, nothing leaves.
        let now = t0 + (steps[0] - 1) * spacing;
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async::<()>(&mut *probe.conn)
            .await?;
        for _ in 0..calls {
            if probe.decide(&[(0, now)]).await?.first() != Some(&false) {
                return fail("over the limit: a request was allowed");
            }
        }
        let usec = evalsha_usec(probe.conn).await? as f64 / calls as f64;
        denied = format!(" denied_usec={usec:.3}");
    }
    for key in &probe.keys {
        redis::cmd("DEL")
            .arg(key)
            .query_async::<()>(&mut *probe.conn)
            .await?;
    }
    Ok(format!(
        "subject={} limit={limit} entries={entries} memory_bytes={} allowed_share={:.4} \
         one_usec={:.3} one_cpu_usec={:.3} batch_usec={:.3} batch_cpu_usec={:.3} \
         spread_usec={:.3} spread_cpu_usec={:.3}{denied}",
        subject.name(),
        memory.map_or_else(|| "-".to_string(), |m| m.to_string()),
        allowed as f64 / decided as f64,
        figures[0].0,
        figures[0].1,
        figures[1].0,
        figures[1].1,
        figures[2].0,
        figures[2].1,
    ))
}
