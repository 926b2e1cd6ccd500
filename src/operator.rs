//! The operator commands: `floodgate inspect | reset | ban | unban |
//! override`, thin over the library's operator actions, and the listings
//! `floodgate bans | overrides | audit`. They read the same file and Redis
//! as `serve`. Exit 0 with the rule's view of the identity (or the
//! listing, one object per line) as JSON on stdout; 2 with one line on
//! stderr for bad input; 1 with one line when Redis cannot be reached.
//! Every action but `inspect` goes to the audit trail, by `cli:USER`.

use std::path::PathBuf;
use std::process::ExitCode;

use floodgate::config::RedisConfig;
use floodgate::limiter::Limiter;
use floodgate::limiter::{Action, Dispatch, LimiterOptions};
use floodgate::{ban_action, operator_check, override_action};
use floodgate_site::config::Config;
use floodgate_site::listings;
use floodgate_site::site::session::Secret;
use floodgate_site::site::store::{session_position, Store};

/// The arguments of one command, as written.
#[derive(Default)]
struct Args<'a> {
    config: Option<&'a str>,
    positional: Vec<&'a str>,
    lasts: Option<&'a str>,
    since: Option<&'a str>,
    limit: Option<&'a str>,
    window: Option<&'a str>,
    clear: bool,
    all_rules: bool,
}

fn parse<'a>(rest: &[&'a str]) -> Result<Args<'a>, String> {
    let mut args = Args::default();
    let mut it = rest.iter().copied();
    let mut flags = true;
    while let Some(arg) = it.next() {
        if !flags || !arg.starts_with("--") {
            args.positional.push(arg);
            continue;
        }
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (arg, None),
        };
        let mut value = || -> Result<&'a str, String> {
            inline
                .or_else(|| it.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        // An option given twice is refused: which one a script meant
        // cannot be known (the admin API refuses a field twice too).
        let twice = || format!("{name} is given twice");
        let slot = match name {
            "--" => {
                flags = false;
                continue;
            }
            "--config" => &mut args.config,
            "--for" => &mut args.lasts,
            "--since" => &mut args.since,
            "--limit" => &mut args.limit,
            "--window" => &mut args.window,
            "--clear" | "--all-rules" if inline.is_none() => {
                let flag = match name {
                    "--clear" => &mut args.clear,
                    _ => &mut args.all_rules,
                };
                if std::mem::replace(flag, true) {
                    return Err(twice());
                }
                continue;
            }
            _ => return Err(format!("unknown option {arg:?}")),
        };
        if slot.is_some() {
            return Err(twice());
        }
        *slot = Some(value()?);
    }
    Ok(args)
}

/// The action `command` asks for, from its options.
fn action(command: &str, args: &Args<'_>) -> Result<Action, String> {
    let none_of = |names: &[(&str, bool)]| -> Result<(), String> {
        match names.iter().find(|(_, given)| *given) {
            Some((name, _)) => Err(format!("{command} takes no {name}")),
            None => Ok(()),
        }
    };
    let (lasts, limit, window) = (
        args.lasts.is_some(),
        args.limit.is_some(),
        args.window.is_some(),
    );
    match command {
        "inspect" | "reset" | "unban" => {
            none_of(&[
                ("--for", lasts),
                ("--limit", limit),
                ("--window", window),
                ("--clear", args.clear),
            ])?;
            Ok(match command {
                "inspect" => Action::Inspect,
                "reset" => Action::Reset,
                _ => Action::Unban,
            })
        }
        "ban" => {
            none_of(&[
                ("--limit", limit),
                ("--window", window),
                ("--clear", args.clear),
            ])?;
            ban_action(
                args.lasts
                    .ok_or("ban needs --for DURATION, like --for 10m")?,
            )
        }
        _ if args.clear => {
            let clash = [("--limit", limit), ("--window", window), ("--for", lasts)];
            match clash.iter().find(|(_, given)| *given) {
                // (An override ends at once when cleared: nothing lasts.)
                Some((name, _)) => Err(format!("override --clear takes no {name}")),
                None => Ok(Action::Clear),
            }
        }
        _ => {
            let text = args.limit.ok_or("override needs --limit N, or --clear")?;
            let n: i64 = text
                .parse()
                .map_err(|_| format!("--limit must be a whole number, got {text:?}"))?;
            override_action(n, args.window, args.lasts)
        }
    }
}

