//! `ShouldRateLimit` over the library's [`Limiter`]: a call's descriptors
//! become one check per matched limit, decided in one atomic Redis call
//! (all charged, or none), batched with other calls' by the limiter. The
//! answer follows envoyproxy/ratelimit's: statuses in order, each with the
//! limit it matched, what is left and when it resets.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use floodgate::gate::{self, Fallback, Named, Partial, Remembered, Verdict};
use floodgate::limiter::Limiter;
use floodgate::limiter::{Action, Check, Decision, LimiterError, Outcome};
use floodgate::metrics::Metrics;
use floodgate::rule::HeaderDialect;
use floodgate::rule::{Algorithm, OnRedisError, Penalty};

use super::config::{OnError, Settings};
use super::descriptors::{algorithm_for, unit_length, unit_of};
use super::matcher::{own_key, state_key, Matcher};
use super::proto::{
    Code, DescriptorStatus, Handler, HeaderValue, RateLimit, RateLimitDescriptor, RateLimitRequest,
    RateLimitResponse, Unit,
};

/// Most hits one call may ask for, per descriptor.
pub const MAX_HITS: u64 = 1_000_000_000;

/// The most descriptors one call may bring, and entries one descriptor may
/// have: Envoy sends a few of each. A larger call is refused
/// (`INVALID_ARGUMENT`) rather than run long in Redis past the timeout,
/// where its answer would be UNAVAILABLE and the breaker would open for
/// every client.
pub const MAX_DESCRIPTORS: usize = 256;
/// See [`MAX_DESCRIPTORS`].
pub const MAX_ENTRIES: usize = 64;

/// The longest name a limit that a call brings for a descriptor no file
/// names is shown and counted under (its domain and keys, which come from
/// the call): a longer one keeps its first bytes and a hash of the whole.
const MAX_NAME_BYTES: usize = 96;

/// How a call was answered, as `/metrics` counts it.
#[derive(Debug, Clone, Copy)]
enum Answer {
    InvalidArgument,
    Ok,
    OverLimit,
    Unavailable,
}

impl Answer {
    /// Every answer, in the order of `CallCounts`'s counters.
    const ALL: [Answer; 4] = [
        Answer::InvalidArgument,
        Answer::Ok,
        Answer::OverLimit,
        Answer::Unavailable,
    ];

    /// Its `code` label.
    fn code(self) -> &'static str {
        match self {
            Answer::InvalidArgument => "INVALID_ARGUMENT",
            Answer::Ok => "OK",
            Answer::OverLimit => "OVER_LIMIT",
            Answer::Unavailable => "UNAVAILABLE",
        }
    }
}

/// Calls answered, by domain and answer, for `/metrics`. Only the domains
/// of the descriptor files are counted by name (the others under `""`), so
/// the map stays as small as the files; a call counts with one atomic add
/// under a shared lock.
#[derive(Debug, Default)]
pub struct CallCounts(RwLock<HashMap<String, [AtomicU64; 4]>>);

