//! Postal's benchmarks. Run against the local stack (`scripts/stack.sh up`, broker on memory
//! storage) with `cargo run --release -p postal-bench -- <command>`; see BENCHMARKS.md.

/// The same allocator as the `postal` binary, so that the relay and consumers measured here
/// run as they do there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod consume;
mod cpu;
mod dashboard;
mod e2e;
mod rabbitmq;
mod wal_drain;

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use futures::future::join_all;
use postal_producer::{
    enqueue, enqueue_batch, parse_property, KafkaConfig, KafkaTransport, NewEvent, Relay,
    RelayConfig,
};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

#[derive(Parser)]
#[command(about = "Postal benchmarks")]
struct Cli {
    /// Server URL; each run creates its own database on it.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BOOTSTRAP_SERVERS")]
    bootstrap: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Clone)]
enum Command {
    /// Drain a backlog: Postal's relay (1, 2, 4 instances) vs a seed-style loop, raw rdkafka
    /// and a SQL-only drain.
    Relay {
        /// Backlog size.
        #[arg(long, default_value_t = 100_000)]
        events: usize,
        /// Sample size for the seed-style baseline.
        #[arg(long, default_value_t = 5_000)]
        baseline_events: usize,
        /// Payload size in bytes.
        #[arg(long, default_value_t = 200)]
        payload_bytes: usize,
        /// Distinct keys.
        #[arg(long, default_value_t = 1000)]
        keys: usize,
        /// Relay batch size.
        #[arg(long, default_value_t = 2000)]
        batch_size: usize,
        /// Relay batches in flight.
        #[arg(long, default_value_t = 4)]
        in_flight: usize,
        /// Relay claim lanes.
        #[arg(long, default_value_t = 4)]
        lanes: usize,
        /// Relay instance counts to run, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        instances: Vec<usize>,
        /// Rounds over the instance counts (interleaved: 1,2,4,1,2,4,…); medians are reported.
        #[arg(long, default_value_t = 1)]
        repeat: usize,
        /// Skip the baselines (b), (c), (d).
        #[arg(long)]
        relay_only: bool,
        /// Connections of the SQL-only drain (d), each running the claim-and-delete loop. One
        /// left this 2-core machine about 45 % idle, so it was not the database's ceiling; two
        /// drained 13–20 % faster (BENCHMARKS.md).
        #[arg(long, default_value_t = 2)]
        sql_connections: usize,
        /// Extra librdkafka property `key=value` (repeatable), e.g. `linger.ms=5`, for the
        /// relay's producer and the raw producer (c); overrides Postal's defaults as `postal
        /// relay --kafka` does.
        #[arg(long = "kafka", value_parser = parse_property)]
        kafka: Vec<(String, String)>,
        /// Each round, also (w) one WAL relay (`--read-from wal`) draining the same backlog
        /// from a logical slot, and (s) the server decoding that backlog from a slot (nothing
        /// published): (w)/min(c, s) is printed. The server needs `wal_level=logical`.
        #[arg(long)]
        wal: bool,
    },
    /// The dashboard's pages on large tables: server time per page and the plans.
    Dashboard {
        /// Published rows kept in the outbox.
        #[arg(long, default_value_t = 1_000_000)]
        published: i64,
        /// Parked events (as many more wait behind them).
        #[arg(long, default_value_t = 10_000)]
        parked: i64,
        /// Dead letters (one in five open).
        #[arg(long, default_value_t = 100_000)]
        dead_letters: i64,
        /// Timed requests per page.
        #[arg(long, default_value_t = 20)]
        requests: usize,
    },
    /// `EXPLAIN ANALYZE` of the claim on an outbox with no history and with `published` rows
    /// of retained history (plus the same pending backlog).
    Explain {
        /// Retained published rows.
        #[arg(long, default_value_t = 1_000_000)]
        published: i64,
        /// Pending rows.
        #[arg(long, default_value_t = 10_000)]
        pending: i64,
    },
    /// Consume pre-produced events whose handler inserts one row: Postal in throughput mode,
    /// Postal with one transaction per message, a raw consume loop and a SQL-only ceiling.
    Consume {
        /// Events to pre-produce and consume.
        #[arg(long, default_value_t = 100_000)]
        events: usize,
        /// Sample size for one transaction per message.
        #[arg(long, default_value_t = 5_000)]
        sample: usize,
        /// Topic partitions.
        #[arg(long, default_value_t = 12)]
        partitions: i32,
        /// Records per transaction in throughput mode.
        #[arg(long, default_value_t = 500)]
        max_batch: usize,
        /// Partitions processed in parallel (and SQL-only connections).
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Payload size in bytes.
        #[arg(long, default_value_t = 200)]
        payload_bytes: usize,
        /// The consumer's `partition_buffer` (records; default: the consumer's default).
        #[arg(long)]
        partition_buffer: Option<usize>,
    },
    /// Order commit to ledger commit through relay, broker and consumer at a steady rate, with
    /// the wake-up and with polling only, next to the broker path alone.
    E2e {
        /// Orders (events) per second.
        #[arg(long, default_value_t = 1000)]
        rate: u64,
        /// Orders (events) per writing transaction: on 2 cores shared with the whole pipeline,
        /// one order per transaction commits at most about 1,400 orders/s.
        #[arg(long, default_value_t = 1)]
        orders_per_tx: u64,
        /// Seconds of steady load per variant.
        #[arg(long, default_value_t = 20)]
        seconds: u64,
        /// Topic partitions.
        #[arg(long, default_value_t = 6)]
        partitions: i32,
        /// Consumer `max_batch` (1 = one transaction per event).
        #[arg(long, default_value_t = 1)]
        max_batch: usize,
        /// Relay producer `linger.ms`.
        #[arg(long, default_value_t = 1)]
        linger_ms: u32,
        /// Consumer `fetch.wait.max.ms`.
        #[arg(long, default_value_t = 10)]
        fetch_wait_ms: u32,
        /// Relay batches awaiting acknowledgement at once.
        #[arg(long, default_value_t = 4)]
        in_flight: usize,
        /// Relay claim lanes.
        #[arg(long, default_value_t = 4)]
        lanes: usize,
        /// Leave out the plain consumer that splits the path into relay + broker and Postal's
        /// consumer: it is a second reader of the topic, whose fetches cost the broker CPU.
        #[arg(long)]
        no_split: bool,
        /// Leave out the polling-only variant (the wake-up variant and the broker path only).
        #[arg(long)]
        no_polling: bool,
        /// Go through librdkafka's mock cluster (in this process) instead of `--bootstrap`.
        #[arg(long)]
        mock_broker: bool,
        /// Run the WAL relay variant too (`--read-from wal`: a logical slot on the run's
        /// database; the server needs `wal_level=logical`, as the local stack sets it).
        #[arg(long)]
        wal: bool,
    },
    /// Drain a backlog to RabbitMQ (durable topic exchange, persistent messages, confirms):
    /// Postal's relay next to a raw lapin publisher with confirms.
    Rabbitmq {
        /// AMQP URI of RabbitMQ.
        #[arg(long, env = "AMQP_URL", hide_env_values = true)]
        amqp_url: String,
        /// Backlog size.
        #[arg(long, default_value_t = 100_000)]
        events: usize,
        /// Payload size in bytes.
        #[arg(long, default_value_t = 200)]
        payload_bytes: usize,
        /// Distinct keys.
        #[arg(long, default_value_t = 1000)]
        keys: usize,
        /// Relay batch size.
        #[arg(long, default_value_t = 2000)]
        batch_size: usize,
    },
    /// Commit-to-broker latency with and without LISTEN/NOTIFY, and what enqueue (with its
    /// wake-up) costs the writing transaction.
    Wakeup {
        /// Events per latency run.
        #[arg(long, default_value_t = 300)]
        events: usize,
        /// Transactions per cost variant.
        #[arg(long, default_value_t = 3000)]
        transactions: usize,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,librdkafka=off,rdkafka=off")
            }),
        )
        .init();
    let cli = Cli::parse();
    let result = run(&cli).await;
    drop_databases(&cli.database_url).await;
    result
}

