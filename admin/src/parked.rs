//! Parked events: the outbox rows the relay gave up on (`status = 'failed'`). Each holds back
//! the later events of its key until it is requeued or discarded.
//!
//! A parked row's `available_at` is when it was parked. Times are read clamped to the years
//! 1–262,000: a row written around `postal.enqueue` may hold `'infinity'`, which the time type
//! cannot (`hostile_sizes::`, `hostile_cli::`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::audit::{self, Operator};
use crate::Error;

/// Which parked events: every field set must match (none set: all of them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Filter {
    /// This event.
    pub event_id: Option<Uuid>,
    /// This topic.
    pub topic: Option<String>,
    /// This key.
    pub key: Option<String>,
    /// This event type.
    pub event_type: Option<String>,
    /// Whose last error contains this text (case-insensitive).
    pub reason: Option<String>,
    /// Parked at or after.
    pub since: Option<DateTime<Utc>>,
    /// Parked before.
    pub until: Option<DateTime<Utc>>,
}

impl Filter {
    /// This event.
    pub fn event_id(mut self, id: Uuid) -> Self {
        self.event_id = Some(id);
        self
    }

    /// This topic.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// This key.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// This event type.
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// Whose last error contains this text (case-insensitive).
    pub fn reason(mut self, text: impl Into<String>) -> Self {
        self.reason = Some(text.into());
        self
    }

    /// Parked at or after `since` and before `until`.
    pub fn parked_between(
        mut self,
        since: Option<DateTime<Utc>>,
        until: Option<DateTime<Utc>>,
    ) -> Self {
        self.since = since;
        self.until = until;
        self
    }

    /// True when no field is set.
    pub fn is_empty(&self) -> bool {
        *self == Filter::default()
    }
}

/// What an action acts on (recorded in the audit trail as `{"ids": [..]}` or
/// `{"filter": {..}}`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Selection {
    /// These events (those of them still parked).
    Ids(Vec<Uuid>),
    /// Every event the filter matches when the action starts.
    Filter(Filter),
}

/// The filter as SQL, its binds `$1`..`$7` (`status = 'failed'` first: every query of this
/// module reads only the partial indexes on parked rows).
pub(crate) const WHERE: &str = "status = 'failed'
    AND ($1::uuid IS NULL OR event_id = $1)
    AND ($2::text IS NULL OR topic = $2)
    AND ($3::text IS NULL OR event_key = $3)
    AND ($4::text IS NULL OR event_type = $4)
    AND ($5::text IS NULL OR strpos(lower(coalesce(last_error, '')), lower($5)) > 0)
    AND ($6::timestamptz IS NULL OR available_at >= $6)
    AND ($7::timestamptz IS NULL OR available_at < $7)";

/// The error's fingerprint: its first 160 characters with ids and numbers replaced by `#`, so
/// that the same failure of different events groups together.
pub const FINGERPRINT_SQL: &str = "regexp_replace(left(coalesce(last_error, '-'), 160), \
     '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}|[0-9]+', '#', 'g')";

pub(crate) fn bind<'q, O>(
    q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    f: &'q Filter,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    q.bind(f.event_id)
        .bind(f.topic.as_deref())
        .bind(f.key.as_deref())
        .bind(f.event_type.as_deref())
        .bind(f.reason.as_deref())
        .bind(f.since)
        .bind(f.until)
}

/// One parked event, as listed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Parked {
    /// Outbox sequence (order of enqueue).
    pub seq: i64,
    /// Event id.
    pub event_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Key.
    pub event_key: String,
    /// Type.
    pub event_type: String,
    /// Attempts used.
    pub attempts: i32,
    /// Why it was parked.
    pub last_error: Option<String>,
    /// When it was parked.
    pub parked_at: DateTime<Utc>,
}

