//! Real Redis Cluster and Sentinel setups for the tests: three cluster
//! masters joined with `redis-cli --cluster create`, or a master, a replica
//! and a Sentinel. Every process runs on free loopback ports (a cluster
//! node also needs its port + 10000 for the cluster bus) and is killed on
//! drop. Also a browser for the site's flows that records every status it
//! is answered, for tests that must show what a visitor saw throughout.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::helpers::wait_until;

/// A port that is free, with port + 10000 free as well (cluster bus).
fn free_cluster_port() -> u16 {
    loop {
        let low = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = low.local_addr().unwrap().port();
        if port >= 55535 {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

/// A private directory for config files.
fn temp_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "{name}-{}-{}",
        std::process::id(),
        super::helpers::free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One redis-server process, killed on drop.
pub struct Node {
    pub port: u16,
    child: Option<Child>,
}

impl Node {
    /// A cluster-enabled node on a free port (and its bus port), once it
    /// answers PING. A port taken between the choice and the start makes
    /// redis-server exit: another port is tried then.
    fn start(dir: &Path) -> Node {
        for _ in 0..5 {
            let port = free_cluster_port();
            let config = dir.join(format!("nodes-{port}.conf"));
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .arg("--cluster-config-file")
                .arg(&config)
                .arg("--dir")
                .arg(dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed");
            let mut node = Node {
                port,
                child: Some(child),
            };
            // A deadline for a loaded machine, not a speed to meet.
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if node.query::<String>(&redis::cmd("PING")).is_some() {
                    return node;
                }
                if let Some(child) = node.child.as_mut() {
                    if child.try_wait().unwrap().is_some() {
                        node.child = None;
                        break;
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            node.kill();
        }
        panic!("no cluster node started on any of 5 free ports");
    }

    fn spawn(port: u16, args: &[String]) -> Node {
        let child = Command::new("redis-server")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed");
        Node {
            port,
            child: Some(child),
        }
    }

    /// A connection to this node alone (2 s timeouts).
    pub fn connection(&self) -> Option<redis::Connection> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}/", self.port)).ok()?;
        let conn = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .ok()?;
        conn.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        Some(conn)
    }

    /// Sends one command to this node.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Option<T> {
        cmd.query(&mut self.connection()?).ok()
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Three cluster masters with every slot assigned.
pub struct Cluster {
    pub nodes: Vec<Node>,
}

impl Cluster {
    /// Starts three nodes, joins them, waits for `cluster_state:ok` on all.
    pub fn start() -> Cluster {
        Cluster::with_replicas(0)
    }

    /// Three masters with `replicas` replicas each, joined; waits for
    /// `cluster_state:ok` on all, and for every replica's link to its
    /// master to be up (a replica that never synced cannot take over).
    pub fn with_replicas(replicas: usize) -> Cluster {
        let dir = temp_dir("cluster");
        let nodes: Vec<Node> = (0..3 * (1 + replicas)).map(|_| Node::start(&dir)).collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli is installed");
        assert!(status.success(), "redis-cli --cluster create failed");
        let cluster = Cluster { nodes };
        cluster.wait_ok();
        for node in &cluster.nodes {
            wait_until(Duration::from_secs(30), "every replica in sync", || {
                node.query::<String>(redis::cmd("INFO").arg("replication"))
                    .is_some_and(|info| {
                        info.contains("role:master") || info.contains("master_link_status:up")
                    })
            });
        }
        cluster
    }

    /// The indexes of the nodes that are masters now.
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i]
                    .query::<String>(redis::cmd("INFO").arg("replication"))
                    .is_some_and(|info| info.contains("role:master"))
            })
            .collect()
    }

    /// Waits until every node says `cluster_state:ok`.
    pub fn wait_ok(&self) {
        for node in &self.nodes {
            wait_until(Duration::from_secs(20), "cluster_state:ok", || {
                node.query::<String>(redis::cmd("CLUSTER").arg("INFO"))
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            });
        }
    }

    /// The seed URLs for `[redis] cluster`.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}/", n.port))
            .collect()
    }

    /// A cluster connection for the test's own reads.
    pub fn connection(&self) -> redis::cluster::ClusterConnection {
        redis::cluster::ClusterClient::new(self.seeds())
            .unwrap()
            .get_connection()
            .unwrap()
    }

    /// The node ID of node `i`.
    pub fn id(&self, i: usize) -> String {
        self.nodes[i]
            .query(redis::cmd("CLUSTER").arg("MYID"))
            .expect("the node answers")
    }

    /// Moves `slots` slots from node `from` to node `to` with redis-cli,
    /// keys included. Blocking.
    pub fn reshard(&self, from: usize, to: usize, slots: u32) {
        let status = Command::new("redis-cli")
            .args(["--cluster", "reshard"])
            .arg(format!("127.0.0.1:{}", self.nodes[0].port))
            .args(["--cluster-from", &self.id(from)])
            .args(["--cluster-to", &self.id(to)])
            .args(["--cluster-slots", &slots.to_string()])
            .args(["--cluster-yes", "--cluster-pipeline", "100"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli is installed");
        assert!(status.success(), "redis-cli --cluster reshard failed");
    }

    /// How many keys each node holds.
    pub fn keys_per_node(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .map(|n| n.query(&redis::cmd("DBSIZE")).unwrap_or(0))
            .collect()
    }
}

/// A master, one replica and one Sentinel watching them as `fg`.
pub struct Sentinel {
    pub master: Node,
    pub replica: Node,
    pub sentinel: Node,
}

/// The name the Sentinel knows the master by.
pub const MASTER_NAME: &str = "fg";

impl Sentinel {
    /// Starts all three and waits until the Sentinel knows the replica.
    pub fn start() -> Sentinel {
        let dir = temp_dir("sentinel");
        let plain = |port: u16, extra: &[String]| {
            let mut args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                &dir.display().to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.extend_from_slice(extra);
            args
        };
        let master_port = super::helpers::free_port();
        let master = Node::spawn(master_port, &plain(master_port, &[]));
        let replica_port = super::helpers::free_port();
        let replica = Node::spawn(
            replica_port,
            &plain(
                replica_port,
                &[
                    "--replicaof".into(),
                    "127.0.0.1".into(),
                    master_port.to_string(),
                ],
            ),
        );
        let sentinel_port = super::helpers::free_port();
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {sentinel_port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds {MASTER_NAME} 500\n\
                 sentinel failover-timeout {MASTER_NAME} 3000\n",
                dir.display()
            ),
        )
        .unwrap();
        let sentinel = Node::spawn(
            sentinel_port,
            &[conf.display().to_string(), "--sentinel".into()],
        );
        let setup = Sentinel {
            master,
            replica,
            sentinel,
        };
        wait_until(
            Duration::from_secs(20),
            "the Sentinel to see the replica",
            || {
                setup
                    .sentinel
                    .query::<Vec<redis::Value>>(
                        redis::cmd("SENTINEL").arg("REPLICAS").arg(MASTER_NAME),
                    )
                    .is_some_and(|r| !r.is_empty())
                    && setup
                        .replica
                        .query::<String>(redis::cmd("INFO").arg("replication"))
                        .is_some_and(|i| i.contains("master_link_status:up"))
            },
        );
        setup
    }

    /// The Sentinel's URL for `[redis] sentinel`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.sentinel.port)
    }

    /// The port the Sentinel names as master now.
    pub fn master_port(&self) -> Option<u16> {
        let addr: Vec<String> = self.sentinel.query(
            redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(MASTER_NAME),
        )?;
        addr.get(1)?.parse().ok()
    }

    /// Has the Sentinel promote the replica while the master stays up
    /// (`SENTINEL FAILOVER`, as for maintenance), and waits until the
    /// Sentinel names the replica as master and the replica says so too.
    /// The old master is demoted by the Sentinel only some seconds later.
    pub fn switch_over(&self) {
        // A Sentinel that has just found the replica has no INFO of its own
        // from it yet, and refuses (NOGOODSLAVE) until it has.
        let mut answer = String::new();
        wait_until(
            Duration::from_secs(20),
            "the Sentinel to accept the failover",
            || {
                let mut conn = self.sentinel.connection().expect("the Sentinel answers");
                answer = match redis::cmd("SENTINEL")
                    .arg("FAILOVER")
                    .arg(MASTER_NAME)
                    .query::<String>(&mut conn)
                {
                    Ok(ok) => ok,
                    Err(e) => e.to_string(),
                };
                !answer.contains("NOGOODSLAVE")
            },
        );
        assert_eq!(answer, "OK");
        self.wait_promoted();
    }

    /// Waits until the Sentinel names the replica, and the replica says it
    /// is master.
    fn wait_promoted(&self) {
        wait_until(
            Duration::from_secs(20),
            "the replica to be promoted",
            || {
                self.master_port() == Some(self.replica.port)
                    && self
                        .replica
                        .query::<String>(redis::cmd("INFO").arg("replication"))
                        .is_some_and(|i| i.contains("role:master"))
            },
        );
    }

    /// Kills the master and waits until the Sentinel has promoted the replica.
    pub fn fail_master(&mut self) {
        self.master.kill();
        self.wait_promoted();
    }
}

