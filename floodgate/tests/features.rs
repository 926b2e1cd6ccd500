//! A build without an optional feature reads the same files, and refuses
//! the settings that need it at load, naming the key and the feature; a
//! filter built in code that asks for it gets the same reason. Run with
//! `cargo test -p floodgate --no-default-features` to see the refusals;
//! with the features on, the same files are accepted. No Redis is needed:
//! nothing here gets as far as connecting.

use std::path::Path;

use floodgate_limiter::config::Config;
use floodgate_limiter::Filter;

const CLUSTER: &str = "[redis]\ncluster = [\"redis://127.0.0.1:7000/\"]\n";
const SENTINEL: &str =
    "[redis]\nsentinel = [\"redis://127.0.0.1:26379/\"]\nsentinel_master = \"fg\"\n";
const E164: &str = "[[rule]]\nname = \"sms\"\npaths = [\"/sms\"]\nkey = \"form:phone\"\n\
                    normalize = \"e164\"\nlimit = 3\nwindow = \"1h\"\n";

fn load(text: &str) -> Result<Config, String> {
    Config::parse(text, Path::new("config.toml")).map_err(|e| e.to_string())
}

/// The error a filter built in code gets for `config`'s `[redis]`.
#[allow(dead_code)]
fn built(redis: floodgate_limiter::config::RedisConfig) -> String {
    match Filter::builder().redis(redis).build() {
        Ok(_) => "built".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
#[cfg(not(feature = "cluster"))]
fn a_cluster_needs_the_cluster_feature() {
    let why = "this build of floodgate has no Redis Cluster support (feature \"cluster\")";
    assert_eq!(
        load(CLUSTER).unwrap_err(),
        format!("config.toml: [redis] cluster: {why}")
    );
    let mut redis = load("").unwrap().redis;
    redis.cluster = vec!["redis://127.0.0.1:7000/".into()];
    assert_eq!(
        built(redis),
        format!("cannot set up the limiter: [redis] cluster: {why}")
    );
}

#[test]
#[cfg(not(feature = "sentinel"))]
fn sentinels_need_the_sentinel_feature() {
    let why = "this build of floodgate has no Redis Sentinel support (feature \"sentinel\")";
    assert_eq!(
        load(SENTINEL).unwrap_err(),
        format!("config.toml: [redis] sentinel: {why}")
    );
    let mut redis = load("").unwrap().redis;
    redis.sentinel = vec!["redis://127.0.0.1:26379/".into()];
    redis.sentinel_master = "fg".into();
    assert_eq!(
        built(redis),
        format!("cannot set up the limiter: [redis] sentinel: {why}")
    );
}

#[test]
#[cfg(not(feature = "e164"))]
fn phone_numbers_need_the_e164_feature() {
    let why = "this build of floodgate has no phone number support (feature \"e164\")";
    assert_eq!(
        load(E164).unwrap_err(),
        format!("config.toml: rule \"sms\" (rule 1): normalize = \"e164\": {why}")
    );
    let err = Filter::from_toml_str(E164, "inline.toml")
        .err()
        .map(|e| e.to_string());
    assert_eq!(
        err.as_deref(),
        Some(format!("inline.toml: rule \"sms\" (rule 1): normalize = \"e164\": {why}").as_str())
    );
}

/// With the features on, the same files are read.
#[test]
fn a_build_with_a_feature_reads_what_it_asks_for() {
    assert_eq!(load(CLUSTER).is_ok(), cfg!(feature = "cluster"));
    assert_eq!(load(SENTINEL).is_ok(), cfg!(feature = "sentinel"));
    assert_eq!(load(E164).is_ok(), cfg!(feature = "e164"));
}
