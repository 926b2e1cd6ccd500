//! Who is asking: key values read exactly as the handler reads them (form
//! charsets, repeated fields, undecodable values), the client address
//! behind a proxy that appends X-Forwarded-For, composite keys, phone
//! numbers in E.164, and `count = "failures"` giving units back.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use actix_web::dev::ServerHandle;
use actix_web::{web, HttpResponse};
use floodgate_site::config::Config;
use floodgate_site::site::Application;

use crate::helpers::{client, remaining, RedisServer};

/// The app with two handlers of its own behind the filter:
/// `POST /whoami` answers the `phone` that `web::Form` gave it, and
/// `GET /answer?status=N` answers status N.
struct KeysApp {
    address: String,
    http: reqwest::Client,
    redis: RedisServer,
    handle: ServerHandle,
}

impl Drop for KeysApp {
    fn drop(&mut self) {
        drop(self.handle.stop(false));
    }
}

async fn whoami(form: web::Form<HashMap<String, String>>) -> HttpResponse {
    HttpResponse::Ok().body(form.get("phone").cloned().unwrap_or_default())
}

async fn answer(query: web::Query<HashMap<String, String>>) -> HttpResponse {
    let status = query
        .get("status")
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    HttpResponse::build(actix_web::http::StatusCode::from_u16(status).unwrap()).finish()
}

fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/whoami", web::post().to(whoami))
        .route("/answer", web::get().to(answer));
}

async fn spawn(toml: &str) -> KeysApp {
    let redis = RedisServer::start();
    let mut config = Config::parse(toml, Path::new("keys.toml")).expect("the test config is valid");
    config.filter.redis.url = redis.url();
    config.server.bind = "127.0.0.1:0".into();
    config.server.workers = 2;
    let app = Application::build_with(config, routes).expect("the app starts");
    let address = format!("http://127.0.0.1:{}", app.port());
    let handle = app.handle();
    actix_web::rt::spawn(app.run_until_stopped());
    let app = KeysApp {
        address,
        http: client(),
        redis,
        handle,
    };
    // A deadline for a loaded machine, not a speed to meet.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match app.http.get(app.url("/healthz")).send().await {
            Ok(res) if res.status() == 200 => return app,
            _ if Instant::now() < deadline => {
                actix_web::rt::time::sleep(Duration::from_millis(10)).await;
            }
            other => panic!("the app does not answer: {other:?}"),
        }
    }
}

impl KeysApp {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.address)
    }

    /// `POST /whoami` with this content type and body, and extra headers.
    async fn post(
        &self,
        content_type: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut req = self
            .http
            .post(self.url("/whoami"))
            .header("content-type", content_type)
            .body(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send().await.unwrap()
    }

    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut req = self.http.get(self.url(path));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send().await.unwrap()
    }
}

const FORM_RULE: &str = r#"
[[rule]]
name = "phone"
paths = ["/whoami"]
methods = ["POST"]
key = "form:phone"
normalize = "e164"
limit = 1
window = "1m"
deny = "status"
"#;

const URLENCODED: &str = "application/x-www-form-urlencoded";

fn utf16(text: &str, big_endian: bool) -> Vec<u8> {
    text.encode_utf16()
        .flat_map(|u| {
            if big_endian {
                u.to_be_bytes()
            } else {
                u.to_le_bytes()
            }
        })
        .collect()
}

/// `text` in `charset`, as a client would send it.
fn encode(charset: &str, text: &str) -> Vec<u8> {
    match charset {
        "utf-16le" | "utf-16" => utf16(text, false),
        "utf-16be" => utf16(text, true),
        _ => {
            let encoding = encoding_rs::Encoding::for_label(charset.as_bytes()).unwrap();
            let (bytes, _, unmappable) = encoding.encode(text);
            assert!(!unmappable, "{charset}: {text}");
            bytes.into_owned()
        }
    }
}

