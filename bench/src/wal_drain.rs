//! The WAL relay draining a backlog (`relay --wal`): (w) one WAL relay reading a logical slot,
//! next to (s) the slot's read rate (the server decoding the same backlog through `pgoutput`,
//! nothing published).

use std::time::{Duration, Instant};

use postal_producer::{KafkaConfig, KafkaTransport, Relay, RelayConfig};
use sqlx::PgPool;

use crate::{clean, cpu, create_topic, delete_topic, outbox_len, rate, RelayOpts};

/// What one WAL drain measured.
pub struct WalDrain {
    /// (w) events/s: backlog committed → outbox empty, one WAL relay.
    pub relay: f64,
    /// (s) events/s: the server decoding the backlog from the slot (`pg_logical_slot_peek_binary_changes`).
    pub slot: f64,
    pub cpu: cpu::Report,
}

/// Creates two slots on the run's database (`url`: its admin URL): one for a WAL relay, started
/// and streaming before the backlog (the figure is the steady drain, not the start-up, as for
/// polling relays), one only to time the server's decoding of the same backlog afterwards.
/// Commits `o.n` events in one transaction, times the relay's drain, then the read.
pub async fn run(
    pool: &PgPool,
    url: &str,
    bootstrap: &str,
    o: &RelayOpts,
) -> anyhow::Result<WalDrain> {
    let (n, payload_bytes, keys) = (o.n, o.payload_bytes, o.keys);
    let id = uuid::Uuid::now_v7().simple().to_string();
    let topic = format!("bench-wal-{id}");
    let slot = format!("postal_bench_{id}");
    let probe = format!("postal_probe_{id}");
    create_topic(bootstrap, &topic, 12).await?;
    postal_producer::wal::slot::create(pool, &slot, &slot).await?;
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&probe)
        .execute(pool)
        .await?;
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(pool)
        .await?;
    let mut config = RelayConfig::default()
        .batch_size(o.batch_size)
        .lease(Duration::from_secs(6));
    config.source = postal_producer::RelaySource::Wal(postal_producer::WalSource::new(
        crate::e2e::with_database(url, &database),
        slot.as_str(),
        slot.as_str(),
    ));
    let mut kcfg = KafkaConfig::new(bootstrap);
    kcfg.properties
        .insert("message.timeout.ms".into(), "2500".into());
    kcfg.properties.extend(o.kafka.iter().cloned());
    let relay = Relay::new(pool.clone(), KafkaTransport::new(kcfg)?, config)?;
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sqlx::query_scalar::<_, bool>(
        "SELECT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(&slot)
    .fetch_one(pool)
    .await?
    {
        anyhow::ensure!(
            Instant::now() < deadline && !handle.is_finished(),
            "the WAL relay did not start streaming within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    clean(pool).await?;
    crate::commit_backlog(pool, &topic, n, payload_bytes, keys).await?;
    let backlog_end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await?;
    let wal = cpu::Wal::now(pool).await;
    let cpu = cpu::Cpu::now();
    let t = Instant::now();
    // The WAL relay deletes each row it published: done when none is left.
    let deadline = t + Duration::from_secs(600);
    while outbox_len(pool).await? > 0 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the WAL relay left events pending for 10 minutes"
        );
        anyhow::ensure!(!handle.is_finished(), "the WAL relay stopped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = t.elapsed();
    let cpu = cpu::Cpu::now()
        .report_since(&cpu, n)
        .with_wal(wal, cpu::Wal::now(pool).await, n);
    let _ = stop.send(());
    let published = handle.await??.published;
    anyhow::ensure!(
        published as usize >= n,
        "the WAL relay published {published} of {n}"
    );

    // (s) The server decodes the backlog from the probe slot as a walsender would (up to the
    // backlog's end: not the relay's deletes after it), with nothing else running.
    let t = Instant::now();
    let changes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, $2::pg_lsn, NULL,
             'proto_version', '1', 'publication_names', $3)",
    )
    .bind(&probe)
    .bind(&backlog_end)
    .bind(&slot)
    .fetch_one(pool)
    .await?;
    let slot_rate = rate(n, t.elapsed());
    anyhow::ensure!(
        changes as usize >= n,
        "the probe slot streamed {changes} changes for {n} events"
    );
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&probe)
        .execute(pool)
        .await?;
    postal_producer::wal::slot::drop(pool, &slot, &slot).await?;
    delete_topic(bootstrap, &topic).await;
    Ok(WalDrain {
        relay: rate(n, elapsed),
        slot: slot_rate,
        cpu,
    })
}
