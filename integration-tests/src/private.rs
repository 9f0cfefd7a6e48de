//! Private servers for tests that kill or restart PostgreSQL or the broker: each test starts
//! its own from the local binaries, whatever mode the shared services run in.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::free_port;

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Runs a PostgreSQL binary as the `postgres` user when we are root (initdb and postgres
/// refuse to run as root); `setpriv` execs, so the child's pid is the server's.
fn pg_command(bin: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid",
            "postgres",
            "--regid",
            "postgres",
            "--init-groups",
        ])
        .arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

fn pg_bin(name: &str) -> PathBuf {
    let dir =
        std::env::var("POSTAL_PG_BIN").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into());
    PathBuf::from(dir).join(name)
}

/// A PostgreSQL server owned by one test.
pub struct PrivatePostgres {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl PrivatePostgres {
    /// Initialises a cluster in a fresh temporary directory and starts it on a free port.
    pub async fn start() -> PrivatePostgres {
        let dir = std::env::temp_dir().join(format!("postal-pg-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("pg dir");
        if is_root() {
            let ok = Command::new("chown")
                .arg("-R")
                .arg("postgres")
                .arg(&dir)
                .status();
            assert!(
                ok.map(|s| s.success()).unwrap_or(false),
                "chown {dir:?} to postgres"
            );
        }
        let out = pg_command(&pg_bin("initdb"))
            .arg("-D")
            .arg(dir.join("data"))
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
            ])
            .stdout(Stdio::null())
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = PrivatePostgres {
            dir,
            port: free_port(),
            child: None,
        };
        pg.restart().await;
        pg
    }

