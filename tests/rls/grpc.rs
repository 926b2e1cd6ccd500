//! The service through its own gRPC client: envoyproxy/ratelimit's
//! integration sequences, all-or-nothing, bad calls, replaces, unlimited,
//! `requests_per_unit: 0`, a descriptor's own limit, shadow, hits, the
//! RateLimit fields, health, metrics, reloads, Redis going away, SIGTERM.

use std::time::{Duration, Instant};

use floodgate_site::rls::proto::{RateLimitOverride, UInt64Value, Unit};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::{call, codes, unique, wait_until, RedisServer, Service, PATIENCE};

/// envoyproxy/ratelimit's integration-test descriptor files.
pub const BASIC: &str = "domain: basic\ndescriptors:\n  - key: key1\n    rate_limit:\n      unit: second\n      requests_per_unit: 50\n";
/// As above: 20 per minute, 10 per hour, 20 per day.
pub const ANOTHER: &str = "domain: another\ndescriptors:\n  - key: key2\n    rate_limit:\n      unit: minute\n      requests_per_unit: 20\n  - key: key3\n    rate_limit:\n      unit: hour\n      requests_per_unit: 10\n  - key: key4\n    rate_limit:\n      unit: day\n      requests_per_unit: 20\n";

#[tokio::test]
async fn one_descriptor_up_to_twenty_a_minute_and_past_it() {
    let redis = RedisServer::start();
    let svc = Service::start(
        &redis,
        &[("basic.yaml", BASIC), ("another.yaml", ANOTHER)],
        "",
        "",
    );
    let mut c = svc.client().await;

    // An unknown domain: OK, no limit.
    let r = c
        .should_rate_limit(call("foo", &[&[("hello", "world")]], 1))
        .await
        .unwrap();
    assert_eq!(r.overall_code, 1);
    assert_eq!(codes(&r), [("OK", 0)]);
    assert!(r.statuses[0].current_limit.is_none());

    let r = c
        .should_rate_limit(call("basic", &[&[("key1", "foo")]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 49)]);
    let limit = r.statuses[0].current_limit.clone().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (50, Unit::Second as i32)
    );
    assert_eq!(limit.name, "basic.key1");

    let v = unique();
    for i in 0..25u32 {
        let r = c
            .should_rate_limit(call("another", &[&[("key2", &v)]], 1))
            .await
            .unwrap();
        let (code, left) = if i < 20 {
            ("OK", 19 - i)
        } else {
            ("OVER_LIMIT", 0)
        };
        assert_eq!(codes(&r), [(code, left)], "call {i}");
        assert_eq!(r.overall_code, if i < 20 { 1 } else { 2 });
        let s = &r.statuses[0];
        let limit = s.current_limit.clone().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (20, Unit::Minute as i32)
        );
        let reset = s.duration_until_reset.unwrap();
        assert!(
            reset.seconds <= 60 && (reset.seconds > 0 || reset.nanos > 0),
            "{reset:?}"
        );
    }
    // The over-limit calls took nothing: the log holds 20 units.
    assert_eq!(redis.units(&format!("floodgate:another.key2:rls:{v}")), 20);
}

#[tokio::test]
async fn two_descriptors_and_the_first_frozen_once_the_second_is_over() {
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("another.yaml", ANOTHER)], "", "");
    let mut c = svc.client().await;
    let v = unique();
    for i in 0..15u32 {
        let r = c
            .should_rate_limit(call("another", &[&[("key2", &v)], &[("key3", &v)]], 1))
            .await
            .unwrap();
        if i < 10 {
            assert_eq!(codes(&r), [("OK", 19 - i), ("OK", 9 - i)], "call {i}");
            assert_eq!(r.overall_code, 1);
        } else {
            // Nothing charged: the first stays at 10 left.
            assert_eq!(codes(&r), [("OK", 10), ("OVER_LIMIT", 0)], "call {i}");
            assert_eq!(r.overall_code, 2);
        }
        let second = r.statuses[1].current_limit.clone().unwrap();
        assert_eq!(
            (second.requests_per_unit, second.unit),
            (10, Unit::Hour as i32)
        );
    }
}