/// Parked events the filter matches, oldest first (at most `limit`).
pub async fn search(pool: &PgPool, filter: &Filter, limit: i64) -> Result<Vec<Parked>, Error> {
    let sql = format!(
        "SELECT seq, event_id, topic, event_key, event_type, attempts, last_error,
                least(greatest(available_at, '0001-01-01 00:00:00+00'), '262000-01-01') AS parked_at
         FROM postal.outbox WHERE {WHERE} ORDER BY seq LIMIT $8"
    );
    Ok(bind(sqlx::query_as(&sql), filter)
        .bind(limit)
        .fetch_all(pool)
        .await?)
}

/// The parked events among `seqs` (sequence numbers from [`matched`]), as listed, in outbox
/// order.
pub async fn by_seqs(pool: &PgPool, seqs: &[i64]) -> Result<Vec<Parked>, Error> {
    Ok(sqlx::query_as(
        "SELECT seq, event_id, topic, event_key, event_type, attempts, last_error,
                least(greatest(available_at, '0001-01-01 00:00:00+00'), '262000-01-01') AS parked_at
         FROM postal.outbox WHERE status = 'failed' AND seq = ANY($1) ORDER BY seq",
    )
    .bind(seqs)
    .fetch_all(pool)
    .await?)
}

/// Parked events that failed the same way.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Group {
    /// The error with ids and numbers replaced by `#`.
    pub fingerprint: String,
    /// How many.
    pub events: i64,
    /// On how many topics.
    pub topics: i64,
    /// One of their errors, whole.
    pub example: Option<String>,
    /// The latest parked.
    pub last_parked_at: DateTime<Utc>,
}

/// The filter's parked events grouped by error fingerprint: the largest groups, and how many
/// events match in all.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct Groups {
    /// The largest groups first, at most the limit asked for.
    pub groups: Vec<Group>,
    /// Parked events the filter matches, in every group.
    pub total: i64,
}

#[derive(sqlx::FromRow)]
struct GroupRow {
    #[sqlx(flatten)]
    group: Group,
    total: i64,
}

/// The filter's parked events grouped by error fingerprint, largest group first (at most
/// `limit` groups), with the number they add up to — in one pass over the matching rows.
pub async fn groups(pool: &PgPool, filter: &Filter, limit: i64) -> Result<Groups, Error> {
    // Grouped by (fingerprint, topic) first and then by fingerprint: two hash aggregates, where
    // counting distinct topics at once would sort every row by its error text. The total is a
    // window over every group, taken before the limit.
    let sql = format!(
        "SELECT fingerprint, sum(n)::int8 AS events, count(*) AS topics, min(example) AS example,
                max(last_parked_at) AS last_parked_at, (sum(sum(n)) OVER ())::int8 AS total
         FROM (SELECT {FINGERPRINT_SQL} AS fingerprint, topic, count(*) AS n,
                      min(last_error) AS example, max(least(greatest(available_at, '0001-01-01 00:00:00+00'), '262000-01-01')) AS last_parked_at
               FROM postal.outbox WHERE {WHERE} GROUP BY 1, 2) AS g
         GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT $8"
    );
    let rows: Vec<GroupRow> = bind(sqlx::query_as(&sql), filter)
        .bind(limit)
        .fetch_all(pool)
        .await?;
    Ok(Groups {
        total: rows.first().map_or(0, |r| r.total),
        groups: rows.into_iter().map(|r| r.group).collect(),
    })
}

/// One outbox event, whole (any status).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Event {
    /// Outbox sequence.
    pub seq: i64,
    /// Event id.
    pub event_id: Uuid,
    /// `pending`, `published` or `failed` (parked).
    pub status: String,
    /// Topic.
    pub topic: String,
    /// Key.
    pub event_key: String,
    /// Type.
    pub event_type: String,
    /// Schema version.
    pub schema_version: i32,
    /// Content type.
    pub content_type: String,
    /// Headers.
    pub headers: serde_json::Value,
    /// Attempts used.
    pub attempts: i32,
    /// The last error.
    pub last_error: Option<String>,
    /// Enqueued at.
    pub created_at: DateTime<Utc>,
    /// Published, parked, or next due at (by status).
    pub available_at: DateTime<Utc>,
    /// The payload's size in bytes.
    pub payload_bytes: i32,
    /// The payload's first `payload_cap` bytes.
    pub payload: Vec<u8>,
}

