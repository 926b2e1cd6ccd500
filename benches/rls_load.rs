//! A gRPC load generator for `floodgate rls` (scripts/bench): keeps
//! `--inflight` `ShouldRateLimit` calls in flight for `--seconds` after a
//! `--warmup`, and prints one JSON line: calls per second, p50 and p99 in
//! microseconds, and how many answers were OK, OVER_LIMIT or errors.
//!
//! `--case`: `none` (a descriptor that matches no limit), `one` (one limit,
//! one key), `two` (two limits in one call), `spread` (one limit over 1000
//! values), or `exact` (`--calls` calls on one fresh key, all at once
//! `--inflight` at a time: the OKs are counted against the limit).
//!
//! `rls_load --endpoint http://127.0.0.1:8081 --case one --seconds 5 --warmup 1 --inflight 64`

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_site::rls::proto::{Entry, RateLimitClient, RateLimitDescriptor, RateLimitRequest};

fn descriptor(pairs: &[(&str, String)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: pairs
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.clone(),
            })
            .collect(),
        limit: None,
        hits_addend: None,
    }
}

fn request(case: &str, n: u64, tag: &str) -> RateLimitRequest {
    let descriptors = match case {
        "none" => vec![descriptor(&[("nothing", "x".into())])],
        "one" => vec![descriptor(&[("one", tag.into())])],
        "two" => vec![
            descriptor(&[("one", tag.into())]),
            descriptor(&[("two", tag.into())]),
        ],
        "spread" => vec![descriptor(&[("one", format!("{tag}-{}", n % 1000))])],
        "exact" => vec![descriptor(&[("exact", tag.into())])],
        other => panic!("unknown case {other:?}"),
    };
    RateLimitRequest {
        domain: "bench".into(),
        descriptors,
        hits_addend: 1,
    }
}

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let endpoint = arg(&args, "--endpoint", "http://127.0.0.1:8081");
    let case = arg(&args, "--case", "one");
    let seconds: f64 = arg(&args, "--seconds", "5").parse().unwrap();
    let warmup: f64 = arg(&args, "--warmup", "1").parse().unwrap();
    let inflight: usize = arg(&args, "--inflight", "64").parse().unwrap();
    let calls: u64 = arg(&args, "--calls", "2000").parse().unwrap();
    let tag = arg(&args, "--tag", &format!("t{}", std::process::id()));
    // A few connections, as a proxy with several workers would open.
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(RateLimitClient::connect(endpoint.clone()).await.unwrap());
    }
    let counter = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, over, errors) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let exact = case == "exact";
    let mut tasks = Vec::new();
    for i in 0..inflight {
        let mut client = clients[i % clients.len()].clone();
        let (counter, measuring, stop) = (counter.clone(), measuring.clone(), stop.clone());
        let (ok, over, errors) = (ok.clone(), over.clone(), errors.clone());
        let (case, tag) = (case.clone(), tag.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies: Vec<u32> = Vec::new();
            loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let n = counter.fetch_add(1, Ordering::Relaxed);
                if exact && n >= calls {
                    break;
                }
                let started = Instant::now();
                let answer = client.should_rate_limit(request(&case, n, &tag)).await;
                let took = started.elapsed();
                if measuring.load(Ordering::Relaxed) || exact {
                    latencies.push(u32::try_from(took.as_micros()).unwrap_or(u32::MAX));
                    match answer {
                        Ok(r) if r.overall_code == 1 => ok.fetch_add(1, Ordering::Relaxed),
                        Ok(_) => over.fetch_add(1, Ordering::Relaxed),
                        Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                    };
                }
            }
            latencies
        }));
    }
    let started;
    if exact {
        started = Instant::now();
    } else {
        tokio::time::sleep(Duration::from_secs_f64(warmup)).await;
        measuring.store(true, Ordering::Relaxed);
        started = Instant::now();
        tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
        measuring.store(false, Ordering::Relaxed);
        stop.store(true, Ordering::Relaxed);
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let pct = |p: f64| {
        if all.is_empty() {
            0
        } else {
            all[((all.len() - 1) as f64 * p) as usize]
        }
    };
    println!(
        "{{\"case\":\"{case}\",\"calls\":{},\"calls_per_s\":{:.1},\"p50_us\":{},\"p99_us\":{},\"ok\":{},\"over\":{},\"errors\":{}}}",
        all.len(),
        all.len() as f64 / elapsed,
        pct(0.5),
        pct(0.99),
        ok.load(Ordering::Relaxed),
        over.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed)
    );
}
