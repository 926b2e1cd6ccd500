//! The signed-in visitor's account: `/account` and `/account/password`.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpResponse};
use askama::Template;

use super::forms::CsrfPost;
use super::password::{check_password, hash_password};
use super::phone::Phone;
use super::{Site, SiteError, Visitor};

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
pub async fn account(site: web::Data<Site>, visitor: Visitor) -> Result<HttpResponse, SiteError> {
    if !visitor.signed_in() {
        return Ok(visitor.respond(to_login()));
    }
    let page = account_page(&site, &visitor).await?;
    Ok(visitor.respond(super::pages::render(&page, StatusCode::OK)))
}

/// `POST /account/password`: sets or changes the password of the signed-in account.
pub async fn set_password(
    site: web::Data<Site>,
    post: CsrfPost,
) -> Result<HttpResponse, SiteError> {
    let visitor = post.visitor;
    if !visitor.signed_in() {
        return Ok(visitor.respond(to_login()));
    }
    let mut page = account_page(&site, &visitor).await?;
    let password = post.fields.password();
    if let Err(e) = check_password(&password) {
        page.error = e;
        return Ok(visitor.respond(super::pages::render(&page, StatusCode::BAD_REQUEST)));
    }
    let phc = site.hashing.run(move || hash_password(&password)).await??;
    let Some(phone) = Phone::stored(&page.phone) else {
        return Err(SiteError::internal("account phone unreadable".into()));
    };
    // The account's other sessions end, as after a reset: whoever holds
    // one (a lost phone, a shared computer) signs in again with the new
    // password or a code.
    let store = site.store.clone();
    let (id, keep) = (
        visitor.account_id().unwrap_or_default(),
        visitor.sid.clone(),
    );
    site.redis(move |conn| {
        store.set_password(conn, &phone, &phc)?;
        store.end_sessions(conn, &id, Some(&keep))
    })
    .await?;
    page.has_password = true;
    page.notice =
        "Your password is set. You can now sign in with it; your other sessions are signed out."
            .into();
    Ok(visitor.respond(super::pages::render(&page, StatusCode::OK)))
}
