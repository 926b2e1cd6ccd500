//! `Application::build(config)`: the bound listener and the server, used by
//! `main` and by the tests (which bind port 0).

use std::cell::{Cell, RefCell};
use std::future::{ready, Future, Ready};
use std::net::TcpListener;
use std::path::PathBuf;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::body::{BodySize, BoxBody, EitherBody, MessageBody};
use actix_web::dev::{
    Payload, Server, ServerHandle, Service, ServiceRequest, ServiceResponse, Transform,
};
use actix_web::error::PayloadError;
use actix_web::middleware::DefaultHeaders;
use actix_web::web::Bytes;
use actix_web::{web, App, Error, HttpMessage, HttpResponse, HttpServer};
use futures_util::future::{Either, MapOk, TryFutureExt};
use futures_util::Stream;

use crate::config::SmsProvider;
use crate::config::{self, Config};
use crate::site::session::{self, Secret};
use crate::site::sms::{LogSender, Outbox, SmsSender};
use crate::site::store::Store;
use crate::site::{self, Site};
use floodgate::limiter::LimiterError;
use floodgate::metrics::Metrics;
use floodgate::rule::Region;
use floodgate::Filter;
use floodgate::SetupError;

/// Why the application could not start.
#[derive(Debug)]
pub enum StartError {
    /// The listen address could not be bound.
    Bind(String, std::io::Error),
    /// The Redis client or the dispatcher threads could not be set up.
    Limiter(floodgate::limiter::LimiterError),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Bind(addr, e) => write!(f, "cannot listen on {addr}: {e}"),
            StartError::Limiter(e) => write!(f, "cannot set up the limiter: {e}"),
        }
    }
}

impl std::error::Error for StartError {}

/// A bound, not yet running, floodgate site.
pub struct Application {
    port: u16,
    server: Server,
    filter: Filter,
    region: Arc<RwLock<Region>>,
    config_path: PathBuf,
}

impl Application {
    /// Binds `config.server.bind` (port 0 picks a free port) and builds the server.
    pub fn build(config: Config) -> Result<Application, StartError> {
        Application::build_with(config, |_| {})
    }

    /// As [`Application::build`], with extra routes registered beside the
    /// site's (behind the same filter): how an app embeds floodgate, and how
    /// tests add a handler that echoes what it received.
    pub fn build_with<F>(config: Config, extra_routes: F) -> Result<Application, StartError>
    where
        F: Fn(&mut web::ServiceConfig) + Clone + Send + 'static,
    {
        let listener = TcpListener::bind(&config.server.bind)
            .map_err(|e| StartError::Bind(config.server.bind.clone(), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| StartError::Bind(config.server.bind.clone(), e))?;
        let port = local.port();
        if let Some(warning) = outbox_warning(&config, local.ip()) {
            log::warn!("{warning}");
        }
        let metrics = Arc::new(Metrics::default());
        let title = config.site.title.clone();
        let secret = Secret::new(&config.server.secret)
            .map_err(|e| StartError::Limiter(LimiterError::Other(format!("no randomness: {e}"))))?;
        let cookie_secret = secret.clone();
        let filter = Filter::builder()
            .config(&config.filter)
            .metrics(Arc::clone(&metrics))
            // The site's JSON API reads `application/json` only (and needs
            // no other setting of `web::JsonConfig`'s).
            .json_content_type_required(true)
            .denial_page(move |denial| site::pages::denial_html(&title, denial))
            // `session` rules key by the account a valid cookie names.
            .session_lookup(move |req| {
                let value = req.cookie(session::COOKIE)?;
                session::read_cookie_value(&cookie_secret, value).and_then(|c| c.account)
            })
            // The operators' API is never rate limited nor counted.
            .unguarded(site::admin::PATH)
            .build()
            .map_err(|e| match e {
                SetupError::Limiter(e) => StartError::Limiter(e),
                other => StartError::Limiter(LimiterError::Other(other.to_string())),
            })?;
        let workers = config.server.workers;
        let max_form = config.filter.server.max_form;
        let body_timeout = BodyTimeout::new(config.server.body_timeout);
        let config_path = config.filter.path.clone();
        let store = Store::new(&config.filter.redis.key_prefix, secret.clone())
            .clustered(!config.filter.redis.cluster.is_empty());
        let outbox = (config.sms.provider == SmsProvider::Outbox).then(|| {
            Arc::new(Outbox {
                key: store.outbox_key(),
            })
        });
        let sms: Arc<dyn SmsSender> = match &outbox {
            Some(o) => Arc::clone(o) as Arc<dyn SmsSender>,
            None => Arc::new(LogSender),
        };
        let region = Arc::new(RwLock::new(config.filter.region));
        let site = web::Data::new(Site {
            region: Arc::clone(&region),
            config,
            filter: filter.clone(),
            history: site::history::History::start(Arc::clone(&metrics)),
            metrics,
            secret,
            store,
            sms,
            outbox,
            hashing: site::password::Hashing::default(),
        });
        let app_filter = filter.clone();
        let mut server = HttpServer::new(move || {
            App::new()
                .app_data(site.clone())
                .app_data(web::FormConfig::default().limit(max_form))
                .configure(extra_routes.clone())
                .configure(site::routes)
                .default_service(web::to(site::pages::not_found))
                .wrap(app_filter.clone())
                .wrap(actix_web::middleware::from_fn(api_answers_json))
                .wrap(body_timeout)
                .wrap(actix_web::middleware::from_fn(no_store_by_default))
                .wrap(security_headers())
        })
        .shutdown_timeout(10)
        .disable_signals();
        if workers > 0 {
            server = server.workers(workers);
        }
        let server = server
            .listen(listener)
            .map_err(|e| StartError::Bind(format!("port {port}"), e))?
            .run();
        Ok(Application {
            port,
            server,
            filter,
            region,
            config_path,
        })
    }

    /// The port actually bound.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The filter (to read or replace rules).
    pub fn filter(&self) -> Filter {
        self.filter.clone()
    }

    /// What SIGHUP does, to call directly.
    pub fn reloader(&self) -> Reloader {
        Reloader {
            filter: self.filter.clone(),
            region: Arc::clone(&self.region),
            path: self.config_path.clone(),
        }
    }

    /// A handle to stop the server.
    pub fn handle(&self) -> ServerHandle {
        self.server.handle()
    }

    /// Serves until stopped through [`Application::handle`]. Installs no
    /// signal handlers (tests embed it).
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        self.server.await
    }

