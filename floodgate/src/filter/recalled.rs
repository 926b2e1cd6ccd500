//! What the other rules held when Redis denied a request of several rules,
//! so that a later denial of the same identities answered from the
//! in-process memory of denials carries their fields too, as a denial
//! Redis answers does.
//!
//! Kept by the request's whole set of keys (the same rules, the same
//! identities), for as long as none of the recorded waits has run out
//! (until then nothing the request could take has come back), in bounded
//! memory: past [`MOST`] entries the map starts afresh. A recalled state is
//! what Redis answered at the denial, its waits shortened by the time
//! since: other requests of the same identities through other paths may
//! have taken more meanwhile, which shows at the next answer from Redis.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use super::lock;
use crate::limiter::{Check, Outcome};

/// The most sets of keys remembered.
const MOST: usize = 4096;

/// See the module's docs.
#[derive(Default)]
pub(crate) struct Recalled {
    states: Mutex<HashMap<String, (Vec<Outcome>, Instant)>>,
}

/// The set of keys of `checks`, in order, as one text.
fn signature(checks: &[Check]) -> String {
    use std::fmt::Write as _;
    let mut text = String::new();
    for c in checks {
        // Length-prefixed: no key can run into the next.
        let _ = write!(text, "{}:{}", c.key().len(), c.key());
    }
    text
}

impl Recalled {
    /// Notes what Redis answered to the denied request of `checks`.
    pub(crate) fn remember(&self, checks: &[Check], outcomes: &[Outcome]) {
        if checks.len() < 2 || outcomes.len() != checks.len() {
            return;
        }
        let mut states = lock(&self.states);
        if states.len() >= MOST {
            states.clear();
        }
        states.insert(signature(checks), (outcomes.to_vec(), Instant::now()));
    }

    /// What the rules of `checks` hold now, as far as the last denial of
    /// the same keys tells, or `None`.
    pub(crate) fn recall(&self, checks: &[Check]) -> Option<Vec<Outcome>> {
        if checks.len() < 2 {
            return None;
        }
        let key = signature(checks);
        let mut states = lock(&self.states);
        let (outcomes, at) = states.get(&key)?;
        let elapsed = at.elapsed();
        if outcomes.iter().any(|o| o.wait <= elapsed) {
            states.remove(&key);
            return None;
        }
        Some(
            outcomes
                .iter()
                .map(|o| Outcome {
                    wait: o.wait - elapsed,
                    ..*o
                })
                .collect(),
        )
    }
}