/// Every charset actix decodes forms in: a body in it is counted under the
/// very key the handler's value makes (a first request in the charset
/// spends the number's one unit, and the same number in UTF-8 is then
/// denied), or refused with 415. Never a third key.
#[actix_web::test]
async fn form_charsets_are_read_as_the_handler_reads_them_or_refused() {
    let app = spawn(FORM_RULE).await;
    let charsets = [
        "utf-8",
        "UTF-8",
        "utf-16le",
        "utf-16be",
        "utf-16",
        "iso-8859-1",
        "latin1",
        "windows-1252",
        "shift_jis",
        "iso-2022-jp",
        "euc-jp",
        "euc-kr",
        "gbk",
        "gb18030",
        "big5",
        "koi8-r",
        "us-ascii",
    ];
    for (i, charset) in charsets.iter().enumerate() {
        let number = format!("+1555010{:04}", 7000 + i);
        let body = format!("x=1&phone={}&y=2", number.replace('+', "%2B"));
        let content_type = format!("{URLENCODED}; charset={charset}");
        let res = app.post(&content_type, encode(charset, &body), &[]).await;
        assert_eq!(res.status(), 200, "{charset}");
        assert_eq!(
            res.text().await.unwrap(),
            number,
            "{charset}: the handler's value"
        );
        let key = format!("floodgate:phone:form:{number}");
        assert_eq!(app.redis.llen(&key), 1, "{charset}: counted under {key}");
        // The same number in UTF-8 meets the same counter.
        let res = app.post(URLENCODED, body.into_bytes(), &[]).await;
        assert_eq!(res.status(), 429, "{charset}");
    }
    // The field name itself hidden by the charset: an escape sequence that
    // switches ISO-2022-JP to ASCII in the middle of "phone", and the name
    // in UTF-16 (no ASCII "phone" in the bytes at all).
    let jis = b"pho\x1b(Bne=%2B15550107999&n=\x1b$B\x24\x22\x1b(B".to_vec();
    let res = app
        .post(&format!("{URLENCODED}; charset=iso-2022-jp"), jis, &[])
        .await;
    assert_eq!(res.status(), 200);
    assert_eq!(res.text().await.unwrap(), "+15550107999");
    let res = app
        .post(URLENCODED, b"phone=%2B15550107999".to_vec(), &[])
        .await;
    assert_eq!(res.status(), 429, "the escaped name is the same field");
    // Charsets no handler reads the same way, undecodable bodies, content
    // codings: 415, and nothing counted.
    let before = app.redis.keys("floodgate:*");
    type Case<'a> = (&'a str, Vec<u8>, &'a [(&'a str, &'a str)]);
    let refused: [Case; 6] = [
        ("utf-7", b"phone=%2B15550108000".to_vec(), &[]),
        ("iso-2022-kr", b"phone=%2B15550108000".to_vec(), &[]),
        ("x-unknown", b"phone=%2B15550108000".to_vec(), &[]),
        ("utf-16le", b"p\0h\0o\0n\0e\0=\x001".to_vec(), &[]),
        ("shift_jis", b"phone=1\x81".to_vec(), &[]),
        (
            "utf-8",
            b"phone=%2B15550108000".to_vec(),
            &[("content-encoding", "gzip")],
        ),
    ];
    for (charset, body, headers) in refused {
        let res = app
            .post(&format!("{URLENCODED}; charset={charset}"), body, headers)
            .await;
        assert_eq!(res.status(), 415, "{charset} {headers:?}");
    }
    assert_eq!(app.redis.keys("floodgate:*"), before);
}

