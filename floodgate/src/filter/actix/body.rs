//! The bodies a request's keys read (stage 2 of a request): the
//! urlencoded form, decoded from its charset exactly as `web::Form` reads
//! it, or the JSON body; read once, then handed on to the handler intact.

use std::borrow::Cow;

use actix_web::dev::{Payload, ServiceRequest};
use actix_web::http::header;
use actix_web::web::{Bytes, BytesMut};
use actix_web::HttpMessage;
use futures_util::StreamExt;

use crate::filter::deny::{Input, Refused};
use crate::filter::{json, values, Filter};
use crate::rule::Rule;

/// The bodies a request's keys read: the form as the handler will read it
/// (decoded from its charset), or the JSON body.
#[derive(Default)]
pub(super) struct Bodies {
    form: Option<Bytes>,
    json: Option<Bytes>,
}

impl Bodies {
    pub(super) fn read(&self) -> values::BodyRead<'_> {
        values::BodyRead {
            form: self.form.as_deref(),
            json: self.json.as_deref(),
        }
    }
}

/// Stage 2: a rule keyed by a body field reads the urlencoded or JSON body
/// (only the types its keys read, and only bodies the handler's `web::Form`
/// or `web::Json` reads: see [`is_urlencoded`] and `JsonBodies`), then
/// hands it on intact. Refused: a body over `max_form` (413) or broken
/// (400), a JSON body whose headers the filter cannot read as the handler
/// would, a form in a charset or coding it cannot decode (415).
pub(super) async fn read_bodies(
    filter: &Filter,
    req: &mut ServiceRequest,
    matched: &[&Rule],
) -> Result<Bodies, Refused<'static>> {
    let form_wanted = matched.iter().any(|r| r.key.reads_form()) && is_urlencoded(req);
    let json_wanted = !form_wanted
        && matched.iter().any(|r| r.key.reads_json())
        && filter.state.json.reads(req.headers());
    if json_wanted {
        json::check_json_headers(req.headers()).map_err(|e| Refused::Unreadable(e, None))?;
    }
    if !form_wanted && !json_wanted {
        return Ok(Bodies::default());
    }
    let body = match read_body(req, filter.state.max_form).await {
        Ok(body) => body,
        Err(BodyError::TooLarge) => {
            return Err(Refused::Input(Input::BodyTooLarge(filter.state.max_form)))
        }
        Err(BodyError::Broken) => return Err(Refused::Input(Input::BrokenBody)),
    };
    req.set_payload(Payload::from(body.clone()));
    // A body read only because the app takes any body as JSON names no one
    // when it is empty (a GET on the same path, say), rather than being
    // refused as no JSON.
    if json_wanted && body.is_empty() && !filter.state.json.declared(req.headers()) {
        return Ok(Bodies::default());
    }
    if json_wanted {
        return Ok(Bodies {
            form: None,
            json: Some(body),
        });
    }
    let decoded = match form_text(req, &body).map_err(|e| Refused::Unreadable(e, None))? {
        Cow::Borrowed(_) => None,
        Cow::Owned(text) => Some(text),
    };
    Ok(Bodies {
        form: Some(decoded.map_or(body, Bytes::from)),
        json: None,
    })
}

/// Why a body could not be read for a `form:` key.
enum BodyError {
    TooLarge,
    Broken,
}

/// The text of an urlencoded body as `web::Form` reads it: the charset of
/// `Content-Type` (actix's own `encoding()`, through `encoding_rs` labels),
/// decoded without replacement; UTF-8 as it is. A body with a content
/// coding, an unknown charset, or bytes its charset cannot decode is
/// refused (415) rather than read in some other way than the handler's.
pub(crate) fn form_text<'a>(
    req: &impl HttpMessage,
    body: &'a [u8],
) -> Result<Cow<'a, [u8]>, values::Unreadable> {
    let unsupported = values::Unreadable::Unsupported;
    if values::content_coded(req.headers()) {
        return Err(unsupported("a form with a content coding cannot be read"));
    }
    let encoding = req
        .encoding()
        .map_err(|_| unsupported("unknown form charset"))?;
    // actix hands UTF-8 bodies to serde as bytes, anything else decoded.
    if encoding.name() == "UTF-8" {
        return Ok(Cow::Borrowed(body));
    }
    match encoding.decode_without_bom_handling_and_without_replacement(body) {
        Some(text) => Ok(Cow::Owned(text.into_owned().into_bytes())),
        None => Err(unsupported("the form is not in its charset")),
    }
}

/// Whether the handler's `web::Form` reads the body: actix-web's own rule
/// (`UrlEncoded::new`), a `Content-Type` whose media type (before any `;`)
/// is `application/x-www-form-urlencoded` in any case; nothing else.
fn is_urlencoded(req: &impl HttpMessage) -> bool {
    req.content_type().to_lowercase() == "application/x-www-form-urlencoded"
}

async fn read_body(req: &mut ServiceRequest, max: usize) -> Result<Bytes, BodyError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(BodyError::TooLarge);
    }
    let mut payload = req.take_payload();
    let mut body = BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|_| BodyError::Broken)?;
        if body.len() + chunk.len() > max {
            return Err(BodyError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;
    use actix_web::{web, FromRequest};
    use std::collections::HashMap;

    #[actix_web::test]
    async fn the_forms_read_are_those_web_form_reads() {
        for ct in [
            None,
            Some("application/x-www-form-urlencoded"),
            Some("Application/X-WWW-Form-Urlencoded; charset=utf-8"),
            Some(" application/x-www-form-urlencoded ;x=y"),
            Some("application/x-www-form-urlencoded; charset=latin1"),
            Some("application/x-www-form-urlencoded; charset=nope"),
            Some("application/x-www-form-urlencoded+json"),
            Some("application/x-www-form-urlencodedx"),
            Some("text/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            Some("application/json"),
            Some("text/plain"),
            Some(""),
        ] {
            let mut req = TestRequest::post().set_payload("a=1");
            if let Some(ct) = ct {
                req = req.insert_header((header::CONTENT_TYPE, ct));
            }
            let (req, mut payload) = req.to_http_parts();
            let form = web::Form::<HashMap<String, String>>::from_request(&req, &mut payload).await;
            // What the filter reads as a form (a form it takes for one but
            // cannot decode as the handler would is refused, 415).
            let read = is_urlencoded(&req) && form_text(&req, b"a=1").is_ok();
            assert_eq!(read, form.is_ok(), "{ct:?}");
        }
    }
}