/// Every status the site answered, with the request it answered, in order:
/// shared by the browsers of one test (and their clones in spawned tasks).
#[derive(Clone, Default)]
pub struct Statuses(Arc<Mutex<Vec<(String, u16)>>>);

impl Statuses {
    fn record(&self, request: String, status: u16) {
        self.0.lock().unwrap().push((request, status));
    }

    /// Every answer so far.
    pub fn all(&self) -> Vec<(String, u16)> {
        self.0.lock().unwrap().clone()
    }

    /// The answers that were a server error other than 503 (which says
    /// "try again in a moment", and is what Redis being away may cost).
    pub fn server_errors(&self) -> Vec<(String, u16)> {
        self.all()
            .into_iter()
            .filter(|&(_, s)| s >= 500 && s != 503)
            .collect()
    }
}

/// One answer, read in full.
#[derive(Debug)]
pub struct Page {
    pub status: u16,
    pub location: Option<String>,
    pub body: String,
}

/// One visitor of the site: its own cookie jar, no redirects followed,
/// every answer recorded in a [`Statuses`].
#[derive(Clone)]
pub struct Browser {
    address: String,
    http: reqwest::Client,
    statuses: Statuses,
}

impl Browser {
    /// A visitor of the site at `address` (`http://127.0.0.1:PORT`).
    pub fn new(address: &str, statuses: &Statuses) -> Browser {
        Browser {
            address: address.to_string(),
            http: reqwest::Client::builder()
                .cookie_store(true)
                .redirect(reqwest::redirect::Policy::none())
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap(),
            statuses: statuses.clone(),
        }
    }

