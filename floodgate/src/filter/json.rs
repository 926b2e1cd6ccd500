//! Reading a top-level member of a JSON body exactly as a handler's
//! `web::Json` (serde_json) would read it, or refusing the body.

use std::fmt;

use crate::net::HeaderLines;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::values::Unreadable;
use super::JsonContentType;

/// Which bodies the app's `web::Json` reads: what the filter was told of
/// its `JsonConfig` (see [`FilterBuilder::json_content_type_required`] and
/// [`FilterBuilder::json_content_type`]).
///
/// [`FilterBuilder::json_content_type_required`]: super::FilterBuilder::json_content_type_required
/// [`FilterBuilder::json_content_type`]: super::FilterBuilder::json_content_type
// Only the actix door reads bodies by its `JsonConfig`; the tower door
// reads them as axum's `Json` does, which has no settings.
#[cfg_attr(not(feature = "actix"), allow(dead_code))]
pub(crate) struct JsonBodies {
    /// `JsonConfig::content_type_required`.
    pub required: bool,
    /// `JsonConfig::content_type`.
    pub content_type: Option<Box<JsonContentType>>,
}

#[cfg_attr(not(feature = "actix"), allow(dead_code))]
impl JsonBodies {
    /// Whether the handler's `web::Json` reads the body of `req`, by
    /// actix-web's own rule (`JsonBody::new`): a `Content-Type` that parses
    /// as a media type whose subtype is `json` (`application/json`,
    /// `text/json`, `application/json+x`) or whose suffix is `json`
    /// (`application/problem+json`), or that the app's predicate accepts;
    /// any body at all when the app does not require a `Content-Type`.
    pub(crate) fn reads(&self, headers: &impl HeaderLines) -> bool {
        !self.required || self.declared(headers)
    }

    /// Whether `Content-Type` names a body `web::Json` reads (whether or
    /// not the app requires one). Its first line is parsed as actix's
    /// `HttpMessage::mime_type` parses it: visible ASCII, one media type.
    pub(crate) fn declared(&self, headers: &impl HeaderLines) -> bool {
        let parsed = headers
            .lines("content-type")
            .next()
            .and_then(|v| std::str::from_utf8(v).ok())
            .filter(|v| v.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b)))
            .map(str::parse::<mime::Mime>);
        match parsed {
            Some(Ok(mime)) => {
                mime.subtype() == mime::JSON
                    || mime.suffix() == Some(mime::JSON)
                    || self.content_type.as_ref().is_some_and(|f| f(mime))
            }
            // No Content-Type, or one that is no media type.
            _ => false,
        }
    }
}

impl Default for JsonBodies {
    /// actix-web's default `JsonConfig`.
    fn default() -> Self {
        JsonBodies {
            required: true,
            content_type: None,
        }
    }
}

/// A JSON body the actix door may read as the handler does: no content
/// coding (actix-web's `web::Json` undoes one, the filter does not), and
/// no charset but UTF-8 (serde_json reads the bytes as UTF-8 whatever the
/// header says, so a body declared in another charset would be read one
/// way here and meant another way by its sender). The tower door checks
/// neither: axum's `Json` reads the bytes as they come, whatever either
/// header says, and the filter reads what it reads.
#[cfg_attr(not(feature = "actix"), allow(dead_code))]
pub(crate) fn check_json_headers(headers: &impl HeaderLines) -> Result<(), Unreadable> {
    let unsupported = Unreadable::Unsupported;
    if super::values::content_coded(headers) {
        return Err(unsupported(
            "a JSON body with a content coding cannot be read",
        ));
    }
    let Some(ct) = headers
        .lines("content-type")
        .next()
        .and_then(|v| std::str::from_utf8(v).ok())
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
                return Err(unsupported("a JSON body must be UTF-8"));
            }
        }
    }
    Ok(())
}