/// Where units come back one by one (token bucket, GCRA), a limit that
/// admits a call another limit refuses says what it holds now: its reset
/// is the one the last admission answered, not one more unit's later.
#[tokio::test]
async fn beside_a_refusal_a_bucket_says_when_it_is_full_as_it_stands() {
    const BUCKETS: &str = "domain: b\ndescriptors:\n  - key: one\n    rate_limit:\n      unit: minute\n      requests_per_unit: 1\n  - key: tb\n    rate_limit:\n      unit: minute\n      requests_per_unit: 3\n      algorithm: token_bucket\n  - key: g\n    rate_limit:\n      unit: minute\n      requests_per_unit: 3\n      algorithm: gcra\n";
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("b.yaml", BUCKETS)], "", "");
    let mut c = svc.client().await;
    let v = unique();
    let reset = |r: &floodgate_site::rls::proto::RateLimitResponse, i: usize| {
        let d = r.statuses[i].duration_until_reset.unwrap();
        d.seconds as f64 + f64::from(d.nanos) / 1e9
    };
    // Two of three units taken: full again 40 s from now (20 s a unit).
    let mut last = (0.0, 0.0);
    for _ in 0..2 {
        let r = c
            .should_rate_limit(call("b", &[&[("tb", &v)], &[("g", &v)]], 1))
            .await
            .unwrap();
        assert_eq!(codes(&r)[0].0, "OK");
        last = (reset(&r, 0), reset(&r, 1));
    }
    assert!((39.0..=40.0).contains(&last.0), "{last:?}");
    assert!((39.0..=40.0).contains(&last.1), "{last:?}");
    let r = c
        .should_rate_limit(call("b", &[&[("one", &v)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    // Refused by `one`: nothing charged, and the buckets say what they hold.
    let r = c
        .should_rate_limit(call("b", &[&[("one", &v)], &[("tb", &v)], &[("g", &v)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0), ("OK", 1), ("OK", 1)]);
    assert!(
        reset(&r, 1) <= last.0 && reset(&r, 1) > 35.0,
        "{} {last:?}",
        reset(&r, 1)
    );
    assert!(
        reset(&r, 2) <= last.1 && reset(&r, 2) > 35.0,
        "{} {last:?}",
        reset(&r, 2)
    );
}

#[tokio::test]
async fn bad_calls_are_refused_and_charge_nothing() {
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("another.yaml", ANOTHER)], "", "");
    let mut c = svc.client().await;
    let v = unique();
    let mut bad = vec![
        call("", &[&[("key2", &v)]], 1),
        call("another", &[], 1),
        call("another", &[&[("key2", &v), ("", "x")]], 1),
        call("another", &[&[("key2", &v)]], 1_000_000_001),
    ];
    let mut big = call("another", &[&[("key2", &v)]], 1);
    big.descriptors[0].hits_addend = Some(UInt64Value { value: u64::MAX });
    bad.push(big);
    // More descriptors than a call may bring, or entries than one may have.
    let one: &[(&str, &str)] = &[("key2", &v)];
    bad.push(call("another", &vec![one; 257], 1));
    let wide: Vec<(&str, &str)> = vec![("key2", v.as_str()); 65];
    bad.push(call("another", &[&wide], 1));
    for b in bad {
        let e = c.should_rate_limit(b.clone()).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{b:?}");
        assert!(!e.message().is_empty());
    }
    let r = c
        .should_rate_limit(call("another", &[&[("key2", &v)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 19)]);
    // Counted under the domain when the files have it.
    let m = svc.metrics();
    for (domain, n) in [("another", 6), ("", 1)] {
        let line = format!(
            "floodgate_rls_calls_total{{domain=\"{domain}\",code=\"INVALID_ARGUMENT\"}} {n}\n"
        );
        assert!(m.contains(&line), "{line} in {m}");
    }
    // Garbage on the wire: a gRPC error, and the service still answers.
    let raw = tonic::transport::Endpoint::new(svc.endpoint())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(raw);
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<UInt64Value, UInt64Value>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        floodgate_site::rls::proto::SHOULD_RATE_LIMIT,
    );
    // A UInt64Value's field 1 is a varint where a domain (string) is read.
    let e = grpc
        .unary(tonic::Request::new(UInt64Value { value: 7 }), path, codec)
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().starts_with("the request does not decode: "),
        "{e:?}"
    );
    let r = c
        .should_rate_limit(call("another", &[&[("key2", &v)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 18)]);
}

const TREE: &str = r#"
domain: t
descriptors:
  - key: user
    rate_limit: {name: per-user, unit: minute, requests_per_unit: 5}
  - key: org
    rate_limit: {name: per-org, unit: minute, requests_per_unit: 100, replaces: [{name: per-user}]}
  - key: free
    rate_limit: {unlimited: true}
  - key: never
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: watched
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: "/api/*"
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: "/files/*"
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: rolling
    rate_limit: {window: 90s, algorithm: fixed_window, requests_per_unit: 3}
  - key: tenant
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: region
    value_to_metric: true
    descriptors:
      - key: app
        value: web
        rate_limit: {unit: minute, requests_per_unit: 10}
"#;

#[tokio::test]
async fn replaces_unlimited_zero_shadow_and_wildcards() {
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("t.yaml", TREE)], "", "");
    let mut c = svc.client().await;
    let (u, o) = (unique(), unique());

    // per-org replaces per-user: the user limit is neither checked nor charged.
    let r = c
        .should_rate_limit(call("t", &[&[("user", &u)], &[("org", &o)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 0), ("OK", 99)]);
    assert!(r.statuses[0].current_limit.is_none());
    let r = c
        .should_rate_limit(call("t", &[&[("user", &u)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 4)]);
    // A limit the call brings for the user descriptor has no name that a
    // `replaces` could name: it is checked and charged beside per-org.
    let mut own = call("t", &[&[("user", &u)], &[("org", &o)]], 1);
    own.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: Unit::Minute as i32,
    });
    let r = c.should_rate_limit(own.clone()).await.unwrap();
    assert_eq!(codes(&r), [("OK", 0), ("OK", 98)]);
    let r = c.should_rate_limit(own).await.unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0), ("OK", 98)]);

    // unlimited: OK, no Redis work.
    let r = c
        .should_rate_limit(call("t", &[&[("free", "x")]], 1000))
        .await
        .unwrap();
    assert_eq!(r.overall_code, 1);
    assert!(redis.keys("floodgate:t.free*").is_empty());

    // requests_per_unit 0: over, and the other descriptor is not charged.
    let r = c
        .should_rate_limit(call("t", &[&[("user", &u)], &[("never", "x")]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 4), ("OVER_LIMIT", 0)]);
    assert_eq!(r.overall_code, 2);

    // shadow_mode: OK though over, counted as shadow_denied.
    let w = unique();
    for _ in 0..3 {
        let r = c
            .should_rate_limit(call("t", &[&[("watched", &w)]], 1))
            .await
            .unwrap();
        assert_eq!(r.overall_code, 1);
    }
    assert!(
        svc.metrics()
            .contains("floodgate_decisions_total{rule=\"t.watched\",decision=\"shadow_denied\"} 2"),
        "{}",
        svc.metrics()
    );

    // share_threshold: every /api/ path shares one count.
    for (i, p) in ["/api/a", "/api/b", "/api/c"].iter().enumerate() {
        let r = c
            .should_rate_limit(call("t", &[&[("path", p)]], 1))
            .await
            .unwrap();
        assert_eq!(code_of(&r), if i < 2 { "OK" } else { "OVER_LIMIT" }, "{p}");
    }
    // A wildcard without it counts each value apart.
    for p in ["/files/a", "/files/b", "/files/c"] {
        let r = c
            .should_rate_limit(call("t", &[&[("path", p)]], 1))
            .await
            .unwrap();
        assert_eq!(codes(&r), [("OK", 1)], "{p}");
    }

    // A window no unit... 90 s: the largest unit dividing it is the second.
    let r = c
        .should_rate_limit(call("t", &[&[("rolling", &unique())]], 1))
        .await
        .unwrap();
    let l = r.statuses[0].current_limit.clone().unwrap();
    assert_eq!(
        (l.requests_per_unit, l.unit, r.statuses[0].limit_remaining),
        (3, Unit::Second as i32, 2)
    );

    // detailed_metric: decisions per descriptor value; value_to_metric: the
    // node's value in the path.
    c.should_rate_limit(call("t", &[&[("tenant", "acme")]], 1))
        .await
        .unwrap();
    c.should_rate_limit(call("t", &[&[("region", "eu"), ("app", "web")]], 1))
        .await
        .unwrap();
    let m = svc.metrics();
    assert!(
        m.contains("floodgate_decisions_total{rule=\"t.tenant_acme\",decision=\"allowed\"} 1"),
        "{m}"
    );
    assert!(
        m.contains(
            "floodgate_decisions_total{rule=\"t.region_eu.app_web\",decision=\"allowed\"} 1"
        ),
        "{m}"
    );
}