async fn run(cli: &Cli) -> anyhow::Result<()> {
    match cli.command.clone() {
        Command::Relay {
            events,
            baseline_events,
            payload_bytes,
            keys,
            batch_size,
            in_flight,
            lanes,
            instances,
            repeat,
            relay_only,
            sql_connections,
            kafka,
            wal,
        } => {
            let opts = RelayOpts {
                n: events,
                baseline_n: baseline_events,
                payload_bytes,
                keys,
                batch_size,
                in_flight,
                lanes,
                instances,
                repeat,
                relay_only,
                sql_connections: sql_connections.max(1),
                kafka,
                wal,
            };
            relay_bench(&cli.database_url, &cli.bootstrap, opts).await
        }
        Command::Consume {
            events,
            sample,
            partitions,
            max_batch,
            concurrency,
            payload_bytes,
            partition_buffer,
        } => {
            let opts = consume::ConsumeOpts {
                n: events,
                sample,
                partitions,
                max_batch,
                concurrency,
                payload_bytes,
                partition_buffer,
            };
            consume::consume_bench(&cli.database_url, &cli.bootstrap, opts).await
        }
        Command::Dashboard {
            published,
            parked,
            dead_letters,
            requests,
        } => {
            let pool = fresh_db(&cli.database_url, 8).await?;
            let opts = dashboard::Opts {
                published,
                parked,
                dead_letters,
                requests: requests.max(1),
            };
            dashboard::run(pool, opts).await
        }
        Command::Explain { published, pending } => {
            explain_bench(&cli.database_url, published, pending).await
        }
        Command::E2e {
            rate,
            orders_per_tx,
            seconds,
            partitions,
            max_batch,
            linger_ms,
            fetch_wait_ms,
            in_flight,
            lanes,
            no_split,
            no_polling,
            mock_broker,
            wal,
        } => {
            let opts = e2e::E2eOpts {
                mock_broker,
                split: !no_split,
                polling: !no_polling,
                wal,
                rate,
                orders_per_tx,
                seconds,
                partitions,
                max_batch,
                linger_ms,
                fetch_wait_ms,
                in_flight,
                lanes,
            };
            e2e::e2e_bench(&cli.database_url, &cli.bootstrap, opts).await
        }
        Command::Rabbitmq {
            amqp_url,
            events,
            payload_bytes,
            keys,
            batch_size,
        } => {
            let opts = rabbitmq::RabbitOpts {
                n: events,
                payload_bytes,
                keys,
                batch_size,
            };
            rabbitmq::rabbitmq_bench(&cli.database_url, &amqp_url, opts).await
        }
        Command::Wakeup {
            events,
            transactions,
        } => wakeup_bench(&cli.database_url, &cli.bootstrap, events, transactions).await,
    }
}

