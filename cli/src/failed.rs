//! `postal failed`: parked outbox events — list, show, requeue, discard.

use crate::out::say;
use std::io::Write as _;

use clap::{Args, Subcommand};
use postal_admin::parked::{self, Filter};
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
        /// Only this key.
        #[arg(long)]
        key: Option<String>,
        /// Only this event type.
        #[arg(long = "type")]
        event_type: Option<String>,
        /// Only those whose last error contains this text (case-insensitive).
        #[arg(long)]
        reason: Option<String>,
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
    /// Show one parked event with its error, headers and payload (its first 64 KiB unless
    /// `--full`).
    #[command(group(clap::ArgGroup::new("which").required(true).args(["event_id", "id"])))]
    Show {
        /// The event id (or `--id`).
        #[arg(value_parser = crate::ids::parked_event)]
        event_id: Option<Uuid>,
        /// The event id.
        #[arg(long = "id", value_name = "EVENT_ID", conflicts_with = "event_id", value_parser = crate::ids::parked_event)]
        id: Option<Uuid>,
        /// Print key, headers, payload and error as stored, control characters included
        /// (else escaped).
        #[arg(long)]
        raw: bool,
        /// Print the payload whole (else its first 64 KiB and how many bytes were cut).
        #[arg(long)]
        full: bool,
    },
    /// Make parked events pending again (attempts reset, event ids unchanged): by id, by topic,
    /// or all. The relay publishes them in their original order.
    Requeue {
        #[command(flatten)]
        select: Selection,
    },
    /// Delete parked events for good, so that the later events of their keys flow: by id, by
    /// topic, or all. Each discarded event is printed first, whole, as one JSON line, and kept
    /// whole in the audit trail (`postal audit show <id>`).
    Discard {
        #[command(flatten)]
        select: Selection,
    },
}

