//! `postal status`: what the outbox holds.

use crate::out::say;
use crate::shown::shown;
use serde::Serialize;
use sqlx::PgPool;

#[derive(Serialize, sqlx::FromRow)]
struct TopicRow {
    topic: String,
    /// Pending events that are due (see the relay's `postal_relay_backlog`).
    pending: i64,
    /// Events scheduled for later delivery, not due yet.
    scheduled: i64,
    failed: i64,
    /// Age of the oldest due event (a scheduled one counts from its delivery time).
    oldest_pending_age_s: Option<f64>,
    /// Why the oldest pending event that failed to publish is still waiting (its last error:
    /// e.g. a missing topic or a missing ACL), if one did.
    #[sqlx(default)]
    waiting: Option<String>,
    /// The oldest due event has waited [`STALLED_AFTER_S`] or more: no relay publishes this
    /// topic now (see `waiting`, the relays below and their logs).
    #[sqlx(default)]
    stalled: bool,
    /// Relay groups that pause the topic (`postal pause relay`; `*`: a pause of every relay
    /// group): nothing of it is published by their relays until it is resumed.
    #[sqlx(skip)]
    paused: Vec<String>,
}

/// How long a due event, or a consumer's lag, may go without progress before `postal status`
/// marks its topic or partition stalled.
const STALLED_AFTER_S: f64 = 60.0;

#[derive(Serialize)]
struct Status {
    topics: Vec<TopicRow>,
    /// Age of the oldest open transaction (it holds back the keys it wrote, and vacuum).
    oldest_transaction_s: Option<f64>,
    relays: Vec<RelayRow>,
    consumers: Vec<ConsumerRow>,
    dead_letters: Vec<DeadLetterRow>,
    dedup_horizons: Vec<HorizonRow>,
    /// The pauses in force (`postal pause`).
    pauses: Vec<postal_admin::pauses::Pause>,
    /// The WAL relays' replication slots (docs/wal-relay.md): lag, retained WAL, lease.
    wal_slots: Vec<postal_producer::wal::slot::SlotState>,
}

/// A consumer's dedup retention horizon: dedup rows processed up to it were deleted, so
/// `postal consumer reset` refuses to move back to records older than it.
#[derive(Serialize, sqlx::FromRow)]
struct HorizonRow {
    consumer_name: String,
    horizon: chrono::DateTime<chrono::Utc>,
}

#[derive(Serialize, sqlx::FromRow)]
struct ConsumerRow {
    group_id: String,
    topic: String,
    partition: i32,
    next_offset: Option<i64>,
    updated_age_s: f64,
    /// Records behind the broker's high watermark (when the broker answered; none when the
    /// topic is stopped).
    #[sqlx(default)]
    lag: Option<i64>,
    /// The partition's high watermark (when the broker answered).
    #[sqlx(default)]
    high_watermark: Option<i64>,
    /// The group's consumers stopped the topic, or would: a partition's log was replaced
    /// under the stored offset (the topic was re-created, or the group moved to another Kafka
    /// cluster). Nothing of the topic is applied until `postal consumer reset`.
    stopped: bool,
    /// Records wait (lag above 0) and the stored offset has not moved for
    /// [`STALLED_AFTER_S`] or more: the group's consumer of the partition is stalled or gone
    /// (its `/readyz` and `postal_consumer_stalled_seconds` say which).
    #[sqlx(default)]
    stalled: bool,
    /// The group, or this topic of it, is paused (`postal pause consumer`): nothing of it is
    /// applied until it is resumed (never `stalled` then).
    #[sqlx(default)]
    paused: bool,
}

#[derive(Serialize, sqlx::FromRow)]
struct DeadLetterRow {
    consumer_name: String,
    total: i64,
    unpublished: i64,
    not_replayed: i64,
}

#[derive(Serialize, sqlx::FromRow)]
struct RelayRow {
    relay_id: uuid::Uuid,
    /// Relay group: relays split the key partitions with the members of their own group.
    relay_group: String,
    host: String,
    heartbeat_age_s: f64,
    partitions: i64,
    /// What holds the relay up, as its claim watchdog last recorded it (its claims wait on the
    /// database); none while it makes progress.
    stalled: Option<String>,
}

