//! A minimal W3C WebDriver client over reqwest, enough to drive the
//! system's headless Chromium through chromedriver: navigate, type, click,
//! read text, take screenshots.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A running chromedriver, killed on drop.
pub struct Driver {
    child: Child,
    base: String,
    http: reqwest::Client,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One browser session.
pub struct Browser {
    base: String,
    http: reqwest::Client,
}

/// An element handle.
pub struct Element {
    id: String,
}

fn find_program(names: &[&str]) -> String {
    for n in names {
        for dir in ["/usr/bin", "/usr/local/bin", "/usr/lib/chromium"] {
            let p = format!("{dir}/{n}");
            if std::path::Path::new(&p).exists() {
                return p;
            }
        }
    }
    panic!(
        "none of {names:?} is installed: scripts/test installs the Debian packages chromium and chromium-driver"
    );
}

impl Driver {
    /// Starts chromedriver on a free port and waits until it is ready.
    pub async fn start() -> Driver {
        let port = super::helpers::free_port();
        let program = find_program(&["chromedriver"]);
        let child = Command::new(program)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let driver = Driver {
            child,
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = driver
                .http
                .get(format!("{}/status", driver.base))
                .send()
                .await
            {
                if let Ok(v) = r.json::<Value>().await {
                    if v["value"]["ready"] == json!(true) {
                        break;
                    }
                }
            }
            assert!(Instant::now() < deadline, "chromedriver did not get ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        driver
    }

    /// Opens a headless Chromium window.
    pub async fn browser(&self) -> Browser {
        let chromium = find_program(&["chromium", "chromium-browser"]);
        let profile = std::env::temp_dir().join(format!(
            "floodgate-chromium-{}-{}",
            std::process::id(),
            super::helpers::free_port()
        ));
        let caps = json!({
            "capabilities": { "alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": chromium,
                    "args": [
                        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync",
                        "--disable-dev-shm-usage", "--window-size=1280,900",
                        format!("--user-data-dir={}", profile.display()),
                    ]
                }
            }}
        });
        let v: Value = self
            .http
            .post(format!("{}/session", self.base))
            .json(&caps)
            .send()
            .await
            .expect("new session")
            .json()
            .await
            .expect("session json");
        let id = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {v}"))
            .to_string();
        Browser {
            base: format!("{}/session/{id}", self.base),
            http: self.http.clone(),
        }
    }
}

impl Browser {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let v: Value = req
            .send()
            .await
            .expect("webdriver call")
            .json()
            .await
            .expect("webdriver json");
        if v["value"].get("error").is_some() {
            panic!("webdriver {path}: {}", v["value"]);
        }
        v["value"].clone()
    }

    /// Loads a URL and waits for the page.
    pub async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    /// The current URL.
    pub async fn url(&self) -> String {
        self.call(reqwest::Method::GET, "/url", None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// The first element matching a CSS selector.
    pub async fn find(&self, css: &str) -> Element {
        let v = self
            .call(
                reqwest::Method::POST,
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        Element {
            id: v[ELEMENT].as_str().expect("element id").to_string(),
        }
    }

    /// Types into an element.
    pub async fn type_into(&self, el: &Element, text: &str) {
        self.call(
            reqwest::Method::POST,
            &format!("/element/{}/value", el.id),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// Clicks an element.
    pub async fn click(&self, el: &Element) {
        self.call(
            reqwest::Method::POST,
            &format!("/element/{}/click", el.id),
            Some(json!({})),
        )
        .await;
    }

    /// The visible text of an element.
    pub async fn text(&self, el: &Element) -> String {
        self.call(
            reqwest::Method::GET,
            &format!("/element/{}/text", el.id),
            None,
        )
        .await
        .as_str()
        .unwrap_or_default()
        .to_string()
    }

    /// Runs JavaScript in the page and returns its value.
    pub async fn eval(&self, script: &str) -> Value {
        self.call(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({ "script": script, "args": [] })),
        )
        .await
    }

    /// Saves a PNG screenshot of the window.
    pub async fn screenshot(&self, path: &std::path::Path) {
        let b64 = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64_decode(b64.as_str().expect("screenshot data"));
        assert!(png.starts_with(b"\x89PNG"), "a screenshot is a PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(path, png).unwrap();
    }

    /// Ends the session (closes the browser).
    pub async fn quit(self) {
        let _ = self.http.delete(&self.base).send().await;
    }
}

fn base64_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => continue,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}
