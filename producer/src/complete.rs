//! Recording the outcome of a published batch on its claim's transaction.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::transport::OutboundEvent;

/// What happens to a row whose publish failed.
#[derive(Clone, Debug)]
pub struct Failure {
    /// Outbox sequence number.
    pub seq: i64,
    /// Whether the failure uses up an attempt.
    pub counts: bool,
    /// Park now (permanent failure or attempts exhausted).
    pub park: bool,
    /// Whether the row holds back later events of its key meanwhile.
    pub hold: bool,
    /// When to retry, from now.
    pub retry_in: Duration,
    /// Recorded as `last_error` (kept unchanged when `None`).
    pub reason: Option<String>,
}

/// Keep-published mode, in one statement on the claim's transaction: marks the acknowledged
/// rows published and reschedules or parks the failed ones. Failed rows hold back later events
/// of their key. (In delete-on-claim mode the rows are already gone; see [`restore`].)
pub(crate) async fn mark(
    conn: &mut PgConnection,
    published: &[i64],
    failures: &[Failure],
) -> Result<(), sqlx::Error> {
    let seqs: Vec<i64> = failures.iter().map(|f| f.seq).collect();
    let incs: Vec<i32> = failures.iter().map(|f| i32::from(f.counts)).collect();
    let delays: Vec<i64> = failures
        .iter()
        .map(|f| f.retry_in.as_millis() as i64)
        .collect();
    let parks: Vec<bool> = failures.iter().map(|f| f.park).collect();
    let reasons: Vec<Option<&str>> = failures.iter().map(|f| f.reason.as_deref()).collect();
    let holds: Vec<bool> = failures.iter().map(|f| f.hold).collect();
    let sql = r#"
        WITH done AS (
            UPDATE postal.outbox
            SET status = 'published', published_at = statement_timestamp(), held = false
            WHERE seq = ANY($1) AND status = 'pending'
            RETURNING 1
        ), failed AS (
            UPDATE postal.outbox o
            SET attempts = least(o.attempts::int8 + u.inc, 2147483647)::int4,
                status = CASE WHEN u.park THEN 'failed' ELSE 'pending' END,
                available_at = now() + u.delay_ms * interval '1 millisecond',
                held = u.hold,
                last_error = coalesce(u.reason, o.last_error)
            FROM unnest($2::int8[], $3::int4[], $4::int8[], $5::bool[], $6::text[], $7::bool[])
                 AS u(seq, inc, delay_ms, park, reason, hold)
            WHERE o.seq = u.seq AND o.status = 'pending'
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM done) + (SELECT count(*) FROM failed)
        "#;
    let _: Option<i64> = sqlx::query_scalar(sql)
        .bind(published)
        .bind(&seqs)
        .bind(&incs)
        .bind(&delays)
        .bind(&parks)
        .bind(&reasons)
        .bind(&holds)
        .fetch_one(conn)
        .await?;
    Ok(())
}

/// Delete-on-claim mode: writes failed rows back (same sequence number and id), rescheduled or
/// parked, in the claim's transaction. `kept` is per row of `batch`, in batch order.
pub(crate) async fn restore(
    conn: &mut PgConnection,
    batch: &[OutboundEvent],
    kept: Vec<(DateTime<Utc>, Option<&str>, Option<&str>)>,
    failures: &[Failure],
) -> Result<(), sqlx::Error> {
    let by_seq: std::collections::HashMap<i64, (usize, &OutboundEvent)> = batch
        .iter()
        .enumerate()
        .map(|(i, e)| (e.seq, (i, e)))
        .collect();
    let n = failures.len();
    let mut cols = EventColumns::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut park = Vec::with_capacity(n);
    let mut delay = Vec::with_capacity(n);
    let mut hold = Vec::with_capacity(n);
    let mut err: Vec<Option<&str>> = Vec::with_capacity(n);
    let mut created = Vec::with_capacity(n);
    let mut raw: Vec<Option<&str>> = Vec::with_capacity(n);
    for f in failures {
        let Some((i, e)) = by_seq.get(&f.seq) else {
            continue;
        };
        cols.push(e);
        attempts.push(e.attempts.saturating_add(i32::from(f.counts)));
        park.push(f.park);
        delay.push(f.retry_in.as_millis() as i64);
        hold.push(f.hold);
        err.push(f.reason.as_deref().or(kept[*i].1));
        created.push(kept[*i].0);
        raw.push(kept[*i].2);
    }
    cols.bind(sqlx::query(
        r#"
        INSERT INTO postal.outbox (seq, event_id, topic, event_key, event_type, schema_version,
                                   occurred_at, content_type, payload, headers, attempts, status,
                                   available_at, held, last_error, created_at)
        OVERRIDING SYSTEM VALUE
        SELECT u.seq, u.id, u.topic, u.k, u.typ, u.ver, u.occ, u.ct, u.payload, u.hdr, u.attempts,
               CASE WHEN u.park THEN 'failed' ELSE 'pending' END,
               now() + u.delay_ms * interval '1 millisecond', u.hold, u.err, u.created
        FROM (SELECT u.seq, u.id, u.topic, u.k, u.typ, u.ver,
                     coalesce(split_part(u.raw, '|', 1)::timestamptz, u.occ) AS occ,
                     u.ct, u.payload, u.hdr, u.attempts, u.park, u.delay_ms, u.hold, u.err,
                     coalesce(split_part(u.raw, '|', 2)::timestamptz, u.created) AS created
              FROM unnest($1::int8[], $2::uuid[], $3::text[], $4::text[], $5::text[],
                          $6::int4[], $7::timestamptz[], $8::text[], $9::bytea[], $10::jsonb[],
                          $11::int4[], $12::bool[], $13::int8[], $14::bool[], $15::text[],
                          $16::timestamptz[], $17::text[])
                   AS u(seq, id, topic, k, typ, ver, occ, ct, payload, hdr, attempts, park,
                        delay_ms, hold, err, created, raw)) u
        "#,
    ))
    .bind(&attempts)
    .bind(&park)
    .bind(&delay)
    .bind(&hold)
    .bind(&err)
    .bind(&created)
    .bind(&raw)
    .execute(conn)
    .await?;
    Ok(())
}

