//! Who is asking: the client address behind trusted proxies, and the Redis
//! key of each rule for a request. Pure functions of the request's parts.

use std::net::{IpAddr, Ipv6Addr};

use actix_web::http::header::HeaderMap;
use sha2::{Digest, Sha256};

use crate::config::{Cidr, Normalize};

/// Longest ID kept as is in a Redis key; longer ones are hashed.
pub const MAX_ID_BYTES: usize = 64;

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
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => {
            let net = u128::from(v6) & (u128::MAX << 64);
            format!("{}/64", Ipv6Addr::from(net))
        }
    }
}

/// The client address (CONTRACT 3.5): the TCP peer, unless the peer is a
/// trusted proxy; then the right-most address of `Forwarded` (or, without
/// it, `X-Forwarded-For`) that is not itself a trusted proxy. A hop that
/// cannot be read ends the walk at the last address known good.
pub fn client_addr(peer: IpAddr, headers: &HeaderMap, trusted: &[Cidr]) -> IpAddr {
    let peer = canonical_ip(peer);
    let is_trusted = |ip: IpAddr| trusted.iter().any(|c| c.contains(ip));
    if !is_trusted(peer) {
        return peer;
    }
    let hops = forwarded_hops(headers);
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

/// The addresses a request passed through, left (client) to right.
fn forwarded_hops(headers: &HeaderMap) -> Vec<String> {
    let forwarded: Vec<&[u8]> = headers.get_all("forwarded").map(|v| v.as_bytes()).collect();
    if !forwarded.is_empty() {
        let mut hops = Vec::new();
        for value in forwarded {
            let value = String::from_utf8_lossy(value);
            for element in value.split(',') {
                // An element without `for=` still is a hop we cannot read.
                let for_ = element.split(';').find_map(|pair| {
                    let (k, v) = pair.split_once('=')?;
                    k.trim()
                        .eq_ignore_ascii_case("for")
                        .then(|| v.trim().trim_matches('"').to_string())
                });
                hops.push(for_.unwrap_or_default());
            }
        }
        return hops;
    }
    headers
        .get_all("x-forwarded-for")
        .flat_map(|v| {
            String::from_utf8_lossy(v.as_bytes())
                .split(',')
                .map(|s| s.trim().to_string())
                .collect::<Vec<_>>()
        })
        .collect()
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

/// Applies a rule's `normalize` to a header, query or form value.
pub fn normalize(value: &str, how: Normalize) -> String {
    match how {
        Normalize::None => value.to_string(),
        Normalize::Digits => value.chars().filter(char::is_ascii_digit).collect(),
        Normalize::Lowercase => value.trim().to_lowercase(),
    }
}

/// `PREFIX:RULE:KIND:ID`, with an ID longer than 64 bytes replaced by
/// `~` and 40 hex digits of its SHA-256.
pub fn redis_key(prefix: &str, rule: &str, kind: &str, id: &str) -> String {
    redis_key_for(false, prefix, rule, kind, id)
}

/// [`redis_key`], and with `hash_tag` (Redis Cluster) the ID in braces,
/// `PREFIX:RULE:KIND:{ID}`: Redis Cluster then places a key by its ID
/// alone, so the rules that key one request by the same value share a slot
/// (and are decided in one atomic call), while different IDs spread over
/// the masters.
pub fn redis_key_for(hash_tag: bool, prefix: &str, rule: &str, kind: &str, id: &str) -> String {
    let hashed;
    let id = if id.len() <= MAX_ID_BYTES {
        id
    } else {
        let digest = Sha256::digest(id.as_bytes());
        let hex: String = digest[..20].iter().map(|b| format!("{b:02x}")).collect();
        hashed = format!("~{hex}");
        &hashed
    };
    if hash_tag {
        format!("{prefix}:{rule}:{kind}:{{{id}}}")
    } else {
        format!("{prefix}:{rule}:{kind}:{id}")
    }
}

/// The first value of `name` in an urlencoded string (query or form body).
pub fn form_value(encoded: &[u8], name: &str) -> Option<String> {
    form_urlencoded::parse(encoded)
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::{HeaderName, HeaderValue};

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn untrusted_peer_is_the_client_whatever_it_says() {
        let h = headers(&[("x-forwarded-for", "9.9.9.9")]);
        assert_eq!(client_addr(ip("1.2.3.4"), &h, &[]), ip("1.2.3.4"));
    }

    #[test]
    fn rightmost_untrusted_hop_behind_trusted_proxies() {
        let trusted = [Cidr::parse("10.0.0.0/8").unwrap()];
        // The client forged 6.6.6.6; the proxy appended the real 5.5.5.5.
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 5.5.5.5, 10.0.0.2")]);
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &trusted), ip("5.5.5.5"));
        let h = headers(&[(
            "forwarded",
            "for=6.6.6.6, for=\"[2001:db8::1]:4711\";proto=https",
        )]);
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &trusted), ip("2001:db8::1"));
        let h = headers(&[("x-forwarded-for", "garbage")]);
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &trusted), ip("10.0.0.1"));
    }

    #[test]
    fn ipv6_keys_by_64_and_mapped_is_v4() {
        assert_eq!(ip_id(ip("2001:db8:1:2:3:4:5:6")), "2001:db8:1:2::/64");
        assert_eq!(ip_id(ip("::ffff:1.2.3.4")), "1.2.3.4");
    }

    #[test]
    fn long_ids_are_hashed() {
        let k = redis_key("fg", "r", "header", &"x".repeat(65));
        let id = k.rsplit(':').next().unwrap();
        assert_eq!(id.len(), 41);
        assert_eq!(redis_key("fg", "r", "ip", "1.2.3.4"), "fg:r:ip:1.2.3.4");
    }

    #[test]
    fn cluster_keys_tag_the_id() {
        assert_eq!(
            redis_key_for(true, "fg", "r", "ip", "1.2.3.4"),
            "fg:r:ip:{1.2.3.4}"
        );
        let long = redis_key_for(true, "fg", "r", "header", &"x".repeat(65));
        let plain = redis_key("fg", "r", "header", &"x".repeat(65));
        let id = plain.rsplit(':').next().unwrap();
        assert_eq!(long, format!("fg:r:header:{{{id}}}"));
    }

    #[test]
    fn normalizing() {
        assert_eq!(
            normalize("+1 (555) 010-9999", Normalize::Digits),
            "15550109999"
        );
        assert_eq!(normalize(" A@B.c ", Normalize::Lowercase), "a@b.c");
    }
}
