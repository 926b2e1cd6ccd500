//! Operators on the service's limits: `floodgate check-config` lists the
//! rule names; `floodgate ban/inspect/override/reset` and the admin API act
//! on an identity by rule name and descriptor values, and the next call
//! honours it.

use std::process::Command;

use crate::{call, codes, fresh_dir, http_request, unique, write_config, RedisServer, Service};

const TREE: &str = r#"
domain: ops
descriptors:
  - key: tenant
    descriptors:
      - key: user
        rate_limit: {name: per-user, unit: minute, requests_per_unit: 5}
  - key: plan
    value: gold
    rate_limit: {unit: hour, requests_per_unit: 1000}
"#;

fn floodgate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(args)
        .env_remove("FLOODGATE_CONFIG")
        .env_remove("FLOODGATE_REDIS_URL")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_lists_rule_names_and_refuses_bad_files() {
    let redis = RedisServer::start();
    let dir = fresh_dir("check");
    std::fs::write(dir.join("descriptors/ops.yaml"), TREE).unwrap();
    let config = write_config(&dir, &redis, 1, 2, "", "");
    let (code, out, err) = floodgate(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let names: Vec<&str> = out.lines().filter_map(|l| l.split(':').next()).collect();
    assert_eq!(names, ["per-user", "ops.plan_gold"], "{out}");
    // `--config FILE`, as the other commands take it, reads the same file.
    for args in [
        vec!["check-config", "--config", config.to_str().unwrap()],
        vec!["check-config", &format!("--config={}", config.display())],
    ] {
        let (code, same, err) = floodgate(&args);
        assert_eq!((code, &same), (0, &out), "{args:?}: {err}");
    }

    std::fs::write(dir.join("descriptors/zz.yaml"), "domain: ops\n").unwrap();
    let (code, _, err) = floodgate(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 2);
    // The refusal names the file that has the domain already.
    let first = dir.join("descriptors/ops.yaml");
    assert!(
        err.trim().ends_with(&format!(
            "zz.yaml: domain \"ops\": duplicate domain: the descriptor file {} already has it",
            first.display()
        )),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");

    // A penalty is checked as a configuration file's is, in the same words.
    std::fs::write(
        dir.join("descriptors/zz.yaml"),
        "domain: zz\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1, penalty: {after: 2, within: 1m, ban: 2h, max: 1h}}\n",
    )
    .unwrap();
    let (code, _, err) = floodgate(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(
        err.trim()
            .ends_with("penalty ban (2h) must be at most max (1h)"),
        "{err}"
    );

    // [server] and [[rule]] do not apply to the service: refused.
    std::fs::remove_file(dir.join("descriptors/zz.yaml")).unwrap();
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        format!("{text}\n[server]\nbind = \"127.0.0.1:1\"\n"),
    )
    .unwrap();
    let (code, _, err) = floodgate(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(
        err.contains(": [server]: floodgate rls does not use [server]"),
        "{err}"
    );

    // A file without a domain, and one that is not a mapping: FILE: WHERE: WHAT,
    // in the file's words.
    let config = write_config(&dir, &redis, 1, 2, "", "");
    std::fs::write(dir.join("descriptors/zz.yaml"), "descriptors: []\n").unwrap();
    let (code, _, err) = floodgate(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(
        err.trim()
            .ends_with("zz.yaml: domain: the domain must be given and not empty"),
        "{err}"
    );
    std::fs::write(dir.join("descriptors/zz.yaml"), "- just\n- a list\n").unwrap();
    let (code, _, err) = floodgate(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("a mapping with a domain"), "{err}");
    assert!(!err.contains("Raw"), "{err}");
    std::fs::remove_file(dir.join("descriptors/zz.yaml")).unwrap();

    // Under [rls] shadow = true no limit is enforced: a ban or override
    // would never be, and is refused.
    let ban_is_refused = |config: &std::path::Path| {
        let (code, _, err) = floodgate(&[
            "ban",
            "--config",
            config.to_str().unwrap(),
            "per-user",
            "acme",
            "u",
            "--for",
            "1m",
        ]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("shadow mode"), "{err}");
    };
    ban_is_refused(&write_config(&dir, &redis, 1, 2, "shadow = true", ""));

    // [defaults] means for every limit what it means for every rule of the
    // site, where [rls] says nothing: the algorithm, and shadow mode.
    let config = write_config(
        &dir,
        &redis,
        1,
        2,
        "",
        "\n[defaults]\nalgorithm = \"gcra\"\nmode = \"shadow\"\n",
    );
    let (code, out, err) = floodgate(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().all(|l| l.contains(" gcra ")), "{out}");
    ban_is_refused(&config);
    let config = write_config(
        &dir,
        &redis,
        1,
        2,
        "algorithm = \"fixed_window\"",
        "\n[defaults]\nalgorithm = \"gcra\"\n",
    );
    let (code, out, err) = floodgate(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().all(|l| l.contains(" fixed_window ")), "{out}");
}

#[tokio::test]
async fn ban_inspect_override_reset_by_rule_name_and_values() {
    let redis = RedisServer::start();
    let svc = Service::start(
        &redis,
        &[("ops.yaml", TREE)],
        "",
        "[admin]\ntoken = \"sesame-sesame-sesame\"\nallow = [\"127.0.0.1/32\"]\n",
    );
    let config = svc.dir.join("rls.toml");
    let config = config.to_str().unwrap();
    let mut c = svc.client().await;
    let user = unique();
    let one = || call("ops", &[&[("tenant", "acme"), ("user", &user)]], 1);
    let r = c.should_rate_limit(one()).await.unwrap();
    assert_eq!(codes(&r), [("OK", 4)]);

    // The rule takes the user (the tenant key has no limit of its own but
    // counts apart too): two values.
    let (code, _, err) = floodgate(&["inspect", "--config", config, "per-user", &user]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("takes 2 values (tenant, user)"), "{err}");
    let (code, out, err) = floodgate(&["inspect", "--config", config, "per-user", "acme", &user]);
    assert_eq!(code, 0, "{err}");
    let seen: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(seen["used"], 1, "{out}");
    assert_eq!(seen["limit"], 5, "{out}");
    assert_eq!(
        seen["key"],
        format!("floodgate:per-user:rls:acme|{user}"),
        "{out}"
    );

    let (code, _, err) = floodgate(&[
        "ban", "--config", config, "per-user", "acme", &user, "--for", "10m",
    ]);
    assert_eq!(code, 0, "{err}");
    let r = c.should_rate_limit(one()).await.unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0)]);
    let wait = r.statuses[0].duration_until_reset.unwrap().seconds;
    assert!((500..=600).contains(&wait), "{wait}");
    // The ban is listed by the admin API and counted in /metrics, as the
    // site's are.
    let get = |path: &str| {
        http_request(
            svc.http,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame-sesame-sesame\r\nConnection: close\r\n\r\n"),
        )
    };
    let (status, text) = get("/admin/bans?rule=per-user");
    assert_eq!(status, 200, "{text}");
    let bans: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(bans[0]["rule"], "per-user", "{text}");
    assert_eq!(bans[0]["id"], format!("acme|{user}"), "{text}");
    let (status, text) = get(&format!("/admin/find?value={user}"));
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains(&format!("floodgate:per-user:rls:acme|{user}")),
        "{text}"
    );
    let (status, text) = get("/admin/bans?rule=nobody");
    assert_eq!(status, 400, "{text}");
    let (status, text) = get("/metrics");
    assert_eq!(status, 200);
    assert!(
        text.contains("floodgate_bans_active{rule=\"per-user\"} 1"),
        "{text}"
    );

    let (code, _, err) = floodgate(&["unban", "--config", config, "per-user", "acme", &user]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = floodgate(&[
        "override", "--config", config, "per-user", "acme", &user, "--limit", "50",
    ]);
    assert_eq!(code, 0, "{err}");
    let r = c.should_rate_limit(one()).await.unwrap();
    assert_eq!(codes(&r), [("OK", 48)]);
    assert_eq!(
        r.statuses[0]
            .current_limit
            .clone()
            .unwrap()
            .requests_per_unit,
        50
    );

    // The admin API on http_bind does the same.
    let body = format!("{{\"rule\":\"per-user\",\"values\":[\"acme\",\"{user}\"]}}");
    let request = |path: &str, auth: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {auth}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let (status, _) = http_request(svc.http, &request("/admin/reset", "wrong"));
    assert_eq!(status, 401);
    let (status, text) = http_request(svc.http, &request("/admin/reset", "sesame-sesame-sesame"));
    assert_eq!(status, 200, "{text}");
    let seen: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(seen["used"], 0, "{text}");
    let r = c.should_rate_limit(one()).await.unwrap();
    assert_eq!(codes(&r)[0].0, "OK");

    // As the site's: the action is in the audit trail, by the address...
    let (code, out, err) = floodgate(&["audit", "--config", config]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l.contains("\"action\":\"reset\"") && l.contains("\"by\":\"127.0.0.1\"")),
        "{out}"
    );
    // ...a field the action does not take is refused...
    let extra = format!("{{\"rule\":\"per-user\",\"values\":[\"acme\",\"{user}\"],\"limit\":5}}");
    let (status, text) = http_request(
        svc.http,
        &format!(
            "POST /admin/reset HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame-sesame-sesame\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{extra}",
            extra.len()
        ),
    );
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("reset takes no \\\"limit\\\""), "{text}");
    // ...and a wrong token from this machine is 401 however often it comes
    // (other addresses get 429 after five a minute, as from the site).
    let statuses: Vec<u16> = (0..7)
        .map(|_| http_request(svc.http, &request("/admin/inspect", "wrong")).0)
        .collect();
    assert_eq!(statuses, [401; 7]);
}

