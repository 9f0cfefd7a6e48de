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
    let status = Status { topics };
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
    Ok(())
}
