//! Sessions, signed cookies and CSRF tokens.
//!
//! The cookie is `SID.ACCOUNT.MAC`: a random session ID, the signed-in
//! account's ID (empty when nobody is signed in) and an HMAC-SHA256 of both
//! under the site secret. The filter reads the account ID from a cookie
//! whose MAC checks (no Redis call) to key `session` rules; the site also
//! checks that Redis still holds the session, so a revoked session is
//! signed out at once. A CSRF token is an HMAC of the session ID: tied to
//! the session, nothing stored.

use actix_web::cookie::{Cookie, SameSite};
use actix_web::HttpRequest;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Name of the session cookie.
pub const COOKIE: &str = "fg_session";
/// How long a signed-in session lives without use.
pub const SESSION_TTL_SECS: u64 = 7 * 86_400;

/// The site secret and the keys derived from it.
#[derive(Clone)]
pub struct Secret {
    key: Vec<u8>,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// The configured secret, or a random one when it is empty.
    pub fn new(configured: &str) -> Result<Secret, getrandom::Error> {
        let key = if configured.is_empty() {
            random_bytes::<32>()?.to_vec()
        } else {
            configured.as_bytes().to_vec()
        };
        Ok(Secret { key })
    }

    /// HMAC-SHA256 of `parts` (joined by a separator that cannot occur in them).
    pub fn mac(&self, purpose: &str, parts: &[&str]) -> [u8; 32] {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.key) else {
            // HMAC takes keys of any length; this branch cannot be taken.
            return [0; 32];
        };
        mac.update(purpose.as_bytes());
        for p in parts {
            mac.update(b"\x1f");
            mac.update(p.as_bytes());
        }
        mac.finalize().into_bytes().into()
    }

    /// The hex MAC, for cookies and tokens.
    pub fn mac_hex(&self, purpose: &str, parts: &[&str]) -> String {
        hex(&self.mac(purpose, parts))
    }
}

/// `n` bytes from the operating system's CSPRNG.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], getrandom::Error> {
    let mut buf = [0u8; N];
    getrandom::fill(&mut buf)?;
    Ok(buf)
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Equality in constant time.
pub fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// What a valid cookie says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CookieSession {
    /// Session ID (64 hex digits).
    pub sid: String,
    /// Signed-in account ID, if any.
    pub account: Option<String>,
}

/// A new anonymous session ID.
pub fn new_sid() -> Result<String, getrandom::Error> {
    Ok(hex(&random_bytes::<32>()?))
}

/// The cookie value for a session.
pub fn cookie_value(secret: &Secret, sid: &str, account: Option<&str>) -> String {
    let account = account.unwrap_or("");
    let mac = secret.mac_hex("session", &[sid, account]);
    format!("{sid}.{account}.{mac}")
}

/// Reads and checks the session cookie; `None` when absent or forged.
pub fn read_cookie(secret: &Secret, req: &HttpRequest) -> Option<CookieSession> {
    read_cookie_value(secret, req.cookie(COOKIE)?.value())
}

/// [`read_cookie`] of the cookie's value, as the filter's session lookup
/// reads it from the request's head.
pub fn read_cookie_value(secret: &Secret, value: &str) -> Option<CookieSession> {
    let mut parts = value.split('.');
    let (sid, account, mac) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some()
        || sid.len() != 64
        || !sid.bytes().all(|b| b.is_ascii_hexdigit())
        || account.len() > 64
    {
        return None;
    }
    if !same(mac, &secret.mac_hex("session", &[sid, account])) {
        return None;
    }
    Some(CookieSession {
        sid: sid.to_string(),
        account: (!account.is_empty()).then(|| account.to_string()),
    })
}

/// The `Set-Cookie` for a session: HttpOnly, SameSite=Lax, Secure when configured.
pub fn cookie(value: String, secure: bool) -> Cookie<'static> {
    Cookie::build(COOKIE, value)
        .path("/")
        .http_only(true)
        .same_site(SameSite::Lax)
        .secure(secure)
        .max_age(actix_web::cookie::time::Duration::seconds(
            SESSION_TTL_SECS as i64,
        ))
        .finish()
}

/// The CSRF token of a session.
pub fn csrf_token(secret: &Secret, sid: &str) -> String {
    secret.mac_hex("csrf", &[sid])
}

/// Whether `token` is the CSRF token of `sid`.
pub fn csrf_ok(secret: &Secret, sid: &str, token: &str) -> bool {
    same(token, &csrf_token(secret, sid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    #[test]
    fn cookies_round_trip_and_reject_forgery() {
        let secret = Secret::new("k").unwrap();
        let sid = new_sid().unwrap();
        let value = cookie_value(&secret, &sid, Some("acct1"));
        let req = TestRequest::default()
            .cookie(Cookie::new(COOKIE, value.clone()))
            .to_http_request();
        let s = read_cookie(&secret, &req).unwrap();
        assert_eq!(s.sid, sid);
        assert_eq!(s.account.as_deref(), Some("acct1"));

        let forged = value.replace("acct1", "acct2");
        let req = TestRequest::default()
            .cookie(Cookie::new(COOKIE, forged))
            .to_http_request();
        assert!(read_cookie(&secret, &req).is_none());
        let other = Secret::new("other").unwrap();
        let req = TestRequest::default()
            .cookie(Cookie::new(COOKIE, value))
            .to_http_request();
        assert!(read_cookie(&other, &req).is_none());
    }

    #[test]
    fn csrf_is_tied_to_the_session() {
        let secret = Secret::new("k").unwrap();
        let t = csrf_token(&secret, "a");
        assert!(csrf_ok(&secret, "a", &t));
        assert!(!csrf_ok(&secret, "b", &t));
        assert!(!csrf_ok(&secret, "a", ""));
    }
}
