//! Unusable configuration files, refused the same way by the real binary's
//! `check-config FILE` and `serve --config FILE`: exit status 2, nothing on
//! stdout and exactly one line `FILE: WHERE: WHAT` on stderr, the same line
//! from both commands. A good file prints one line per rule and exits 0;
//! nothing ever panics or prints a backtrace (RUST_BACKTRACE=1 is set to make
//! one show if it could).

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn no_panic(file: &str, output: &Output) {
    for text in [&output.stdout, &output.stderr] {
        let text = String::from_utf8_lossy(text).to_lowercase();
        assert!(
            !text.contains("panicked") && !text.contains("backtrace"),
            "{file}: {text}"
        );
    }
}

fn floodgate() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_floodgate"));
    command
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RUST_BACKTRACE", "1")
        .env_remove("FLOODGATE_CONFIG")
        .env_remove("FLOODGATE_BIND")
        .env_remove("FLOODGATE_REDIS_URL");
    command
}

fn check_config(file: &str) -> Output {
    let output = floodgate().args(["check-config", file]).output().unwrap();
    no_panic(file, &output);
    output
}

/// `serve --config FILE`, which must exit by itself; killed if it is still
/// serving after 20 s (the file was accepted).
fn serve(file: &str) -> Output {
    let mut child = floodgate()
        .args(["serve", "--config", file])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // As wait_until does, but the child is killed before the test fails.
    let deadline = Instant::now() + Duration::from_secs(20);
    let exited = loop {
        if child.try_wait().unwrap().is_some() {
            break true;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let output = child.wait_with_output().unwrap();
    assert!(exited, "{file}: serve did not exit: it accepted the file");
    no_panic(file, &output);
    output
}

/// Both commands refuse the fixture with exactly `FILE: what`.
fn assert_refused(fixture: &str, what: &str) {
    let file = format!("tests/fixtures/config/{fixture}");
    for (command, output) in [
        ("check-config", check_config(&file)),
        ("serve", serve(&file)),
    ] {
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(output.status.code(), Some(2), "{command} {file}: {stderr}");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            "",
            "{command} {file}"
        );
        assert_eq!(stderr, format!("{file}: {what}\n"), "{command} {file}");
    }
}

#[test]
fn unknown_key() {
    assert_refused(
        "unknown_key.toml",
        "line 6, column 1: unknown field \"windw\", expected one of \"name\", \"paths\", \
         \"methods\", \"key\", \"normalize\", \"limit\", \"window\", \"rate\", \"burst\", \
         \"cost\", \"description\", \"algorithm\", \"deny\", \"error_page\", \
         \"on_redis_error\", \"mode\", \"region\", \"count\", \"on_missing_key\", \"hash_key\", \
         \"headers\", \"exempt\", \"penalty\"",
    );
}

#[test]
fn bad_duration() {
    assert_refused(
        "bad_duration.toml",
        "rule \"check\" (rule 1): window: invalid duration \"10 s\": expected a whole number \
         followed by ms, s, m, h or d, like \"250ms\" or \"10s\"",
    );
}

#[test]
fn zero_limit() {
    assert_refused(
        "zero_limit.toml",
        "rule \"check\" (rule 1): limit must be between 1 and 100000, got 0",
    );
}

#[test]
fn zero_window() {
    assert_refused(
        "zero_window.toml",
        "rule \"check\" (rule 1): window must be greater than 0",
    );
}

#[test]
fn limit_over_100000() {
    assert_refused(
        "limit_too_large.toml",
        "rule \"check\" (rule 1): limit must be between 1 and 100000, got 100001",
    );
}

#[test]
fn duplicate_rule_name() {
    assert_refused(
        "duplicate_rule.toml",
        "rule \"sms\" (rule 2): duplicate rule name (also rule 1)",
    );
}

#[test]
fn bad_rule_name() {
    assert_refused(
        "bad_rule_name.toml",
        "rule \"sms send\" (rule 1): name must be 1 to 64 characters from A-Z, a-z, 0-9, \
         \"_\" and \"-\"",
    );
}

#[test]
fn path_not_starting_with_slash() {
    assert_refused(
        "relative_path.toml",
        "rule \"check\" (rule 1): path \"check\" must start with \"/\"",
    );
}

#[test]
fn unknown_key_kind() {
    assert_refused(
        "unknown_key_kind.toml",
        "rule \"check\" (rule 1): unknown key \"cookie:sid\", expected \"ip\", \"global\", \
         \"path\", \"session\", \"header:NAME\", \"query:NAME\", \"form:NAME\", \"json:NAME\" \
         or \"body:NAME\"",
    );
}

#[test]
fn unknown_algorithm() {
    assert_refused(
        "unknown_algorithm.toml",
        "line 4, column 13: unknown variant \"leaky_bucket\", expected one of \
         \"sliding_window\", \"fixed_window\", \"token_bucket\", \"gcra\", \"sliding_counter\"",
    );
}

#[test]
fn token_bucket_without_burst() {
    assert_refused(
        "token_bucket_without_burst.toml",
        "rule \"api\" (rule 1): token_bucket needs burst (the bucket's capacity)",
    );
}

#[test]
fn cost_over_limit() {
    assert_refused(
        "cost_over_limit.toml",
        "rule \"check\" (rule 1): cost must be between 1 and 5 (the rule's limit), got 6",
    );
}

#[test]
fn normalize_on_a_key_that_reads_no_value() {
    assert_refused(
        "normalize_without_value_key.toml",
        "rule \"check\" (rule 1): normalize applies to header, query, form, json and body keys; \
         key = [\"ip\", \"path\"] reads none",
    );
}

#[test]
fn bad_cidr_in_trusted_proxies() {
    assert_refused(
        "bad_cidr.toml",
        "[server] trusted_proxies: \"10.0.0.0/33\" is not an IP address or CIDR: the prefix \
         length must be at most 32 for IPv4",
    );
}

#[test]
fn unknown_on_missing_key() {
    let dir = std::env::temp_dir().join(format!("fg-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("missing.toml");
    std::fs::write(&file, "[defaults]\non_missing_key = \"drop\"\n").unwrap();
    let err = floodgate::config::Config::load_file(&file)
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with("line 2, column 18: unknown variant \"drop\", expected \"ip\" or \"reject\""),
        "{err}"
    );
}

#[test]
fn bad_cidr_in_a_rules_exempt() {
    assert_refused(
        "bad_exempt.toml",
        "rule \"check\" (rule 1): exempt: \"10.0.0.0/33\" is not an IP address or CIDR: the \
         prefix length must be at most 32 for IPv4",
    );
}

#[test]
fn unknown_header_dialect() {
    assert_refused(
        "bad_headers.toml",
        "line 2, column 11: unknown variant \"draft-8\", expected one of \"ietf\", \
         \"draft-6\", \"draft-7\", \"x-ratelimit\", \"none\"",
    );
}

#[test]
fn unknown_proxy_header() {
    assert_refused(
        "bad_proxy_header.toml",
        "line 3, column 16: unknown variant \"x-real-ip\", expected \"x-forwarded-for\" or \"forwarded\"",
    );
}

#[test]
fn toml_syntax_error() {
    assert_refused(
        "toml_syntax.toml",
        "line 4, column 1: missing comma between array elements, expected \",\"",
    );
}

#[test]
fn missing_file_is_one_line_and_status_2() {
    let file = "tests/fixtures/config/does-not-exist.toml";
    for output in [check_config(file), serve(file)] {
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(output.stdout.is_empty());
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.starts_with(&format!("{file}: ")) && stderr.ends_with('\n'),
            "{stderr}"
        );
    }
}

#[test]
fn default_config_passes_with_one_line_per_rule() {
    let file = "config/default.toml";
    let output = check_config(file);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.stderr.is_empty());
    let text = std::fs::read_to_string(file).unwrap();
    let names: Vec<&str> = text
        .split("[[rule]]")
        .skip(1)
        .map(|rule| {
            rule.lines()
                .find_map(|l| l.trim().strip_prefix("name = \""))
                .and_then(|l| l.split('"').next())
                .expect("every rule has a name")
        })
        .collect();
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(!names.is_empty());
    assert_eq!(lines.len(), names.len(), "{stdout}");
    for (line, name) in lines.iter().zip(&names) {
        assert!(line.starts_with(&format!("{name}: ")), "{line}");
    }
}

