//! What the crate writes to the log, and how: text that comes from a
//! request is escaped, and a warning that traffic can repeat is written at
//! most once per [`PERIOD`] per kind, with the count of the ones held back.
//!
//! **Escaping.** [`Escaped`] shows a string with its control characters
//! (newline, carriage return, escape, NUL, DEL, the C1 controls) and the
//! Unicode line separators and direction overrides as escapes (`\n`,
//! `\x1b`, `\u{202e}`), and a backslash as `\\`: a path like `/a%0Aforged`
//! (decoded to a newline) cannot start a line of its own or repaint the
//! terminal, and an escape in the log always means one in the request.
//! [`EscapingWriter`] escapes the control characters (not the backslashes,
//! so that what [`Escaped`] wrote is not escaped twice) of everything
//! written through it: the binary's logger writes every message through
//! one, so no message, whoever wrote it, can split a line.
//!
//! **Repeats.** A warning of one kind (Redis failed, no decision, a
//! give-back failed, ...) is written when the kind has written nothing for
//! [`PERIOD`]; the ones in between are counted, and the next line of the
//! kind says how many it stands for ("and 199 more like it in the last
//! 10s"). [`flush`] writes the counts still held (the binary calls it every
//! period and when it stops). Deciding costs two atomic operations, no
//! lock and no allocation.

use std::fmt::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// At most one line per kind of repeated warning in this time.
#[doc(hidden)] // the floodgate binary's, not part of the API
pub const PERIOD: Duration = Duration::from_secs(10);

/// Shows a string with control characters escaped (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        escape_into(f, self.0, true)
    }
}

/// Whether `c` is written as an escape (besides the backslash).
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// Writes `s` to `out` with control characters escaped, and backslashes
/// too when `backslash`.
pub(crate) fn escape_into(out: &mut impl Write, s: &str, backslash: bool) -> fmt::Result {
    let mut rest = s;
    while let Some(at) = rest.find(|c| needs_escape(c) || (backslash && c == '\\')) {
        out.write_str(&rest[..at])?;
        let Some(c) = rest[at..].chars().next() else {
            break;
        };
        match c {
            '\n' => out.write_str("\\n")?,
            '\r' => out.write_str("\\r")?,
            '\t' => out.write_str("\\t")?,
            '\\' => out.write_str("\\\\")?,
            c if (c as u32) < 0x80 => write!(out, "\\x{:02x}", c as u32)?,
            c => write!(out, "\\u{{{:x}}}", c as u32)?,
        }
        rest = &rest[at + c.len_utf8()..];
    }
    out.write_str(rest)
}

/// A [`Write`] that escapes everything written through it.
pub struct EscapingWriter<W>(pub W);

impl<W: Write> Write for EscapingWriter<W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        escape_into(&mut self.0, s, false)
    }
}

fn now_us() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// One kind of warning that traffic can repeat.
#[derive(Debug)]
#[doc(hidden)] // the floodgate binary's, not part of the API
pub struct Repeats {
    /// What the kind is about, for the line [`flush`] writes.
    what: &'static str,
    level: log::Level,
    /// µs (process clock) before which no line of this kind is written.
    next: AtomicU64,
    /// When the last line of this kind (or its count) was written.
    last: AtomicU64,
    /// Warnings held back since then.
    held: AtomicU64,
}

/// What [`Repeats::admit`] says: write the line, and how many it stands
/// for besides itself, over how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[doc(hidden)] // the floodgate binary's, not part of the API
pub struct Admitted {
    /// Warnings of the kind held back since the last line.
    pub held: u64,
    /// Since the last line of the kind.
    pub since: Duration,
}

impl fmt::Display for Admitted {
    /// Empty when nothing was held back, else " (and N more like it in the last Ts)".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.held == 0 {
            return Ok(());
        }
        write!(
            f,
            " (and {} more like it in the last {}s)",
            self.held,
            self.since.as_secs().max(1)
        )
    }
}

