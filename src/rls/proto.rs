//! The messages of Envoy's rate-limit protocol (`envoy.service.ratelimit.v3`
//! and the descriptor of `envoy.extensions.common.ratelimit.v3`), written
//! out with prost's derive for just the fields floodgate reads and writes
//! (others are skipped on decode, as protobuf allows), and the gRPC glue:
//! [`RateLimitServer`] routes `ShouldRateLimit` to a handler, and
//! [`RateLimitClient`] calls it (the tests and the benchmark use it).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// The gRPC path of `ShouldRateLimit`.
pub const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The service's full name.
pub const SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// `RateLimitRequest`: a domain, its descriptors, and the hits of each.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitRequest {
    /// The domain whose descriptor tree applies.
    #[prost(string, tag = "1")]
    pub domain: String,
    /// The descriptors, each answered by one status in order.
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RateLimitDescriptor>,
    /// Hits this call takes from every limit it matches (0 means 1).
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `RateLimitDescriptor`: entries, and optionally its own limit and hits.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitDescriptor {
    /// Key/value pairs, walked in order down the domain's tree.
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
    /// A limit that replaces the configured one for this descriptor.
    #[prost(message, optional, tag = "2")]
    pub limit: Option<RateLimitOverride>,
    /// Hits for this descriptor alone (`google.protobuf.UInt64Value`).
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
}

/// One entry of a descriptor.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct Entry {
    /// The descriptor key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// Its value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// A descriptor's own limit.
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct RateLimitOverride {
    /// Requests per unit.
    #[prost(uint32, tag = "1")]
    pub requests_per_unit: u32,
    /// The unit (`envoy.type.v3.RateLimitUnit`, same numbers as [`Unit`]).
    #[prost(enumeration = "Unit", tag = "2")]
    pub unit: i32,
}

/// `google.protobuf.UInt64Value`.
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct UInt64Value {
    /// The value.
    #[prost(uint64, tag = "1")]
    pub value: u64,
}

/// `google.protobuf.Duration`.
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct Duration {
    /// Whole seconds.
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    /// Nanoseconds besides.
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

impl From<std::time::Duration> for Duration {
    fn from(d: std::time::Duration) -> Duration {
        Duration {
            seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
        }
    }
}

/// `RateLimitResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitResponse {
    /// `OVER_LIMIT` when any descriptor is over, else `OK`.
    #[prost(enumeration = "Code", tag = "1")]
    pub overall_code: i32,
    /// One per request descriptor, in order.
    #[prost(message, repeated, tag = "2")]
    pub statuses: Vec<DescriptorStatus>,
    /// Headers the proxy adds to its response to the client.
    #[prost(message, repeated, tag = "3")]
    pub response_headers_to_add: Vec<HeaderValue>,
    /// Headers the proxy adds to the request it forwards.
    #[prost(message, repeated, tag = "4")]
    pub request_headers_to_add: Vec<HeaderValue>,
}

/// `RateLimitResponse.Code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Code {
    /// Not set.
    Unknown = 0,
    /// Within the limits.
    Ok = 1,
    /// Over a limit.
    OverLimit = 2,
}

impl Code {
    /// The name Envoy gives it (`OK`, `OVER_LIMIT`).
    pub fn name(self) -> &'static str {
        match self {
            Code::Unknown => "UNKNOWN",
            Code::Ok => "OK",
            Code::OverLimit => "OVER_LIMIT",
        }
    }
}

/// `RateLimitResponse.RateLimit.Unit` (and `envoy.type.v3.RateLimitUnit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Unit {
    /// No unit (a `window` no unit divides).
    Unknown = 0,
    /// One second.
    Second = 1,
    /// One minute.
    Minute = 2,
    /// One hour.
    Hour = 3,
    /// One day.
    Day = 4,
    /// 30 days.
    Month = 5,
    /// 365 days.
    Year = 6,
    /// Seven days.
    Week = 7,
}

impl Unit {
    /// The name Envoy gives it (`MINUTE`).
    pub fn name(self) -> &'static str {
        match self {
            Unit::Unknown => "UNKNOWN",
            Unit::Second => "SECOND",
            Unit::Minute => "MINUTE",
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
            Unit::Month => "MONTH",
            Unit::Year => "YEAR",
            Unit::Week => "WEEK",
        }
    }
}

/// `RateLimitResponse.RateLimit`: the limit a descriptor was decided under.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct RateLimit {
    /// The limit's name (the rule name).
    #[prost(string, tag = "3")]
    pub name: String,
    /// Requests per unit.
    #[prost(uint32, tag = "1")]
    pub requests_per_unit: u32,
    /// The unit.
    #[prost(enumeration = "Unit", tag = "2")]
    pub unit: i32,
}

/// `RateLimitResponse.DescriptorStatus`.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct DescriptorStatus {
    /// This descriptor's code.
    #[prost(enumeration = "Code", tag = "1")]
    pub code: i32,
    /// The limit it matched, if any.
    #[prost(message, optional, tag = "2")]
    pub current_limit: Option<RateLimit>,
    /// What is left after this call.
    #[prost(uint32, tag = "3")]
    pub limit_remaining: u32,
    /// Until the limit resets.
    #[prost(message, optional, tag = "4")]
    pub duration_until_reset: Option<Duration>,
}

