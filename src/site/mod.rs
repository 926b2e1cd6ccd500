//! The demo site: pages that show the filter at work, plus the operational
//! endpoints (`/healthz`, `/readyz`, `/metrics`).

pub mod account;
pub mod admin;
pub mod api;
mod codes;
pub mod dashboard;
pub mod forms;
pub mod history;
pub mod pages;
pub mod password;
pub mod phone;
pub mod reset;
pub mod session;
pub mod signin;
pub mod sms;
pub mod startup;
pub mod store;

pub use self::startup::{Application, Reloader, StartError};

use std::sync::{Arc, RwLock};

use actix_web::cookie::Cookie;
use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};

use crate::config::Config;
use floodgate::limiter::RedisConn;
use floodgate::metrics::Metrics;
use floodgate::rule::Region;
use floodgate::Filter;

/// What every handler can reach (`web::Data<Site>`).
pub struct Site {
    /// The configuration the site was started with.
    pub config: Config,
    /// `[defaults] region` as last (re)loaded: how phone fields are read.
    pub region: Arc<RwLock<Region>>,
    /// The filter (its rules are the ones in force, after reloads).
    pub filter: Filter,
    /// Process counters.
    pub metrics: Arc<Metrics>,
    /// Key for cookies, CSRF tokens and code hashes.
    pub secret: session::Secret,
    /// Accounts, codes and sessions in Redis.
    pub store: store::Store,
    /// Where SMS go.
    pub sms: Arc<dyn sms::SmsSender>,
    /// The outbox, when `[sms] provider = "outbox"`.
    pub outbox: Option<Arc<sms::Outbox>>,
    /// The bound on password hashes running at once.
    pub hashing: password::Hashing,
    /// Decisions per rule by the minute, for the operators' page.
    pub history: Arc<history::History>,
}

impl Site {
    /// The region whose conventions read phone numbers written without
    /// `+`: the one the rules in force use.
    pub fn region(&self) -> Region {
        match self.region.read() {
            Ok(r) => *r,
            Err(p) => *p.into_inner(),
        }
    }

    /// The client's address as far as it can be told: the TCP peer, or
    /// behind trusted proxies the address their forwarding header names.
    /// `None` when the header names no client: a hop the proxy could not
    /// name (`unknown`, `_hidden`, garbage) or only trusted hops, so that
    /// the walk stopped at a trusted proxy's own address, which says
    /// nothing about who is asking. A trusted proxy's own request (no
    /// forwarding header) is from its address. Whatever answers only some
    /// addresses (the outbox, the admin API) asks this, and it fails
    /// closed: a trusted peer's request carrying either forwarding header
    /// names no client unless `proxy_header`'s names one beyond the trusted
    /// hops. (The rules' keys read only `proxy_header`'s; here a request
    /// that carries only the other one most likely comes through a proxy
    /// that writes that one, and `proxy_header` is set wrong: it must not
    /// pass for the proxy's own request from a loopback address.)
    pub fn named_client(&self, req: &HttpRequest) -> Option<std::net::IpAddr> {
        let client = self.filter.client_addr(req).to_canonical();
        let headers = req.headers();
        let forwarded =
            headers.contains_key("forwarded") || headers.contains_key("x-forwarded-for");
        (!forwarded || !self.filter.is_trusted_proxy(client)).then_some(client)
    }

    /// The site title.
    pub fn title(&self) -> String {
        self.config.site.title.clone()
    }

    /// Runs blocking Redis work on the blocking pool with a pooled connection.
    ///
    /// The checkout hands out only a connection Redis answers on: one that
    /// sat idle is checked with a PING first, and a dead one (Redis restarted
    /// or closed it meanwhile) is replaced before `work` sees it. `work` is
    /// run once and never repeated: it may write several keys, and after a
    /// failure nobody can tell which of its commands ran. A connection that
    /// saw an I/O error is dropped instead of going back to the pool.
    pub async fn redis<T, F>(&self, work: F) -> Result<T, SiteError>
    where
        F: FnOnce(&mut RedisConn) -> redis::RedisResult<T> + Send + 'static,
        T: Send + 'static,
    {
        self.filter
            .limiter()
            .with_redis(work)
            .await
            .map_err(|e| SiteError::unavailable(e.to_string()))?
            .map_err(|e| SiteError::unavailable(format!("redis: {e}")))
    }
}

/// A failure the user cannot fix: logged in full, shown as an opaque page.
#[derive(Debug)]
pub struct SiteError {
    status: StatusCode,
    detail: String,
}

impl SiteError {
    /// Redis (or another dependency) failed: 503.
    pub fn unavailable(detail: String) -> SiteError {
        SiteError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            detail,
        }
    }

    /// A bug or an OS failure: 500.
    pub fn internal(detail: String) -> SiteError {
        SiteError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            detail,
        }
    }
}

