//! The consumer benchmark: consume pre-produced events whose handler inserts one row.
//!
//! (a) Postal in throughput mode, (b) Postal with one transaction per message (on a sample),
//! (c) a raw consume loop without database work, (d) a SQL-only ceiling: the same dedup insert
//! and one-row effect per event in batches, no broker — with the effect inserted row by row as
//! the handler does (d), and as one multi-row insert (d'). (a'') is Postal in throughput mode
//! with a batch handler doing (d')'s multi-row insert.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::future::join_all;
use postal_consumer::{idempotent, Batch, Consumer, ConsumerConfig, Event, HandlerError, Stats};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::{PgPool, Postgres, Transaction};

use crate::cpu::Cpu;
use crate::{create_topic, fresh_db, headers, payload, rate};

/// Options of the consumer benchmark.
pub struct ConsumeOpts {
    pub n: usize,
    pub sample: usize,
    pub partitions: i32,
    pub max_batch: usize,
    pub concurrency: usize,
    pub payload_bytes: usize,
    /// The consumer's `partition_buffer` (records), when not its default.
    pub partition_buffer: Option<usize>,
}

/// The benchmark handler: one row per event.
#[idempotent(consumer = "bench")]
async fn record_row(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<serde_json::Value>,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (event_id, i) VALUES ($1, $2)")
        .bind(event.id.as_uuid())
        .bind(event.payload["i"].as_i64().unwrap_or(-1))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The batch benchmark handler: the batch's rows in one multi-row insert, as (d') does.
#[idempotent(consumer = "bench")]
async fn record_rows(
    tx: &mut Transaction<'_, Postgres>,
    events: Batch<serde_json::Value>,
) -> Result<(), HandlerError> {
    let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.id.as_uuid()).collect();
    let is: Vec<i64> = events
        .iter()
        .map(|e| e.payload["i"].as_i64().unwrap_or(-1))
        .collect();
    sqlx::query("INSERT INTO effects SELECT unnest($1::uuid[]), unnest($2::bigint[])")
        .bind(&ids)
        .bind(&is)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// How a Postal run is configured.
#[derive(Clone, Copy)]
struct RunOpts {
    max_batch: usize,
    concurrency: usize,
    form: Form,
    partition_buffer: Option<usize>,
}

/// Which handler a Postal run routes to.
#[derive(Clone, Copy)]
enum Form {
    /// `record_row`, one insert per event.
    Single,
    /// `record_rows`, one insert per batch.
    Batch,
}

async fn effects_db(url: &str, max: u32) -> anyhow::Result<PgPool> {
    let pool = fresh_db(url, max).await?;
    sqlx::query("CREATE TABLE effects (event_id uuid NOT NULL, i bigint NOT NULL)")
        .execute(&pool)
        .await?;
    Ok(pool)
}

async fn produce(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    n: usize,
    payload_bytes: usize,
) -> anyhow::Result<Duration> {
    create_topic(bootstrap, topic, partitions).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .create()?;
    let t = Instant::now();
    for chunk in (0..n).collect::<Vec<_>>().chunks(10_000) {
        let sends = chunk.iter().map(|&i| {
            let id = uuid::Uuid::now_v7().to_string();
            let body = serde_json::to_vec(&payload(payload_bytes, i)).expect("json");
            let key = format!("key-{}", i % 1000);
            let producer = producer.clone();
            let topic = topic.to_owned();
            async move {
                let headers = fill_headers(&id);
                producer
                    .send(
                        FutureRecord::to(&topic)
                            .key(&key)
                            .payload(&body)
                            .headers(headers),
                        Duration::from_secs(60),
                    )
                    .await
                    .map_err(|(e, _)| e)
            }
        });
        for r in join_all(sends).await {
            r.context("produce")?;
        }
    }
    Ok(t.elapsed())
}

