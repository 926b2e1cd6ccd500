//! The actix-web door (feature `actix`): a [`Filter`] is an actix-service
//! `Transform` that wraps the whole app, a `Scope` or a `Resource`, so
//! rules apply before routing (and guard paths with no handler); a handler
//! reads the decision as the [`Usage`] extractor.
//!
//! A request goes through the shared stages (`filter/request.rs`) with
//! actix's types: its head read through [`Head`], its body read as
//! `web::Form` and `web::Json` read it (`body.rs`), and the answer written
//! as an actix response (`request.rs`, `response.rs`). Filters nest: an
//! inner one (limits wrapped on a resource) notes in the request's
//! extensions what it took and showed, so that the outer one gives its
//! units back on an inner denial and merges the fields.

mod body;
mod request;
mod response;

use std::future::{ready, Future, Ready};
use std::net::IpAddr;
use std::pin::Pin;
use std::rc::Rc;

use actix_service::{Service, Transform};
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode as ActixStatus;
use actix_web::{Error, FromRequest, HttpMessage, HttpRequest, HttpResponse};

use super::deny::{accepts_in, Answer};
use super::fields::{join, FieldMap};
use super::head::Head;
use super::usage::Withdrawn;
use super::{values, Filter, Usage};
use crate::head::RequestHead;
use crate::net::HeaderLines;
use crate::rule::Rule;

impl<S, B> Transform<S, ServiceRequest> for Filter
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Transform = FilterService<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(FilterService {
            service: Rc::new(service),
            filter: self.clone(),
        }))
    }
}

/// The per-worker service the [`Filter`] transform builds.
#[doc(hidden)]
pub struct FilterService<S> {
    service: Rc<S>,
    filter: Filter,
}

type LocalBoxFuture<T> = Pin<Box<dyn Future<Output = T>>>;

impl<S, B> Service<ServiceRequest> for FilterService<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Future = LocalBoxFuture<Result<Self::Response, Self::Error>>;

    actix_service::forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        let service = Rc::clone(&self.service);
        let filter = self.filter.clone();
        Box::pin(async move { request::filter_request(filter, service, req).await })
    }
}

impl Filter {
    /// The client address of a request, behind trusted proxies.
    pub fn client_addr(&self, req: &HttpRequest) -> IpAddr {
        self.client_of(req)
    }

    /// The Redis key a rule uses for a request, from what this call is
    /// given: the request's head, and `form`, the urlencoded body as
    /// `web::Form` reads it (decoded from its charset), when one was read.
    /// A JSON body and a `Key::lookup` function's answer are not read here:
    /// a rule keyed by them gives the key of a request without them (its
    /// client address). A value the rule must read but cannot read exactly
    /// as a handler would is an error: the request is refused, never keyed
    /// by something else.
    pub fn key_for(
        &self,
        rule: &Rule,
        req: &HttpRequest,
        path: &str,
        form: Option<&[u8]>,
    ) -> Result<String, values::Unreadable> {
        let body = values::BodyRead { form, json: None };
        self.key_of(rule, req, path, &body, &[]).map(|k| k.key)
    }
}

/// Whether the `Accept` field names a media type.
pub fn accepts(req: &HttpRequest, media: &str) -> bool {
    accepts_in(req.headers(), media)
}

impl Answer {
    /// The answer as an actix-web response.
    fn to_actix(&self) -> HttpResponse {
        let status =
            ActixStatus::from_u16(self.status.as_u16()).unwrap_or(ActixStatus::TOO_MANY_REQUESTS);
        let mut builder = HttpResponse::build(status);
        for (name, value) in &self.headers {
            builder.insert_header((name.as_str(), value.as_bytes()));
        }
        builder.body(self.body.clone())
    }
}

impl FromRequest for Usage {
    type Error = actix_web::Error;
    type Future = Ready<Result<Usage, actix_web::Error>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(Ok(req
            .extensions()
            .get::<Usage>()
            .cloned()
            .unwrap_or_default()))
    }
}

impl Usage {
    /// The request's `Usage`: a filter around this one's, else a new one
    /// the request keeps.
    fn of(req: &HttpRequest) -> Usage {
        let mut ext = req.extensions_mut();
        match ext.get::<Usage>() {
            Some(usage) => usage.clone(),
            None => {
                let usage = Usage::default();
                ext.insert(usage.clone());
                usage
            }
        }
    }

    /// Called by a filter that denies: outer filters give back their units.
    pub(super) fn deny_outer(req: &HttpRequest) {
        if req.extensions().get::<Usage>().is_some() {
            req.extensions_mut().insert(Withdrawn);
        }
    }
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

impl HeaderLines for actix_web::http::header::HeaderMap {
    fn lines<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a [u8]> {
        self.get_all(name).map(|v| v.as_bytes())
    }
}

impl FieldMap for actix_web::http::header::HeaderMap {
    fn text(&self, name: &'static str) -> Option<&str> {
        self.get(name).and_then(|v| v.to_str().ok())
    }
    fn joined(&self, name: &'static str) -> Option<String> {
        join(self.get_all(name).filter_map(|v| v.to_str().ok()))
    }
    fn has(&self, name: &'static str) -> bool {
        self.contains_key(name)
    }
    fn set(&mut self, name: &'static str, value: String) {
        use actix_web::http::header::{HeaderName, HeaderValue};
        if let Ok(v) = HeaderValue::try_from(value) {
            self.insert(HeaderName::from_static(name), v);
        }
    }
    fn unset(&mut self, name: &'static str) {
        self.remove(name);
    }
}
