//! `postal consumer`: stored consumer positions.

use crate::out::say;
use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use clap::Subcommand;
use rdkafka::consumer::Consumer;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;

/// Consumer positions stored in the database.
#[derive(Subcommand, Debug)]
pub enum ConsumerCommand {
    /// Move a consumer group's stored offsets on a topic while the group is stopped.
    ///
    /// Prints the plan and changes nothing unless `--execute` is given.
    ///
    /// Postal consumers resume from the offsets stored in the database beside their effects,
    /// not from Kafka's group offsets: Kafka's own reset tool (`kafka-consumer-groups
    /// --reset-offsets`) would be ignored. Use this instead. Moving back replays events: their
    /// dedup rows (within the dedup retention) make the replay apply nothing twice.
    ///
    /// A topic deleted and re-created (or a group moved to another Kafka cluster) has offsets
    /// below the stored ones; the group's consumers stop such a topic (`postal status` shows
    /// it). `--to earliest` is the way on: the new log is applied from its start, and events
    /// applied before are skipped by their dedup rows while they last (the dedup retention).
    /// The reset then covers all of the topic's partitions and lifts the stop.
    ///
    /// Refused when the target reaches records older than a consumer's dedup retention horizon
    /// (their dedup rows were deleted, so they would apply twice) unless
    /// `--force-past-retention`. Two checks: the group's offset marks (`postal.offset_marks`,
    /// recorded every 10 minutes by its running consumers: offsets processed before the
    /// horizon, by the database's clock), and the records' timestamps (the producing hosts'
    /// clocks: those up to `--clock-tolerance` newer than the horizon count as older). The group's Kafka offsets are committed too, in an order that
    /// never leaves them ahead of the stored ones (a restarted consumer would otherwise fetch
    /// past the replay); the command fails, naming what to do, when that cannot be done.
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
        /// The group is new: give it its first stored offsets. Without it, a group with no
        /// stored offsets in this database (a typo) is refused.
        #[arg(long)]
        new_group: bool,
        /// Apply the plan. Without it the command only prints the plan (each partition's stored
        /// offset, its target, and how many offsets are replayed or skipped) and changes
        /// nothing.
        #[arg(long)]
        execute: bool,
        /// The group's dedup scopes (`ConsumerConfig::consumer`, `#[idempotent(consumer = ..)]`)
        /// whose dedup retention horizon the target must not reach past (repeatable). Default:
        /// every consumer whose dedup rows retention ever deleted, since the database does not
        /// record which consumer names a group uses.
        #[arg(long = "consumer")]
        consumers: Vec<String>,
        /// Move back past the dedup retention horizon anyway: events older than it whose dedup
        /// rows were deleted are applied again (only for handlers that tolerate that).
        #[arg(long)]
        force_past_retention: bool,
        /// How far the clocks of the hosts that produced the records (their Kafka timestamps)
        /// may be ahead of the database's: records up to this much newer than the dedup
        /// horizon count as older than it.
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        clock_tolerance: Duration,
        /// Kafka bootstrap servers (for the topic's partitions, watermarks and group members).
        #[arg(long, env = "KAFKA_BOOTSTRAP_SERVERS")]
        bootstrap_servers: Option<String>,
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
        new_group,
        execute,
        consumers,
        force_past_retention,
        clock_tolerance,
        bootstrap_servers,
    } = cmd;
    let target = parse_target(&to)?;
    let every_partition = partitions.is_empty();
    let bootstrap_servers = crate::required_bootstrap(bootstrap_servers.as_deref())?;
    crate::known::group(pool, &group, Some(new_group)).await?;
    // Partitions whose log was replaced under the group (a re-created topic, another
    // cluster): the consumers stopped the topic, or the stored offset is above the high
    // watermark (found below).
    let stops: Vec<i32> = sqlx::query_scalar(
        "SELECT partition FROM postal.consumer_stops WHERE group_id = $1 AND topic = $2",
    )
    .bind(&group)
    .bind(&topic)
    .fetch_all(pool)
    .await?;
    anyhow::ensure!(
        stops.is_empty() || partitions.is_empty(),
        "topic {topic:?} is stopped for group {group:?} (its log was replaced: `postal status`), so every partition's stored offset is in doubt; nothing changed: reset all its partitions (leave out --partition)"
    );
    // A consumer named here that never deduplicated anything in this database (a typo, the
    // group's name) would leave the retention check with no horizon to hold: refused.
    for name in &consumers {
        crate::known::consumer(pool, name).await?;
    }
    // The newest horizon among the consumers checked: the strictest.
    let horizon: Option<(String, DateTime<Utc>)> = if force_past_retention {
        None
    } else {
        sqlx::query_as(
            "SELECT consumer_name, horizon FROM postal.dedup_horizon
             WHERE cardinality($1::text[]) = 0 OR consumer_name = ANY($1)
             ORDER BY horizon DESC, consumer_name LIMIT 1",
        )
        .bind(&consumers)
        .fetch_optional(pool)
        .await?
    };
    let stored: HashMap<i32, i64> = sqlx::query_as::<_, (i32, i64)>(
        "SELECT partition, next_offset FROM postal.consumer_offsets
         WHERE group_id = $1 AND topic = $2 AND next_offset IS NOT NULL",
    )
    .bind(&group)
    .bind(&topic)
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let (b, g, t, stored_) = (
        bootstrap_servers.clone(),
        group.clone(),
        topic.clone(),
        stored.clone(),
    );
    // Records' timestamps come from the producing hosts' clocks, the horizon from the
    // database's: a record a little newer than the horizon may still be older than it.
    let tolerance_us = i64::try_from(clock_tolerance.as_micros()).unwrap_or(i64::MAX);
    let horizon_us = horizon
        .as_ref()
        .map(|(_, h)| h.timestamp_micros().saturating_add(tolerance_us));
    let (positions, watermarks, past) = tokio::task::spawn_blocking(move || {
        let (positions, watermarks) = positions(&b, &g, &t, partitions, target, force)?;
        let mut past = None;
        if let Some(h) = horizon_us {
            for &(p, o) in &positions {
                // Only a move back (or a first position) replays records already processed.
                if stored_.get(&p).is_some_and(|s| o >= *s) {
                    continue;
                }
                if let Some(safe) = first_newer(&b, &t, p, o, h)? {
                    past = Some((p, o, safe));
                    break;
                }
            }
        }
        anyhow::Ok((positions, watermarks, past))
    })
    .await??;
    // Partitions the group stored offsets for that the topic no longer has: Kafka never takes
    // a partition away, so the topic was re-created with fewer partitions (or the group moved
    // to another cluster), and every stored offset of the topic belongs to the old log.
    let vanished: Vec<(i32, Option<i64>)> = sqlx::query_as::<_, (i32, Option<i64>)>(
        "SELECT partition, next_offset FROM postal.consumer_offsets
         WHERE group_id = $1 AND topic = $2 ORDER BY partition",
    )
    .bind(&group)
    .bind(&topic)
    .fetch_all(pool)
    .await?
    .into_iter()
    .filter(|(p, _)| !watermarks.contains_key(p))
    .collect();
    anyhow::ensure!(
        vanished.is_empty() || every_partition,
        "topic {topic:?} no longer has partition {} that group {group:?} stored an offset for (it was re-created with fewer partitions), so every partition's stored offset is in doubt; nothing changed: reset all its partitions (leave out --partition)",
        vanished[0].0
    );
    let recreated = !stops.is_empty()
        || !vanished.is_empty()
        || stored.iter().any(|(p, s)| {
            watermarks
                .get(p)
                .is_some_and(|&(_, high)| postal_consumer::log_replaced(*s, high))
        });
    // The group's own record of where it stood (database clock). Records processed before
    // the horizon lie below the highest position the group had reached by then; marks are
    // taken every 10 minutes and by every reset before it moves (the position it leaves), so
    // that is the highest mark up to the first one at least 10 minutes after the horizon
    // (transactions longer than that are not expected). With no mark after the horizon (the
    // group has not run since) or none before it (its history began after it): everything
    // below the highest mark or its stored offset may be that old. A target below it may reach records whose
    // dedup rows were deleted, whatever their timestamps. (Only consulted with a horizon.)
    // A replaced log's marks (and stored offsets) are of the old log: they say nothing of the
    // new one's records.
    let marked: HashMap<i32, i64> = match &horizon {
        Some(_) if recreated => HashMap::new(),
        Some((_, h)) => {
            let marks: Vec<(i32, i64, DateTime<Utc>)> = sqlx::query_as(
                "SELECT partition, next_offset, marked_at FROM postal.offset_marks
                 WHERE group_id = $1 AND topic = $2 ORDER BY partition, marked_at",
            )
            .bind(&group)
            .bind(&topic)
            .fetch_all(pool)
            .await?;
            let after = *h + chrono::Duration::minutes(10);
            let mut out = HashMap::new();
            for &(p, _) in &positions {
                let of_p: Vec<&(i32, i64, DateTime<Utc>)> =
                    marks.iter().filter(|m| m.0 == p).collect();
                let until = of_p.iter().find(|m| m.2 >= after).map(|m| m.2);
                // Marks that begin after the horizon (a Postal without marks ran before) tell
                // nothing about how far the group had got by then.
                let covered = of_p.iter().any(|m| m.2 <= *h);
                let bound = match until {
                    Some(u) if covered => of_p.iter().filter(|m| m.2 <= u).map(|m| m.1).max(),
                    _ => of_p.iter().map(|m| m.1).max().max(stored.get(&p).copied()),
                };
                if let Some(n) = bound {
                    out.insert(p, n);
                }
            }
            out
        }
        None => HashMap::new(),
    };
    let past = positions
        .iter()
        .filter(|(p, o)| stored.get(p).is_none_or(|s| o < s))
        .find_map(|&(p, o)| {
            let n = *marked.get(&p)?;
            (o < n).then(|| {
                // With both checks refusing, the later safe offset.
                let safe = match past {
                    Some((pp, _, s)) if pp == p => s.max(n),
                    _ => n,
                };
                (p, o, safe)
            })
        })
        .or(past);
    if let (Some((consumer, h)), Some((partition, offset, safe))) = (&horizon, past) {
        anyhow::bail!(
            "{topic}[{partition}] offset {offset} may hold records processed before consumer {consumer:?}'s dedup retention horizon ({}; by the group's offset marks, or record timestamps within --clock-tolerance {}): their dedup rows may be deleted, so a replay could apply them twice; reset to offset {safe} or later, or pass --force-past-retention if applying them twice is acceptable",
            h.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            humantime::format_duration(clock_tolerance)
        );
    }
    for (partition, offset) in &positions {
        let line = match (recreated, watermarks.get(partition)) {
            (true, Some(&(low, high))) => {
                replaced_line(stored.get(partition).copied(), *offset, low, high)
            }
            _ => plan_line(stored.get(partition).copied(), *offset),
        };
        say!("plan: {group} {topic}[{partition}]: {line}");
    }
    for (partition, stored) in &vanished {
        let stored = stored.map_or_else(|| "none".to_owned(), |s| s.to_string());
        say!("plan: {group} {topic}[{partition}]: the topic no longer has this partition: its stored offset ({stored}, of the old log) is deleted");
    }
    let (held_keys, held_records) = if recreated {
        postal_admin::held::count(pool, &group, &topic).await?
    } else {
        (0, 0)
    };
    if held_records > 0 {
        say!("plan: {group} {topic}: {held_records} held records of {held_keys} held keys (of the old log, never applied) become dead letters (reason log_replaced), in key order, and their keys are let go: `postal dead-letters replay` applies them after the new log's");
    }
    if recreated {
        say!(
            "topic {topic} was re-created (or the group moved to another Kafka cluster): its stored offsets belong to the old log. Events applied before are not applied again while their dedup rows in postal.processed_events last (the consumers' dedup retention; `postal status` shows each dedup horizon)."
        );
    }
    if !execute {
        say!("dry run: nothing changed; add --execute to apply this plan");
        return Ok(());
    }
    // Kafka's group offsets must never be ahead of the stored ones: a restarted consumer
    // fetches from Kafka's offset until its seek to the stored one lands, and would take a
    // later record as its start, skipping the replay. So: move Kafka's offsets back first
    // (to min(stored, target)), then write the stored offsets, then move Kafka's forward.
    let back: Vec<(i32, i64)> = positions
        .iter()
        .map(|&(p, o)| (p, stored.get(&p).map_or(o, |&s| s.min(o))))
        .collect();
    let forward: Vec<(i32, i64)> = positions
        .iter()
        .copied()
        .filter(|(p, o)| stored.get(p).is_some_and(|s| o > s))
        .collect();
    let commit = |p: Vec<(i32, i64)>| {
        let (b, g, t) = (bootstrap_servers.clone(), group.clone(), topic.clone());
        tokio::task::spawn_blocking(move || commit_to_kafka(&b, &g, &t, &p))
    };
    if let Err(e) = commit(back).await? {
        anyhow::bail!(
            "nothing changed: cannot commit group {group:?}'s offsets to Kafka ({e:#}); make sure the broker is reachable and the group has no live members, then re-run"
        );
    }
    // Audited (`postal audit list`): who, the group and topic, the target and flags given,
    // and each partition's move, in the transaction that writes the stored offsets.
    let audit_target = serde_json::json!({
        "group": group,
        "topic": topic,
        "to": to,
        "force": force,
        "force_past_retention": force_past_retention,
        "partitions": positions.iter().map(|&(p, o)| serde_json::json!({
            "partition": p,
            "from": stored.get(&p),
            "to": o,
        })).collect::<Vec<_>>(),
    });
    let by = crate::audit::operator();
    let current: Vec<i32> = watermarks.keys().copied().collect();
    if let Err(e) = store(
        pool,
        &group,
        &topic,
        &positions,
        recreated.then_some(current.as_slice()),
        &by,
        &audit_target,
    )
    .await
    {
        anyhow::bail!(
            "Kafka's offsets of group {group:?} were moved back, but the stored offsets were not written ({e}): re-run this command before starting the group (until then it resumes from its old stored offsets)"
        );
    }
    for (partition, offset) in &positions {
        say!("{group} {topic}[{partition}] -> next offset {offset}");
    }
    if recreated {
        say!("{group} {topic}: stop lifted; the group's consumers apply the topic from the offsets above");
    }
    if !forward.is_empty() {
        if let Err(e) = commit(forward).await? {
            anyhow::bail!(
                "the stored offsets moved, but Kafka's offsets of group {group:?} could not follow them forward ({e:#}); the group resumes from the stored offsets; re-run this command to align Kafka's offsets (for lag tools)"
            );
        }
    }
    Ok(())
}

