//! The floodgate demo site as a library, so that the `floodgate` command
//! and the tests (tests/api, tests/browser) share it: sign-in with SMS
//! codes and passwords, a dashboard, all guarded by the `floodgate` filter
//! through its public API only.
#![forbid(unsafe_code)]

/// Writes a line of a kind of warning that traffic can repeat (see
/// [`floodgate::logging::Repeats`]): `repeated!(&KIND, "format", args...)`.
macro_rules! repeated {
    ($kind:expr, $($arg:tt)+) => {{
        let kind: &floodgate::logging::Repeats = $kind;
        if log::log_enabled!(kind.level()) {
            if let Some(admitted) = kind.admit() {
                log::log!(kind.level(), "{}{}", format_args!($($arg)+), admitted);
            }
        }
    }};
}
pub(crate) use repeated;

pub mod config;
pub mod rls;
pub mod site;
