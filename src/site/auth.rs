//! Sign-in by SMS code or password, sign-out, the account page and the
//! password reset: the flows the demo's limits guard.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use askama::Template;
use serde::Deserialize;

use super::phone::{Phone, PHONE_RULE};
use super::session::{self, random_bytes};
use super::store::{Account, CodeCheck, Purpose, CODE_TTL_SECS, MAX_ATTEMPTS};
use super::{Site, SiteError, Visitor};

/// Shortest and longest password accepted (NIST SP 800-63B: at least 8,
/// allow long ones).
const PASSWORD_CHARS: std::ops::RangeInclusive<usize> = 8..=128;

/// Every POST form's fields; all optional so that a missing one is a form
/// error (or a 403 for `csrf`), never an extractor 400 without a page.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Fields {
    phone: Option<String>,
    code: Option<String>,
    password: Option<String>,
    csrf: Option<String>,
}

/// The state of the phone forms (sign-in and reset): what was typed, what
/// happened, what went wrong. Both pages render it.
#[derive(Default)]
pub struct PhoneForm {
    site_title: String,
    signed_in: bool,
    csrf: String,
    phone: String,
    code_sent: bool,
    notice: String,
    error: String,
    phone_error: bool,
}

#[derive(Template)]
#[template(path = "login.html")]
struct LoginPage<'a> {
    form: &'a PhoneForm,
}

#[derive(Template)]
#[template(path = "reset.html")]
struct ResetPage<'a> {
    form: &'a PhoneForm,
}

/// The templates read the form's fields as their own.
impl std::ops::Deref for LoginPage<'_> {
    type Target = PhoneForm;
    fn deref(&self) -> &PhoneForm {
        self.form
    }
}

impl std::ops::Deref for ResetPage<'_> {
    type Target = PhoneForm;
    fn deref(&self) -> &PhoneForm {
        self.form
    }
}

/// Which page shows a [`PhoneForm`].
#[derive(Clone, Copy)]
enum Page {
    Login,
    Reset,
}

impl PhoneForm {
    fn new(site: &Site, visitor: &Visitor, phone: &str) -> PhoneForm {
        PhoneForm {
            site_title: site.title(),
            signed_in: visitor.signed_in(),
            csrf: visitor.csrf(site),
            phone: phone.to_string(),
            ..PhoneForm::default()
        }
    }

    /// The page with this state, with the visitor's cookie when it is new.
    fn show(&self, page: Page, visitor: &Visitor, status: StatusCode) -> HttpResponse {
        let res = match page {
            Page::Login => super::pages::render(&LoginPage { form: self }, status),
            Page::Reset => super::pages::render(&ResetPage { form: self }, status),
        };
        visitor.respond(res)
    }

    /// The page again with an error, as a 400.
    fn refuse(mut self, page: Page, visitor: &Visitor, error: String) -> HttpResponse {
        self.error = error;
        self.show(page, visitor, StatusCode::BAD_REQUEST)
    }
}

#[derive(Template, Default)]
#[template(path = "account.html")]
struct AccountPage {
    site_title: String,
    signed_in: bool,
    csrf: String,
    phone: String,
    has_password: bool,
    notice: String,
    error: String,
}

/// A phone form POST that passed the common checks.
struct PhonePost {
    visitor: Visitor,
    phone: Phone,
    form: PhoneForm,
}

/// What every phone form POST starts with: who is asking, the CSRF check
/// (403) and the phone field (the form again with an error, 400). `Err` is
/// the response to send as it is.
async fn phone_post(
    site: &Site,
    req: &HttpRequest,
    fields: &Fields,
    page: Page,
    code_sent: bool,
) -> Result<Result<PhonePost, HttpResponse>, SiteError> {
    let visitor = Visitor::of(site, req).await?;
    if !csrf_ok(site, &visitor, fields) {
        return Ok(Err(forbidden(site, &visitor)));
    }
    let typed = fields.phone.clone().unwrap_or_default();
    let mut form = PhoneForm::new(site, &visitor, &typed);
    form.code_sent = code_sent;
    match Phone::parse(&typed, site.config.region) {
        Some(phone) => Ok(Ok(PhonePost {
            visitor,
            phone,
            form,
        })),
        None => {
            form.phone_error = true;
            Ok(Err(form.refuse(page, &visitor, PHONE_RULE.into())))
        }
    }
}

