//! The site's JSON API for apps: `POST /api/sms/send`, the form's
//! `POST /sms/send` for clients that speak JSON, under the same rules and
//! the same counters (the rules key both by `body:phone`).
//!
//! It takes `application/json` only (anything else: 415), so it needs no
//! CSRF token: a page on another site can post a form (urlencoded,
//! multipart or text/plain) without asking, but a JSON body only after a
//! CORS preflight, which this site never answers.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use serde::Deserialize;

use super::codes::text_code;
use super::forms::give_back_all;
use super::phone::Phone;
use super::store::Purpose;
use super::{Site, SiteError, Visitor};

/// The body: `{"phone":"..."}`; other members are allowed. A struct, so
/// that a body naming `phone` twice is refused as the filter refuses it.
#[derive(Deserialize)]
struct SendCode {
    #[serde(default)]
    phone: Option<serde_json::Value>,
}

/// `POST /api/sms/send`: texts a sign-in code, bound to the caller's
/// session (a new one, with its cookie, when the request brought none).
pub async fn send_code(
    site: web::Data<Site>,
    req: HttpRequest,
    mut payload: web::Payload,
) -> Result<HttpResponse, SiteError> {
    if !is_utf8_json(&req) {
        return Ok(refused(
            &req,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        )
        .await);
    }
    let max = site.config.filter.server.max_form;
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let Ok(chunk) = chunk else {
            return Ok(error(StatusCode::BAD_REQUEST, "unreadable_body"));
        };
        if body.len() + chunk.len() > max {
            return Ok(error(StatusCode::PAYLOAD_TOO_LARGE, "too_large"));
        }
        body.extend_from_slice(&chunk);
    }
    let Ok(sent) = serde_json::from_slice::<SendCode>(&body) else {
        return Ok(refused(&req, StatusCode::BAD_REQUEST, "invalid_json").await);
    };
    let phone = match sent.phone {
        Some(serde_json::Value::String(typed)) => Phone::parse(&typed, site.region()),
        _ => None,
    };
    let Some(phone) = phone else {
        return Ok(refused(&req, StatusCode::BAD_REQUEST, "invalid_phone").await);
    };
    // Redis failing: a JSON answer too, as the client reads no other.
    let visitor = match Visitor::of(&site, &req).await {
        Ok(v) => v,
        Err(e) => return Ok(e.json_response()),
    };
    if let Err(e) = text_code(&site, Purpose::SignIn, &phone, &visitor.sid).await {
        return Ok(e.json_response());
    }
    log::info!("sign-in code sent to {} (API)", phone.masked());
    let res = HttpResponse::Ok()
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .json(serde_json::json!({ "sent": true }));
    Ok(visitor.respond(res))
}

/// `Content-Type: application/json`, in UTF-8 (no other charset), without
/// a content coding. The type is parsed as actix-web parses it
/// (`HttpMessage::mime_type`), which is how the filter decides whether it
/// reads the body's `phone`: a type it cannot parse (`application/json ;
/// x=y`, with a space before the `;`) would have the filter key the
/// request by address alone while this handler still sent a code.
fn is_utf8_json(req: &HttpRequest) -> bool {
    use actix_web::{mime, HttpMessage};
    let Ok(Some(mime)) = req.mime_type() else {
        return false;
    };
    let json = mime.type_() == mime::APPLICATION && mime.subtype() == mime::JSON;
    let utf8 = mime
        .get_param(mime::CHARSET)
        .is_none_or(|c| c == mime::UTF_8 || c.as_str().eq_ignore_ascii_case("utf8"));
    let coded = req.headers().get_all(header::CONTENT_ENCODING).any(|c| {
        !c.to_str()
            .is_ok_and(|c| c.trim().eq_ignore_ascii_case("identity"))
    });
    json && utf8 && !coded
}

/// [`error`] for a request refused before any code is sent: what the rules
/// took for it is given back (see [`give_back_all`]).
async fn refused(req: &HttpRequest, status: StatusCode, what: &str) -> HttpResponse {
    give_back_all(req).await;
    error(status, what)
}

/// `{"error":WHAT}` with `status`.
fn error(status: StatusCode, what: &str) -> HttpResponse {
    HttpResponse::build(status)
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .json(serde_json::json!({ "error": what }))
}