impl Repeats {
    /// A kind of warning written at `level`.
    pub const fn new(what: &'static str, level: log::Level) -> Repeats {
        Repeats {
            what,
            level,
            next: AtomicU64::new(0),
            last: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// The level its lines are written at.
    pub fn level(&self) -> log::Level {
        self.level
    }

    /// `Some` when a line of this kind is to be written now, `None` when
    /// it is held back (and counted).
    pub fn admit(&self) -> Option<Admitted> {
        let now = now_us();
        let next = self.next.load(Ordering::Acquire);
        if now >= next
            && self
                .next
                .compare_exchange(
                    next,
                    now + PERIOD.as_micros() as u64,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
        {
            let held = self.held.swap(0, Ordering::AcqRel);
            let last = self.last.swap(now, Ordering::AcqRel);
            return Some(Admitted {
                held,
                since: Duration::from_micros(now.saturating_sub(last)),
            });
        }
        self.held.fetch_add(1, Ordering::AcqRel);
        None
    }

    /// Writes the count held back, if any.
    /// Writes the count of lines held back, if any, and starts counting
    /// again.
    pub fn flush(&self) {
        let held = self.held.swap(0, Ordering::AcqRel);
        if held == 0 {
            return;
        }
        let now = now_us();
        let last = self.last.swap(now, Ordering::AcqRel);
        let since = Duration::from_micros(now.saturating_sub(last));
        log::log!(
            self.level,
            "{held} more \"{}\" lines in the last {}s",
            self.what,
            since.as_secs().max(1)
        );
    }
}

/// Writes a line of a kind of warning that traffic can repeat (see
/// [`Repeats`]): `repeated!(&KIND, "format", args...)`.
#[doc(hidden)]
macro_rules! repeated {
    ($kind:expr, $($arg:tt)+) => {{
        let kind: &$crate::logging::Repeats = $kind;
        if log::log_enabled!(kind.level()) {
            if let Some(admitted) = kind.admit() {
                log::log!(kind.level(), "{}{}", format_args!($($arg)+), admitted);
            }
        }
    }};
}
pub(crate) use repeated;

/// Redis failed a batch of decisions.
pub(crate) static REDIS_FAILED: Repeats = Repeats::new("redis error", log::Level::Warn);
/// The breaker opened.
pub(crate) static BREAKER: Repeats = Repeats::new("breaker open", log::Level::Warn);
/// A request got no decision from Redis (error, timeout, breaker,
/// overload) and its error policy applied.
pub(crate) static NO_DECISION: Repeats = Repeats::new("no decision", log::Level::Warn);
/// Units could not be given back.
pub(crate) static GIVE_BACK_FAILED: Repeats =
    Repeats::new("could not give back units", log::Level::Warn);
/// A key function chose a quota its rule cannot have.
pub(crate) static BAD_QUOTA: Repeats = Repeats::new("unusable quota", log::Level::Warn);
/// The connection pool could not open or check a connection.
pub(crate) static REDIS_CONNECTION: Repeats = Repeats::new("redis connection", log::Level::Warn);

static ALL: [&Repeats; 6] = [
    &REDIS_FAILED,
    &BREAKER,
    &NO_DECISION,
    &GIVE_BACK_FAILED,
    &BAD_QUOTA,
    &REDIS_CONNECTION,
];

/// Writes the counts of repeated warnings held back so far: call it now and
/// then (every [`PERIOD`]) and before the process exits.
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn flush() {
    for kind in ALL {
        kind.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_and_backslashes_are_escaped() {
        let shown = Escaped("/a\nforged\r\x1b[31m\\n\u{7f}\u{85}\u{202e}é\t").to_string();
        assert_eq!(
            shown,
            "/a\\nforged\\r\\x1b[31m\\\\n\\x7f\\u{85}\\u{202e}é\\t"
        );
        assert_eq!(Escaped("/plain/path?q=1").to_string(), "/plain/path?q=1");
        let mut out = String::new();
        let newline = String::from("\n");
        write!(EscapingWriter(&mut out), "x{newline}y{}", Escaped("\n")).unwrap();
        assert_eq!(out, "x\\ny\\n", "what Escaped wrote is not escaped twice");
    }

    #[test]
    fn a_repeated_warning_is_admitted_once_per_period_and_counted() {
        let kind = Repeats::new("test", log::Level::Warn);
        assert_eq!(kind.admit().map(|a| a.held), Some(0));
        for _ in 0..99 {
            assert_eq!(kind.admit(), None);
        }
        assert_eq!(kind.held.load(Ordering::Relaxed), 99);
        // As if the period had run out.
        kind.next.store(0, Ordering::Relaxed);
        let admitted = kind.admit().unwrap();
        assert_eq!(admitted.held, 99);
        assert!(
            admitted.to_string().contains("99 more like it"),
            "{admitted}"
        );
        kind.flush();
        assert_eq!(kind.held.load(Ordering::Relaxed), 0);
    }
}