/// The opaque answer to a POST without a valid CSRF token.
fn forbidden(site: &Site, visitor: &Visitor) -> HttpResponse {
    super::pages::message(
        site,
        visitor.signed_in(),
        StatusCode::FORBIDDEN,
        "This form has expired",
        "The form was sent without a valid security token. Reload the page and try again.",
    )
}

/// Checks the CSRF token of a POST against the session cookie it came with.
fn csrf_ok(site: &Site, visitor: &Visitor, fields: &Fields) -> bool {
    visitor.had_cookie
        && fields
            .csrf
            .as_deref()
            .is_some_and(|t| session::csrf_ok(&site.secret, &visitor.sid, t))
}

/// Issues a new `purpose` code for `phone` (replacing any earlier one) and
/// texts it. A reset code is texted only when the phone has an account, but
/// the Redis work is the same either way, so the answer tells nothing.
async fn text_code(site: &Site, purpose: Purpose, phone: &Phone) -> Result<(), SiteError> {
    let (store, sms) = (site.store.clone(), Arc::clone(&site.sms));
    let to = phone.clone();
    site.redis(move |conn| {
        let send = match purpose {
            Purpose::SignIn => true,
            Purpose::Reset => store.account(conn, &to)?.is_some(),
        };
        let code = store.issue_code(conn, purpose, &to)?;
        if !send {
            return Ok(());
        }
        let minutes = CODE_TTL_SECS / 60;
        let text = match purpose {
            Purpose::SignIn => {
                format!("Your floodgate sign-in code is {code}. It expires in {minutes} minutes.")
            }
            Purpose::Reset => format!(
                "Your floodgate password reset code is {code}. It expires in {minutes} minutes. If you did not ask for it, ignore this message."
            ),
        };
        sms.send(conn, &to, &text)
    })
    .await
}

/// `GET /login`
pub async fn login_form(
    site: web::Data<Site>,
    req: HttpRequest,
) -> Result<HttpResponse, SiteError> {
    let visitor = Visitor::of(&site, &req).await?;
    let mut form = PhoneForm::new(&site, &visitor, "");
    if req.query_string().contains("reset=done") {
        form.notice = "Your password was changed and every session of the account was signed out. Sign in with the new password.".into();
    }
    Ok(form.show(Page::Login, &visitor, StatusCode::OK))
}

/// `POST /sms/send`: texts a sign-in code.
pub async fn send_code(
    site: web::Data<Site>,
    req: HttpRequest,
    fields: web::Form<Fields>,
) -> Result<HttpResponse, SiteError> {
    let post = match phone_post(&site, &req, &fields, Page::Login, false).await? {
        Ok(post) => post,
        Err(response) => return Ok(response),
    };
    let PhonePost {
        visitor,
        phone,
        mut form,
    } = post;
    text_code(&site, Purpose::SignIn, &phone).await?;
    log::info!("sign-in code sent to {}", phone.masked());
    form.phone = phone.display();
    form.code_sent = true;
    form.notice = format!(
        "We texted a 6-digit code to {}. It is valid for {} minutes.",
        phone.display(),
        CODE_TTL_SECS / 60
    );
    Ok(form.show(Page::Login, &visitor, StatusCode::OK))
}

/// `POST /login/sms`: signs in with a code (creating the account the first time).
pub async fn login_sms(
    site: web::Data<Site>,
    req: HttpRequest,
    fields: web::Form<Fields>,
) -> Result<HttpResponse, SiteError> {
    let post = match phone_post(&site, &req, &fields, Page::Login, true).await? {
        Ok(post) => post,
        Err(response) => return Ok(response),
    };
    let code = fields.code.clone().unwrap_or_default();
    let store = site.store.clone();
    let to = post.phone.clone();
    let result = site
        .redis(
            move |conn| match store.check_code(conn, Purpose::SignIn, &to, &code)? {
                CodeCheck::Valid => store.find_or_create(conn, &to).map(Ok),
                other => Ok(Err(other)),
            },
        )
        .await?;
    match result {
        Ok(account) => sign_in(&site, &post.visitor, account).await,
        Err(check) => Ok(post
            .form
            .refuse(Page::Login, &post.visitor, code_error(check))),
    }
}

fn code_error(check: CodeCheck) -> String {
    match check {
        CodeCheck::Wrong(0) => format!(
            "That code is not right, and after {MAX_ATTEMPTS} wrong tries it no longer works. Ask for a new code."
        ),
        CodeCheck::Wrong(1) => "That code is not right. You have 1 more try.".into(),
        CodeCheck::Wrong(n) => format!("That code is not right. You have {n} more tries."),
        CodeCheck::Missing | CodeCheck::Valid => {
            "There is no valid code for this number: it was used, it expired, or none was sent. Ask for a new code.".into()
        }
    }
}

