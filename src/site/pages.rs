//! The site's pages: home, `/check`, the error page and 404.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;

use super::Site;
use floodgate::rule::{Mode, Rule};

/// Longest wait the error page will show (a year); larger values are clamped.
const MAX_RETRY_AFTER: u64 = 366 * 86_400;

/// One rule as the home page lists it.
pub struct RuleRow {
    /// Rule name.
    pub name: String,
    /// Methods, or "any".
    pub methods: String,
    /// Path patterns joined.
    pub paths: String,
    /// Key kind as configured.
    pub key: String,
    /// The limit in words.
    pub description: String,
    /// Shadow mode.
    pub shadow: bool,
}

impl RuleRow {
    /// The row for `rule`.
    pub fn new(rule: &Rule) -> RuleRow {
        RuleRow {
            name: rule.name().to_string(),
            methods: if rule.methods().is_empty() {
                "any".into()
            } else {
                rule.methods().join(", ")
            },
            paths: rule.path_text().join(" "),
            key: rule.key().to_string(),
            description: rule.description().to_string(),
            shadow: rule.mode() == Mode::Shadow,
        }
    }
}

#[derive(Template)]
#[template(path = "home.html")]
struct HomePage {
    site_title: String,
    signed_in: bool,
    rules: Vec<RuleRow>,
}

#[derive(Template)]
#[template(path = "check.html")]
struct CheckPage {
    site_title: String,
    signed_in: bool,
    description: String,
}

/// The error page: which rule, and a live countdown.
#[derive(Template)]
#[template(path = "err.html")]
pub struct ErrorPage {
    /// Site title.
    pub site_title: String,
    /// Whether the nav shows "Account".
    pub signed_in: bool,
    /// The rule name, only when it is a configured rule.
    pub rule: String,
    /// The rule's limit in words; `None` = generic text.
    pub description: Option<String>,
    /// Seconds to wait.
    pub retry_after: u64,
    /// The client is banned (blocked), not only over the limit.
    pub banned: bool,
    /// Where "Go back" leads (a local path).
    pub back: String,
}

/// Renders a template, or logs why not and shows an opaque 500.
pub fn render(t: &impl Template, status: StatusCode) -> HttpResponse {
    match t.render() {
        Ok(html) => HttpResponse::build(status)
            .content_type("text/html; charset=utf-8")
            .body(html),
        Err(e) => {
            crate::repeated!(
                &crate::log_kinds::SITE_ERROR,
                "template failed: {}",
                floodgate::logging::Escaped(&e.to_string())
            );
            HttpResponse::InternalServerError()
                .content_type("text/plain; charset=utf-8")
                .body("something went wrong\n")
        }
    }
}

/// `GET /`
pub async fn home(site: web::Data<Site>, req: HttpRequest) -> HttpResponse {
    let rules = site.filter.rules().iter().map(RuleRow::new).collect();
    render(
        &HomePage {
            site_title: site.config.site.title.clone(),
            signed_in: signed_in(&site, &req),
            rules,
        },
        StatusCode::OK,
    )
}

/// `GET /check`
pub async fn check(site: web::Data<Site>, req: HttpRequest) -> HttpResponse {
    let description = site
        .filter
        .rules()
        .iter()
        .find(|r| r.name() == "check")
        .map_or_else(
            || "as many requests as you like".into(),
            |r| r.description().to_string(),
        );
    render(
        &CheckPage {
            site_title: site.config.site.title.clone(),
            signed_in: signed_in(&site, &req),
            description,
        },
        StatusCode::OK,
    )
}