pub async fn print(pool: &PgPool, json: bool, bootstrap: Option<&str>) -> anyhow::Result<()> {
    let mut topics: Vec<TopicRow> = sqlx::query_as(&postal_producer::backlog::summary_sql(true))
        .fetch_all(pool)
        .await?;
    let pauses = postal_admin::pauses::list(pool).await?;
    for t in &mut topics {
        t.paused = pauses
            .iter()
            .filter(|p| p.side == "relay" && p.topic.as_ref().is_none_or(|x| *x == t.topic))
            .map(|p| p.group_name.clone().unwrap_or_else(|| "*".into()))
            .collect();
    }
    for t in &mut topics {
        if t.pending > 0 {
            t.waiting = sqlx::query_scalar(
                "SELECT last_error FROM postal.outbox
                 WHERE topic = $1 AND status = 'pending' AND last_error IS NOT NULL
                 ORDER BY seq LIMIT 1",
            )
            .bind(&t.topic)
            .fetch_optional(pool)
            .await?;
            // A topic paused in every relay group waits on purpose. (Paused in some groups
            // only, it may still be stalled in the others.)
            t.stalled = t.oldest_pending_age_s.is_some_and(|a| a >= STALLED_AFTER_S)
                && !t.paused.iter().any(|g| g == "*");
        }
    }
    let oldest_transaction_s: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(xact_start))::float8 FROM pg_stat_activity
         WHERE (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL) AND pid <> pg_backend_pid()",
    )
    .fetch_one(pool)
    .await?;
    let relays: Vec<RelayRow> = sqlx::query_as(
        "SELECT i.relay_id, i.relay_group, i.host, extract(epoch FROM now() - i.heartbeat_at)::float8 AS heartbeat_age_s,
                count(p.key_partition) FILTER (WHERE p.lease_until > now()) AS partitions,
                i.stalled
         FROM postal.relay_instances i
         LEFT JOIN postal.relay_partitions p ON p.owner = i.relay_id
         GROUP BY i.relay_id ORDER BY i.relay_group, i.relay_id",
    )
    .fetch_all(pool)
    .await?;
    let mut consumers: Vec<ConsumerRow> = sqlx::query_as(
        "SELECT o.group_id, o.topic, o.partition, o.next_offset,
                extract(epoch FROM now() - o.updated_at)::float8 AS updated_age_s,
                EXISTS (SELECT 1 FROM postal.consumer_stops s
                        WHERE s.group_id = o.group_id AND s.topic = o.topic) AS stopped,
                EXISTS (SELECT 1 FROM postal.pauses p
                        WHERE p.side = 'consumer' AND p.group_name = o.group_id
                          AND (p.topic IS NULL OR p.topic = o.topic)) AS paused
         FROM postal.consumer_offsets o ORDER BY o.group_id, o.topic, o.partition",
    )
    .fetch_all(pool)
    .await?;
    if let (Some(b), false) = (bootstrap, consumers.is_empty()) {
        let wanted: Vec<(String, i32)> = consumers
            .iter()
            .map(|c| (c.topic.clone(), c.partition))
            .collect();
        let b = b.to_owned();
        let highs = tokio::task::spawn_blocking(move || high_watermarks(&b, &wanted))
            .await
            .unwrap_or_default();
        for (c, high) in consumers.iter_mut().zip(highs) {
            c.high_watermark = high;
            c.lag = high.map(|h| h - c.next_offset.unwrap_or(0));
        }
        // A stored offset above the high watermark is no negative lag but a replaced log; the
        // consumers stop the whole topic when they find one.
        let replaced: std::collections::HashSet<(String, String)> = consumers
            .iter()
            .filter(|c| c.lag.is_some_and(|l| l < 0))
            .map(|c| (c.group_id.clone(), c.topic.clone()))
            .collect();
        for c in &mut consumers {
            c.stopped |= replaced.contains(&(c.group_id.clone(), c.topic.clone()));
        }
    }
    for c in &mut consumers {
        if c.stopped {
            c.lag = None;
        }
        c.stalled = !c.paused && c.lag.is_some_and(|l| l > 0) && c.updated_age_s >= STALLED_AFTER_S;
    }
    let dead_letters: Vec<DeadLetterRow> = sqlx::query_as(
        "SELECT consumer_name, count(*) AS total,
                count(*) FILTER (WHERE published_at IS NULL) AS unpublished,
                count(*) FILTER (WHERE replayed_at IS NULL) AS not_replayed
         FROM postal.dead_letters GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await?;
    let dedup_horizons: Vec<HorizonRow> = sqlx::query_as(
        "SELECT consumer_name, horizon FROM postal.dedup_horizon ORDER BY consumer_name",
    )
    .fetch_all(pool)
    .await?;
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(pool)
        .await?;
    let wal_slots = if in_recovery {
        Vec::new()
    } else {
        postal_producer::wal::slot::states(pool).await?
    };
    let status = Status {
        wal_slots,
        topics,
        oldest_transaction_s,
        relays,
        consumers,
        dead_letters,
        dedup_horizons,
        pauses,
    };
    if json {
        say!("{}", crate::shown::json(&status, true)?);
        return Ok(());
    }
    say!(
        "{:<40} {:>10} {:>10} {:>8} {:>14}",
        "TOPIC",
        "PENDING",
        "SCHEDULED",
        "FAILED",
        "OLDEST (s)"
    );
    for t in &status.topics {
        say!(
            "{:<40} {:>10} {:>10} {:>8} {:>14}",
            shown(&t.topic, false),
            t.pending,
            t.scheduled,
            t.failed,
            t.oldest_pending_age_s
                .map(|a| format!("{a:.1}"))
                .unwrap_or_else(|| "-".into())
        );
        if t.stalled {
            say!(
                "  STALLED: its oldest due event has waited {:.0}s; no relay publishes it now (see waiting, the relays below, their logs)",
                t.oldest_pending_age_s.unwrap_or_default()
            );
        }
        if !t.paused.is_empty() {
            let groups: Vec<String> = t
                .paused
                .iter()
                .map(|g| match g.as_str() {
                    "*" => "every relay group".to_owned(),
                    g => format!("relay group {}", shown(g, false)),
                })
                .collect();
            say!(
                "  PAUSED in {}: not published until postal resume relay",
                groups.join(", ")
            );
        }
        if let Some(w) = &t.waiting {
            say!("  waiting: {}", shown(w, false));
        }
    }
    if status.topics.is_empty() {
        say!("(outbox empty)");
    }
    say!(
        "oldest open transaction: {}",
        status
            .oldest_transaction_s
            .map(|a| format!("{a:.1}s"))
            .unwrap_or_else(|| "none".into())
    );
    say!("relays:");
    for r in &status.relays {
        say!(
            "  {}  group {:<12} host {:<20} heartbeat {:>6.1}s ago  partitions {}",
            r.relay_id,
            shown(&r.relay_group, false),
            shown(&r.host, false),
            r.heartbeat_age_s,
            r.partitions
        );
        if let Some(problem) = &r.stalled {
            say!("    STALLED: {}", shown(problem, false));
        }
    }
    say!("consumers (positions stored beside their effects):");
    for c in &status.consumers {
        say!(
            "  {:<24} {:<32} [{:>3}] next offset {:>10}  lag {:>8}  updated {:>8.1}s ago",
            shown(&c.group_id, false),
            shown(&c.topic, false),
            c.partition,
            c.next_offset
                .map(|o| o.to_string())
                .unwrap_or_else(|| "-".into()),
            match (c.stopped, c.paused, c.lag) {
                (true, _, _) => "STOPPED".into(),
                (false, true, Some(l)) => format!("{l} PAUSED"),
                (false, true, None) => "PAUSED".into(),
                (false, false, Some(l)) => l.to_string(),
                (false, false, None) => "?".into(),
            },
            c.updated_age_s
        );
    }
    let mut stopped: Vec<(&str, &str)> = status
        .consumers
        .iter()
        .filter(|c| c.stopped)
        .map(|c| (c.group_id.as_str(), c.topic.as_str()))
        .collect();
    stopped.dedup();
    for c in status.consumers.iter().filter(|c| c.stalled) {
        say!(
            "  STALLED {} {} [{}]: {} records behind and the stored offset unchanged for {:.0}s: the group's consumer of it is stalled or gone (its log, /readyz and postal_consumer_stalled_seconds say why)",
            shown(&c.group_id, false),
            shown(&c.topic, false),
            c.partition,
            c.lag.unwrap_or_default(),
            c.updated_age_s
        );
    }
    for (group, topic) in stopped {
        say!(
            "  STOPPED {} {}: a stored offset is above its partition's high watermark (the topic was re-created, or the group moved to another Kafka cluster); nothing of it is applied until: postal consumer reset --group {} --topic {} --to earliest --execute",
            shown(group, false),
            shown(topic, false),
            shown(group, false),
            shown(topic, false)
        );
    }
    if !status.pauses.is_empty() {
        say!("pauses (postal pause list; lifted with postal resume):");
    }
    for p in &status.pauses {
        let (group, topic) = (
            p.group_name.as_deref().unwrap_or("(every)"),
            p.topic.as_deref().unwrap_or("(every)"),
        );
        say!(
            "  PAUSED {:<8} group {} topic {} since {} by {}{}",
            p.side,
            shown(group, false),
            shown(topic, false),
            p.paused_at.format("%Y-%m-%d %H:%M:%S UTC"),
            shown(&p.paused_by, false),
            p.reason
                .as_deref()
                .map(|r| format!(": {}", shown(r, false)))
                .unwrap_or_default()
        );
    }
    if !status.wal_slots.is_empty() {
        say!("WAL relay slots:");
    }
    for w in &status.wal_slots {
        let bytes = |b: Option<i64>| b.map(|b| format!("{b} B")).unwrap_or_else(|| "-".into());
        say!(
            "  {:<32} {:<8} lag {} ({})  retained {}  wal_status {}  safe {}  lease {}",
            shown(&w.slot, false),
            match (w.present, w.active) {
                (false, _) => "MISSING",
                (true, true) => "active",
                (true, false) => "INACTIVE",
            },
            bytes(w.lag_bytes),
            w.lag_s
                .map(|s| format!("{s:.1}s"))
                .unwrap_or_else(|| "-".into()),
            bytes(w.retained_bytes),
            w.wal_status.as_deref().unwrap_or("-"),
            bytes(w.safe_wal_bytes),
            match (&w.holder, w.lease_left_s) {
                (Some(h), Some(left)) if left > 0.0 => format!(
                    "{h} on {} ({left:.1}s left)",
                    shown(w.holder_host.as_deref().unwrap_or(""), false)
                ),
                (Some(h), _) => format!("{h} EXPIRED"),
                _ => "none".into(),
            }
        );
        if !w.present {
            say!("    MISSING: the slot is gone (dropped, or not on this server after a failover): run polling relays, then create the slot again (docs/wal-relay.md, Failover)");
        } else if matches!(w.wal_status.as_deref(), Some("unreserved" | "lost")) {
            say!("    AT RISK: the slot keeps more WAL than max_slot_wal_keep_size allows (wal_status {}); it is invalidated at a checkpoint unless its relay catches up", w.wal_status.as_deref().unwrap_or(""));
        }
    }
    for d in &status.dead_letters {
        say!(
            "dead letters of {}: {} ({} not yet published to the DLQ, {} not replayed)",
            shown(&d.consumer_name, false),
            d.total,
            d.unpublished,
            d.not_replayed
        );
    }
    for h in &status.dedup_horizons {
        say!(
            "dedup horizon of {}: {} (rows processed up to then were deleted; resets to older records are refused)",
            shown(&h.consumer_name, false), h.horizon.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        );
    }
    Ok(())
}

/// High watermarks of the given partitions; `None` where the broker did not answer in time.
fn high_watermarks(bootstrap: &str, wanted: &[(String, i32)]) -> Vec<Option<i64>> {
    use rdkafka::consumer::Consumer;
    let client: Result<crate::kafka_client::Consumer, _> = crate::kafka_client::config(bootstrap)
        .set("log_level", "0")
        .create_with_context(crate::kafka_client::Capture::default());
    let Ok(client) = client else {
        return vec![None; wanted.len()];
    };
    let mut out = Vec::with_capacity(wanted.len());
    for (t, p) in wanted {
        match client.fetch_watermarks(t, *p, std::time::Duration::from_secs(3)) {
            Ok((_, high)) => out.push(Some(high)),
            // Unreachable broker: no lag figures at all rather than a slow command.
            Err(_) => return vec![None; wanted.len()],
        }
    }
    out
}