/// What moving a partition's stored next offset from `stored` to `target` does.
fn plan_line(stored: Option<i64>, target: i64) -> String {
    match stored {
        None => format!("no stored offset -> next offset {target} (the group starts there)"),
        Some(s) if s == target => format!("next offset {s} -> {target} (unchanged)"),
        Some(s) if target < s => format!(
            "next offset {s} -> {target} (moves back {} offsets: replayed, each event applied at most once while its dedup row lasts)",
            s - target
        ),
        Some(s) => format!(
            "next offset {s} -> {target} (moves forward {} offsets: those records are skipped, never applied)",
            target - s
        ),
    }
}

/// What moving a partition's stored next offset from `stored` to `target` does when the
/// partition's log was replaced (its offsets now run from `low` to `high`).
fn replaced_line(stored: Option<i64>, target: i64, low: i64, high: i64) -> String {
    let stored = stored.map_or_else(|| "none".to_owned(), |s| s.to_string());
    let what = if target <= low {
        "the new log is applied from its start".to_owned()
    } else {
        format!(
            "records {low} to {} of the new log are skipped, never applied; the rest is applied",
            target - 1
        )
    };
    format!("next offset {stored} (of the old log) -> {target} (new log: offsets {low} to {high}; {what})")
}

/// Writes the stored offsets of `positions` (and bumps the epochs, fencing any owner). With
/// `replaced` (the partitions the topic has now) the topic's log was replaced: its offset marks
/// (of the old log) are deleted, its stop lifted, and the stored offsets of partitions it no
/// longer has deleted. Recorded in the audit trail as `reset` by `by` on `target`, in the same
/// transaction: the stored offsets move only with their audit row.
async fn store(
    pool: &PgPool,
    group: &str,
    topic: &str,
    positions: &[(i32, i64)],
    replaced: Option<&[i32]>,
    by: &postal_admin::audit::Operator,
    target: &serde_json::Value,
) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    postal_admin::audit::record(
        &mut tx,
        by,
        "reset",
        target,
        positions.len(),
        positions.len() as u64,
    )
    .await?;
    let partitions: Vec<i32> = positions.iter().map(|(p, _)| *p).collect();
    let recreated = replaced.is_some();
    if let Some(current) = replaced {
        sqlx::query(
            "DELETE FROM postal.consumer_offsets
             WHERE group_id = $1 AND topic = $2 AND NOT (partition = ANY($3))",
        )
        .bind(group)
        .bind(topic)
        .bind(current)
        .execute(&mut *tx)
        .await?;
        for table in ["postal.offset_marks", "postal.consumer_stops"] {
            sqlx::query(&format!(
                "DELETE FROM {table} WHERE group_id = $1 AND topic = $2"
            ))
            .bind(group)
            .bind(topic)
            .execute(&mut *tx)
            .await?;
        }
        postal_admin::held::dead_letter_replaced_log(&mut tx, group, topic).await?;
    }
    // The position the group leaves, as an offset mark: a later reset must know how far it had
    // got, even if it moved back before the next periodic mark (not an old log's).
    sqlx::query(
        "INSERT INTO postal.offset_marks (group_id, topic, partition, next_offset)
         SELECT group_id, topic, partition, next_offset FROM postal.consumer_offsets
         WHERE group_id = $1 AND topic = $2 AND partition = ANY($3) AND next_offset IS NOT NULL
           AND NOT $4
         ON CONFLICT DO NOTHING",
    )
    .bind(group)
    .bind(topic)
    .bind(&partitions)
    .bind(recreated)
    .execute(&mut *tx)
    .await?;
    for (partition, offset) in positions {
        sqlx::query(
            "INSERT INTO postal.consumer_offsets (group_id, topic, partition, next_offset, owner)
             VALUES ($1, $2, $3, $4, 'postal consumer reset')
             ON CONFLICT (group_id, topic, partition) DO UPDATE
                SET next_offset = EXCLUDED.next_offset, epoch = postal.consumer_offsets.epoch + 1,
                    owner = EXCLUDED.owner, updated_at = now()",
        )
        .bind(group)
        .bind(topic)
        .bind(partition)
        .bind(offset)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Commits `positions` as the group's Kafka offsets and reads them back: an error unless the
/// broker stored every one of them.
fn commit_to_kafka(
    bootstrap: &str,
    group: &str,
    topic: &str,
    positions: &[(i32, i64)],
) -> anyhow::Result<()> {
    let client: crate::kafka_client::Consumer = crate::kafka_client::config(bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("log_level", "0")
        .create_with_context(crate::kafka_client::Capture::default())?;
    let mut tpl = TopicPartitionList::new();
    for (p, o) in positions {
        tpl.add_partition_offset(topic, *p, Offset::Offset(*o))?;
    }
    client.commit(&tpl, rdkafka::consumer::CommitMode::Sync)?;
    let committed = client.committed_offsets(tpl, Duration::from_secs(10))?;
    for (p, o) in positions {
        let got = committed
            .find_partition(topic, *p)
            .map(|e| (e.offset(), e.error()));
        if !matches!(got, Some((Offset::Offset(n), Ok(()))) if n == *o) {
            anyhow::bail!("the broker did not store offset {o} of {topic}[{p}] (it has {got:?})");
        }
    }
    Ok(())
}

/// Per partition, the first offset whose record is newer than `horizon_ms` (the high watermark
/// when none is).
/// When the record at `offset` of `topic[partition]` (or the first after it) is not newer than
/// `horizon_us` (microseconds since the epoch): `Some` of the first offset whose record is,
/// found by bisection up to the high watermark (record timestamps grow with offsets). `None`
/// when it is newer, or there is no record there (nothing to replay).
fn first_newer(
    bootstrap: &str,
    topic: &str,
    partition: i32,
    offset: i64,
    horizon_us: i64,
) -> anyhow::Result<Option<i64>> {
    let old = |ts_ms: i64| ts_ms.saturating_mul(1000) <= horizon_us;
    let Some((at, ts)) = record_at(bootstrap, topic, partition, offset)? else {
        return Ok(None);
    };
    if !old(ts) {
        return Ok(None);
    }
    let client: crate::kafka_client::Consumer = crate::kafka_client::config(bootstrap)
        .set("log_level", "0")
        .create_with_context(crate::kafka_client::Capture::default())?;
    let high = client
        .fetch_watermarks(topic, partition, Duration::from_secs(10))?
        .1;
    // Records up to `lo` are old; the first newer one is in (lo, hi].
    let (mut lo, mut hi) = (at, high);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match record_at(bootstrap, topic, partition, mid)? {
            Some((o, ts)) if old(ts) => lo = o,
            _ => hi = mid,
        }
    }
    Ok(Some(hi))
}

/// The (offset, timestamp in ms) of the record at `offset` of `topic[partition]` or the first
/// after it; `None` when none arrives within 10 s (e.g. `offset` is the high watermark).
fn record_at(
    bootstrap: &str,
    topic: &str,
    partition: i32,
    offset: i64,
) -> anyhow::Result<Option<(i64, i64)>> {
    use rdkafka::Message as _;
    let client: crate::kafka_client::Consumer = crate::kafka_client::config(bootstrap)
        .set(
            "group.id",
            format!("postal-cli-{}", uuid::Uuid::now_v7().simple()),
        )
        .set("enable.auto.commit", "false")
        .set("log_level", "0")
        .create_with_context(crate::kafka_client::Capture::default())?;
    let (low, high) = client.fetch_watermarks(topic, partition, Duration::from_secs(10))?;
    // Below the log start the consumer resumes from the log start (`auto.offset.reset`).
    let offset = offset.max(low);
    if offset >= high {
        return Ok(None);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(offset))?;
    client.assign(&tpl)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if let Some(m) = client.poll(Duration::from_millis(200)) {
            let m = m?;
            if m.offset() >= offset {
                return Ok(m.timestamp().to_millis().map(|t| (m.offset(), t)));
            }
        }
    }
    Ok(None)
}

