//! Real service processes for the chaos and cluster tests: started, killed with SIGKILL,
//! restarted and stopped by the test, with their logs kept; and the checks both run at the end
//! (an independent reader of the topics, counts from the database).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use postal_integration_tests::free_port;
use sqlx::PgPool;

pub(crate) fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v:?}")))
        .unwrap_or(default)
}

/// Creates the logical slot `slot` on `pool`'s database (publication `postal_outbox`) and
/// returns `postal relay`'s flags that read the outbox from it.
pub(crate) async fn wal_flags<'a>(pool: &PgPool, slot: &'a str) -> [&'a str; 6] {
    postal_producer::wal::slot::create(pool, slot, "postal_outbox")
        .await
        .expect("the slot and its publication");
    [
        "--read-from",
        "wal",
        "--wal-slot",
        slot,
        "--wal-publication",
        "postal_outbox",
    ]
}

/// Directory holding `postal` (`postal-cli`), the demo's services (`order_service`,
/// `billing_service`, `invoice_recorder`, `demo` from `postal-demo`) and this package's
/// fixtures (`report_worker`, `roundtrip` from `src/bin/`):
/// `target/<profile>/`, where cargo puts them all, or `POSTAL_BIN_DIR`.
pub(crate) fn bin_dir() -> PathBuf {
    if let Ok(d) = std::env::var("POSTAL_BIN_DIR") {
        return PathBuf::from(d);
    }
    // target/<profile>/deps/suite-<hash> → target/<profile>
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target directory")
        .to_owned()
}

/// One service process that the test starts, kills and restarts.
pub(crate) struct Proc {
    pub(crate) name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    pub(crate) log: PathBuf,
    /// The test host (network namespace) it runs on, if not this one.
    netns: Option<String>,
    metrics_port: Option<u16>,
    child: Option<Child>,
    pub(crate) kills: u32,
    /// How long a killed process stays down before it is started again.
    restart_delay: Duration,
    /// When the killed process is due to start again.
    restart_at: Option<Instant>,
    /// When the running process started, and how long it must have run before it may be
    /// killed again (long enough to get to work: join its group, claim, publish).
    started_at: Instant,
    min_uptime: Duration,
    /// Consumer counters scraped from `/metrics` before each kill and at the end.
    pub(crate) counters: BTreeMap<&'static str, u64>,
}

impl Proc {
    pub(crate) fn new(dir: &Path, logs: &Path, name: &str, program: &str, args: &[&str]) -> Proc {
        let program = dir.join(program);
        assert!(
            program.is_file(),
            "{} is missing: build the binaries first (cargo build -p postal-cli -p postal-demo -p postal-integration-tests --bins)",
            program.display()
        );
        Proc {
            name: name.into(),
            program,
            args: args.iter().map(|s| s.to_string()).collect(),
            // Errors returned from `main` print without a backtrace (panics keep theirs).
            env: vec![("RUST_LIB_BACKTRACE".into(), "0".into())],
            log: logs.join(format!("{name}.log")),
            netns: None,
            metrics_port: None,
            child: None,
            kills: 0,
            restart_delay: Duration::ZERO,
            restart_at: None,
            started_at: Instant::now(),
            min_uptime: Duration::from_secs(2),
            counters: BTreeMap::new(),
        }
    }

    pub(crate) fn env(mut self, pairs: &[(&str, String)]) -> Proc {
        self.env
            .extend(pairs.iter().map(|(k, v)| (k.to_string(), v.clone())));
        self
    }

    /// Runs the process on a test host (`ip netns exec <netns>`, which execs it: the pid is
    /// the service's).
    pub(crate) fn on_host(mut self, netns: &str) -> Proc {
        self.netns = Some(netns.to_owned());
        self
    }

    pub(crate) fn with_metrics(mut self) -> Proc {
        let port = free_port();
        self.metrics_port = Some(port);
        self.env
            .push(("POSTAL_METRICS_ADDR".into(), format!("127.0.0.1:{port}")));
        self
    }

