//! `Limiter::peek`: for every algorithm, and for the states a reload leaves
//! behind (other parameters, another algorithm's state, an old-layout
//! counter, a list longer than any limit), a peek answers exactly what a
//! decision of the same check at the same moment answers, and changes
//! nothing in Redis (the whole dataset's digest, every key's value, and its
//! expiry time).

mod common;

use floodgate_limiter::limiter::Outcome;
use floodgate_limiter::rule::Algorithm;

use common::pinned::{bucket, check, fixed, pinned_limiter, sliding, T0};
use common::RedisServer;

/// A key's value (`DUMP`, `None` when there is none) and its absolute
/// expiry time in ms (`PEXPIRETIME`: -1 none, -2 no key).
type KeyState = (Option<Vec<u8>>, i64);

/// Everything a write could change: the key count, the dataset's digest,
/// and each key's value and expiry.
fn snapshot(redis: &RedisServer, keys: &[String]) -> (u64, String, Vec<KeyState>) {
    let mut conn = redis.connection();
    let size: u64 = redis::cmd("DBSIZE").query(&mut conn).unwrap();
    let digest: String = redis::cmd("DEBUG").arg("DIGEST").query(&mut conn).unwrap();
    let keys = keys
        .iter()
        .map(|k| {
            let dump: Option<Vec<u8>> = redis::cmd("DUMP").arg(k).query(&mut conn).unwrap();
            let at: i64 = redis::cmd("PEXPIRETIME").arg(k).query(&mut conn).unwrap();
            (dump, at)
        })
        .collect();
    (size, digest, keys)
}

/// One case: the state a key is given, and the check it is peeked with.
struct Case {
    key: &'static str,
    /// Decisions that build the state: (ms after T0, algorithm, cost).
    decisions: Vec<(u64, Algorithm, u32)>,
    /// What is peeked (and then decided) at `AT`.
    algorithm: Algorithm,
    cost: u32,
}

/// When every case is peeked, then decided (ms after T0).
const AT: u64 = 20_000;