/// `floodgate top` and `find` on the service's limits: the identities its
/// calls were denied most, by rule name, as the limiter tallied them; and
/// an identity found by one of its descriptor values.
#[tokio::test]
async fn top_and_find_on_the_services_limits() {
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("ops.yaml", TREE)], "", "deny_cache = false");
    let config = svc.dir.join("rls.toml");
    let config = config.to_str().unwrap();
    let mut c = svc.client().await;
    let user = unique();
    let one = || call("ops", &[&[("tenant", "acme"), ("user", &user)]], 1);
    for _ in 0..7 {
        c.should_rate_limit(one()).await.unwrap();
    }
    let top = top_once_denied(config, "per-user", 2);
    assert_eq!(top["rule"], "per-user");
    assert_eq!(top["id"], format!("acme|{user}"));
    // `find` names the identity by one of its descriptor values.
    let found = find_one(config, &user);
    assert_eq!(found["rule"], "per-user");
    assert_eq!(found["key"], format!("floodgate:per-user:rls:acme|{user}"));
    assert_eq!(found["used"], 5);

    // With the denial cache on, the denials it answers count too.
    let cached = Service::start(&redis, &[("ops.yaml", TREE)], "", "");
    let mut c = cached.client().await;
    let other = unique();
    let mut codes_seen = Vec::new();
    for _ in 0..7 {
        let r = c
            .should_rate_limit(call("ops", &[&[("tenant", "acme"), ("user", &other)]], 1))
            .await
            .unwrap();
        codes_seen.push(codes(&r)[0].0);
    }
    assert_eq!(codes_seen.iter().filter(|c| **c == "OVER_LIMIT").count(), 2);
    assert!(
        cached
            .metrics()
            .lines()
            .any(|l| l.starts_with("floodgate_deny_cache_hits_total") && l.ends_with(" 1")),
        "the second denial came from the cache: {}",
        cached.metrics()
    );
    let want = format!("acme|{other}");
    crate::wait_until(
        std::time::Duration::from_secs(10),
        "the cached denial in top",
        || {
            let (code, stdout, err) = floodgate(&["top", "--config", config, "per-user"]);
            assert_eq!(code, 0, "{err}");
            stdout.lines().any(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["id"] == want.as_str() && v["denied"] == 2
            })
        },
    );
}