fn code_of(r: &floodgate_site::rls::proto::RateLimitResponse) -> &'static str {
    crate::code_name(r.overall_code)
}

#[tokio::test]
async fn hits_and_a_descriptors_own_limit() {
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("another.yaml", ANOTHER)], "", "");
    let mut c = svc.client().await;
    let v = unique();
    // The request's hits_addend, then a descriptor's own.
    let r = c
        .should_rate_limit(call("another", &[&[("key2", &v)]], 5))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 15)]);
    let mut one = call("another", &[&[("key2", &v)]], 5);
    one.descriptors[0].hits_addend = Some(UInt64Value { value: 2 });
    let r = c.should_rate_limit(one).await.unwrap();
    assert_eq!(codes(&r), [("OK", 13)]);
    // More hits than are left: over, nothing taken.
    let r = c
        .should_rate_limit(call("another", &[&[("key2", &v)]], 14))
        .await
        .unwrap();
    assert_eq!(r.overall_code, 2);
    let r = c
        .should_rate_limit(call("another", &[&[("key2", &v)]], 13))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);

    // The descriptor's own limit replaces the configured one.
    let w = unique();
    let mut own = call("another", &[&[("key2", &w)]], 1);
    own.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: Unit::Hour as i32,
    });
    let mut seen = Vec::new();
    for _ in 0..3 {
        let r = c.should_rate_limit(own.clone()).await.unwrap();
        let l = r.statuses[0].current_limit.clone().unwrap();
        assert_eq!((l.requests_per_unit, l.unit), (2, Unit::Hour as i32));
        seen.push(codes(&r)[0]);
    }
    assert_eq!(seen, [("OK", 1), ("OK", 0), ("OVER_LIMIT", 0)]);
    // On a counter of its own: the configured limit (20 a minute) counted
    // none of those calls, and the denial remembered for the call's own
    // limit does not answer for it; nor does another own limit share it.
    let r = c
        .should_rate_limit(call("another", &[&[("key2", &w)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 19)]);
    let mut other = own.clone();
    other.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 3,
        unit: Unit::Hour as i32,
    });
    let r = c.should_rate_limit(other).await.unwrap();
    assert_eq!(codes(&r), [("OK", 2)]);
    // Past 10^9 an own limit is 10^9, and the answer says so.
    let mut huge = own.clone();
    huge.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: u32::MAX,
        unit: Unit::Second as i32,
    });
    let r = c.should_rate_limit(huge).await.unwrap();
    let l = r.statuses[0].current_limit.clone().unwrap();
    assert_eq!(l.requests_per_unit, 1_000_000_000);
    assert_eq!(codes(&r), [("OK", 999_999_999)]);
    // Even for a descriptor of the domain that matches no configured limit.
    let mut loose = call("another", &[&[("k", &w)]], 1);
    loose.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: Unit::Minute as i32,
    });
    let r = c.should_rate_limit(loose.clone()).await.unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    let r = c.should_rate_limit(loose).await.unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0)]);
    // Counted per value, but in metrics under the descriptor's keys alone.
    let m = svc.metrics();
    for line in [
        "floodgate_decisions_total{rule=\"another.k\",decision=\"allowed\"} 1\n",
        "floodgate_decisions_total{rule=\"another.k\",decision=\"denied\"} 1\n",
    ] {
        assert!(m.contains(line), "{line} in {m}");
    }
    assert!(!m.contains(&format!("another.k_{w}")), "{m}");
    // An unknown domain has no limit, not even a descriptor's own.
    let mut nowhere = call("nowhere", &[&[("k", &w)]], 1);
    nowhere.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 0,
        unit: Unit::Second as i32,
    });
    let r = c.should_rate_limit(nowhere).await.unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    assert!(r.statuses[0].current_limit.is_none(), "{r:?}");
}