impl std::hash::Hash for Duration {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.seconds.hash(state);
        self.nanos.hash(state);
    }
}

/// `envoy.config.core.v3.HeaderValue`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    /// Header name.
    #[prost(string, tag = "1")]
    pub key: String,
    /// Header value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// What answers `ShouldRateLimit`.
pub trait Handler: Send + Sync + 'static {
    /// Answers one call.
    fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> impl Future<Output = Result<tonic::Response<RateLimitResponse>, tonic::Status>> + Send;
}

/// The largest `ShouldRateLimit` request read (Envoy's are well under a
/// KiB; tonic's own default, 4 MiB, would let a few thousand unfinished
/// calls hold gigabytes).
pub const MAX_REQUEST_BYTES: usize = 256 * 1024;

/// The gRPC service: `ShouldRateLimit` to the handler, any other method
/// `UNIMPLEMENTED`. At most as many calls as `in_flight` has permits are
/// read and decided at once, over every connection and thread sharing it;
/// a call beyond them is answered `RESOURCE_EXHAUSTED` at once, before its
/// body is read, so what unfinished calls hold stays bounded.
#[derive(Debug)]
pub struct RateLimitServer<H> {
    inner: Arc<H>,
    in_flight: Arc<tokio::sync::Semaphore>,
}

impl<H> Clone for RateLimitServer<H> {
    fn clone(&self) -> Self {
        RateLimitServer {
            inner: Arc::clone(&self.inner),
            in_flight: Arc::clone(&self.in_flight),
        }
    }
}

impl<H: Handler> RateLimitServer<H> {
    /// Serves `handler`, at most `in_flight`'s permits of calls at once.
    pub fn new(handler: Arc<H>, in_flight: Arc<tokio::sync::Semaphore>) -> RateLimitServer<H> {
        RateLimitServer {
            inner: handler,
            in_flight,
        }
    }
}

impl<H> tonic::server::NamedService for RateLimitServer<H> {
    const NAME: &'static str = SERVICE;
}

/// One call handed to the handler.
struct Unary<H>(Arc<H>);

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'static>>;

impl<H: Handler> tonic::server::UnaryService<RateLimitRequest> for Unary<H> {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { inner.should_rate_limit(request).await })
    }
}

/// The server's codec: prost's, except that a request that does not
/// decode is the caller's fault, `INVALID_ARGUMENT` (prost's says
/// `INTERNAL`, a fault of the server's).
struct ServerCodec;

impl tonic::codec::Codec for ServerCodec {
    type Encode = RateLimitResponse;
    type Decode = RateLimitRequest;
    type Encoder = tonic_prost::ProstEncoder<RateLimitResponse>;
    type Decoder = RequestDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder(tonic_prost::ProstDecoder::default())
    }
}

/// prost's decoder of requests, its refusals made `INVALID_ARGUMENT`.
struct RequestDecoder(tonic_prost::ProstDecoder<RateLimitRequest>);

impl tonic::codec::Decoder for RequestDecoder {
    type Item = RateLimitRequest;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<RateLimitRequest>, tonic::Status> {
        self.0.decode(src).map_err(|e| {
            tonic::Status::invalid_argument(format!("the request does not decode: {}", e.message()))
        })
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        self.0.buffer_settings()
    }
}

impl<H, B> tonic::codegen::Service<tonic::codegen::http::Request<B>> for RateLimitServer<H>
where
    H: Handler,
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        if req.uri().path() == SHOULD_RATE_LIMIT {
            let Ok(permit) = Arc::clone(&self.in_flight).try_acquire_owned() else {
                crate::repeated!(
                    &crate::log_kinds::RLS_BUSY,
                    "rls: as many calls in flight as are read at once: a call was answered RESOURCE_EXHAUSTED"
                );
                let busy = tonic::Status::resource_exhausted("too many calls in flight");
                return Box::pin(async move { Ok(busy.into_http()) });
            };
            let inner = Arc::clone(&self.inner);
            Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(ServerCodec)
                    .max_decoding_message_size(MAX_REQUEST_BYTES);
                let answer = grpc.unary(Unary(inner), req).await;
                drop(permit);
                Ok(answer)
            })
        } else {
            Box::pin(async move { Ok(tonic::Status::unimplemented("no such method").into_http()) })
        }
    }
}

/// A client of `ShouldRateLimit`, over any tonic channel.
#[derive(Debug, Clone)]
pub struct RateLimitClient {
    inner: tonic::client::Grpc<tonic::transport::Channel>,
}

impl RateLimitClient {
    /// Connects to `endpoint` (`http://127.0.0.1:8081`).
    pub async fn connect(endpoint: String) -> Result<RateLimitClient, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::new(endpoint)?.connect().await?;
        Ok(RateLimitClient::new(channel))
    }

    /// A client over `channel`.
    pub fn new(channel: tonic::transport::Channel) -> RateLimitClient {
        RateLimitClient {
            inner: tonic::client::Grpc::new(channel),
        }
    }

    /// Calls `ShouldRateLimit`.
    pub async fn should_rate_limit(
        &mut self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("not ready: {e}")))?;
        let codec = tonic_prost::ProstCodec::<RateLimitRequest, RateLimitResponse>::default();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(SHOULD_RATE_LIMIT);
        self.inner
            .unary(tonic::Request::new(request), path, codec)
            .await
            .map(tonic::Response::into_inner)
    }
}
