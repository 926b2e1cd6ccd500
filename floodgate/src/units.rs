//! The leaf every layer reads: the bounds of what a rule can say (the Lua
//! scripts read the same numbers, from here), and units as the file writes
//! them: durations (`250ms`, `10s`, `1m`, `1h`, `1d`), sizes (`16KiB`), and
//! the words messages use for them.

use std::time::Duration;

/// Largest `limit` of a sliding-window log or fixed window (and a token
/// bucket's burst), as a literal: the Lua scripts are given it too.
macro_rules! max_limit {
    () => {
        100000
    };
}
pub(crate) use max_limit;

/// Largest `limit` of the algorithms whose state does not grow with it
/// (gcra, sliding counter), as a literal for the Lua scripts too.
macro_rules! max_large_limit {
    () => {
        1000000000
    };
}
pub(crate) use max_large_limit;

/// Largest `limit` a sliding-window log or fixed window may have (and a
/// token bucket's burst); gcra and the sliding counter take up to
/// [`MAX_LARGE_LIMIT`].
pub const MAX_LIMIT: u32 = max_limit!();

/// Largest `limit` of gcra and the sliding counter.
pub const MAX_LARGE_LIMIT: u32 = max_large_limit!();

/// Longest window, and longest time a token bucket may take to refill from empty.
pub const MAX_WINDOW: Duration = Duration::from_secs(366 * 86_400);

/// Largest token bucket `rate`, in tokens per second.
pub const MAX_RATE: f64 = 1_000_000.0;

/// Most connections in the pool (`[redis] pool_size`).
pub(crate) const MAX_POOL_SIZE: u32 = 1024;

/// Fewest connections the pool may have. The limiter's own connections
/// (one per worker and per dispatcher thread) are outside it; the pool
/// serves the site, `/readyz`, give-backs and `/limits`, and below 3 one
/// call stalled until the timeout holds up the rest.
pub(crate) fn min_pool_size() -> u32 {
    3
}

/// Longest `[redis] timeout`.
pub(crate) const MAX_REDIS_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest `[limiter] breaker`.
pub(crate) const MAX_BREAKER: Duration = Duration::from_secs(600);

/// Longest `error_page`.
pub(crate) const MAX_ERROR_PAGE: usize = 256;

/// "10 seconds", "minute", "10 minutes", "hour", "1500 ms".
pub fn human_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (one, many, size) in [
        ("day", "days", 86_400_000),
        ("hour", "hours", 3_600_000),
        ("minute", "minutes", 60_000),
        ("second", "seconds", 1000),
    ] {
        if ms >= size && ms.is_multiple_of(size) {
            let n = ms / size;
            return if n == 1 {
                one.to_string()
            } else {
                format!("{n} {many}")
            };
        }
    }
    format!("{ms} ms")
}

/// An operator's length of time (a ban's, an override's window or
/// lifetime), named `what` in the refusal: more than 0, at most
/// [`MAX_WINDOW`].
pub(crate) fn check_operator_length(what: &str, d: Duration) -> Result<(), String> {
    if d.is_zero() {
        return Err(format!("{what} must be greater than 0"));
    }
    if d > MAX_WINDOW {
        return Err(format!(
            "{what} must be at most {}, got {}",
            amount_of_time(MAX_WINDOW),
            amount_of_time(d)
        ));
    }
    Ok(())
}

/// "366 days", "1 minute", "10 minutes", "1500 ms".
pub(crate) fn amount_of_time(d: Duration) -> String {
    let words = human_duration(d);
    if words.starts_with(|c: char| c.is_ascii_digit()) {
        words
    } else {
        format!("1 {words}")
    }
}

/// Parses `"250ms"`, `"10s"`, `"1m"`, `"10m"`, `"1h"`, `"1d"`. A number too
/// large to count in milliseconds is refused, never wrapped.
#[cfg(test)]
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    match parse_duration_ms(text) {
        Ok(ms) => Ok(Duration::from_millis(ms)),
        Err(DurationError::Invalid) => Err(invalid_duration(text)),
        Err(DurationError::TooLong) => Err(format!("duration {text:?} is too long")),
    }
}

/// Why a duration did not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DurationError {
    /// Not a whole number and a unit.
    Invalid,
    /// More milliseconds than a u64 holds.
    TooLong,
}

pub(crate) fn invalid_duration(text: &str) -> String {
    format!(
        "invalid duration {text:?}: expected a whole number followed by ms, s, m, h or d, like \"250ms\" or \"10s\""
    )
}

pub(crate) fn parse_duration_ms(text: &str) -> Result<u64, DurationError> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit())
        .ok_or(DurationError::Invalid)?;
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(DurationError::Invalid);
    }
    let size: u64 = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(DurationError::Invalid),
    };
    // Only digits are left, so a failed parse is an overflow.
    let n: u64 = num.parse().map_err(|_| DurationError::TooLong)?;
    n.checked_mul(size).ok_or(DurationError::TooLong)
}

/// Why a duration setting was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SettingError {
    /// Not a duration at all: the parse error.
    Invalid(String),
    /// A duration outside the setting's range: "must be ...".
    Range(String),
}

impl SettingError {
    /// The message alone (the setting is named by the place).
    pub(crate) fn text(self) -> String {
        match self {
            SettingError::Invalid(w) | SettingError::Range(w) => w,
        }
    }
}

/// A duration setting: greater than 0 and at most `max`.
pub(crate) fn duration_setting(text: &str, max: Duration) -> Result<Duration, SettingError> {
    let too_long = || {
        SettingError::Range(format!(
            "must be at most {}, got {text:?}",
            amount_of_time(max)
        ))
    };
    match parse_duration_ms(text) {
        Err(DurationError::Invalid) => Err(SettingError::Invalid(invalid_duration(text))),
        Err(DurationError::TooLong) => Err(too_long()),
        Ok(0) => Err(SettingError::Range("must be greater than 0".into())),
        Ok(ms) if Duration::from_millis(ms) > max => Err(too_long()),
        Ok(ms) => Ok(Duration::from_millis(ms)),
    }
}

/// A duration as messages show it: `"10s"`, `"1500ms"`, or `"1.5ms"` when
/// it is not whole milliseconds.
pub(crate) fn written_duration(d: Duration) -> String {
    if d.subsec_nanos().is_multiple_of(1_000_000) && d.as_millis() > 0 {
        format_duration(d)
    } else {
        format!("{d:?}")
    }
}

/// Formats a duration the way the config writes it (`10s`, `1m`, `250ms`).
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// Largest `max_form`: 64 MiB.
pub(crate) const MAX_FORM: usize = 64 * 1024 * 1024;

/// Parses a size: `"16KiB"`, `"1MiB"`, `"4096"`, `"64KB"`; 1 byte to 64MiB.
pub(crate) fn parse_size(text: &str) -> Result<usize, String> {
    let bad = || format!("invalid size {text:?}: expected a number with B, KiB, MiB, KB or MB");
    let range = || format!("must be between 1 byte and 64MiB, got {text:?}");
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(bad());
    }
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1024,
        "MiB" => 1024 * 1024,
        "KB" | "kB" => 1000,
        "MB" => 1_000_000,
        _ => return Err(bad()),
    };
    // Only digits are left, so a failed parse is an overflow.
    let n: u64 = num.parse().map_err(|_| range())?;
    let size = n.checked_mul(mult).ok_or_else(range)?;
    if size == 0 || size > MAX_FORM as u64 {
        return Err(range());
    }
    usize::try_from(size).map_err(|_| range())
}