#[actix_web::test]
async fn a_peek_answers_what_a_decision_would_and_writes_nothing() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let cases = vec![
        Case {
            key: "sliding-same",
            decisions: vec![
                (0, sliding(5, 60_000), 1),
                (1_000, sliding(5, 60_000), 1),
                (2_000, sliding(5, 60_000), 1),
            ],
            algorithm: sliding(5, 60_000),
            cost: 2,
        },
        Case {
            key: "sliding-full",
            decisions: vec![(0, sliding(3, 60_000), 3)],
            algorithm: sliding(3, 60_000),
            cost: 1,
        },
        Case {
            // Reloaded with a lower limit and a shorter window: the entry
            // at 0 has left it, the two at 15 s fill it.
            key: "sliding-reloaded",
            decisions: vec![(0, sliding(5, 60_000), 1), (15_000, sliding(5, 60_000), 2)],
            algorithm: sliding(2, 10_000),
            cost: 1,
        },
        Case {
            key: "fixed-same",
            decisions: vec![(0, fixed(5, 60_000), 2)],
            algorithm: fixed(5, 60_000),
            cost: 1,
        },
        Case {
            // A decision stamps the open window with the new length.
            key: "fixed-reloaded",
            decisions: vec![(0, fixed(5, 60_000), 2)],
            algorithm: fixed(5, 30_000),
            cost: 1,
        },
        Case {
            key: "bucket-same",
            decisions: vec![(0, bucket(0.1, 5), 3)],
            algorithm: bucket(0.1, 5),
            cost: 2,
        },
        Case {
            // A decision stamps the bucket with the new rate and burst.
            key: "bucket-reloaded",
            decisions: vec![(0, bucket(0.1, 5), 3)],
            algorithm: bucket(0.2, 4),
            cost: 1,
        },
        Case {
            // A bucket's hash, now a fixed window: a decision deletes it.
            key: "bucket-now-fixed",
            decisions: vec![(0, bucket(0.1, 5), 3)],
            algorithm: fixed(5, 60_000),
            cost: 1,
        },
        Case {
            key: "fixed-now-bucket",
            decisions: vec![(0, fixed(5, 60_000), 4)],
            algorithm: bucket(0.1, 5),
            cost: 1,
        },
        Case {
            // A list, now a fixed window: another Redis type altogether.
            key: "sliding-now-fixed",
            decisions: vec![(0, sliding(5, 60_000), 4)],
            algorithm: fixed(5, 60_000),
            cost: 1,
        },
        Case {
            key: "fixed-now-sliding",
            decisions: vec![(0, fixed(5, 60_000), 4)],
            algorithm: sliding(5, 60_000),
            cost: 1,
        },
    ];
    for case in &cases {
        for &(t, algorithm, cost) in &case.decisions {
            let d = limiter
                .decide_at(T0 + t, vec![check(case.key, algorithm, cost)])
                .await
                .unwrap();
            assert!(d.allowed, "{}: setup at {t}", case.key);
        }
    }
    // A counter in the layout from before windows stored their start, and
    // a list longer than any limit (no decision writes one; a decision
    // trims it).
    let mut conn = redis.connection();
    redis::cmd("SET")
        .arg("legacy")
        .arg(2)
        .arg("PX")
        .arg(600_000)
        .query::<()>(&mut conn)
        .unwrap();
    // One unit each, pushed oldest first (entries are `TIME:TOTAL:UNITS`).
    let long: Vec<String> = (0..100_001u64)
        .map(|i| format!("{}:{}:1", T0 + 10_000, i + 1))
        .collect();
    redis::cmd("LPUSH")
        .arg("too-long")
        .arg(&long)
        .query::<()>(&mut conn)
        .unwrap();
    let mut peeked: Vec<(String, Algorithm, u32)> = cases
        .iter()
        .map(|c| (c.key.to_string(), c.algorithm, c.cost))
        .collect();
    peeked.push(("legacy".into(), fixed(5, 60_000), 1));
    peeked.push(("too-long".into(), sliding(100_000, 60_000), 1));
    let keys: Vec<String> = peeked.iter().map(|(k, _, _)| k.clone()).collect();

    let before = snapshot(&redis, &keys);
    let checks = peeked
        .iter()
        .map(|(k, a, c)| check(k, *a, *c))
        .collect::<Vec<_>>();
    let peeks = limiter.peek_at(T0 + AT, checks.clone()).await.unwrap();
    // Peeked again, and each key alone: the same answers.
    assert_eq!(
        limiter.peek_at(T0 + AT, checks.clone()).await.unwrap(),
        peeks
    );
    for (check, peek) in checks.iter().zip(&peeks) {
        let alone = limiter.peek_at(T0 + AT, vec![check.clone()]).await.unwrap();
        assert_eq!(alone, vec![*peek], "{} alone", check.key());
    }
    let after = snapshot(&redis, &keys);
    assert_eq!(before.0, after.0, "DBSIZE");
    assert_eq!(before.1, after.1, "DEBUG DIGEST");
    for ((key, b), a) in keys.iter().zip(&before.2).zip(&after.2) {
        assert_eq!(b.0, a.0, "{key}: DUMP");
        assert_eq!(b.1, a.1, "{key}: PEXPIRETIME");
    }

    // Each decision at the same moment answers what its peek did, and these
    // are the cases where a decision writes before it answers.
    let mut decided: Vec<Outcome> = Vec::new();
    for check in &checks {
        let d = limiter
            .decide_at(T0 + AT, vec![check.clone()])
            .await
            .unwrap();
        decided.push(d.outcomes[0]);
    }
    for ((check, peek), decision) in checks.iter().zip(&peeks).zip(&decided) {
        assert_eq!(peek, decision, "{}: the peek and the decision", check.key());
    }
    let changed = snapshot(&redis, &keys);
    for (((key, b), a), peek) in keys.iter().zip(&before.2).zip(&changed.2).zip(&peeks) {
        if !peek.allowed && key.starts_with("sliding") {
            continue; // a denial on a log writes nothing but its TTL
        }
        assert!(
            b != a,
            "{key}: the decision changed the key (the case is real)"
        );
    }
    // A few answers spelled out, so that "equal" is not "equally wrong".
    let by = |key: &str| peeks[keys.iter().position(|k| k == key).unwrap()];
    assert_eq!(
        (by("sliding-same").allowed, by("sliding-same").remaining),
        (true, 0)
    );
    assert!(!by("sliding-full").allowed);
    assert_eq!(by("sliding-reloaded").wait.as_millis(), 5_000);
    assert_eq!(by("fixed-reloaded").wait.as_millis(), 10_000);
    assert_eq!(
        (
            by("bucket-now-fixed").allowed,
            by("bucket-now-fixed").remaining
        ),
        (true, 4)
    );
    assert_eq!(by("legacy").remaining, 2);
    assert!(!by("too-long").allowed);
    assert_eq!(redis.llen("too-long"), 100_000, "the decision trimmed it");
}
