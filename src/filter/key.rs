//! Who is asking: the client address behind trusted proxies, the values a
//! rule reads (read exactly as a handler would, or refused), phone numbers
//! in E.164, and the Redis key of each rule for a request. Pure functions of
//! the request's parts.

use std::net::{IpAddr, Ipv6Addr};

use actix_web::http::header::HeaderMap;
use phonenumber::metadata::DATABASE;
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

/// The client address: the TCP peer, unless the peer is a trusted proxy.
/// Then the forwarding headers are walked from the right, over the hops
/// that trusted proxies appended, and the first address that is not a
/// trusted proxy is the client. A hop that cannot be read ends the walk at
/// the last trusted address.
///
/// `Forwarded` and `X-Forwarded-For` are walked separately. When a request
/// carries only one of them, that one decides. When it carries both, the
/// proxy appended to one of them and the client may have written the other
/// from scratch (nginx, for one, appends only `X-Forwarded-For` and passes a
/// client's `Forwarded` on untouched), so neither may decide alone: if both
/// walks end at the same address that is the client, otherwise the request
/// is keyed by the trusted peer itself, an address no client can choose.
pub fn client_addr(peer: IpAddr, headers: &HeaderMap, trusted: &[Cidr]) -> IpAddr {
    let peer = canonical_ip(peer);
    let is_trusted = |ip: IpAddr| trusted.iter().any(|c| c.contains(ip));
    if !is_trusted(peer) {
        return peer;
    }
    let walk = |hops: Vec<String>| {
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
    };
    let forwarded = forwarded_hops(headers);
    let xff = x_forwarded_for_hops(headers);
    match (forwarded, xff) {
        (None, None) => peer,
        (Some(hops), None) | (None, Some(hops)) => walk(hops),
        (Some(f), Some(x)) => {
            let (f, x) = (walk(f), walk(x));
            if f == x {
                f
            } else {
                peer
            }
        }
    }
}

