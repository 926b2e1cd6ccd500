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

/// GET, or HEAD (answered as GET is, without the body): the methods of a
/// page and of a probe, on the site's listener and the Envoy service's.
pub(crate) fn get_or_head() -> impl actix_web::guard::Guard {
    actix_web::guard::Any(actix_web::guard::Get()).or(actix_web::guard::Head())
}

/// The site's own kinds of repeated warnings.
pub mod log_kinds {
    use floodgate::logging::Repeats;

    /// `/readyz` found Redis away.
    pub static READYZ: Repeats = Repeats::new("readyz", log::Level::Warn);
    /// The site answered an error.
    pub static SITE_ERROR: Repeats = Repeats::new("site error", log::Level::Error);
    /// An admin API request was refused (address not allowed, no or wrong
    /// token): anyone can send these, so they are not one line each.
    pub static ADMIN_REFUSED: Repeats = Repeats::new("admin request refused", log::Level::Warn);
    /// The rate-limit service had as many calls in flight as it reads at
    /// once, and refused one.
    pub static RLS_BUSY: Repeats = Repeats::new("rls call refused", log::Level::Warn);

    /// Writes the counts of repeated warnings held back so far, the
    /// library's and the site's.
    pub fn flush() {
        floodgate::logging::flush();
        for kind in [&READYZ, &SITE_ERROR, &ADMIN_REFUSED, &RLS_BUSY] {
            kind.flush();
        }
    }
}

pub mod admin_http;
pub mod config;
pub mod listings;
pub mod rls;
pub mod site;