/// History mode: writes the acknowledged rows of `batch` (deleted at claim time) into
/// `postal.outbox_history`, in the claim's transaction, with `published_at` the time of this statement (after the
/// acknowledgement; `now()` would be the claim's start, which can precede the event's
/// `created_at` when the enqueueing transaction began after the claim's `BEGIN`).
/// `kept` is per row of `batch`, in batch order.
pub(crate) async fn archive(
    conn: &mut PgConnection,
    batch: &[OutboundEvent],
    kept: Vec<(DateTime<Utc>, Option<&str>, Option<&str>)>,
    published: &[i64],
) -> Result<(), sqlx::Error> {
    let published: std::collections::HashSet<i64> = published.iter().copied().collect();
    let rows: Vec<(&OutboundEvent, DateTime<Utc>)> = batch
        .iter()
        .zip(kept)
        .filter(|(e, _)| published.contains(&e.seq))
        .map(|(e, k)| (e, k.0))
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    let mut cols = EventColumns::with_capacity(rows.len());
    for (e, _) in &rows {
        cols.push(e);
    }
    let attempts: Vec<i32> = rows.iter().map(|(e, _)| e.attempts).collect();
    let created: Vec<DateTime<Utc>> = rows.iter().map(|(_, c)| *c).collect();
    cols.bind(sqlx::query(
        r#"
        INSERT INTO postal.outbox_history (seq, event_id, topic, event_key, event_type,
                                           schema_version, occurred_at, content_type, payload,
                                           headers, attempts, created_at, published_at)
        SELECT u.seq, u.id, u.topic, u.k, u.typ, u.ver, u.occ, u.ct, u.payload, u.hdr,
               u.attempts, u.created, statement_timestamp()
        FROM unnest($1::int8[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::int4[],
                    $7::timestamptz[], $8::text[], $9::bytea[], $10::jsonb[], $11::int4[],
                    $12::timestamptz[])
             AS u(seq, id, topic, k, typ, ver, occ, ct, payload, hdr, attempts, created)
        "#,
    ))
    .bind(&attempts)
    .bind(&created)
    .execute(conn)
    .await?;
    Ok(())
}

/// An event's stored columns, one array per column, for the `unnest($1 … $10)` inserts that
/// write rows back to the outbox or into its history.
struct EventColumns<'a> {
    seq: Vec<i64>,
    id: Vec<uuid::Uuid>,
    topic: Vec<&'a str>,
    key: Vec<&'a str>,
    event_type: Vec<&'a str>,
    schema_version: Vec<i32>,
    occurred_at: Vec<DateTime<Utc>>,
    content_type: Vec<&'a str>,
    payload: Vec<&'a [u8]>,
    headers: Vec<serde_json::Value>,
}

impl<'a> EventColumns<'a> {
    fn with_capacity(n: usize) -> Self {
        EventColumns {
            seq: Vec::with_capacity(n),
            id: Vec::with_capacity(n),
            topic: Vec::with_capacity(n),
            key: Vec::with_capacity(n),
            event_type: Vec::with_capacity(n),
            schema_version: Vec::with_capacity(n),
            occurred_at: Vec::with_capacity(n),
            content_type: Vec::with_capacity(n),
            payload: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
        }
    }

    fn push(&mut self, e: &'a OutboundEvent) {
        self.seq.push(e.seq);
        self.id.push(e.id.as_uuid());
        self.topic.push(&e.topic);
        self.key.push(&e.key);
        self.event_type.push(&e.event_type);
        self.schema_version.push(e.schema_version);
        self.occurred_at.push(e.occurred_at);
        self.content_type.push(&e.content_type);
        self.payload.push(&e.payload);
        self.headers.push(headers_json(e));
    }

    /// Binds the columns as `$1` … `$10`, in the order above.
    fn bind(
        self,
        query: sqlx::query::Query<'a, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'a, sqlx::Postgres, sqlx::postgres::PgArguments> {
        query
            .bind(self.seq)
            .bind(self.id)
            .bind(self.topic)
            .bind(self.key)
            .bind(self.event_type)
            .bind(self.schema_version)
            .bind(self.occurred_at)
            .bind(self.content_type)
            .bind(self.payload)
            .bind(self.headers)
    }
}

/// An event's user headers as the JSON object the outbox stores: as they were stored, also a
/// value that was not a string (the claim passed it on under a marked name, to park the row).
fn headers_json(e: &OutboundEvent) -> serde_json::Value {
    serde_json::Value::Object(
        e.headers
            .iter()
            .map(|(k, v)| match k.strip_prefix('\0') {
                Some(name) => (
                    name.to_owned(),
                    serde_json::from_str(v)
                        .unwrap_or_else(|_| serde_json::Value::String(v.clone())),
                ),
                None => (k.clone(), serde_json::Value::String(v.clone())),
            })
            .collect(),
    )
}