/// The `for=` of every `Forwarded` element, left (client) to right, over
/// every `Forwarded` line in order; `None` without the header. An element
/// without a readable `for=` is an empty hop (which ends a walk).
fn forwarded_hops(headers: &HeaderMap) -> Option<Vec<String>> {
    let mut lines = headers.get_all("forwarded").peekable();
    lines.peek()?;
    let mut hops = Vec::new();
    for value in lines {
        let value = String::from_utf8_lossy(value.as_bytes());
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
fn x_forwarded_for_hops(headers: &HeaderMap) -> Option<Vec<String>> {
    let mut lines = headers.get_all("x-forwarded-for").peekable();
    lines.peek()?;
    Some(
        lines
            .flat_map(|v| {
                String::from_utf8_lossy(v.as_bytes())
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

/// Applies a rule's `normalize` to a header, query or form value; `None`
/// when nothing is left (the request is then keyed by its address).
pub fn normalize(value: &str, how: Normalize) -> Option<String> {
    let v = match how {
        Normalize::None => value.to_string(),
        Normalize::Digits => value.chars().filter(char::is_ascii_digit).collect(),
        Normalize::Lowercase => value.trim().to_lowercase(),
        Normalize::E164(region) => return e164(value, region),
    };
    (!v.is_empty()).then_some(v)
}

/// A region whose dialling conventions apply to numbers written without a
/// leading `+` (its national prefix, its international prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region(phonenumber::country::Id);

impl Region {
    /// A two-letter region code with phone number data (`US`, `GB`, `de`…).
    pub fn parse(code: &str) -> Option<Region> {
        let id: phonenumber::country::Id = code.trim().to_ascii_uppercase().parse().ok()?;
        DATABASE.by_id(id.as_ref())?;
        Some(Region(id))
    }

    /// The United States (the default).
    pub fn us() -> Region {
        Region(phonenumber::country::US)
    }

    /// The two-letter code.
    pub fn code(&self) -> &str {
        self.0.as_ref()
    }
}

impl Default for Region {
    fn default() -> Region {
        Region::us()
    }
}

/// Longest phone value parsed (anything longer is not a phone number).
const MAX_PHONE_CHARS: usize = 64;

/// A phone number in E.164, `+DIGITS`: a leading `+` gives the country
/// code; otherwise `region`'s international prefix (011 in the US, 00 in
/// most of Europe) or national prefix (1 in the US, 0 in the UK) is
/// recognised and removed as libphonenumber does. Only digits, one leading
/// `+`, spaces and `-./()[]` are accepted. `None` unless the result is a
/// possible number (the national part has a length the country uses), so
/// that `+1 555 010 7777`, `1-555-010-7777` and `011 1 555 010 7777` are
/// one number, and `001 555 010 7777` (no US prefix) is none.
///
/// The site reads its phone fields with this same function, so its
/// accounts and the rules agree on what one number is.
pub fn e164(value: &str, region: Region) -> Option<String> {
    let t = value.trim();
    if t.is_empty() || t.len() > MAX_PHONE_CHARS {
        return None;
    }
    let body = t.strip_prefix('+').unwrap_or(t);
    if !body
        .chars()
        .all(|c| c.is_ascii_digit() || " -./()[]".contains(c))
    {
        return None;
    }
    if !body.chars().any(|c| c.is_ascii_digit()) {
        return None;
    }
    // The parser is third-party code fed with client input: a panic in it
    // must cost this request its key, never the worker.
    let parsed = std::panic::catch_unwind(|| phonenumber::parse(Some(region.0), t)).ok()?;
    let number = parsed.ok()?;
    let code = number.code().value();
    let national = number.national().to_string();
    let len = u16::try_from(national.len()).ok()?;
    if !possible_length(code, len) {
        return None;
    }
    let e164 = format!("+{code}{national}");
    // E.164 allows at most 15 digits.
    (e164.len() <= 16).then_some(e164)
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

/// Whether national numbers of country `code` have `len` digits: the
/// lengths of any number type of the country's main region (what
/// libphonenumber's "possible number" means), local-only lengths excluded.
fn possible_length(code: u16, len: u16) -> bool {
    let Some(meta) = DATABASE.by_code(&code).and_then(|m| m.into_iter().next()) else {
        return false;
    };
    let d = meta.descriptors();
    if d.general().possible_length().contains(&len) {
        return true;
    }
    [
        d.fixed_line(),
        d.mobile(),
        d.toll_free(),
        d.premium_rate(),
        d.shared_cost(),
        d.personal_number(),
        d.voip(),
        d.pager(),
        d.uan(),
        d.voicemail(),
    ]
    .into_iter()
    .flatten()
    .any(|desc| desc.possible_length().contains(&len))
}

/// Joins the parts of a composite key: KIND is the kinds joined by `+`, ID
/// the IDs joined by `|`, each with `%` and `|` percent-escaped so that no
/// two different combinations make the same ID.
pub fn compose(parts: &[(&str, String)]) -> (String, String) {
    let kind = parts.iter().map(|(k, _)| *k).collect::<Vec<_>>().join("+");
    let id = parts
        .iter()
        .map(|(_, id)| id.replace('%', "%25").replace('|', "%7C"))
        .collect::<Vec<_>>()
        .join("|");
    (kind, id)
}

/// A value a rule must read but may not read alone: the request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreadable {
    /// 400: the field is repeated, or is not text (invalid UTF-8 after
    /// percent-decoding, or a header value that is not visible ASCII).
    Malformed(&'static str),
    /// 415: the body's charset (or content coding) is not one the filter
    /// reads exactly as the handler would.
    Unsupported(&'static str),
}

/// The value of `name` in urlencoded text (a query string, or a form body
/// already decoded from its charset), read as `form_urlencoded` and serde
/// read it for a handler (`+` is a space, then percent-decoding). `Ok(None)`
/// when absent. A name that appears more than once is refused, since
/// handlers differ on which one they take (a struct refuses, a map takes the
/// last, a list the first); so is a value that does not decode to UTF-8
/// (a handler would see U+FFFD in its place, and different values would
/// look alike).
pub fn urlencoded_value(encoded: &[u8], name: &str) -> Result<Option<String>, Unreadable> {
    let decode = |raw: &[u8]| -> Vec<u8> {
        let plus: Vec<u8> = raw
            .iter()
            .map(|b| if *b == b'+' { b' ' } else { *b })
            .collect();
        percent_encoding::percent_decode(&plus).collect()
    };
    let mut found: Option<String> = None;
    for pair in encoded.split(|b| *b == b'&') {
        if pair.is_empty() {
            continue;
        }
        let (n, v) = match pair.iter().position(|b| *b == b'=') {
            Some(i) => (&pair[..i], &pair[i + 1..]),
            None => (pair, &pair[pair.len()..]),
        };
        if decode(n) != name.as_bytes() {
            continue;
        }
        if found.is_some() {
            return Err(Unreadable::Malformed("a key field is repeated\n"));
        }
        let value = String::from_utf8(decode(v))
            .map_err(|_| Unreadable::Malformed("a key field is not valid UTF-8\n"))?;
        found = Some(value);
    }
    Ok(found)
}

/// The value of header `name`, when it appears once and is visible ASCII
/// (what `HeaderValue::to_str` gives a handler). Repeated lines and values
/// with other bytes are refused: a handler would see another value or none.
pub fn header_value(headers: &HeaderMap, name: &str) -> Result<Option<String>, Unreadable> {
    let mut lines = headers.get_all(name);
    let Some(first) = lines.next() else {
        return Ok(None);
    };
    if lines.next().is_some() {
        return Err(Unreadable::Malformed("a key header is repeated\n"));
    }
    first
        .to_str()
        .map(|v| Some(v.to_string()))
        .map_err(|_| Unreadable::Malformed("a key header is not visible ASCII\n"))
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
            normalize("+1 (555) 010-9999", Normalize::Digits).as_deref(),
            Some("15550109999")
        );
        assert_eq!(
            normalize(" A@B.c ", Normalize::Lowercase).as_deref(),
            Some("a@b.c")
        );
        assert_eq!(normalize("()", Normalize::Digits), None);
        assert_eq!(
            normalize("555 010 7777", Normalize::E164(Region::us())).as_deref(),
            Some("+15550107777")
        );
    }

    #[test]
    fn e164_makes_one_number_of_every_way_of_writing_it() {
        let us = Region::us();
        for same in [
            "+1 555 010 7777",
            "+15550107777",
            "1 555 010 7777",
            "1-555-010-7777",
            "(555) 010-7777",
            "555.010.7777",
            "011 1 555 010 7777",
            " +1 [555] 010 7777 ",
        ] {
            assert_eq!(e164(same, us).as_deref(), Some("+15550107777"), "{same}");
        }
        // Prefixes the US does not use, and impossible lengths: no number.
        for none in [
            "001 555 010 7777",
            "0001 555 010 7777",
            "00001 555 010 7777",
            "12345",
            "+1 555 010 77777",
            "",
            "+",
            "555-CALL-NOW",
            "+1 555 010 7777 ext 5",
            "++15550107777",
            "1+5550107777",
        ] {
            assert_eq!(e164(none, us), None, "{none}");
        }
        // Where 00 is the international prefix and 0 the national one.
        let gb = Region::parse("gb").unwrap();
        assert_eq!(
            e164("00 1 555 010 7777", gb).as_deref(),
            Some("+15550107777")
        );
        assert_eq!(e164("020 7946 0000", gb).as_deref(), Some("+442079460000"));
        assert_eq!(
            e164("+44 20 7946 0000", us).as_deref(),
            Some("+442079460000")
        );
        // Italian numbers keep their leading zero.
        assert_eq!(
            e164("+39 06 6982 0000", us).as_deref(),
            Some("+390669820000")
        );
    }

    #[test]
    fn regions_are_checked() {
        assert_eq!(Region::parse("US"), Some(Region::us()));
        assert_eq!(Region::parse("de").unwrap().code(), "DE");
        for bad in ["", "XX", "USA", "zz", "1"] {
            assert_eq!(Region::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_client_forwarded_header_cannot_beat_the_proxys_x_forwarded_for() {
        let trusted = [Cidr::parse("10.0.0.0/8").unwrap()];
        let peer = ip("10.0.0.1");
        // nginx appended 5.5.5.5 to X-Forwarded-For; the client wrote Forwarded.
        let h = headers(&[("forwarded", "for=6.6.6.6"), ("x-forwarded-for", "5.5.5.5")]);
        assert_eq!(client_addr(peer, &h, &trusted), peer);
        // Both say the same: that is the client.
        let h = headers(&[("forwarded", "for=5.5.5.5"), ("x-forwarded-for", "5.5.5.5")]);
        assert_eq!(client_addr(peer, &h, &trusted), ip("5.5.5.5"));
        // Several lines are one list, in order.
        let h = headers(&[
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-for", "2.2.2.2, 10.0.0.7"),
        ]);
        assert_eq!(client_addr(peer, &h, &trusted), ip("2.2.2.2"));
        // Garbage stops the walk at the last trusted hop.
        let h = headers(&[("x-forwarded-for", "1.1.1.1, nonsense, 10.0.0.7")]);
        assert_eq!(client_addr(peer, &h, &trusted), ip("10.0.0.7"));
        let h = headers(&[("forwarded", "for=unknown")]);
        assert_eq!(client_addr(peer, &h, &trusted), peer);
    }

    #[test]
    fn urlencoded_values_are_read_as_handlers_read_them_or_refused() {
        let v = |s: &str| urlencoded_value(s.as_bytes(), "phone");
        assert_eq!(v("phone=%2B1+555&x=1"), Ok(Some("+1 555".into())));
        assert_eq!(v("ph%6Fne=1%202"), Ok(Some("1 2".into())));
        assert_eq!(v("phone"), Ok(Some(String::new())));
        assert_eq!(v("x=1&&phones=2"), Ok(None));
        assert!(matches!(
            v("phone=1&phone=2"),
            Err(Unreadable::Malformed(_))
        ));
        assert!(matches!(
            v("phone=1&ph%6Fne=1"),
            Err(Unreadable::Malformed(_))
        ));
        assert!(matches!(v("phone=%FF"), Err(Unreadable::Malformed(_))));
        // What serde gives a handler, for the values accepted.
        for body in ["phone=%2B1+555&x=1", "ph%6Fne=1%202", "a=%zz&phone=a+b%2Bc"] {
            let handler: std::collections::HashMap<String, String> =
                serde_urlencoded::from_str(body).unwrap();
            assert_eq!(v(body).unwrap().as_ref(), handler.get("phone"), "{body}");
        }
    }

    #[test]
    fn header_values_must_be_single_and_visible_ascii() {
        let h = headers(&[("x-user", "bob"), ("x-twice", "a"), ("x-twice", "b")]);
        assert_eq!(header_value(&h, "x-user"), Ok(Some("bob".into())));
        assert_eq!(header_value(&h, "x-none"), Ok(None));
        assert!(header_value(&h, "x-twice").is_err());
        let mut h = HeaderMap::new();
        h.insert(
            HeaderName::from_static("x-user"),
            HeaderValue::from_bytes(b"b\xe9b").unwrap(),
        );
        assert!(header_value(&h, "x-user").is_err());
    }

    #[test]
    fn composite_ids_cannot_collide() {
        let a = compose(&[("header", "a|b".into()), ("ip", "c".into())]);
        let b = compose(&[("header", "a".into()), ("ip", "b|c".into())]);
        assert_ne!(a, b);
        assert_eq!(
            compose(&[("form", "+15550107777".into()), ("ip", "1.2.3.4".into())]),
            ("form+ip".to_string(), "+15550107777|1.2.3.4".to_string())
        );
    }
}