/// Which parked events a command acts on.
#[derive(Args, Debug)]
pub struct Selection {
    /// Event ids (or `--id`, repeatable).
    #[arg(value_name = "EVENT_ID", conflicts_with_all = ["topic", "all"], value_parser = crate::ids::parked_event)]
    listed: Vec<Uuid>,
    /// Event ids (repeatable).
    #[arg(long = "id", value_name = "EVENT_ID", conflicts_with_all = ["topic", "all"], value_parser = crate::ids::parked_event)]
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

/// The parked events `select` matches now, by sequence number in outbox order (the shared
/// implementation the dashboard uses too): a command acts on these only. With the selection as
/// the audit trail records it.
async fn matched_at_start(
    pool: &PgPool,
    ids: &[Uuid],
    topic: &Option<String>,
) -> anyhow::Result<(Vec<i64>, serde_json::Value)> {
    let selection = if ids.is_empty() {
        parked::Selection::Filter(topic.iter().fold(Filter::default(), |f, t| f.topic(t)))
    } else {
        parked::Selection::Ids(ids.to_vec())
    };
    let target = serde_json::to_value(&selection)?;
    Ok((parked::matched(pool, &selection, None).await?, target))
}

/// `--dry-run`: prints the matched events (id, topic, key, type, attempts, last error), one
/// per line, and their count.
async fn show_matched(pool: &PgPool, seqs: &[i64], verb: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    for chunk in seqs.chunks(1000) {
        for p in parked::by_seqs(pool, chunk).await? {
            writeln!(
                out,
                "{}  {}  {}  {}  attempts {}  {}",
                p.event_id,
                shown(&p.topic, false),
                shown(&p.event_key, false),
                shown(&p.event_type, false),
                p.attempts,
                shown(
                    &postal_shared::text::bounded(p.last_error.as_deref().unwrap_or("-"), 200),
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

/// `show --full` prints the payload whole: the cap is larger than any payload (a `bytea`
/// holds at most 1 GB).
const WHOLE_PAYLOAD: i32 = i32::MAX;

pub async fn run(pool: &PgPool, cmd: FailedCommand) -> anyhow::Result<()> {
    match cmd {
        FailedCommand::List {
            topic,
            key,
            event_type,
            reason,
            limit,
            json,
            raw,
        } => {
            let mut filter = Filter::default();
            let topic_filter = topic.clone();
            if let Some(topic) = topic {
                filter = filter.topic(topic);
            }
            if let Some(key) = key {
                filter = filter.key(key);
            }
            if let Some(event_type) = event_type {
                filter = filter.event_type(event_type);
            }
            if let Some(reason) = reason {
                filter = filter.reason(reason);
            }
            let rows = parked::search(pool, &filter, limit).await?;
            if json {
                say!("{}", crate::shown::json(&rows, true)?);
                return Ok(());
            }
            say!(
                "{:<36}  {:<24} {:<16} {:>8}  ERROR",
                "EVENT ID",
                "TOPIC",
                "KEY",
                "ATTEMPTS"
            );
            for r in &rows {
                say!(
                    "{:<36}  {:<24} {:<16} {:>8}  {}",
                    r.event_id,
                    shown(&r.topic, raw),
                    shown(&r.event_key, raw),
                    r.attempts,
                    shown(r.last_error.as_deref().unwrap_or("-"), raw)
                );
            }
            if rows.is_empty() {
                // Consumer failures are not parked outbox events: say where they are.
                let dead = postal_admin::dead_letters::count(
                    pool,
                    &topic_filter
                        .iter()
                        .fold(postal_admin::dead_letters::Filter::default(), |f, t| {
                            f.topic(t)
                        }),
                )
                .await?;
                if dead > 0 {
                    say!("(no parked events; consumers have {dead} open dead letter(s): postal dead-letters list)");
                } else {
                    say!("(no parked events)");
                }
            }
            Ok(())
        }
        FailedCommand::Show {
            event_id,
            id,
            raw,
            full,
        } => {
            let event_id = event_id.or(id).expect("clap requires one");
            let cap = if full {
                WHOLE_PAYLOAD
            } else {
                crate::shown::PAYLOAD_SHOWN as i32
            };
            let Some(parked::Event {
                event_id: id,
                status,
                topic,
                event_key: key,
                event_type: ty,
                schema_version: version,
                content_type: ct,
                headers,
                attempts,
                last_error: err,
                payload_bytes,
                payload,
                ..
            }) = parked::show(pool, event_id, cap).await?
            else {
                anyhow::bail!("no outbox event {event_id}");
            };
            if payload.len() < (payload_bytes.min(cap)) as usize {
                anyhow::bail!(
                    "event {event_id}: read {} of its {payload_bytes} payload bytes",
                    payload.len()
                );
            }
            say!("event id:     {id}");
            say!("status:       {status}");
            say!(
                "topic / key:  {} / {}",
                shown(&topic, raw),
                shown(&key, raw)
            );
            say!(
                "type:         {} (schema version {version})",
                shown(&ty, raw)
            );
            say!("attempts:     {attempts}");
            say!(
                "last error:   {}",
                shown(err.as_deref().unwrap_or("-"), raw)
            );
            // JSON text escapes control characters itself; bidi overrides it keeps.
            say!("headers:      {}", shown(&headers.to_string(), raw));
            say!("content type: {}", shown(&ct, raw));
            say!(
                "payload:      {}",
                crate::shown::payload(&payload, payload_bytes as usize, raw)
            );
            Ok(())
        }
        FailedCommand::Discard {
            select:
                Selection {
                    listed,
                    mut ids,
                    topic,
                    all,
                    dry_run,
                },
        } => {
            ids.extend(listed);
            if ids.is_empty() && topic.is_none() && !all {
                anyhow::bail!(
                    "say what to discard: event ids (or --id <event id>), --topic <topic> or --all"
                );
            }
            let (matched, target) = matched_at_start(pool, &ids, &topic).await?;
            if dry_run {
                return show_matched(pool, &matched, "discard").await;
            }
            // Each batch's events are moved whole, inside the database, to the audit trail
            // (`postal.operator_audit_events`) by the statement that deletes them; what
            // is printed (and flushed before the deletion commits) is which they were.
            let by = crate::audit::operator();
            let mut audit_id = None;
            let done = parked::discard_seqs(pool, &by, &target, &matched, |batch| {
                let mut out = std::io::stdout().lock();
                for d in &batch {
                    audit_id = Some(d.audit_id);
                    writeln!(
                        out,
                        "{}",
                        crate::shown::json(d, false).map_err(std::io::Error::other)?
                    )?;
                }
                out.flush()?;
                eprintln!(
                    "deleting the {} event(s) printed above this line",
                    batch.len()
                );
                Ok(())
            })
            .await? as usize;
            eprintln!("discarded {done} parked event(s); later events of their keys are released");
            if let Some(id) = audit_id {
                eprintln!(
                    "the discarded events are kept whole in the audit trail: postal audit show {id}"
                );
            }
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
                    listed,
                    mut ids,
                    topic,
                    all,
                    dry_run,
                },
        } => {
            ids.extend(listed);
            if ids.is_empty() && topic.is_none() && !all {
                anyhow::bail!(
                    "say what to requeue: event ids (or --id <event id>), --topic <topic> or --all"
                );
            }
            let (matched, target) = matched_at_start(pool, &ids, &topic).await?;
            if dry_run {
                return show_matched(pool, &matched, "requeue").await;
            }
            let progress = Progress::new(matched.len() as u64, "requeued");
            let by = crate::audit::operator();
            let done =
                parked::requeue_seqs(pool, &by, &target, &matched, |n| progress.set(n)).await?;
            progress.finish();
            say!("requeued {done} event(s); the relay publishes them with their original ids");
            if !ids.is_empty() && (done as usize) < ids.len() {
                say!(
                    "({} of the given ids were not parked)",
                    ids.len() - done as usize
                );
            }
            Ok(())
        }
    }
}