/// Runs Postal's consumer over `topic` until `n` events are applied; the rate is measured from
/// the first applied event (the group join is reported apart).
async fn postal_run(
    url: &str,
    bootstrap: &str,
    topic: &str,
    n: usize,
    run: RunOpts,
) -> anyhow::Result<(f64, Duration)> {
    let RunOpts {
        max_batch,
        concurrency,
        form,
        partition_buffer,
    } = run;
    let pool = effects_db(url, concurrency as u32 + 4).await?;
    let group = format!("bench-{}", uuid::Uuid::now_v7().simple());
    let mut config = ConsumerConfig::new(bootstrap, group);
    config.max_batch = max_batch;
    config.max_concurrent_partitions = concurrency;
    if let Some(b) = partition_buffer {
        config.partition_buffer = b;
    }
    config
        .kafka
        .insert("session.timeout.ms".into(), "6000".into());
    let builder = Consumer::builder(pool.clone(), config);
    let consumer = match form {
        Form::Single => builder.on(topic, "bench.event", record_row),
        Form::Batch => builder.on_batch(topic, "bench.event", record_rows),
    }
    .build()?;
    let stats: Arc<Stats> = consumer.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let task = tokio::spawn(consumer.run(async move {
        let _ = stop_rx.await;
    }));
    let mut first: Option<(Instant, u64)> = None;
    loop {
        let applied = stats.snapshot().applied;
        if first.is_none() && applied > 0 {
            first = Some((Instant::now(), applied));
        }
        if applied as usize >= n {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(300),
            "consumer stalled at {applied}/{n}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let end = Instant::now();
    let _ = stop_tx.send(());
    task.await??;
    let (t0, at_t0) = first.expect("something was applied");
    let rows: i64 = sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM effects")
        .fetch_one(&pool)
        .await?;
    anyhow::ensure!(rows as usize == n, "expected {n} effects, found {rows}");
    // The transactions that wrote effects (their ids, `xmin`): how full the batches were.
    let txs: i64 = sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM effects")
        .fetch_one(&pool)
        .await?;
    println!(
        "    {txs} transactions wrote the effects: {:.1} events per transaction on average",
        n as f64 / txs.max(1) as f64
    );
    let measured = (n as u64 - at_t0) as usize;
    Ok((rate(measured, end - t0), t0 - started))
}

fn raw_consume(bootstrap: &str, topic: &str, partitions: i32, n: usize) -> anyhow::Result<f64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("raw-{}", uuid::Uuid::now_v7().simple()))
        .set("enable.auto.commit", "false")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let t = Instant::now();
    let mut seen = 0usize;
    let mut bytes = 0usize;
    while seen < n {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(300),
            "raw consume stalled"
        );
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            let m = m?;
            bytes += rdkafka::message::Message::payload(&m).map_or(0, |p| p.len());
            seen += 1;
        }
    }
    std::hint::black_box(bytes);
    Ok(rate(n, t.elapsed()))
}

/// The same database work as (a) without a broker: per transaction `batch` events, one
/// multi-row dedup insert, the effect per event (row by row, or one multi-row insert), the
/// offset update; `concurrency` connections in parallel.
async fn sql_only(
    url: &str,
    n: usize,
    batch: usize,
    concurrency: usize,
    multi_row_effect: bool,
) -> anyhow::Result<f64> {
    let pool = effects_db(url, concurrency as u32 + 1).await?;
    let per_worker = n / concurrency;
    let t = Instant::now();
    let workers = (0..concurrency).map(|w| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO postal.consumer_offsets (group_id, topic, partition) VALUES ('sql', 't', $1)",
            )
            .bind(w as i32)
            .execute(&pool)
            .await?;
            let mut done = 0usize;
            while done < per_worker {
                let k = batch.min(per_worker - done);
                let ids: Vec<uuid::Uuid> = (0..k).map(|_| uuid::Uuid::now_v7()).collect();
                let mut tx = pool.begin().await?;
                let fresh: Vec<uuid::Uuid> = sqlx::query_scalar(
                    "INSERT INTO postal.processed_events (consumer_name, event_id)
                     SELECT 'sql', unnest($1::uuid[]) ON CONFLICT DO NOTHING RETURNING event_id",
                )
                .bind(&ids)
                .fetch_all(&mut *tx)
                .await?;
                if multi_row_effect {
                    let is: Vec<i64> = (0..fresh.len() as i64).collect();
                    sqlx::query("INSERT INTO effects SELECT unnest($1::uuid[]), unnest($2::bigint[])")
                        .bind(&fresh)
                        .bind(&is)
                        .execute(&mut *tx)
                        .await?;
                } else {
                    for (i, id) in fresh.iter().enumerate() {
                        sqlx::query("INSERT INTO effects (event_id, i) VALUES ($1, $2)")
                            .bind(id)
                            .bind(i as i64)
                            .execute(&mut *tx)
                            .await?;
                    }
                }
                sqlx::query(
                    "UPDATE postal.consumer_offsets SET next_offset = $2
                     WHERE group_id = 'sql' AND topic = 't' AND partition = $1",
                )
                .bind(w as i32)
                .bind((done + k) as i64)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                done += k;
            }
            Ok::<(), sqlx::Error>(())
        }
    });
    for r in join_all(workers).await {
        r?;
    }
    Ok(rate(per_worker * concurrency, t.elapsed()))
}