/// A key field that handlers could read differently is refused (400):
/// repeated (a map takes the last, a struct refuses, a list the first), or
/// not UTF-8 once percent-decoded. Headers: repeated, or not visible ASCII.
#[actix_web::test]
async fn ambiguous_key_values_are_refused_not_keyed_by_something_else() {
    let app = spawn(&format!(
        r#"{FORM_RULE}
[[rule]]
name = "q"
paths = ["/answer"]
key = ["query:user", "header:x-user"]
limit = 1
window = "1m"
deny = "status"
"#
    ))
    .await;
    for body in [
        "phone=%2B15550107000&phone=%2B15550107001",
        "phone=%2B15550107000&ph%6Fne=%2B15550107001",
        "phone=%2B1555010700%FF",
    ] {
        let res = app.post(URLENCODED, body.as_bytes().to_vec(), &[]).await;
        assert_eq!(res.status(), 400, "{body}");
    }
    // `+` and %20 are both a space, to the handler and to the key.
    let res = app
        .post(URLENCODED, b"phone=%2B1+555%20010+7000".to_vec(), &[])
        .await;
    assert_eq!(res.status(), 200);
    assert_eq!(res.text().await.unwrap(), "+1 555 010 7000");
    let res = app
        .post(URLENCODED, b"phone=%2B1%20555+010%207000".to_vec(), &[])
        .await;
    assert_eq!(res.status(), 429);

    for query in ["/answer?user=a&user=b", "/answer?user=%C3%28"] {
        let res = app.get(query, &[("x-user", "1")]).await;
        assert_eq!(res.status(), 400, "{query}");
    }
    let res = app
        .http
        .get(app.url("/answer?user=a"))
        .header("x-user", "1")
        .header("x-user", "2")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 400, "repeated header");
    let res = app
        .http
        .get(app.url("/answer?user=a"))
        .header(
            "x-user",
            reqwest::header::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 400, "obs-text header");
    assert_eq!(app.redis.keys("floodgate:q:*"), Vec::<String>::new());
    // Read once and cleanly, both parts make one key.
    let res = app.get("/answer?user=a%7Cb", &[("x-user", "c")]).await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        app.redis.keys("floodgate:q:*"),
        vec!["floodgate:q:query+header:a%7Cb|c".to_string()]
    );
}

const BEHIND_NGINX: &str = r#"
[server]
trusted_proxies = ["127.0.0.1"]

[[rule]]
name = "per_ip"
paths = ["/answer"]
limit = 5
window = "1m"
deny = "status"
"#;

/// nginx appends the client's address to X-Forwarded-For and passes the
/// client's own `Forwarded` on. With `proxy_header` at its default only
/// X-Forwarded-For is read: a `Forwarded` the client wrote (rotating, or
/// one its own proxy added) neither picks a key nor merges clients into the
/// proxy's own address. Two clients behind the proxy keep their own counters.
#[actix_web::test]
async fn behind_a_proxy_that_writes_x_forwarded_for_a_forwarded_header_is_ignored() {
    let app = spawn(BEHIND_NGINX).await;
    for i in 0..8 {
        let forwarded = format!("for=203.0.113.{i}");
        let res = app
            .get(
                "/answer",
                &[
                    ("forwarded", &forwarded),
                    ("x-forwarded-for", "198.51.100.7, 192.0.2.1"),
                ],
            )
            .await;
        assert_eq!(res.status(), if i < 5 { 200 } else { 429 }, "request {i}");
    }
    // A second client, whose own proxy added `Forwarded`, is not locked out
    // with the first.
    for i in 0..5 {
        let res = app
            .get(
                "/answer",
                &[
                    ("forwarded", "for=10.1.1.1"),
                    ("x-forwarded-for", "192.0.2.2"),
                ],
            )
            .await;
        assert_eq!(res.status(), 200, "second client, request {i}");
    }
    let mut keys = app.redis.keys("floodgate:per_ip:ip:*");
    keys.sort();
    assert_eq!(
        keys,
        vec![
            "floodgate:per_ip:ip:192.0.2.1".to_string(),
            "floodgate:per_ip:ip:192.0.2.2".to_string(),
        ]
    );
}

