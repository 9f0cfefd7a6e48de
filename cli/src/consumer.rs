//! `postal consumer`: stored consumer positions.

use std::time::Duration;

use clap::Subcommand;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;

/// Consumer positions stored in the database.
#[derive(Subcommand, Debug)]
pub enum ConsumerCommand {
    /// Move a consumer group's stored offsets on a topic while the group is stopped.
    ///
    /// Postal consumers resume from the offsets stored in the database beside their effects,
    /// not from Kafka's group offsets: Kafka's own reset tool (`kafka-consumer-groups
    /// --reset-offsets`) would be ignored. Use this instead. Moving back replays events: their
    /// dedup rows (within the dedup retention) make the replay apply nothing twice.
    Reset {
        /// Consumer group.
        #[arg(long)]
        group: String,
        /// Topic.
        #[arg(long)]
        topic: String,
        /// Only these partitions (repeatable); default all of the topic's partitions.
        #[arg(long = "partition")]
        partitions: Vec<i32>,
        /// `earliest`, `latest`, an offset, or an RFC 3339 time (the first offset at or after it).
        #[arg(long)]
        to: String,
        /// Reset even if the group has live members (they would overwrite the reset).
        #[arg(long)]
        force: bool,
        /// Kafka bootstrap servers (for the topic's partitions, watermarks and group members).
        #[arg(
            long,
            env = "KAFKA_BOOTSTRAP_SERVERS",
            default_value = "127.0.0.1:9092"
        )]
        bootstrap_servers: String,
    },
}

enum Target {
    Earliest,
    Latest,
    Offset(i64),
    Time(i64),
}

fn parse_target(s: &str) -> anyhow::Result<Target> {
    Ok(match s {
        "earliest" => Target::Earliest,
        "latest" => Target::Latest,
        _ => {
            if let Ok(n) = s.parse::<i64>() {
                anyhow::ensure!(n >= 0, "offset must not be negative");
                Target::Offset(n)
            } else if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
                Target::Time(t.timestamp_millis())
            } else {
                anyhow::bail!("--to {s:?} is not earliest, latest, an offset or an RFC 3339 time");
            }
        }
    })
}

pub async fn run(pool: &PgPool, cmd: ConsumerCommand) -> anyhow::Result<()> {
    let ConsumerCommand::Reset {
        group,
        topic,
        partitions,
        to,
        force,
        bootstrap_servers,
    } = cmd;
    let target = parse_target(&to)?;
    let (b, g, t) = (bootstrap_servers.clone(), group.clone(), topic.clone());
    let positions =
        tokio::task::spawn_blocking(move || positions(&b, &g, &t, partitions, target, force))
            .await??;
    let mut tx = pool.begin().await?;
    for (partition, offset) in &positions {
        sqlx::query(
            "INSERT INTO postal.consumer_offsets (group_id, topic, partition, next_offset, owner)
             VALUES ($1, $2, $3, $4, 'postal consumer reset')
             ON CONFLICT (group_id, topic, partition) DO UPDATE
                SET next_offset = EXCLUDED.next_offset, epoch = postal.consumer_offsets.epoch + 1,
                    owner = EXCLUDED.owner, updated_at = now()",
        )
        .bind(&group)
        .bind(&topic)
        .bind(partition)
        .bind(offset)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    // Align the group's Kafka offsets too (lag tools; and a restarted consumer then fetches
    // from the new position rather than from a later Kafka offset before its seek lands).
    let (b, g, t, p) = (
        bootstrap_servers,
        group.clone(),
        topic.clone(),
        positions.clone(),
    );
    if let Err(e) = tokio::task::spawn_blocking(move || commit_to_kafka(&b, &g, &t, &p)).await? {
        eprintln!("warning: stored offsets moved, but the Kafka group offsets were not: {e}");
    }
    for (partition, offset) in &positions {
        println!("{group} {topic}[{partition}] -> next offset {offset}");
    }
    Ok(())
}

fn commit_to_kafka(
    bootstrap: &str,
    group: &str,
    topic: &str,
    positions: &[(i32, i64)],
) -> anyhow::Result<()> {
    let client: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("log_level", "0")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for (p, o) in positions {
        tpl.add_partition_offset(topic, *p, Offset::Offset(*o))?;
    }
    client.commit(&tpl, rdkafka::consumer::CommitMode::Sync)?;
    Ok(())
}

fn positions(
    bootstrap: &str,
    group: &str,
    topic: &str,
    only: Vec<i32>,
    target: Target,
    force: bool,
) -> anyhow::Result<Vec<(i32, i64)>> {
    let timeout = Duration::from_secs(10);
    let client: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set(
            "group.id",
            format!("postal-cli-{}", uuid::Uuid::now_v7().simple()),
        )
        .set("log_level", "0")
        .create()?;
    let groups = client
        .fetch_group_list(Some(group), timeout)
        .map_err(|e| anyhow::anyhow!("cannot reach the broker at {bootstrap}: {e}"))?;
    let (members, state) = groups
        .groups()
        .iter()
        .find(|g| g.name() == group)
        .map(|g| (g.members().len(), g.state().to_owned()))
        .unwrap_or((0, String::new()));
    // A group is stopped when it has no members and is not rebalancing.
    let stopped = members == 0 && matches!(state.as_str(), "" | "Empty" | "Dead");
    if !stopped && !force {
        anyhow::bail!(
            "consumer group {group:?} has {members} live member(s) (state {state}): stop them first (or pass --force)"
        );
    }
    let md = client.fetch_metadata(Some(topic), timeout)?;
    let all: Vec<i32> = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    anyhow::ensure!(!all.is_empty(), "topic {topic:?} does not exist");
    let chosen = if only.is_empty() { all.clone() } else { only };
    if let Some(p) = chosen.iter().find(|p| !all.contains(p)) {
        anyhow::bail!("topic {topic:?} has no partition {p}");
    }
    let mut out = Vec::new();
    for p in chosen {
        let offset = match target {
            Target::Offset(n) => n,
            Target::Earliest => client.fetch_watermarks(topic, p, timeout)?.0,
            Target::Latest => client.fetch_watermarks(topic, p, timeout)?.1,
            Target::Time(ms) => {
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition_offset(topic, p, Offset::Offset(ms))?;
                let found = client.offsets_for_times(tpl, timeout)?;
                match found.elements()[0].offset() {
                    Offset::Offset(n) => n,
                    _ => client.fetch_watermarks(topic, p, timeout)?.1,
                }
            }
        };
        out.push((p, offset));
    }
    Ok(out)
}
