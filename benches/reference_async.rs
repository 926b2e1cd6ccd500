//! The reference design that scripts/bench measures floodgate against, and
//! the probe of the sliding-window script's Redis cost.
//!
//! Not a Criterion bench: a program that scripts/bench starts. Two commands
//! (every flag also reads an environment variable):
//!
//! ```text
//! reference_async serve --port 8082 --redis URL --workers 2 --limit 100000 --window-ms 1000
//! reference_async cost  --redis URL --limit 10 --calls 20000
//! ```
//!
//! `serve` guards `GET /check` with floodgate's own script
//! ([`floodgate::__private::SCRIPT_SOURCE`], one job per `EVALSHA`)
//! through the redis crate's async multiplexed connection, one connection
//! per actix worker: the best async design, to measure floodgate's pooled
//! synchronous connections and batching dispatcher against. It does what
//! floodgate does per request: key by client address, a decision bounded by
//! a 250 ms timeout (Redis errors let the request through), the RateLimit
//! fields on allowed responses, 429 with Retry-After on denied ones.
//!
//! `cost` fills one sliding-window key to its limit on a pinned clock, then
//! decides `--calls` requests at the limit (each pops one expired entry and
//! pushes one), one job per call and then 32 per call, then `--calls`
//! denied ones, and prints the Redis time per decision (`INFO
//! commandstats`, evalsha) and the key's `MEMORY USAGE`, as one line of
//! `name=value` pairs.

use std::time::Duration;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use actix_web::middleware::{from_fn, Next};
use actix_web::{web, App, Error, HttpResponse, HttpServer};
use floodgate::__private::SCRIPT_SOURCE;
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
    script: redis::Script,
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
                        let conn = client.get_multiplexed_async_connection().await?;
                        let policy =
                            format!("\"check\";q={limit};w={}", window_ms.div_ceil(1000).max(1));
                        Ok::<_, redis::RedisError>(Guard {
                            conn,
                            script: redis::Script::new(SCRIPT_SOURCE),
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

/// Allowed, remaining, ms (as the script returns them).
async fn decide(guard: &Guard, key: &str) -> Option<(bool, i64, i64)> {
    let mut call = guard.script.prepare_invoke();
    call.key(key)
        .arg(1) // jobs
        .arg("") // now: Redis TIME
        .arg("") // deadline: none
        .arg(1) // checks
        .arg(1) // sliding_window
        .arg(guard.limit)
        .arg(guard.window_ms)
        .arg(1) // cost
        .arg(1); // enforce
    let mut conn = guard.conn.clone();
    let reply = tokio::time::timeout(TIMEOUT, call.invoke_async::<Vec<i64>>(&mut conn)).await;
    match reply {
        // Three values, then Redis's clock.
        Ok(Ok(v)) if v.len() == 4 => Some((v[0] == 1, v[1], v[2])),
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

/// Microseconds of Redis time spent in EVALSHA since the last CONFIG RESETSTAT.
async fn evalsha_usec(conn: &mut MultiplexedConnection) -> redis::RedisResult<u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    Ok(info
        .lines()
        .filter_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        .flat_map(|l| l.split(','))
        .filter_map(|kv| kv.strip_prefix("usec="))
        .filter_map(|v| v.trim().parse::<u64>().ok())
        .sum())
}

/// One EVALSHA deciding `nows.len()` jobs on `key`, each at its pinned time.
async fn batch(
    conn: &mut MultiplexedConnection,
    script: &redis::Script,
    key: &str,
    limit: u64,
    window_ms: u64,
    nows: &[u64],
) -> redis::RedisResult<Vec<i64>> {
    let mut call = script.prepare_invoke();
    call.arg(nows.len());
    for now in nows {
        call.key(key)
            .arg(now)
            .arg("") // deadline: none
            .arg(1)
            .arg(1)
            .arg(limit)
            .arg(window_ms)
            .arg(1)
            .arg(1);
    }
    let mut out: Vec<i64> = call.invoke_async(conn).await?;
    // The last value is Redis's clock.
    out.pop();
    Ok(out)
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
    let result = measure(&url, limit, calls).await;
    match result {
        Ok(line) => {
            println!("{line}");
            Ok(())
        }
        Err(e) => Err(std::io::Error::other(e.to_string())),
    }
}

async fn measure(url: &str, limit: u64, calls: u64) -> redis::RedisResult<String> {
    // The same window at every limit; entries are spaced so that exactly one
    // leaves the window each time the clock moves on by `spacing`.
    let window_ms: u64 = 600_000;
    let spacing = window_ms / limit;
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let script = redis::Script::new(SCRIPT_SOURCE);
    let key = format!("costprobe:sliding:{limit}");
    redis::cmd("DEL")
        .arg(&key)
        .query_async::<()>(&mut conn)
        .await?;
    let (secs, _): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let t0 = secs * 1000 - window_ms;

    // Fill the key to its limit.
    let fill: Vec<u64> = (0..limit).map(|i| t0 + i * spacing).collect();
    for chunk in fill.chunks(1000) {
        let out = batch(&mut conn, &script, &key, limit, window_ms, chunk).await?;
        if out.chunks(3).any(|c| c[0] != 1) {
            return Err(std::io::Error::other("filling: a request was denied").into());
        }
    }
    let len: u64 = redis::cmd("LLEN").arg(&key).query_async(&mut conn).await?;
    let memory: u64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(&mut conn)
        .await?;

    let mut step = limit;
    let mut per_decision = Vec::new();
    for jobs in [1u64, 32] {
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async::<()>(&mut conn)
            .await?;
        let mut decided = 0;
        while decided < calls {
            let nows: Vec<u64> = (0..jobs).map(|i| t0 + (step + i) * spacing).collect();
            step += jobs;
            let out = batch(&mut conn, &script, &key, limit, window_ms, &nows).await?;
            if out.chunks(3).any(|c| c[0] != 1) {
                return Err(std::io::Error::other("at the limit: a request was denied").into());
            }
            decided += jobs;
        }
        per_decision.push(evalsha_usec(&mut conn).await? as f64 / decided as f64);
    }

    // Denied at the limit: the clock stands still, nothing leaves.
    let now = t0 + (step - 1) * spacing;
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut conn)
        .await?;
    for _ in 0..calls {
        let out = batch(&mut conn, &script, &key, limit, window_ms, &[now]).await?;
        if out.first() != Some(&0) {
            return Err(std::io::Error::other("over the limit: a request was allowed").into());
        }
    }
    let denied = evalsha_usec(&mut conn).await? as f64 / calls as f64;
    let after: u64 = redis::cmd("LLEN").arg(&key).query_async(&mut conn).await?;
    redis::cmd("DEL")
        .arg(&key)
        .query_async::<()>(&mut conn)
        .await?;
    Ok(format!(
        "limit={limit} entries={len} entries_after={after} memory_bytes={memory} \
         allowed_usec={:.3} allowed_batch32_usec={:.3} denied_usec={denied:.3}",
        per_decision[0], per_decision[1]
    ))
}