/// A hash to verify against when there is no account, so that unknown and
/// known phones take the same time.
fn dummy_hash() -> &'static str {
    static DUMMY: OnceLock<String> = OnceLock::new();
    DUMMY.get_or_init(|| hash_password("not a password of anyone").unwrap_or_default())
}

fn hash_password(password: &str) -> Result<String, SiteError> {
    let salt_bytes = random_bytes::<16>().map_err(|e| SiteError::internal(e.to_string()))?;
    let salt =
        SaltString::encode_b64(&salt_bytes).map_err(|e| SiteError::internal(e.to_string()))?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| SiteError::internal(e.to_string()))
}

fn verify_password(password: &str, phc: &str) -> bool {
    PasswordHash::new(phc).is_ok_and(|hash| {
        Argon2::default()
            .verify_password(password.as_bytes(), &hash)
            .is_ok()
    })
}

/// `POST /login/password`
pub async fn login_password(
    site: web::Data<Site>,
    req: HttpRequest,
    fields: web::Form<Fields>,
) -> Result<HttpResponse, SiteError> {
    let post = match phone_post(&site, &req, &fields, Page::Login, false).await? {
        Ok(post) => post,
        Err(response) => return Ok(response),
    };
    let store = site.store.clone();
    let to = post.phone.clone();
    let account = site.redis(move |conn| store.account(conn, &to)).await?;
    let password = fields.password.clone().unwrap_or_default();
    let phc = account.as_ref().and_then(|a| a.password.clone());
    // Every verification (and the dummy hash) runs under a permit.
    let matches = site
        .hashing
        .run(move || match phc {
            Some(phc) => verify_password(&password, &phc),
            None => verify_password(&password, dummy_hash()),
        })
        .await?;
    match account {
        Some(account) if matches && account.password.is_some() => {
            sign_in(&site, &post.visitor, account).await
        }
        _ => Ok(post.form.refuse(
            Page::Login,
            &post.visitor,
            "That phone number and password do not match an account with a password. You can sign in with a code instead.".into(),
        )),
    }
}

/// Starts a session under a NEW session ID (no fixation) and goes to the account.
async fn sign_in(
    site: &Site,
    visitor: &Visitor,
    account: Account,
) -> Result<HttpResponse, SiteError> {
    let sid = session::new_sid().map_err(|e| SiteError::internal(e.to_string()))?;
    let store = site.store.clone();
    let (old_sid, old_account) = (visitor.sid.clone(), visitor.account_id());
    let (new_sid, acct) = (sid.clone(), account.clone());
    site.redis(move |conn| {
        if let Some(old) = old_account {
            store.end_session(conn, &old_sid, &old)?;
        }
        store.start_session(conn, &new_sid, &acct)
    })
    .await?;
    log::info!("signed in account {}", account.id);
    let cookie = session::cookie(
        session::cookie_value(&site.secret, &sid, Some(&account.id)),
        site.config.site.secure_cookies,
    );
    Ok(HttpResponse::SeeOther()
        .insert_header((header::LOCATION, "/account"))
        .cookie(cookie)
        .finish())
}

/// `POST /logout`
pub async fn logout(
    site: web::Data<Site>,
    req: HttpRequest,
    fields: web::Form<Fields>,
) -> Result<HttpResponse, SiteError> {
    let visitor = Visitor::of(&site, &req).await?;
    if !csrf_ok(&site, &visitor, &fields) {
        return Ok(forbidden(&site, &visitor));
    }
    if let Some(account) = visitor.account_id() {
        let (store, sid) = (site.store.clone(), visitor.sid.clone());
        site.redis(move |conn| store.end_session(conn, &sid, &account))
            .await?;
    }
    let sid = session::new_sid().map_err(|e| SiteError::internal(e.to_string()))?;
    let cookie = session::cookie(
        session::cookie_value(&site.secret, &sid, None),
        site.config.site.secure_cookies,
    );
    Ok(HttpResponse::SeeOther()
        .insert_header((header::LOCATION, "/"))
        .cookie(cookie)
        .finish())
}

fn to_login() -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, "/login"))
        .finish()
}