pub async fn consume_bench(url: &str, bootstrap: &str, o: ConsumeOpts) -> anyhow::Result<()> {
    let concurrency = o.concurrency.min(o.partitions as usize).max(1);
    println!(
        "consumer benchmark: {} events of {} B, {} partitions, batch {}, {} partitions in parallel; {} cores, load average {}",
        o.n,
        o.payload_bytes,
        o.partitions,
        o.max_batch,
        concurrency,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average()
    );
    let topic = format!("bench-consume-{}", uuid::Uuid::now_v7().simple());
    let took = produce(bootstrap, &topic, o.partitions, o.n, o.payload_bytes).await?;
    println!("pre-produced {} events in {:.1} s", o.n, took.as_secs_f64());
    let sample_topic = format!("bench-consume-sample-{}", uuid::Uuid::now_v7().simple());
    produce(
        bootstrap,
        &sample_topic,
        o.partitions,
        o.sample,
        o.payload_bytes,
    )
    .await?;

    // Where the CPU went in each phase (PostgreSQL, the Kafka broker, this process): on a
    // machine where all of them share the cores, that is what bounds a figure.
    let cpu = Cpu::now();
    let c = {
        let (b, t, p, n) = (bootstrap.to_owned(), topic.clone(), o.partitions, o.n);
        tokio::task::spawn_blocking(move || raw_consume(&b, &t, p, n)).await??
    };
    println!("(c) raw consume loop, no database:           {c:>9.0} events/s");
    println!("    {}", Cpu::now().report_since(&cpu, o.n));
    let cpu = Cpu::now();
    let d = sql_only(url, o.n, o.max_batch, concurrency, false).await?;
    println!("(d) SQL only, dedup + row-by-row effect:      {d:>9.0} events/s");
    println!("    {}", Cpu::now().report_since(&cpu, o.n));
    let cpu = Cpu::now();
    let d2 = sql_only(url, o.n, o.max_batch, concurrency, true).await?;
    println!("(d') SQL only, dedup + multi-row effect:      {d2:>9.0} events/s");
    println!("    {}", Cpu::now().report_since(&cpu, o.n));
    let cpu = Cpu::now();
    let (a, join) = postal_run(
        url,
        bootstrap,
        &topic,
        o.n,
        RunOpts {
            max_batch: o.max_batch,
            concurrency,
            form: Form::Single,
            partition_buffer: o.partition_buffer,
        },
    )
    .await?;
    println!(
        "(a) Postal, throughput mode (batch {}):       {a:>9.0} events/s (group join {:.1} s not counted)",
        o.max_batch,
        join.as_secs_f64()
    );
    println!(
        "    {} (CPU includes the group join)",
        Cpu::now().report_since(&cpu, o.n)
    );
    let cpu = Cpu::now();
    let (a2, join) = postal_run(
        url,
        bootstrap,
        &topic,
        o.n,
        RunOpts {
            max_batch: o.max_batch,
            concurrency,
            form: Form::Batch,
            partition_buffer: o.partition_buffer,
        },
    )
    .await?;
    println!(
        "(a'') Postal, batch handler (batch {}):      {a2:>9.0} events/s (group join {:.1} s not counted)",
        o.max_batch,
        join.as_secs_f64()
    );
    println!(
        "    {} (CPU includes the group join)",
        Cpu::now().report_since(&cpu, o.n)
    );
    let cpu = Cpu::now();
    let (b, _) = postal_run(
        url,
        bootstrap,
        &sample_topic,
        o.sample,
        RunOpts {
            max_batch: 1,
            concurrency,
            form: Form::Single,
            partition_buffer: o.partition_buffer,
        },
    )
    .await?;
    println!(
        "(b) Postal, one transaction per message:      {b:>9.0} events/s ({} event sample)",
        o.sample
    );
    println!(
        "    {} (CPU includes the group join)",
        Cpu::now().report_since(&cpu, o.sample)
    );
    let floor = c.min(d);
    let check = |ok: bool| if ok { "met" } else { "NOT met" };
    println!(
        "(a) / min(c, d) = {:.2} (goal >= 0.8: {}); (a'') / (d') = {:.2} (goal >= 0.6: {}); (a'') / (b) = {:.1}x (goal >= 20: {}); (a) / (b) = {:.1}x; (a'') / (a) = {:.1}x",
        a / floor,
        check(a / floor >= 0.8),
        a2 / d2,
        check(a2 / d2 >= 0.6),
        a2 / b,
        check(a2 / b >= 20.0),
        a / b,
        a2 / a,
    );
    println!("load average at the end: {}", load_average());
    Ok(())
}

/// `/proc/loadavg`'s first three fields (other workloads on the machine disturb the figures).
pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

/// The headers of the records the consumer benchmarks read: the three a Postal consumer needs
/// (event id, type, content type).
fn fill_headers(id: &str) -> OwnedHeaders {
    use postal_shared::headers as h;
    headers(&[
        (h::CE_ID, id),
        (h::CE_TYPE, "bench.event"),
        (h::CONTENT_TYPE, "application/json"),
    ])
}