/// Runs an operator command on a `floodgate rls` file's limits: RULE is a
/// limit's rule name, VALUE... the values of its descriptor entries that
/// count apart.
fn run_rls(command: &str, args: &Args<'_>, path: &std::path::Path) -> ExitCode {
    let bad = |what: &str| {
        eprintln!("floodgate {command}: {what}");
        ExitCode::from(2)
    };
    let (config, matcher) = match floodgate_site::rls::load(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let Some((rule, values)) = args.positional.split_first() else {
        return bad("name a rule (and its descriptor values)");
    };
    let action = match action(command, args) {
        Ok(a) => a,
        Err(e) => return bad(&e),
    };
    let redis = &config.filter.redis;
    let check = match floodgate_site::rls::operator::check_for(
        &matcher,
        &redis.key_prefix,
        !redis.cluster.is_empty(),
        config.rls.shadow,
        rule,
        values,
        &action,
    ) {
        Ok(c) => c,
        Err(e) => return bad(&e),
    };
    let limiter = match command_limiter(command, redis) {
        Ok(l) => l,
        Err(code) => return code,
    };
    act(&limiter, &redis.key_prefix, command, rule, &check, action)
}

/// The limiter a command talks to Redis through: it decides nothing, so it
/// keeps no denial cache, and its dispatcher threads serve it. Redis out of
/// reach: exit 1, with one line.
fn command_limiter(command: &str, redis: &RedisConfig) -> Result<Limiter, ExitCode> {
    let options = LimiterOptions {
        deny_cache: false,
        dispatch: Dispatch::Threads,
        ..LimiterOptions::default()
    };
    Limiter::new(redis, options).map_err(|e| {
        eprintln!("floodgate {command}: {e}");
        ExitCode::FAILURE
    })
}

/// The ID a `session` rule keys the account `value` names by (its phone
/// number, or the ID itself), or why it names none; exit 1 when Redis
/// cannot say.
fn session_id(
    command: &str,
    limiter: &Limiter,
    config: &floodgate::config::Config,
    secret: &str,
    value: &str,
) -> Result<Result<String, String>, ExitCode> {
    let fail = |code: u8, what: &str| {
        eprintln!("floodgate {command}: {what}");
        ExitCode::from(code)
    };
    let store = Secret::new(secret)
        .map(|s| {
            Store::new(&config.redis.key_prefix, s).clustered(!config.redis.cluster.is_empty())
        })
        .map_err(|e| fail(1, &format!("no randomness for the site's secret: {e}")))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| fail(1, &format!("cannot start: {e}")))?;
    let (value, region) = (value.to_string(), config.region);
    match runtime.block_on(limiter.with_redis(move |conn| store.session_id(conn, &value, region))) {
        Ok(Ok(named)) => Ok(named),
        Ok(Err(e)) => Err(fail(1, &format!("redis: {e}"))),
        Err(e) => Err(fail(1, &e.to_string())),
    }
}