    /// The port of its `/metrics`, with [`Proc::with_metrics`].
    pub(crate) fn metrics_port(&self) -> Option<u16> {
        self.metrics_port
    }

    pub(crate) fn start(&mut self) {
        assert!(self.child.is_none(), "{} already running", self.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut command = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.program);
                c
            }
            None => Command::new(&self.program),
        };
        let child = command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.name));
        self.child = Some(child);
        self.started_at = Instant::now();
    }

    /// Panics (with the end of its log) if the process exited without being told to.
    pub(crate) fn assert_alive(&mut self) {
        if let Some(child) = self.child.as_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "{} exited on its own ({status}); log tail:\n{}",
                    self.name,
                    log_tail(&self.log)
                );
            }
        }
    }

    /// Its exit status, once it has exited on its own.
    pub(crate) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Whether its log so far contains `text`.
    pub(crate) fn logged(&self, text: &str) -> bool {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .contains(text)
    }

    /// Waits until its log contains `text`; panics if it exits first or `within` passes.
    pub(crate) async fn await_log(&mut self, text: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.logged(text) {
            self.assert_alive();
            assert!(
                Instant::now() < deadline,
                "{} did not log {text:?} within {within:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) fn scrape(&mut self) {
        let Some(port) = self.metrics_port else {
            return;
        };
        let Some(text) = http_get(port, "/metrics") else {
            return;
        };
        for (key, pattern) in [
            ("applied", "outcome=\"applied\""),
            ("duplicates", "outcome=\"duplicate\""),
            ("replays_skipped", "reason=\"below_stored_offset\""),
            ("retries", "postal_consumer_retries_total"),
            ("fenced", "postal_consumer_fenced_total"),
        ] {
            let v: u64 = text
                .lines()
                .filter(|l| !l.starts_with('#') && l.contains(pattern))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .map(|v| v as u64)
                .sum();
            *self.counters.entry(key).or_default() += v;
        }
    }

    /// For the generator, which ends by itself: fine when it exited successfully.
    pub(crate) fn assert_alive_or_finished(&mut self) {
        if let Some(child) = self.child.as_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                assert!(
                    status.success() && self.name == "order_service",
                    "{} exited ({status}); log tail:\n{}",
                    self.name,
                    log_tail(&self.log)
                );
            }
        }
    }

    pub(crate) fn finished(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(Some(s))) if s.success())
    }

    pub(crate) fn restart_after(mut self, delay: Duration, min_uptime: Duration) -> Proc {
        self.restart_delay = delay;
        self.min_uptime = min_uptime;
        self
    }

    /// Running long enough to be worth killing.
    pub(crate) fn killable(&self) -> bool {
        self.child.is_some() && self.started_at.elapsed() >= self.min_uptime
    }

    /// Sends `signal` (`STOP`, `CONT`, …) to the running process.
    pub(crate) fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("running");
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} {}", self.name);
    }

    /// kill -9 (after reading its counters); it starts again after its restart delay.
    pub(crate) fn kill(&mut self) {
        self.assert_alive();
        self.scrape();
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL");
            child.wait().expect("reap");
        }
        self.kills += 1;
        self.restart_at = Some(Instant::now() + self.restart_delay);
        self.restart_if_due();
    }

    /// Starts a killed process whose restart delay is over; checks a running one is alive.
    pub(crate) fn restart_if_due(&mut self) {
        match self.restart_at {
            Some(at) if Instant::now() >= at => {
                self.restart_at = None;
                self.start();
            }
            Some(_) => {}
            None => self.assert_alive(),
        }
    }

    /// SIGTERM and wait; asserts a clean exit.
    pub(crate) fn stop(&mut self) {
        self.assert_alive();
        self.scrape();
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                assert!(
                    status.success(),
                    "{} did not stop cleanly ({status}); log tail:\n{}",
                    self.name,
                    log_tail(&self.log)
                );
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{} ignored SIGTERM for 30 s", self.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The last 30 lines of a log, without the frames of backtraces (they would crowd out the
/// message).
pub(crate) fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut in_backtrace = false;
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            if t.eq_ignore_ascii_case("stack backtrace:") {
                in_backtrace = true;
                return true;
            }
            let frame = t
                .split_once(": ")
                .is_some_and(|(n, _)| n.parse::<u32>().is_ok())
                || t.starts_with("at ")
                || t.starts_with("note: Some details");
            in_backtrace &= frame;
            !in_backtrace
        })
        .collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