    /// Serves as the `floodgate` command does: SIGTERM and Ctrl-C (SIGINT)
    /// stop accepting and finish in-flight requests; SIGHUP reloads the
    /// rules from the same file.
    pub async fn run_with_signals(self) -> std::io::Result<()> {
        #[cfg(unix)]
        {
            actix_rt::spawn(reload_on_sighup(self.reloader()));
            actix_rt::spawn(stop_on_signals(self.server.handle()));
        }
        self.server.await
    }
}

/// What to say at startup when the outbox (everyone's codes) can be
/// reached from other machines: it is on and the site listens on an
/// address that is not loopback.
pub fn outbox_warning(config: &Config, bound: std::net::IpAddr) -> Option<String> {
    if config.sms.provider != SmsProvider::Outbox || bound.to_canonical().is_loopback() {
        return None;
    }
    Some(if config.site.public_outbox {
        format!(
            "[sms] provider = \"outbox\" with [site] public_outbox = true on {bound}: anyone who reaches the site can read every code at /dev/outbox and sign in as its phone's owner; use it for demos only"
        )
    } else {
        format!(
            "[sms] provider = \"outbox\" on {bound}: the codes are not texted to anyone; /dev/outbox shows them to loopback clients only (others get 404), so only this machine can read them"
        )
    })
}

/// actix-server would stop at once on SIGINT; we finish in-flight requests
/// on SIGINT as on SIGTERM.
#[cfg(unix)]
async fn stop_on_signals(handle: ServerHandle) {
    use actix_rt::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        log::warn!("cannot listen for SIGTERM/SIGINT");
        return;
    };
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    log::info!("{name}: finishing in-flight requests, then stopping");
    handle.stop(true).await;
}

/// Headers every response carries: no framing, no sniffing, scripts and
/// styles only from this site.
/// The JSON API answers JSON: a request to it that does not ask for HTML
/// is taken as asking for JSON (an app's HTTP client often sends no
/// `Accept`, or `*/*`), so that its denials are the 429 JSON rather than a
/// redirect to the error page. Runs before the filter.
async fn api_answers_json(
    mut req: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl MessageBody>,
) -> Result<actix_web::dev::ServiceResponse<impl MessageBody>, Error> {
    if req.path().starts_with("/api/sms/") && !floodgate::accepts(req.request(), "text/html") {
        req.headers_mut().insert(
            actix_web::http::header::ACCEPT,
            actix_web::http::header::HeaderValue::from_static("application/json"),
        );
    }
    next.call(req).await
}