/// Runs `action` and prints what the rule holds afterwards; records it in
/// the audit trail.
fn act(
    limiter: &Limiter,
    prefix: &str,
    command: &str,
    rule: &str,
    check: &floodgate::limiter::Check,
    action: Action,
) -> ExitCode {
    match limiter.operate_blocking(check, action) {
        Ok(seen) => {
            out!("{}", seen.to_json(rule));
            let user = listings::cli_user();
            if let Err(e) = listings::record(limiter, prefix, &action, rule, &seen.key, &user) {
                eprintln!("floodgate {command}: done, but not written to the audit trail: {e}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("floodgate {command}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs a listing: `bans [RULE]`, `overrides [RULE]`, `top RULE [--since
/// D]`, `find VALUE`, `audit [--since D]`.
pub fn run_listing(command: &str, rest: &[&str], default: PathBuf) -> ExitCode {
    let bad = |what: &str| {
        eprintln!("floodgate {command}: {what}");
        ExitCode::from(2)
    };
    let args = match parse(rest) {
        Ok(a) => a,
        Err(e) => return bad(&e),
    };
    if args.lasts.is_some()
        || args.limit.is_some()
        || args.window.is_some()
        || args.clear
        || args.all_rules
    {
        return bad("takes no --for, --limit, --window, --clear or --all-rules");
    }
    let path = args.config.map_or(default, PathBuf::from);
    let mut site_rules = Vec::new();
    // The site's file (its secret), for an account `find` names by phone.
    let mut site_config = None;
    // What `find` searches of a rate-limit service's limits: a descriptor
    // value is an ID's part as it is (escaped as a composite ID's parts are).
    let mut rls_limits: Vec<listings::Searched> = Vec::new();
    let (redis, rules): (_, Vec<listings::Known>) = if floodgate_site::rls::is_rls_file(&path) {
        match floodgate_site::rls::load(&path) {
            Ok((config, matcher)) => {
                let known = listings::known_limits(&matcher);
                if let (Some(value), "find") = (args.positional.first(), command) {
                    rls_limits = listings::searched_limits(&matcher, value);
                }
                (config.filter.redis, known)
            }
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        }
    } else {
        match Config::load(&path) {
            Ok(c) => {
                let known = listings::known(&c.filter.rules);
                site_rules = c.filter.rules.clone();
                let redis = c.filter.redis.clone();
                site_config = Some((c.filter, c.server.secret));
                (redis, known)
            }
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        }
    };
    let rule = match (command, args.positional.as_slice()) {
        ("audit", []) | ("bans" | "overrides", []) => None,
        ("find", [value]) => Some(*value),
        ("top", [rule]) => {
            if let Err(e) = listings::known_rule(&rules, rule) {
                return bad(&e);
            }
            Some(*rule)
        }
        ("top", _) => return bad("takes one rule (and --since D)"),
        ("find", _) => return bad("takes one value, written as a request carries it"),
        ("bans" | "overrides", [rule]) => {
            if let Err(e) = listings::known_rule(&rules, rule) {
                return bad(&e);
            }
            Some(*rule)
        }
        ("audit", _) => return bad("takes no rule (only --since D)"),
        _ => return bad("takes at most one rule"),
    };
    if !matches!(command, "audit" | "top") && args.since.is_some() {
        return bad("takes no --since");
    }
    let since = match listings::since("--since", args.since.filter(|_| command == "audit")) {
        Ok(s) => s,
        Err(e) => return bad(&e),
    };
    let top_since = match listings::top_since("--since", args.since.filter(|_| command == "top")) {
        Ok(s) => s,
        Err(e) => return bad(&e),
    };
    let limiter = match command_limiter(command, &redis) {
        Ok(l) => l,
        Err(code) => return code,
    };
    // `find`'s one value: what each rule (or limit) is searched for.
    let searched = match (command, rule) {
        ("find", Some(value)) if rls_limits.is_empty() => {
            let mut searched = listings::searched_rules(&site_rules, value);
            // An account named by its phone number: the session rules are
            // searched for its ID too.
            let session_rules = site_rules.iter().any(listings::has_session);
            if let (true, Some((config, secret))) = (session_rules, &site_config) {
                match session_id(command, &limiter, config, secret, value) {
                    Ok(Ok(id)) if id != *value => {
                        listings::search_session_id(&mut searched, &site_rules, &id)
                    }
                    Ok(_) => {}
                    Err(code) => return code,
                }
            }
            searched
        }
        _ => rls_limits,
    };
    let asked = listings::Asked {
        what: command,
        rule: rule.filter(|_| command != "find"),
        searched: &searched,
        since,
        top_since,
    };
    let objects = listings::list(&limiter, &redis.key_prefix, &rules, &asked);
    match objects {
        Ok(objects) => {
            for o in objects {
                out!("{o}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("floodgate {command}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `ban | unban | reset --all-rules VALUE`: the action on the identity
/// VALUE under every enforce rule keyed by that one kind of value: an
/// address under every `ip` rule; a path (it starts with `/`) under every
/// `path` rule; any other value under every rule keyed by one value of the
/// request (a header, query, form, JSON or body field, the session) that
/// takes it. Prints each rule's view, one per line.
fn run_all_rules(
    command: &str,
    args: &Args<'_>,
    config: &floodgate::config::Config,
    secret: &str,
    action: Action,
) -> ExitCode {
    use floodgate::rule::{KeyKind, Mode};
    let bad = |what: &str| {
        eprintln!("floodgate {command}: {what}");
        ExitCode::from(2)
    };
    let [value] = args.positional.as_slice() else {
        return bad("--all-rules takes one value (and no rule)");
    };
    let is_address = value.parse::<std::net::IpAddr>().is_ok();
    let is_path = value.starts_with('/');
    let hash_tags = !config.redis.cluster.is_empty();
    // The account a `session` rule keys the value by (its phone number
    // names it), asked of Redis only when such a rule takes the value.
    let mut limiter = None;
    let mut account = None;
    let session_rules = config
        .rules
        .iter()
        .any(|r| r.mode() == Mode::Enforce && matches!(r.key().single(), Some(KeyKind::Session)));
    if session_rules && !is_address && !is_path {
        let l = match command_limiter(command, &config.redis) {
            Ok(l) => l,
            Err(code) => return code,
        };
        // (One that names no account leaves the session rules out.)
        account = match session_id(command, &l, config, secret, value) {
            Ok(named) => named.ok(),
            Err(code) => return code,
        };
        limiter = Some(l);
    }
    let checks: Vec<(&str, floodgate::limiter::Check)> = config
        .rules
        .iter()
        .filter(|r| r.mode() == Mode::Enforce)
        .filter(|r| match r.key().single() {
            Some(KeyKind::Ip) => is_address,
            Some(KeyKind::Path) => is_path,
            Some(
                KeyKind::Header(_)
                | KeyKind::Query(_)
                | KeyKind::Form(_)
                | KeyKind::Json(_)
                | KeyKind::Body(_)
                | KeyKind::Session,
            ) => !is_address && !is_path,
            _ => false,
        })
        .filter_map(|r| {
            let named = match r.key().single() {
                // A value that names no account reaches no session rule.
                Some(KeyKind::Session) if !is_address => account.as_deref()?,
                _ => *value,
            };
            let check = operator_check(
                &config.rules,
                &config.redis.key_prefix,
                hash_tags,
                r.name(),
                &[named],
                &action,
            );
            check.ok().map(|c| (r.name(), c))
        })
        .collect();
    if checks.is_empty() {
        return bad(&format!(
            "no enforce rule is keyed by one value like {value:?}"
        ));
    }
    let limiter = match limiter.map_or_else(|| command_limiter(command, &config.redis), Ok) {
        Ok(l) => l,
        Err(code) => return code,
    };
    for (rule, check) in &checks {
        let done = act(
            &limiter,
            &config.redis.key_prefix,
            command,
            rule,
            check,
            action,
        );
        if done != ExitCode::SUCCESS {
            return done;
        }
    }
    ExitCode::SUCCESS
}

/// Runs an operator command.
pub fn run(command: &str, rest: &[&str], default: PathBuf) -> ExitCode {
    let bad = |what: &str| {
        eprintln!("floodgate {command}: {what}");
        ExitCode::from(2)
    };
    let args = match parse(rest) {
        Ok(a) => a,
        Err(e) => return bad(&e),
    };
    let path = args.config.map_or(default, PathBuf::from);
    if args.all_rules && !matches!(command, "ban" | "unban" | "reset") {
        return bad("--all-rules goes with ban, unban and reset");
    }
    if floodgate_site::rls::is_rls_file(&path) {
        if args.all_rules {
            return bad("--all-rules is for the site's rules, not a rate-limit service's");
        }
        return run_rls(command, &args, &path);
    }
    // The same file as `serve` (the site's own sections included).
    let (config, secret) = match Config::load(&path) {
        Ok(c) => (c.filter, c.server.secret),
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let action = match action(command, &args) {
        Ok(a) => a,
        Err(e) => return bad(&e),
    };
    if args.all_rules {
        return run_all_rules(command, &args, &config, &secret, action);
    }
    let Some((rule, values)) = args.positional.split_first() else {
        return bad("name a rule (and its key values)");
    };
    let mut values: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    let mut limiter = None;
    if let Some(i) = session_position(&config.rules, rule, values.len()) {
        let l = match command_limiter(command, &config.redis) {
            Ok(l) => l,
            Err(code) => return code,
        };
        values[i] = match session_id(command, &l, &config, &secret, &values[i]) {
            Ok(Ok(id)) => id,
            Ok(Err(why)) => return bad(&why),
            Err(code) => return code,
        };
        limiter = Some(l);
    }
    let values: Vec<&str> = values.iter().map(String::as_str).collect();
    let hash_tags = !config.redis.cluster.is_empty();
    let check = match operator_check(
        &config.rules,
        &config.redis.key_prefix,
        hash_tags,
        rule,
        &values,
        &action,
    ) {
        Ok(c) => c,
        Err(e) => return bad(&e),
    };
    let limiter = match limiter.map_or_else(|| command_limiter(command, &config.redis), Ok) {
        Ok(l) => l,
        Err(code) => return code,
    };
    act(
        &limiter,
        &config.redis.key_prefix,
        command,
        rule,
        &check,
        action,
    )
}