/// The counter of a limit a call brings is of a kind of its own: a
/// configured limit whose name reads like one (`NAME~LIMIT/UNIT`) never
/// shares it, whatever the values.
#[tokio::test]
async fn a_calls_own_limit_never_counts_on_a_configured_one() {
    let redis = RedisServer::start();
    let file = "domain: o\ndescriptors:\n  - key: k\n    rate_limit: {name: \"o.j~1/minute\", unit: minute, requests_per_unit: 1}\n";
    let svc = Service::start(&redis, &[("o.yaml", file)], "", "");
    let mut c = svc.client().await;
    let v = unique();
    // Descriptor `j` matches no node; its own limit of 1 a minute counts
    // as `o.j~1/minute`, per value.
    let mut own = call("o", &[&[("j", &v)]], 1);
    own.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: Unit::Minute as i32,
    });
    let r = c.should_rate_limit(own.clone()).await.unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    // The configured limit of that very name, on the same value, is its own.
    let r = c
        .should_rate_limit(call("o", &[&[("k", &v)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    assert_eq!(redis.units(&format!("floodgate:o.j~1/minute:rls:{v}")), 1);
    assert_eq!(redis.units(&format!("floodgate:o.j~1/minute:own:{v}")), 1);
    let r = c.should_rate_limit(own).await.unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0)]);
}

/// Two descriptors of one call that count on the same key (the same
/// limit, the same values) are decided as one check of their summed hits:
/// apart, each would see the count before the call, and together they
/// would take more than the limit holds.
#[tokio::test]
async fn descriptors_on_one_key_never_take_more_than_the_limit() {
    let redis = RedisServer::start();
    let three = "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 3}\n";
    let svc = Service::start(&redis, &[("a.yaml", three)], "", "");
    let mut c = svc.client().await;
    let v = unique();
    let twice = |hits| call("a", &[&[("k", &v)], &[("k", &v)]], hits);
    // 2 + 2 hits on a limit of 3: over, and nothing taken.
    let r = c.should_rate_limit(twice(2)).await.unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0), ("OVER_LIMIT", 0)]);
    assert_eq!(redis.units(&format!("floodgate:a.k:rls:{v}")), 0);
    // 1 + 1: both OK, 1 left, and the log holds 2.
    let r = c.should_rate_limit(twice(1)).await.unwrap();
    assert_eq!(codes(&r), [("OK", 1), ("OK", 1)]);
    assert_eq!(redis.units(&format!("floodgate:a.k:rls:{v}")), 2);
    // 1 + 1 more do not fit in the 1 left.
    let r = c.should_rate_limit(twice(1)).await.unwrap();
    assert_eq!(r.overall_code, 2);
    let r = c
        .should_rate_limit(call("a", &[&[("k", &v)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    assert_eq!(redis.units(&format!("floodgate:a.k:rls:{v}")), 3);
    // Four descriptors of one hit each on a fresh value: over.
    let w = unique();
    let four = call(
        "a",
        &[&[("k", &w)], &[("k", &w)], &[("k", &w)], &[("k", &w)]],
        1,
    );
    let r = c.should_rate_limit(four).await.unwrap();
    assert_eq!(r.overall_code, 2);
    assert_eq!(redis.units(&format!("floodgate:a.k:rls:{w}")), 0);
}

/// `[rls] shadow = true`: every answer OK, a descriptor's own limit too.
#[tokio::test]
async fn shadow_covers_a_descriptors_own_limit() {
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("another.yaml", ANOTHER)], "shadow = true", "");
    let mut c = svc.client().await;
    let v = unique();
    let mut own = call("another", &[&[("key2", &v)]], 1);
    own.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: Unit::Minute as i32,
    });
    for _ in 0..3 {
        let r = c.should_rate_limit(own.clone()).await.unwrap();
        assert_eq!(r.overall_code, 1, "{r:?}");
    }
    own.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 0,
        unit: Unit::Second as i32,
    });
    let r = c.should_rate_limit(own).await.unwrap();
    assert_eq!(r.overall_code, 1, "{r:?}");
}

