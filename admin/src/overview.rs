//! The state of the system at a glance: backlog per topic, relays and their leases, consumers
//! and their offsets, open dead letters, and the last hour per minute.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::Error;

/// One topic's backlog.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Backlog {
    /// Topic (or RabbitMQ exchange, or task queue).
    pub topic: String,
    /// Pending events that are due.
    pub pending: i64,
    /// Events scheduled for later delivery.
    pub scheduled: i64,
    /// Parked events.
    pub failed: i64,
    /// Age of the oldest due event, in seconds.
    pub oldest_pending_age_s: Option<f64>,
}

/// Pending events of one topic that wait behind a parked event of their key.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct BehindParked {
    /// Topic.
    pub topic: String,
    /// Keys whose earliest parked event holds later pending ones back.
    pub keys: i64,
    /// Pending events held back.
    pub waiting: i64,
}

/// The held keys of one consumer group (`FinalFailure::HoldKey`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct HeldGroup {
    /// Group.
    pub group_id: String,
    /// Held keys.
    pub keys: i64,
    /// Records stored behind them (the heads included), not applied until released.
    pub records: i64,
    /// Their bytes, as counted against the group's bound.
    pub bytes: i64,
}

/// One relay.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Relay {
    /// Its id.
    pub relay_id: uuid::Uuid,
    /// Its group.
    pub relay_group: String,
    /// Its host.
    pub host: String,
    /// Seconds since its last heartbeat.
    pub heartbeat_age_s: f64,
    /// Key partitions it holds a live lease on (of 256).
    pub partitions: i64,
}

/// One consumer group's partition.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct ConsumerPartition {
    /// Group.
    pub group_id: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The next offset it will consume (stored with its effects).
    pub next_offset: Option<i64>,
    /// Seconds since it last advanced.
    pub updated_age_s: f64,
    /// Records behind the broker's high watermark (when the dashboard can ask the broker).
    #[sqlx(default)]
    pub lag: Option<i64>,
}

/// One minute of the last hour, summed over the relays' reports (`postal.relay_minutes`) and
/// the consumers' dead letters.
#[derive(Debug, Clone, Default, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Minute {
    /// The minute.
    pub minute: DateTime<Utc>,
    /// Events recorded published.
    pub published: i64,
    /// Failed attempts rescheduled for a retry.
    pub retried: i64,
    /// Events parked.
    pub parked: i64,
    /// Dead letters recorded.
    pub dead_letters: i64,
    /// Average end-to-end lag of the published events (enqueue to the publish being
    /// recorded, after the destination's acknowledgement), in milliseconds.
    pub lag_ms: Option<f64>,
    /// The largest such lag, in milliseconds.
    pub lag_max_ms: Option<f64>,
}

/// Everything the overview shows.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Overview {
    /// Per topic.
    pub backlog: Vec<Backlog>,
    /// Live and recently seen relays.
    pub relays: Vec<Relay>,
    /// Consumer offsets.
    pub consumers: Vec<ConsumerPartition>,
    /// Open dead letters per consumer.
    pub dead_letters: Vec<(String, i64)>,
    /// The last 60 minutes, oldest first, every minute present.
    pub minutes: Vec<Minute>,
    /// The WAL relays' replication slots: lag, retained WAL, lease (none on a standby).
    pub wal_slots: Vec<postal_producer::wal::slot::SlotState>,
    /// Per topic, pending events waiting behind a parked event of their key.
    pub behind_parked: Vec<BehindParked>,
    /// Per consumer group, its held keys.
    pub held: Vec<HeldGroup>,
}

// As `crate::parked::BLOCKED_SQL`: one pass over the parked and the pending rows, each
// through its partial index, grouped by key in a hash.
const BEHIND_PARKED_SQL: &str = "WITH r AS (
             SELECT topic, event_key, seq, true AS parked
             FROM postal.outbox WHERE status = 'failed'
             UNION ALL
             SELECT topic, event_key, seq, false
             FROM postal.outbox WHERE status = 'pending'),
         k AS (
             SELECT topic, min(seq) FILTER (WHERE parked) AS head_seq,
                    array_agg(seq) FILTER (WHERE NOT parked) AS pending
             FROM r GROUP BY topic, event_key HAVING bool_or(parked)),
         w AS (
             SELECT topic, (SELECT count(*) FROM unnest(pending) AS s WHERE s > head_seq) AS waiting
             FROM k)
         SELECT topic, count(*) FILTER (WHERE waiting > 0)::int8 AS keys,
                sum(waiting)::int8 AS waiting
         FROM w GROUP BY topic HAVING sum(waiting) > 0 ORDER BY topic";

const HELD_SQL: &str = "SELECT k.group_id, count(*)::int8 AS keys,
                coalesce(sum(r.records), 0)::int8 AS records,
                coalesce(max(b.bytes), 0)::int8 AS bytes
         FROM postal.held_keys k
         LEFT JOIN LATERAL (
             SELECT count(*) AS records FROM postal.held_records r
             WHERE (r.group_id, r.topic, r.partition, r.key_hash, r.record_key)
                 = (k.group_id, k.topic, k.partition, k.key_hash, k.record_key)) r ON true
         LEFT JOIN postal.held_bytes b ON b.group_id = k.group_id
         GROUP BY k.group_id ORDER BY k.group_id";

