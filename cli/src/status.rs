//! `postal status`: what the outbox holds.

use serde::Serialize;
use sqlx::PgPool;

#[derive(Serialize, sqlx::FromRow)]
struct TopicRow {
    topic: String,
    pending: i64,
    failed: i64,
    oldest_pending_age_s: Option<f64>,
}

#[derive(Serialize)]
struct Status {
    topics: Vec<TopicRow>,
    /// Age of the oldest open transaction (it holds back the keys it wrote, and vacuum).
    oldest_transaction_s: Option<f64>,
    relays: Vec<RelayRow>,
}

#[derive(Serialize, sqlx::FromRow)]
struct RelayRow {
    relay_id: uuid::Uuid,
    host: String,
    heartbeat_age_s: f64,
    partitions: i64,
}

pub async fn print(pool: &PgPool, json: bool) -> anyhow::Result<()> {
    let topics: Vec<TopicRow> = sqlx::query_as(
        r#"SELECT topic,
                  count(*) FILTER (WHERE status = 'pending') AS pending,
                  count(*) FILTER (WHERE status = 'failed') AS failed,
                  extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8
                      AS oldest_pending_age_s
           FROM postal.outbox
           WHERE status IN ('pending', 'failed')
           GROUP BY topic ORDER BY topic"#,
    )
    .fetch_all(pool)
    .await?;
    let oldest_transaction_s: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(xact_start))::float8 FROM pg_stat_activity
         WHERE (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL) AND pid <> pg_backend_pid()",
    )
    .fetch_one(pool)
    .await?;
    let relays: Vec<RelayRow> = sqlx::query_as(
        "SELECT i.relay_id, i.host, extract(epoch FROM now() - i.heartbeat_at)::float8 AS heartbeat_age_s,
                count(p.key_partition) FILTER (WHERE p.lease_until > now()) AS partitions
         FROM postal.relay_instances i
         LEFT JOIN postal.relay_partitions p ON p.owner = i.relay_id
         GROUP BY i.relay_id ORDER BY i.relay_id",
    )
    .fetch_all(pool)
    .await?;
    let status = Status {
        topics,
        oldest_transaction_s,
        relays,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
        return Ok(());
    }
    println!(
        "{:<40} {:>10} {:>8} {:>14}",
        "TOPIC", "PENDING", "FAILED", "OLDEST (s)"
    );
    for t in &status.topics {
        println!(
            "{:<40} {:>10} {:>8} {:>14}",
            t.topic,
            t.pending,
            t.failed,
            t.oldest_pending_age_s
                .map(|a| format!("{a:.1}"))
                .unwrap_or_else(|| "-".into())
        );
    }
    if status.topics.is_empty() {
        println!("(outbox empty)");
    }
    println!(
        "oldest open transaction: {}",
        status
            .oldest_transaction_s
            .map(|a| format!("{a:.1}s"))
            .unwrap_or_else(|| "none".into())
    );
    println!("relays:");
    for r in &status.relays {
        println!(
            "  {}  host {:<20} heartbeat {:>6.1}s ago  partitions {}",
            r.relay_id, r.host, r.heartbeat_age_s, r.partitions
        );
    }
    Ok(())
}