pub(crate) fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(2),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

pub(crate) async fn scalar(pool: &PgPool, sql: &str) -> Option<i64> {
    sqlx::query_scalar(sql).fetch_one(pool).await.ok()
}

/// Sum of the high watermarks of a topic's partitions: the records the broker holds.
pub(crate) fn records_in(bootstrap: &str, topic: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("consumer");
    postal_integration_tests::kafka::partitions(bootstrap, topic, Duration::from_secs(30))
        .into_iter()
        .map(|p| {
            c.fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks")
                .1
        })
        .sum()
}

/// Waits (up to 30 s) until relays hold outbox rows in open claims, i.e. sent to the broker
/// and not yet acknowledged, and returns how many.
pub(crate) async fn wait_for_claims_in_flight(pool: &PgPool) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // Pending rows minus those no open transaction holds: the claimed ones.
        let claimed = scalar(
            pool,
            "SELECT (SELECT count(*) FROM postal.outbox WHERE status = 'pending')
                  - (SELECT count(*) FROM (SELECT 1 FROM postal.outbox WHERE status = 'pending'
                                           FOR UPDATE SKIP LOCKED) free)",
        )
        .await
        .unwrap_or(0);
        if claimed > 0 {
            return claimed;
        }
        assert!(
            Instant::now() < deadline,
            "no relay claim in flight within 30 s of hanging the broker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What an independent reader finds on one topic: records, distinct orders, orders of `want`
/// missing, and customers whose orders first appear out of sequence (per key, in partition
/// offset order, each order seen for the first time must be the customer's next one; a
/// re-published copy of an earlier order is a duplicate the consumers drop, not a reorder).
pub(crate) struct WireCheck {
    pub(crate) records: usize,
    pub(crate) distinct: usize,
    pub(crate) missing: usize,
    pub(crate) out_of_order: Vec<String>,
}

pub(crate) async fn check_wire(
    bootstrap: &str,
    topic: &str,
    expected_records: i64,
    want: &std::collections::BTreeSet<String>,
) -> WireCheck {
    let records = postal_integration_tests::kafka::read_all(
        bootstrap,
        topic,
        usize::try_from(expected_records).unwrap_or(0),
        Duration::from_secs(120),
    )
    .await;
    let mut seen = std::collections::BTreeSet::new();
    let mut next: BTreeMap<String, i64> = BTreeMap::new();
    let mut out_of_order = Vec::new();
    for r in &records {
        let v: serde_json::Value = serde_json::from_slice(&r.payload).expect("order payload");
        let order = v["order_id"].to_string().trim_matches('"').to_owned();
        let customer = v["customer"].as_str().expect("customer").to_owned();
        let seq = v["seq"].as_i64().expect("seq");
        if !seen.insert(order) {
            continue;
        }
        let expected = next.entry(customer.clone()).or_insert(seq);
        if seq != *expected {
            out_of_order.push(format!("{customer}: seq {seq} first seen where {expected} was due (partition {} offset {})", r.partition, r.offset));
        }
        *expected = (*expected).max(seq) + 1;
    }
    WireCheck {
        records: records.len(),
        distinct: seen.len(),
        missing: want.difference(&seen).count(),
        out_of_order,
    }
}