#[test]
fn window_that_overflows_milliseconds_is_refused_not_wrapped() {
    assert_refused(
        "window_overflow.toml",
        "rule \"check\" (rule 1): window must be at most 366 days, got \"213503982335d\"",
    );
}

#[test]
fn window_over_366_days() {
    assert_refused(
        "window_over_366_days.toml",
        "rule \"check\" (rule 1): window must be at most 366 days, got \"367d\"",
    );
}

#[test]
fn redis_timeout_that_overflows() {
    assert_refused(
        "redis_timeout_overflow.toml",
        "[redis] timeout: must be at most 1 minute, got \"999999999999h\"",
    );
}

#[test]
fn redis_timeout_over_a_minute() {
    assert_refused(
        "redis_timeout_over_a_minute.toml",
        "[redis] timeout: must be at most 1 minute, got \"61s\"",
    );
}

#[test]
fn body_timeout_zero() {
    assert_refused(
        "body_timeout_zero.toml",
        "[server] body_timeout: must be greater than 0",
    );
}

#[test]
fn body_timeout_over_an_hour() {
    assert_refused(
        "body_timeout_over_an_hour.toml",
        "[server] body_timeout: must be at most 1 hour, got \"61m\"",
    );
}

#[test]
fn breaker_over_ten_minutes() {
    assert_refused(
        "breaker_over_ten_minutes.toml",
        "[limiter] breaker: must be at most 10 minutes, got \"1h\"",
    );
}

