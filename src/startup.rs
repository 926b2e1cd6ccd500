//! `Application::build(config)`: the bound listener and the server, used by
//! `main` and by the tests (which bind port 0).

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;

use actix_web::dev::{Server, ServerHandle};
use actix_web::middleware::DefaultHeaders;
use actix_web::{web, App, HttpServer};

use crate::config::SmsProvider;
use crate::config::{self, Config};
use crate::filter::{Filter, FilterOptions};
use crate::limit::{Limiter, LimiterError};
use crate::metrics::Metrics;
use crate::site::session::{self, Secret};
use crate::site::sms::{LogSender, Outbox, SmsSender};
use crate::site::store::Store;
use crate::site::{self, Site};

/// Why the application could not start.
#[derive(Debug)]
pub enum StartError {
    /// The listen address could not be bound.
    Bind(String, std::io::Error),
    /// The Redis client or the dispatcher threads could not be set up.
    Limiter(crate::limit::LimiterError),
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
        let port = listener
            .local_addr()
            .map_err(|e| StartError::Bind(config.server.bind.clone(), e))?
            .port();
        let limiter = Arc::new(Limiter::new(&config.redis).map_err(StartError::Limiter)?);
        let metrics = Arc::new(Metrics::default());
        let title = config.site.title.clone();
        let secret = Secret::new(&config.server.secret)
            .map_err(|e| StartError::Limiter(LimiterError::Redis(format!("no randomness: {e}"))))?;
        let cookie_secret = secret.clone();
        let filter = Filter::new(
            config.rules.clone(),
            Arc::clone(&limiter),
            Arc::clone(&metrics),
            FilterOptions {
                trusted_proxies: config.server.trusted_proxies.clone(),
                max_form: config.server.max_form,
                key_prefix: config.redis.key_prefix.clone(),
                denial_page: Box::new(move |rule, retry| {
                    site::pages::denial_html(&title, rule, retry)
                }),
                // `session` rules key by the account a valid cookie names.
                session: Some(Box::new(move |req| {
                    session::read_cookie(&cookie_secret, req).and_then(|c| c.account)
                })),
            },
        );
        let workers = config.server.workers;
        let max_form = config.server.max_form;
        let config_path = config.path.clone();
        let store = Store::new(&config.redis.key_prefix, secret.clone())
            .clustered(!config.redis.cluster.is_empty());
        let outbox = (config.sms.provider == SmsProvider::Outbox).then(|| {
            Arc::new(Outbox {
                key: store.outbox_key(),
            })
        });
        let sms: Arc<dyn SmsSender> = match &outbox {
            Some(o) => Arc::clone(o) as Arc<dyn SmsSender>,
            None => Arc::new(LogSender),
        };
        let site = web::Data::new(Site {
            config,
            filter: filter.clone(),
            metrics,
            secret,
            store,
            sms,
            outbox,
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
            actix_rt::spawn(reload_on_sighup(
                self.filter.clone(),
                self.config_path.clone(),
            ));
            actix_rt::spawn(stop_on_signals(self.server.handle()));
        }
        self.server.await
    }
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

/// Re-reads `[defaults]` and `[[rule]]` from `path`; the old rules stay in
/// force when the file does not validate.
pub fn reload_rules(filter: &Filter, path: &std::path::Path) -> Result<usize, config::ConfigError> {
    // The whole file must validate, though only the rules are taken.
    let config = Config::load_file(path)?;
    let n = config.rules.len();
    filter.replace_rules(config.rules);
    Ok(n)
}

#[cfg(unix)]
async fn reload_on_sighup(filter: Filter, path: PathBuf) {
    use actix_rt::signal::unix::{signal, SignalKind};
    let mut hangups = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            log::warn!("cannot listen for SIGHUP, rules will not reload: {e}");
            return;
        }
    };
    while hangups.recv().await.is_some() {
        match reload_rules(&filter, &path) {
            Ok(n) => log::info!("SIGHUP: reloaded {n} rules from {}", path.display()),
            Err(e) => log::error!("SIGHUP: kept the old rules: {e}"),
        }
    }
}