impl std::fmt::Display for SiteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.detail)
    }
}

impl ResponseError for SiteError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        self.logged()
            .content_type("text/plain; charset=utf-8")
            .body("Something went wrong on our side. Please try again in a moment.\n")
    }
}

impl SiteError {
    /// The answer for a JSON client: `{"error":"unavailable"}` (503) or
    /// `{"error":"internal"}` (500), logged as the page is.
    pub fn json_response(&self) -> HttpResponse {
        let what = match self.status {
            StatusCode::SERVICE_UNAVAILABLE => "unavailable",
            _ => "internal",
        };
        self.logged()
            .insert_header((header::CACHE_CONTROL, "no-store"))
            .json(serde_json::json!({ "error": what }))
    }

    /// Logs the failure (a repeated one once in a while) and starts its
    /// answer: the status, and `Retry-After: 1` on a 503.
    fn logged(&self) -> actix_web::HttpResponseBuilder {
        crate::repeated!(
            &crate::log_kinds::SITE_ERROR,
            "{}",
            floodgate::logging::Escaped(&self.to_string())
        );
        let mut res = HttpResponse::build(self.status);
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            res.insert_header((header::RETRY_AFTER, "1"));
        }
        res
    }
}

/// Who is asking: the session (a new anonymous one when there is no valid
/// cookie) and the signed-in account, if Redis still holds the session.
pub struct Visitor {
    /// Session ID.
    pub sid: String,
    /// Signed-in account ID.
    pub account: Option<String>,
    /// Signed-in phone (E.164).
    pub phone: Option<String>,
    /// Whether the request carried a valid cookie (POSTs need one).
    pub had_cookie: bool,
    set_cookie: Option<Cookie<'static>>,
}

impl Visitor {
    /// Reads the session cookie and checks a signed-in session in Redis.
    pub async fn of(site: &Site, req: &HttpRequest) -> Result<Visitor, SiteError> {
        let secure = site.config.site.secure_cookies;
        let Some(cookie) = session::read_cookie(&site.secret, req) else {
            let sid = session::new_sid().map_err(|e| SiteError::internal(e.to_string()))?;
            let value = session::cookie_value(&site.secret, &sid, None);
            return Ok(Visitor {
                sid,
                account: None,
                phone: None,
                had_cookie: false,
                set_cookie: Some(session::cookie(value, secure)),
            });
        };
        let mut visitor = Visitor {
            sid: cookie.sid.clone(),
            account: None,
            phone: None,
            had_cookie: true,
            set_cookie: None,
        };
        if let Some(account) = cookie.account {
            let store = site.store.clone();
            let (sid, id) = (cookie.sid.clone(), account.clone());
            match site
                .redis(move |conn| store.session_phone(conn, &sid, &id))
                .await?
            {
                Some(phone) => {
                    visitor.account = Some(account);
                    visitor.phone = Some(phone);
                }
                None => {
                    // Signed out elsewhere (e.g. by a password reset).
                    let value = session::cookie_value(&site.secret, &cookie.sid, None);
                    visitor.set_cookie = Some(session::cookie(value, secure));
                }
            }
        }
        Ok(visitor)
    }

    /// Whether someone is signed in.
    pub fn signed_in(&self) -> bool {
        self.account.is_some()
    }

    /// The signed-in account's ID.
    pub fn account_id(&self) -> Option<String> {
        self.account.clone()
    }

    /// The CSRF token for this session's forms.
    pub fn csrf(&self, site: &Site) -> String {
        session::csrf_token(&site.secret, &self.sid)
    }

    /// Adds the session cookie to a response when it is new or changed.
    pub fn respond(&self, mut res: HttpResponse) -> HttpResponse {
        if let Some(c) = &self.set_cookie {
            if let Err(e) = res.add_cookie(c) {
                crate::repeated!(
                    &crate::log_kinds::SITE_ERROR,
                    "cannot set the session cookie: {}",
                    floodgate::logging::Escaped(&e.to_string())
                );
            }
        }
        res
    }
}