/// `GET /err?rule=NAME&retry_after=N`: names the rule only when it is a
/// configured one, and counts down.
pub async fn error_page(site: web::Data<Site>, req: HttpRequest) -> HttpResponse {
    let mut rule_name = String::new();
    let mut retry_after = 1;
    let mut banned = false;
    for (k, v) in form_urlencoded::parse(req.query_string().as_bytes()) {
        match k.as_ref() {
            "rule" => rule_name = v.into_owned(),
            "banned" => banned = v == "1",
            "retry_after" => {
                retry_after = v.trim().parse::<u64>().unwrap_or(1).min(MAX_RETRY_AFTER);
            }
            _ => {}
        }
    }
    let rules = site.filter.rules();
    let rule = rules.iter().find(|r| r.name() == rule_name);
    let page = ErrorPage {
        site_title: site.config.site.title.clone(),
        signed_in: signed_in(&site, &req),
        rule: rule.map(|r| r.name().to_string()).unwrap_or_default(),
        description: rule.and_then(shown_description),
        retry_after,
        banned,
        back: back_link(&req, rule),
    };
    let mut res = render(&page, StatusCode::OK);
    res.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    res
}

/// A rule's limit in words, for its error page; `None` for an abuse
/// threshold (`headers = "none"`), which no page tells: the page names
/// the rule only (anyone may ask `/err` for any rule).
fn shown_description(rule: &Rule) -> Option<String> {
    (rule.headers() != floodgate::rule::HeaderDialect::None).then(|| rule.description().to_string())
}

/// The HTML sent with a 429 for a browser (`deny = "status"`).
pub fn denial_html(site_title: &str, denial: &floodgate::Denial) -> String {
    let retry_after = denial.retry_after;
    let page = ErrorPage {
        site_title: site_title.to_string(),
        signed_in: false,
        rule: denial.rule.name().to_string(),
        description: shown_description(&denial.rule),
        retry_after,
        banned: denial.banned,
        back: "/".into(),
    };
    page.render().unwrap_or_else(|e| {
        crate::repeated!(
            &crate::log_kinds::SITE_ERROR,
            "template failed: {}",
            floodgate::logging::Escaped(&e.to_string())
        );
        format!("Too many requests; try again in {retry_after} seconds.")
    })
}

/// "Go back" leads to the page the user came from when it is on this site,
/// else to the rule's first plain path, else home.
fn back_link(req: &HttpRequest, rule: Option<&Rule>) -> String {
    let host = req.connection_info().host().to_string();
    if let Some(referer) = req
        .headers()
        .get(header::REFERER)
        .and_then(|v| v.to_str().ok())
    {
        if let Some(rest) = referer
            .strip_prefix("http://")
            .or_else(|| referer.strip_prefix("https://"))
        {
            if let Some(path) = rest.strip_prefix(host.as_str()) {
                if path.starts_with('/') && !path.starts_with("//") && !path.starts_with("/err") {
                    return path.to_string();
                }
            }
        }
    }
    rule.filter(|r| r.methods().is_empty() || r.methods().iter().any(|m| m == "GET"))
        .and_then(|r| {
            r.path_text()
                .iter()
                .find(|p| !p.contains([':', '*']))
                .cloned()
        })
        .unwrap_or_else(|| "/".into())
}

/// Whether the cookie names an account (for the nav only; no Redis call).
pub fn signed_in(site: &Site, req: &HttpRequest) -> bool {
    super::session::read_cookie(&site.secret, req).is_some_and(|c| c.account.is_some())
}

#[derive(Template)]
#[template(path = "message.html")]
struct MessagePage<'a> {
    site_title: String,
    signed_in: bool,
    heading: &'a str,
    text: &'a str,
}

/// A page with a heading and a sentence, for 403s and the like.
pub fn message(
    site: &Site,
    signed_in: bool,
    status: StatusCode,
    heading: &str,
    text: &str,
) -> HttpResponse {
    render(
        &MessagePage {
            site_title: site.title(),
            signed_in,
            heading,
            text,
        },
        status,
    )
}

/// 404 for every path without a handler: a page of the site for a
/// browser, a line of text for anyone else.
pub async fn not_found(req: HttpRequest) -> HttpResponse {
    let site = req.app_data::<web::Data<Site>>();
    match site {
        Some(site) if floodgate::accepts(&req, "text/html") => message(
            site,
            false,
            StatusCode::NOT_FOUND,
            "Page not found",
            "There is no page at this address.",
        ),
        _ => HttpResponse::NotFound()
            .content_type("text/plain; charset=utf-8")
            .body("not found\n"),
    }
}
