//! What the two admin APIs (the site's, and `floodgate rls`'s on its
//! `http_bind`) answer and check alike: JSON that is never cached, and the
//! bearer token compared in time that depends on neither side.

use actix_web::http::{header, StatusCode};
use actix_web::{HttpRequest, HttpResponse};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// `body` (JSON) with `status`, never cached.
pub fn json(status: StatusCode, body: String) -> HttpResponse {
    HttpResponse::build(status)
        .content_type("application/json")
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .body(body)
}

/// `{"error": what}` with `status`.
pub fn error(status: StatusCode, what: &str) -> HttpResponse {
    json(status, serde_json::json!({ "error": what }).to_string())
}

/// Whether `given` is `token`, in time that depends on neither.
pub fn token_matches(given: &[u8], token: &str) -> bool {
    let a = Sha256::digest(given);
    let b = Sha256::digest(token.as_bytes());
    bool::from(a.ct_eq(&b))
}

/// The token of an `Authorization: Bearer TOKEN` field.
pub fn bearer(req: &HttpRequest) -> Option<&[u8]> {
    let value = req.headers().get(header::AUTHORIZATION)?.as_bytes();
    let scheme = value.get(..7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| &value[7..])
}
