//! `/limits`, the live view of every rule and the visitor's own usage, and
//! `/dev/outbox`, the SMS messages the demo "sent".

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use redis::Commands;

use super::pages::render;
use super::{Site, SiteError, Visitor};
use crate::config::{format_duration, human_duration};
use floodgate::limiter::{Action, Check, Outcome};
use floodgate::rule::Algorithm;
use floodgate::rule::{KeyKind, Mode, Rule};

/// Width of the SVG drawings, in user units.
const WIDTH: f64 = 600.0;
/// Most timestamps drawn per key.
const MAX_TICKS: usize = 200;

/// One rule on the page.
struct RuleView {
    name: String,
    methods: String,
    paths: String,
    key: String,
    algorithm: &'static str,
    params: String,
    description: String,
    shadow: bool,
    subjects: Vec<SubjectView>,
    note: String,
}

/// The visitor's usage of one rule under one key.
struct SubjectView {
    label: String,
    used: String,
    bar: u32,
    full: bool,
    next: String,
    /// x positions of the entries in the window (sliding window only).
    ticks: Vec<u32>,
    sliding: bool,
    window: String,
    /// What operators set for this identity: its ban, its own limit.
    operator: String,
}

#[derive(Template)]
#[template(path = "limits.html")]
struct LimitsPage {
    site_title: String,
    signed_in: bool,
    address: String,
    phone: String,
    rules: Vec<RuleView>,
}

/// A key to look at, and how to describe it.
struct Subject {
    label: String,
    key: String,
}

/// The visitor's own keys for a rule (address, account, phone), each built
/// by the filter from this request as it builds the key of a guarded one:
/// the phone of a signed-in visitor stands for the form fields the site's
/// forms send, the page's own headers for header parts.
fn subjects(
    site: &Site,
    rule: &Rule,
    req: &HttpRequest,
    visitor: &Visitor,
) -> (Vec<Subject>, String) {
    let address = floodgate::net::ip_id(site.filter.client_addr(req));
    let key = |path: &str, form: Option<&[u8]>| site.filter.key_for(rule, req, path, form).ok();
    if let Some(KeyKind::Path) = rule.key().single() {
        return (
            rule.path_text()
                .iter()
                .filter(|p| !p.contains([':', '*']))
                .filter_map(|p| {
                    key(p, None).map(|key| Subject {
                        label: format!("the page {p}"),
                        key,
                    })
                })
                .collect(),
            String::new(),
        );
    }
    let mut labels: Vec<String> = Vec::new();
    let mut form = form_urlencoded::Serializer::new(String::new());
    for kind in rule.key().kinds() {
        let label = match kind {
            KeyKind::Ip => Some(format!("your address {address}")),
            KeyKind::Global => Some("everyone together".to_string()),
            KeyKind::Path | KeyKind::Custom(_) | KeyKind::Query(_) | KeyKind::Json(_) => None,
            KeyKind::Session => visitor.account.as_ref().map(|_| "your account".to_string()),
            KeyKind::Header(name) => req
                .headers()
                .contains_key(name.as_str())
                .then(|| format!("your {name} header")),
            KeyKind::Form(name) | KeyKind::Body(name) => visitor.phone.as_ref().map(|phone| {
                form.append_pair(name, phone);
                format!("your phone {phone}")
            }),
            _ => None,
        };
        let Some(label) = label else {
            let note = match kind {
                KeyKind::Session => "Keyed by your address until you sign in.".to_string(),
                _ => format!(
                    "Counted per {} sent; sign in to see your phone's usage.",
                    rule.key()
                ),
            };
            // Signed out, a session rule keys this visitor by address:
            // the filter falls back to it by itself.
            let shown = if rule.key().single().is_some() && matches!(kind, KeyKind::Session) {
                key(req.path(), None)
                    .map(|key| Subject {
                        label: format!("your address {address}"),
                        key,
                    })
                    .into_iter()
                    .collect()
            } else {
                Vec::new()
            };
            return (shown, note);
        };
        labels.push(label);
    }
    let body = form.finish();
    match key(req.path(), Some(body.as_bytes())) {
        Some(key) => (
            vec![Subject {
                label: labels.join(" from "),
                key,
            }],
            String::new(),
        ),
        None => (Vec::new(), "Your usage cannot be shown here.".to_string()),
    }
}