const RELAYS_SQL: &str = "SELECT i.relay_id, i.relay_group, i.host,
                extract(epoch FROM now() - i.heartbeat_at)::float8 AS heartbeat_age_s,
                count(p.key_partition) FILTER (WHERE p.lease_until > now()) AS partitions
         FROM postal.relay_instances i
         LEFT JOIN postal.relay_partitions p
           ON p.owner = i.relay_id AND p.relay_group = i.relay_group
         GROUP BY 1, 2, 3, 4 ORDER BY 2, 1";

const CONSUMERS_SQL: &str = "SELECT group_id, topic, partition, next_offset,
                extract(epoch FROM now() - updated_at)::float8 AS updated_age_s
         FROM postal.consumer_offsets ORDER BY group_id, topic, partition";

const MINUTES_SQL: &str = "WITH m AS (
             SELECT generate_series(date_trunc('minute', now()) - interval '59 minutes',
                                    date_trunc('minute', now()), interval '1 minute') AS minute),
         relayed AS (
             SELECT minute, sum(published) AS published, sum(retried) AS retried,
                    sum(parked) AS parked,
                    sum(lag_ms_sum) / nullif(sum(lag_events), 0) AS lag_ms,
                    max(lag_ms_max) FILTER (WHERE lag_events > 0) AS lag_max_ms
             FROM postal.relay_minutes
             WHERE minute >= date_trunc('minute', now()) - interval '59 minutes'
             GROUP BY 1),
         dead AS (
             SELECT date_trunc('minute', created_at) AS minute, count(*) AS n
             FROM postal.dead_letters
             WHERE created_at >= date_trunc('minute', now()) - interval '59 minutes'
             GROUP BY 1)
         SELECT m.minute, coalesce(r.published, 0)::int8 AS published,
                coalesce(r.retried, 0)::int8 AS retried, coalesce(r.parked, 0)::int8 AS parked,
                coalesce(d.n, 0) AS dead_letters, r.lag_ms::float8 AS lag_ms,
                r.lag_max_ms::float8 AS lag_max_ms
         FROM m LEFT JOIN relayed r USING (minute) LEFT JOIN dead d USING (minute)
         ORDER BY m.minute";

/// The overview's queries without parameters, named (for [`crate::plans`]).
pub(crate) const SQL: &[(&str, &str)] = &[
    ("overview: relays", RELAYS_SQL),
    ("overview: consumers", CONSUMERS_SQL),
    ("overview: last hour per minute", MINUTES_SQL),
    (
        "overview: open dead letters per consumer",
        crate::dead_letters::OPEN_PER_CONSUMER_SQL,
    ),
    ("overview: pending behind parked", BEHIND_PARKED_SQL),
    ("overview: held keys per group", HELD_SQL),
];

/// Reads the overview (consumer lag left empty: see [`fill_lag`]).
pub async fn read(pool: &PgPool) -> Result<Overview, Error> {
    let backlog = sqlx::query_as(&postal_producer::backlog::summary_sql(true))
        .fetch_all(pool)
        .await?;
    let relays = sqlx::query_as(RELAYS_SQL).fetch_all(pool).await?;
    let consumers = sqlx::query_as(CONSUMERS_SQL).fetch_all(pool).await?;
    let dead_letters = crate::dead_letters::open_per_consumer(pool).await?;
    let minutes: Vec<Minute> = sqlx::query_as(MINUTES_SQL).fetch_all(pool).await?;
    let behind_parked = sqlx::query_as(BEHIND_PARKED_SQL).fetch_all(pool).await?;
    let held = sqlx::query_as(HELD_SQL).fetch_all(pool).await?;
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(pool)
        .await?;
    let wal_slots = if in_recovery {
        Vec::new()
    } else {
        postal_producer::wal::slot::states(pool).await?
    };
    Ok(Overview {
        behind_parked,
        held,
        wal_slots,
        backlog,
        relays,
        consumers,
        dead_letters,
        minutes,
    })
}

/// Fills in each consumer partition's lag from the broker's high watermarks, asking at most
/// for `budget` in all (partitions not asked in time keep `None`). Runs on a blocking thread.
pub async fn fill_lag<C: rdkafka::consumer::ConsumerContext + 'static>(
    overview: &mut Overview,
    client: std::sync::Arc<rdkafka::consumer::BaseConsumer<C>>,
    budget: std::time::Duration,
) {
    use rdkafka::consumer::Consumer as _;
    let wanted: Vec<(String, i32)> = overview
        .consumers
        .iter()
        .map(|c| (c.topic.clone(), c.partition))
        .collect();
    let highs = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + budget;
        wanted
            .iter()
            .map(|(t, p)| {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return None;
                }
                client
                    .fetch_watermarks(t, *p, left)
                    .ok()
                    .map(|(_, high)| high)
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    for (c, high) in overview.consumers.iter_mut().zip(highs) {
        c.lag = match (high, c.next_offset) {
            (Some(h), Some(n)) => Some((h - n).max(0)),
            (Some(h), None) => Some(h),
            _ => None,
        };
    }
}