async fn account_page(site: &Site, visitor: &Visitor) -> Result<AccountPage, SiteError> {
    let Some(phone) = visitor.phone.as_ref().and_then(|p| Phone::stored(p)) else {
        return Err(SiteError::internal(
            "signed-in session without a phone".into(),
        ));
    };
    let store = site.store.clone();
    let to = phone.clone();
    let account = site.redis(move |conn| store.account(conn, &to)).await?;
    Ok(AccountPage {
        site_title: site.title(),
        signed_in: true,
        csrf: visitor.csrf(site),
        phone: phone.display(),
        has_password: account.is_some_and(|a| a.password.is_some()),
        ..AccountPage::default()
    })
}

/// `GET /account`
pub async fn account(site: web::Data<Site>, req: HttpRequest) -> Result<HttpResponse, SiteError> {
    let visitor = Visitor::of(&site, &req).await?;
    if !visitor.signed_in() {
        return Ok(visitor.respond(to_login()));
    }
    let page = account_page(&site, &visitor).await?;
    Ok(visitor.respond(super::pages::render(&page, StatusCode::OK)))
}

/// `POST /account/password`: sets or changes the password of the signed-in account.
pub async fn set_password(
    site: web::Data<Site>,
    req: HttpRequest,
    fields: web::Form<Fields>,
) -> Result<HttpResponse, SiteError> {
    let visitor = Visitor::of(&site, &req).await?;
    if !csrf_ok(&site, &visitor, &fields) {
        return Ok(forbidden(&site, &visitor));
    }
    if !visitor.signed_in() {
        return Ok(visitor.respond(to_login()));
    }
    let mut page = account_page(&site, &visitor).await?;
    let password = fields.password.clone().unwrap_or_default();
    if let Err(e) = check_password(&password) {
        page.error = e;
        return Ok(visitor.respond(super::pages::render(&page, StatusCode::BAD_REQUEST)));
    }
    let phc = site.hashing.run(move || hash_password(&password)).await??;
    let Some(phone) = Phone::stored(&page.phone) else {
        return Err(SiteError::internal("account phone unreadable".into()));
    };
    let store = site.store.clone();
    site.redis(move |conn| store.set_password(conn, &phone, &phc))
        .await?;
    page.has_password = true;
    page.notice = "Your password is set. You can now sign in with it.".into();
    Ok(visitor.respond(super::pages::render(&page, StatusCode::OK)))
}

fn check_password(password: &str) -> Result<(), String> {
    let n = password.chars().count();
    if PASSWORD_CHARS.contains(&n) {
        Ok(())
    } else {
        Err(format!(
            "Choose a password of {} to {} characters (yours has {n}).",
            PASSWORD_CHARS.start(),
            PASSWORD_CHARS.end()
        ))
    }
}

/// `GET /password/reset`
pub async fn reset_form(
    site: web::Data<Site>,
    req: HttpRequest,
) -> Result<HttpResponse, SiteError> {
    let visitor = Visitor::of(&site, &req).await?;
    let form = PhoneForm::new(&site, &visitor, "");
    Ok(form.show(Page::Reset, &visitor, StatusCode::OK))
}

/// `POST /password/reset`: sends a reset code when the phone has an
/// account; answers the same page, status and (nearly) time either way.
pub async fn reset_request(
    site: web::Data<Site>,
    req: HttpRequest,
    fields: web::Form<Fields>,
) -> Result<HttpResponse, SiteError> {
    let post = match phone_post(&site, &req, &fields, Page::Reset, false).await? {
        Ok(post) => post,
        Err(response) => return Ok(response),
    };
    let PhonePost {
        visitor,
        phone,
        mut form,
    } = post;
    text_code(&site, Purpose::Reset, &phone).await?;
    form.phone = phone.display();
    form.code_sent = true;
    form.notice = format!(
        "If {} belongs to an account, we texted it a 6-digit reset code, valid for {} minutes.",
        phone.display(),
        CODE_TTL_SECS / 60
    );
    Ok(form.show(Page::Reset, &visitor, StatusCode::OK))
}

