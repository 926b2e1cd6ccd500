//! Real Redis Cluster and Sentinel setups for the tests: three cluster
//! masters joined with `redis-cli --cluster create`, or a master, a replica
//! and a Sentinel. Every process runs on free loopback ports (a cluster
//! node also needs its port + 10000 for the cluster bus) and is killed on
//! drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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
        let dir = temp_dir("cluster");
        let mut nodes = Vec::new();
        for _ in 0..3 {
            let port = free_cluster_port();
            let args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "2000",
                "--cluster-config-file",
                &dir.join(format!("nodes-{port}.conf")).display().to_string(),
                "--dir",
                &dir.display().to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            nodes.push(Node::spawn(port, &args));
        }
        for node in &nodes {
            wait_until(Duration::from_secs(10), "a cluster node to answer", || {
                node.query::<String>(&redis::cmd("PING")).is_some()
            });
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli is installed");
        assert!(status.success(), "redis-cli --cluster create failed");
        let cluster = Cluster { nodes };
        cluster.wait_ok();
        cluster
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

    /// Kills the master and waits until the Sentinel has promoted the replica.
    pub fn fail_master(&mut self) {
        self.master.kill();
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
}
