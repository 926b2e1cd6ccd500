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
