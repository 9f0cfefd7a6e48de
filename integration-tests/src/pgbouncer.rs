//! Private PgBouncer instances for the pooler tests: each test starts its own, with the pool
//! mode, pool size and ignored startup parameters it needs, in front of the suite's PostgreSQL.
//!
//! The binary is `POSTAL_PGBOUNCER_BIN` (`scripts/stack.sh env` prints it; Debian's package
//! puts it at `/usr/sbin/pgbouncer`, used when the variable is unset). Without one a test
//! skips with a message, unless `POSTAL_REQUIRE_PGBOUNCER=1` (as `scripts/test.sh` sets): then
//! it fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// PgBouncer's `pool_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// A server connection per transaction.
    Transaction,
    /// A server connection per client connection, for its lifetime.
    Session,
}

impl PoolMode {
    fn name(self) -> &'static str {
        match self {
            PoolMode::Transaction => "transaction",
            PoolMode::Session => "session",
        }
    }
}

/// The PgBouncer binary, or `None` (with a message saying the test did not run) when there is
/// none and `POSTAL_REQUIRE_PGBOUNCER` is not `1`.
pub fn binary(test: &str) -> Option<PathBuf> {
    let bin = std::env::var_os("POSTAL_PGBOUNCER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/sbin/pgbouncer"));
    if bin.is_file() {
        return Some(bin);
    }
    if std::env::var("POSTAL_REQUIRE_PGBOUNCER").as_deref() == Ok("1") {
        panic!(
            "{test}: no PgBouncer at {} (POSTAL_REQUIRE_PGBOUNCER=1): bash scripts/stack.sh pooler-up installs it",
            bin.display()
        );
    }
    eprintln!(
        "{test} NOT RUN: no PgBouncer at {} (set POSTAL_PGBOUNCER_BIN, or bash scripts/stack.sh pooler-up installs Debian's)",
        bin.display()
    );
    None
}

/// Whether `addr:port` accepts a connection, tried from network namespace `netns` (on a
/// thread of its own, which ends there).
fn listening(netns: Option<&str>, addr: &str, port: u16) -> bool {
    let (netns, addr) = (netns.map(str::to_owned), addr.to_owned());
    std::thread::spawn(move || {
        if let Some(ns) = &netns {
            crate::hosts::enter_netns(ns);
        }
        std::net::TcpStream::connect((addr.as_str(), port)).is_ok()
    })
    .join()
    .unwrap_or(false)
}

/// One running PgBouncer; stopped (SIGTERM, then SIGKILL) when dropped.
pub struct PgBouncer {
    /// The port it listens on (loopback).
    pub port: u16,
    dir: PathBuf,
    child: Child,
}

/// The uid and gid of the `postgres` user (PgBouncer refuses to run as root).
fn postgres_user() -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&"postgres")).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

/// Where and how a [`PgBouncer`] runs besides its mode and pool ([`PgBouncer::start_with`]).
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The network namespace (a test host, [`crate::hosts::TestHosts::netns`]) it runs in;
    /// `None`: this one, on 127.0.0.1.
    pub netns: Option<String>,
    /// The address it listens on (default 127.0.0.1).
    pub listen_addr: Option<String>,
    /// The PostgreSQL server it connects to as `host=…` (a unix socket directory reaches a
    /// server of another network namespace); default: `database_url`'s host.
    pub server_host: Option<String>,
    /// More `[pgbouncer]` settings, one `name = value` each.
    pub settings: Vec<String>,
}

impl PgBouncer {
    /// Starts `bin` in `mode` with `pool_size` server connections per database and user, in
    /// front of the PostgreSQL of `database_url` (any database name passes through), with
    /// `ignore` as `ignore_startup_parameters` besides `extra_float_digits`. Waits until it
    /// accepts connections.
    pub fn start(
        bin: &Path,
        database_url: &str,
        mode: PoolMode,
        pool_size: u32,
        ignore: &[&str],
    ) -> PgBouncer {
        PgBouncer::start_with(
            bin,
            database_url,
            mode,
            pool_size,
            ignore,
            Options::default(),
        )
    }

    /// [`PgBouncer::start`] with [`Options`]: in a network namespace of a test host, on
    /// another address, with more settings.
    pub fn start_with(
        bin: &Path,
        database_url: &str,
        mode: PoolMode,
        pool_size: u32,
        ignore: &[&str],
        options: Options,
    ) -> PgBouncer {
        let target: sqlx::postgres::PgConnectOptions =
            database_url.parse().expect("a PostgreSQL URL");
        let port = crate::free_port();
        let listen = options
            .listen_addr
            .clone()
            .unwrap_or_else(|| "127.0.0.1".into());
        let dir = std::env::temp_dir().join(format!("postal-pgbouncer-{}", crate::unique("t")));
        std::fs::create_dir_all(&dir).expect("pgbouncer folder");
        let mut ignored = vec!["extra_float_digits"];
        ignored.extend_from_slice(ignore);
        let mut config = format!(
            "[databases]\n* = host={host} port={pg_port}\n\
             [pgbouncer]\nlisten_addr = {listen}\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {dir}/userlist.txt\npool_mode = {mode}\n\
             default_pool_size = {pool_size}\nmax_client_conn = 1000\n\
             ignore_startup_parameters = {ignored}\nlogfile = {dir}/pgbouncer.log\n\
             admin_users = postgres\n",
            host = options
                .server_host
                .clone()
                .unwrap_or_else(|| target.get_host().to_owned()),
            pg_port = target.get_port(),
            dir = dir.display(),
            mode = mode.name(),
            ignored = ignored.join(","),
        );
        for setting in &options.settings {
            config.push_str(setting);
            config.push('\n');
        }
        std::fs::write(dir.join("pgbouncer.ini"), config).expect("pgbouncer.ini");
        std::fs::write(dir.join("userlist.txt"), "\"postgres\" \"\"\n").expect("userlist");
        let root = nix::unistd::getuid().is_root();
        if root {
            let (uid, gid) = postgres_user().expect("a postgres user to run PgBouncer as");
            for entry in [
                dir.clone(),
                dir.join("pgbouncer.ini"),
                dir.join("userlist.txt"),
            ] {
                std::os::unix::fs::chown(&entry, Some(uid), Some(gid)).expect("chown");
            }
        }
        let mut command = match &options.netns {
            // `ip netns exec` needs root; PgBouncer then drops to `postgres` itself.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns])
                    .arg(bin)
                    .args(["-u", "postgres"]);
                c
            }
            None => {
                let mut c = Command::new(bin);
                if root {
                    let (uid, gid) = postgres_user().expect("a postgres user");
                    use std::os::unix::process::CommandExt as _;
                    c.uid(uid).gid(gid);
                }
                c
            }
        };
        command.arg(dir.join("pgbouncer.ini"));
        let child = command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start pgbouncer");
        let mut bouncer = PgBouncer { port, dir, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !listening(options.netns.as_deref(), &listen, port) {
            if let Ok(Some(status)) = bouncer.child.try_wait() {
                panic!("pgbouncer exited ({status}): {}", bouncer.log());
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer did not listen within 20 s: {}",
                bouncer.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        bouncer
    }

    /// The URL of database `db` through this PgBouncer.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Sends `signal` (`STOP`: a pooler that hangs with every connection open; `CONT`).
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} pgbouncer");
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // A frozen one (SIGSTOP) would not act on SIGTERM.
        Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status()
            .ok();
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .ok();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                std::fs::remove_dir_all(&self.dir).ok();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child.kill().ok();
        self.child.wait().ok();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}
