//! `postal failed`: parked outbox events — list, show, requeue, discard.

use std::io::Write as _;

use clap::{Args, Subcommand};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::progress::Progress;
use crate::shown::shown;

/// Parked (failed) outbox events.
#[derive(Subcommand, Debug)]
pub enum FailedCommand {
    /// List parked events, oldest first.
    List {
        /// Only this topic.
        #[arg(long)]
        topic: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Print keys and errors as stored, control characters included (else escaped).
        #[arg(long)]
        raw: bool,
    },
    /// Show one parked event with its error, headers and payload.
    Show {
        /// The event id.
        event_id: Uuid,
        /// Print key, headers, payload and error as stored, control characters included
        /// (else escaped).
        #[arg(long)]
        raw: bool,
    },
    /// Make parked events pending again (attempts reset, event ids unchanged): by id, by topic,
    /// or all. The relay publishes them in their original order.
    Requeue {
        #[command(flatten)]
        select: Selection,
    },
    /// Delete parked events for good, so that the later events of their keys flow: by id, by
    /// topic, or all. Each discarded event is printed first, whole, as one JSON line (keep the
    /// output: it is the only copy left).
    Discard {
        #[command(flatten)]
        select: Selection,
    },
}

/// Which parked events a command acts on.
#[derive(Args, Debug)]
pub struct Selection {
    /// Event ids (repeatable).
    #[arg(long = "id", conflicts_with_all = ["topic", "all"])]
    ids: Vec<Uuid>,
    /// Every parked event of this topic.
    #[arg(long, conflicts_with = "all")]
    topic: Option<String>,
    /// Every parked event.
    #[arg(long)]
    all: bool,
}

/// A discarded event, as printed: everything needed to enqueue it again.
#[derive(Serialize, sqlx::FromRow)]
struct Discarded {
    event_id: Uuid,
    topic: String,
    event_key: String,
    event_type: String,
    schema_version: i32,
    occurred_at: chrono::DateTime<chrono::Utc>,
    content_type: String,
    headers: serde_json::Value,
    attempts: i32,
    last_error: Option<String>,
    /// The payload as text when it is UTF-8 (JSON payloads are).
    #[sqlx(skip)]
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<String>,
    /// The payload in base64 when it is not UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_base64: Option<String>,
}

#[derive(Serialize, sqlx::FromRow)]
struct Row {
    event_id: Uuid,
    topic: String,
    event_key: String,
    event_type: String,
    attempts: i32,
    last_error: Option<String>,
    age_s: f64,
}

#[derive(sqlx::FromRow)]
struct Shown {
    event_id: Uuid,
    topic: String,
    event_key: String,
    event_type: String,
    schema_version: i32,
    content_type: String,
    payload: Vec<u8>,
    headers: serde_json::Value,
    attempts: i32,
    last_error: Option<String>,
    status: String,
}