/// Every answer but a static file's is about one visitor (their session,
/// their codes, their usage of the limits): none is kept by a cache,
/// unless its handler said otherwise.
async fn no_store_by_default(
    req: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl MessageBody>,
) -> Result<actix_web::dev::ServiceResponse<impl MessageBody>, Error> {
    let static_file = req.path().starts_with("/static/");
    let mut res = next.call(req).await?;
    let cache_control = actix_web::http::header::CACHE_CONTROL;
    if !static_file && !res.headers().contains_key(&cache_control) {
        res.headers_mut().insert(
            cache_control,
            actix_web::http::header::HeaderValue::from_static("no-store"),
        );
    }
    Ok(res)
}

fn security_headers() -> DefaultHeaders {
    DefaultHeaders::new()
        .add((
            "Content-Security-Policy",
            "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
        ))
        .add(("X-Content-Type-Options", "nosniff"))
        .add(("X-Frame-Options", "DENY"))
        .add(("Referrer-Policy", "same-origin"))
}

/// What SIGHUP reloads from the configuration file: `[defaults]` and
/// `[[rule]]`, and with `[defaults] region` the site's own reading of the
/// phone numbers people type (so that the site and the rules keep agreeing
/// on what one number is). Cloned into the signal task; tests call it directly.
#[derive(Clone)]
pub struct Reloader {
    filter: Filter,
    region: Arc<RwLock<Region>>,
    path: PathBuf,
}

impl Reloader {
    /// Re-reads the file; the old rules stay in force when it does not
    /// validate. Returns the number of rules now in force.
    pub fn reload(&self) -> Result<usize, config::ConfigError> {
        // The whole file must validate, though only the rules and the
        // region are taken. They are put in force one after the other: a
        // request already under way may meet the old rules and the new
        // region, as it may meet the old rules for its whole life.
        let config = Config::load_file(&self.path)?;
        let n = config.filter.rules.len();
        match self.region.write() {
            Ok(mut r) => *r = config.filter.region,
            Err(p) => *p.into_inner() = config.filter.region,
        }
        self.filter.replace_rules(config.filter.rules);
        Ok(n)
    }
}

#[cfg(unix)]
async fn reload_on_sighup(reloader: Reloader) {
    use actix_rt::signal::unix::{signal, SignalKind};
    let mut hangups = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            log::warn!("cannot listen for SIGHUP, rules will not reload: {e}");
            return;
        }
    };
    while hangups.recv().await.is_some() {
        match reloader.reload() {
            Ok(n) => log::info!(
                "SIGHUP: reloaded {n} rules from {}",
                reloader.path.display()
            ),
            Err(e) => log::error!("SIGHUP: kept the old rules: {e}"),
        }
    }
}

/// Bounds how long a request body may take to arrive: a body not fully
/// received `timeout` after its head gets `408 Request Timeout` and the
/// connection is closed. actix-web's own `client_request_timeout` covers
/// only the head, so a client that announces `Content-Length: 100` and
/// sends 7 bytes would otherwise hold a connection (and a handler, or the
/// filter reading a `form:` key) for as long as it likes.
///
/// Wrap it outside everything that reads bodies (the rate-limit filter
/// reads form bodies itself). It wraps the request's payload stream: a read
/// still waiting when the time is up fails, and the response, whatever the
/// reader made of that failure, is replaced by the 408. Requests without a
/// body pass untouched; a body read in time never starts a timer.
///
/// A body still unfinished when the response leaves (timed out, or never
/// read by the handler) is kept open until the response is written, so that
/// actix-http closes the connection after it instead of reading on, for as
/// long as the client likes, to drain a chunked body.
#[derive(Debug, Clone, Copy)]
pub struct BodyTimeout {
    timeout: Duration,
}

impl BodyTimeout {
    /// Bodies must arrive within `timeout` of the request head.
    pub fn new(timeout: Duration) -> BodyTimeout {
        BodyTimeout { timeout }
    }
}

impl<S, B> Transform<S, ServiceRequest> for BodyTimeout
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Transform = BodyTimeoutService<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(BodyTimeoutService {
            service: Rc::new(service),
            timeout: self.timeout,
        }))
    }
}

/// The per-worker service [`BodyTimeout`] builds.
#[doc(hidden)]
pub struct BodyTimeoutService<S> {
    service: Rc<S>,
    timeout: Duration,
}

type Left<B> = fn(ServiceResponse<B>) -> ServiceResponse<EitherBody<B>>;