impl CallCounts {
    fn count(&self, domain: &str, answer: Answer) {
        {
            let map = match self.0.read() {
                Ok(m) => m,
                Err(p) => p.into_inner(),
            };
            if let Some(counts) = map.get(domain) {
                counts[answer as usize].fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let mut map = match self.0.write() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        map.entry(domain.to_string()).or_default()[answer as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// `floodgate_rls_calls_total{domain,code}` in Prometheus text.
    pub fn render(&self) -> String {
        // Two domains may read alike once made printable: one series each.
        let mut series: BTreeMap<(String, &'static str), u64> = BTreeMap::new();
        {
            let map = match self.0.read() {
                Ok(m) => m,
                Err(p) => p.into_inner(),
            };
            for (domain, counts) in map.iter() {
                for answer in Answer::ALL {
                    let n = counts[answer as usize].load(Ordering::Relaxed);
                    if n > 0 {
                        *series.entry((label(domain), answer.code())).or_default() += n;
                    }
                }
            }
        }
        let mut out = String::from(
            "# HELP floodgate_rls_calls_total ShouldRateLimit calls by domain and answer.\n\
             # TYPE floodgate_rls_calls_total counter\n",
        );
        for ((domain, code), n) in series.iter() {
            out.push_str(&format!(
                "floodgate_rls_calls_total{{domain=\"{domain}\",code=\"{code}\"}} {n}\n"
            ));
        }
        out
    }
}

/// A label value Prometheus can read: no quote, backslash or line break.
pub fn label(text: &str) -> String {
    text.chars().map(printable).collect()
}

fn printable(c: char) -> char {
    match c {
        '"' | '\\' => '_',
        c if c.is_control() => '_',
        c => c,
    }
}

/// [`label`] of a text already owned: kept as it is when nothing in it
/// needs replacing (the common case, with no copy).
fn into_label(text: String) -> String {
    if text.chars().all(|c| printable(c) == c) {
        text
    } else {
        label(&text)
    }
}

/// The service: the limiter, the compiled descriptor files (swapped on
/// reload) and the settings.
#[derive(Debug)]
pub struct Rls {
    /// Decides the checks.
    pub limiter: Arc<Limiter>,
    /// Decisions per limit.
    pub metrics: Arc<Metrics>,
    /// Calls per domain and code.
    pub calls: CallCounts,
    /// The descriptor files in force.
    pub matcher: RwLock<Arc<Matcher>>,
    /// `[rls]`.
    pub settings: Settings,
    /// `[redis] key_prefix`.
    pub prefix: String,
}

/// One limit as it applies to one descriptor of a call (its names borrowed
/// from the descriptor files in force, or from the call).
struct Applied<'a> {
    name: Cow<'a, str>,
    metric: String,
    key: String,
    requests_per_unit: u32,
    unit: Unit,
    /// The window in force: the limit's, or an operator's override's once
    /// Redis (or the denial cache) answered under one.
    window: Duration,
    algorithm: Option<Algorithm>,
    unlimited: bool,
    shadow: bool,
    replaces: &'a [String],
    /// A limit the call brought for this descriptor: no `replaces` removes
    /// it (envoyproxy/ratelimit gives it no name to be named by).
    own: bool,
    /// The hits this descriptor asks for; on the first of several
    /// descriptors that count on one key, the hits of them all.
    hits: u32,
    penalty: Option<Penalty>,
    /// The first descriptor of the call that counts on the same key, by
    /// the same limit: this one is decided with it, as one check of their
    /// summed hits (two checks on one key would each see the count before
    /// the call, and together take more than the limit holds), and
    /// answered as it is.
    twin: Option<usize>,
}

impl Applied<'_> {
    /// Whether no amount of waiting lets this limit take the hits
    /// (`requests_per_unit: 0`, or more hits than the limit holds).
    fn never(&self) -> bool {
        !self.unlimited && self.algorithm.is_none_or(|a| self.hits > a.quota())
    }

    fn current(&self) -> RateLimit {
        RateLimit {
            name: self.name.to_string(),
            requests_per_unit: self.requests_per_unit,
            unit: self.unit as i32,
        }
    }
}

/// Marks every descriptor that counts on the key of an earlier one, by the
/// same limit (same key, algorithm and kind), as its twin, and adds its
/// hits to the earlier one's.
fn join_twins(applied: &mut [Option<Applied<'_>>]) {
    for i in 1..applied.len() {
        let Some(a) = &applied[i] else { continue };
        let first = applied[..i].iter().position(|b| {
            b.as_ref().is_some_and(|b| {
                b.twin.is_none()
                    && b.key == a.key
                    && b.algorithm == a.algorithm
                    && (b.unlimited, b.shadow) == (a.unlimited, a.shadow)
            })
        });
        let Some(j) = first else { continue };
        let hits = a.hits;
        if let Some(b) = &mut applied[j] {
            b.hits = b.hits.saturating_add(hits);
        }
        if let Some(a) = &mut applied[i] {
            a.twin = Some(j);
        }
    }
}

/// `name` as the text of a structured field's string: printable ASCII
/// only, without `"` or `\` (each other character becomes `_`), so that a
/// name from a call can never break the field or the header.
fn sf_text(name: &str) -> Cow<'_, str> {
    // (What a metric label keeps, and ASCII only.)
    let fits = |c: char| c.is_ascii() && printable(c) == c;
    if name.chars().all(fits) {
        Cow::Borrowed(name)
    } else {
        Cow::Owned(
            name.chars()
                .map(|c| if fits(c) { c } else { '_' })
                .collect(),
        )
    }
}

/// `text` (a name made from a call) kept to [`MAX_NAME_BYTES`]: a longer
/// one keeps its first bytes, then `~` and a hash of the whole.
fn bounded(text: String) -> String {
    if text.len() <= MAX_NAME_BYTES {
        return text;
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(text.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let mut end = MAX_NAME_BYTES - hex.len() - 1;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}~{hex}", &text[..end])
}

/// `DOMAIN.KEY1.KEY2...` of a request descriptor: what a limit the call
/// brings for a descriptor that matches no node is named and counted under
/// in metrics.
fn descriptor_key(domain: &str, d: &RateLimitDescriptor) -> String {
    let mut key = String::from(domain);
    for e in &d.entries {
        key.push('.');
        key.push_str(&e.key);
    }
    key
}

/// Why a call is refused, or `None`.
fn invalid(req: &RateLimitRequest) -> Option<String> {
    if req.domain.is_empty() {
        return Some("the domain must not be empty".into());
    }
    if req.descriptors.is_empty() {
        return Some("the call has no descriptors".into());
    }
    if req.descriptors.len() > MAX_DESCRIPTORS {
        return Some(format!(
            "the call has {} descriptors, more than {MAX_DESCRIPTORS}",
            req.descriptors.len()
        ));
    }
    if u64::from(req.hits_addend) > MAX_HITS {
        return Some(format!(
            "hits_addend {} is above {MAX_HITS}",
            req.hits_addend
        ));
    }
    for (i, d) in req.descriptors.iter().enumerate() {
        if d.entries.len() > MAX_ENTRIES {
            return Some(format!(
                "descriptor {i} has {} entries, more than {MAX_ENTRIES}",
                d.entries.len()
            ));
        }
        if let Some((j, _)) = d.entries.iter().enumerate().find(|(_, e)| e.key.is_empty()) {
            return Some(format!(
                "descriptor {i}, entry {j}: the key must not be empty"
            ));
        }
        if let Some(h) = d.hits_addend {
            if h.value > MAX_HITS {
                return Some(format!(
                    "descriptor {i}: hits_addend {} is above {MAX_HITS}",
                    h.value
                ));
            }
        }
    }
    None
}

/// An answer given without Redis's word.
fn bare_status(a: &Applied<'_>, code: Code) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        current_limit: Some(a.current()),
        limit_remaining: 0,
        duration_until_reset: None,
    }
}

fn no_limit() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        current_limit: None,
        limit_remaining: 0,
        duration_until_reset: None,
    }
}

impl Rls {
    /// The descriptor files in force now.
    pub fn matcher(&self) -> Arc<Matcher> {
        match self.matcher.read() {
            Ok(m) => Arc::clone(&m),
            Err(p) => Arc::clone(&p.into_inner()),
        }
    }