#[tokio::test]
async fn response_headers_in_the_chosen_dialect() {
    let redis = RedisServer::start();
    let svc = Service::start(
        &redis,
        &[("another.yaml", ANOTHER)],
        "headers = \"draft-7\"",
        "",
    );
    let mut c = svc.client().await;
    let v = unique();
    let r = c
        .should_rate_limit(call("another", &[&[("key2", &v)], &[("key3", &v)]], 1))
        .await
        .unwrap();
    let h: Vec<(String, String)> = r
        .response_headers_to_add
        .iter()
        .map(|h| (h.key.clone(), h.value.clone()))
        .collect();
    // The most restrictive: key3, 10 per hour, 9 left.
    assert_eq!(h[0].0, "ratelimit");
    assert!(h[0].1.starts_with("limit=10, remaining=9, reset="), "{h:?}");
    assert_eq!(h[1], ("ratelimit-policy".into(), "10;w=3600".into()));
    let r = c
        .should_rate_limit(call("another", &[&[("key3", &v)]], 20))
        .await
        .unwrap();
    assert!(
        r.response_headers_to_add
            .iter()
            .any(|h| h.key == "retry-after"),
        "{r:?}"
    );

    // The policy's window is the limit's own (90 s, no unit's length),
    // and a shadow limit never shows.
    let odd = "domain: odd\ndescriptors:\n  - key: win\n    rate_limit: {requests_per_unit: 4, window: 90s}\n  - key: sh\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";
    let svc = Service::start(&redis, &[("odd.yaml", odd)], "headers = \"ietf\"", "");
    let mut c = svc.client().await;
    let r = c
        .should_rate_limit(call("odd", &[&[("win", &v)], &[("sh", &v)]], 1))
        .await
        .unwrap();
    let policy: Vec<&str> = r
        .response_headers_to_add
        .iter()
        .filter(|h| h.key == "ratelimit-policy")
        .map(|h| h.value.as_str())
        .collect();
    assert_eq!(policy, ["\"odd.win\";q=4;w=90"], "{r:?}");
    assert!(
        !r.response_headers_to_add
            .iter()
            .any(|h| h.value.contains("odd.sh")),
        "{r:?}"
    );
}

async fn health(svc: &Service) -> i32 {
    let Ok(channel) = tonic::transport::Endpoint::new(svc.endpoint())
        .unwrap()
        .connect()
        .await
    else {
        return -1;
    };
    let mut h = HealthClient::new(channel);
    h.check(HealthCheckRequest {
        service: String::new(),
    })
    .await
    .map(|r| r.into_inner().status)
    .unwrap_or(-1)
}