    async fn read(&self, request: String, res: reqwest::Response) -> Page {
        let status = res.status().as_u16();
        let location = res
            .headers()
            .get("location")
            .map(|v| v.to_str().unwrap().to_string());
        let body = res.text().await.unwrap();
        self.statuses.record(request, status);
        Page {
            status,
            location,
            body,
        }
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> Page {
        let res = self
            .http
            .get(format!("{}{path}", self.address))
            .send()
            .await
            .unwrap();
        self.read(format!("GET {path}"), res).await
    }

    /// `POST path` with `fields` and this session's CSRF token (read from
    /// `/login` first; when that page fails, its answer is returned).
    pub async fn post(&self, path: &str, fields: &[(&str, &str)]) -> Page {
        let login = self.get("/login").await;
        if login.status != 200 {
            return login;
        }
        let at = login
            .body
            .find("name=\"csrf\" value=\"")
            .expect("a csrf field")
            + 19;
        let csrf = &login.body[at..at + 64];
        let mut all = fields.to_vec();
        all.push(("csrf", csrf));
        let res = self
            .http
            .post(format!("{}{path}", self.address))
            .form(&all)
            .send()
            .await
            .unwrap();
        self.read(format!("POST {path}"), res).await
    }

    /// Signs in by SMS code as `phone` (E.164): asks for a code, reads it
    /// from the outbox, sends it. Returns the answer to the code.
    pub async fn sign_in(&self, phone: &str) -> Page {
        let page = self.post("/sms/send", &[("phone", phone)]).await;
        assert_eq!(page.status, 200, "{page:?}");
        let code = code_in(&self.outbox().await.unwrap(), phone, "sign-in code").unwrap();
        self.post("/login/sms", &[("phone", phone), ("code", &code)])
            .await
    }

    /// The outbox (`/dev/outbox` as JSON, newest first), or the failed page.
    pub async fn outbox(&self) -> Result<Vec<serde_json::Value>, Page> {
        let res = self
            .http
            .get(format!("{}/dev/outbox", self.address))
            .header("accept", "application/json")
            .send()
            .await
            .unwrap();
        let page = self.read("GET /dev/outbox".into(), res).await;
        if page.status != 200 {
            return Err(page);
        }
        let v: serde_json::Value = serde_json::from_str(&page.body).unwrap();
        Ok(v.as_array().unwrap().clone())
    }
}

/// The 6-digit code in the newest outbox message to `phone` (E.164) whose
/// text contains `kind` ("sign-in code", "reset code").
pub fn code_in(messages: &[serde_json::Value], phone: &str, kind: &str) -> Option<String> {
    let text = messages
        .iter()
        .filter(|m| m["phone"] == phone)
        .filter_map(|m| m["text"].as_str())
        .find(|t| t.contains(kind))?;
    let at = text.find(|c: char| c.is_ascii_digit())?;
    Some(text[at..at + 6].to_string())
}