/// `proxy_header = "forwarded"`: the proxy writes `Forwarded`, and an
/// X-Forwarded-For the client sent is never read.
#[actix_web::test]
async fn behind_a_proxy_that_writes_forwarded_x_forwarded_for_is_ignored() {
    let app = spawn(&BEHIND_NGINX.replace(
        "trusted_proxies = [\"127.0.0.1\"]",
        "trusted_proxies = [\"127.0.0.1\"]\nproxy_header = \"forwarded\"",
    ))
    .await;
    for i in 0..8 {
        let xff = format!("203.0.113.{i}");
        let res = app
            .get(
                "/answer",
                &[
                    ("x-forwarded-for", &xff),
                    ("forwarded", "for=198.51.100.7, for=\"192.0.2.1\""),
                ],
            )
            .await;
        assert_eq!(res.status(), if i < 5 { 200 } else { 429 }, "request {i}");
    }
    // Another client behind the same proxy has its own counter.
    let res = app
        .get(
            "/answer",
            &[
                ("x-forwarded-for", "192.0.2.1"),
                ("forwarded", "for=192.0.2.3"),
            ],
        )
        .await;
    assert_eq!(res.status(), 200);
    // Only X-Forwarded-For: the header is not read, the proxy is the client.
    let res = app
        .get("/answer", &[("x-forwarded-for", "192.0.2.4")])
        .await;
    assert_eq!(res.status(), 200);
    let mut keys = app.redis.keys("floodgate:per_ip:ip:*");
    keys.sort();
    assert_eq!(
        keys,
        vec![
            "floodgate:per_ip:ip:127.0.0.1".to_string(),
            "floodgate:per_ip:ip:192.0.2.1".to_string(),
            "floodgate:per_ip:ip:192.0.2.3".to_string(),
        ]
    );
}

/// `key = ["form:phone", "ip"]`: one counter per number per address. A
/// number spent from one address is untouched from another; a request
/// without a number is counted by its address alone.
#[actix_web::test]
async fn composite_keys_count_each_phone_per_address() {
    let app = spawn(
        r#"
[server]
trusted_proxies = ["127.0.0.1"]

[[rule]]
name = "combo"
paths = ["/whoami"]
key = ["form:phone", "ip"]
normalize = "e164"
limit = 2
window = "1m"
deny = "status"
"#,
    )
    .await;
    let from = |ip: &'static str| [("x-forwarded-for", ip)];
    let victim = b"phone=%2B15550107777".to_vec();
    for expected in [200, 200, 429] {
        let res = app.post(URLENCODED, victim.clone(), &from("6.6.6.6")).await;
        assert_eq!(res.status(), expected);
    }
    let res = app.post(URLENCODED, victim.clone(), &from("7.7.7.7")).await;
    assert_eq!(res.status(), 200, "another address is not locked out");
    assert_eq!(remaining(&res, "combo"), Some(1));
    let res = app
        .post(URLENCODED, b"x=1".to_vec(), &from("6.6.6.6"))
        .await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        app.redis.keys("floodgate:combo:*"),
        vec![
            "floodgate:combo:form+ip:+15550107777|6.6.6.6".to_string(),
            "floodgate:combo:form+ip:+15550107777|7.7.7.7".to_string(),
            "floodgate:combo:ip:6.6.6.6".to_string(),
        ]
    );
}