/// `POST /password/reset/confirm`: code + new password. Signs out every
/// other session of the account and does not sign anyone in.
pub async fn reset_confirm(
    site: web::Data<Site>,
    req: HttpRequest,
    fields: web::Form<Fields>,
) -> Result<HttpResponse, SiteError> {
    let post = match phone_post(&site, &req, &fields, Page::Reset, true).await? {
        Ok(post) => post,
        Err(response) => return Ok(response),
    };
    let PhonePost {
        visitor,
        phone,
        form,
    } = post;
    let password = fields.password.clone().unwrap_or_default();
    if let Err(e) = check_password(&password) {
        return Ok(form.refuse(Page::Reset, &visitor, e));
    }
    let code = fields.code.clone().unwrap_or_default();
    let store = site.store.clone();
    let to = phone.clone();
    let checked = site
        .redis(move |conn| {
            Ok(match store.check_code(conn, Purpose::Reset, &to, &code)? {
                CodeCheck::Valid => store.account(conn, &to)?.ok_or(CodeCheck::Missing),
                other => Err(other),
            })
        })
        .await?;
    let account = match checked {
        Ok(a) => a,
        Err(check) => return Ok(form.refuse(Page::Reset, &visitor, code_error(check))),
    };
    let phc = site.hashing.run(move || hash_password(&password)).await??;
    let store = site.store.clone();
    let keep =
        (visitor.account_id().as_deref() == Some(account.id.as_str())).then(|| visitor.sid.clone());
    let id = account.id.clone();
    let ended = site
        .redis(move |conn| {
            store.set_password(conn, &phone, &phc)?;
            store.end_sessions(conn, &id, keep.as_deref())
        })
        .await?;
    log::info!(
        "password reset for account {}, {ended} sessions signed out",
        account.id
    );
    Ok(HttpResponse::SeeOther()
        .insert_header((header::LOCATION, "/login?reset=done"))
        .finish())
}

/// Password hashes (Argon2id, 19 MiB each) that may run at once. The
/// memory they take is bounded by this, whatever the load.
pub const HASH_PERMITS: usize = 2;
/// Password checks that may wait for a permit; more get 503 at once.
pub const HASH_QUEUE: usize = 32;

/// Bounds the password hashing of the whole site: at most
/// [`HASH_PERMITS`] run at once, at most [`HASH_QUEUE`] wait, and the rest
/// are refused with 503 and `Retry-After: 1`. Counts what it does for
/// `/metrics`.
#[derive(Debug)]
pub struct Hashing {
    permits: tokio::sync::Semaphore,
    waiting: AtomicUsize,
    running: AtomicUsize,
    peak: AtomicUsize,
    refused: AtomicU64,
}

impl Default for Hashing {
    fn default() -> Hashing {
        Hashing {
            permits: tokio::sync::Semaphore::new(HASH_PERMITS),
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
        }
    }
}

/// Takes one off a counter when dropped (also when the request is dropped
/// while it waits).
struct Held<'a>(&'a AtomicUsize);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Hashing {
    /// Runs `work` (a hash or a verification) on the blocking pool once a
    /// permit is free; 503 when too many are already waiting.
    pub async fn run<T, F>(&self, work: F) -> Result<T, SiteError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= HASH_QUEUE {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(SiteError::unavailable(
                "too many password checks waiting; refused".into(),
            ));
        }
        let waiting = Held(&self.waiting);
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|e| SiteError::internal(e.to_string()))?;
        drop(waiting);
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        let _running = Held(&self.running);
        self.peak.fetch_max(now, Ordering::SeqCst);
        web::block(work)
            .await
            .map_err(|e| SiteError::internal(e.to_string()))
    }

    /// Prometheus lines: running, waiting, the most ever running at once,
    /// and how many were refused.
    pub fn render(&self) -> String {
        format!(
            "# HELP floodgate_password_hashes_running Password hashes running now.\n\
             # TYPE floodgate_password_hashes_running gauge\n\
             floodgate_password_hashes_running {}\n\
             # HELP floodgate_password_hashes_waiting Password checks waiting for a permit.\n\
             # TYPE floodgate_password_hashes_waiting gauge\n\
             floodgate_password_hashes_waiting {}\n\
             # HELP floodgate_password_hashes_peak The most password hashes ever running at once.\n\
             # TYPE floodgate_password_hashes_peak gauge\n\
             floodgate_password_hashes_peak {}\n\
             # HELP floodgate_password_hashes_refused_total Password checks refused with 503 (queue full).\n\
             # TYPE floodgate_password_hashes_refused_total counter\n\
             floodgate_password_hashes_refused_total {}\n",
            self.running.load(Ordering::SeqCst),
            self.waiting.load(Ordering::SeqCst),
            self.peak.load(Ordering::SeqCst),
            self.refused.load(Ordering::Relaxed),
        )
    }
}