/// Describes one key from what a one-unit request would be answered now
/// (the limiter's own peek: nothing is counted), and for a sliding window
/// the times of the entries still in it, newest first.
fn usage(rule: &Rule, label: String, now: &Outcome, entries: &[u64], clock: u64) -> SubjectView {
    let quota = u64::from(now.limit(&rule.algorithm()));
    // What is left before this request would take its unit.
    let left = (now.remaining + u64::from(now.allowed)).min(quota);
    let used = quota - left;
    let wait = now.wait.as_millis() as u64;
    let mut view = SubjectView {
        label,
        used: String::new(),
        bar: 0,
        full: false,
        next: String::new(),
        ticks: Vec::new(),
        sliding: false,
        window: String::new(),
        operator: String::new(),
    };
    fill(&mut view, used, quota);
    match rule.algorithm() {
        Algorithm::SlidingWindow { window, .. } => {
            view.next = if used == 0 {
                "nothing used".into()
            } else if now.allowed {
                // The reset of an allowed request: when its oldest use leaves.
                format!(
                    "a slot is free now; the oldest use leaves in {}",
                    secs_words(wait)
                )
            } else {
                wait_words(wait)
            };
            view.sliding = true;
            view.window = format_duration(window);
            let window_ms = window.as_millis() as f64;
            view.ticks = entries
                .iter()
                .map(|t| {
                    let age = clock.saturating_sub(*t) as f64;
                    (WIDTH - age / window_ms * WIDTH).clamp(0.0, WIDTH) as u32
                })
                .collect();
        }
        Algorithm::FixedWindow { .. } => {
            view.next = if used == 0 {
                "nothing used".into()
            } else {
                format!("the window closes in {}", secs_words(wait))
            };
        }
        Algorithm::TokenBucket { .. } => {
            view.next = if used == 0 {
                "the bucket is full".into()
            } else if now.allowed {
                "a token is free now".into()
            } else {
                format!(
                    "the bucket is empty: the next token comes in {}",
                    secs_words(wait)
                )
            };
        }
        _ if used == 0 => view.next = "nothing used".into(),
        _ if now.allowed => {
            view.next = format!("a slot is free now; all is back in {}", secs_words(wait))
        }
        _ => view.next = wait_words(wait),
    }
    view
}

fn fill(view: &mut SubjectView, used: u64, limit: u64) {
    view.used = format!("{used} of {limit}");
    view.bar = ((used as f64 / limit as f64).min(1.0) * WIDTH) as u32;
    view.full = used >= limit;
}