/// The member `name` of a JSON object body: a string as is, a number as
/// its JSON text in one spelling per value ([`number_text`]), `None` for any other value, for no such member, or for
/// a body that is valid JSON but no object. Refused (400): a body that is
/// not valid JSON (as serde_json reads it: no byte-order mark, UTF-8, one
/// value), and an object that names `name` twice (serde_json's map would
/// take the last, a struct refuses: the filter and the handler could
/// disagree). Names are compared after JSON unescaping, as serde does.
/// A body a handler's `Json<serde_json::Value>` refuses is refused too:
/// nested deeper than serde_json's limit (128), or a number beyond `f64`.
pub(crate) fn json_value(body: &[u8], name: &str) -> Result<Option<String>, Unreadable> {
    if serde_json::from_slice::<serde_json::Value>(body).is_err() {
        return Err(Unreadable::Malformed("the body is not valid JSON"));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = de
        .deserialize_any(Member { name })
        .and_then(|found| de.end().map(|()| found));
    match found {
        Ok(Found::Once(raw)) => Ok(scalar(&raw)),
        Ok(Found::Absent) => Ok(None),
        Ok(Found::Twice) => Err(Unreadable::Malformed("a key member is repeated")),
        Err(_) => Err(Unreadable::Malformed("the body is not valid JSON")),
    }
}

/// A string's value, or a number's JSON text ([`number_text`]).
fn scalar(raw: &RawValue) -> Option<String> {
    let text = raw.get();
    match text.as_bytes().first()? {
        b'"' => serde_json::from_str::<String>(text).ok(),
        b'-' | b'0'..=b'9' => Some(number_text(text)),
        _ => None,
    }
}

/// A JSON number's text, one spelling per number a handler reads: `77`,
/// `77.0`, `7.7e1` and `770e-1` are all `77` (a handler's `f64` is the
/// same for each, so one counter is), and `-0` is `0`. A whole number as
/// written when an `i64` or `u64` holds it (every digit counts: numeric IDs
/// past 2^53, as snowflake IDs are, stay apart, as a handler reading them
/// as integers sees them); any other number as the shortest text that
/// reads back as the same `f64`.
fn number_text(text: &str) -> String {
    let whole = !text.contains(['.', 'e', 'E']);
    if whole && (text.parse::<i64>().is_ok() || text.parse::<u64>().is_ok()) {
        return if text == "-0" {
            "0".to_string()
        } else {
            text.to_string()
        };
    }
    // (Valid JSON, checked before: it reads as a finite f64.)
    let Ok(x) = text.parse::<f64>() else {
        return text.to_string();
    };
    // Whole and within ±2^53, where every whole number is exact.
    if x.fract() == 0.0 && x.abs() <= 9_007_199_254_740_992.0 {
        return format!("{}", x as i64);
    }
    format!("{x}")
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
    use http::header::{self, HeaderMap};
    use http::header::{HeaderName, HeaderValue};

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
        assert_eq!(v(r#"{"phone":-1.50e3}"#), Ok(Some("-1500".into())));
        // One spelling per number a handler reads: respelling a number
        // never makes another counter.
        for (spelled, keyed) in [
            ("77", "77"),
            ("77.0", "77"),
            ("7.7e1", "77"),
            ("770E-1", "77"),
            ("-0", "0"),
            ("-0.0", "0"),
            ("1.50", "1.5"),
            ("15e-2", "0.15"),
            ("18446744073709551615", "18446744073709551615"),
            ("-9223372036854775808", "-9223372036854775808"),
            ("1e300", &format!("1{}", "0".repeat(300))),
        ] {
            let body = format!(r#"{{"phone":{spelled}}}"#);
            assert_eq!(v(&body), Ok(Some(keyed.to_string())), "{spelled}");
        }
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
        // What a handler's `Json<Value>` refuses: deeper than serde_json's
        // limit, or a number beyond f64, the key's member or another.
        let deep = format!(
            r#"{{"a":{}{},"phone":"1"}}"#,
            "[".repeat(130),
            "]".repeat(130)
        );
        for bad in [
            deep.as_str(),
            r#"{"phone":1e400}"#,
            r#"{"a":-1e999,"phone":"1"}"#,
        ] {
            assert!(serde_json::from_str::<serde_json::Value>(bad).is_err());
            assert!(matches!(v(bad), Err(Unreadable::Malformed(_))), "{bad:?}");
        }
        let fine = format!(
            r#"{{"a":{}{},"phone":"1"}}"#,
            "[".repeat(100),
            "]".repeat(100)
        );
        assert_eq!(v(&fine), Ok(Some("1".into())));
        // Other members may repeat: only the key's member is read.
        assert_eq!(v(r#"{"a":1,"a":2,"phone":"3"}"#), Ok(Some("3".into())));
    }

    #[cfg(feature = "actix")]
    use actix_web::{test::TestRequest, web, FromRequest};

    /// Whether actix's `web::Json` reads a body of `content_type` under
    /// `config`: what the filter must answer.
    #[cfg(feature = "actix")]
    async fn web_json_reads(content_type: Option<&str>, config: web::JsonConfig) -> bool {
        let mut req = TestRequest::post().app_data(config).set_payload("{}");
        if let Some(ct) = content_type {
            req = req.insert_header(("content-type", ct));
        }
        let (req, mut payload) = req.to_http_parts();
        web::Json::<serde_json::Value>::from_request(&req, &mut payload)
            .await
            .is_ok()
    }

    #[cfg(feature = "actix")]
    fn reads(bodies: &JsonBodies, content_type: Option<&str>) -> bool {
        let mut req = TestRequest::post();
        if let Some(ct) = content_type {
            req = req.insert_header(("content-type", ct));
        }
        bodies.reads(req.to_http_request().headers())
    }

    #[cfg(feature = "actix")]
    #[actix_web::test]
    async fn the_bodies_read_are_those_web_json_reads() {
        let types = [
            None,
            Some("application/json"),
            Some("Application/JSON; charset=utf-8"),
            Some("application/problem+json"),
            Some("application/vnd.api+JSON"),
            Some("text/json"),
            Some("application/json+x"),
            Some("application/jsonx"),
            Some("application/x-json"),
            Some("json"),
            Some("application/json;"),
            Some("application/json; charset"),
            Some("text/plain"),
            Some("text/html; charset=utf-8"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            Some(""),
            Some("*/*"),
        ];
        fn plain(m: mime::Mime) -> bool {
            m == mime::TEXT_PLAIN
        }
        let configs: [(JsonBodies, fn() -> web::JsonConfig); 3] = [
            (JsonBodies::default(), web::JsonConfig::default),
            (
                JsonBodies {
                    required: false,
                    content_type: None,
                },
                || web::JsonConfig::default().content_type_required(false),
            ),
            (
                JsonBodies {
                    required: true,
                    content_type: Some(Box::new(plain)),
                },
                || web::JsonConfig::default().content_type(plain),
            ),
        ];
        for (i, (bodies, config)) in configs.iter().enumerate() {
            for ct in types {
                assert_eq!(
                    reads(bodies, ct),
                    web_json_reads(ct, config()).await,
                    "config {i}, {ct:?}"
                );
            }
        }
        assert!(reads(&JsonBodies::default(), Some("text/json")));
        assert!(!reads(&JsonBodies::default(), Some("text/plain")));
    }

    #[test]
    fn charsets_and_codings() {
        let h = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            h
        };
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