/// The outbox event `id` (payload cut at `payload_cap` bytes), if the outbox still has it.
pub async fn show(pool: &PgPool, id: Uuid, payload_cap: i32) -> Result<Option<Event>, Error> {
    Ok(sqlx::query_as(
        "SELECT seq, event_id, status, topic, event_key, event_type, schema_version,
                content_type, headers, attempts, last_error,
                least(greatest(created_at, '0001-01-01 00:00:00+00'), '262000-01-01') AS created_at,
                least(greatest(available_at, '0001-01-01 00:00:00+00'), '262000-01-01') AS available_at,
                octet_length(payload) AS payload_bytes, substring(payload FROM 1 FOR $2) AS payload
         FROM postal.outbox WHERE event_id = $1",
    )
    .bind(id)
    .bind(payload_cap)
    .fetch_optional(pool)
    .await?)
}

/// The parked events `selection` matches now, by sequence number in outbox order: an action
/// acts on these only (still parked when their turn comes), never on events parked while it
/// runs. More than `cap`: refused.
pub async fn matched(
    pool: &PgPool,
    selection: &Selection,
    cap: Option<usize>,
) -> Result<Vec<i64>, Error> {
    let seqs: Vec<i64> = match selection {
        Selection::Ids(ids) => {
            sqlx::query_scalar(
                "SELECT seq FROM postal.outbox WHERE status = 'failed' AND event_id = ANY($1)
                 ORDER BY seq",
            )
            .bind(ids)
            .fetch_all(pool)
            .await?
        }
        Selection::Filter(f) => {
            let sql = format!("SELECT seq FROM postal.outbox WHERE {WHERE} ORDER BY seq");
            let rows: Vec<(i64,)> = bind(sqlx::query_as(&sql), f).fetch_all(pool).await?;
            rows.into_iter().map(|(s,)| s).collect()
        }
    };
    if let Some(cap) = cap {
        if seqs.len() > cap {
            return Err(Error::OverCap {
                matched: seqs.len(),
                cap,
            });
        }
    }
    Ok(seqs)
}

async fn notify(pool: &PgPool) -> Result<(), Error> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(postal_producer::NOTIFY_CHANNEL)
        .execute(pool)
        .await?;
    Ok(())
}

/// Makes parked events pending again (attempts reset, event ids unchanged, the previous error
/// kept in `last_error`): the relay publishes them in their original order, each ahead of the
/// later events of its key. Recorded in the audit trail as `requeue` by `by`, with the
/// selection as its target. Returns how many were requeued.
pub async fn requeue(
    pool: &PgPool,
    by: &Operator,
    selection: &Selection,
    cap: Option<usize>,
) -> Result<u64, Error> {
    let seqs = matched(pool, selection, cap).await?;
    let target = serde_json::to_value(selection).unwrap_or_default();
    requeue_seqs(pool, by, &target, &seqs, |_| {}).await
}

/// [`requeue`] of the matched `seqs`, recorded as `requeue` by `by` on `target` (what the
/// operator gave: ids or a filter), calling `progress` with the running total.
pub async fn requeue_seqs(
    pool: &PgPool,
    by: &Operator,
    target: &serde_json::Value,
    seqs: &[i64],
    progress: impl FnMut(u64),
) -> Result<u64, Error> {
    let recording = audit::open(pool, by, "requeue", target, seqs.len()).await?;
    let outcome = requeue_recorded(pool, &recording, seqs, progress).await;
    recording.end(pool, outcome).await
}

