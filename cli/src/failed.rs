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
    /// Show what would be acted on (one line per event, and the count) and change nothing.
    #[arg(long)]
    dry_run: bool,
}

/// The parked events `select` matches now, by sequence number in outbox order: a command acts
/// on these only (still parked when their turn comes), never on events parked while it runs.
async fn matched_at_start(
    pool: &PgPool,
    ids: &[Uuid],
    topic: &Option<String>,
) -> anyhow::Result<Vec<i64>> {
    Ok(sqlx::query_scalar(
        "SELECT seq FROM postal.outbox WHERE status = 'failed'
         AND (cardinality($1::uuid[]) = 0 OR event_id = ANY($1))
         AND ($2::text IS NULL OR topic = $2)
         ORDER BY seq",
    )
    .bind(ids)
    .bind(topic)
    .fetch_all(pool)
    .await?)
}

/// `--dry-run`: prints the matched events (id, topic, key, type, attempts, last error), one
/// per line, and their count.
async fn show_matched(pool: &PgPool, seqs: &[i64], verb: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    for chunk in seqs.chunks(1000) {
        let rows: Vec<(Uuid, String, String, String, i32, Option<String>)> = sqlx::query_as(
            "SELECT event_id, topic, event_key, event_type, attempts, last_error
             FROM postal.outbox WHERE seq = ANY($1) ORDER BY seq",
        )
        .bind(chunk)
        .fetch_all(pool)
        .await?;
        for (id, topic, key, ty, attempts, err) in rows {
            writeln!(
                out,
                "{id}  {}  {}  {}  attempts {attempts}  {}",
                shown(&topic, false),
                shown(&key, false),
                shown(&ty, false),
                shown(
                    &postal_shared::text::bounded(err.as_deref().unwrap_or("-"), 200),
                    false
                )
            )?;
        }
    }
    out.flush()?;
    eprintln!(
        "dry run: would {verb} {} parked event(s); nothing changed",
        seqs.len()
    );
    Ok(())
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
            select:
                Selection {
                    ids,
                    topic,
                    all,
                    dry_run,
                },
        } => {
            if ids.is_empty() && topic.is_none() && !all {
                anyhow::bail!("say what to discard: --id <event id>, --topic <topic> or --all");
            }
            let matched = matched_at_start(pool, &ids, &topic).await?;
            if dry_run {
                return show_matched(pool, &matched, "discard").await;
            }
            let mut done = 0usize;
            for chunk in matched.chunks(1000) {
                // Each batch is printed (and stdout flushed) before its deletion commits: an
                // interrupted run loses nothing it did not print.
                let mut tx = pool.begin().await?;
                let rows: Vec<(Discarded, Vec<u8>)> = sqlx::query(
                    "WITH batch AS (
                         SELECT seq FROM postal.outbox WHERE status = 'failed'
                         AND seq = ANY($1)
                         ORDER BY seq FOR UPDATE)
                     DELETE FROM postal.outbox o USING batch WHERE o.seq = batch.seq
                     RETURNING o.seq, o.event_id, o.topic, o.event_key, o.event_type,
                               o.schema_version, o.occurred_at, o.content_type, o.headers,
                               o.attempts, o.last_error, o.payload,
                               translate(encode(o.payload, 'base64'), chr(10), '') AS payload_base64",
                )
                .bind(chunk)
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
            }
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(postal_producer::NOTIFY_CHANNEL)
                .execute(pool)
                .await?;
            eprintln!("discarded {done} parked event(s); later events of their keys are released");
            if done < matched.len() {
                eprintln!(
                    "({} of the {} matched at the start were no longer parked)",
                    matched.len() - done,
                    matched.len()
                );
            }
            if !ids.is_empty() && done < ids.len() {
                eprintln!("({} of the given ids were not parked)", ids.len() - done);
            }
            Ok(())
        }
        FailedCommand::Requeue {
            select:
                Selection {
                    ids,
                    topic,
                    all,
                    dry_run,
                },
        } => {
            if ids.is_empty() && topic.is_none() && !all {
                anyhow::bail!("say what to requeue: --id <event id>, --topic <topic> or --all");
            }
            let matched = matched_at_start(pool, &ids, &topic).await?;
            if dry_run {
                return show_matched(pool, &matched, "requeue").await;
            }
            let progress = Progress::new(matched.len() as u64, "requeued");
            let mut done = 0u64;
            for chunk in matched.chunks(1000) {
                let n = sqlx::query(
                    "UPDATE postal.outbox o
                        SET status = 'pending', attempts = 0, held = false,
                            available_at = now(),
                            last_error = 'requeued by operator; previous error: ' || coalesce(o.last_error, '-')
                      WHERE o.status = 'failed' AND o.seq = ANY($1)",
                )
                .bind(chunk)
                .execute(pool)
                .await?
                .rows_affected();
                done += n;
                progress.set(done);
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