/// Databases this run created (dropped when it ends).
static CREATED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Drops this run's databases: left behind, each would cost the server an autovacuum worker
/// start per database every `autovacuum_naptime` — background load for the next benchmark.
async fn drop_databases(admin_url: &str) {
    let names = std::mem::take(&mut *CREATED.lock().expect("created lock"));
    // POSTAL_BENCH_KEEP=1 keeps them, to look at the data afterwards.
    if names.is_empty() || std::env::var("POSTAL_BENCH_KEEP").as_deref() == Ok("1") {
        return;
    }
    let Ok(opts) = postal_shared::secret::database_url_options(admin_url) else {
        return;
    };
    let Ok(admin) = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts)
        .await
    else {
        return;
    };
    for name in names {
        if let Err(e) = admin
            .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
            .await
        {
            eprintln!("could not drop database {name}: {e}");
        }
    }
    admin.close().await;
}

async fn fresh_db(admin_url: &str, max: u32) -> anyhow::Result<PgPool> {
    let opts = postal_shared::secret::database_url_options(admin_url)?;
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts.clone())
        .await
        .context("connect")?;
    let name = format!("postal_bench_{}", uuid::Uuid::now_v7().simple());
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await?;
    CREATED.lock().expect("created lock").push(name.clone());
    admin.close().await;
    // As `postal relay` configures its pool: no test query before each checkout.
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(false)
        .connect_with(opts.database(&name))
        .await?;
    postal_shared::migrate(&pool).await?;
    Ok(pool)
}

fn payload(n: usize, i: usize) -> serde_json::Value {
    // A JSON object whose encoding is `n` bytes.
    let pad = n.saturating_sub(20);
    serde_json::json!({"i": i, "p": "x".repeat(pad)})
}

/// Events `range` of a backlog on `topic`: keys `key-<i mod keys>`, payloads of `payload_bytes`.
fn backlog_chunk(
    topic: &str,
    range: std::ops::Range<usize>,
    payload_bytes: usize,
    keys: usize,
) -> anyhow::Result<Vec<NewEvent>> {
    Ok(range
        .map(|i| {
            NewEvent::json(
                topic,
                format!("key-{}", i % keys),
                "bench.event",
                &payload(payload_bytes, i),
            )
        })
        .collect::<Result<Vec<_>, _>>()?)
}

async fn seed(
    pool: &PgPool,
    topic: &str,
    n: usize,
    payload_bytes: usize,
    keys: usize,
) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await?;
    for start in (0..n).step_by(1000) {
        let batch = backlog_chunk(topic, start..(start + 1000).min(n), payload_bytes, keys)?;
        enqueue_batch(&mut conn, batch).await?;
    }
    sqlx::query("ANALYZE postal.outbox").execute(pool).await?;
    Ok(())
}

async fn outbox_len(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(pool)
        .await?)
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

struct RelayOpts {
    n: usize,
    baseline_n: usize,
    payload_bytes: usize,
    keys: usize,
    batch_size: usize,
    in_flight: usize,
    lanes: usize,
    instances: Vec<usize>,
    repeat: usize,
    relay_only: bool,
    sql_connections: usize,
    kafka: Vec<(String, String)>,
    wal: bool,
}

