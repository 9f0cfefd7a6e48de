//! `postal cleanup`: run retention once.

use crate::out::say;
use std::time::Duration;

use clap::Args;
use sqlx::PgPool;

use crate::progress::Progress;

/// What `postal cleanup` deletes.
#[derive(Args, Debug)]
pub struct CleanupArgs {
    /// Delete kept published outbox rows older than this (relays with `--keep-published`).
    #[arg(long, value_parser = humantime::parse_duration)]
    published_retention: Option<Duration>,
    /// Delete dedup rows (`processed_events`) older than this. Keep them longer than a relay
    /// can republish an event (docs/consumer.md: "Dedup retention").
    #[arg(long, value_parser = humantime::parse_duration)]
    dedup_retention: Option<Duration>,
    /// Delete dead letters older than this that reached their dead-letter topic (unpublished
    /// ones are kept: the table is their only copy).
    #[arg(long, value_parser = humantime::parse_duration)]
    dead_letter_retention: Option<Duration>,
    /// Only these consumers' dedup rows (repeatable; default every consumer).
    #[arg(long = "consumer")]
    consumers: Vec<String>,
    /// Delete dedup rows by --dedup-retention even where a consumer declares a longer
    /// retention (or none: keep for good). Without it, the longer one applies.
    #[arg(long)]
    ignore_declared: bool,
    /// Rows per delete statement.
    #[arg(long, default_value_t = 5000)]
    batch: usize,
}

/// Opens the audit row of one retention run (`cleanup` by the OS user on `target`): written
/// before it deletes anything; each batch adds its count in the batch's own transaction, so a
/// run that fails or is stopped midway still says how many rows it deleted.
async fn audited(
    pool: &PgPool,
    target: serde_json::Value,
) -> anyhow::Result<postal_admin::audit::Recording> {
    Ok(
        postal_admin::audit::open_uncounted(pool, &crate::audit::operator(), "cleanup", &target)
            .await?,
    )
}

fn age(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Runs the retentions asked for; each is recorded in the audit trail as `cleanup` (which
/// table, the retention, and how many rows it deleted).
pub async fn run(pool: &PgPool, args: CleanupArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.published_retention.is_some()
            || args.dedup_retention.is_some()
            || args.dead_letter_retention.is_some(),
        "say what to clean: --published-retention, --dedup-retention and/or --dead-letter-retention"
    );
    anyhow::ensure!(args.batch > 0, "--batch must be positive");
    if let Some(r) = args.published_retention {
        let progress = Progress::new(0, "published rows deleted");
        let audit = audited(
            pool,
            serde_json::json!({ "table": "outbox", "published_retention": age(r), "batch": args.batch }),
        )
        .await?;
        let done = audit
            .end(
                pool,
                postal_producer::retention::cleanup_published_recorded(
                    pool,
                    r,
                    args.batch,
                    Some(audit.id()),
                    |n| progress.set(n),
                )
                .await,
            )
            .await?;
        progress.finish();
        match done {
            Some(n) => say!(
                "outbox: deleted {n} published row(s) older than {}",
                humantime::format_duration(r)
            ),
            None => say!("outbox: another instance is cleaning right now; nothing done"),
        }
    }
    if let Some(r) = args.dedup_retention {
        anyhow::ensure!(
            r >= postal_shared::cleanup::MIN_DEDUP_RETENTION,
            "--dedup-retention must be at least 1h: a shorter one lets a copy that arrives after an outage apply twice"
        );
        let consumers: Vec<String> = if args.consumers.is_empty() {
            sqlx::query_scalar(
                "SELECT DISTINCT consumer_name FROM postal.processed_events ORDER BY 1",
            )
            .fetch_all(pool)
            .await?
        } else {
            for c in &args.consumers {
                crate::known::consumer(pool, c).await?;
            }
            args.consumers
        };
        for c in consumers {
            let declared = postal_consumer::retention::declared_retention(pool, &c).await?;
            let name = c;
            // The name for the lines below: it came from the database.
            let c = crate::shown::shown(&name, false);
            let r = match declared {
                Some(None) if !args.ignore_declared => {
                    say!("dedup {c}: the consumer keeps its dedup rows for good (it declares no retention); nothing done (--ignore-declared deletes them anyway)");
                    continue;
                }
                Some(Some(d)) if d > r && !args.ignore_declared => {
                    say!(
                        "dedup {c}: the consumer declares a retention of {}; keeping rows that young (--ignore-declared uses {} anyway)",
                        humantime::format_duration(d),
                        humantime::format_duration(r)
                    );
                    d
                }
                _ => r,
            };
            let audit = audited(
                pool,
                serde_json::json!({ "table": "processed_events", "consumer": name, "dedup_retention": age(r), "batch": args.batch }),
            )
            .await?;
            let done = audit
                .end(
                    pool,
                    postal_consumer::retention::cleanup_processed_recorded(
                        pool,
                        &name,
                        r,
                        args.batch,
                        Some(audit.id()),
                    )
                    .await,
                )
                .await?;
            match done {
                Some(n) => say!(
                    "dedup {c}: deleted {n} row(s) older than {}",
                    humantime::format_duration(r)
                ),
                None => say!("dedup {c}: another instance is cleaning right now; nothing done"),
            }
        }
    }
    if let Some(r) = args.dead_letter_retention {
        let audit = audited(
            pool,
            serde_json::json!({ "table": "dead_letters", "dead_letter_retention": age(r), "batch": args.batch }),
        )
        .await?;
        let done = audit
            .end(
                pool,
                postal_consumer::retention::cleanup_dead_letters_recorded(
                    pool,
                    r,
                    args.batch,
                    Some(audit.id()),
                )
                .await,
            )
            .await?;
        match done {
            Some(n) => say!(
                "dead letters: deleted {n} published row(s) older than {}",
                humantime::format_duration(r)
            ),
            None => say!("dead letters: another instance is cleaning right now; nothing done"),
        }
    }
    Ok(())
}
