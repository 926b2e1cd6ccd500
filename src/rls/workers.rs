//! The gRPC listener's threads: one single-threaded runtime per core, each
//! serving the connections the acceptor deals it in turn.
//!
//! A call is read, decided and answered on one thread: its decision joins
//! that thread's batch for Redis (the limiter's worker lane, as on an
//! actix worker) and the answer wakes a task of the same thread. On a
//! work-stealing runtime the same call would wake other threads several
//! times (a task stolen, a flush run elsewhere, an answer delivered
//! across), and each wake-up of a sleeping thread costs more than the
//! decision itself on a small virtual machine: serving on one runtime per
//! core measured 15% more calls per second with no limit and 2 to 4 µs
//! less of the service's CPU per call (with a limit, the gain was within
//! that machine's noise).
//!
//! Envoy keeps a few long-lived HTTP/2 connections per proxy, each carrying
//! many calls; dealing them in turn spreads them evenly.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tonic_health::pb::health_server::{Health, HealthServer};

use super::proto::RateLimitServer;
use super::service::Rls;
use super::ServeError;

/// How long the acceptor waits after a failed accept (out of file
/// descriptors, say) before it tries again.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// The most `ShouldRateLimit` calls read and decided at once, over every
/// connection: far above what a busy service holds (tens of thousands of
/// calls a second, each answered within milliseconds, or at once while
/// the breaker is open), and with [`MAX_REQUEST_BYTES`](super::proto::MAX_REQUEST_BYTES) a bound on what
/// calls whose bodies never finish can hold (256 MiB).
const MAX_CALLS_IN_FLIGHT: usize = 1024;

/// The most calls one HTTP/2 connection carries at once (Envoy opens
/// another connection past it).
const MAX_STREAMS_PER_CONNECTION: u32 = 1024;

/// The longest a call may take, its request's bytes included: a client
/// that starts a call and never finishes it loses it then. Far beyond
/// any decision (at most a few times the Redis timeout).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How often an idle connection is pinged, and how long its answer may
/// take before the connection is dropped (a peer that vanished).
const KEEPALIVE: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(10));

/// Serves gRPC on `listener` until `stop` resolves, then stops accepting
/// and lets every thread finish its calls in flight, for `grace` at most.
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    rls: &Arc<Rls>,
    health: HealthServer<impl Health>,
    grace: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (stopping, stopped) = tokio::sync::watch::channel(false);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_CALLS_IN_FLIGHT));
    let mut deal = Vec::with_capacity(threads);
    let mut ended = Vec::with_capacity(threads);
    for i in 0..threads {
        let (conns, incoming) = tokio::sync::mpsc::unbounded_channel();
        let (done, end) = tokio::sync::oneshot::channel();
        let (rls, health, stopped) = (Arc::clone(rls), health.clone(), stopped.clone());
        let in_flight = Arc::clone(&in_flight);
        std::thread::Builder::new()
            .name(format!("floodgate-rls-{i}"))
            .spawn(move || {
                let server = RateLimitServer::new(rls, in_flight);
                let _ = done.send(run(incoming, server, health, stopped, grace));
            })
            .map_err(|e| ServeError::Other(format!("cannot start a gRPC thread: {e}")))?;
        deal.push(conns);
        ended.push(end);
    }
    tokio::pin!(stop);
    let mut next = 0;
    loop {
        let accepted = tokio::select! {
            () = &mut stop => break,
            accepted = listener.accept() => accepted,
        };
        let conn = match accepted.and_then(|(conn, _)| {
            conn.set_nodelay(true)?;
            conn.into_std()
        }) {
            Ok(conn) => conn,
            Err(e) => {
                log::warn!("rls: cannot accept a connection: {e}");
                tokio::time::sleep(ACCEPT_PAUSE).await;
                continue;
            }
        };
        // The next thread still serving takes it; a thread that is gone
        // ended with an error, reported below once every other has ended.
        let (mut conn, mut dealt) = (conn, false);
        for _ in 0..threads {
            let to = next % threads;
            next += 1;
            match deal[to].send(conn) {
                Ok(()) => {
                    dealt = true;
                    break;
                }
                Err(tokio::sync::mpsc::error::SendError(back)) => conn = back,
            }
        }
        if !dealt {
            log::error!("rls: no gRPC thread is serving any more");
            break;
        }
    }
    log::info!("rls: stopping: no new calls; finishing the calls in flight");
    drop(deal);
    let _ = stopping.send(true);
    let mut result = Ok(());
    for end in ended {
        match end.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => result = Err(ServeError::Other(format!("grpc: {e}"))),
            Err(_) => result = Err(ServeError::Other("grpc: a thread panicked".into())),
        }
    }
    result
}

/// One thread's runtime: serves the connections dealt to it until told
/// to stop, then finishes its calls in flight, for `grace` at most.
fn run(
    mut incoming: tokio::sync::mpsc::UnboundedReceiver<std::net::TcpStream>,
    server: RateLimitServer<Rls>,
    health: HealthServer<impl Health>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
    grace: Duration,
) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    runtime.block_on(async move {
        // (Each made a tokio stream here, on the runtime that polls it.)
        let incoming = futures_util::stream::poll_fn(move |cx| incoming.poll_recv(cx))
            .map(tokio::net::TcpStream::from_std);
        let mut told = stopped.clone();
        let serve = tonic::transport::Server::builder()
            .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
            .timeout(CALL_TIMEOUT)
            .http2_keepalive_interval(Some(KEEPALIVE.0))
            .http2_keepalive_timeout(Some(KEEPALIVE.1))
            .add_service(health)
            .add_service(server)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = told.wait_for(|stop| *stop).await;
            });
        // A stop waits for the calls in flight, which end within the Redis
        // timeout; a client that keeps its idle connection open (Envoy
        // does) does not hold the process past that.
        tokio::select! {
            r = serve => r.map_err(|e| e.to_string()),
            () = async {
                let _ = stopped.wait_for(|stop| *stop).await;
                tokio::time::sleep(grace).await;
            } => Ok(()),
        }
    })
}
