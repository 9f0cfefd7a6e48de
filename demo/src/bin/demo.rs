//! The one-command demo (run by `bash scripts/demo.sh`): a fresh database, the relay, the order
//! service, the billing service and the invoice recorder as separate processes; orders flow
//! through two hops (order → ledger + invoice event → invoice record). Prints progress, then a
//! summary, and exits non-zero if any order was not applied exactly once (or out of order for
//! its customer).
//!
//! Environment: `DATABASE_URL` (a server; the demo creates its own database on it),
//! `KAFKA_BOOTSTRAP_SERVERS`, `DEMO_ORDERS` (default 2000), `DEMO_RATE` (orders/s, default 200),
//! `DEMO_CUSTOMERS` (default 50), `DEMO_LOGS` (the folder for the processes' logs; default a
//! new `demo-<run>` folder next to this binary), `DEMO_STOP_HINT` (a line printed last, saying
//! what still runs and how to stop it: the Docker route sets it); `POSTAL_DEDUP_RETENTION` /
//! `POSTAL_CLEANUP_INTERVAL` are passed to the consumers (a sustained run shows the cleanup
//! keeping up).
//!
//! The programs it starts ([`postal_demo::DEMO_PROGRAMS`]) are found next to this binary.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use sqlx::{ConnectOptions, Executor, PgPool};

fn env_or(name: &str, default: u64) -> anyhow::Result<u64> {
    match std::env::var(name) {
        Ok(v) => v.parse().with_context(|| format!("{name}={v:?}")),
        Err(_) => Ok(default),
    }
}

struct Proc {
    name: &'static str,
    child: Child,
}

impl Proc {
    fn spawn(
        dir: &Path,
        logs: &Path,
        name: &'static str,
        args: &[&str],
        env: &[(&str, String)],
    ) -> anyhow::Result<Proc> {
        let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
        let child = Command::new(dir.join(name))
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| {
                format!("starting {name} (build with `cargo build -p postal-cli -p postal-demo`)")
            })?;
        Ok(Proc { name, child })
    }

    /// SIGTERM, then wait.
    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("{} did not stop in time; killing it", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Resident and peak resident memory of a process (Linux `/proc`), e.g. `RSS 31 MB (peak 40 MB)`.
fn rss(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| format!("{} MB", kb / 1024))
            .unwrap_or_else(|| "?".into())
    };
    format!("RSS {} (peak {})", field("VmRSS:"), field("VmHWM:"))
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap_or(0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let result = run().await;
    if let Ok(hint) = std::env::var("DEMO_STOP_HINT") {
        if let Err(e) = &result {
            eprintln!("error: {e:#}");
        }
        println!("{hint}");
        if result.is_err() {
            std::process::exit(1);
        }
    }
    result
}