async fn relay_bench(url: &str, bootstrap: &str, o: RelayOpts) -> anyhow::Result<()> {
    let RelayOpts {
        n,
        baseline_n,
        payload_bytes,
        keys,
        ..
    } = o;
    println!("backlog {n} events, payload {payload_bytes} B, {keys} keys; broker {bootstrap}");
    // Room for every connection of the SQL-only drain, plus a few for the benchmark's own
    // queries (seeding, vacuum, counts) while it runs.
    let pool = fresh_db(url, 40.max(o.sql_connections as u32 + 8)).await?;
    let rounds = o.repeat.max(1);
    let mut b_rate = f64::NAN;
    if !o.relay_only {
        b_rate = seed_style_drain(&pool, bootstrap, baseline_n, payload_bytes, keys).await?;
        println!("(b) seed-style loop (claim 10, await each ack, mark each), {baseline_n} events: {b_rate:>9.0} events/s");
    }
    // Each round measures the ceilings (d) and (c) and then the relay with every instance
    // count, so that all of them see the same machine (steal time on a shared VM varies from
    // minute to minute); medians over the rounds are reported.
    let (mut c_rates, mut d_rates) = (Vec::new(), Vec::new());
    let mut a_rates: Vec<(usize, f64)> = Vec::new();
    // Per round: (a) with the first instance count over min(c, d) of the same round, and the
    // highest steal share of the round's phases.
    let mut round_ratios: Vec<(f64, f64)> = Vec::new();
    // Per round: CPU per 1,000 events of (a) with the first instance count, and of what it
    // has to do at least: (d)'s database work plus (c)'s producer and broker work.
    let mut round_costs: Vec<(f64, f64, f64)> = Vec::new();
    // Per round: (w) events/s, (s) events/s, (w)/min(c, s), (w)'s and (a)'s PostgreSQL CPU per
    // 1,000 events.
    let mut wal_rounds: Vec<(f64, f64, f64, f64, f64)> = Vec::new();
    for round in 1..=rounds {
        if rounds > 1 {
            println!("round {round} of {rounds}");
        }
        let mut steal: f64 = 0.0;
        let mut ceiling = f64::NAN;
        let mut floor = f64::NAN;
        if !o.relay_only {
            let conns = o.sql_connections;
            let (d, cpu) = sql_drain(&pool, n, payload_bytes, keys, conns).await?;
            let label = if conns == 1 {
                "connection"
            } else {
                "connections"
            };
            println!("(d) SQL-only drain (claim+delete, 1000/statement, {conns} {label}): {d:>9.0} events/s");
            println!("    {cpu}");
            steal = steal.max(cpu.steal);
            floor = cpu.ms_per_k.sum();
            d_rates.push(d);
            let (c, cpu) = raw_produce(bootstrap, &o.kafka, n, payload_bytes, keys).await?;
            println!("(c) raw rdkafka idempotent producer, not awaited one by one:      {c:>9.0} events/s");
            println!("    {cpu}");
            steal = steal.max(cpu.steal);
            floor += cpu.ms_per_k.sum();
            c_rates.push(c);
            ceiling = c.min(d);
        }
        let mut first = f64::NAN;
        let mut first_pg = f64::NAN;
        for &instances in &o.instances {
            let (r, cpu) = relay_drain(&pool, bootstrap, &o, instances).await?;
            println!(
                "(a) Postal relay, {instances} instance(s), {} lanes, batch {}, {} in flight{}: {r:>9.0} events/s",
                o.lanes,
                o.batch_size,
                o.in_flight,
                o.kafka
                    .iter()
                    .map(|(k, v)| format!(", {k}={v}"))
                    .collect::<String>()
            );
            println!("    {cpu}");
            if first.is_nan() {
                first = r;
                first_pg = cpu.ms_per_k.postgres;
                steal = steal.max(cpu.steal);
                round_costs.push((cpu.ms_per_k.sum(), floor, ceiling));
            }
            a_rates.push((instances, r));
        }
        round_ratios.push((first / ceiling, steal));
        if o.wal {
            let w = wal_drain::run(&pool, url, bootstrap, &o).await?;
            println!(
                "(w) WAL relay, 1 instance, batch {}: {:>9.0} events/s",
                o.batch_size, w.relay
            );
            println!("    {}", w.cpu);
            println!(
                "(s) the slot's read (server-side pgoutput decoding, nothing published): {:>9.0} events/s",
                w.slot
            );
            let c = c_rates.last().copied().unwrap_or(f64::NAN);
            wal_rounds.push((
                w.relay,
                w.slot,
                w.relay / c.min(w.slot),
                w.cpu.ms_per_k.postgres,
                first_pg,
            ));
        }
    }
    let median = |mut r: Vec<f64>, what: &str| -> f64 {
        if r.is_empty() {
            return f64::NAN;
        }
        r.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let m = r[r.len() / 2];
        if rounds > 1 {
            println!(
                "{what}: median {m:.0} events/s over {} rounds (min {:.0}, max {:.0})",
                r.len(),
                r[0],
                r[r.len() - 1]
            );
        }
        m
    };
    println!();
    let d = median(d_rates, "(d) SQL-only drain");
    let c = median(c_rates, "(c) raw rdkafka");
    let mut medians = Vec::new();
    for &instances in &o.instances {
        let r = a_rates
            .iter()
            .filter(|(i, _)| *i == instances)
            .map(|(_, r)| *r)
            .collect();
        medians.push(median(r, &format!("(a) {instances} instance(s)")));
    }
    let a1 = medians.first().copied().unwrap_or(f64::NAN);
    println!();
    println!("(a)/min(c,d) = {:.2}  (target >= 0.60)", a1 / c.min(d));
    if !o.relay_only && rounds > 1 {
        // The same ratio within each round (its ceilings and its relay run minutes apart at
        // most), with the highest steal share among the three phases it compares.
        let per_round: Vec<String> = round_ratios
            .iter()
            .map(|(r, s)| format!("{r:.2} (steal up to {:.0} %)", 100.0 * s))
            .collect();
        let mut sorted: Vec<f64> = round_ratios.iter().map(|(r, _)| *r).collect();
        sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "(a)/min(c,d) per round: {}; median {:.2}",
            per_round.join(", "),
            sorted[sorted.len() / 2]
        );
    }
    if !o.relay_only {
        // How the relay's CPU compares with the work it cannot avoid, and what the two cores
        // allow at either cost.
        println!("CPU per 1000 events, (a) with {} instance(s) against (d)'s database work + (c)'s producer and broker work, per round:", o.instances[0]);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        for (i, (a_ms, floor_ms, ceiling)) in round_costs.iter().enumerate() {
            println!(
                "    round {}: (a) {a_ms:.1} ms, (d)+(c) {floor_ms:.1} ms (the relay adds {:+.1}); {cores} fully busy cores allow {:.2} of min(c, d) at (a)'s cost, {:.2} at (d)+(c)'s",
                i + 1,
                a_ms - floor_ms,
                cores * 1e6 / a_ms / ceiling,
                cores * 1e6 / floor_ms / ceiling,
            );
        }
    }
    println!("(a)/(b)      = {:.1}x", a1 / b_rate);
    for (i, (w, s, ratio, w_pg, a_pg)) in wal_rounds.iter().enumerate() {
        println!(
            "round {}: (w) {w:.0}/s, (s) {s:.0}/s, (w)/min(c, s) = {ratio:.2} (target >= 0.80); PostgreSQL CPU per 1000 events: (w) {w_pg:.1} ms, (a) {a_pg:.1} ms: (w)/(a) = {:.2} (target <= 0.50)",
            i + 1,
            w_pg / a_pg
        );
    }
    Ok(())
}

