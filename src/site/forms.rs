//! What the site's handlers share: the POST form's fields, the state of
//! the phone forms (sign-in and reset) and their pages, and the extractors
//! for the opening every handler would otherwise repeat: who is asking
//! ([`Visitor`]), a POST whose CSRF token checks out ([`CsrfPost`], else
//! 403), and a phone form whose number reads as E.164 ([`PhonePost`], else
//! the form again with an error, 400).

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;

use actix_web::dev::Payload;
use actix_web::error::InternalError;
use actix_web::http::StatusCode;
use actix_web::{web, FromRequest, HttpMessage, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;

use super::phone::{Phone, PHONE_RULE};
use super::{session, Site, SiteError, Visitor};

/// Every POST form's fields; all optional so that a missing one is a form
/// error (or a 403 for `csrf`), never an extractor 400 without a page.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Fields {
    pub(super) phone: Option<String>,
    pub(super) code: Option<String>,
    pub(super) password: Option<String>,
    pub(super) csrf: Option<String>,
}

impl Fields {
    /// The code field as typed ("" when absent).
    pub(super) fn code(&self) -> String {
        self.code.clone().unwrap_or_default()
    }

    /// The password field as typed ("" when absent).
    pub(super) fn password(&self) -> String {
        self.password.clone().unwrap_or_default()
    }
}

/// The state of the phone forms (sign-in and reset): what was typed, what
/// happened, what went wrong. Both pages render it.
#[derive(Default)]
pub struct PhoneForm {
    site_title: String,
    signed_in: bool,
    csrf: String,
    pub(super) phone: String,
    pub(super) code_sent: bool,
    pub(super) notice: String,
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
pub enum Page {
    /// `/login`
    Login,
    /// `/password/reset`
    Reset,
}

impl PhoneForm {
    /// A blank form for this visitor, with `phone` typed in.
    pub(super) fn new(site: &Site, visitor: &Visitor, phone: &str) -> PhoneForm {
        PhoneForm {
            site_title: site.title(),
            signed_in: visitor.signed_in(),
            csrf: visitor.csrf(site),
            phone: phone.to_string(),
            ..PhoneForm::default()
        }
    }

    /// The page with this state, with the visitor's cookie when it is new.
    pub(super) fn show(&self, page: Page, visitor: &Visitor, status: StatusCode) -> HttpResponse {
        let res = match page {
            Page::Login => super::pages::render(&LoginPage { form: self }, status),
            Page::Reset => super::pages::render(&ResetPage { form: self }, status),
        };
        visitor.respond(res)
    }

    /// The page again with an error, as a 400.
    pub(super) fn refuse(mut self, page: Page, visitor: &Visitor, error: String) -> HttpResponse {
        self.error = error;
        self.show(page, visitor, StatusCode::BAD_REQUEST)
    }
}

/// What the extractors return: boxed, as they await the visitor's session.
type Extracted<T> = Pin<Box<dyn Future<Output = Result<T, actix_web::Error>>>>;

/// The site's state, from the app's data.
fn site_of(req: &HttpRequest) -> Result<web::Data<Site>, SiteError> {
    req.app_data::<web::Data<Site>>()
        .cloned()
        .ok_or_else(|| SiteError::internal("the site's state is not registered".into()))
}

/// Who is asking (see [`Visitor::of`]); 503 when Redis cannot say.
impl FromRequest for Visitor {
    type Error = actix_web::Error;
    type Future = Extracted<Visitor>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let req = req.clone();
        Box::pin(async move {
            let site = site_of(&req)?;
            Ok(Visitor::of(&site, &req).await?)
        })
    }
}

/// A POST form whose CSRF token belongs to the session cookie it came
/// with. Without one the request is answered 403 with an opaque page, and
/// the handler never runs: a POST with no form at all (no body, or a body
/// of another type), or one that cannot be read (a field given twice), has
/// no token either, so it gets the 403 too.
pub struct CsrfPost {
    /// Who sent it.
    pub visitor: Visitor,
    /// The form as sent.
    pub fields: Fields,
}