async fn requeue_recorded(
    pool: &PgPool,
    recording: &audit::Recording,
    seqs: &[i64],
    mut progress: impl FnMut(u64),
) -> Result<u64, Error> {
    let mut done = 0u64;
    for chunk in seqs.chunks(1000) {
        let mut tx = postal_shared::cancel_safe::begin(pool).await?;
        let n = sqlx::query(
            // Pending again as a retry that is due now: `held` keeps it ahead of its key's
            // later events even for a claim whose transaction began before this one (to which
            // `now()` here is in the future, so the row is not due yet: without `held` that
            // claim would take the key's next events alone).
            "UPDATE postal.outbox o
                SET status = 'pending', attempts = 0, held = true,
                    available_at = now(),
                    last_error = 'requeued by operator; previous error: ' || coalesce(o.last_error, '-')
              WHERE o.status = 'failed' AND o.seq = ANY($1)",
        )
        .bind(chunk)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        recording.add(&mut tx, n, None).await?;
        tx.commit().await?;
        done += n;
        progress(done);
    }
    notify(pool).await?;
    Ok(done)
}

/// A discarded event: everything needed to enqueue it again.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Discarded {
    /// Event id.
    pub event_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Key.
    pub event_key: String,
    /// Type.
    pub event_type: String,
    /// Schema version.
    pub schema_version: i32,
    /// When it occurred.
    pub occurred_at: DateTime<Utc>,
    /// Content type.
    pub content_type: String,
    /// Headers.
    pub headers: serde_json::Value,
    /// Attempts used.
    pub attempts: i32,
    /// Why it was parked.
    pub last_error: Option<String>,
    /// The payload as text when it is UTF-8 without NUL (JSON payloads are).
    #[sqlx(skip)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    /// The payload in base64 when it is not UTF-8, or holds NUL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_base64: Option<String>,
}

/// A discarded event as a discard reports it: which, and how big. The event itself, whole, is
/// in the audit trail (`postal.operator_audit_events`, [`crate::audit::removed_event`]); it
/// never goes through the process that discarded it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct DiscardedRef {
    /// The audit row that keeps it (`postal audit show <id>`).
    pub audit_id: i64,
    /// Event id.
    pub event_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Key.
    pub event_key: String,
    /// Type.
    pub event_type: String,
    /// The payload's size in bytes.
    pub payload_bytes: i64,
}

/// How big one batch of a discard may be: at most `rows` events and at most `bytes` bytes of
/// them (payload, headers and texts), except that a batch always takes one event however
/// large (an event is moved by one statement inside the database, never through the client).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiscardBatch {
    /// At most this many events.
    pub rows: usize,
    /// At most this many bytes of events (the first event of a batch excepted).
    pub bytes: u64,
}

impl Default for DiscardBatch {
    /// 1,000 events, 64 MiB.
    fn default() -> Self {
        Self {
            rows: 1000,
            bytes: 64 << 20,
        }
    }
}

/// Deletes the matched parked events for good, so that the later events of their keys flow.
/// A row another transaction holds (a requeue of it in progress) is skipped, never waited for:
/// waiting would leave it locked by this discard, and the relay's claim skips locked rows.
/// Recorded as `discard` by `by` on `target` (what the operator gave: ids or a filter); each
/// batch's events are moved whole, inside the database, to `postal.operator_audit_events`
/// (one row each, referencing the audit row) by the statement that deletes them, and counted
/// in the audit row in the same transaction. Batches of [`DiscardBatch::default`]. Each
/// batch's [`DiscardedRef`]s are handed to `keep` before its deletion commits (an error from
/// `keep` stops the action with that batch not deleted). Returns how many were discarded.
pub async fn discard_seqs(
    pool: &PgPool,
    by: &Operator,
    target: &serde_json::Value,
    seqs: &[i64],
    keep: impl FnMut(Vec<DiscardedRef>) -> Result<(), Error>,
) -> Result<u64, Error> {
    discard_seqs_in(pool, by, target, seqs, DiscardBatch::default(), keep).await
}

/// [`discard_seqs`] in batches of at most `batch`.
pub async fn discard_seqs_in(
    pool: &PgPool,
    by: &Operator,
    target: &serde_json::Value,
    seqs: &[i64],
    batch: DiscardBatch,
    keep: impl FnMut(Vec<DiscardedRef>) -> Result<(), Error>,
) -> Result<u64, Error> {
    let recording = audit::open(pool, by, "discard", target, seqs.len()).await?;
    let outcome = discard_recorded(pool, &recording, seqs, batch, keep).await;
    recording.end(pool, outcome).await
}

