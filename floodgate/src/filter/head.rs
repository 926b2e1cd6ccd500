//! What the filter reads of a request before its body, whatever the web
//! framework: each door (the actix-web `Transform`, the tower `Layer`)
//! implements [`Head`] for its own request type, so that matching rules and
//! building keys are one code for every door, and no request is copied to
//! be read.

use std::net::IpAddr;

use crate::net::HeaderLines;
use crate::rule::{CustomKey, Rule};

use super::SessionLookup;

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
    /// Whether `rule`'s skip predicate lets this request past it.
    fn skips(&self, rule: &Rule) -> bool;
    /// The value of an application's key function, where this door can
    /// call it.
    fn custom(&self, f: &CustomKey) -> Option<String>;
    /// Who is signed in, where this door can tell.
    fn session(&self, lookup: &SessionLookup) -> Option<String>;
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

    fn skips(&self, rule: &Rule) -> bool {
        !rule.applies_to(self)
    }

    fn custom(&self, f: &CustomKey) -> Option<String> {
        f.key(self)
    }

    fn session(&self, lookup: &SessionLookup) -> Option<String> {
        lookup(self)
    }
}