/// Where a timed body stands; shared by the payload stream and the middleware.
struct BodyState {
    /// The request's own payload.
    payload: RefCell<Payload>,
    /// The payload ended (or failed on its own).
    finished: Cell<bool>,
    /// The deadline failed a read.
    expired: Cell<bool>,
}

/// A response body that holds an unfinished request payload open until the
/// body has been written: actix-http decides whether to close for an
/// unread payload when the response body ends, and closes only if the
/// payload's reader still exists (see [`BodyTimeout`]).
struct HoldingPayload {
    body: BoxBody,
    _payload: Rc<BodyState>,
}

impl MessageBody for HoldingPayload {
    type Error = Box<dyn std::error::Error>;

    fn size(&self) -> BodySize {
        self.body.size()
    }

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        Pin::new(&mut self.body).poll_next(cx)
    }
}

/// `res` with its body holding `state` open (see [`HoldingPayload`]).
fn holding_payload<In: MessageBody + 'static, B>(
    res: ServiceResponse<In>,
    state: Rc<BodyState>,
) -> ServiceResponse<EitherBody<B>> {
    res.map_body(|_, body| {
        BoxBody::new(HoldingPayload {
            body: BoxBody::new(body),
            _payload: state,
        })
    })
    .map_into_right_body()
}

impl<S, B> Service<ServiceRequest> for BodyTimeoutService<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    #[allow(clippy::type_complexity)]
    type Future = Either<
        MapOk<S::Future, Left<B>>,
        Pin<Box<dyn Future<Output = Result<Self::Response, Error>>>>,
    >;

    actix_web::dev::forward_ready!(service);

    fn call(&self, mut req: ServiceRequest) -> Self::Future {
        let payload = req.take_payload();
        if matches!(payload, Payload::None) {
            let left: Left<B> = ServiceResponse::map_into_left_body;
            return Either::Left(self.service.call(req).map_ok(left));
        }
        let state = Rc::new(BodyState {
            payload: RefCell::new(payload),
            finished: Cell::new(false),
            expired: Cell::new(false),
        });
        req.set_payload(Payload::Stream {
            payload: Box::pin(TimedPayload {
                state: Rc::clone(&state),
                deadline: tokio::time::Instant::now() + self.timeout,
                sleep: None,
            }),
        });
        // (No clone of the HttpRequest may be held across the call: the
        // router needs it unshared. The 408 takes it back from the response.)
        let timeout = self.timeout;
        let answer = self.service.call(req);
        Either::Right(Box::pin(async move {
            let result = answer.await;
            if !state.expired.get() {
                let res = result?;
                if state.finished.get() {
                    return Ok(res.map_into_left_body());
                }
                return Ok(holding_payload(res, state));
            }
            let what = "the request body did not arrive in time\n";
            let res = match result {
                Ok(res) => res,
                // Errors become responses in actix-web's handlers; should one
                // arrive here, it still answers 408.
                Err(_) => {
                    return Err(actix_web::error::InternalError::new(
                        what,
                        actix_web::http::StatusCode::REQUEST_TIMEOUT,
                    )
                    .into())
                }
            };
            let (request, _) = res.into_parts();
            log::info!(
                "{} {}: the body did not arrive within {}, 408",
                request.method(),
                request.path(),
                config::format_duration(timeout)
            );
            let response = HttpResponse::RequestTimeout()
                .force_close()
                .content_type("text/plain; charset=utf-8")
                .body(what);
            Ok(holding_payload(
                ServiceResponse::new(request, response),
                state,
            ))
        }))
    }
}

/// A request payload that fails once its deadline has passed while a read
/// is still waiting for data.
struct TimedPayload {
    state: Rc<BodyState>,
    deadline: tokio::time::Instant,
    /// Started the first time a read has to wait.
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

fn body_timed_out() -> PayloadError {
    PayloadError::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the request body did not arrive in time",
    ))
}

impl Stream for TimedPayload {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let state = &*this.state;
        if state.expired.get() {
            return Poll::Ready(Some(Err(body_timed_out())));
        }
        let polled = Pin::new(&mut *state.payload.borrow_mut()).poll_next(cx);
        match polled {
            Poll::Ready(Some(Ok(chunk))) => return Poll::Ready(Some(Ok(chunk))),
            Poll::Ready(other) => {
                state.finished.set(true);
                return Poll::Ready(other);
            }
            Poll::Pending => {}
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                state.expired.set(true);
                Poll::Ready(Some(Err(body_timed_out())))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