/// [`discard_seqs_in`] under its audit row `recording`.
async fn discard_recorded(
    pool: &PgPool,
    recording: &audit::Recording,
    seqs: &[i64],
    batch: DiscardBatch,
    mut keep: impl FnMut(Vec<DiscardedRef>) -> Result<(), Error>,
) -> Result<u64, Error> {
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let rows = batch.rows.max(1);
    let mut done = 0u64;
    let mut pos = 0;
    while pos < sorted.len() {
        let chunk = &sorted[pos..(pos + rows).min(sorted.len())];
        let mut tx = postal_shared::cancel_safe::begin(pool).await?;
        // Sizes only: octet_length of a payload reads its stored length, not the payload.
        let locked: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT seq, (octet_length(payload) + octet_length(headers::text)
                      + octet_length(topic) + octet_length(event_key)
                      + octet_length(event_type) + coalesce(octet_length(last_error), 0))::int8
         FROM postal.outbox WHERE status = 'failed' AND seq = ANY($1)
         ORDER BY seq FOR UPDATE SKIP LOCKED",
        )
        .bind(chunk)
        .fetch_all(&mut *tx)
        .await?;
        let mut picked = Vec::with_capacity(locked.len());
        let mut bytes = 0u64;
        for &(seq, size) in &locked {
            let size = size.max(0) as u64;
            if !picked.is_empty() && bytes.saturating_add(size) > batch.bytes {
                break;
            }
            bytes = bytes.saturating_add(size);
            picked.push(seq);
        }
        // The next batch starts at the first locked row this one left out, else after the chunk.
        let next = match locked.get(picked.len()) {
            Some(&(left, _)) => sorted.partition_point(|&s| s < left),
            None => pos + chunk.len(),
        };
        if picked.is_empty() {
            // Nothing of this chunk is still parked and free: an empty batch, handed to
            // `keep` like any other.
            keep(Vec::new())?;
            tx.rollback().await?;
            pos = next;
            continue;
        }
        let moved: Vec<DiscardedRef> = sqlx::query_as(
            "WITH d AS (
             DELETE FROM postal.outbox WHERE status = 'failed' AND seq = ANY($2)
             RETURNING seq, event_id, topic, event_key, event_type, schema_version,
                       occurred_at, content_type, headers, attempts, last_error, payload)
         INSERT INTO postal.operator_audit_events
             (audit_id, seq, event_id, topic, event_key, event_type, schema_version,
              occurred_at, content_type, headers, attempts, last_error, payload)
         SELECT $1, seq, event_id, topic, event_key, event_type, schema_version,
                occurred_at, content_type, headers, attempts, last_error, payload
         FROM d ORDER BY seq
         RETURNING audit_id, event_id, topic, event_key, event_type,
                   octet_length(payload)::int8 AS payload_bytes",
        )
        .bind(recording.id())
        .bind(&picked)
        .fetch_all(&mut *tx)
        .await?;
        let n = moved.len() as u64;
        recording.add(&mut tx, n, None).await?;
        keep(moved)?;
        tx.commit().await?;
        done += n;
        pos = next;
    }
    notify(pool).await?;
    Ok(done)
}

/// A key held back by a parked event: its first parked event (the head) and how many of its
/// later events wait behind it. A key's scope is its topic and key: a parked event holds back
/// its key's later events on its own topic, not on others.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct BlockedKey {
    /// The key's topic.
    pub topic: String,
    /// Key.
    pub event_key: String,
    /// The head: the key's earliest parked event.
    pub head_event_id: Uuid,
    /// The head's error.
    pub head_error: Option<String>,
    /// When the head was parked.
    pub parked_at: DateTime<Utc>,
    /// The key's parked events (the head included).
    pub parked: i64,
    /// The key's later events on its topic that are pending, held back by the head.
    pub waiting: i64,
}