#[test]
fn breaker_not_a_duration() {
    assert_refused(
        "breaker_bad_duration.toml",
        "[limiter] breaker: invalid duration \"1.5s\": expected a whole number followed by \
         ms, s, m, h or d, like \"250ms\" or \"10s\"",
    );
}

#[test]
fn workers_over_512_is_refused_before_serve_can_panic() {
    assert_refused(
        "workers_513.toml",
        "[server] workers: must be between 0 and 512 (0 = one per CPU core), got 513",
    );
}

#[test]
fn max_form_that_overflows() {
    assert_refused(
        "max_form_overflow.toml",
        "[server] max_form: must be between 1 byte and 64MiB, got \
         \"99999999999999999999999KiB\"",
    );
}

#[test]
fn bind_to_an_impossible_address() {
    assert_refused(
        "bad_bind.toml",
        "[server] bind: \"999.1.1.1:8080\" is not host:port (an IP address, [IPv6] or host \
         name, then a port from 0 to 65535)",
    );
}

#[test]
fn pool_size_below_what_the_limiter_holds_plus_one() {
    assert_refused(
        "pool_size_2.toml",
        "[redis] pool_size: must be between 3 and 1024, got 2 (the pool serves the site, \
         /readyz, give-backs and /limits; with fewer, one stalled call starves the others)",
    );
}

#[test]
fn key_prefix_with_a_control_character() {
    assert_refused(
        "key_prefix_control.toml",
        "[redis] key_prefix: must be 1 to 64 bytes without spaces or control characters, got \
         \"flood\\tgate\"",
    );
}

#[test]
fn token_bucket_that_needs_years_to_refill() {
    assert_refused(
        "token_bucket_slow_refill.toml",
        "rule \"api\" (rule 1): a bucket of 20 refilling at rate 1e-15 per second needs more \
         than 366 days to refill from empty; rate must be at least 6.324630641570532e-7 \
         (burst / 31622400 seconds)",
    );
}

#[test]
fn token_bucket_rate_not_a_number() {
    assert_refused(
        "token_bucket_nan_rate.toml",
        "rule \"api\" (rule 1): rate must be greater than 0 and at most 1000000 (tokens per \
         second), got NaN",
    );
}

#[test]
fn token_bucket_rate_infinite() {
    assert_refused(
        "token_bucket_infinite_rate.toml",
        "rule \"api\" (rule 1): rate must be greater than 0 and at most 1000000 (tokens per \
         second), got inf",
    );
}

#[test]
fn token_bucket_rate_zero() {
    assert_refused(
        "token_bucket_zero_rate.toml",
        "rule \"api\" (rule 1): rate must be greater than 0 and at most 1000000 (tokens per \
         second), got 0",
    );
}

#[test]
fn cost_over_burst() {
    assert_refused(
        "cost_over_burst.toml",
        "rule \"api\" (rule 1): cost must be between 1 and 20 (the rule's burst), got 21",
    );
}

#[test]
fn cost_far_over_limit_states_the_real_range() {
    assert_refused(
        "cost_200000.toml",
        "rule \"check\" (rule 1): cost must be between 1 and 5 (the rule's limit), got 200000",
    );
}

#[test]
fn cost_zero() {
    assert_refused(
        "cost_zero.toml",
        "rule \"check\" (rule 1): cost must be between 1 and 5 (the rule's limit), got 0",
    );
}

const PLAIN_PATH: &str = "it must be a plain absolute path on this site, like \"/err\"";