/// The demo; `Ok` only when every order was applied exactly once, in order.
async fn run() -> anyhow::Result<()> {
    let server = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").context("KAFKA_BOOTSTRAP_SERVERS is not set")?;
    let orders = env_or("DEMO_ORDERS", 2000)?;
    let rate = env_or("DEMO_RATE", 200)?;
    let customers = env_or("DEMO_CUSTOMERS", 50)?;
    let dir: PathBuf = std::env::current_exe()?
        .parent()
        .context("binary directory")?
        .to_owned();
    for program in postal_demo::DEMO_PROGRAMS {
        if !dir.join(program).is_file() {
            bail!(
                "{} is missing: build it with `cargo build -p postal-cli -p postal-demo`",
                dir.join(program).display()
            );
        }
    }

    let run = uuid::Uuid::now_v7().simple().to_string();
    let name = format!("postal_demo_{run}");
    let opts = postal_shared::secret::database_url_options(&server)?;
    let mut admin = opts.connect().await.context("cannot reach PostgreSQL")?;
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await?;
    let url = opts.database(&name).to_url_lossy().to_string();
    let pool = PgPool::connect(&url).await?;
    postal_shared::migrate(&pool).await?;

    let logs = match std::env::var_os("DEMO_LOGS") {
        Some(d) => PathBuf::from(d).join(format!("demo-{run}")),
        None => dir.join(format!("demo-{run}")),
    };
    std::fs::create_dir_all(&logs)?;
    let (orders_topic, invoices_topic) = (format!("orders-{run}"), format!("invoices-{run}"));
    let env = vec![
        ("DATABASE_URL", url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.clone()),
        ("ORDERS_TOPIC", orders_topic.clone()),
        ("INVOICES_TOPIC", invoices_topic.clone()),
        ("ORDERS", orders.to_string()),
        ("ORDER_RATE", rate.to_string()),
        ("CUSTOMERS", customers.to_string()),
        ("POSTAL_LOG", "warn".into()),
        ("RUST_LOG", "warn".into()),
    ];
    println!(
        "demo: {orders} orders for {customers} customers at {rate}/s through relay → billing → invoices (database {name}, logs in {})",
        logs.display()
    );
    let relay = Proc::spawn(
        &dir,
        &logs,
        "postal",
        &["relay", "--topic-partitions", "6"],
        &env,
    )?;
    // Consumers fetch with a short wait: librdkafka's default `fetch.wait.max.ms` (500 ms)
    // is what a broker that holds empty fetches adds to every event's latency.
    let mut consumer_env = env.clone();
    consumer_env.push(("POSTAL_KAFKA", "fetch.wait.max.ms=10".into()));
    for name in ["POSTAL_DEDUP_RETENTION", "POSTAL_CLEANUP_INTERVAL"] {
        if let Ok(v) = std::env::var(name) {
            consumer_env.push((name, v));
        }
    }
    let billing = Proc::spawn(&dir, &logs, "billing_service", &[], &consumer_env)?;
    let invoices = Proc::spawn(&dir, &logs, "invoice_recorder", &[], &consumer_env)?;
    let mut producer = Proc::spawn(&dir, &logs, "order_service", &[], &env)?;

    let started = Instant::now();
    let limit = Duration::from_secs(600.max(2 * orders / rate.max(1) + 120));
    let deadline = started + limit;
    let tty = std::io::stderr().is_terminal();
    let mut last_line = started;
    loop {
        let o = count(&pool, "SELECT count(*) FROM orders").await;
        let l = count(&pool, "SELECT count(DISTINCT order_id) FROM ledger").await;
        let i = count(&pool, "SELECT count(DISTINCT order_id) FROM invoices").await;
        let line = format!(
            "  {:>5.1}s  orders {o:>7}/{orders}  ledger {l:>7}  invoices {i:>7}",
            started.elapsed().as_secs_f64()
        );
        if tty {
            eprint!("\r{line}   ");
            let _ = std::io::stderr().flush();
        } else if last_line.elapsed() >= Duration::from_secs(5) {
            eprintln!("{line}");
            last_line = Instant::now();
        }
        if i as u64 >= orders && producer.child.try_wait()?.is_some() {
            break;
        }
        if let Ok(Some(status)) = producer.child.try_wait() {
            if !status.success() {
                bail!(
                    "the order service failed ({status}); see {}",
                    logs.display()
                );
            }
        }
        if Instant::now() > deadline {
            eprintln!();
            bail!(
                "not done after {} s; see the logs in {}",
                limit.as_secs(),
                logs.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if tty {
        eprintln!();
    }
    let elapsed = started.elapsed();
    producer.child.wait()?;
    let memory: Vec<(&str, String)> = [&relay, &billing, &invoices]
        .iter()
        .map(|p| (p.name, rss(p.child.id())))
        .collect();
    let sizes: (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM postal.outbox), pg_total_relation_size('postal.outbox'),
                (SELECT count(*) FROM postal.processed_events),
                pg_total_relation_size('postal.processed_events')",
    )
    .fetch_one(&pool)
    .await?;
    for p in [invoices, billing, relay] {
        p.stop();
    }

    let q = |sql: &'static str| {
        let pool = pool.clone();
        async move { count(&pool, sql).await }
    };
    let created = q("SELECT count(*) FROM orders").await;
    let outbox_left = q("SELECT count(*) FROM postal.outbox").await;
    let enqueued = created + q("SELECT count(*) FROM ledger").await;
    let ledger_rows = q("SELECT count(*) FROM ledger").await;
    let invoice_rows = q("SELECT count(*) FROM invoices").await;
    let delivered_orders =
        q("SELECT coalesce(sum(next_offset), 0)::bigint FROM postal.consumer_offsets WHERE group_id = 'billing'").await;
    let delivered_invoices =
        q("SELECT coalesce(sum(next_offset), 0)::bigint FROM postal.consumer_offsets WHERE group_id = 'invoices'").await;
    let not_once = q("SELECT count(*) FROM orders o
         WHERE (SELECT count(*) FROM ledger l WHERE l.order_id = o.id) <> 1
            OR (SELECT count(*) FROM invoices i WHERE i.order_id = o.id) <> 1")
    .await;
    let out_of_order = q("SELECT count(*) FROM (
             SELECT seq, lag(seq) OVER (PARTITION BY customer ORDER BY id) AS prev FROM ledger) s
         WHERE prev IS NOT NULL AND seq <> prev + 1")
    .await;
    let dead = q("SELECT count(*) FROM postal.dead_letters").await;
    let (p50, p99, i50, i99): (Option<f64>, Option<f64>, Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM l.applied_at - o.created_at) * 1000),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM l.applied_at - o.created_at) * 1000),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM i.recorded_at - o.created_at) * 1000),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM i.recorded_at - o.created_at) * 1000)
         FROM orders o JOIN ledger l ON l.order_id = o.id JOIN invoices i ON i.order_id = o.id",
    )
    .fetch_one(&pool)
    .await?;
    let span: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM (SELECT max(recorded_at) FROM invoices) - (SELECT min(created_at) FROM orders))::float8",
    )
    .fetch_one(&pool)
    .await?;
    let ms = |v: Option<f64>| {
        v.map(|v| format!("{v:.1} ms"))
            .unwrap_or_else(|| "-".into())
    };

    println!("summary ({:.1} s):", elapsed.as_secs_f64());
    println!("  orders created                 {created}");
    println!(
        "  events published               {} of {enqueued} (outbox left: {outbox_left})",
        enqueued - outbox_left
    );
    println!("  deliveries seen (incl. dups)   order.created {delivered_orders}, invoice.created {delivered_invoices}");
    println!("  effects applied                ledger {ledger_rows}, invoices {invoice_rows}");
    println!(
        "  duplicates skipped             {}",
        (delivered_orders - ledger_rows) + (delivered_invoices - invoice_rows)
    );
    println!("  dead letters                   {dead}");
    println!(
        "  order → ledger latency         p50 {}  p99 {}",
        ms(p50),
        ms(p99)
    );
    println!(
        "  order → invoice latency        p50 {}  p99 {}",
        ms(i50),
        ms(i99)
    );
    if let Some(s) = span {
        println!(
            "  throughput                     {:.0} orders/s through both hops",
            created as f64 / s.max(1e-9)
        );
    }
    for (name, m) in &memory {
        println!("  memory {name:<24}{m}");
    }
    println!(
        "  tables at the end              outbox {} rows / {} kB, processed_events {} rows / {} kB",
        sizes.0,
        sizes.1 / 1024,
        sizes.2,
        sizes.3 / 1024
    );
    if not_once > 0 || out_of_order > 0 || created as u64 != orders {
        bail!("FAILED: {not_once} order(s) not applied exactly once, {out_of_order} out of order");
    }
    println!("OK: every order applied exactly once in the ledger and the invoices, in order per customer");
    Ok(())
}
