//! The service on a Redis Cluster and through a Sentinel, configured as
//! for the site: keys carry hash tags, a call's limits stay all-or-nothing
//! across shards (never more admitted than each limit allows), and a
//! Sentinel's master is found.

use crate::cluster_helpers::{Cluster, Sentinel, MASTER_NAME};
use crate::grpc::ANOTHER;
use crate::{call, codes, unique, Service};

#[tokio::test]
async fn on_a_cluster_with_hash_tags_and_all_or_nothing() {
    let cluster = Cluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("{s:?}")).collect();
    let redis = format!("cluster = [{}]", seeds.join(", "));
    let svc = Service::start_on(&redis, &[("another.yaml", ANOTHER)], "", "");
    let mut c = svc.client().await;
    // Two descriptors, two identities (two slots): 20 a minute and 10 an hour.
    let (a, b) = (unique(), unique());
    for i in 0..12u32 {
        let r = c
            .should_rate_limit(call("another", &[&[("key2", &a)], &[("key3", &b)]], 1))
            .await
            .unwrap();
        if i < 10 {
            assert_eq!(codes(&r), [("OK", 19 - i), ("OK", 9 - i)], "call {i}");
        } else {
            assert_eq!(r.overall_code, 2, "call {i}: {r:?}");
            assert_eq!(codes(&r)[1], ("OVER_LIMIT", 0));
        }
    }
    // Never more than each limit allows: 10 entries in each log (a
    // give-back in flight may briefly leave fewer, never more).
    let mut conn = cluster.connection();
    let first: u64 = redis::cmd("LLEN")
        .arg(format!("floodgate:another.key2:rls:{{{a}}}"))
        .query(&mut conn)
        .unwrap();
    let second: u64 = redis::cmd("LLEN")
        .arg(format!("floodgate:another.key3:rls:{{{b}}}"))
        .query(&mut conn)
        .unwrap();
    assert!(first <= 10 && second == 10, "{first} {second}");
}

#[tokio::test]
async fn through_a_sentinel() {
    let sentinel = Sentinel::start();
    let redis = format!(
        "sentinel = [\"{}\"]\nsentinel_master = \"{MASTER_NAME}\"",
        sentinel.url()
    );
    let svc = Service::start_on(&redis, &[("another.yaml", ANOTHER)], "", "");
    let mut c = svc.client().await;
    let v = unique();
    for i in 0..11u32 {
        let r = c
            .should_rate_limit(call("another", &[&[("key3", &v)]], 1))
            .await
            .unwrap();
        let want = if i < 10 {
            ("OK", 9 - i)
        } else {
            ("OVER_LIMIT", 0)
        };
        assert_eq!(codes(&r), [want], "call {i}");
    }
}
