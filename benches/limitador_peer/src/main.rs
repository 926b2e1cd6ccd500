//! A minimal Envoy rate-limit service (`ShouldRateLimit`) on the `limitador`
//! crate and its Redis storage, for scripts/bench to measure beside
//! `floodgate rls` under the same load and on the same Redis.
//!
//! `limitador-peer --listen 127.0.0.1:8081 --redis redis://127.0.0.1:6379 --mode exact|cached`
//!
//! `--mode exact` counts in Redis on every call (`AsyncRedisStorage`);
//! `--mode cached` counts in memory and flushes to Redis in the background
//! (`CachedRedisStorage`, its default settings).
//!
//! The limits are those of the benchmark's descriptor file (domain `bench`):
//! `one` and `two` 100000 per second, `exact` 1000 per hour, each counted per
//! descriptor value. As Limitador's own server does, every entry of every
//! descriptor goes into one map of key to value, and a limit whose variable
//! is a key of that map applies, counted per the key's value. A call that
//! matches no limit is OK. Redis failing answers UNAVAILABLE.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use limitador::limit::{Limit, Namespace};
use limitador::storage::redis::{AsyncRedisStorage, CachedRedisStorage};
use limitador::AsyncRateLimiter;

const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
const DOMAIN: &str = "bench";

/// `envoy.service.ratelimit.v3.RateLimitRequest`, the fields read here.
#[derive(Clone, PartialEq, prost::Message)]
struct RateLimitRequest {
    #[prost(string, tag = "1")]
    domain: String,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RateLimitDescriptor>,
    #[prost(uint32, tag = "3")]
    hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`: its entries.
#[derive(Clone, PartialEq, prost::Message)]
struct RateLimitDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<Entry>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Entry {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "2")]
    value: String,
}

/// `RateLimitResponse`: the overall code and one status per descriptor.
#[derive(Clone, PartialEq, prost::Message)]
struct RateLimitResponse {
    #[prost(int32, tag = "1")]
    overall_code: i32,
    #[prost(message, repeated, tag = "2")]
    statuses: Vec<DescriptorStatus>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct DescriptorStatus {
    #[prost(int32, tag = "1")]
    code: i32,
}

const CODE_UNKNOWN: i32 = 0;
const CODE_OK: i32 = 1;
const CODE_OVER_LIMIT: i32 = 2;

/// The limits of the benchmark's descriptor file, as Limitador limits.
fn limits() -> Vec<Limit> {
    let empty: [&str; 0] = [];
    vec![
        Limit::new(DOMAIN, 100_000, 1, empty, ["one"]),
        Limit::new(DOMAIN, 100_000, 1, empty, ["two"]),
        Limit::new(DOMAIN, 1000, 3600, empty, ["exact"]),
    ]
}

struct Peer {
    limiter: AsyncRateLimiter,
}

impl Peer {
    async fn decide(&self, request: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        if request.domain.is_empty() {
            return Ok(RateLimitResponse {
                overall_code: CODE_UNKNOWN,
                statuses: Vec::new(),
            });
        }
        let mut values = HashMap::new();
        for descriptor in &request.descriptors {
            for entry in &descriptor.entries {
                values.insert(entry.key.clone(), entry.value.clone());
            }
        }
        let namespace = Namespace::from(request.domain);
        let hits = i64::from(request.hits_addend.max(1));
        let checked = self
            .limiter
            .check_rate_limited_and_update(&namespace, &values, hits, false)
            .await
            .map_err(|e| tonic::Status::unavailable(format!("limitador: {e}")))?;
        let code = if checked.limited {
            CODE_OVER_LIMIT
        } else {
            CODE_OK
        };
        Ok(RateLimitResponse {
            overall_code: code,
            statuses: request
                .descriptors
                .iter()
                .map(|_| DescriptorStatus { code })
                .collect(),
        })
    }
}

/// The gRPC service: `ShouldRateLimit` to [`Peer::decide`], anything else
/// UNIMPLEMENTED.
#[derive(Clone)]
struct Service(Arc<Peer>);

impl tonic::server::NamedService for Service {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'static>>;

struct Unary(Arc<Peer>);

impl tonic::server::UnaryService<RateLimitRequest> for Unary {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let peer = Arc::clone(&self.0);
        Box::pin(async move {
            peer.decide(request.into_inner())
                .await
                .map(tonic::Response::new)
        })
    }
}

impl<B> tonic::codegen::Service<tonic::codegen::http::Request<B>> for Service
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        if req.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(async {
                Ok(tonic::Status::unimplemented("no such method").into_http())
            });
        }
        let peer = Arc::clone(&self.0);
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<RateLimitResponse, RateLimitRequest>::default();
            Ok(tonic::server::Grpc::new(codec)
                .unary(Unary(peer), req)
                .await)
        })
    }
}

struct Args {
    listen: SocketAddr,
    redis: String,
    cached: bool,
}

fn args() -> Result<Args, String> {
    let (mut listen, mut redis, mut mode) = (None, None, None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => listen = Some(value),
            "--redis" => redis = Some(value),
            "--mode" => mode = Some(value),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let listen = listen
        .unwrap_or_else(|| "127.0.0.1:8081".into())
        .parse()
        .map_err(|e| format!("--listen: {e}"))?;
    let cached = match mode.as_deref().unwrap_or("exact") {
        "exact" => false,
        "cached" => true,
        other => return Err(format!("--mode {other}: exact or cached")),
    };
    Ok(Args {
        listen,
        redis: redis.unwrap_or_else(|| "redis://127.0.0.1:6379".into()),
        cached,
    })
}

async fn shutdown() {
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

fn fail(message: String) -> ! {
    eprintln!("limitador-peer: {message}");
    std::process::exit(2)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args = args().unwrap_or_else(|e| fail(e));
    let limiter = if args.cached {
        let storage = CachedRedisStorage::new(&args.redis)
            .await
            .unwrap_or_else(|e| fail(format!("Redis at {}: {e}", args.redis)));
        AsyncRateLimiter::new_with_storage(Box::new(storage))
    } else {
        let storage = AsyncRedisStorage::new(&args.redis)
            .await
            .unwrap_or_else(|e| fail(format!("Redis at {}: {e}", args.redis)));
        AsyncRateLimiter::new_with_storage(Box::new(storage))
    };
    for limit in limits() {
        limiter.add_limit(limit);
    }
    let service = Service(Arc::new(Peer { limiter }));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .unwrap_or_else(|e| fail(format!("cannot listen on {}: {e}", args.listen)));
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let stopping = Arc::new(tokio::sync::Notify::new());
    let told = Arc::clone(&stopping);
    let serve = tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, async move {
            shutdown().await;
            told.notify_one();
        });
    // A client that keeps its connection open does not hold the stop for
    // more than a second.
    tokio::select! {
        served = serve => {
            if let Err(e) = served {
                fail(format!("serving: {e}"));
            }
        }
        () = async {
            stopping.notified().await;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        } => {}
    }
}