/// "1 second", "42 seconds", "9 min 58 s", "2 h 5 min".
fn secs_words(ms: u64) -> String {
    let s = ms.div_ceil(1000);
    match s {
        1 => "1 second".into(),
        0..=119 => format!("{s} seconds"),
        120..=7199 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

fn wait_words(ms: u64) -> String {
    format!("limit reached: the next slot frees in {}", secs_words(ms))
}

/// `GET /limits`
pub async fn limits(site: web::Data<Site>, req: HttpRequest) -> Result<HttpResponse, SiteError> {
    let visitor = Visitor::of(&site, &req).await?;
    let client = site.filter.client_addr(&req);
    let rules = site.filter.rules();
    let mut plan: Vec<(usize, Subject)> = Vec::new();
    let mut views = Vec::new();
    // Every rule, the abuse thresholds too (`headers = "none"`: no
    // response's fields show them, but the visitor may see them here).
    for (at, rule) in rules.iter().enumerate() {
        let (subs, note) = subjects(&site, rule, &req, &visitor);
        plan.extend(subs.into_iter().map(|s| (at, s)));
        views.push(RuleView {
            name: rule.name().to_string(),
            methods: if rule.methods().is_empty() {
                "any method".into()
            } else {
                rule.methods().join(", ")
            },
            paths: rule.path_text().join(" "),
            key: rule.key().to_string(),
            algorithm: rule.algorithm().name(),
            params: rule.algorithm().parameters(human_duration),
            description: rule.description().to_string(),
            shadow: rule.mode() == Mode::Shadow,
            subjects: Vec::new(),
            note,
        });
    }
    let checks: Vec<Check> = plan
        .iter()
        .map(|(at, s)| Check::new(s.key.clone(), rules[*at].algorithm()))
        .collect();
    let outcomes = site
        .filter
        .limiter()
        .peek(checks)
        .await
        .map_err(|e| SiteError::unavailable(format!("limits: {e}")))?;
    // The timelines: the entries in each sliding window, newest first (the
    // log's head), as many as the peek counted, and Redis's clock.
    let drawn: Vec<(String, isize)> = plan
        .iter()
        .zip(&outcomes)
        .filter(|((at, _), _)| matches!(rules[*at].algorithm(), Algorithm::SlidingWindow { .. }))
        .map(|((at, s), o)| {
            let quota = u64::from(o.limit(&rules[*at].algorithm()));
            let used = quota - (o.remaining + u64::from(o.allowed)).min(quota);
            (s.key.clone(), used.min(MAX_TICKS as u64) as isize)
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    let (clock, mut entries) = site
        .redis(move |conn| {
            let (secs, micros): (u64, u64) = redis::cmd("TIME").query(conn)?;
            let mut all = Vec::with_capacity(drawn.len());
            for (key, n) in drawn {
                // Each entry is one admission, `TIME:TOTAL:UNITS`: one
                // tick per unit, newest first, `n` at most.
                let entries: Vec<String> = conn.lrange(&key, 0, n - 1)?;
                let mut stamps = Vec::new();
                for entry in &entries {
                    let mut parts = entry.split(':');
                    let time = parts.next().and_then(|t| t.parse::<u64>().ok());
                    let units = parts.nth(1).and_then(|w| w.parse::<usize>().ok());
                    if let Some(time) = time {
                        let room = (n as usize).saturating_sub(stamps.len());
                        stamps.extend(std::iter::repeat_n(time, units.unwrap_or(1).min(room)));
                    }
                }
                all.push((key, stamps));
            }
            Ok((secs * 1000 + micros / 1000, all))
        })
        .await?;
    for ((at, subject), now) in plan.into_iter().zip(&outcomes) {
        let rule = &rules[at];
        let stamps = match entries.iter().position(|(k, _)| *k == subject.key) {
            Some(i) => entries.swap_remove(i).1,
            None => Vec::new(),
        };
        let key = subject.key.clone();
        let mut view = usage(rule, subject.label, now, &stamps, clock);
        view.operator = operator_note(&site, rule, key).await;
        if let Some(shown) = views.iter_mut().find(|v| v.name == rule.name()) {
            shown.subjects.push(view);
        }
    }
    let page = LimitsPage {
        site_title: site.title(),
        signed_in: visitor.signed_in(),
        address: floodgate::net::ip_id(client),
        phone: visitor.phone.clone().unwrap_or_default(),
        rules: views,
    };
    let mut res = visitor.respond(render(&page, StatusCode::OK));
    res.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    Ok(res)
}

/// The visitor's ban or own limit under `rule`, in words ("" when none,
/// or when Redis cannot say).
async fn operator_note(site: &Site, rule: &Rule, key: String) -> String {
    let check = rule.check(key).with_enforce(true).with_penalty(None);
    let Ok(seen) = site.filter.limiter().operate(check, Action::Inspect).await else {
        return String::new();
    };
    let mut notes = Vec::new();
    if seen.banned_s > 0 {
        notes.push(format!(
            "banned for {} more",
            human_duration(std::time::Duration::from_secs(seen.banned_s))
        ));
    }
    if let Some(o) = seen.override_state {
        let until = match o.expires_s {
            Some(s) => format!(
                " for {} more",
                human_duration(std::time::Duration::from_secs(s))
            ),
            None => String::new(),
        };
        notes.push(format!(
            "your own limit: {} per {}{until}",
            o.limit,
            human_duration(std::time::Duration::from_secs(o.window_s))
        ));
    }
    notes.join(" · ")
}

#[derive(Template)]
#[template(path = "outbox.html")]
struct OutboxPage {
    site_title: String,
    signed_in: bool,
    messages: Vec<super::sms::Message>,
}

/// Whether the client is on this machine: its address (behind trusted
/// proxies, one the forwarding header names: [`Site::named_client`]) is
/// loopback.
fn loopback_client(site: &Site, req: &HttpRequest) -> bool {
    site.named_client(req).is_some_and(|c| c.is_loopback())
}

/// `GET /dev/outbox`: the messages "sent", newest first (only with the
/// outbox provider). JSON when `Accept` names `application/json`. The
/// messages are everyone's codes: only loopback clients (the client
/// address behind trusted proxies, not the proxy's) see them unless
/// `[site] public_outbox` is set; others get the 404 page.
pub async fn outbox(site: web::Data<Site>, req: HttpRequest) -> Result<HttpResponse, SiteError> {
    let Some(outbox) = site.outbox.clone() else {
        return Ok(super::pages::not_found(req).await);
    };
    if !site.config.site.public_outbox && !loopback_client(&site, &req) {
        return Ok(super::pages::not_found(req).await);
    }
    let messages = site.redis(move |conn| outbox.read(conn)).await?;
    if floodgate::accepts(&req, "application/json") {
        return Ok(HttpResponse::Ok()
            .insert_header((header::CACHE_CONTROL, "no-store"))
            .json(messages));
    }
    let page = OutboxPage {
        site_title: site.title(),
        signed_in: super::pages::signed_in(&site, &req),
        messages,
    };
    let mut res = render(&page, StatusCode::OK);
    res.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    Ok(res)
}
