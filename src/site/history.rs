//! Decisions per rule by the minute, over the last hour, as this process
//! counted them: what the operators' page charts. A thread samples the
//! filter's counters at every minute's start; nothing is asked of Redis.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use floodgate::metrics::Metrics;
use serde_json::{json, Map, Value};

/// Samples kept: an hour of minutes, and the one before it.
const KEEP: usize = 61;

/// Each rule's decisions so far, at the start of a minute.
type Sample = (u64, Vec<(String, u64)>);

/// The samples, oldest first.
pub struct History {
    metrics: Arc<Metrics>,
    samples: Mutex<VecDeque<Sample>>,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl History {
    /// A history of `metrics`, sampled now and at every minute's start
    /// until the history is dropped.
    pub fn start(metrics: Arc<Metrics>) -> Arc<History> {
        let history = Arc::new(History {
            samples: Mutex::new(VecDeque::from([(
                now_secs() / 60,
                metrics.decisions_by_rule(),
            )])),
            metrics,
        });
        let weak: Weak<History> = Arc::downgrade(&history);
        let started = std::thread::Builder::new()
            .name("floodgate-history".to_owned())
            .spawn(move || loop {
                let next = (now_secs() / 60 + 1) * 60;
                std::thread::sleep(Duration::from_secs(next.saturating_sub(now_secs()).max(1)));
                let Some(history) = weak.upgrade() else {
                    return;
                };
                history.sample();
            });
        if let Err(e) = started {
            log::warn!("cannot start the decisions history ({e}); the operators' page charts only the current minute");
        }
        history
    }

    fn sample(&self) {
        let totals = self.metrics.decisions_by_rule();
        let mut samples = match self.samples.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        samples.push_back((now_secs() / 60, totals));
        while samples.len() > KEEP {
            samples.pop_front();
        }
    }

    /// `{"minutes":[UNIX_MINUTE...],"rules":{"NAME":[DECISIONS...]}}`: the
    /// decisions of each minute sampled, the current one (so far) last.
    pub fn json(&self) -> Value {
        let mut points: Vec<Sample> = match self.samples.lock() {
            Ok(s) => s.iter().cloned().collect(),
            Err(p) => p.into_inner().iter().cloned().collect(),
        };
        points.push((now_secs() / 60 + 1, self.metrics.decisions_by_rule()));
        let total = |sample: &Sample, rule: &str| {
            sample
                .1
                .iter()
                .find(|(r, _)| r == rule)
                .map_or(0, |(_, n)| *n)
        };
        let mut names: Vec<&str> = points
            .iter()
            .flat_map(|(_, rules)| rules.iter().map(|(r, _)| r.as_str()))
            .collect();
        names.sort_unstable();
        names.dedup();
        let minutes: Vec<u64> = points.windows(2).map(|w| w[0].0).collect();
        let mut rules = Map::new();
        for name in names {
            let counts: Vec<u64> = points
                .windows(2)
                .map(|w| total(&w[1], name).saturating_sub(total(&w[0], name)))
                .collect();
            rules.insert(name.to_string(), json!(counts));
        }
        json!({ "minutes": minutes, "rules": rules })
    }
}