/// Each partition's (low, high) watermarks.
type Watermarks = HashMap<i32, (i64, i64)>;

/// The target offset of each chosen partition, and the watermarks of all of the topic's.
fn positions(
    bootstrap: &str,
    group: &str,
    topic: &str,
    only: Vec<i32>,
    target: Target,
    force: bool,
) -> anyhow::Result<(Vec<(i32, i64)>, Watermarks)> {
    let timeout = Duration::from_secs(10);
    let client: crate::kafka_client::Consumer = crate::kafka_client::config(bootstrap)
        .set(
            "group.id",
            format!("postal-cli-{}", uuid::Uuid::now_v7().simple()),
        )
        .set("log_level", "0")
        .create_with_context(crate::kafka_client::Capture::default())?;
    let groups = client
        .fetch_group_list(Some(group), timeout)
        .map_err(|e| crate::kafka_client::why(&client, bootstrap, e))?;
    let (members, state, hosts) = groups
        .groups()
        .iter()
        .find(|g| g.name() == group)
        .map(|g| {
            let mut hosts: Vec<String> = g
                .members()
                .iter()
                .map(|m| format!("{} on {}", m.client_id(), m.client_host()))
                .collect();
            hosts.sort();
            hosts.dedup();
            (g.members().len(), g.state().to_owned(), hosts)
        })
        .unwrap_or((0, String::new(), Vec::new()));
    // A group is stopped when it has no members and is not rebalancing.
    let stopped = members == 0 && matches!(state.as_str(), "" | "Empty" | "Dead");
    if !stopped && !force {
        // A consumer that stopped cleanly has left the group; one that was killed, cut off
        // or hung stays a member until the group coordinator expires it.
        anyhow::bail!(
            "consumer group {group:?} has {members} live member(s) (state {state}{}): stop them first (or pass --force); nothing changed. A consumer killed or cut off without leaving the group stays a member until the broker expires it, one session timeout after its last heartbeat (the consumers' session.timeout.ms, 45 s unless they set it): if every consumer of the group is stopped, re-run after that",
            if hosts.is_empty() {
                String::new()
            } else {
                format!("; {}", crate::shown::shown(&hosts.join(", "), false))
            }
        );
    }
    let md = client
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| crate::kafka_client::why(&client, bootstrap, e))?;
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
    let mut watermarks = HashMap::new();
    // All of the topic's: a replaced log shows on any of them.
    for &p in &all {
        watermarks.insert(p, client.fetch_watermarks(topic, p, timeout)?);
    }
    for p in chosen {
        let (low, high) = watermarks[&p];
        let offset = match target {
            Target::Offset(n) => {
                // Outside the partition's offsets, the consumer would fall back to its
                // `auto.offset.reset` and then skip what lies below the stored offset.
                anyhow::ensure!(
                    (low..=high).contains(&n),
                    "--to {n} is outside partition {p}'s offsets ({low} to {high}): pick one in that range, or earliest, latest or a time"
                );
                n
            }
            Target::Earliest => low,
            Target::Latest => high,
            Target::Time(ms) => {
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition_offset(topic, p, Offset::Offset(ms))?;
                let found = client.offsets_for_times(tpl, timeout)?;
                match found.elements()[0].offset() {
                    Offset::Offset(n) => n,
                    _ => high,
                }
            }
        };
        out.push((p, offset));
    }
    Ok((out, watermarks))
}
