//! [`RequestHead`]: a request as the application's own functions see it,
//! whatever the web framework (key functions, skip predicates, the session
//! lookup, the denial responder).

use std::net::IpAddr;

/// A request's head (method, path, query, header fields, addresses) as the
/// functions an application gives floodgate see it: [`Key::custom`] and
/// [`Key::lookup`] key functions, [`Limit::skip_if`] predicates, the
/// [session lookup] and the [denial responder]. The actix-web filter and
/// the tower layer hand over the same thing, so one function serves both
/// doors. It is built only for a request that one of those functions
/// reads, and owned, so that a lookup may await with it.
///
/// [`Key::custom`]: crate::Key::custom
/// [`Key::lookup`]: crate::Key::lookup
/// [`Limit::skip_if`]: crate::Limit::skip_if
/// [session lookup]: crate::FilterBuilder::session_lookup
/// [denial responder]: crate::FilterBuilder::denial_responder
///
/// ```
/// use floodgate_limiter::RequestHead;
///
/// let head = RequestHead::new(
///     http::Method::GET,
///     "/api/items?page=2".parse().unwrap(),
///     http::HeaderMap::new(),
///     Some("192.0.2.7".parse().unwrap()),
/// );
/// assert_eq!(head.path(), "/api/items");
/// assert_eq!(head.query(), "page=2");
/// assert_eq!(head.client_ip(), Some("192.0.2.7".parse().unwrap()));
/// ```
#[derive(Debug, Clone)]
pub struct RequestHead {
    method: http::Method,
    uri: http::Uri,
    headers: http::HeaderMap,
    client: Option<IpAddr>,
}

impl RequestHead {
    /// A head of its own (for tests of an application's functions): the
    /// filter builds one from each request it hands over. `client` is the
    /// address the filter keys `ip` by.
    pub fn new(
        method: http::Method,
        uri: http::Uri,
        headers: http::HeaderMap,
        client: Option<IpAddr>,
    ) -> RequestHead {
        RequestHead {
            method,
            uri,
            headers,
            client,
        }
    }

    /// The method.
    pub fn method(&self) -> &http::Method {
        &self.method
    }

    /// The path as received (percent-encoded), without the query.
    pub fn path(&self) -> &str {
        self.uri.path()
    }

    /// The query string without `?` (empty when there is none).
    pub fn query(&self) -> &str {
        self.uri.query().unwrap_or("")
    }

    /// The header fields.
    pub fn headers(&self) -> &http::HeaderMap {
        &self.headers
    }

    /// The first value of the header field `name` that is visible ASCII
    /// text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get_all(name)
            .iter()
            .find_map(|v| v.to_str().ok())
    }

    /// The value of the cookie `name`, as the `Cookie` fields send it.
    pub fn cookie(&self, name: &str) -> Option<&str> {
        self.headers
            .get_all(http::header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|line| line.split(';'))
            .find_map(|pair| {
                let (n, v) = pair.trim().split_once('=')?;
                (n == name).then(|| v.trim_matches('"'))
            })
    }

    /// The client's address as the filter keys `ip` by: the peer's, or the
    /// one the trusted proxies forwarded. `None` when the server did not
    /// tell the peer's.
    pub fn client_ip(&self) -> Option<IpAddr> {
        self.client
    }
}

#[cfg(test)]
mod tests {
    use super::RequestHead;

    #[test]
    fn cookies_and_headers_are_read_by_name() {
        let mut headers = http::HeaderMap::new();
        headers.append("cookie", "a=1; sid=\"x y\"".parse().unwrap());
        headers.append("cookie", "b=2".parse().unwrap());
        headers.append("x-tenant", "acme".parse().unwrap());
        let head = RequestHead::new(http::Method::POST, "/p".parse().unwrap(), headers, None);
        assert_eq!(head.cookie("sid"), Some("x y"));
        assert_eq!(head.cookie("b"), Some("2"));
        assert_eq!(head.cookie("c"), None);
        assert_eq!(head.header("X-Tenant"), Some("acme"));
        assert_eq!(head.query(), "");
        assert_eq!(head.client_ip(), None);
    }
}
