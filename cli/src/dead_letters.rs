//! `postal dead-letters`: records consumers gave up on — list, show, replay, resolve.

use crate::out::say;
use crate::shown::{shown, shown_bytes};

use clap::Subcommand;
use postal_admin::dead_letters::{self, DeadLetter, Filter, Full};
use rdkafka::producer::FutureProducer;
use sqlx::PgPool;

use crate::progress::Progress;

/// Consumer dead letters recorded in `postal.dead_letters`.
#[derive(Subcommand, Debug)]
pub enum DeadLetterCommand {
    /// List dead letters, oldest first (replayed and resolved ones only with
    /// `--include-replayed`).
    List {
        /// Only this consumer.
        #[arg(long)]
        consumer: Option<String>,
        /// Only the dead letters of this event (its event id, a UUID).
        #[arg(long, value_name = "EVENT_ID", value_parser = crate::ids::event_id_of_dead_letter)]
        event: Option<uuid::Uuid>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Include dead letters already replayed or resolved (in the dashboard).
        #[arg(long)]
        include_replayed: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Print errors as stored, control characters included (else escaped).
        #[arg(long)]
        raw: bool,
    },
    /// Show one dead letter with its error, headers and payload (its first 64 KiB unless
    /// `--full`).
    #[command(group(clap::ArgGroup::new("which").required(true).args(["id", "id_flag"])))]
    Show {
        /// The dead letter's id (first column of `list`; or `--id`).
        #[arg(value_parser = crate::ids::dead_letter)]
        id: Option<i64>,
        /// The dead letter's id.
        #[arg(long = "id", value_name = "ID", conflicts_with = "id", value_parser = crate::ids::dead_letter)]
        id_flag: Option<i64>,
        /// Print key, headers, payload and error as stored, control characters included
        /// (else escaped).
        #[arg(long)]
        raw: bool,
        /// Print the payload whole (else its first 64 KiB and how many bytes were cut).
        #[arg(long)]
        full: bool,
    },
    /// Send dead letters back to the topic they came from, with their original key, value and
    /// headers (so their original event id), for the consumer's handler to process again: by
    /// id, by consumer, or all not yet replayed. A dead letter keeps its event's dedup row, so
    /// that no copy of it is ever applied by itself; replay removes that row just before
    /// sending, so the event goes through the handler once more — once.
    Replay {
        /// Dead letter ids (or `--id`, repeatable).
        #[arg(value_name = "ID", conflicts_with_all = ["consumer", "all"], value_parser = crate::ids::dead_letter)]
        listed: Vec<i64>,
        /// Dead letter ids (repeatable).
        #[arg(long = "id", value_name = "ID", conflicts_with_all = ["consumer", "all"], value_parser = crate::ids::dead_letter)]
        ids: Vec<i64>,
        /// Every unreplayed dead letter of this consumer.
        #[arg(long, conflicts_with = "all")]
        consumer: Option<String>,
        /// Every unreplayed dead letter.
        #[arg(long)]
        all: bool,
        /// Kafka bootstrap servers.
        #[arg(long, env = "KAFKA_BOOTSTRAP_SERVERS")]
        bootstrap_servers: Option<String>,
        /// Replay even dead letters recorded before another consumer's dedup retention
        /// horizon (that consumer may apply them again).
        #[arg(long)]
        force_past_retention: bool,
    },
    /// Mark open dead letters resolved: settled without a replay (the handler's effect was
    /// made by hand, or the event is to be dropped). They stay recorded, with their dedup
    /// rows, so their events are never applied; audited as the dashboard's resolve is.
    Resolve {
        /// Dead letter ids (or `--id`, repeatable).
        #[arg(value_name = "ID", value_parser = crate::ids::dead_letter)]
        listed: Vec<i64>,
        /// Dead letter ids (repeatable).
        #[arg(long = "id", value_name = "ID", value_parser = crate::ids::dead_letter)]
        ids: Vec<i64>,
        /// Show what would be resolved (one line per dead letter, and the count) and change
        /// nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// A dead letter's state: open, replayed or resolved.
fn state(d: &DeadLetter) -> &'static str {
    if d.replayed {
        "replayed"
    } else if d.resolved {
        "resolved"
    } else {
        "open"
    }
}

pub async fn run(pool: &PgPool, cmd: DeadLetterCommand) -> anyhow::Result<()> {
    match cmd {
        DeadLetterCommand::List {
            consumer,
            event,
            limit,
            include_replayed,
            json,
            raw,
        } => {
            let mut filter = Filter::default().all(include_replayed);
            if let Some(consumer) = consumer {
                crate::known::consumer(pool, &consumer).await?;
                filter = filter.consumer(consumer);
            }
            if let Some(event) = event {
                filter = filter.event_id(event);
            }
            let rows = dead_letters::oldest(pool, &filter, limit).await?;
            if json {
                say!("{}", crate::shown::json(&rows, true)?);
                return Ok(());
            }
            say!(
                "{:>6}  {:<12} {:<24} {:>9}  {:<18} {:<8} ERROR",
                "ID",
                "CONSUMER",
                "TOPIC",
                "PART/OFF",
                "REASON",
                "STATE"
            );
            for r in &rows {
                say!(
                    "{:>6}  {:<12} {:<24} {:>9}  {:<18} {:<8} {}",
                    r.id,
                    shown(&r.consumer_name, raw),
                    shown(&r.topic, raw),
                    format!("{}/{}", r.partition, r.kafka_offset),
                    r.reason,
                    state(r),
                    shown(&r.error, raw)
                );
            }
            if rows.is_empty() {
                say!("(no dead letters)");
            }
            Ok(())
        }
        DeadLetterCommand::Show {
            id,
            id_flag,
            raw,
            full,
        } => {
            let id = id.or(id_flag).expect("clap requires one");
            let Some(found) = dead_letters::show(pool, id).await? else {
                anyhow::bail!("no dead letter {id}");
            };
            let st = state(&found.listed);
            let Full {
                listed:
                    DeadLetter {
                        consumer_name: consumer,
                        topic,
                        partition,
                        kafka_offset: offset,
                        event_id,
                        reason,
                        error,
                        attempts,
                        ..
                    },
                record_key: key,
                payload,
                header_names: names,
                header_values: values,
                ..
            } = found;
            let text = |b: &[u8]| shown_bytes(b, raw);
            say!("dead letter:  {id} (consumer {})", shown(&consumer, raw));
            say!(
                "from:         {} partition {partition} offset {offset}",
                shown(&topic, raw)
            );
            say!(
                "event id:     {}",
                event_id
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| "-".into())
            );
            say!("reason:       {reason} after {attempts} attempt(s)");
            say!("state:        {st}");
            say!("error:        {}", shown(&error, raw));
            say!(
                "key:          {}",
                key.as_deref().map(text).unwrap_or_else(|| "-".into())
            );
            for (n, v) in names.iter().zip(&values) {
                say!("header:       {} = {}", shown(n, raw), text(v));
            }
            let payload = payload.as_deref().map(|p| {
                let head = crate::shown::cut(p, full);
                format!(
                    "{}{}",
                    text(head),
                    crate::shown::cut_note(head.len(), p.len())
                )
            });
            say!("payload:      {}", payload.unwrap_or_else(|| "-".into()));
            Ok(())
        }
        DeadLetterCommand::Replay {
            listed,
            mut ids,
            consumer,
            all,
            bootstrap_servers,
            force_past_retention,
        } => {
            ids.extend(listed);
            if ids.is_empty() && consumer.is_none() && !all {
                anyhow::bail!(
                    "say what to replay: dead letter ids (or --id <id>), --consumer <name> or --all"
                );
            }
            if let Some(consumer) = &consumer {
                crate::known::consumer(pool, consumer).await?;
            }
            let bootstrap_servers = crate::required_bootstrap(bootstrap_servers.as_deref())?;
            let filter = consumer
                .iter()
                .fold(Filter::default(), |f, c| f.consumer(c));
            let target = if !ids.is_empty() {
                serde_json::json!({ "ids": ids })
            } else {
                serde_json::json!({ "filter": filter })
            };
            let ids = dead_letters::matched(pool, &ids, &filter, None).await?;
            let producer: FutureProducer<crate::kafka_client::Capture> =
                crate::kafka_client::producer_config(&bootstrap_servers)?
                    .create_with_context(crate::kafka_client::Capture::default())?;
            let progress = Progress::new(ids.len() as u64, "replayed");
            let by = crate::audit::operator();
            let replayed = if force_past_retention {
                dead_letters::replay_past_retention(pool, &producer, &by, &target, &ids, |n| {
                    progress.set(n)
                })
                .await
            } else {
                dead_letters::replay(pool, &producer, &by, &target, &ids, |n| progress.set(n)).await
            };
            let done = match replayed {
                Ok(n) => n,
                Err(e) => {
                    progress.finish();
                    return Err(e.into());
                }
            };
            progress.finish();
            say!("replayed {done} dead letter(s) to their original topics");
            Ok(())
        }
        DeadLetterCommand::Resolve {
            listed,
            mut ids,
            dry_run,
        } => {
            ids.extend(listed);
            anyhow::ensure!(
                !ids.is_empty(),
                "say what to resolve: dead letter ids (or --id <id>), from `postal dead-letters list`"
            );
            let found = dead_letters::matched(pool, &ids, &Filter::default(), None).await?;
            if dry_run {
                for r in dead_letters::by_ids(pool, &found, found.len() as i64).await? {
                    say!(
                        "{:>6}  {}  {}  {}/{}  {}  {}",
                        r.id,
                        shown(&r.consumer_name, false),
                        shown(&r.topic, false),
                        r.partition,
                        r.kafka_offset,
                        r.reason,
                        shown(&postal_shared::text::bounded(&r.error, 200), false)
                    );
                }
                eprintln!(
                    "dry run: would resolve {} dead letter(s); nothing changed",
                    found.len()
                );
                if found.len() < ids.len() {
                    eprintln!(
                        "({} of the given ids are not open dead letters)",
                        ids.len() - found.len()
                    );
                }
                return Ok(());
            }
            let by = crate::audit::operator();
            let target = serde_json::json!({ "ids": ids });
            let done = dead_letters::resolve(pool, &by, &target, &found).await?;
            say!("resolved {done} dead letter(s): they stay recorded, and their events are not applied");
            if (done as usize) < ids.len() {
                say!(
                    "({} of the given ids are not open dead letters)",
                    ids.len() - done as usize
                );
            }
            Ok(())
        }
    }
}
