//! The `floodgate` command: `serve [--config FILE]` | `check-config [FILE]`
//! | `rls [--config FILE]` (Envoy's rate-limit service) | the operator commands (`inspect`, `reset`, `ban`, `unban`, `override`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use floodgate_site::{config, site};

use config::{cannot_listen, format_duration, Config, ConfigError, DEFAULT_PATH};
use floodgate::rule::HeaderDialect;
use site::Application;

/// `println!`, except that a reader gone away (`floodgate bans | head`)
/// ends the command quietly, as it ends any Unix tool, and any other
/// failure to write (a full disk) ends it with status 1, instead of a panic.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            eprintln!("floodgate: cannot write the output: {e}");
            std::process::exit(1);
        }
    }};
}

mod operator;

/// mimalloc: a decision's allocations (its job for Redis, the reply's
/// channel, a gRPC call's messages), made on one thread and freed on
/// another, cost less than with the system allocator (measured: about 2 µs
/// less of the Envoy service's CPU per call under load).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "usage: floodgate [serve [--config FILE]] | check-config [[--config] FILE] | rls [--config FILE]
       floodgate inspect|reset|unban [--config FILE] RULE [VALUE...]
       floodgate ban [--config FILE] RULE [VALUE...] --for DURATION
       floodgate override [--config FILE] RULE [VALUE...] (--limit N [--window D] | --clear) [--for D]
       floodgate ban|unban|reset [--config FILE] --all-rules VALUE [--for DURATION]
       floodgate bans|overrides [--config FILE] [RULE]
       floodgate top [--config FILE] RULE [--since D]
       floodgate find [--config FILE] VALUE
       floodgate audit [--config FILE] [--since D]";

