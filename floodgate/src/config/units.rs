//! Units as the file writes them: durations (`250ms`, `10s`, `1m`, `1h`,
//! `1d`), sizes (`16KiB`), and the words messages use for them.

use std::time::Duration;

pub(super) use crate::rule::amount_of_time;
pub use crate::rule::human_duration;

/// Parses `"250ms"`, `"10s"`, `"1m"`, `"10m"`, `"1h"`, `"1d"`. A number too
/// large to count in milliseconds is refused, never wrapped.
#[cfg(test)]
pub(super) fn parse_duration(text: &str) -> Result<Duration, String> {
    match parse_duration_ms(text) {
        Ok(ms) => Ok(Duration::from_millis(ms)),
        Err(DurationError::Invalid) => Err(invalid_duration(text)),
        Err(DurationError::TooLong) => Err(format!("duration {text:?} is too long")),
    }
}

/// Why a duration did not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DurationError {
    /// Not a whole number and a unit.
    Invalid,
    /// More milliseconds than a u64 holds.
    TooLong,
}

pub(super) fn invalid_duration(text: &str) -> String {
    format!(
        "invalid duration {text:?}: expected a whole number followed by ms, s, m, h or d, like \"250ms\" or \"10s\""
    )
}

pub(super) fn parse_duration_ms(text: &str) -> Result<u64, DurationError> {
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
pub(super) enum SettingError {
    /// Not a duration at all: the parse error.
    Invalid(String),
    /// A duration outside the setting's range: "must be ...".
    Range(String),
}

impl SettingError {
    /// The message alone (the setting is named by the place).
    pub(super) fn text(self) -> String {
        match self {
            SettingError::Invalid(w) | SettingError::Range(w) => w,
        }
    }
}

/// A duration setting: greater than 0 and at most `max`.
pub(super) fn duration_setting(text: &str, max: Duration) -> Result<Duration, SettingError> {
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

/// Parses a size: `"16KiB"`, `"1MiB"`, `"4096"`, `"64KB"`; 1 byte to 64MiB.
pub fn parse_size(text: &str) -> Result<usize, String> {
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
    if size == 0 || size > 64 * 1024 * 1024 {
        return Err(range());
    }
    usize::try_from(size).map_err(|_| range())
}