/// Enqueues `n` events of `payload_bytes` on `topic` over `keys` keys, in one transaction.
async fn commit_backlog(
    pool: &PgPool,
    topic: &str,
    n: usize,
    payload_bytes: usize,
    keys: usize,
) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    for start in (0..n).step_by(1000) {
        let batch = backlog_chunk(topic, start..(start + 1000).min(n), payload_bytes, keys)?;
        enqueue_batch(&mut tx, batch).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Vacuums the outbox before a measured phase, so that no phase pays for cleaning up after the
/// one before it (each still pays for the dead rows it leaves behind itself, through
/// autovacuum, as in production).
async fn clean(pool: &PgPool) -> anyhow::Result<()> {
    sqlx::query("VACUUM postal.outbox").execute(pool).await?;
    Ok(())
}

/// (d) The SQL-only ceiling: claim and delete in batches of 1000, no broker, on `connections`
/// connections at once (each skips the rows the others hold).
async fn sql_drain(
    pool: &PgPool,
    n: usize,
    payload_bytes: usize,
    keys: usize,
    connections: usize,
) -> anyhow::Result<(f64, cpu::Report)> {
    clean(pool).await?;
    seed(pool, "bench-sql", n, payload_bytes, keys).await?;
    let wal = cpu::Wal::now(pool).await;
    let cpu = cpu::Cpu::now();
    let t = Instant::now();
    let mut loops = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let pool = pool.clone();
        loops.spawn(async move {
            loop {
                let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(
                    "DELETE FROM postal.outbox WHERE seq IN (
                         SELECT seq FROM postal.outbox WHERE status = 'pending' ORDER BY seq LIMIT 1000
                         FOR UPDATE SKIP LOCKED)
                     RETURNING seq, payload",
                )
                .fetch_all(&pool)
                .await?;
                if rows.is_empty() {
                    return anyhow::Ok(());
                }
            }
        });
    }
    while let Some(done) = loops.join_next().await {
        done??;
    }
    let r = rate(n, t.elapsed());
    let report = cpu::Cpu::now().report_since(&cpu, n);
    Ok((r, report.with_wal(wal, cpu::Wal::now(pool).await, n)))
}

/// (c) Raw rdkafka: the same records (key, payload and the relay's nine headers), sends not
/// awaited one by one.
async fn raw_produce(
    bootstrap: &str,
    kafka: &[(String, String)],
    n: usize,
    payload_bytes: usize,
    keys: usize,
) -> anyhow::Result<(f64, cpu::Report)> {
    let mut kcfg = KafkaConfig::new(bootstrap);
    kcfg.properties.extend(kafka.iter().cloned());
    let producer: FutureProducer = kcfg.client_config().create()?;
    let topic_c = format!("bench-raw-{}", uuid::Uuid::now_v7().simple());
    create_topic(bootstrap, &topic_c, 12).await?;
    let body: Vec<Vec<u8>> = (0..n)
        .map(|i| serde_json::to_vec(&payload(payload_bytes, i)).unwrap())
        .collect();
    let cpu = cpu::Cpu::now();
    let t = Instant::now();
    let mut acks = Vec::with_capacity(n);
    for (i, b) in body.iter().enumerate() {
        let key = format!("key-{}", i % keys);
        let id = uuid::Uuid::now_v7().to_string();
        let time = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        let seq = (i + 1).to_string();
        let headers = raw_headers(&id, &key, &time, &seq);
        let mut rec = FutureRecord::to(&topic_c)
            .key(key.as_bytes())
            .payload(b.as_slice())
            .headers(headers);
        loop {
            match producer.send_result(rec) {
                Ok(f) => {
                    acks.push(f);
                    break;
                }
                Err((_, r)) => {
                    rec = r;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }
    let ok = join_all(acks)
        .await
        .into_iter()
        .filter(|r| matches!(r, Ok(Ok(_))))
        .count();
    anyhow::ensure!(ok == n, "raw producer: only {ok}/{n} acknowledged");
    let r = rate(n, t.elapsed());
    let cpu = cpu::Cpu::now().report_since(&cpu, n);
    drop(producer);
    delete_topic(bootstrap, &topic_c).await;
    Ok((r, cpu))
}

/// (b) The seed-style baseline: claim 10, publish each awaiting its ack, mark each. Its
/// producer gets linger.ms=0, the best setting for one-at-a-time sends.
async fn seed_style_drain(
    pool: &PgPool,
    bootstrap: &str,
    baseline_n: usize,
    payload_bytes: usize,
    keys: usize,
) -> anyhow::Result<f64> {
    let mut bcfg = KafkaConfig::new(bootstrap);
    bcfg.properties.insert("linger.ms".into(), "0".into());
    let producer: FutureProducer = bcfg.client_config().create()?;
    seed(pool, "bench-baseline", baseline_n, payload_bytes, keys).await?;
    create_topic(bootstrap, "bench-baseline", 12).await?;
    let t = Instant::now();
    let mut done = 0;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<(i64, uuid::Uuid, String, Vec<u8>)> = sqlx::query_as(
            "SELECT seq, event_id, event_key, payload FROM postal.outbox WHERE status = 'pending'
             ORDER BY seq LIMIT 10 FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            break;
        }
        for (seq, id, key, body) in rows {
            let id = id.to_string();
            let headers = OwnedHeaders::new().insert(Header {
                key: "ce_id",
                value: Some(id.as_str()),
            });
            let rec = FutureRecord::to("bench-baseline")
                .key(key.as_bytes())
                .payload(body.as_slice())
                .headers(headers);
            producer
                .send(rec, Duration::from_secs(30))
                .await
                .map_err(|(e, _)| anyhow::anyhow!("baseline publish: {e}"))?;
            sqlx::query(
                "UPDATE postal.outbox SET status = 'published', published_at = now() WHERE seq = $1",
            )
            .bind(seq)
            .execute(&mut *tx)
            .await?;
            done += 1;
        }
        tx.commit().await?;
    }
    let r = rate(done, t.elapsed());
    sqlx::query("DELETE FROM postal.outbox")
        .execute(pool)
        .await?;
    Ok(r)
}

/// (a) Postal's relay with `instances` instances on a backlog of `o.n` events.
async fn relay_drain(
    pool: &PgPool,
    bootstrap: &str,
    o: &RelayOpts,
    instances: usize,
) -> anyhow::Result<(f64, cpu::Report)> {
    let (n, payload_bytes, keys) = (o.n, o.payload_bytes, o.keys);
    let topic = format!("bench-relay-{instances}-{}", uuid::Uuid::now_v7().simple());
    create_topic(bootstrap, &topic, 12).await?;
    let mut stops = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..instances {
        let cfg = RelayConfig::default()
            .batch_size(o.batch_size)
            .max_in_flight_batches(o.in_flight)
            .lanes(o.lanes)
            .lease(Duration::from_secs(6));
        // A short lease so that joining instances get their share within seconds; the
        // delivery timeout must stay below half of it.
        let mut kcfg = KafkaConfig::new(bootstrap);
        kcfg.properties
            .insert("message.timeout.ms".into(), "2500".into());
        kcfg.properties.extend(o.kafka.iter().cloned());
        let relay = Relay::new(pool.clone(), KafkaTransport::new(kcfg)?, cfg)?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        stops.push(tx);
        handles.push(tokio::spawn(relay.run(async move {
            let _ = rx.await;
        })));
    }
    // Wait until the instances have split the key partitions, then commit the whole
    // backlog in one transaction: the figure is the steady drain, not the start-up.
    let deadline = Instant::now() + Duration::from_secs(30);
    while sqlx::query_scalar::<_, i64>(
        "SELECT count(DISTINCT owner) FROM postal.relay_partitions WHERE lease_until > now()",
    )
    .fetch_one(pool)
    .await?
        < instances as i64
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    clean(pool).await?;
    commit_backlog(pool, &topic, n, payload_bytes, keys).await?;
    let wal = cpu::Wal::now(pool).await;
    let cpu = cpu::Cpu::now();
    let t = Instant::now();
    // Watching must not load the database: the lowest pending sequence number, searched from
    // the one found last time. Pending rows keep their sequence numbers (a failed publish
    // writes its row back under the same one) and none are inserted during the drain, so the
    // probe skips the index entries of rows already drained (they stay in the index until a
    // scan marks them dead) instead of walking them 50 times a second.
    let deadline = t + Duration::from_secs(600);
    let mut floor = 0_i64;
    while let Some(next) = sqlx::query_scalar::<_, Option<i64>>(
        "SELECT min(seq) FROM postal.outbox WHERE status = 'pending' AND seq >= $1",
    )
    .bind(floor)
    .fetch_one(pool)
    .await?
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the relay left events pending for 10 minutes (lowest pending seq {next})"
        );
        floor = next;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    anyhow::ensure!(
        outbox_len(pool).await? == 0,
        "outbox not empty after the drain"
    );
    let elapsed = t.elapsed();
    let cpu_line =
        cpu::Cpu::now()
            .report_since(&cpu, n)
            .with_wal(wal, cpu::Wal::now(pool).await, n);
    for s in stops {
        let _ = s.send(());
    }
    let mut published = 0;
    for h in handles {
        published += h.await??.published;
    }
    anyhow::ensure!(
        published as usize >= n,
        "relay published {published} of {n}"
    );
    delete_topic(bootstrap, &topic).await;
    Ok((rate(n, elapsed), cpu_line))
}

type Admin = rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>;

fn admin(bootstrap: &str) -> rdkafka::error::KafkaResult<Admin> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
}