#[test]
fn error_page_with_a_control_character() {
    assert_refused(
        "error_page_control_char.toml",
        &format!(
            "[defaults] error_page: error_page \"/err\\u{{7}}\" may hold only letters, digits \
             and -._~!$&'()*+,;=:@/ (no spaces, control or non-ASCII characters): {PLAIN_PATH}"
        ),
    );
}

#[test]
fn error_page_with_a_query() {
    assert_refused(
        "error_page_with_query.toml",
        &format!(
            "rule \"check\" (rule 1): error_page \"/err?from=check\" must not have a query or \
             fragment (the rule and retry time are added as the query): {PLAIN_PATH}"
        ),
    );
}

#[test]
fn error_page_on_another_host() {
    assert_refused(
        "error_page_protocol_relative.toml",
        &format!(
            "[defaults] error_page: error_page \"//evil.example/err\" must not start with \"//\" \
             (a browser reads that as another host): {PLAIN_PATH}"
        ),
    );
}

#[test]
fn error_page_with_a_space() {
    assert_refused(
        "error_page_space.toml",
        &format!(
            "[defaults] error_page: error_page \"/my err\" may hold only letters, digits and \
             -._~!$&'()*+,;=:@/ (no spaces, control or non-ASCII characters): {PLAIN_PATH}"
        ),
    );
}

#[test]
fn error_page_with_a_dot_segment() {
    assert_refused(
        "error_page_dot_segment.toml",
        &format!(
            "[defaults] error_page: error_page \"/static/../err\" must not have an empty, \".\" \
             or \"..\" segment: {PLAIN_PATH}"
        ),
    );
}

#[test]
fn error_page_percent_encoded() {
    assert_refused(
        "error_page_percent.toml",
        &format!(
            "[defaults] error_page: error_page \"/%65rr\" must not be percent-encoded: {PLAIN_PATH}"
        ),
    );
}

#[test]
fn error_page_relative() {
    assert_refused(
        "error_page_relative.toml",
        &format!("[defaults] error_page: error_page \"err\" must start with \"/\": {PLAIN_PATH}"),
    );
}

#[test]
fn redirect_rule_that_covers_its_own_error_page() {
    assert_refused(
        "redirect_covers_error_page.toml",
        "rule \"everything\" (rule 1): deny = \"redirect\" sends denied requests to error_page \
         \"/err\", which this rule's paths and methods cover too (a loop); leave the error page \
         out of paths, set another error_page, or use deny = \"status\"",
    );
}

#[test]
fn path_with_a_query() {
    assert_refused(
        "path_with_query.toml",
        "rule \"check\" (rule 1): path \"/a?b\" can never match: it contains \"?\" (a query is \
         not part of the path)",
    );
}

#[test]
fn path_percent_encoded() {
    assert_refused(
        "path_percent_encoded.toml",
        "rule \"check\" (rule 1): path \"/caf%C3%A9\" can never match: it contains \"%\" \
         (paths are matched percent-decoded: write \"/café\", not \"/caf%C3%A9\")",
    );
}

#[test]
fn path_with_a_fragment() {
    assert_refused(
        "path_with_fragment.toml",
        "rule \"check\" (rule 1): path \"/a#b\" can never match: it contains \"#\" (a fragment \
         is never sent)",
    );
}

#[test]
fn path_with_a_space() {
    assert_refused(
        "path_with_space.toml",
        "rule \"check\" (rule 1): path \"/a b\" can never match: it contains a space",
    );
}

#[test]
fn path_with_a_control_character() {
    assert_refused(
        "path_with_control_char.toml",
        "rule \"check\" (rule 1): path \"/a\\nb\" can never match: it contains a control \
         character",
    );
}

#[test]
fn sentinel_without_sentinel_master() {
    assert_refused(
        "sentinel_without_master.toml",
        "[redis] sentinel: sentinel needs sentinel_master, the name the Sentinels monitor the \
         master under",
    );
}

#[test]
fn sentinel_master_without_sentinel() {
    assert_refused(
        "sentinel_master_without_sentinel.toml",
        "[redis] sentinel_master: is set but sentinel lists no Sentinel servers",
    );
}

#[test]
fn cluster_together_with_sentinel() {
    assert_refused(
        "cluster_and_sentinel.toml",
        "[redis] cluster: cluster and sentinel cannot both be set: Redis is either a Cluster or \
         a master watched by Sentinels",
    );
}