impl FromRequest for CsrfPost {
    type Error = actix_web::Error;
    type Future = Extracted<CsrfPost>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let form = web::Form::<Fields>::from_request(req, payload);
        let req = req.clone();
        Box::pin(async move {
            use actix_web::error::UrlencodedError;
            let fields = match form.await {
                Ok(form) => form.into_inner(),
                Err(e) => match e.as_error::<UrlencodedError>() {
                    // Not a form, or one that cannot be read (a field
                    // twice, text that is not UTF-8): no valid token
                    // either, so the 403 below, and nothing spent.
                    Some(
                        UrlencodedError::ContentType
                        | UrlencodedError::Parse(_)
                        | UrlencodedError::Encoding,
                    ) => Fields::default(),
                    // Too large, or broken off: refused as it is, and
                    // nothing spent either.
                    _ => {
                        give_back_all(&req).await;
                        return Err(e);
                    }
                },
            };
            let site = site_of(&req)?;
            let visitor = Visitor::of(&site, &req).await?;
            if !csrf_ok(&site, &visitor, &fields) {
                give_back_all(&req).await;
                let page = forbidden(&site, &visitor);
                return Err(InternalError::from_response("no valid CSRF token", page).into());
            }
            Ok(CsrfPost { visitor, fields })
        })
    }
}

/// Which phone form a [`PhonePost`] comes from: the page that shows it
/// again, and whether that page shows the code field.
pub trait Flow: 'static {
    /// The page of the form.
    const PAGE: Page;
    /// Whether the form was sent with a code (the code field stays).
    const CODE_SENT: bool;
}

/// `POST /sms/send`, `POST /login/password`: a phone, no code yet.
pub struct SignIn;
/// `POST /login/sms`: a phone and its code.
pub struct SignInCode;
/// `POST /password/reset`: a phone, no code yet.
pub struct Reset;
/// `POST /password/reset/confirm`: a phone, its code and a new password.
pub struct ResetCode;

impl Flow for SignIn {
    const PAGE: Page = Page::Login;
    const CODE_SENT: bool = false;
}
impl Flow for SignInCode {
    const PAGE: Page = Page::Login;
    const CODE_SENT: bool = true;
}
impl Flow for Reset {
    const PAGE: Page = Page::Reset;
    const CODE_SENT: bool = false;
}
impl Flow for ResetCode {
    const PAGE: Page = Page::Reset;
    const CODE_SENT: bool = true;
}

/// A phone form POST that passed the common checks: the CSRF token (else
/// 403, as [`CsrfPost`]) and the phone field, read as E.164 by the same
/// function as the rules (else the form again with an error, 400).
pub struct PhonePost<F: Flow> {
    /// Who sent it.
    pub visitor: Visitor,
    /// The number.
    pub phone: Phone,
    /// The form's state so far, to show it again.
    pub form: PhoneForm,
    /// The form as sent.
    pub fields: Fields,
    flow: PhantomData<F>,
}

impl<F: Flow> FromRequest for PhonePost<F> {
    type Error = actix_web::Error;
    type Future = Extracted<PhonePost<F>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let post = CsrfPost::from_request(req, payload);
        let req = req.clone();
        Box::pin(async move {
            let CsrfPost { visitor, fields } = post.await?;
            let site = site_of(&req)?;
            let typed = fields.phone.clone().unwrap_or_default();
            let mut form = PhoneForm::new(&site, &visitor, &typed);
            form.code_sent = F::CODE_SENT;
            match Phone::parse(&typed, site.region()) {
                Some(phone) => Ok(PhonePost {
                    visitor,
                    phone,
                    form,
                    fields,
                    flow: PhantomData,
                }),
                None => {
                    give_back_all(&req).await;
                    form.phone_error = true;
                    let page = form.refuse(F::PAGE, &visitor, PHONE_RULE.into());
                    Err(InternalError::from_response("unreadable phone", page).into())
                }
            }
        })
    }
}

/// Gives back what the rules took for a POST the site refuses before
/// acting on it: one without a valid CSRF token, or, on the JSON API, of
/// another type (another site's page can make a visitor's browser send
/// such requests, and must not spend the visitor's address's or number's
/// quota with them), or one whose phone number cannot be read (a typo
/// sends no code, and costs none).
pub(super) async fn give_back_all(req: &HttpRequest) {
    let usage = req.extensions().get::<floodgate::Usage>().cloned();
    if let Some(usage) = usage {
        if let Err(e) = usage.give_back().await {
            log::debug!("a refused form's units not given back: {e}");
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