    /// The limits a call's descriptors get, one slot per descriptor;
    /// `known`: the call's domain is in the descriptor files.
    fn apply<'a>(
        &self,
        matcher: &'a Matcher,
        req: &'a RateLimitRequest,
        known: bool,
    ) -> Vec<Option<Applied<'a>>> {
        if !known {
            // An unknown domain: no limit, not even a descriptor's own.
            return req.descriptors.iter().map(|_| None).collect();
        }
        let hash_tags = self.limiter.hash_tags();
        let request_hits = req.hits_addend.max(1);
        let mut applied: Vec<Option<Applied>> = req
            .descriptors
            .iter()
            .map(|d| {
                let hits = match d.hits_addend {
                    Some(h) => u32::try_from(h.value.max(1)).unwrap_or(u32::MAX),
                    None => request_hits,
                };
                let matched = matcher.find(&req.domain, &d.entries);
                let own = d.limit.and_then(|l| {
                    let unit = Unit::try_from(l.unit).ok()?;
                    Some((l.requests_per_unit, unit, unit_length(unit)?))
                });
                if let Some((rpu, unit, window)) = own {
                    // The descriptor's own limit replaces the configured one
                    // (past 10^9 it is 10^9, the most any algorithm counts,
                    // and `current_limit` says so).
                    let rpu = rpu.min(MAX_HITS as u32);
                    let (name, metric, values) = match matched {
                        Some(m) => (Cow::Borrowed(m.limit.name.as_str()), m.metric, m.values),
                        // Named, shown and counted in metrics under its
                        // domain and keys alone (bounded): values come from
                        // traffic, and would make a series each. In Redis
                        // it counts per value, the values being the ID.
                        None => {
                            let keys = bounded(descriptor_key(&req.domain, d));
                            let values = d.entries.iter().map(|e| e.value.as_str()).collect();
                            (Cow::Owned(keys.clone()), keys, values)
                        }
                    };
                    let algorithm = NonZeroU32::new(rpu).and_then(|n| {
                        algorithm_for(None, &self.settings.algorithm, n, window).ok()
                    });
                    // Its own counter, apart from the configured limit's
                    // and from other own limits' (each algorithm's state
                    // holds its numbers): NAME~LIMIT/UNIT, of a kind of
                    // its own.
                    let counter = format!("{name}~{rpu}/{}", unit.name().to_lowercase());
                    return Some(Applied {
                        key: own_key(hash_tags, &self.prefix, &counter, &values),
                        name,
                        metric: into_label(metric),
                        requests_per_unit: rpu,
                        unit,
                        window,
                        algorithm,
                        unlimited: false,
                        shadow: self.settings.shadow,
                        replaces: &[],
                        own: true,
                        hits,
                        penalty: None,
                        twin: None,
                    });
                }
                let m = matched?;
                let l = m.limit;
                Some(Applied {
                    key: state_key(hash_tags, &self.prefix, &l.name, &m.values),
                    name: Cow::Borrowed(l.name.as_str()),
                    metric: into_label(m.metric),
                    requests_per_unit: l.requests_per_unit,
                    unit: l.unit,
                    window: l.window,
                    algorithm: l.algorithm,
                    unlimited: l.unlimited,
                    shadow: l.shadow || self.settings.shadow,
                    replaces: &l.replaces,
                    own: false,
                    hits,
                    penalty: l.penalty,
                    twin: None,
                })
            })
            .collect();
        let replaced: HashSet<&str> = applied
            .iter()
            .flatten()
            .flat_map(|a| a.replaces.iter().map(String::as_str))
            .collect();
        if !replaced.is_empty() {
            for slot in &mut applied {
                if slot
                    .as_ref()
                    .is_some_and(|a| !a.own && replaced.contains(a.name.as_ref()))
                {
                    *slot = None;
                }
            }
        }
        join_twins(&mut applied);
        applied
    }

    /// Answers one call.
    pub async fn answer(&self, req: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        let started = Instant::now();
        let matcher = self.matcher();
        // Counted under its domain when the files have it; any other name
        // (a client's typo, or garbage) under "", so that the series stay few.
        let known = matcher.has_domain(&req.domain);
        let domain = if known { req.domain.as_str() } else { "" };
        if let Some(why) = invalid(&req) {
            self.calls.count(domain, Answer::InvalidArgument);
            return Err(tonic::Status::invalid_argument(why));
        }
        let mut applied = self.apply(&matcher, &req, known);
        let result = self.decide(&mut applied).await;
        let took = started.elapsed();
        if log::log_enabled!(log::Level::Debug) {
            let answer = match &result {
                Ok(r) if r.overall_code == Code::OverLimit as i32 => "OVER_LIMIT".to_string(),
                Ok(_) => "OK".to_string(),
                Err(status) => format!("{:?}", status.code()),
            };
            let limits: Vec<&str> = applied
                .iter()
                .flatten()
                .map(|a| a.metric.as_str())
                .collect();
            log::debug!(
                "rls: domain {} limits [{}]: {answer} in {took:?}",
                floodgate::logging::Escaped(&req.domain),
                floodgate::logging::Escaped(&limits.join(", "))
            );
        }
        match result {
            Ok(response) => {
                let answer = if response.overall_code == Code::OverLimit as i32 {
                    Answer::OverLimit
                } else {
                    Answer::Ok
                };
                self.calls.count(domain, answer);
                Ok(response)
            }
            Err(status) => {
                self.calls.count(domain, Answer::Unavailable);
                Err(status)
            }
        }
    }

    async fn decide(
        &self,
        applied: &mut [Option<Applied<'_>>],
    ) -> Result<RateLimitResponse, tonic::Status> {
        self.under_overrides(applied).await;
        // The limits that take Redis work: every matched one but
        // `unlimited` and `requests_per_unit: 0`.
        let mut checks = Vec::new();
        let mut of_check = Vec::new();
        for (i, a) in applied.iter().enumerate() {
            // (A twin is decided with the first of its key.)
            if let Some(a) = a.as_ref().filter(|a| a.twin.is_none()) {
                if let (Some(algorithm), false) = (a.algorithm, a.unlimited || a.never()) {
                    // (Not `never()`: the hits fit in the limit's quota.)
                    let check = Check::new(a.key.clone(), algorithm)
                        .with_cost(a.hits)
                        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?
                        .with_enforce(!a.shadow)
                        .with_penalty(a.penalty);
                    checks.push(check);
                    of_check.push(i);
                }
            }
        }
        let enforced_zero = applied
            .iter()
            .flatten()
            .any(|a| a.twin.is_none() && !a.unlimited && a.never() && !a.shadow);
        let mut statuses: Vec<DescriptorStatus> = applied
            .iter()
            .map(|a| match a {
                // A twin's answer is its first's, copied by `response`.
                None | Some(Applied { twin: Some(_), .. }) => no_limit(),
                Some(a) if a.unlimited => DescriptorStatus {
                    code: Code::Ok as i32,
                    current_limit: None,
                    limit_remaining: u32::MAX,
                    duration_until_reset: None,
                },
                Some(a) if a.never() => {
                    // requests_per_unit 0, or more hits than the limit: over.
                    let code = if a.shadow { Code::Ok } else { Code::OverLimit };
                    gate::count_refused(&self.metrics, &a.metric, !a.shadow);
                    DescriptorStatus {
                        code: code as i32,
                        current_limit: Some(a.current()),
                        limit_remaining: 0,
                        duration_until_reset: Some(a.window.into()),
                    }
                }
                Some(_) => no_limit(),
            })
            .collect();
        if checks.is_empty() {
            return Ok(self.response(applied, statuses));
        }
        // A limit that is always over denies the call: nothing is charged,
        // and the others show what they hold now.
        if enforced_zero {
            let now = self.limiter.peek(checks.clone()).await;
            for (n, &i) in of_check.iter().enumerate() {
                let Some(a) = &mut applied[i] else { continue };
                statuses[i] = match now.as_ref().ok().and_then(|o| o.get(n)) {
                    Some(o) => self.status(a, o, false),
                    None => bare_status(a, Code::Ok),
                };
            }
            return Ok(self.response(applied, statuses));
        }
        // The limits' names in the metrics, and what Redis trouble does.
        let on_error = match self.settings.on_redis_error {
            OnError::Error | OnError::Deny => OnRedisError::Deny,
            OnError::Allow => OnRedisError::Allow,
            OnError::Local => OnRedisError::Local,
        };
        let limits: Vec<Named<'_>> = of_check
            .iter()
            .map(|&i| {
                let metric = applied[i].as_ref().map_or("", |a| a.metric.as_str());
                Named::new(metric, on_error)
            })
            .collect();
        let verdict = gate::decide(&self.limiter, &self.metrics, &limits, &checks).await;
        match verdict {
            Verdict::Redis(decision) => {
                self.answer_each(applied, &mut statuses, &of_check, &decision);
                Ok(self.response(applied, statuses))
            }
            // A remembered denial answers without Redis (and counts for `top`).
            Verdict::Remembered(denial) => {
                self.remembered(applied, &mut statuses, &of_check, &checks, denial)
                    .await;
                Ok(self.response(applied, statuses))
            }
            Verdict::Unavailable(error) => self.without_redis(applied, statuses, &of_check, &error),
            // The limits Redis could not decide let the call pass, shown
            // without a limit; the others as Redis decided them.
            Verdict::Partial(Partial {
                decided,
                decision,
                error,
                ..
            }) => {
                log::debug!("rls: redis could not decide some limits: {error}");
                for &i in &of_check {
                    statuses[i] = no_limit();
                }
                let of_decided: Vec<usize> = decided.iter().map(|&j| of_check[j]).collect();
                self.answer_each(applied, &mut statuses, &of_decided, &decision);
                Ok(self.response(applied, statuses))
            }
            Verdict::Fallback(Fallback {
                error,
                local,
                decision,
                ..
            }) => {
                log::debug!("rls: redis did not decide: {error}");
                if local.is_empty() {
                    // `allow`, or only shadow limits: nothing denies, and
                    // nothing is known of the limits' state (no limit is
                    // shown, as the site shows no RateLimit fields then).
                    for &i in &of_check {
                        statuses[i] = no_limit();
                    }
                } else {
                    // `local`: every limit was decided here, in order.
                    self.answer_each(applied, &mut statuses, &of_check, &decision);
                }
                Ok(self.response(applied, statuses))
            }
        }
    }

    /// The limits whose hits are more than their quota (no count of theirs
    /// could take them) take the limit of the identity's override instead,
    /// when an operator gave it one that fits the hits; the others stay
    /// `never()`. A read of the identity's operator record, made only for
    /// such a limit (no other call waits for it); when it fails the limit
    /// stays `never()` too. An override cleared between that read and the
    /// decision is not seen by the decision, which then counts this one
    /// call by the override's limit.
    async fn under_overrides(&self, applied: &mut [Option<Applied<'_>>]) {
        for a in applied.iter_mut().flatten() {
            // (`requests_per_unit: 0` has no algorithm: nothing raises it.)
            let (None, true, Some(algorithm)) = (a.twin, a.never(), a.algorithm) else {
                continue;
            };
            let check = Check::new(a.key.clone(), algorithm);
            let Ok(seen) = self.limiter.operate(check, Action::Inspect).await else {
                continue;
            };
            let Some(limit) = seen
                .override_state
                .and_then(|o| u32::try_from(o.limit).ok())
                .filter(|&l| l >= a.hits)
                .and_then(NonZeroU32::new)
            else {
                continue;
            };
            // The override's limit as the limit's: the decision applies
            // the same override over it (its window too), so nothing else
            // changes.
            if let Some(raised) = algorithm.with_quota(limit) {
                a.algorithm = Some(raised);
            }
        }
    }

    /// A remembered denial of check `denial.index`: its status says so, and
    /// the others show what they hold now (nothing is charged).
    async fn remembered(
        &self,
        applied: &mut [Option<Applied<'_>>],
        statuses: &mut [DescriptorStatus],
        of_check: &[usize],
        checks: &[Check],
        denial: Remembered,
    ) {
        let n = denial.index;
        if let Some(a) = &mut applied[of_check[n]] {
            let mut s = bare_status(a, Code::OverLimit);
            if let Some(q) = denial.quota {
                a.window = q.window;
                s.current_limit = Some(RateLimit {
                    requests_per_unit: q.limit,
                    unit: unit_of(q.window) as i32,
                    ..a.current()
                });
            }
            // (In whole ms, as Redis's answers are.)
            let ms = denial.wait.as_nanos().div_ceil(1_000_000);
            s.duration_until_reset = Some(Duration::from_millis(ms as u64).into());
            statuses[of_check[n]] = s;
        }
        let others: Vec<usize> = (0..checks.len()).filter(|&m| m != n).collect();
        if others.is_empty() {
            return;
        }
        let peeked = self
            .limiter
            .peek(others.iter().map(|&m| checks[m].clone()).collect())
            .await;
        for (k, &m) in others.iter().enumerate() {
            let Some(a) = &mut applied[of_check[m]] else {
                continue;
            };
            statuses[of_check[m]] = match peeked.as_ref().ok().and_then(|o| o.get(k)) {
                Some(o) => self.status(a, o, false),
                None => bare_status(a, Code::Ok),
            };
        }
    }

    /// `on_redis_error` `error` or `deny`: Redis did not decide, and an
    /// enforcing limit was matched.
    fn without_redis(
        &self,
        applied: &mut [Option<Applied<'_>>],
        mut statuses: Vec<DescriptorStatus>,
        of_check: &[usize],
        error: &LimiterError,
    ) -> Result<RateLimitResponse, tonic::Status> {
        log::debug!("rls: redis did not decide: {error}");
        if self.settings.on_redis_error == OnError::Error {
            return Err(tonic::Status::unavailable(format!(
                "redis did not decide: {error}"
            )));
        }
        for &i in of_check {
            if let Some(a) = &applied[i] {
                let code = if a.shadow { Code::Ok } else { Code::OverLimit };
                statuses[i] = bare_status(a, code);
                statuses[i].duration_until_reset = Some(Duration::from_secs(1).into());
            }
        }
        Ok(self.response(applied, statuses))
    }

    /// Writes each decided descriptor's status (the gate counted them).
    fn answer_each(
        &self,
        applied: &mut [Option<Applied<'_>>],
        statuses: &mut [DescriptorStatus],
        of_check: &[usize],
        decision: &Decision,
    ) {
        for (&i, o) in of_check.iter().zip(&decision.outcomes) {
            let Some(a) = &mut applied[i] else { continue };
            statuses[i] = self.status(a, o, decision.allowed);
        }
    }

    /// One descriptor's status from its outcome; `charged`: the call was
    /// allowed (so its allowed outcomes were recorded).
    fn status(&self, a: &mut Applied<'_>, o: &Outcome, charged: bool) -> DescriptorStatus {
        let (limit, unit) = match o.quota {
            Some(q) => {
                a.window = q.window;
                (q.limit, unit_of(q.window))
            }
            None => (a.requests_per_unit, a.unit),
        };
        let over = !o.allowed && !a.shadow;
        let mut o = *o;
        if let (true, false, Some(algorithm)) = (o.allowed, charged, &a.algorithm) {
            // Nothing was taken: what it holds now.
            o.uncharge(a.hits, algorithm);
        }
        let remaining = if o.allowed { o.remaining } else { 0 };
        DescriptorStatus {
            code: if over { Code::OverLimit } else { Code::Ok } as i32,
            current_limit: Some(RateLimit {
                name: a.name.to_string(),
                requests_per_unit: limit,
                unit: unit as i32,
            }),
            limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
            duration_until_reset: Some(o.wait.into()),
        }
    }

    /// The answer: overall code, statuses, and the RateLimit fields.
    fn response(
        &self,
        applied: &[Option<Applied<'_>>],
        mut statuses: Vec<DescriptorStatus>,
    ) -> RateLimitResponse {
        for (i, a) in applied.iter().enumerate() {
            if let Some(j) = a.as_ref().and_then(|a| a.twin) {
                statuses[i] = statuses[j].clone();
            }
        }
        let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
        let overall = if over { Code::OverLimit } else { Code::Ok };
        let headers = fields(self.settings.headers, applied, &statuses, over);
        RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add: headers,
            request_headers_to_add: Vec::new(),
        }
    }
}

/// Whole seconds, rounded up.
fn secs_up(d: &super::proto::Duration) -> u64 {
    let s = u64::try_from(d.seconds).unwrap_or(0);
    if d.nanos > 0 {
        s + 1
    } else {
        s
    }
}

/// The RateLimit fields of `dialect` for the limits with a status, and
/// `Retry-After` when the call is over.
fn fields(
    dialect: HeaderDialect,
    applied: &[Option<Applied<'_>>],
    statuses: &[DescriptorStatus],
    over: bool,
) -> Vec<HeaderValue> {
    let mut rows: Vec<(&str, u32, u64, u32, u64)> = Vec::new();
    for (a, s) in applied.iter().zip(statuses) {
        let (Some(a), Some(limit)) = (a, &s.current_limit) else {
            continue;
        };
        if a.shadow || a.twin.is_some() {
            // A shadow limit never shows; a twin shows once, as its first.
            continue;
        }
        let reset = s.duration_until_reset.as_ref().map_or(0, secs_up);
        let window = (a.window.as_millis().div_ceil(1000) as u64).max(1);
        rows.push((
            &a.name,
            limit.requests_per_unit,
            window,
            s.limit_remaining,
            reset,
        ));
    }
    let h = |k: &str, v: String| HeaderValue {
        key: k.to_string(),
        value: v,
    };
    let mut out = Vec::new();
    if over {
        let retry = statuses
            .iter()
            .filter(|s| s.code == Code::OverLimit as i32)
            .filter_map(|s| s.duration_until_reset.as_ref().map(secs_up))
            .max()
            .unwrap_or(1)
            .max(1);
        if dialect != HeaderDialect::None {
            out.push(h("retry-after", retry.to_string()));
        }
    }
    if rows.is_empty() {
        return out;
    }
    let least = rows
        .iter()
        .min_by_key(|r| (r.3, r.4))
        .copied()
        .unwrap_or(rows[0]);
    match dialect {
        HeaderDialect::None => {}
        HeaderDialect::Ietf => {
            let policy: Vec<String> = rows
                .iter()
                .map(|r| format!("\"{}\";q={};w={}", sf_text(r.0), r.1, r.2))
                .collect();
            let state: Vec<String> = rows
                .iter()
                .map(|r| format!("\"{}\";r={};t={}", sf_text(r.0), r.3, r.4))
                .collect();
            out.push(h("ratelimit-policy", policy.join(", ")));
            out.push(h("ratelimit", state.join(", ")));
        }
        HeaderDialect::Draft6 => {
            out.push(h("ratelimit-limit", least.1.to_string()));
            out.push(h("ratelimit-remaining", least.3.to_string()));
            out.push(h("ratelimit-reset", least.4.to_string()));
            out.push(h("ratelimit-policy", format!("{};w={}", least.1, least.2)));
        }
        HeaderDialect::Draft7 => {
            out.push(h(
                "ratelimit",
                format!(
                    "limit={}, remaining={}, reset={}",
                    least.1, least.3, least.4
                ),
            ));
            out.push(h("ratelimit-policy", format!("{};w={}", least.1, least.2)));
        }
        HeaderDialect::XRateLimit => {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            out.push(h("x-ratelimit-limit", least.1.to_string()));
            out.push(h("x-ratelimit-remaining", least.3.to_string()));
            out.push(h("x-ratelimit-reset", (now + least.4).to_string()));
        }
        _ => {}
    }
    out
}

impl Handler for Rls {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        self.answer(request.into_inner())
            .await
            .map(tonic::Response::new)
    }
}

impl Handler for Arc<Rls> {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        self.answer(request.into_inner())
            .await
            .map(tonic::Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rls::descriptors::add_file;
    use proptest::prelude::*;
    use prost::Message;

    const TREE: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: w\n    value: 'a*b*'\n    rate_limit: {unit: second, requests_per_unit: 1}\n";

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Whatever bytes arrive: decoded or refused, checked, matched,
        /// keyed, never a panic.
        #[test]
        fn any_bytes_are_decoded_or_refused_without_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut m = Matcher::default();
            add_file(&mut m, TREE, "t.yaml", "sliding_window").unwrap();
            if let Ok(req) = RateLimitRequest::decode(bytes.as_slice()) {
                let _ = invalid(&req);
                for d in &req.descriptors {
                    if let Some(hit) = m.find(&req.domain, &d.entries) {
                        let _ = state_key(false, "p", &hit.limit.name, &hit.values);
                        let _ = label(&hit.metric);
                    }
                    let name = bounded(descriptor_key(&req.domain, d));
                    prop_assert!(name.len() <= MAX_NAME_BYTES);
                    prop_assert!(sf_text(&name).chars().all(|c| c.is_ascii_graphic() || c == ' '));
                }
            }
        }

        /// Any descriptor entries, printable or not, walk the tree safely.
        #[test]
        fn any_entries_walk_the_tree(entries in proptest::collection::vec((".{0,6}", ".{0,6}"), 0..5)) {
            let mut m = Matcher::default();
            add_file(&mut m, TREE, "t.yaml", "sliding_window").unwrap();
            let entries: Vec<crate::rls::proto::Entry> = entries
                .into_iter()
                .map(|(key, value)| crate::rls::proto::Entry { key, value })
                .collect();
            let _ = m.find("d", &entries);
        }
    }

    /// A name from a call can neither break a field nor grow without bound.
    #[test]
    fn names_from_calls_are_bounded_and_fit_a_field() {
        assert_eq!(sf_text("d.k"), "d.k");
        assert_eq!(
            sf_text("a\r\nSet-Cookie: \"x\\\u{e9}"),
            "a__Set-Cookie: _x__"
        );
        let long = format!("d.{}", "k".repeat(1000));
        let short = bounded(long.clone());
        assert!(
            short.len() <= MAX_NAME_BYTES && short.starts_with("d.kkk"),
            "{short}"
        );
        assert_ne!(short, bounded(format!("{long}x")));
        assert_eq!(bounded("d.k".to_string()), "d.k");
        let wide = bounded("\u{e9}".repeat(200));
        assert!(wide.len() <= MAX_NAME_BYTES);
    }

    #[test]
    fn bad_calls_say_why() {
        let ok = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![crate::rls::proto::Entry {
                    key: "k".into(),
                    value: String::new(),
                }],
                limit: None,
                hits_addend: None,
            }],
            hits_addend: 0,
        };
        assert_eq!(invalid(&ok), None);
        let mut r = ok.clone();
        r.domain.clear();
        assert!(invalid(&r).unwrap().contains("domain"));
        let mut r = ok.clone();
        r.descriptors.clear();
        assert!(invalid(&r).unwrap().contains("no descriptors"));
        let mut r = ok.clone();
        r.descriptors[0].entries[0].key.clear();
        assert!(invalid(&r).unwrap().contains("key must not be empty"));
        let mut r = ok.clone();
        r.hits_addend = 1_000_000_001;
        assert!(invalid(&r).unwrap().contains("hits_addend"));
        let mut r = ok;
        r.descriptors[0].hits_addend = Some(crate::rls::proto::UInt64Value { value: 1 << 40 });
        assert!(invalid(&r).unwrap().contains("descriptor 0: hits_addend"));
    }
}
