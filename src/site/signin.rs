//! Signing in (by SMS code or by password) and out: `/login`,
//! `/sms/send`, `/login/sms`, `/login/password`, `/logout`.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};

use super::codes::{code_error, text_code};
use super::forms::{CsrfPost, Page, PhoneForm, PhonePost, SignIn, SignInCode};
use super::password::{dummy_hash, verify_password};
use super::session;
use super::store::{Account, CodeCheck, Purpose, CODE_TTL_SECS};
use super::{Site, SiteError, Visitor};

/// `GET /login`
pub async fn login_form(
    site: web::Data<Site>,
    req: HttpRequest,
    visitor: Visitor,
) -> Result<HttpResponse, SiteError> {
    let mut form = PhoneForm::new(&site, &visitor, "");
    if req.query_string().contains("reset=done") {
        form.notice = "Your password was changed and every session of the account was signed out. Sign in with the new password.".into();
    }
    Ok(form.show(Page::Login, &visitor, StatusCode::OK))
}

/// `POST /sms/send`: texts a sign-in code.
pub async fn send_code(
    site: web::Data<Site>,
    post: PhonePost<SignIn>,
) -> Result<HttpResponse, SiteError> {
    let PhonePost {
        visitor,
        phone,
        mut form,
        ..
    } = post;
    text_code(&site, Purpose::SignIn, &phone, &visitor.sid).await?;
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
    post: PhonePost<SignInCode>,
) -> Result<HttpResponse, SiteError> {
    let code = post.fields.code();
    let store = site.store.clone();
    let (to, sid) = (post.phone.clone(), post.visitor.sid.clone());
    let result = site
        .redis(
            move |conn| match store.check_code(conn, Purpose::SignIn, &to, &code, &sid)? {
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

/// `POST /login/password`
pub async fn login_password(
    site: web::Data<Site>,
    post: PhonePost<SignIn>,
) -> Result<HttpResponse, SiteError> {
    let store = site.store.clone();
    let to = post.phone.clone();
    let account = site.redis(move |conn| store.account(conn, &to)).await?;
    let password = post.fields.password();
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
pub async fn logout(site: web::Data<Site>, post: CsrfPost) -> Result<HttpResponse, SiteError> {
    let visitor = post.visitor;
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
