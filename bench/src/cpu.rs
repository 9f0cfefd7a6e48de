//! Where the CPU goes during a benchmark phase (Linux `/proc`): CPU time of the PostgreSQL
//! processes, of the broker (the Kafka JVM) and of this process (including librdkafka's threads), plus
//! the machine's idle and steal time. On a machine where all of them share the same cores, this
//! is what bounds a pipeline that needs all three at once.

use std::time::Instant;

/// Clock ticks per second of `/proc` times (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
const TICKS: f64 = 100.0;

/// CPU seconds consumed so far, per component.
#[derive(Clone, Copy, Default)]
pub struct Cpu {
    postgres: f64,
    broker: f64,
    bench: f64,
    idle: f64,
    steal: f64,
    total: f64,
    at: Option<Instant>,
}

/// `utime + stime (+ cutime + cstime)` of one `/proc/<pid>/stat`, with its command name.
fn process(stat: &str) -> Option<(String, f64, f64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat[open + 1..close].to_string();
    let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
    // Fields after the command: state is index 0, utime 11, stime 12, cutime 13, cstime 14.
    let num = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Some((
        comm,
        (num(11) + num(12)) / TICKS,
        (num(13) + num(14)) / TICKS,
    ))
}

impl Cpu {
    /// Reads the counters now (zeros where `/proc` is not available).
    pub fn now() -> Self {
        let mut cpu = Cpu {
            at: Some(Instant::now()),
            ..Cpu::default()
        };
        let me = std::process::id().to_string();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let name = entry.file_name();
                let Some(pid) = name
                    .to_str()
                    .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
                else {
                    continue;
                };
                let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                    continue;
                };
                let Some((comm, own, children)) = process(&stat) else {
                    continue;
                };
                if pid == me {
                    cpu.bench += own;
                } else if comm == "postgres" {
                    // The postmaster's children times cover backends that have exited.
                    cpu.postgres += own + children;
                } else if comm == "java"
                    && std::fs::read(entry.path().join("cmdline"))
                        .is_ok_and(|c| c.windows(11).any(|w| w == b"kafka.Kafka"))
                {
                    cpu.broker += own;
                }
            }
        }
        if let Some(line) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| s.lines().next().map(str::to_string))
        {
            let v: Vec<f64> = line
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            // user nice system idle iowait irq softirq steal guest guest_nice
            cpu.total = v.iter().take(8).sum::<f64>() / TICKS;
            cpu.idle = (v.get(3).unwrap_or(&0.0) + v.get(4).unwrap_or(&0.0)) / TICKS;
            cpu.steal = v.get(7).unwrap_or(&0.0) / TICKS;
        }
        cpu
    }

    /// One line: CPU seconds per component since `start`, per 1,000 events, and the
    /// machine's idle and steal share over the same wall time.
    pub fn report_since(&self, start: &Cpu, events: usize) -> Report {
        let per_k = |s: f64| s * 1e6 / events.max(1) as f64;
        let (pg, br, me) = (
            self.postgres - start.postgres,
            self.broker - start.broker,
            self.bench - start.bench,
        );
        let total = (self.total - start.total).max(1e-9);
        let wall = match (self.at, start.at) {
            (Some(a), Some(b)) => (a - b).as_secs_f64(),
            _ => 0.0,
        };
        let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
        let steal = (self.steal - start.steal) / total;
        let idle_share = (self.idle - start.idle) / total;
        // The machine's busy cores (from `/proc/stat`, all CPUs) less the three measured
        // components: other processes on the machine (other workloads disturb a figure).
        let cores = std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64);
        let others =
            ((1.0 - idle_share - steal) * cores - (pg + br + me) / wall.max(1e-9)).max(0.0);
        let line = format!(
            "cpu ms per 1000 events: postgres {:.1}, broker {:.1}, bench process {:.1} \
             (sum {:.1}); over {:.2} s: {:.2} cores busy, other processes {:.2} cores, \
             idle {:.0} %, steal {:.0} %; {threads} threads in this process",
            per_k(pg),
            per_k(br),
            per_k(me),
            per_k(pg + br + me),
            wall,
            (pg + br + me) / wall.max(1e-9),
            others,
            100.0 * idle_share,
            100.0 * steal,
        );
        Report {
            line,
            ms_per_k: Costs {
                postgres: per_k(pg),
                broker: per_k(br),
                process: per_k(me),
            },
            steal,
            wal: None,
        }
    }
}

/// PostgreSQL's WAL position and the outbox's autovacuum count (this database). The position
/// is exact at once; `pg_stat_wal`'s record counts are not used because backends report them
/// lazily (up to a second or more later), which is the length of a whole phase here.
pub struct Wal {
    bytes: f64,
    autovacuums: i64,
}

impl Wal {
    /// Reads the counters; `None` if the server cannot say.
    pub async fn now(pool: &sqlx::PgPool) -> Option<Wal> {
        let (bytes, autovacuums): (f64, i64) = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8,
                    coalesce((SELECT autovacuum_count FROM pg_stat_user_tables
                              WHERE schemaname = 'postal' AND relname = 'outbox'), 0)",
        )
        .fetch_one(pool)
        .await
        .ok()?;
        Some(Wal { bytes, autovacuums })
    }
}

/// CPU milliseconds per 1,000 events of one phase, per component.
#[derive(Clone, Copy, Debug, Default)]
pub struct Costs {
    /// PostgreSQL's processes.
    pub postgres: f64,
    /// The broker's process.
    pub broker: f64,
    /// The benchmark's own process (the relay, or the raw producer, or the SQL drain's client).
    pub process: f64,
}

impl Costs {
    /// All three.
    pub fn sum(&self) -> f64 {
        self.postgres + self.broker + self.process
    }
}

/// What [`Cpu::report_since`] found: the printed line and the machine's steal share.
pub struct Report {
    line: String,
    /// CPU milliseconds per 1,000 events: PostgreSQL's processes, the broker, this process.
    pub ms_per_k: Costs,
    /// Share of the machine's CPU time taken by the hypervisor for other guests (0–1).
    pub steal: f64,
    wal: Option<String>,
}

impl Report {
    /// Adds the WAL written between `start` and `end` (per 1,000 events) and the outbox's
    /// autovacuums in between.
    pub fn with_wal(mut self, start: Option<Wal>, end: Option<Wal>, events: usize) -> Report {
        if let (Some(a), Some(b)) = (start, end) {
            let per_k = |x: f64| x * 1000.0 / events.max(1) as f64;
            self.wal = Some(format!(
                "wal per 1000 events: {:.0} kB; outbox autovacuums during the phase: {}",
                per_k(b.bytes - a.bytes) / 1024.0,
                b.autovacuums - a.autovacuums
            ));
        }
        self
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.line)?;
        if let Some(w) = &self.wal {
            write!(f, "\n    {w}")?;
        }
        Ok(())
    }
}