/// Registers every route of the site.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/", page().to(pages::home))
        .route("/check", page().to(pages::check))
        .route("/login", page().to(signin::login_form))
        .route("/sms/send", web::post().to(signin::send_code))
        .route("/login/sms", web::post().to(signin::login_sms))
        .route("/login/password", web::post().to(signin::login_password))
        .route("/logout", web::post().to(signin::logout))
        .route("/account", page().to(account::account))
        .route("/account/password", web::post().to(account::set_password))
        .route("/password/reset", page().to(reset::reset_form))
        .route("/password/reset", web::post().to(reset::reset_request))
        .route(
            "/password/reset/confirm",
            web::post().to(reset::reset_confirm),
        )
        // A form's target asked for as a page (a "back" link, a reload of
        // the answer's address): the page of the form.
        .route("/sms/send", page().to(|| see_other("/login")))
        .route("/login/sms", page().to(|| see_other("/login")))
        .route("/login/password", page().to(|| see_other("/login")))
        .route("/logout", page().to(|| see_other("/")))
        .route("/account/password", page().to(|| see_other("/account")))
        .route(
            "/password/reset/confirm",
            page().to(|| see_other("/password/reset")),
        )
        .route("/limits", page().to(dashboard::limits))
        .route("/dev/outbox", page().to(dashboard::outbox))
        .route("/err", page().to(pages::error_page))
        .route("/api/ping", page().to(api_ping))
        .route("/api/sms/send", web::post().to(api::send_code))
        // Load balancers probe with HEAD as well as GET.
        .route("/healthz", page().to(healthz))
        .route("/readyz", page().to(readyz))
        .route("/metrics", page().to(metrics))
        .route("/static/{file}", page().to(static_file));
    // Any other method on a known address: 405, naming the methods it takes.
    const PAGE: &str = "GET, HEAD";
    const FORM: &str = "GET, HEAD, POST";
    for (path, allow) in [
        ("/", PAGE),
        ("/check", PAGE),
        ("/login", PAGE),
        ("/sms/send", FORM),
        ("/login/sms", FORM),
        ("/login/password", FORM),
        ("/logout", FORM),
        ("/account", PAGE),
        ("/account/password", FORM),
        ("/password/reset", FORM),
        ("/password/reset/confirm", FORM),
        ("/limits", PAGE),
        ("/dev/outbox", PAGE),
        ("/err", PAGE),
        ("/api/ping", PAGE),
        ("/api/sms/send", "POST"),
        ("/healthz", PAGE),
        ("/readyz", PAGE),
        ("/metrics", PAGE),
        ("/static/{file}", PAGE),
    ] {
        cfg.route(path, web::route().to(move || method_not_allowed(allow)));
    }
    admin::routes(cfg);
}

/// `405 Method Not Allowed`, with the methods the address takes.
async fn method_not_allowed(allow: &'static str) -> HttpResponse {
    HttpResponse::MethodNotAllowed()
        .insert_header((header::ALLOW, allow))
        .content_type("text/plain; charset=utf-8")
        .body("method not allowed\n")
}

/// A page's route: GET, and HEAD, answered as GET is without the body
/// (as link checkers and uptime probes ask).
fn page() -> actix_web::Route {
    web::route().guard(crate::get_or_head())
}

/// `303 See Other` to `path`.
async fn see_other(path: &'static str) -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, path))
        .finish()
}

async fn api_ping() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({ "ok": true }))
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; charset=utf-8")
        .body("ok\n")
}

/// 200 when Redis answers PING within the timeout, else 503.
async fn readyz(site: web::Data<Site>) -> HttpResponse {
    match site.filter.limiter().ready().await {
        Ok(()) => HttpResponse::Ok()
            .content_type("text/plain; charset=utf-8")
            .body("ready\n"),
        Err(e) => {
            crate::repeated!(
                &crate::log_kinds::READYZ,
                "readyz: {}",
                floodgate::logging::Escaped(&e.to_string())
            );
            HttpResponse::ServiceUnavailable()
                .content_type("text/plain; charset=utf-8")
                .body("redis unavailable\n")
        }
    }
}

async fn metrics(site: web::Data<Site>) -> HttpResponse {
    let mut text = site.metrics.render(site.filter.limiter().error_count());
    text.push_str(&site.hashing.render());
    // Bans and overrides in force: read from Redis's operator records at
    // each scrape; left out while Redis does not answer.
    let known = crate::listings::known(&site.filter.rules());
    let prefix = &site.config.filter.redis.key_prefix;
    if let Some(gauges) =
        crate::listings::active_gauges(site.filter.limiter(), prefix, &known).await
    {
        text.push_str(&gauges);
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(text)
}

const STATIC_FILES: &[(&str, &str, &str)] = &[
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("../../static/style.css"),
    ),
    (
        "countdown.js",
        "text/javascript; charset=utf-8",
        include_str!("../../static/countdown.js"),
    ),
    (
        "admin.js",
        "text/javascript; charset=utf-8",
        include_str!("../../static/admin.js"),
    ),
];

/// The stylesheet and scripts, compiled into the binary so it runs from anywhere.
async fn static_file(req: HttpRequest) -> HttpResponse {
    let name = req.match_info().get("file").unwrap_or_default();
    match STATIC_FILES.iter().find(|(n, _, _)| *n == name) {
        Some((_, mime, body)) => HttpResponse::Ok()
            .content_type(*mime)
            .insert_header((header::CACHE_CONTROL, "public, max-age=300"))
            .body(*body),
        None => pages::not_found(req).await,
    }
}
