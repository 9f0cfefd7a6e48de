//! End-to-end latency at a steady rate: the commit of an order (with its `order.created` event
//! in the same transaction) to the commit of the ledger row written by an idempotent consumer,
//! through Postal's relay, the broker and Postal's consumer runtime — with the LISTEN/NOTIFY
//! wake-up and with polling only. A third line measures the broker path alone (a raw producer
//! to a raw consumer with the same client settings), i.e. what the broker contributes.
//!
//! Both ends are read from PostgreSQL's clock. With `track_commit_timestamp = on` (the local
//! stack sets it) they are the commit timestamps of the order's and of the ledger row's
//! transactions (`pg_xact_commit_timestamp(xmin)`), exactly what is asked for. Without it the
//! benchmark says so and falls back to the inserts: `orders.created_at` is
//! `clock_timestamp()` at the order's insert and `ledger.applied_at` at the ledger row's
//! insert, each followed by its commit. The latencies are also reported per 5 s window of
//! order time, which shows whether they drift while the topic fills, and split into three
//! segments at the record's Kafka timestamp (set when the relay hands the event to its
//! producer; millisecond resolution) and at the ledger row's insert: the relay (wake-up and
//! claim), the broker and the consumer up to the handler, and the rest of the consumer's
//! transaction.
//!
//! With `--mock-broker` the same run goes through librdkafka's mock cluster (a Kafka-protocol
//! broker in memory, on loopback, served by a thread of the benchmark process) instead of the
//! given broker: Postal's path without the broker's process on the same cores.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cpu::Cpu;

use postal_consumer::{idempotent, Consumer, ConsumerConfig, Event, HandlerError, Stats};
use postal_producer::{enqueue, KafkaConfig, KafkaTransport, NewEvent, Relay, RelayConfig};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Message;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sqlx::{PgPool, Postgres, Transaction};

use crate::{create_topic, fresh_db, percentile, receive_times};

/// Options of the end-to-end benchmark.
pub struct E2eOpts {
    pub rate: u64,
    /// Orders (events) per writing transaction.
    pub orders_per_tx: u64,
    pub seconds: u64,
    pub partitions: i32,
    pub max_batch: usize,
    pub linger_ms: u32,
    pub fetch_wait_ms: u32,
    pub in_flight: usize,
    pub lanes: usize,
    /// Run a plain consumer on the topic too (order → broker → plain consumer).
    pub split: bool,
    /// Run the polling-only variant too.
    pub polling: bool,
    /// Use librdkafka's in-process mock cluster instead of the given broker.
    pub mock_broker: bool,
    /// Run the WAL relay variant too.
    pub wal: bool,
}

/// How a run's relay learns of new events.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// LISTEN/NOTIFY, with the 1 s safety poll.
    Listen,
    /// Polling only (every 1 s).
    Poll,
    /// A logical replication slot (`--read-from wal`).
    Wal,
}

/// The broker a run goes through: the one given, or librdkafka's mock cluster.
enum Broker {
    Remote(String),
    Mock(MockCluster<'static, DefaultProducerContext>),
}

impl Broker {
    fn bootstrap(&self) -> String {
        match self {
            Broker::Remote(bootstrap) => bootstrap.clone(),
            Broker::Mock(mock) => mock.bootstrap_servers(),
        }
    }

