//! Reading a top-level member of a JSON body exactly as a handler's
//! `web::Json` (serde_json) would read it, or refusing the body.

use std::fmt;

use actix_web::http::header::{self, HeaderMap};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::values::Unreadable;

/// Whether `Content-Type` names a JSON body as actix's `web::Json` takes
/// it: `application/json`, or any `+json` type (`application/problem+json`).
pub(crate) fn is_json(headers: &HeaderMap) -> bool {
    media_type(headers).is_some_and(|m| {
        let m = m.to_ascii_lowercase();
        m == "application/json" || (m.contains('/') && m.ends_with("+json"))
    })
}

/// The media type of `Content-Type`, without parameters.
fn media_type(headers: &HeaderMap) -> Option<&str> {
    let ct = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    ct.split(';').next().map(str::trim)
}

/// A JSON body the filter may read as the handler does: no content
/// coding, and no charset but UTF-8 (serde_json reads the bytes as UTF-8
/// whatever the header says, so a body declared in another charset would
/// be read one way here and meant another way by its sender).
pub(crate) fn check_json_headers(headers: &HeaderMap) -> Result<(), Unreadable> {
    let unsupported = Unreadable::Unsupported;
    for coding in headers.get_all(header::CONTENT_ENCODING) {
        let identity = coding
            .to_str()
            .is_ok_and(|c| c.trim().eq_ignore_ascii_case("identity"));
        if !identity {
            return Err(unsupported(
                "a JSON body with a content coding cannot be read\n",
            ));
        }
    }
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return Ok(());
    };
    for param in ct.split(';').skip(1) {
        let Some((name, value)) = param.split_once('=') else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("charset") {
            let value = value.trim().trim_matches('"');
            if !(value.eq_ignore_ascii_case("utf-8") || value.eq_ignore_ascii_case("utf8")) {
                return Err(unsupported("a JSON body must be UTF-8\n"));
            }
        }
    }
    Ok(())
}

/// The member `name` of a JSON object body: a string as is, a number as
/// its JSON text, `None` for any other value, for no such member, or for
/// a body that is valid JSON but no object. Refused (400): a body that is
/// not valid JSON (as serde_json reads it: no byte-order mark, UTF-8, one
/// value), and an object that names `name` twice (serde_json's map would
/// take the last, a struct refuses: the filter and the handler could
/// disagree). Names are compared after JSON unescaping, as serde does.
pub(crate) fn json_value(body: &[u8], name: &str) -> Result<Option<String>, Unreadable> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = de
        .deserialize_any(Member { name })
        .and_then(|found| de.end().map(|()| found));
    match found {
        Ok(Found::Once(raw)) => Ok(scalar(&raw)),
        Ok(Found::Absent) => Ok(None),
        Ok(Found::Twice) => Err(Unreadable::Malformed("a key member is repeated\n")),
        Err(_) => Err(Unreadable::Malformed("the body is not valid JSON\n")),
    }
}

/// A string's value, or a number's JSON text.
fn scalar(raw: &RawValue) -> Option<String> {
    let text = raw.get();
    match text.as_bytes().first()? {
        b'"' => serde_json::from_str::<String>(text).ok(),
        b'-' | b'0'..=b'9' => Some(text.to_string()),
        _ => None,
    }
}

enum Found {
    Absent,
    Once(Box<RawValue>),
    Twice,
}

struct Member<'n> {
    name: &'n str,
}

impl<'de> Visitor<'de> for Member<'_> {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let mut found = Found::Absent;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key == self.name {
                let value: Box<RawValue> = map.next_value()?;
                found = match found {
                    Found::Absent => Found::Once(value),
                    _ => Found::Twice,
                };
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }

    // Any other value is valid JSON without the member.
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Found, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Found::Absent)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Found, E> {
        Ok(Found::Absent)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Found, E> {
        Ok(Found::Absent)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Found, E> {
        Ok(Found::Absent)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Found, E> {
        Ok(Found::Absent)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Found, E> {
        Ok(Found::Absent)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Found, E> {
        Ok(Found::Absent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::{HeaderName, HeaderValue};

    fn v(body: &str) -> Result<Option<String>, Unreadable> {
        json_value(body.as_bytes(), "phone")
    }

    #[test]
    fn members_are_read_as_serde_reads_them() {
        assert_eq!(v(r#"{"phone":"+1 555"}"#), Ok(Some("+1 555".into())));
        assert_eq!(
            v(r#" {"a":{"phone":1},"ph\u006fne":"x\"y"} "#),
            Ok(Some("x\"y".into()))
        );
        assert_eq!(
            v(r#"{"phone":15550109999}"#),
            Ok(Some("15550109999".into()))
        );
        assert_eq!(v(r#"{"phone":-1.50e3}"#), Ok(Some("-1.50e3".into())));
        for absent in [
            r#"{"phone":null}"#,
            r#"{"phone":true}"#,
            r#"{"phone":["1"]}"#,
            r#"{"phone":{"a":1}}"#,
            r#"{"phones":"1"}"#,
            r#"["phone","1"]"#,
            r#""phone""#,
            "12",
            "null",
        ] {
            assert_eq!(v(absent), Ok(None), "{absent}");
        }
        // What a handler's struct gets, for the values accepted.
        #[derive(serde::Deserialize)]
        struct Handler {
            phone: String,
        }
        for body in [
            r#"{"phone":"+1 555","x":[1,{"phone":2}]}"#,
            r#"{"ph\u006fne":"\u00e9"}"#,
        ] {
            let h: Handler = serde_json::from_str(body).unwrap();
            assert_eq!(v(body), Ok(Some(h.phone)), "{body}");
        }
    }

    #[test]
    fn invalid_or_ambiguous_bodies_are_refused() {
        for bad in [
            "",
            "{",
            r#"{"phone":"1"} x"#,
            r#"{"phone":"1",}"#,
            "{'phone':'1'}",
            r#"{"phone":"1","phone":"2"}"#,
            r#"{"phone":"1","ph\u006fne":"1"}"#,
            "\u{feff}{\"phone\":\"1\"}",
        ] {
            assert!(matches!(v(bad), Err(Unreadable::Malformed(_))), "{bad:?}");
        }
        assert!(json_value(b"{\"phone\":\"\xff\"}", "phone").is_err());
        // Other members may repeat: only the key's member is read.
        assert_eq!(v(r#"{"a":1,"a":2,"phone":"3"}"#), Ok(Some("3".into())));
    }

    #[test]
    fn content_types_and_charsets() {
        let h = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            h
        };
        assert!(is_json(&h("application/json")));
        assert!(is_json(&h("Application/JSON; charset=utf-8")));
        assert!(is_json(&h("application/problem+json")));
        assert!(!is_json(&h("text/plain")));
        assert!(!is_json(&h("application/x-www-form-urlencoded")));
        assert!(!is_json(&HeaderMap::new()));
        assert_eq!(check_json_headers(&h("application/json")), Ok(()));
        assert_eq!(
            check_json_headers(&h("application/json; charset=\"UTF-8\"")),
            Ok(())
        );
        assert!(check_json_headers(&h("application/json; charset=utf-16")).is_err());
        assert!(check_json_headers(&h("application/json; charset=latin1")).is_err());
        let mut gz = h("application/json");
        gz.insert(
            HeaderName::from_static("content-encoding"),
            HeaderValue::from_static("gzip"),
        );
        assert!(matches!(
            check_json_headers(&gz),
            Err(Unreadable::Unsupported(_))
        ));
    }
}