async fn wait_health(svc: &Service, want: ServingStatus) {
    let deadline = Instant::now() + PATIENCE;
    while health(svc).await != want as i32 {
        assert!(Instant::now() < deadline, "health never became {want:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn health_metrics_and_redis_going_away() {
    let mut redis = RedisServer::start();
    let svc = Service::start(&redis, &[("another.yaml", ANOTHER)], "", "");
    let mut c = svc.client().await;
    wait_health(&svc, ServingStatus::Serving).await;
    assert_eq!(svc.get("/healthz").0, 200);
    assert_eq!(svc.get("/readyz").0, 200);
    // Load balancers probe with HEAD too.
    for path in ["/healthz", "/readyz"] {
        let head = format!("HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(crate::http_request(svc.http, &head).0, 200, "{path}");
    }
    let v = unique();
    c.should_rate_limit(call("another", &[&[("key2", &v)]], 1))
        .await
        .unwrap();
    c.should_rate_limit(call("unknown-domain", &[&[("key2", &v)]], 1))
        .await
        .unwrap();
    let m = svc.metrics();
    assert!(
        m.contains("floodgate_rls_calls_total{domain=\"another\",code=\"OK\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("floodgate_rls_calls_total{domain=\"\",code=\"OK\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("floodgate_decisions_total{rule=\"another.key2\",decision=\"allowed\"} 1"),
        "{m}"
    );

    // Redis gone: the default answers UNAVAILABLE, health says so.
    redis.stop();
    let e = c
        .should_rate_limit(call("another", &[&[("key2", &v)]], 1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    wait_health(&svc, ServingStatus::NotServing).await;
    assert_eq!(svc.get("/readyz").0, 503);
    // A call that names no limit needs no Redis.
    let r = c
        .should_rate_limit(call("another", &[&[("nope", "x")]], 1))
        .await
        .unwrap();
    assert_eq!(r.overall_code, 1);
    // Back: decided by Redis again, with no restart.
    redis.restart();
    wait_health(&svc, ServingStatus::Serving).await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        match c
            .should_rate_limit(call("another", &[&[("key2", &v)]], 1))
            .await
        {
            Ok(r) => {
                // A fresh Redis: the earlier unit is gone.
                assert_eq!(codes(&r), [("OK", 19)]);
                break;
            }
            Err(_) => assert!(Instant::now() < deadline),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Redis gone, the default `error`: a call that an enforcing limit matches
/// gets UNAVAILABLE; one whose limits only watch is answered OK (a shadow
/// limit never denies), counted as such.
#[tokio::test]
async fn without_redis_a_watching_limit_never_refuses() {
    let file = "domain: w\ndescriptors:\n  - key: enforced\n    rate_limit: {unit: minute, requests_per_unit: 5}\n  - key: watched\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let mut redis = RedisServer::start();
    let svc = Service::start(&redis, &[("w.yaml", file)], "", "");
    let mut c = svc.client().await;
    redis.stop();
    let e = c
        .should_rate_limit(call("w", &[&[("enforced", "a")]], 1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let r = c
        .should_rate_limit(call("w", &[&[("watched", "a")]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    // Both together: the enforcing limit decides.
    let e = c
        .should_rate_limit(call("w", &[&[("enforced", "a")], &[("watched", "a")]], 1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let m = svc.metrics();
    for (rule, decision, n) in [
        ("w.enforced", "error_denied", 2),
        ("w.watched", "error_allowed", 1),
        ("w.watched", "error_denied", 1),
    ] {
        let line =
            format!("floodgate_decisions_total{{rule=\"{rule}\",decision=\"{decision}\"}} {n}");
        assert!(m.contains(&line), "{line}\n{m}");
    }
}

/// Calls that Redis cannot decide write their warnings at most once per
/// kind and period, as the site's requests do: the counts held back go out
/// with the next line of the kind, or every period, not with every call.
#[tokio::test]
async fn calls_redis_cannot_decide_do_not_flood_the_log() {
    let file = "domain: q\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let mut redis = RedisServer::start();
    let started = Instant::now();
    let svc = Service::start(&redis, &[("q.yaml", file)], "", "");
    let mut c = svc.client().await;
    redis.stop();
    // Calls until Redis has failed 8 of them: the first, then a probe
    // after each breaker period (200 ms here), each a warning of its kind.
    let errors = |m: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix("floodgate_redis_errors_total "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    let mut i = 0u64;
    let deadline = Instant::now() + PATIENCE;
    while errors(&svc.metrics()) < 8 {
        assert!(Instant::now() < deadline, "Redis never failed 8 calls");
        let e = c
            .should_rate_limit(call("q", &[&[("k", &i.to_string())]], 1))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable);
        i += 1;
    }
    // Every line written before the reload's has been read once it is.
    svc.signal("HUP");
    wait_until(PATIENCE, "the reload's line", || {
        svc.log_has("descriptors reloaded (SIGHUP")
    });
    // The counting thread writes each kind's count every 10 s: at most one
    // line of each kind per 10 s of the service's life, not one a probe.
    let rounds = 1 + started.elapsed().as_secs() / 10;
    let log = svc.log();
    for kind in [
        "redis error",
        "redis connection",
        "breaker open",
        "no decision",
    ] {
        let counts: Vec<&String> = log
            .iter()
            .filter(|l| l.contains(&format!(" more \"{kind}\" lines")))
            .collect();
        assert!(counts.len() as u64 <= rounds, "{counts:#?}");
    }
}

#[tokio::test]
async fn without_redis_allow_deny_and_local() {
    for (policy, want) in [("allow", "OK"), ("deny", "OVER_LIMIT"), ("local", "local")] {
        let mut redis = RedisServer::start();
        let svc = Service::start(
            &redis,
            &[("another.yaml", ANOTHER)],
            &format!("on_redis_error = \"{policy}\""),
            "",
        );
        let mut c = svc.client().await;
        redis.stop();
        let v = unique();
        if want == "local" {
            // This process alone, with the same limit: 10 per hour.
            let mut seen = Vec::new();
            for _ in 0..11 {
                let r = c
                    .should_rate_limit(call("another", &[&[("key3", &v)]], 1))
                    .await
                    .unwrap();
                seen.push(crate::code_name(r.overall_code));
            }
            assert_eq!(seen[..10], ["OK"; 10]);
            assert_eq!(seen[10], "OVER_LIMIT");
        } else {
            let r = c
                .should_rate_limit(call("another", &[&[("key3", &v)]], 1))
                .await
                .unwrap();
            assert_eq!(crate::code_name(r.overall_code), want, "{policy}");
            if want == "OK" {
                // Allowed without Redis's word: no limit is shown.
                assert!(r.statuses[0].current_limit.is_none(), "{r:?}");
            }
        }
    }
}

/// One limit whose state the script cannot read fails alone: under
/// `allow` it shows no limit and takes nothing, and the other descriptors
/// of the same call are decided by Redis (here, over their limit).
#[tokio::test]
async fn a_broken_limit_leaves_the_others_of_its_call_to_redis() {
    let redis = RedisServer::start();
    let svc = Service::start(
        &redis,
        &[("another.yaml", ANOTHER)],
        "on_redis_error = \"allow\"",
        "",
    );
    let mut c = svc.client().await;
    let v = unique();
    redis::cmd("HSET")
        .arg(format!("floodgate:another.key2:rls:{v}"))
        .arg("x")
        .arg("1")
        .query::<()>(&mut redis.connection())
        .unwrap();
    let two = || call("another", &[&[("key2", &v)], &[("key3", &v)]], 1);
    let mut seen = Vec::new();
    for _ in 0..11 {
        let r = c.should_rate_limit(two()).await.unwrap();
        assert!(r.statuses[0].current_limit.is_none(), "{r:?}");
        seen.push(codes(&r)[1]);
    }
    let want: Vec<(&str, u32)> = (0..10)
        .rev()
        .map(|left| ("OK", left))
        .chain([("OVER_LIMIT", 0)])
        .collect();
    assert_eq!(seen, want);
    assert_eq!(redis.units(&format!("floodgate:another.key3:rls:{v}")), 10);
}

#[tokio::test]
async fn reloads_on_a_file_change_and_sighup_and_keeps_the_old_set_on_error() {
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("another.yaml", ANOTHER)], "", "");
    let mut c = svc.client().await;
    // A new file: picked up without a signal, within 2 s (waited for with
    // a longer deadline, for a loaded machine).
    svc.write_file("new.yaml", "domain: new\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 7}\n");
    let deadline = Instant::now() + PATIENCE;
    loop {
        let r = c
            .should_rate_limit(call("new", &[&[("k", "a")]], 1))
            .await
            .unwrap();
        if r.statuses[0].current_limit.is_some() {
            assert_eq!(codes(&r), [("OK", 6)]);
            break;
        }
        assert!(Instant::now() < deadline, "the new file was not picked up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A broken file: logged, and the old set stays in force.
    svc.write_file("new.yaml", "domain: new\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n");
    wait_until(PATIENCE, "the refusal in the log", || {
        svc.log_has("not reloaded")
    });
    assert!(
        svc.log_has("invalid rate limit unit \"fortnight\""),
        "{:?}",
        svc.log()
    );
    let r = c
        .should_rate_limit(call("new", &[&[("k", "a")]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 5)]);
    // Fixed, then SIGHUP: reloaded.
    svc.write_file("new.yaml", "domain: new\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 9}\n");
    svc.signal("HUP");
    until_limit(&mut c, "b", 9, "the fixed file").await;
    // Once the watcher has seen the fixed file too (its second reload),
    // rewritten in place at the same length, its time put back: still a
    // change, picked up without a signal.
    wait_until(PATIENCE, "the watcher's reload of the fixed file", || {
        svc.log()
            .iter()
            .filter(|l| l.contains("descriptors reloaded (the files changed)"))
            .count()
            == 2
    });
    svc.rewrite_in_place("new.yaml", "domain: new\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 8}\n");
    until_limit(&mut c, "c", 8, "the file rewritten in place").await;
}

/// Calls domain `new`, key `k`, value `value` until its limit is
/// `limit` a minute (the reload of `what` picked up), within [`PATIENCE`].
async fn until_limit(
    c: &mut floodgate_site::rls::proto::RateLimitClient,
    value: &str,
    limit: u32,
    what: &str,
) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let r = c
            .should_rate_limit(call("new", &[&[("k", value)]], 1))
            .await
            .unwrap();
        if r.statuses[0]
            .current_limit
            .as_ref()
            .is_some_and(|l| l.requests_per_unit == limit)
        {
            return;
        }
        assert!(Instant::now() < deadline, "{what} was not picked up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn sigterm_stops_cleanly() {
    let redis = RedisServer::start();
    let mut svc = Service::start(&redis, &[("another.yaml", ANOTHER)], "", "");
    let mut c = svc.client().await;
    c.should_rate_limit(call("another", &[&[("key2", "x")]], 1))
        .await
        .unwrap();
    svc.signal("TERM");
    let status = svc.wait();
    assert!(status.success(), "{status} {:?}", svc.log());
}

/// A ban Redis answers (here one no operator announced, as a penalty's ban
/// decided by another process is) is taught to the local fallback: with
/// Redis gone, `on_redis_error = "local"` still refuses that identity.
/// (Without the denial cache, which would answer it from memory anyway.)
#[tokio::test]
async fn the_local_fallback_keeps_the_bans_redis_answered() {
    let mut redis = RedisServer::start();
    let svc = Service::start(
        &redis,
        &[("another.yaml", ANOTHER)],
        "on_redis_error = \"local\"",
        "deny_cache = false",
    );
    let mut c = svc.client().await;
    let v = unique();
    let ask = || call("another", &[&[("key3", &v)]], 1);
    let r = c.should_rate_limit(ask()).await.unwrap();
    assert_eq!(crate::code_name(r.overall_code), "OK");
    // The identity's state key, and a ban in its operator record that no
    // one announced.
    let keys = redis.keys(&format!("*{v}*"));
    let key = keys
        .iter()
        .find(|k| !k.starts_with('!'))
        .unwrap_or_else(|| panic!("no state key among {keys:?}"))
        .clone();
    let mut conn = redis.connection();
    let (secs, _): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
    let _: () = redis::cmd("HSET")
        .arg(format!("!{key}"))
        .arg("ban")
        .arg((secs + 600) * 1000)
        .arg("by")
        .arg("penalty")
        .query(&mut conn)
        .unwrap();
    let r = c.should_rate_limit(ask()).await.unwrap();
    assert_eq!(
        crate::code_name(r.overall_code),
        "OVER_LIMIT",
        "banned by Redis"
    );
    redis.stop();
    // This process alone would allow 9 more; the ban it learned refuses.
    let r = c.should_rate_limit(ask()).await.unwrap();
    assert_eq!(
        crate::code_name(r.overall_code),
        "OVER_LIMIT",
        "banned here"
    );
}

/// floodgate's `penalty` in a `rate_limit`: a value denied `after` times
/// within `within` is banned for `ban`, counted and decided in the call
/// that denies; the ban shows as the wait, and in the metrics.
#[tokio::test]
async fn a_penalty_bans_a_value_denied_again_and_again() {
    const PENALTY: &str = "domain: pen\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: minute\n      requests_per_unit: 1\n      penalty: {after: 2, within: 10m, ban: 1h, max: 4h}\n";
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("pen.yaml", PENALTY)], "", "");
    let mut c = svc.client().await;
    let user = unique();
    let one = || call("pen", &[&[("user", &user)]], 1);
    let mut waits = Vec::new();
    for _ in 0..4 {
        let r = c.should_rate_limit(one()).await.unwrap();
        waits.push((
            codes(&r)[0].0,
            r.statuses[0].duration_until_reset.unwrap().seconds,
        ));
    }
    assert_eq!(waits[0].0, "OK");
    // The first denial waits for the window; the second bans for an hour.
    assert_eq!(waits[1].0, "OVER_LIMIT");
    assert!(waits[1].1 <= 60, "{waits:?}");
    for (code, wait) in &waits[2..] {
        assert_eq!(*code, "OVER_LIMIT");
        assert!((3500..=3600).contains(wait), "{waits:?}");
    }
    // Another value is not banned.
    let other = unique();
    let r = c
        .should_rate_limit(call("pen", &[&[("user", &other)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r)[0].0, "OK");
    assert!(
        svc.metrics()
            .lines()
            .any(|l| l.starts_with("floodgate_bans_total{")
                && l.contains("penalty")
                && l.ends_with(" 1")),
        "{}",
        svc.metrics()
    );
}

#[tokio::test]
async fn calls_that_never_finish_are_bounded_and_the_rest_refused_at_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    // Calls whose request never arrives each hold one of the calls the
    // service reads at once (1024); past them a call is answered
    // RESOURCE_EXHAUSTED at once, and once they go, calls are answered again.
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("another.yaml", ANOTHER)], "", "");
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        floodgate_site::rls::proto::SHOULD_RATE_LIMIT,
    );
    // Three connections of 512 unfinished calls each (a connection carries
    // at most 1024 at once): 1536 calls, of which the service holds 1024
    // and refuses 512. Every connection is opened and warmed before any
    // call is held: a warm-up after the first two connections' calls would
    // itself be refused.
    let mut channels = Vec::new();
    for _ in 0..3 {
        let channel = tonic::transport::Endpoint::new(svc.endpoint())
            .unwrap()
            .connect()
            .await
            .unwrap();
        // One call answered first: the client then has the server's
        // settings (1024 streams a connection). Before them it opens 100
        // at most, and the streams past those may wait for good.
        floodgate_site::rls::proto::RateLimitClient::new(channel.clone())
            .should_rate_limit(call("warm-up", &[&[("k", "v")]], 1))
            .await
            .unwrap();
        channels.push(channel);
    }
    let mut c = svc.client().await;
    let refused_held = Arc::new(AtomicUsize::new(0));
    let mut held = Vec::new();
    for channel in &channels {
        for _ in 0..512 {
            let mut grpc = tonic::client::Grpc::new(channel.clone());
            let path = path.clone();
            let refused_held = Arc::clone(&refused_held);
            held.push(tokio::spawn(async move {
                grpc.ready().await.unwrap();
                let codec = tonic_prost::ProstCodec::<
                    floodgate_site::rls::proto::RateLimitRequest,
                    floodgate_site::rls::proto::RateLimitResponse,
                >::default();
                let never = futures_util::stream::pending();
                let answer = grpc
                    .client_streaming(tonic::Request::new(never), path, codec)
                    .await;
                if matches!(&answer, Err(e) if e.code() == tonic::Code::ResourceExhausted) {
                    refused_held.fetch_add(1, Ordering::SeqCst);
                }
            }));
        }
    }
    // The probe waits until the service has refused the 512 past its bound:
    // a probe sent while the held calls still arrive could take a place
    // for its moment and leave one free for good.
    let deadline = Instant::now() + PATIENCE;
    while refused_held.load(Ordering::SeqCst) < 512 {
        assert!(
            Instant::now() < deadline,
            "only {} held calls refused",
            refused_held.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(refused_held.load(Ordering::SeqCst), 512);
    let v = unique();
    let refused = c
        .should_rate_limit(call("another", &[&[("key2", &v)]], 1))
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("too many calls in flight"),
        "{refused:?}"
    );
    wait_until(PATIENCE, "the refusal in the log", || {
        svc.log_has("answered RESOURCE_EXHAUSTED")
    });
    for h in &held {
        h.abort();
    }
    let fresh = unique();
    let deadline = Instant::now() + PATIENCE;
    let r = loop {
        match c
            .should_rate_limit(call("another", &[&[("key2", &fresh)]], 1))
            .await
        {
            Ok(r) => break r,
            Err(e) => {
                assert!(Instant::now() < deadline, "still refused: {e:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(codes(&r), [("OK", 19)]);
}
