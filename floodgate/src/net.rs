//! The client's address: behind trusted proxies, as one ID per host, and
//! the networks (CIDRs) whose forwarding headers are believed.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv6Addr};

/// The lines of a request's header fields, whatever the web framework's
/// header map: what the client address (and the filter's key values) are
/// read from.
pub trait HeaderLines {
    /// Every line of the field `name` (lower case), in order.
    fn lines<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a [u8]>;
}

impl HeaderLines for http::HeaderMap {
    fn lines<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a [u8]> {
        self.get_all(name).iter().map(|v| v.as_bytes())
    }
}

/// IPv4-mapped IPv6 (`::ffff:1.2.3.4`) becomes the IPv4 address.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// The ID of a client address: IPv4 as is, IPv6 by its /64 (one host
/// usually holds a whole /64, so a single address would be no limit).
pub fn ip_id(ip: IpAddr) -> String {
    match canonical_ip(ip) {
        IpAddr::V4(v4) => {
            // At most 15 bytes: one allocation, not one per growth.
            let mut id = String::with_capacity(15);
            let _ = write!(id, "{v4}");
            id
        }
        IpAddr::V6(v6) => {
            let net = u128::from(v6) & (u128::MAX << 64);
            format!("{}/64", Ipv6Addr::from(net))
        }
    }
}

/// The forwarding header the trusted proxies write (`[server]
/// proxy_header`). Only that one is read: the other, which a client (or
/// the client's own proxy) may have sent and the trusted proxy passed on
/// untouched, is ignored entirely.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[non_exhaustive]
pub enum ProxyHeader {
    /// `X-Forwarded-For: client, proxy1, ...` (nginx, HAProxy, most load
    /// balancers).
    #[default]
    #[serde(rename = "x-forwarded-for")]
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1` (RFC 7239).
    #[serde(rename = "forwarded")]
    Forwarded,
}

impl ProxyHeader {
    /// The value as the configuration file writes it.
    pub fn as_str(&self) -> &'static str {
        match self {
            ProxyHeader::XForwardedFor => "x-forwarded-for",
            ProxyHeader::Forwarded => "forwarded",
        }
    }
}

/// The client address: the TCP peer, unless the peer is a trusted proxy.
/// Then `header` (the one the trusted proxies write) is walked from the
/// right, over the hops that trusted proxies appended, and the first
/// address that is not a trusted proxy is the client. A hop that cannot be
/// read ends the walk at the last trusted address; without the header the
/// peer is the client. The other forwarding header is never read.
pub fn client_addr(
    peer: IpAddr,
    headers: &impl HeaderLines,
    trusted: &[Cidr],
    header: ProxyHeader,
) -> IpAddr {
    let peer = canonical_ip(peer);
    let is_trusted = |ip: IpAddr| trusted.iter().any(|c| c.contains(ip));
    if !is_trusted(peer) {
        return peer;
    }
    let hops = match header {
        ProxyHeader::Forwarded => forwarded_hops(headers),
        ProxyHeader::XForwardedFor => x_forwarded_for_hops(headers),
    };
    let Some(hops) = hops else {
        return peer;
    };
    let mut client = peer;
    for hop in hops.iter().rev() {
        match parse_hop(hop) {
            Some(ip) => {
                client = ip;
                if !is_trusted(ip) {
                    break;
                }
            }
            None => break,
        }
    }
    client
}

/// The `for=` of every `Forwarded` element, left (client) to right, over
/// every `Forwarded` line in order; `None` without the header. An element
/// without a readable `for=` is an empty hop (which ends a walk).
fn forwarded_hops(headers: &impl HeaderLines) -> Option<Vec<String>> {
    let mut lines = headers.lines("forwarded").peekable();
    lines.peek()?;
    let mut hops = Vec::new();
    for value in lines {
        let value = String::from_utf8_lossy(value);
        for element in value.split(',') {
            let for_ = element.split(';').find_map(|pair| {
                let (k, v) = pair.split_once('=')?;
                k.trim()
                    .eq_ignore_ascii_case("for")
                    .then(|| v.trim().trim_matches('"').to_string())
            });
            hops.push(for_.unwrap_or_default());
        }
    }
    Some(hops)
}

/// The addresses of every `X-Forwarded-For` line, left to right; `None`
/// without the header.
fn x_forwarded_for_hops(headers: &impl HeaderLines) -> Option<Vec<String>> {
    let mut lines = headers.lines("x-forwarded-for").peekable();
    lines.peek()?;
    Some(
        lines
            .flat_map(|v| {
                String::from_utf8_lossy(v)
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .collect::<Vec<_>>()
            })
            .collect(),
    )
}

/// `1.2.3.4`, `1.2.3.4:80`, `[2001:db8::1]:443`, `2001:db8::1`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(canonical_ip(ip));
    }
    if let Some(rest) = hop.strip_prefix('[') {
        let (inside, _) = rest.split_once(']')?;
        return inside.parse::<IpAddr>().ok().map(canonical_ip);
    }
    let (host, port) = hop.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

/// An IP network whose forwarding headers may be believed: `10.0.0.0/8`,
/// `fd00::/8`, or one address. IPv4-mapped IPv6 addresses count as IPv4.
///
/// ```
/// use floodgate_limiter::net::Cidr;
/// let net = Cidr::parse("10.0.0.0/8").unwrap();
/// assert!(net.contains("10.1.2.3".parse().unwrap()));
/// assert!(net.contains("::ffff:10.1.2.3".parse().unwrap()));
/// assert!(!net.contains("11.0.0.1".parse().unwrap()));
/// assert_eq!(
///     Cidr::parse("10.0.0.0/33").unwrap_err().to_string(),
///     "\"10.0.0.0/33\" is not an IP address or CIDR: the prefix length must be at most 32 for IPv4"
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr(ipnet::IpNet);

/// Why a text is not a [`Cidr`]; `Display` says which text and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CidrError {
    text: String,
    why: &'static str,
}

impl std::fmt::Display for CidrError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} is not an IP address or CIDR: {}",
            self.text, self.why
        )
    }
}

impl std::error::Error for CidrError {}

impl std::str::FromStr for Cidr {
    type Err = CidrError;
    fn from_str(text: &str) -> Result<Cidr, CidrError> {
        Cidr::parse(text)
    }
}

impl Cidr {
    /// Parses `10.0.0.1`, `10.0.0.0/8`, `::1` or `fd00::/8` (a prefix of
    /// digits only, within the address's length).
    pub fn parse(text: &str) -> Result<Cidr, CidrError> {
        let fail = |why| CidrError {
            text: text.to_string(),
            why,
        };
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr = canonical_ip(addr.trim().parse().map_err(|_| {
            fail("the address must be IPv4 (10.0.0.1) or IPv6 (fd00::1), without a port")
        })?);
        let max: u8 = if addr.is_ipv4() { 32 } else { 128 };
        let too_long = if addr.is_ipv4() {
            "the prefix length must be at most 32 for IPv4"
        } else {
            "the prefix length must be at most 128 for IPv6"
        };
        let prefix = match prefix {
            Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
                p.parse::<u8>().map_err(|_| fail(too_long))?
            }
            Some(_) => return Err(fail("the prefix length after \"/\" must be a number")),
            None => max,
        };
        ipnet::IpNet::new(addr, prefix)
            .map(Cidr)
            .map_err(|_| fail(too_long))
    }

    /// Whether `ip` is inside this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(&canonical_ip(ip))
    }
}