    /// Creates a topic (the mock cluster has no CreateTopics API: through its own call).
    async fn new_topic(&self, topic: &str, partitions: i32) -> anyhow::Result<()> {
        match self {
            Broker::Remote(bootstrap) => create_topic(bootstrap, topic, partitions).await,
            Broker::Mock(mock) => Ok(mock.create_topic(topic, partitions, 1)?),
        }
    }
}

/// The ledger handler of the benchmark.
#[idempotent(consumer = "ledger")]
async fn book(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<serde_json::Value>,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (order_id, event_id, produced_at) VALUES ($1, $2, $3)")
        .bind(event.payload["order_id"].as_i64().unwrap_or(-1))
        .bind(event.id.as_uuid())
        .bind(event.timestamp)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

pub async fn e2e_bench(url: &str, bootstrap: &str, opts: E2eOpts) -> anyhow::Result<()> {
    let broker = if opts.mock_broker {
        let mock = MockCluster::new(1)?;
        println!(
            "broker: librdkafka's mock cluster at {} (in this process), not {bootstrap}",
            mock.bootstrap_servers()
        );
        Broker::Mock(mock)
    } else {
        Broker::Remote(bootstrap.to_owned())
    };
    println!(
        "end to end at {} orders/s ({} per transaction) for {} s per variant ({} partitions, consumer max_batch {}, linger.ms {}, fetch.wait.max.ms {}):",
        opts.rate, opts.orders_per_tx, opts.seconds, opts.partitions, opts.max_batch, opts.linger_ms, opts.fetch_wait_ms
    );
    let commit_ts = commit_timestamps(url).await?;
    println!(
        "  {}",
        if commit_ts {
            "measured from commit timestamps (track_commit_timestamp = on)"
        } else {
            "track_commit_timestamp is off: measured from the order's insert to the ledger row's insert instead of commit to commit"
        }
    );
    for wake in [Wake::Listen, Wake::Poll, Wake::Wal] {
        if (wake == Wake::Poll && !opts.polling) || (wake == Wake::Wal && !opts.wal) {
            continue;
        }
        let cpu = Cpu::now();
        let r = postal_run(url, &broker, &opts, wake, commit_ts).await?;
        let cpu = Cpu::now().report_since(&cpu, r.e2e.n);
        println!(
            "  order commit -> ledger commit, {}: {} orders, p50 {:.1} ms  p99 {:.1} ms",
            match wake {
                Wake::Listen => "LISTEN/NOTIFY wake-up (+1 s safety poll)",
                Wake::Poll => "polling only (relay default, every 1 s)",
                Wake::Wal => "WAL relay (logical replication slot)",
            },
            r.e2e.n,
            r.e2e.p50,
            r.e2e.p99
        );
        println!(
            "    orders committed at {:.0}/s (target {}/s)",
            r.offered, opts.rate
        );
        println!("    {cpu} (the whole variant, set-up included)");
        let line = |w: &[f64]| {
            w.iter()
                .map(|p| format!("{p:.1}"))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        println!(
            "    p50 per 5 s window of order time: {}  (orders: {})",
            line(&r.windows),
            r.counts
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(" / ")
        );
        println!("      of which (record timestamps have 1 ms resolution):");
        // Without commit timestamps the ledger's end is its insert: the last segment is empty.
        let segments = if commit_ts { 3 } else { 2 };
        for (name, w) in [
            (
                "order commit -> relay hands the record to the producer",
                &r.segments[0],
            ),
            (
                "-> handler's insert (broker, fetch, consumer, dedup)",
                &r.segments[1],
            ),
            (
                "-> ledger commit (rest of the consumer's transaction)",
                &r.segments[2],
            ),
        ]
        .into_iter()
        .take(segments)
        {
            println!("        {name}: {}", line(w));
        }
        if opts.split {
            println!(
                "    of which order commit -> plain consumer of the topic (relay + broker): {} records, p50 {:.1} ms  p99 {:.1} ms",
                r.to_broker.n, r.to_broker.p50, r.to_broker.p99
            );
        }
    }
    let cpu = Cpu::now();
    let b = broker_run(&broker, &opts).await?;
    let cpu = Cpu::now().report_since(&cpu, b.e2e.n);
    println!(
        "  broker alone (raw produce -> raw consume, same settings): {} records, p50 {:.1} ms  p99 {:.1} ms",
        b.e2e.n, b.e2e.p50, b.e2e.p99
    );
    println!("    {cpu}");
    println!(
        "    p50 per 5 s window of send time: {}",
        b.windows
            .iter()
            .map(|p| format!("{p:.1}"))
            .collect::<Vec<_>>()
            .join(" / ")
    );
    println!(
        "    of which send -> acknowledgement (acks=all): p50 {:.1} ms  p99 {:.1} ms",
        b.ack.p50, b.ack.p99
    );
    Ok(())
}

async fn postal_run(
    url: &str,
    broker: &Broker,
    opts: &E2eOpts,
    wake: Wake,
    commit_ts: bool,
) -> anyhow::Result<Run> {
    let pool = fresh_db(url, 40).await?;
    let slot = format!("postal_bench_{}", uuid::Uuid::now_v7().simple());
    let source = if wake == Wake::Wal {
        postal_producer::wal::slot::create(&pool, &slot, &slot).await?;
        let database: String = sqlx::query_scalar("SELECT current_database()::text")
            .fetch_one(&pool)
            .await?;
        postal_producer::RelaySource::Wal(postal_producer::WalSource::new(
            with_database(url, &database),
            slot.as_str(),
            slot.as_str(),
        ))
    } else {
        postal_producer::RelaySource::Poll
    };
    sqlx::raw_sql(
        "CREATE TABLE orders (id bigserial PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT clock_timestamp());
         CREATE TABLE ledger (order_id bigint NOT NULL, event_id uuid NOT NULL, produced_at timestamptz,
                              applied_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(&pool)
    .await?;
    let bootstrap = &broker.bootstrap();
    let topic = format!("bench-e2e-{}", uuid::Uuid::now_v7().simple());
    broker.new_topic(&topic, opts.partitions).await?;
    // A plain consumer on the same topic splits the path: order → broker → plain consumer
    // (relay and broker) versus order → ledger commit (plus Postal's consumer).
    let stop_reader = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = opts.split.then(|| {
        let (bootstrap, topic, stop) = (bootstrap.to_owned(), topic.clone(), stop_reader.clone());
        let wait = opts.fetch_wait_ms;
        tokio::task::spawn_blocking(move || {
            receive_times(&bootstrap, &topic, usize::MAX, wait, &stop)
        })
    });

    let mut kcfg = KafkaConfig::new(bootstrap);
    kcfg.properties
        .insert("linger.ms".into(), opts.linger_ms.to_string());
    let mut relay_config = RelayConfig::default()
        .listen(wake == Wake::Listen)
        .max_in_flight_batches(opts.in_flight)
        .lanes(opts.lanes);
    relay_config.source = source;
    let relay = Relay::new(pool.clone(), KafkaTransport::new(kcfg)?, relay_config)?;
    let (stop_relay, rx) = tokio::sync::oneshot::channel::<()>();
    let relay_task = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));

    let mut config = ConsumerConfig::new(bootstrap, format!("ledger-{topic}"));
    config.max_batch = opts.max_batch;
    for (k, v) in [
        ("fetch.wait.max.ms", opts.fetch_wait_ms.to_string()),
        ("session.timeout.ms", "6000".into()),
    ] {
        config.kafka.insert(k.into(), v);
    }
    let consumer = Consumer::builder(pool.clone(), config)
        .on(&topic, "order.created", book)
        .build()?;
    let stats: Arc<Stats> = consumer.stats();
    let (stop_consumer, rx) = tokio::sync::oneshot::channel::<()>();
    let consumer_task = tokio::spawn(consumer.run(async move {
        let _ = rx.await;
    }));

    // Warm up until the consumer has its partitions and one order went through.
    let warm = Instant::now();
    while stats.snapshot().applied == 0 {
        create_orders(&pool, &topic, 1).await?;
        anyhow::ensure!(
            warm.elapsed() < Duration::from_secs(60),
            "no order came through in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let warmup_orders: i64 = sqlx::query_scalar("SELECT max(id) FROM orders")
        .fetch_one(&pool)
        .await?;

    // Steady load: transactions of `orders_per_tx` orders (one event each), one writer per 250
    // transactions/s (at least 4, at most 16), each at its share of the rate. The writers'
    // rate is bounded by the machine; the rate reached is printed next to the target.
    let per_tx = opts.orders_per_tx.max(1);
    let total = opts.rate * opts.seconds;
    let tx_rate = (opts.rate / per_tx).max(1);
    let writers = (tx_rate / 250).clamp(4, 16);
    let per_writer = total / (writers * per_tx);
    let sent = per_writer * writers * per_tx;
    let load_started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..writers {
        let pool = pool.clone();
        let topic = topic.clone();
        let period = Duration::from_secs_f64(writers as f64 / tx_rate as f64);
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            for _ in 0..per_writer {
                tick.tick().await;
                create_orders(&pool, &topic, per_tx).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let offered = sent as f64 / load_started.elapsed().as_secs_f64();
    let want = warmup_orders as u64 + sent;
    let deadline = Instant::now() + Duration::from_secs(120);
    while stats.snapshot().applied < want {
        if Instant::now() >= deadline {
            anyhow::bail!(
                "consumer applied {} of {want}; {:?}; {}",
                stats.snapshot().applied,
                stats.snapshot(),
                where_they_are(&pool, bootstrap, &topic).await
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop_consumer.send(());
    consumer_task.await??;
    let _ = stop_relay.send(());
    relay_task.await??;
    if wake == Wake::Wal {
        postal_producer::wal::slot::drop(&pool, &slot, &slot).await?;
    }

    // (seconds since the first measured order, latency in ms, and its three segments: order
    // commit → record timestamp (the relay's producer call), → the handler's insert, → ledger
    // commit)
    type Point = (f64, f64, Option<f64>, Option<f64>, f64);
    let rows: Vec<Point> = sqlx::query_as(
        "WITH t AS (
             SELECT o.created_at,
                    CASE WHEN $2 THEN pg_xact_commit_timestamp(o.xmin) ELSE o.created_at END AS ordered,
                    l.produced_at, l.applied_at,
                    CASE WHEN $2 THEN pg_xact_commit_timestamp(l.xmin) ELSE l.applied_at END AS booked
             FROM orders o JOIN ledger l ON l.order_id = o.id WHERE o.id > $1)
         SELECT extract(epoch FROM created_at - min(created_at) OVER ())::float8,
                (extract(epoch FROM booked - ordered) * 1000)::float8,
                (extract(epoch FROM produced_at - ordered) * 1000)::float8,
                (extract(epoch FROM applied_at - produced_at) * 1000)::float8,
                (extract(epoch FROM booked - applied_at) * 1000)::float8
         FROM t",
    )
    .bind(warmup_orders)
    .bind(commit_ts)
    .fetch_all(&pool)
    .await?;
    let windows_of = |f: &dyn Fn(&Point) -> Option<f64>| {
        windows(
            &rows
                .iter()
                .filter_map(|p| Some((p.0, f(p)?)))
                .collect::<Vec<_>>(),
            5.0,
        )
    };
    let segments = [
        windows_of(&|p| p.2),
        windows_of(&|p| p.3),
        windows_of(&|p| Some(p.4)),
    ];
    let grouped = by_window(&rows.iter().map(|p| (p.0, p.1)).collect::<Vec<_>>(), 5.0);
    let counts = grouped.iter().map(Vec::len).collect();
    let windows = p50s(grouped);
    let lat: Vec<f64> = rows.into_iter().map(|p| p.1).collect();
    stop_reader.store(true, std::sync::atomic::Ordering::Relaxed);
    let received: std::collections::HashMap<String, std::time::SystemTime> = match reader {
        Some(reader) => reader.await??.into_iter().collect(),
        None => Default::default(),
    };
    let created: Vec<(uuid::Uuid, f64)> = sqlx::query_as(
        "SELECT l.event_id, extract(epoch FROM o.created_at)::float8
         FROM orders o JOIN ledger l ON l.order_id = o.id WHERE o.id > $1",
    )
    .bind(warmup_orders)
    .fetch_all(&pool)
    .await?;
    let to_broker: Vec<f64> = created
        .iter()
        .filter_map(|(id, at)| {
            let got = received.get(&id.to_string())?;
            let got = got
                .duration_since(std::time::UNIX_EPOCH)
                .ok()?
                .as_secs_f64();
            Some((got - at) * 1000.0)
        })
        .collect();
    Ok(Run {
        offered,
        windows,
        counts,
        segments,
        e2e: Latencies::of(lat),
        to_broker: Latencies::of(to_broker),
    })
}

/// p50, p99 and count of a set of latencies (ms).
struct Latencies {
    p50: f64,
    p99: f64,
    n: usize,
}

impl Latencies {
    fn of(mut v: Vec<f64>) -> Latencies {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        Latencies {
            p50: percentile(&v, 0.5),
            p99: percentile(&v, 0.99),
            n: v.len(),
        }
    }
}

/// Where the events that did not arrive are: the outbox by status, the consumer's stored
/// offsets and the topic's high watermarks.
async fn where_they_are(pool: &PgPool, bootstrap: &str, topic: &str) -> String {
    let outbox: Vec<(String, i64)> =
        sqlx::query_as("SELECT status::text, count(*) FROM postal.outbox GROUP BY 1 ORDER BY 1")
            .fetch_all(pool)
            .await
            .unwrap_or_default();
    let stored: Vec<(i32, Option<i64>)> = sqlx::query_as(
        "SELECT partition, next_offset FROM postal.consumer_offsets WHERE topic = $1 ORDER BY 1",
    )
    .bind(topic)
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let high = {
        let (bootstrap, topic) = (bootstrap.to_owned(), topic.to_owned());
        tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<i64>> {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .create()?;
            let metadata = consumer.fetch_metadata(Some(&topic), Duration::from_secs(5))?;
            let partitions = metadata
                .topics()
                .first()
                .map_or(0, |t| t.partitions().len() as i32);
            (0..partitions)
                .map(|p| {
                    Ok(consumer
                        .fetch_watermarks(&topic, p, Duration::from_secs(5))?
                        .1)
                })
                .collect()
        })
        .await
        .map_err(anyhow::Error::from)
        .and_then(|r| r)
    };
    let rows: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM ledger),
                (SELECT count(*) FROM postal.processed_events)",
    )
    .fetch_one(pool)
    .await
    .unwrap_or_default();
    format!(
        "orders, ledger rows, dedup rows {rows:?}; outbox by status {outbox:?}; stored offsets {stored:?}; broker's high watermarks {high:?}"
    )
}

/// Whether the server records commit timestamps (`track_commit_timestamp`).
async fn commit_timestamps(url: &str) -> anyhow::Result<bool> {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let on: String = sqlx::query_scalar("SHOW track_commit_timestamp")
        .fetch_one(&mut conn)
        .await?;
    conn.close().await?;
    Ok(on == "on")
}

/// The latencies of `(seconds, latency)` points grouped by `width`-second window, in order.
fn by_window(points: &[(f64, f64)], width: f64) -> Vec<Vec<f64>> {
    let mut by_window: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for &(at, lat) in points {
        by_window.entry((at / width) as u64).or_default().push(lat);
    }
    by_window.into_values().collect()
}

/// p50 of the latencies per `width`-second window of `(seconds, latency)` points.
fn windows(points: &[(f64, f64)], width: f64) -> Vec<f64> {
    p50s(by_window(points, width))
}

/// The p50 of each group of latencies.
fn p50s(groups: Vec<Vec<f64>>) -> Vec<f64> {
    groups
        .into_iter()
        .map(|mut v| {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            percentile(&v, 0.5)
        })
        .collect()
}

/// Latencies of one Postal run.
struct Run {
    /// Orders per second the writers committed (the target may be more than the machine does).
    offered: f64,
    /// Order commit → ledger commit.
    e2e: Latencies,
    /// p50 of `e2e` per window of order time.
    windows: Vec<f64>,
    /// Orders per window of `windows` (the last one holds what the generator sent late).
    counts: Vec<usize>,
    /// p50 per window of the segments: order commit → record timestamp, → handler's insert,
    /// → ledger commit.
    segments: [Vec<f64>; 3],
    /// Order → plain consumer on the same topic.
    to_broker: Latencies,
}

/// One transaction: `n` orders, each with its `order.created` event.
async fn create_orders(pool: &PgPool, topic: &str, n: u64) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    for _ in 0..n {
        let id: i64 = sqlx::query_scalar("INSERT INTO orders DEFAULT VALUES RETURNING id")
            .fetch_one(&mut *tx)
            .await?;
        enqueue(
            &mut tx,
            NewEvent::json(
                topic,
                format!("customer-{}", id % 500),
                "order.created",
                &serde_json::json!({"order_id": id}),
            )?,
        )
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Latencies of the broker path alone.
struct BrokerRun {
    /// Raw produce → raw consume.
    e2e: Latencies,
    /// Send → the producer's delivery report.
    ack: Latencies,
    /// p50 of `e2e` per window of send time.
    windows: Vec<f64>,
}

/// Raw producer → raw consumer at the same rate and client settings: the broker's share.
async fn broker_run(broker: &Broker, opts: &E2eOpts) -> anyhow::Result<BrokerRun> {
    let bootstrap = &broker.bootstrap();
    let topic = format!("bench-broker-{}", uuid::Uuid::now_v7().simple());
    broker.new_topic(&topic, opts.partitions).await?;
    let n = (opts.rate * opts.seconds) as usize;
    let reader = {
        let bootstrap = bootstrap.to_owned();
        let topic = topic.clone();
        let wait = opts.fetch_wait_ms;
        let seconds = opts.seconds;
        // (send time in ms since the epoch, latency in ms)
        tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<(f64, f64)>> {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .set(
                    "group.id",
                    format!("bench-{}", uuid::Uuid::now_v7().simple()),
                )
                .set("enable.auto.commit", "false")
                .set("auto.offset.reset", "earliest")
                .set("fetch.wait.max.ms", wait.to_string())
                .create()?;
            consumer.subscribe(&[&topic])?;
            let deadline = Instant::now() + Duration::from_secs(seconds + 120);
            let mut out = Vec::with_capacity(n);
            while out.len() < n && Instant::now() < deadline {
                if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)?
                        .as_secs_f64()
                        * 1000.0;
                    if let Some(sent) = m
                        .payload()
                        .and_then(|p| std::str::from_utf8(p).ok())
                        .and_then(|s| s.parse::<f64>().ok())
                    {
                        if sent > 0.0 {
                            out.push((sent, now - sent));
                        }
                    }
                }
            }
            Ok(out)
        })
    };
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", opts.linger_ms.to_string())
        .create()?;
    // Let the reader join the group, with marker records that are not measured.
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_secs(5) {
        producer
            .send(
                FutureRecord::to(&topic).key("warm").payload("0"),
                Duration::from_secs(5),
            )
            .await
            .map_err(|(e, _)| e)?;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / opts.rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut acks = Vec::with_capacity(n);
    for i in 0..n {
        tick.tick().await;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64()
            * 1000.0;
        let payload = format!("{now:.3}");
        let key = format!("k{}", i % 500);
        let sent = Instant::now();
        let ack = producer
            .send_result(FutureRecord::to(&topic).key(&key).payload(&payload))
            .map_err(|(e, _)| e)?;
        // Awaited in its own task, so the time is taken when the report arrives.
        acks.push(tokio::spawn(async move {
            let _ = ack.await;
            sent.elapsed().as_secs_f64() * 1e3
        }));
    }
    let mut ack_lat = Vec::with_capacity(acks.len());
    for a in acks {
        ack_lat.push(a.await?);
    }
    let mut received = reader.await??;
    let first = received.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
    for r in &mut received {
        r.0 = (r.0 - first) / 1000.0;
    }
    Ok(BrokerRun {
        windows: windows(&received, 5.0),
        e2e: Latencies::of(received.into_iter().map(|r| r.1).collect()),
        ack: Latencies::of(ack_lat),
    })
}

/// `url` with its database replaced by `database` (the query string kept).
pub(crate) fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let authority_end = base.find("://").map_or(0, |i| i + 3);
    let root = match base[authority_end..].find('/') {
        Some(i) => &base[..authority_end + i],
        None => base,
    };
    match query {
        Some(q) => format!("{root}/{database}?{q}"),
        None => format!("{root}/{database}"),
    }
}