/// `+1 555 010 7777`, `1 555 010 7777`, `(555) 010-7777` and
/// `011 1 555 010 7777` are one number; `001 …`, `0001 …`, `00001 …` are
/// no US number and are counted by address, all together.
#[actix_web::test]
async fn phone_formats_share_one_counter() {
    let app = spawn(&FORM_RULE.replace("limit = 1", "limit = 4")).await;
    for phone in [
        "%2B1+555+010+7777",
        "1+555+010+7777",
        "%28555%29+010-7777",
        "011+1+555+010+7777",
        "555.010.7777",
    ] {
        let body = format!("phone={phone}").into_bytes();
        let res = app.post(URLENCODED, body, &[]).await;
        let want = if phone.starts_with("555.") { 429 } else { 200 };
        assert_eq!(res.status(), want, "{phone}");
    }
    assert_eq!(app.redis.llen("floodgate:phone:form:+15550107777"), 4);
    for phone in [
        "001+555+010+7777",
        "0001+555+010+7777",
        "00001+555+010+7777",
    ] {
        let body = format!("phone={phone}").into_bytes();
        assert_eq!(app.post(URLENCODED, body, &[]).await.status(), 200);
    }
    assert_eq!(app.redis.llen("floodgate:phone:ip:127.0.0.1"), 3);
    assert_eq!(app.redis.keys("floodgate:phone:form:*").len(), 1);
}

/// Numbers of other countries keep their own counters, written with `+`
/// whatever the region: two German numbers a digit apart are two keys, a
/// Paris number is a key, and a number that is no possible one is counted
/// by address.
#[actix_web::test]
async fn numbers_of_other_countries_are_keyed_exactly() {
    let app = spawn(FORM_RULE).await;
    for (phone, key) in [
        ("%2B49+160+1234567", "+491601234567"),
        ("%2B49+60+1234567", "+49601234567"),
        ("%2B49+151+12345678", "+4915112345678"),
        ("%2B33+1+23+45+67+89", "+33123456789"),
        ("%2B55+11+91234+5678", "+5511912345678"),
        ("011+81+90+1234+5678", "+819012345678"),
    ] {
        let body = format!("phone={phone}").into_bytes();
        assert_eq!(
            app.post(URLENCODED, body, &[]).await.status(),
            200,
            "{phone}"
        );
        assert_eq!(
            app.redis.llen(&format!("floodgate:phone:form:{key}")),
            1,
            "{phone}"
        );
    }
    let body = b"phone=%2B33+1+23+45+67".to_vec();
    assert_eq!(app.post(URLENCODED, body, &[]).await.status(), 200);
    assert_eq!(app.redis.llen("floodgate:phone:ip:127.0.0.1"), 1);
    assert_eq!(app.redis.keys("floodgate:phone:form:*").len(), 6);
}

/// `count = "failures"`: answers below 400 give their units back, answers
/// of 400 and above keep them, for every algorithm.
#[actix_web::test]
async fn count_failures_gives_back_what_successes_took() {
    let rules = r#"
[defaults]
count = "failures"
deny = "status"

[[rule]]
name = "sliding"
paths = ["/answer"]
limit = 3
window = "1m"

[[rule]]
name = "fixed"
paths = ["/answer"]
algorithm = "fixed_window"
limit = 3
window = "1m"

[[rule]]
name = "bucket"
paths = ["/answer"]
algorithm = "token_bucket"
rate = 0.01
burst = 3
"#;
    let app = spawn(rules).await;
    for status in [200, 204, 303, 399, 200, 302, 200] {
        let res = app.get(&format!("/answer?status={status}"), &[]).await;
        assert_eq!(res.status().as_u16(), status);
        for rule in ["sliding", "fixed", "bucket"] {
            assert_eq!(remaining(&res, rule), Some(3), "{rule} after {status}");
        }
    }
    assert_eq!(app.redis.llen("floodgate:sliding:ip:127.0.0.1"), 0);
    for (status, left) in [(401, 2), (400, 1), (500, 0)] {
        let res = app.get(&format!("/answer?status={status}"), &[]).await;
        assert_eq!(res.status().as_u16(), status);
        for rule in ["sliding", "fixed", "bucket"] {
            assert_eq!(remaining(&res, rule), Some(left), "{rule} after {status}");
        }
    }
    let res = app.get("/answer?status=200", &[]).await;
    assert_eq!(res.status(), 429, "the failures spent the limit");
    assert_eq!(app.redis.llen("floodgate:sliding:ip:127.0.0.1"), 3);
}