async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
    let _ = admin(bootstrap)?
        .create_topics(
            [&NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await?;
    Ok(())
}

/// Deletes a benchmark topic once its phase is measured, so that the broker's disk and page
/// cache hold only the phase running. Returns whether the broker deleted it.
async fn delete_topic(bootstrap: &str, topic: &str) -> bool {
    let Ok(admin) = admin(bootstrap) else {
        return false;
    };
    matches!(
        admin
            .delete_topics(&[topic], &rdkafka::admin::AdminOptions::new())
            .await
            .as_deref(),
        Ok([Ok(_)])
    )
}

/// The headers the relay writes on a record of the benchmark's backlog (see
/// `postal_producer::KafkaTransport`), so that (c) produces the same records as (a): the nine
/// CloudEvents and Postal headers, in the same order, with values of about the same lengths.
fn raw_headers(id: &str, key: &str, time: &str, seq: &str) -> OwnedHeaders {
    use postal_shared::headers as h;
    headers(&[
        (h::CE_ID, id),
        (h::CE_TYPE, "bench.event"),
        (h::CE_SOURCE, "postal"),
        (h::CE_TIME, time),
        (h::CE_SPECVERSION, h::SPEC_VERSION),
        (h::CE_SUBJECT, key),
        (h::CE_SCHEMA_VERSION, "1"),
        (h::CE_POSTAL_SEQ, seq),
        (h::CONTENT_TYPE, "application/json"),
    ])
}

/// Kafka headers from (name, value) pairs, in order.
fn headers(pairs: &[(&str, &str)]) -> OwnedHeaders {
    pairs.iter().fold(
        OwnedHeaders::new_with_capacity(pairs.len()),
        |headers, &(key, value)| {
            headers.insert(Header {
                key,
                value: Some(value),
            })
        },
    )
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

async fn wakeup_bench(url: &str, bootstrap: &str, n: usize, txs: usize) -> anyhow::Result<()> {
    let pool = fresh_db(url, 8).await?;
    sqlx::query("CREATE TABLE orders (id bigserial PRIMARY KEY, customer text NOT NULL, total bigint NOT NULL)")
        .execute(&pool)
        .await?;

    // Cost on the writing transaction (synchronous_commit on), A/B/C interleaved in one run.
    let mut plain = Vec::with_capacity(txs);
    let mut with_enqueue = Vec::with_capacity(txs);
    let mut without_notify = Vec::with_capacity(txs);
    let mut conn = pool.acquire().await?;
    for i in 0..txs {
        for variant in 0..3 {
            let t = Instant::now();
            let mut tx = sqlx::Acquire::begin(&mut *conn).await?;
            sqlx::query("INSERT INTO orders (customer, total) VALUES ($1, $2)")
                .bind(format!("c-{}", i % 100))
                .bind(i as i64)
                .execute(&mut *tx)
                .await?;
            match variant {
                0 => {}
                1 => {
                    let ev = NewEvent::json(
                        "bench-cost",
                        format!("c-{}", i % 100),
                        "order.created",
                        &payload(200, i),
                    )?;
                    enqueue(&mut tx, ev).await?;
                }
                _ => {
                    // The same row without the advisory lock and NOTIFY: isolates the wake-up.
                    sqlx::query(
                        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload)
                         VALUES ($1, 'bench-cost', $2, 'order.created', $3)",
                    )
                    .bind(uuid::Uuid::now_v7())
                    .bind(format!("c-{}", i % 100))
                    .bind(serde_json::to_vec(&payload(200, i))?)
                    .execute(&mut *tx)
                    .await?;
                }
            }
            tx.commit().await?;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            [&mut plain, &mut with_enqueue, &mut without_notify][variant].push(ms);
        }
    }
    drop(conn);
    sqlx::query("DELETE FROM postal.outbox")
        .execute(&pool)
        .await?;
    for v in [&mut plain, &mut with_enqueue, &mut without_notify] {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    println!("writing transaction, {txs} each, synchronous_commit on (ms):");
    println!(
        "  order insert only:                        p50 {:.3}  p99 {:.3}",
        percentile(&plain, 0.5),
        percentile(&plain, 0.99)
    );
    println!(
        "  + enqueue (key lock + NOTIFY):            p50 {:.3}  p99 {:.3}",
        percentile(&with_enqueue, 0.5),
        percentile(&with_enqueue, 0.99)
    );
    println!(
        "  + outbox insert without lock and NOTIFY:  p50 {:.3}  p99 {:.3}",
        percentile(&without_notify, 0.5),
        percentile(&without_notify, 0.99)
    );
    println!(
        "  added by enqueue at p50: {:+.3} ms ({:+.1}%); of which lock + NOTIFY: {:+.3} ms",
        percentile(&with_enqueue, 0.5) - percentile(&plain, 0.5),
        100.0 * (percentile(&with_enqueue, 0.5) / percentile(&plain, 0.5) - 1.0),
        percentile(&with_enqueue, 0.5) - percentile(&without_notify, 0.5)
    );

    // Commit-to-broker latency, one event every 20 ms, with LISTEN/NOTIFY and polling only.
    for listen in [true, false] {
        let topic = format!("bench-wakeup-{}", uuid::Uuid::now_v7().simple());
        create_topic(bootstrap, &topic, 12).await?;
        let mut kcfg = KafkaConfig::new(bootstrap);
        kcfg.properties.insert("linger.ms".into(), "0".into());
        let cfg = RelayConfig::default()
            .listen(listen)
            .poll_interval(Duration::from_millis(500));
        let relay = Relay::new(pool.clone(), KafkaTransport::new(kcfg)?, cfg)?;
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(relay.run(async move {
            let _ = rx.await;
        }));
        let reader = {
            let bootstrap = bootstrap.to_owned();
            let topic = topic.clone();
            let never = std::sync::atomic::AtomicBool::new(false);
            tokio::task::spawn_blocking(move || receive_times(&bootstrap, &topic, n, 5, &never))
        };
        tokio::time::sleep(Duration::from_millis(1500)).await; // let the reader join its partitions
        let mut commits = std::collections::HashMap::new();
        let mut conn = pool.acquire().await?;
        for i in 0..n {
            let mut tx = sqlx::Acquire::begin(&mut *conn).await?;
            let id = enqueue(
                &mut tx,
                NewEvent::json(topic.as_str(), format!("k{}", i % 10), "e", &i)?,
            )
            .await?;
            tx.commit().await?;
            commits.insert(id.to_string(), std::time::SystemTime::now());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let received = reader.await??;
        let _ = stop.send(());
        handle.await??;
        let mut lat: Vec<f64> = received
            .iter()
            .filter_map(|(id, at)| {
                commits
                    .get(id)
                    .map(|c| at.duration_since(*c).unwrap_or_default().as_secs_f64() * 1000.0)
            })
            .collect();
        lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "commit -> consumer receipt, {} events, {}: p50 {:.1} ms  p99 {:.1} ms",
            lat.len(),
            if listen {
                "LISTEN/NOTIFY + 500 ms poll"
            } else {
                "500 ms polling only"
            },
            percentile(&lat, 0.5),
            percentile(&lat, 0.99)
        );
    }
    Ok(())
}

/// Reads `topic` from the beginning with a plain consumer (`fetch.wait.max.ms` = `fetch_wait_ms`),
/// noting when each event id arrived, until `n` records, `stop` is set, or two minutes.
fn receive_times(
    bootstrap: &str,
    topic: &str,
    n: usize,
    fetch_wait_ms: u32,
    stop: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<Vec<(String, std::time::SystemTime)>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set(
            "group.id",
            format!("bench-{}", uuid::Uuid::now_v7().simple()),
        )
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", fetch_wait_ms.to_string())
        .set("fetch.min.bytes", "1")
        .create()?;
    let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let mut tpl = TopicPartitionList::new();
    for t in md.topics() {
        for p in t.partitions() {
            tpl.add_partition_offset(topic, p.id(), Offset::Beginning)?;
        }
    }
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut out = Vec::with_capacity(n.min(1 << 20));
    while out.len() < n
        && Instant::now() < deadline
        && !stop.load(std::sync::atomic::Ordering::Relaxed)
    {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            let at = std::time::SystemTime::now();
            if let Some(h) = m.headers() {
                if let Some(id) = h.iter().find(|h| h.key == "ce_id").and_then(|h| h.value) {
                    out.push((String::from_utf8_lossy(id).into_owned(), at));
                }
            }
        }
    }
    Ok(out)
}

async fn explain_bench(url: &str, published: i64, pending: i64) -> anyhow::Result<()> {
    let pool = fresh_db(url, 2).await?;
    explain_insert(&pool, "pending", pending).await?;
    explain_claim(
        &pool,
        &format!("claim of 2000 rows: {pending} pending, no history"),
        true,
        true,
        true,
        None,
    )
    .await?;
    explain_insert(&pool, "published", published).await?;
    explain_claim(
        &pool,
        &format!("claim of 2000 rows: {pending} pending, {published} retained published rows"),
        true,
        true,
        true,
        None,
    )
    .await?;
    // One relay of four (a contiguous quarter of the key partitions): the partition range
    // checked inside the index, and for comparison only the mask (checked on each table row).
    for in_index in [true, false] {
        explain_claim(
            &pool,
            &format!(
                "claim of 2000 rows from partitions 64..=127 (one relay of four), range {}",
                if in_index {
                    "checked in the index"
                } else {
                    "not given: mask only"
                }
            ),
            false,
            true,
            true,
            Some((64, 127, in_index)),
        )
        .await?;
    }

    // A backlog committed since the last ANALYZE: the statistics still describe an empty
    // table. With and without the relay's planner settings (claim::PLAN_SETTINGS).
    let pool = fresh_db(url, 2).await?;
    let backlog = 300_000;
    explain_insert(&pool, "pending", backlog).await?;
    for settings in [false, true] {
        explain_claim(
            &pool,
            &format!(
                "fresh backlog of {backlog} rows, statistics not yet updated, planner settings {}",
                if settings { "of the relay" } else { "default" }
            ),
            false,
            settings,
            false,
            None,
        )
        .await?;
    }
    // Most of the backlog published (deleted) and autovacuum not yet through: the claim walks
    // the index entries of deleted rows at the head of the pending index.
    sqlx::query(
        "DELETE FROM postal.outbox WHERE seq IN (SELECT seq FROM postal.outbox ORDER BY seq LIMIT $1)",
    )
    .bind(backlog - 10_000)
    .execute(&pool)
    .await?;
    for label in ["first claim after", "second claim after"] {
        explain_claim(
            &pool,
            &format!(
                "{label} {} rows were published and deleted, before VACUUM",
                backlog - 10_000
            ),
            false,
            true,
            false,
            None,
        )
        .await?;
    }
    sqlx::query("VACUUM postal.outbox").execute(&pool).await?;
    explain_claim(&pool, "the same after VACUUM", false, true, false, None).await?;
    Ok(())
}

async fn explain_insert(pool: &PgPool, status: &str, n: i64) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status, published_at)
         SELECT postal.uuid_v7(), 'bench', 'key-' || (g % 1000), 'bench.event',
                convert_to(repeat('x', 200), 'UTF8'), $1,
                CASE WHEN $1 = 'published' THEN now() - interval '1 day' END
         FROM generate_series(1, $2) g",
    )
    .bind(status)
    .bind(n)
    .execute(pool)
    .await?;
    Ok(())
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of the relay's claim statement (rolled back). `full` prints the
/// whole plan, otherwise the scan of the pending rows and the totals.
async fn explain_claim(
    pool: &PgPool,
    label: &str,
    analyze: bool,
    settings: bool,
    full: bool,
    part: Option<(i16, i16, bool)>,
) -> anyhow::Result<()> {
    // `part`: claim only partitions lo..=hi (the mask), and say so to the index or not.
    let (mask, lo, hi) = match part {
        None => (None, 0i16, 255i16),
        Some((lo, hi, in_index)) => {
            let mask: Vec<bool> = (0..256).map(|p| p >= lo && p <= hi).collect();
            if in_index {
                (Some(mask), lo, hi)
            } else {
                (Some(mask), 0, 255)
            }
        }
    };
    if analyze {
        sqlx::query("ANALYZE postal.outbox").execute(pool).await?;
    }
    let mut tx = pool.begin().await?;
    if settings {
        sqlx::query(postal_producer::testing::claim::PLAN_SETTINGS)
            .execute(&mut *tx)
            .await?;
    }
    let plan: Vec<String> = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, BUFFERS) {}",
        postal_producer::testing::claim::CLAIM_DELETE
    ))
    .bind(mask)
    .bind(2000i64)
    .bind(None::<Vec<String>>)
    .bind(None::<Vec<String>>)
    .bind(lo)
    .bind(hi)
    .bind(0i64)
    .bind(Vec::<i64>::new())
    .bind(Vec::<i64>::new())
    .fetch_all(&mut *tx)
    .await?;
    tx.rollback().await?;
    println!("--- {label}");
    for line in plan {
        if full
            || line.contains("on outbox o ")
            || line.contains("Sort Method")
            || line.contains("Execution Time")
        {
            println!("{line}");
        }
    }
    Ok(())
}
