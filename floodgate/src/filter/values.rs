//! Reading the values a rule keys by from a request, exactly as a handler
//! would read them, or refusing the request. Pure functions of its parts.

use crate::net::HeaderLines;

/// A value a rule must read but may not read alone: the request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreadable {
    /// 400: the field is repeated, or is not text (invalid UTF-8 after
    /// percent-decoding, or a header value that is not visible ASCII).
    Malformed(&'static str),
    /// 415: the body's charset (or content coding) is not one the filter
    /// reads exactly as the handler would.
    Unsupported(&'static str),
    /// 400 with `{"error":"missing_key",...}`: the rule's kind at this
    /// place in its key has no value, and the rule's `on_missing_key` is
    /// `reject`.
    Missing(usize),
}

/// Whether a request's body comes in a content coding (a `Content-Encoding`
/// other than `identity`): the filter reads a body as it comes, so a rule
/// that reads one refuses it (415) rather than key by other bytes than the
/// handler gets.
pub(crate) fn content_coded(headers: &impl HeaderLines) -> bool {
    headers.lines("content-encoding").any(|coding| {
        !std::str::from_utf8(coding).is_ok_and(|c| c.trim().eq_ignore_ascii_case("identity"))
    })
}

/// The bodies a request's keys may read: the urlencoded form (decoded from
/// its charset) or the JSON body, as the filter read them.
pub(crate) struct BodyRead<'a> {
    /// A form body.
    pub form: Option<&'a [u8]>,
    /// A JSON body.
    pub json: Option<&'a [u8]>,
}

/// A rule's Redis key for a request, and the quota a key function chose
/// for that identity (`None`: the rule's own).
pub(crate) struct Keyed {
    /// `PREFIX:RULE:KIND:ID`.
    pub key: String,
    /// The identity's own quota.
    pub limit: Option<u32>,
}

/// The value of `name` in urlencoded text (a query string, or a form body
/// already decoded from its charset), read as `form_urlencoded` and serde
/// read it for a handler (`+` is a space, then percent-decoding). `Ok(None)`
/// when absent. A name that appears more than once is refused, since
/// handlers differ on which one they take (a struct refuses, a map takes the
/// last, a list the first); so is a value that does not decode to UTF-8
/// (a handler would see U+FFFD in its place, and different values would
/// look alike).
pub(crate) fn urlencoded_value(encoded: &[u8], name: &str) -> Result<Option<String>, Unreadable> {
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
            return Err(Unreadable::Malformed("a key field is repeated"));
        }
        let value = String::from_utf8(decode(v))
            .map_err(|_| Unreadable::Malformed("a key field is not valid UTF-8"))?;
        found = Some(value);
    }
    Ok(found)
}