// One pass over the parked and pending rows (each through its partial index), grouped by key
// in a hash: joins between them were planned from poor estimates (nested loops over thousands
// of keys). Then the head row by its primary key.
pub(crate) const BLOCKED_SQL: &str = "WITH r AS (
             SELECT topic, event_key, seq, true AS parked
             FROM postal.outbox WHERE status = 'failed'
             UNION ALL
             SELECT topic, event_key, seq, false
             FROM postal.outbox WHERE status = 'pending'),
         k AS (
             SELECT topic, event_key, min(seq) FILTER (WHERE parked) AS head_seq,
                    count(*) FILTER (WHERE parked) AS parked,
                    array_agg(seq) FILTER (WHERE NOT parked) AS pending
             FROM r GROUP BY 1, 2 HAVING bool_or(parked)),
         w AS (
             SELECT event_key, head_seq, parked,
                    (SELECT count(*) FROM unnest(pending) AS s WHERE s > head_seq) AS waiting
             FROM k ORDER BY 4 DESC, head_seq LIMIT $1)
         SELECT o.topic, w.event_key, o.event_id AS head_event_id, o.last_error AS head_error,
                least(greatest(o.available_at, '0001-01-01 00:00:00+00'), '262000-01-01') AS parked_at, w.parked, w.waiting
         FROM w JOIN postal.outbox o ON o.seq = w.head_seq
         ORDER BY w.waiting DESC, w.head_seq";

/// Keys held back by a parked event, most events waiting first (at most `limit`). Reads the
/// parked rows and the pending rows through their partial indexes, never the published ones.
pub async fn blocked_keys(pool: &PgPool, limit: i64) -> Result<Vec<BlockedKey>, Error> {
    Ok(sqlx::query_as(BLOCKED_SQL)
        .bind(limit)
        .fetch_all(pool)
        .await?)
}

/// Releases the key held by the parked event `head`: requeues all the key's parked events on
/// the head's topic (the head first, in their original order), after which the relay publishes
/// the head, then the events that waited behind it. Returns how many were requeued; 0 if `head`
/// is no longer parked. Recorded as `release-key` by `by`.
pub async fn release_key(
    pool: &PgPool,
    by: &Operator,
    head: Uuid,
    cap: Option<usize>,
) -> Result<u64, Error> {
    let seqs = key_of_head(pool, head, cap)
        .await?
        .map(|(_, seqs)| seqs)
        .unwrap_or_default();
    release_seqs(pool, by, &serde_json::json!({ "head": head }), &seqs).await
}

/// [`release_key`] of the key's parked events `seqs` (from [`key_of_head`]), recorded as
/// `release-key` by `by` on `target`.
pub async fn release_seqs(
    pool: &PgPool,
    by: &Operator,
    target: &serde_json::Value,
    seqs: &[i64],
) -> Result<u64, Error> {
    let recording = audit::open(pool, by, "release-key", target, seqs.len()).await?;
    let outcome = requeue_recorded(pool, &recording, seqs, |_| {}).await;
    recording.end(pool, outcome).await
}

/// The key of the parked event `head` and the key's parked events on its topic, in outbox
/// order (`None` if `head` is not parked); more than `cap`: refused.
pub async fn key_of_head(
    pool: &PgPool,
    head: Uuid,
    cap: Option<usize>,
) -> Result<Option<(String, Vec<i64>)>, Error> {
    let found: Option<(String, String)> = sqlx::query_as(
        "SELECT topic, event_key FROM postal.outbox WHERE event_id = $1 AND status = 'failed'",
    )
    .bind(head)
    .fetch_optional(pool)
    .await?;
    let Some((topic, key)) = found else {
        return Ok(None);
    };
    let seqs = matched(
        pool,
        &Selection::Filter(Filter::default().topic(topic).key(key.clone())),
        cap,
    )
    .await?;
    Ok(Some((key, seqs)))
}
