//! `floodgate check-config FILE` run as a real process (CONTRACT 1): every
//! unusable file under tests/fixtures/config/ exits with status 2, prints
//! nothing on stdout and exactly one line `FILE: WHERE: WHAT` on stderr; a
//! good file prints one line per rule and exits 0; nothing ever panics or
//! prints a backtrace (RUST_BACKTRACE=1 is set to make one show if it could).

use std::process::{Command, Output};

fn check_config(file: &str) -> Output {
    let output = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["check-config", file])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RUST_BACKTRACE", "1")
        .env_remove("FLOODGATE_CONFIG")
        .output()
        .unwrap();
    for text in [&output.stdout, &output.stderr] {
        let text = String::from_utf8_lossy(text).to_lowercase();
        assert!(
            !text.contains("panicked") && !text.contains("backtrace"),
            "{file}: {text}"
        );
    }
    output
}

/// `check-config FILE` refuses the fixture with exactly `FILE: what`.
fn assert_refused(fixture: &str, what: &str) {
    let file = format!("tests/fixtures/config/{fixture}");
    let output = check_config(&file);
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(2), "{file}: {stderr}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "", "{file}");
    assert_eq!(stderr, format!("{file}: {what}\n"));
}

#[test]
fn unknown_key() {
    assert_refused(
        "unknown_key.toml",
        "line 6, column 1: unknown field \"windw\", expected one of \"name\", \"paths\", \
         \"methods\", \"key\", \"normalize\", \"limit\", \"window\", \"rate\", \"burst\", \
         \"cost\", \"description\", \"algorithm\", \"deny\", \"error_page\", \
         \"on_redis_error\", \"mode\", \"region\", \"count\"",
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
         \"path\", \"session\", \"header:NAME\", \"query:NAME\" or \"form:NAME\"",
    );
}

#[test]
fn unknown_algorithm() {
    assert_refused(
        "unknown_algorithm.toml",
        "rule \"check\" (rule 1): unknown algorithm \"leaky_bucket\", expected \
         \"sliding_window\", \"fixed_window\" or \"token_bucket\"",
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
        "rule \"check\" (rule 1): cost 6 is more than limit 5",
    );
}

#[test]
fn bad_cidr_in_trusted_proxies() {
    assert_refused(
        "bad_cidr.toml",
        "[server] trusted_proxies: \"10.0.0.0/33\" is not an IP address or CIDR",
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
    let output = check_config(file);
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(output.stdout.is_empty());
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("{file}: ")) && stderr.ends_with('\n'),
        "{stderr}"
    );
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