/// A limit name may hold `:` and braces (a descriptor file names limits
/// freely): such a name shares no counter with another limit whatever the
/// values sent, and the operators' commands and listings give it back
/// whole.
#[tokio::test]
async fn a_colon_in_a_limit_name_shares_no_counter() {
    let redis = RedisServer::start();
    let file = "domain: c\ndescriptors:\n  - key: a\n    rate_limit: {name: x, unit: minute, requests_per_unit: 1}\n  - key: b\n    rate_limit: {name: \"x:rls:{v}\", unit: minute, requests_per_unit: 1}\n";
    let svc = Service::start(&redis, &[("c.yaml", file)], "", "deny_cache = false");
    let config = svc.dir.join("rls.toml");
    let config = config.to_str().unwrap();
    let mut c = svc.client().await;
    let w = unique();
    // Limit `x` on value `{v}:rls:W`, and limit `x:rls:{v}` on value `W`:
    // written as they are, both would be the key `floodgate:x:rls:{v}:rls:W`.
    let crafted = format!("{{v}}:rls:{w}");
    let r = c
        .should_rate_limit(call("c", &[&[("a", &crafted)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    let r = c
        .should_rate_limit(call("c", &[&[("b", &w)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    let r = c
        .should_rate_limit(call("c", &[&[("b", &w)]], 1))
        .await
        .unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0)]);

    let (code, out, err) = floodgate(&["inspect", "--config", config, "x:rls:{v}", &w]);
    assert_eq!(code, 0, "{err}");
    let seen: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(seen["used"], 1, "{out}");
    assert_eq!(seen["key"], format!("floodgate:x%3Arls%3A%7Bv%7D:rls:{w}"));
    assert_eq!(find_one(config, &w)["rule"], "x:rls:{v}");
    // The denial is counted under the whole name.
    let top = top_once_denied(config, "x:rls:{v}", 1);
    assert_eq!(top["rule"], "x:rls:{v}", "{top}");
    assert_eq!(top["id"], w.as_str(), "{top}");
}

/// The one identity `floodgate find VALUE` lists.
fn find_one(config: &str, value: &str) -> serde_json::Value {
    let (code, out, err) = floodgate(&["find", "--config", config, value]);
    assert_eq!(code, 0, "{err}");
    let found: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(found.len(), 1, "{out}");
    found.into_iter().next().unwrap()
}

/// `floodgate top` on `rule`'s busiest identity, once its denials (counted
/// in the background) reach `denied`.
fn top_once_denied(config: &str, rule: &str, denied: u32) -> serde_json::Value {
    let mut out = String::new();
    crate::wait_until(
        std::time::Duration::from_secs(10),
        "the denials in top",
        || {
            let (code, stdout, err) = floodgate(&["top", "--config", config, rule]);
            assert_eq!(code, 0, "{err}");
            out = stdout;
            out.contains(&format!("\"denied\":{denied}"))
        },
    );
    serde_json::from_str(out.trim()).unwrap()
}

#[tokio::test]
async fn an_override_above_the_limit_takes_hits_the_limit_cannot() {
    // per-user allows 5 a minute: a call of 20 hits can never fit it, but
    // an identity an operator raised to 50 takes them.
    let redis = RedisServer::start();
    let svc = Service::start(&redis, &[("ops.yaml", TREE)], "", "");
    let config = svc.dir.join("rls.toml");
    let config = config.to_str().unwrap();
    let mut c = svc.client().await;
    let (raised, other) = (unique(), unique());
    let heavy = |user: &str| call("ops", &[&[("tenant", "acme"), ("user", user)]], 20);
    for user in [&raised, &other] {
        let r = c.should_rate_limit(heavy(user)).await.unwrap();
        assert_eq!(codes(&r), [("OVER_LIMIT", 0)], "{user}");
    }
    let (code, _, err) = floodgate(&[
        "override", "--config", config, "per-user", "acme", &raised, "--limit", "50",
    ]);
    assert_eq!(code, 0, "{err}");
    let r = c.should_rate_limit(heavy(&raised)).await.unwrap();
    assert_eq!(codes(&r), [("OK", 30)]);
    assert_eq!(
        r.statuses[0]
            .current_limit
            .clone()
            .unwrap()
            .requests_per_unit,
        50
    );
    let r = c.should_rate_limit(heavy(&raised)).await.unwrap();
    assert_eq!(codes(&r), [("OK", 10)]);
    // Over the override too, and nothing charged: one more unit fits.
    let r = c.should_rate_limit(heavy(&raised)).await.unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0)]);
    let one = call("ops", &[&[("tenant", "acme"), ("user", &raised)]], 10);
    let r = c.should_rate_limit(one).await.unwrap();
    assert_eq!(codes(&r), [("OK", 0)]);
    // Only that identity.
    let r = c.should_rate_limit(heavy(&other)).await.unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0)]);
    // Cleared: back to a limit 20 hits can never fit.
    let (code, _, err) = floodgate(&[
        "override", "--config", config, "per-user", "acme", &raised, "--clear",
    ]);
    assert_eq!(code, 0, "{err}");
    let r = c.should_rate_limit(heavy(&raised)).await.unwrap();
    assert_eq!(codes(&r), [("OVER_LIMIT", 0)]);
}