#[test]
fn every_new_key_at_its_limits_is_accepted() {
    let file = "tests/fixtures/config/accepted_limits.toml";
    let output = check_config(file);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        stdout,
        "slow: * /slow key=ip sliding_window limit=100000 window=366d cost=100000 deny=redirect \
         on_redis_error=allow mode=enforce\n\
         bucket: GET /bucket/* key=ip token_bucket rate=0.0000006324630641570532/s burst=20 \
         cost=20 deny=status on_redis_error=deny mode=enforce\n\
         errors: POST /err key=ip fixed_window limit=5 window=1m cost=1 deny=redirect \
         on_redis_error=allow mode=enforce\n"
    );
}

#[test]
fn check_config_names_a_rules_dialect_and_exempt_networks_when_set() {
    let file = "tests/fixtures/config/dialects_and_exempt.toml";
    let output = check_config(file);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        "seven: * /a key=ip sliding_window limit=5 window=10s cost=1 deny=redirect \
         on_redis_error=allow mode=enforce headers=draft-7\n\
         quiet: * /b key=ip sliding_window limit=5 window=10s cost=1 deny=redirect \
         on_redis_error=allow mode=enforce headers=none exempt=2\n\
         std: * /c key=ip sliding_window limit=5 window=10s cost=1 deny=redirect \
         on_redis_error=allow mode=enforce\n"
    );
}

#[test]
fn check_config_names_what_changes_what_a_rule_counts() {
    let output = check_config("tests/fixtures/config/counting.toml");
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        "verify: POST /login/sms key=[\"form:phone\", \"ip\"] sliding_window limit=5 window=10m \
         cost=1 deny=redirect on_redis_error=allow mode=enforce count=failures normalize=e164\n\
         emails: * /login key=body:email sliding_window limit=10 window=1m cost=1 deny=redirect \
         on_redis_error=allow mode=enforce normalize=lowercase hash_key=true on_missing_key=reject\n"
    );
}

/// A listing whose output cannot be written (here `/dev/full`, as a disk
/// that filled up) says so and exits 1; it never panics.
#[test]
fn an_output_that_cannot_be_written_is_an_error_not_a_panic() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let output = floodgate()
        .args(["check-config", "config/default.toml"])
        .stdout(full)
        .output()
        .unwrap();
    no_panic("config/default.toml", &output);
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot write the output"), "{stderr}");
}

/// An address taken by another process: `serve` and `rls` refuse the file
/// as any other unusable setting, naming it (exit 2, one line).
#[test]
fn a_bind_address_in_use_is_the_files_to_mend() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let dir = std::env::temp_dir().join(format!("floodgate-bind-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("descriptors")).unwrap();
    std::fs::write(
        dir.join("descriptors/d.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: minute, requests_per_unit: 1 }\n",
    )
    .unwrap();
    let site = dir.join("site.toml");
    std::fs::write(&site, format!("[server]\nbind = \"127.0.0.1:{port}\"\n")).unwrap();
    let rls = dir.join("rls.toml");
    std::fs::write(
        &rls,
        format!(
            "[rls]\nbind = \"127.0.0.1:{port}\"\nhttp_bind = \"127.0.0.1:0\"\ndescriptors = {:?}\n",
            dir.join("descriptors").display().to_string()
        ),
    )
    .unwrap();
    for (command, file, place) in [
        ("serve", &site, "[server] bind"),
        ("rls", &rls, "[rls] bind"),
    ] {
        let file = file.display().to_string();
        let output = floodgate()
            .args([command, "--config", &file])
            .output()
            .unwrap();
        no_panic(&file, &output);
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(output.status.code(), Some(2), "{command}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{command}: {stderr}");
        assert!(
            stderr.starts_with(&format!(
                "{file}: {place}: cannot listen on 127.0.0.1:{port}: "
            )),
            "{command}: {stderr}"
        );
    }
    drop(taken);
    let _ = std::fs::remove_dir_all(dir);
}

/// `--help` (or `-h`) after any command prints the usage and succeeds; an
/// unknown command prints it on stderr and exits with 2.
#[test]
fn help_after_any_command_and_usage_on_a_wrong_one() {
    for args in [
        &["--help"][..],
        &["help"],
        &["ban", "--help"],
        &["override", "-h"],
        &["rls", "--help"],
        &["check-config", "-h"],
    ] {
        let out = floodgate().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.starts_with("usage: floodgate"), "{args:?}: {text}");
        assert!(text.contains("floodgate override"), "{args:?}: {text}");
    }
    let out = floodgate().arg("frobnicate").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("usage: floodgate"));
}
