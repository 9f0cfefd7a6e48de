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
            .args(["-c", "max_connections=200", "-c", "fsync=on"])
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

/// Path of the tansu binary: `POSTAL_TANSU_BIN`, `tansu` on PATH, or `~/.cargo/bin/tansu`.
pub fn tansu_bin() -> PathBuf {
    if let Ok(p) = std::env::var("POSTAL_TANSU_BIN") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("tansu"))
            .find(|p| p.is_file())
    }) {
        return p;
    }
    PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cargo/bin/tansu")
}

/// A tansu broker owned by one test, with durable sqlite storage so it can be killed and
/// restarted without losing records.
pub struct PrivateBroker {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl PrivateBroker {
    /// Starts a broker on a free port with storage in a fresh temporary directory.
    pub async fn start() -> PrivateBroker {
        let dir =
            std::env::temp_dir().join(format!("postal-tansu-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("tansu dir");
        let mut b = PrivateBroker {
            dir,
            port: free_port(),
            child: None,
        };
        b.restart().await;
        b
    }

    /// Bootstrap servers of this broker.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// (Re)starts the broker on the same port and storage and waits until it answers.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "broker already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("tansu.log"))
            .expect("log file");
        let child = Command::new(tansu_bin())
            .current_dir(&self.dir)
            .args(["broker", "--kafka-cluster-id", "postal"])
            .arg("--kafka-listener-url")
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .arg("--kafka-advertised-listener-url")
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .args(["--storage-engine", "sqlite://tansu.db"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn tansu (install it: cargo install tansu --locked --features dynostore,libsql)");
        self.child = Some(child);
        crate::kafka::wait_ready(&self.bootstrap(), Duration::from_secs(60))
            .await
            .expect("private broker ready");
        self.index_headers();
    }

    /// tansu 0.6.0's sqlite schema has no index on record headers, so every fetched record
    /// scans all headers ever stored and the broker slows down quadratically with the topic
    /// (a few tens of thousands of records with CloudEvents headers starve its group
    /// coordinator). The index it lacks, added next to it (sqlite allows a second process).
    fn index_headers(&self) {
        let db = rusqlite::Connection::open(self.dir.join("tansu.db")).expect("open tansu.db");
        db.busy_timeout(Duration::from_secs(10))
            .expect("busy timeout");
        db.execute_batch(
            "CREATE INDEX IF NOT EXISTS postal_header_record ON header (topition, offset_id)",
        )
        .expect("index tansu's header table");
    }

    /// Kills the broker with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
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