    /// URL of the `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// (Re)starts the server and waits until it accepts connections.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "server already running");
        let log = std::fs::File::create(
            self.dir
                .join(format!("log-{}", uuid::Uuid::now_v7().simple())),
        )
        .expect("log file");
        let child = pg_command(&pg_bin("postgres"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args([
                "-p",
                &self.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
            ])
            .arg("-k")
            .arg(&self.dir)
            // `wal_level=logical`: the chaos run's WAL relays read a logical slot.
            .args([
                "-c",
                "max_connections=200",
                "-c",
                "fsync=on",
                "-c",
                "wal_level=logical",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn postgres");
        self.child = Some(child);
        crate::wait::ready_postgres(&self.url(), Duration::from_secs(60))
            .await
            .expect("private postgres ready");
    }

    /// Crashes the server (SIGQUIT: immediate shutdown without checkpoint, like a crash of every
    /// process) and reaps it.
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-QUIT", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.crash();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The repository's root (where `scripts/stack.sh` lives).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// `bash scripts/stack.sh <command>` on a stack folder of its own (`dir`), with the test heap
/// (`POSTAL_TEST_KAFKA_HEAP`, 512m) and the repository's Kafka jars unless `POSTAL_KAFKA_LIB`
/// names others.
fn stack_command(dir: &Path, command: &str) -> Command {
    stack_command_on(None, dir, command)
}

/// [`stack_command`] run on a test host (`ip netns exec <netns>`) when `netns` is given.
pub(crate) fn stack_command_on(netns: Option<&str>, dir: &Path, command: &str) -> Command {
    let root = repo_root();
    let mut c = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "bash"]);
            c
        }
        None => Command::new("bash"),
    };
    c.arg(root.join("scripts/stack.sh"))
        .arg(command)
        .env("POSTAL_STACK_DIR", dir)
        .env(
            "POSTAL_KAFKA_HEAP",
            std::env::var("POSTAL_TEST_KAFKA_HEAP").unwrap_or_else(|_| "512m".into()),
        );
    if std::env::var_os("POSTAL_KAFKA_LIB").is_none() {
        c.env("POSTAL_KAFKA_LIB", root.join(".stack/kafka-lib"));
    }
    c
}

/// An Apache Kafka broker (single-node KRaft) owned by one test, started by `scripts/stack.sh`
/// in a folder of its own, so it can be killed with SIGKILL and restarted on the same data.
pub struct PrivateBroker {
    dir: PathBuf,
    port: u16,
    controller_port: u16,
    running: bool,
}

impl PrivateBroker {
    /// Starts a broker on free ports with storage in a fresh temporary directory.
    pub async fn start() -> PrivateBroker {
        let dir =
            std::env::temp_dir().join(format!("postal-kafka-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("broker dir");
        let mut b = PrivateBroker {
            dir,
            port: free_port(),
            controller_port: free_port(),
            running: false,
        };
        b.restart().await;
        b
    }

    /// Bootstrap servers of this broker.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn stack(&self, command: &'static str) -> Command {
        let mut c = stack_command(&self.dir, command);
        c.env("POSTAL_KAFKA_PORT", self.port.to_string())
            .env(
                "POSTAL_KAFKA_CONTROLLER_PORT",
                self.controller_port.to_string(),
            )
            .stdout(Stdio::null());
        c
    }

    /// (Re)starts the broker on the same ports and storage and waits until it answers.
    pub async fn restart(&mut self) {
        assert!(!self.running, "broker already running");
        let mut c = self.stack("kafka-up");
        let status = tokio::task::spawn_blocking(move || c.status())
            .await
            .expect("join")
            .expect("run scripts/stack.sh kafka-up");
        assert!(
            status.success(),
            "private broker did not start (logs: {})",
            self.dir.display()
        );
        self.running = true;
        crate::kafka::wait_ready(&self.bootstrap(), Duration::from_secs(60))
            .await
            .expect("private broker ready");
    }

    /// Stops the broker with SIGSTOP: connections stay open, requests in flight get no answer
    /// (a hung broker); [`Self::kill`] still works on it.
    pub fn freeze(&self) {
        let pid = std::fs::read_to_string(self.dir.join("kafka/kafka.pid")).expect("broker pid");
        let status = Command::new("kill")
            .args(["-STOP", pid.trim()])
            .status()
            .expect("kill -STOP");
        assert!(status.success(), "kill -STOP {pid}");
    }

    /// Kills the broker with SIGKILL and waits until it is gone.
    pub fn kill(&mut self) {
        if std::mem::take(&mut self.running) {
            let _ = self.stack("kafka-kill").status();
        }
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        self.kill();
        if std::env::var_os("POSTAL_TEST_KEEP").is_some() {
            eprintln!("keeping broker directory {}", self.dir.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A 3-node Apache Kafka cluster (every node a broker and a KRaft controller; topics replicated
/// 3 times, `min.insync.replicas=2`) owned by one test, started by `scripts/stack.sh --cluster 3`
/// in a folder of its own; each node can be killed with SIGKILL and started again on its data.
pub struct PrivateCluster {
    dir: PathBuf,
    base: u16,
    running: [bool; 3],
}

impl PrivateCluster {
    /// Starts the three nodes on six consecutive free ports and waits until they serve.
    pub async fn start() -> PrivateCluster {
        let dir =
            std::env::temp_dir().join(format!("postal-cluster-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("cluster dir");
        let base = loop {
            let first = free_port();
            if (1..6).all(|i| free_port() == first + i) {
                break first;
            }
        };
        let mut c = PrivateCluster {
            dir,
            base,
            running: [false; 3],
        };
        c.run_stack("kafka-up", None);
        c.running = [true; 3];
        crate::kafka::wait_ready(&c.bootstrap(), Duration::from_secs(60))
            .await
            .expect("cluster ready");
        c
    }

    /// Bootstrap servers: all three nodes.
    pub fn bootstrap(&self) -> String {
        (1..=3)
            .map(|n| format!("127.0.0.1:{}", self.port(n)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Client port of node `node` (1–3).
    pub fn port(&self, node: u8) -> u16 {
        self.base + 2 * (u16::from(node) - 1)
    }

    fn stack(&self, command: &'static str, node: Option<u8>) -> Command {
        let mut c = stack_command(&self.dir, command);
        c.args(["--cluster", "3"])
            .args(node.map(|n| n.to_string()))
            .env("POSTAL_KAFKA_CLUSTER_PORT", self.base.to_string())
            .stdout(Stdio::null());
        c
    }

    fn run_stack(&self, command: &'static str, node: Option<u8>) {
        let status = self
            .stack(command, node)
            .status()
            .expect("run scripts/stack.sh");
        assert!(
            status.success(),
            "scripts/stack.sh {command} --cluster 3 {node:?} failed (logs: {})",
            self.dir.display()
        );
    }

    /// Kills node `node` with SIGKILL (its data stays).
    pub fn kill(&mut self, node: u8) {
        self.run_stack("kafka-kill", Some(node));
        self.running[usize::from(node) - 1] = false;
    }

    /// Starts node `node` again on its data; waits until it says it has started. A node
    /// starts only while a majority of the controllers runs (it may be the majority itself).
    pub async fn restart(&mut self, node: u8) {
        let mut c = self.stack("kafka-up", Some(node));
        let status = tokio::task::spawn_blocking(move || c.status())
            .await
            .expect("join")
            .expect("run scripts/stack.sh");
        assert!(
            status.success(),
            "node {node} did not start (logs: {})",
            self.dir.display()
        );
        self.running[usize::from(node) - 1] = true;
    }

    /// Nodes running now (as far as this handle started and killed them).
    pub fn running(&self) -> Vec<u8> {
        (1..=3)
            .filter(|&n| self.running[usize::from(n) - 1])
            .collect()
    }

    /// The node that leads the KRaft controller quorum, from Kafka's own
    /// `MetadataQuorumCommand` (`None` if it cannot say).
    pub fn quorum_leader(&self) -> Option<u8> {
        let lib = std::env::var_os("POSTAL_KAFKA_LIB")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo_root().join(".stack/kafka-lib"));
        let servers = self
            .running()
            .iter()
            .map(|&n| format!("127.0.0.1:{}", self.port(n)))
            .collect::<Vec<_>>()
            .join(",");
        let out = Command::new("java")
            .arg("-Xmx256M")
            .arg("-cp")
            .arg(format!("{}/*", lib.display()))
            .arg("org.apache.kafka.tools.MetadataQuorumCommand")
            .args(["--bootstrap-server", &servers, "describe", "--status"])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("LeaderId:")?.trim().parse().ok())
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        if self.running.iter().any(|&r| r) {
            self.run_stack("kafka-kill", None);
        }
        if std::env::var_os("POSTAL_TEST_KEEP").is_some() {
            eprintln!("keeping cluster directory {}", self.dir.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// PostgreSQL and a single-node Apache Kafka broker on a test host (a network namespace of
/// [`crate::hosts::TestHosts`]), listening on the host's address (PostgreSQL on 5432, Kafka on
/// 9092), started by `scripts/stack.sh` in a folder of its own; stopped on drop.
pub struct HostStack {
    dir: PathBuf,
    netns: String,
    addr: String,
}

impl HostStack {
    /// Starts both and waits until they accept connections.
    pub fn start(netns: &str, addr: &str) -> HostStack {
        let dir = std::env::temp_dir().join(format!(
            "postal-host-stack-{}",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&dir).expect("stack dir");
        let s = HostStack {
            dir,
            netns: netns.to_owned(),
            addr: addr.to_owned(),
        };
        let out = s
            .command("up")
            .env("POSTAL_NO_RABBITMQ", "1")
            .output()
            .expect("run scripts/stack.sh up");
        assert!(
            out.status.success(),
            "stack on {netns} did not start: {}\nbroker.log: {}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(s.dir.join("kafka/logs/broker.log")).unwrap_or_default()
        );
        s
    }

    fn command(&self, command: &str) -> Command {
        let mut c = stack_command_on(Some(&self.netns), &self.dir, command);
        c.env("POSTAL_STACK_HOST", &self.addr)
            .env("POSTAL_PG_PORT", "5432")
            .env("POSTAL_KAFKA_PORT", "9092")
            .env("POSTAL_KAFKA_CONTROLLER_PORT", "9093")
            .env("POSTAL_NO_RABBITMQ", "1");
        c
    }

    /// The server's admin URL (database `postgres`).
    pub fn database_url(&self) -> String {
        format!("postgres://postgres@{}:5432/postgres", self.addr)
    }

    /// The broker's bootstrap address.
    pub fn bootstrap(&self) -> String {
        format!("{}:9092", self.addr)
    }
}

impl Drop for HostStack {
    fn drop(&mut self) {
        let _ = self.command("down").output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