/// The value of header `name`, when it appears once and is visible ASCII
/// (what `HeaderValue::to_str` gives a handler). Repeated lines and values
/// with other bytes are refused: a handler would see another value or none.
pub(crate) fn header_value(
    headers: &impl HeaderLines,
    name: &str,
) -> Result<Option<String>, Unreadable> {
    let mut lines = headers.lines(name);
    let Some(first) = lines.next() else {
        return Ok(None);
    };
    if lines.next().is_some() {
        return Err(Unreadable::Malformed("a key header is repeated"));
    }
    // What `HeaderValue::to_str` accepts: visible ASCII and tabs.
    if first.iter().all(|&b| b == b'\t' || (32..127).contains(&b)) {
        Ok(Some(String::from_utf8_lossy(first).into_owned()))
    } else {
        Err(Unreadable::Malformed("a key header is not visible ASCII"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::{client_addr, ip_id, Cidr, ProxyHeader};
    use crate::rule::{compose, normalize, redis_key_for, Normalize};
    #[cfg(feature = "e164")]
    use crate::rule::{e164, Region};
    use http::{HeaderMap, HeaderName, HeaderValue};
    use std::net::IpAddr;

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
        for header in [ProxyHeader::XForwardedFor, ProxyHeader::Forwarded] {
            assert_eq!(client_addr(ip("1.2.3.4"), &h, &[], header), ip("1.2.3.4"));
        }
    }

    #[test]
    fn rightmost_untrusted_hop_behind_trusted_proxies() {
        let trusted = [Cidr::parse("10.0.0.0/8").unwrap()];
        // The client forged 6.6.6.6; the proxy appended the real 5.5.5.5.
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 5.5.5.5, 10.0.0.2")]);
        let xff = ProxyHeader::XForwardedFor;
        assert_eq!(
            client_addr(ip("10.0.0.1"), &h, &trusted, xff),
            ip("5.5.5.5")
        );
        let h = headers(&[(
            "forwarded",
            "for=6.6.6.6, for=\"[2001:db8::1]:4711\";proto=https",
        )]);
        let fwd = ProxyHeader::Forwarded;
        assert_eq!(
            client_addr(ip("10.0.0.1"), &h, &trusted, fwd),
            ip("2001:db8::1")
        );
        let h = headers(&[("x-forwarded-for", "garbage")]);
        assert_eq!(
            client_addr(ip("10.0.0.1"), &h, &trusted, xff),
            ip("10.0.0.1")
        );
    }

    #[test]
    fn ipv6_keys_by_64_and_mapped_is_v4() {
        assert_eq!(ip_id(ip("2001:db8:1:2:3:4:5:6")), "2001:db8:1:2::/64");
        assert_eq!(ip_id(ip("::ffff:1.2.3.4")), "1.2.3.4");
    }

    #[test]
    fn long_ids_are_hashed() {
        let k = redis_key_for(false, "fg", "r", "header", &"x".repeat(65));
        let id = k.rsplit(':').next().unwrap();
        assert_eq!(id.len(), 41);
        assert_eq!(
            redis_key_for(false, "fg", "r", "ip", "1.2.3.4"),
            "fg:r:ip:1.2.3.4"
        );
        // A value written as `~` and that hash is hashed in turn: it never
        // shares the long value's counter.
        let forged = redis_key_for(false, "fg", "r", "header", id);
        assert_ne!(forged, k);
        assert_eq!(forged.rsplit(':').next().unwrap().len(), 41);
    }

    #[test]
    fn cluster_keys_tag_the_id() {
        assert_eq!(
            redis_key_for(true, "fg", "r", "ip", "1.2.3.4"),
            "fg:r:ip:{1.2.3.4}"
        );
        let long = redis_key_for(true, "fg", "r", "header", &"x".repeat(65));
        let plain = redis_key_for(false, "fg", "r", "header", &"x".repeat(65));
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
    }

    #[test]
    #[cfg(feature = "e164")]
    fn e164_normalizes_a_phone_number() {
        assert_eq!(
            normalize("555 010 7777", Normalize::E164(Region::us())).as_deref(),
            Some("+15550107777")
        );
    }

    #[test]
    #[cfg(feature = "e164")]
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
    #[cfg(feature = "e164")]
    fn regions_are_checked() {
        assert_eq!(Region::parse("US"), Some(Region::us()));
        assert_eq!(Region::parse("de").unwrap().code(), "DE");
        for bad in ["", "XX", "USA", "zz", "1"] {
            assert_eq!(Region::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_the_header_the_proxies_write_is_read() {
        let trusted = [Cidr::parse("10.0.0.0/8").unwrap()];
        let peer = ip("10.0.0.1");
        let (xff, fwd) = (ProxyHeader::XForwardedFor, ProxyHeader::Forwarded);
        // nginx appended 5.5.5.5 to X-Forwarded-For; the client wrote Forwarded.
        let h = headers(&[("forwarded", "for=6.6.6.6"), ("x-forwarded-for", "5.5.5.5")]);
        assert_eq!(client_addr(peer, &h, &trusted, xff), ip("5.5.5.5"));
        // The proxy writes Forwarded; the client wrote X-Forwarded-For.
        assert_eq!(client_addr(peer, &h, &trusted, fwd), ip("6.6.6.6"));
        // Only the other header: the proxy itself is the client.
        let h = headers(&[("forwarded", "for=6.6.6.6")]);
        assert_eq!(client_addr(peer, &h, &trusted, xff), peer);
        let h = headers(&[("x-forwarded-for", "5.5.5.5")]);
        assert_eq!(client_addr(peer, &h, &trusted, fwd), peer);
        // Several lines are one list, in order.
        let h = headers(&[
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-for", "2.2.2.2, 10.0.0.7"),
        ]);
        assert_eq!(client_addr(peer, &h, &trusted, xff), ip("2.2.2.2"));
        // Garbage stops the walk at the last trusted hop.
        let h = headers(&[("x-forwarded-for", "1.1.1.1, nonsense, 10.0.0.7")]);
        assert_eq!(client_addr(peer, &h, &trusted, xff), ip("10.0.0.7"));
        let h = headers(&[("forwarded", "for=unknown")]);
        assert_eq!(client_addr(peer, &h, &trusted, fwd), peer);
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
