//! `/limits`, the live view of every rule and the visitor's own usage, and
//! `/dev/outbox`, the SMS messages the demo "sent".

use std::net::IpAddr;

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use redis::Commands;

use super::pages::render;
use super::{Site, SiteError, Visitor};
use crate::config::{format_duration, human_duration};
use crate::limit::Algorithm;
use crate::limit::RedisConn;
use crate::rule::{KeyKind, Mode, Rule};

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

/// The visitor's own keys for a rule: address, account, phone.
fn subjects(site: &Site, rule: &Rule, client: IpAddr, visitor: &Visitor) -> (Vec<Subject>, String) {
    let prefix = &site.config.redis.key_prefix;
    let tagged = site.filter.limiter().hash_tags();
    let make = |label: String, kind: &str, id: &str| Subject {
        label,
        key: crate::rule::redis_key_for(tagged, prefix, &rule.name, kind, id),
    };
    let address = crate::net::ip_id(client);
    let ip = make(format!("your address {address}"), "ip", &address);
    if let Some(KeyKind::Path) = rule.key.single() {
        return (
            rule.path_text
                .iter()
                .filter(|p| !p.contains([':', '*']))
                .map(|p| make(format!("the page {p}"), "path", p))
                .collect(),
            String::new(),
        );
    }
    // Each part of the key as the visitor's own requests would have it.
    let mut parts: Vec<(&'static str, String)> = Vec::new();
    let mut labels: Vec<String> = Vec::new();
    for kind in rule.key.kinds() {
        let part = match kind {
            KeyKind::Ip => Some((address.clone(), format!("your address {address}"))),
            KeyKind::Global => Some(("all".to_string(), "everyone together".to_string())),
            KeyKind::Path | KeyKind::Custom(_) => None,
            KeyKind::Session => visitor
                .account
                .as_ref()
                .map(|id| (id.clone(), "your account".to_string())),
            KeyKind::Header(_) | KeyKind::Query(_) | KeyKind::Form(_) => {
                visitor.phone.as_ref().and_then(|phone| {
                    crate::rule::normalize(phone, rule.normalize)
                        .map(|id| (id, format!("your phone {phone}")))
                })
            }
        };
        match part {
            Some((id, label)) => {
                parts.push((kind.kind(), id));
                labels.push(label);
            }
            None => {
                let note = match kind {
                    KeyKind::Session => "Keyed by your address until you sign in.".to_string(),
                    _ => format!(
                        "Counted per {} sent; sign in to see your phone's usage.",
                        rule.key
                    ),
                };
                let shown = if rule.key.single().is_some() && matches!(kind, KeyKind::Session) {
                    vec![ip]
                } else {
                    Vec::new()
                };
                return (shown, note);
            }
        }
    }
    let (kind, id) = match parts.as_slice() {
        [(kind, id)] => ((*kind).to_string(), id.clone()),
        _ => crate::rule::compose(&parts),
    };
    (vec![make(labels.join(" from "), &kind, &id)], String::new())
}

/// Reads one key's state and describes it.
fn usage(
    conn: &mut RedisConn,
    rule: &Rule,
    subject: Subject,
    now: u64,
) -> redis::RedisResult<SubjectView> {
    let mut view = SubjectView {
        label: subject.label,
        used: String::new(),
        bar: 0,
        full: false,
        next: String::new(),
        ticks: Vec::new(),
        sliding: false,
        window: String::new(),
    };
    match rule.algorithm {
        Algorithm::SlidingWindow { limit, window } => {
            let window_ms = window.as_millis() as u64;
            let stamps: Vec<u64> = conn.lrange(&subject.key, 0, MAX_TICKS as isize - 1)?;
            let live: Vec<u64> = stamps.into_iter().filter(|t| t + window_ms > now).collect();
            // Each entry is one unit; past the drawn ones, count the list.
            let used = if live.len() < MAX_TICKS {
                live.len() as u64
            } else {
                conn.llen(&subject.key)?
            };
            fill(&mut view, used, u64::from(limit.get()));
            // The oldest entry in the window frees the next slot.
            view.next = match live.last() {
                Some(oldest) if view.full => wait_words(oldest + window_ms - now),
                Some(oldest) => format!(
                    "a slot is free now; the oldest use leaves in {}",
                    secs_words(oldest + window_ms - now)
                ),
                None => "nothing used".into(),
            };
            view.sliding = true;
            view.window = format_duration(window);
            view.ticks = live
                .iter()
                .map(|t| {
                    let age = now.saturating_sub(*t) as f64;
                    (WIDTH - age / window_ms as f64 * WIDTH).clamp(0.0, WIDTH) as u32
                })
                .collect();
        }
        Algorithm::FixedWindow { limit, window } => {
            // The limiter's hash: the window's start, the units used, and
            // the window it was last decided under.
            let (start, used, was): (Option<u64>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
                .arg(&subject.key)
                .arg("start")
                .arg("used")
                .arg("window")
                .query(conn)?;
            let window_ms = window.as_millis() as u64;
            let open = match (start, used) {
                (Some(start), Some(used))
                    if now < start + was.unwrap_or(window_ms) && now < start + window_ms =>
                {
                    Some((used, start + window_ms - now))
                }
                _ => None,
            };
            fill(&mut view, open.map_or(0, |o| o.0), u64::from(limit.get()));
            view.next = match open {
                Some((_, closes)) => format!("the window closes in {}", secs_words(closes)),
                None => "nothing used".into(),
            };
        }
        Algorithm::TokenBucket { rate, burst } => {
            let (tokens, ts): (Option<f64>, Option<u64>) = redis::cmd("HMGET")
                .arg(&subject.key)
                .arg("tokens")
                .arg("ts")
                .query(conn)?;
            let burst_f = f64::from(burst.get());
            let tokens = match (tokens, ts) {
                (Some(t), Some(ts)) => {
                    (t + now.saturating_sub(ts) as f64 * rate / 1000.0).min(burst_f)
                }
                _ => burst_f,
            };
            let used = (burst_f - tokens).max(0.0).floor() as u64;
            fill(&mut view, used, u64::from(burst.get()));
            view.next = if tokens >= burst_f {
                "the bucket is full".into()
            } else {
                format!(
                    "full again in {}",
                    secs_words(((burst_f - tokens) * 1000.0 / rate).ceil() as u64)
                )
            };
        }
    }
    Ok(view)
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
    let mut plan = Vec::new();
    let mut views = Vec::new();
    for rule in rules.iter() {
        let (subs, note) = subjects(&site, rule, client, &visitor);
        plan.push((rule.clone(), subs));
        views.push(RuleView {
            name: rule.name.clone(),
            methods: if rule.methods.is_empty() {
                "any method".into()
            } else {
                rule.methods.join(", ")
            },
            paths: rule.path_text.join(" "),
            key: rule.key.to_string(),
            algorithm: rule.algorithm.name(),
            params: match rule.algorithm {
                Algorithm::SlidingWindow { limit, window }
                | Algorithm::FixedWindow { limit, window } => {
                    format!("{limit} per {}", human_duration(window))
                }
                Algorithm::TokenBucket { rate, burst } => {
                    format!("burst {burst}, {rate} per second")
                }
            },
            description: rule.description.clone(),
            shadow: rule.mode == Mode::Shadow,
            subjects: Vec::new(),
            note,
        });
    }
    let usages = site
        .redis(move |conn| {
            let (secs, micros): (u64, u64) = redis::cmd("TIME").query(conn)?;
            let now = secs * 1000 + micros / 1000;
            let mut all = Vec::new();
            for (rule, subs) in plan {
                let mut one = Vec::new();
                for s in subs {
                    one.push(usage(conn, &rule, s, now)?);
                }
                all.push(one);
            }
            Ok(all)
        })
        .await?;
    for (view, subs) in views.iter_mut().zip(usages) {
        view.subjects = subs;
    }
    let page = LimitsPage {
        site_title: site.title(),
        signed_in: visitor.signed_in(),
        address: crate::net::ip_id(client),
        phone: visitor
            .phone
            .as_ref()
            .map(|p| format!("+{p}"))
            .unwrap_or_default(),
        rules: views,
    };
    let mut res = visitor.respond(render(&page, StatusCode::OK));
    res.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    Ok(res)
}

#[derive(Template)]
#[template(path = "outbox.html")]
struct OutboxPage {
    site_title: String,
    signed_in: bool,
    messages: Vec<super::sms::Message>,
}

/// `GET /dev/outbox`: the messages "sent", newest first (only with the
/// outbox provider). JSON when `Accept` names `application/json`.
pub async fn outbox(site: web::Data<Site>, req: HttpRequest) -> Result<HttpResponse, SiteError> {
    let Some(outbox) = site.outbox.clone() else {
        return Ok(super::pages::not_found(req).await);
    };
    let messages = site.redis(move |conn| outbox.read(conn)).await?;
    if crate::filter::accepts(&req, "application/json") {
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
