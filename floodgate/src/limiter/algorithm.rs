//! The algorithms as the limiter runs them: each one's code and
//! parameters on the wire, and when giving units back is safe. What the
//! domain knows of each (its name, quota, window, words, how it is built
//! from a rule's fields) is in `rule/policy.rs`. The Lua of each algorithm
//! is one file that registers itself in `ALGORITHMS` (see
//! `lua/common.lua`); the list of those files is [`lua_with_algorithms!`]
//! below. The local fallback (`local/state.rs`) keeps the same state in
//! memory.
//!
//! A new algorithm: its Lua file (and its line in the macro below), a
//! variant in `rule/policy.rs` with its arms, its arms here, and its state
//! in `local/state.rs`.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::rule::Algorithm;

/// `concat!` of the Lua every script starts with (the shared helpers and
/// every algorithm's file, each registering itself in `ALGORITHMS`), then
/// the given driver files. The one list of the algorithm files.
macro_rules! lua_with_algorithms {
    ($($driver:literal),+) => {
        concat!(
            // The bounds the Rust side checks rules against, written once.
            "local MAX_LIMIT = ",
            $crate::units::max_limit!(),
            "\nlocal MAX_LARGE_LIMIT = ",
            $crate::units::max_large_limit!(),
            "\n",
            include_str!("lua/common.lua"),
            "\n",
            include_str!("lua/sliding_window.lua"),
            "\n",
            include_str!("lua/fixed_window.lua"),
            "\n",
            include_str!("lua/token_bucket.lua"),
            "\n",
            include_str!("lua/gcra.lua"),
            "\n",
            include_str!("lua/sliding_counter.lua"),
            $("\n", include_str!($driver)),+
        )
    };
}

/// One parameter as the scripts read it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Param {
    /// A whole number.
    Whole(u64),
    /// A number with a fraction.
    Real(f64),
}

/// How the limiter sends each algorithm, and when a give-back is safe.
impl Algorithm {
    /// The code and the two parameters the Lua files read (see the
    /// algorithm's own file): 1 sliding window, 2 fixed window, 3 token
    /// bucket, 4 gcra, 5 sliding counter; limit and window in ms, or rate
    /// and burst.
    pub(crate) fn wire(&self) -> (u8, Param, Param) {
        let ms = |d: Duration| Param::Whole(d.as_millis() as u64);
        let n = |l: NonZeroU32| Param::Whole(u64::from(l.get()));
        match *self {
            Algorithm::SlidingWindow { limit, window } => (1, n(limit), ms(window)),
            Algorithm::FixedWindow { limit, window } => (2, n(limit), ms(window)),
            Algorithm::TokenBucket { rate, burst } => (3, Param::Real(rate), n(burst)),
            Algorithm::Gcra { limit, window } => (4, n(limit), ms(window)),
            Algorithm::SlidingCounter { limit, window } => (5, n(limit), ms(window)),
        }
    }

    /// Whether giving back a request's units is still safe, `elapsed`
    /// after its decision was asked for, with `margin` to spare for the
    /// call to reach Redis; `reset` is its allowed outcome's `wait`.
    /// Sliding window: its own entry is still in the window; fixed window:
    /// its window is still open; sliding counter: the fixed window it was
    /// counted in is still the current one (its reset is one window after
    /// that one closes). The bucket and gcra are always safe.
    pub(crate) fn give_back_safe(
        &self,
        elapsed: Duration,
        margin: Duration,
        reset: Duration,
    ) -> bool {
        match *self {
            Algorithm::SlidingWindow { window, .. } => elapsed + margin < window,
            Algorithm::FixedWindow { .. } => elapsed + margin < reset,
            Algorithm::SlidingCounter { window, .. } => elapsed + margin + window < reset,
            Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. } => true,
        }
    }
}
