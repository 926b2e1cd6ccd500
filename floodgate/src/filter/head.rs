//! What the filter reads of a request before its body, whatever the web
//! framework: each door (the actix-web `Transform`, the tower `Layer`)
//! implements [`Head`] for its own request type, so that matching rules and
//! building keys are one code for every door, and no request is copied to
//! be read.

use std::net::IpAddr;

use crate::head::RequestHead;
use crate::net::HeaderLines;

/// A request's head as the filter's stages read it.
pub(crate) trait Head {
    /// The framework's header map.
    type Headers: HeaderLines;

    /// The method, upper case.
    fn method(&self) -> &str;
    /// The path as received (percent-encoded).
    fn raw_path(&self) -> &str;
    /// The path as the framework's router routes it.
    fn routed_path(&self) -> &str;
    /// The query string, without `?`.
    fn query(&self) -> &str;
    /// The header fields.
    fn headers(&self) -> &Self::Headers;
    /// The size of the header block: names, values and separators.
    fn header_bytes(&self) -> usize;
    /// The TCP peer's address, when the server told it.
    fn peer(&self) -> Option<IpAddr>;
    /// The head as the application's own functions see it, `client`
    /// being the address the filter keys `ip` by (built only for a request
    /// one of those functions reads).
    fn request_head(&self, client: IpAddr) -> RequestHead;
}

impl Head for actix_web::HttpRequest {
    type Headers = actix_web::http::header::HeaderMap;

    fn method(&self) -> &str {
        actix_web::HttpRequest::method(self).as_str()
    }

    fn raw_path(&self) -> &str {
        self.path()
    }

    /// actix's router routes `actix_router::Url`: decoded but for `%2F`,
    /// `%25` and `%2B`, so `/admin%2Fx` is one segment.
    fn routed_path(&self) -> &str {
        self.match_info().as_str()
    }

    fn query(&self) -> &str {
        self.query_string()
    }

    fn headers(&self) -> &Self::Headers {
        actix_web::HttpRequest::headers(self)
    }

    fn header_bytes(&self) -> usize {
        actix_web::HttpRequest::headers(self)
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum()
    }

    fn peer(&self) -> Option<IpAddr> {
        self.peer_addr().map(|a| a.ip())
    }

    /// actix-web 4 has the `http` crate's types of version 0.2: each part
    /// is carried over by its bytes.
    fn request_head(&self, client: IpAddr) -> RequestHead {
        let method =
            http::Method::from_bytes(Head::method(self).as_bytes()).unwrap_or(http::Method::GET);
        let uri = self
            .uri()
            .path_and_query()
            .and_then(|pq| http::Uri::try_from(pq.as_str()).ok())
            .unwrap_or_default();
        let mut headers = http::HeaderMap::with_capacity(Head::headers(self).len());
        for (name, value) in Head::headers(self) {
            if let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(name.as_str().as_bytes()),
                http::HeaderValue::from_bytes(value.as_bytes()),
            ) {
                headers.append(name, value);
            }
        }
        RequestHead::new(method, uri, headers, Some(client))
    }
}