pub async fn run(pool: &PgPool, cmd: FailedCommand) -> anyhow::Result<()> {
    match cmd {
        FailedCommand::List {
            topic,
            limit,
            json,
            raw,
        } => {
            let rows: Vec<Row> = sqlx::query_as(
                "SELECT event_id, topic, event_key, event_type, attempts, last_error,
                        extract(epoch FROM now() - created_at)::float8 AS age_s
                 FROM postal.outbox WHERE status = 'failed' AND ($1::text IS NULL OR topic = $1)
                 ORDER BY seq LIMIT $2",
            )
            .bind(topic)
            .bind(limit)
            .fetch_all(pool)
            .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(());
            }
            println!(
                "{:<36}  {:<24} {:<16} {:>8}  ERROR",
                "EVENT ID", "TOPIC", "KEY", "ATTEMPTS"
            );
            for r in &rows {
                println!(
                    "{:<36}  {:<24} {:<16} {:>8}  {}",
                    r.event_id,
                    shown(&r.topic, raw),
                    shown(&r.event_key, raw),
                    r.attempts,
                    shown(r.last_error.as_deref().unwrap_or("-"), raw)
                );
            }
            if rows.is_empty() {
                println!("(no parked events)");
            }
            Ok(())
        }
        FailedCommand::Show { event_id, raw } => {
            let row: Option<Shown> = sqlx::query_as(
                "SELECT event_id, topic, event_key, event_type, schema_version, content_type, payload,
                        headers, attempts, last_error, status
                 FROM postal.outbox WHERE event_id = $1",
            )
            .bind(event_id)
            .fetch_optional(pool)
            .await?;
            let Some(Shown {
                event_id: id,
                topic,
                event_key: key,
                event_type: ty,
                schema_version: version,
                content_type: ct,
                payload,
                headers,
                attempts,
                last_error: err,
                status,
            }) = row
            else {
                anyhow::bail!("no outbox event {event_id}");
            };
            println!("event id:     {id}");
            println!("status:       {status}");
            println!(
                "topic / key:  {} / {}",
                shown(&topic, raw),
                shown(&key, raw)
            );
            println!(
                "type:         {} (schema version {version})",
                shown(&ty, raw)
            );
            println!("attempts:     {attempts}");
            println!(
                "last error:   {}",
                shown(err.as_deref().unwrap_or("-"), raw)
            );
            // JSON text escapes control characters itself; bidi overrides it keeps.
            println!("headers:      {}", shown(&headers.to_string(), raw));
            println!("content type: {}", shown(&ct, raw));
            match std::str::from_utf8(&payload) {
                Ok(text) => println!("payload:      {}", shown(text, raw)),
                Err(_) => println!("payload:      {} bytes (binary)", payload.len()),
            }
            Ok(())
        }
        FailedCommand::Discard {
            select: Selection { ids, topic, all },
        } => {
            if ids.is_empty() && topic.is_none() && !all {
                anyhow::bail!("say what to discard: --id <event id>, --topic <topic> or --all");
            }
            let mut done = 0usize;
            loop {
                // Each batch is printed (and stdout flushed) before its deletion commits: an
                // interrupted run loses nothing it did not print.
                let mut tx = pool.begin().await?;
                let rows: Vec<(Discarded, Vec<u8>)> = sqlx::query(
                    "WITH batch AS (
                         SELECT seq FROM postal.outbox WHERE status = 'failed'
                         AND (cardinality($1::uuid[]) = 0 OR event_id = ANY($1))
                         AND ($2::text IS NULL OR topic = $2)
                         ORDER BY seq LIMIT 1000 FOR UPDATE)
                     DELETE FROM postal.outbox o USING batch WHERE o.seq = batch.seq
                     RETURNING o.seq, o.event_id, o.topic, o.event_key, o.event_type,
                               o.schema_version, o.occurred_at, o.content_type, o.headers,
                               o.attempts, o.last_error, o.payload,
                               translate(encode(o.payload, 'base64'), chr(10), '') AS payload_base64",
                )
                .bind(&ids)
                .bind(&topic)
                .try_map(|row: sqlx::postgres::PgRow| {
                    use sqlx::{FromRow, Row};
                    Ok((Discarded::from_row(&row)?, row.try_get("payload")?))
                })
                .fetch_all(&mut *tx)
                .await?;
                let n = rows.len();
                let mut out = std::io::stdout().lock();
                for (mut d, payload) in rows {
                    if let Ok(text) = String::from_utf8(payload) {
                        d.payload = Some(text);
                        d.payload_base64 = None;
                    }
                    writeln!(out, "{}", serde_json::to_string(&d)?)?;
                }
                out.flush()?;
                drop(out);
                tx.commit().await?;
                if n > 0 {
                    eprintln!("deleted the {n} event(s) printed above this line");
                }
                done += n;
                if n < 1000 {
                    break;
                }
            }
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(postal_producer::NOTIFY_CHANNEL)
                .execute(pool)
                .await?;
            eprintln!("discarded {done} parked event(s); later events of their keys are released");
            if !ids.is_empty() && done < ids.len() {
                eprintln!("({} of the given ids were not parked)", ids.len() - done);
            }
            Ok(())
        }
        FailedCommand::Requeue {
            select: Selection { ids, topic, all },
        } => {
            if ids.is_empty() && topic.is_none() && !all {
                anyhow::bail!("say what to requeue: --id <event id>, --topic <topic> or --all");
            }
            let total: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM postal.outbox WHERE status = 'failed'
                 AND (cardinality($1::uuid[]) = 0 OR event_id = ANY($1))
                 AND ($2::text IS NULL OR topic = $2)",
            )
            .bind(&ids)
            .bind(&topic)
            .fetch_one(pool)
            .await?;
            let progress = Progress::new(total as u64, "requeued");
            let mut done = 0u64;
            loop {
                let n = sqlx::query(
                    "WITH batch AS (
                         SELECT seq FROM postal.outbox WHERE status = 'failed'
                         AND (cardinality($1::uuid[]) = 0 OR event_id = ANY($1))
                         AND ($2::text IS NULL OR topic = $2)
                         ORDER BY seq LIMIT 1000 FOR UPDATE)
                     UPDATE postal.outbox o
                        SET status = 'pending', attempts = 0, held = false,
                            available_at = now(),
                            last_error = 'requeued by operator; previous error: ' || coalesce(o.last_error, '-')
                       FROM batch WHERE o.seq = batch.seq",
                )
                .bind(&ids)
                .bind(&topic)
                .execute(pool)
                .await?
                .rows_affected();
                done += n;
                progress.set(done);
                if n < 1000 {
                    break;
                }
            }
            progress.finish();
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(postal_producer::NOTIFY_CHANNEL)
                .execute(pool)
                .await?;
            println!("requeued {done} event(s); the relay publishes them with their original ids");
            if !ids.is_empty() && (done as usize) < ids.len() {
                println!(
                    "({} of the given ids were not parked)",
                    ids.len() - done as usize
                );
            }
            Ok(())
        }
    }
}
