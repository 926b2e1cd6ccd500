//! The password reset: `/password/reset` (the form, and a code by SMS) and
//! `/password/reset/confirm` (the code and a new password).

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};

use super::codes::{code_error, text_code};
use super::forms::{give_back_all, Page, PhoneForm, PhonePost, Reset, ResetCode};
use super::password::{check_password, hash_password};
use super::store::{CodeCheck, Purpose, CODE_TTL_SECS};
use super::{Site, SiteError, Visitor};

/// `GET /password/reset`
pub async fn reset_form(
    site: web::Data<Site>,
    visitor: Visitor,
) -> Result<HttpResponse, SiteError> {
    let form = PhoneForm::new(&site, &visitor, "");
    Ok(form.show(Page::Reset, &visitor, StatusCode::OK))
}

/// `POST /password/reset`: sends a reset code when the phone has an
/// account; answers the same page, status and (nearly) time either way.
pub async fn reset_request(
    site: web::Data<Site>,
    post: PhonePost<Reset>,
) -> Result<HttpResponse, SiteError> {
    let PhonePost {
        visitor,
        phone,
        mut form,
        ..
    } = post;
    text_code(&site, Purpose::Reset, &phone, &visitor.sid).await?;
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
    req: HttpRequest,
    site: web::Data<Site>,
    post: PhonePost<ResetCode>,
) -> Result<HttpResponse, SiteError> {
    let PhonePost {
        visitor,
        phone,
        form,
        fields,
        ..
    } = post;
    let password = fields.password();
    if let Err(e) = check_password(&password) {
        // The code was not tried: its try goes back.
        give_back_all(&req).await;
        return Ok(form.refuse(Page::Reset, &visitor, e));
    }
    let code = fields.code();
    let store = site.store.clone();
    let (to, sid) = (phone.clone(), visitor.sid.clone());
    let checked = site
        .redis(move |conn| {
            Ok(
                match store.check_code(conn, Purpose::Reset, &to, &code, &sid)? {
                    CodeCheck::Valid => store.account(conn, &to)?.ok_or(CodeCheck::Missing),
                    other => Err(other),
                },
            )
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