fn main() -> ExitCode {
    let args = config_flag_split(std::env::args().skip(1).collect());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        // Asked of any command (`floodgate ban --help`): the usage.
        ["-h" | "--help" | "help"] | [_, "-h" | "--help", ..] => {
            out!("{USAGE}");
            ExitCode::SUCCESS
        }
        [] | ["serve"] => serve(default_path()),
        ["serve", "--config", file] => serve(PathBuf::from(file)),
        // (The site's file has `[server]` and rules, which `rls` refuses.)
        ["rls"] => rls(default_path_or(RLS_DEFAULT_PATH)),
        ["rls", "--config", file] => rls(PathBuf::from(file)),
        ["check-config"] => check_config(default_path()),
        // (A FILE that starts with `-` is an option mistyped or without its file.)
        ["check-config", file] if !file.starts_with('-') => check_config(PathBuf::from(file)),
        ["check-config", "--config", file] => check_config(PathBuf::from(file)),
        [command @ ("inspect" | "reset" | "ban" | "unban" | "override"), rest @ ..] => {
            init_audit_log();
            operator::run(command, rest, default_path())
        }
        [command @ ("bans" | "overrides" | "audit" | "find" | "top"), rest @ ..] => {
            operator::run_listing(command, rest, default_path())
        }
        ["-V" | "--version"] => {
            out!("floodgate {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// `serve`, `rls` and `check-config` with `--config=FILE` written as
/// `--config FILE`, the one form their arms match (the operator commands
/// read their options themselves).
fn config_flag_split(mut args: Vec<String>) -> Vec<String> {
    let file = match args.as_slice() {
        [command, flag] if matches!(command.as_str(), "serve" | "rls" | "check-config") => {
            flag.strip_prefix("--config=").map(str::to_string)
        }
        _ => None,
    };
    if let Some(file) = file {
        args.truncate(1);
        args.extend(["--config".to_string(), file]);
    }
    args
}

/// The file `rls` serves when neither `--config` nor `$FLOODGATE_CONFIG`
/// names one.
const RLS_DEFAULT_PATH: &str = "config/rls.toml";

fn default_path() -> PathBuf {
    default_path_or(DEFAULT_PATH)
}

/// `$FLOODGATE_CONFIG`, else `fallback`.
fn default_path_or(fallback: &str) -> PathBuf {
    std::env::var_os("FLOODGATE_CONFIG")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(fallback), PathBuf::from)
}

fn unusable(e: &ConfigError) -> ExitCode {
    eprintln!("{e}");
    ExitCode::from(2)
}

fn check_config(path: PathBuf) -> ExitCode {
    if floodgate_site::rls::is_rls_file(&path) {
        return check_rls(&path);
    }
    let config = match Config::load_file(&path) {
        Ok(c) => c,
        Err(e) => return unusable(&e),
    };
    for r in &config.filter.rules {
        let methods = if r.methods().is_empty() {
            "*".to_string()
        } else {
            r.methods().join(",")
        };
        let limit = r.algorithm().fields(format_duration);
        // Only what differs from the usual is shown of these.
        let mut extra = String::new();
        if r.headers() != HeaderDialect::Ietf {
            extra.push_str(&format!(" headers={}", r.headers()));
        }
        // What changes what a rule counts, and how its values are read.
        if r.count() != floodgate::rule::Count::All {
            extra.push_str(&format!(" count={}", r.count()));
        }
        if r.normalize() != floodgate::rule::Normalize::None {
            extra.push_str(&format!(" normalize={}", r.normalize()));
        }
        if r.hash_key() {
            extra.push_str(" hash_key=true");
        }
        if r.on_missing_key() != floodgate::rule::OnMissingKey::Ip {
            extra.push_str(&format!(" on_missing_key={}", r.on_missing_key()));
        }
        if !r.exempt().is_empty() {
            extra.push_str(&format!(" exempt={}", r.exempt().len()));
        }
        if let Some(p) = r.penalty() {
            extra.push_str(&format!(
                " penalty={}/{} ban={} max={}",
                p.after,
                format_duration(p.within),
                format_duration(p.ban),
                format_duration(p.max)
            ));
        }
        out!(
            "{}: {methods} {} key={} {} {limit} cost={} deny={} on_redis_error={} mode={}{extra}",
            r.name(),
            r.path_text().join(" "),
            r.key(),
            r.algorithm().name(),
            r.cost(),
            r.deny(),
            r.on_redis_error(),
            r.mode()
        );
    }
    ExitCode::SUCCESS
}

/// `check-config` on a `floodgate rls` file: one line per limit, its rule
/// name first.
fn check_rls(path: &std::path::Path) -> ExitCode {
    let (config, matcher) = match floodgate_site::rls::load(path) {
        Ok(c) => c,
        Err(e) => return unusable(&e),
    };
    for l in matcher.limits() {
        let what = if l.unlimited {
            "unlimited".to_string()
        } else {
            match &l.algorithm {
                Some(a) => format!("{} {}", a.name(), a.fields(format_duration)),
                None => format!(
                    "always over (requests_per_unit 0) window={}",
                    format_duration(l.window)
                ),
            }
        };
        let mut extra = String::new();
        if l.shadow {
            extra.push_str(" shadow");
        }
        if !l.replaces.is_empty() {
            extra.push_str(&format!(" replaces={}", l.replaces.join(",")));
        }
        out!(
            "{}: domain={} path={} {what} unit={}{extra}",
            l.name,
            l.domain,
            l.path,
            l.unit.name()
        );
    }
    for w in floodgate_site::rls::warnings(&config, &matcher) {
        eprintln!("warning: {w}");
    }
    ExitCode::SUCCESS
}

fn rls(path: PathBuf) -> ExitCode {
    init_logger();
    let result = floodgate_site::rls::serve(&path);
    floodgate::logging::flush();
    match result {
        Ok(()) => {
            log::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(floodgate_site::rls::ServeError::Config(e)) => unusable(&e),
        Err(e) => {
            eprintln!("floodgate rls: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The log: one line per record, its message escaped (a control character
/// that came from a request cannot start a line or reach the terminal), and
/// the counts of repeated warnings written every period.
fn init_logger() {
    with_format(&mut env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or("info"),
    ))
    .init();
    let ticker = std::thread::Builder::new()
        .name("floodgate-log".into())
        .spawn(|| loop {
            std::thread::sleep(floodgate::logging::PERIOD);
            floodgate_site::log_kinds::flush();
        });
    if let Err(e) = ticker {
        log::warn!("cannot start the log's counting thread ({e}); held-back warnings are counted on the next line of their kind");
    }
}

/// The command's log lines, as `serve` and `rls` write them (one line each,
/// control characters escaped).
fn with_format(builder: &mut env_logger::Builder) -> &mut env_logger::Builder {
    builder.format(|buf, record| {
        use std::fmt::Write as _;
        use std::io::Write as _;
        let mut message = String::new();
        let _ = write!(
            floodgate::logging::EscapingWriter(&mut message),
            "{}",
            record.args()
        );
        writeln!(
            buf,
            "[{} {:<5} {}] {message}",
            buf.timestamp(),
            record.level(),
            record.target()
        )
    })
}

/// The operator commands log each action they take at `info`, as the admin
/// API's actions are logged: what was done, under which rule, to whom, by
/// whom. Nothing else of the library logs here, so that a failure stays
/// the one line the command prints.
fn init_audit_log() {
    with_format(
        env_logger::Builder::new()
            .filter_level(log::LevelFilter::Off)
            .filter_module(
                "floodgate_limiter::limiter::operator::list",
                log::LevelFilter::Info,
            ),
    )
    .init();
}

fn serve(path: PathBuf) -> ExitCode {
    init_logger();
    let config = match Config::load(&path) {
        Ok(c) => c,
        Err(e) => return unusable(&e),
    };
    let target = floodgate_site::config::redis_target(&config.filter.redis);
    let (bind, rules) = (config.server.bind.clone(), config.filter.rules.len());
    let file = path.display().to_string();
    let result = actix_web::rt::System::new().block_on(async move {
        // (Whether the error stopped the start: a bind address that
        // cannot be listened on is the file's to mend.)
        let app = Application::build(config).map_err(|e| (true, e))?;
        log::info!(
            "floodgate serving {} on {} (port {}), redis {target}, {rules} rules",
            path.display(),
            bind,
            app.port()
        );
        app.run_with_signals()
            .await
            .map_err(|e| (false, site::StartError::Bind(bind.clone(), e)))
    });
    floodgate_site::log_kinds::flush();
    match result {
        Ok(()) => {
            log::info!("stopped");
            ExitCode::SUCCESS
        }
        Err((true, site::StartError::Bind(addr, e))) => {
            unusable(&cannot_listen(Path::new(&file), "[server] bind", &addr, &e))
        }
        Err((_, e)) => {
            eprintln!("floodgate: {e}");
            ExitCode::FAILURE
        }
    }
}
