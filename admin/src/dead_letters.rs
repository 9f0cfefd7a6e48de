//! Consumer dead letters (`postal.dead_letters`): records a consumer gave up on. Open ones are
//! neither replayed nor resolved.

use std::time::Duration;

use chrono::{DateTime, Utc};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::audit::{self, Operator};
use crate::Error;

/// Which dead letters: every field set must match.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Filter {
    /// This consumer.
    pub consumer: Option<String>,
    /// From this topic.
    pub topic: Option<String>,
    /// This event.
    pub event_id: Option<Uuid>,
    /// This reason (`permanent`, `undecodable`, `missing_event_id`, `unknown_type`, `panic`,
    /// `retries_exhausted`).
    pub reason: Option<String>,
    /// Whose error contains this text (case-insensitive).
    pub error: Option<String>,
    /// Replayed and resolved ones too (else only open ones).
    #[serde(default)]
    pub all: bool,
}

impl Filter {
    /// This consumer.
    pub fn consumer(mut self, name: impl Into<String>) -> Self {
        self.consumer = Some(name.into());
        self
    }

    /// From this topic.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// This event.
    pub fn event_id(mut self, id: Uuid) -> Self {
        self.event_id = Some(id);
        self
    }

    /// This reason.
    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// Whose error contains this text (case-insensitive).
    pub fn error(mut self, text: impl Into<String>) -> Self {
        self.error = Some(text.into());
        self
    }

    /// Replayed and resolved ones too.
    pub fn all(mut self, all: bool) -> Self {
        self.all = all;
        self
    }
}

pub(crate) const WHERE: &str = "($1::text IS NULL OR consumer_name = $1)
    AND ($2::text IS NULL OR topic = $2)
    AND ($3::uuid IS NULL OR event_id = $3)
    AND ($4::text IS NULL OR reason = $4)
    AND ($5::text IS NULL OR strpos(lower(error), lower($5)) > 0)
    AND ($6 OR (replayed_at IS NULL AND resolved_at IS NULL))";

pub(crate) fn bind<'q, O>(
    q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    f: &'q Filter,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    q.bind(f.consumer.as_deref())
        .bind(f.topic.as_deref())
        .bind(f.event_id)
        .bind(f.reason.as_deref())
        .bind(f.error.as_deref())
        .bind(f.all)
}

/// One dead letter, as listed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its id.
    pub id: i64,
    /// The consumer that gave up.
    pub consumer_name: String,
    /// From this topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub kafka_offset: i64,
    /// The event id, when the record had one.
    pub event_id: Option<Uuid>,
    /// Why (see [`Filter::reason`]).
    pub reason: String,
    /// The error.
    pub error: String,
    /// Attempts.
    pub attempts: i32,
    /// Recorded at.
    pub created_at: DateTime<Utc>,
    /// Published to the dead-letter topic.
    pub published: bool,
    /// Sent back to its topic.
    pub replayed: bool,
    /// Settled by an operator without a replay.
    pub resolved: bool,
}

const COLUMNS: &str = "id, consumer_name, topic, partition, kafka_offset, event_id, reason, error,
    attempts, created_at, published_at IS NOT NULL AS published,
    replayed_at IS NOT NULL AS replayed, resolved_at IS NOT NULL AS resolved";

/// The dead letters among `ids`, as listed, oldest first (at most `limit`).
pub async fn by_ids(pool: &PgPool, ids: &[i64], limit: i64) -> Result<Vec<DeadLetter>, Error> {
    Ok(sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM postal.dead_letters WHERE id = ANY($1) ORDER BY id LIMIT $2"
    ))
    .bind(ids)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// Dead letters the filter matches, newest first (at most `limit`).
pub async fn search(pool: &PgPool, filter: &Filter, limit: i64) -> Result<Vec<DeadLetter>, Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM postal.dead_letters WHERE {WHERE} ORDER BY id DESC LIMIT $7"
    );
    Ok(bind(sqlx::query_as(&sql), filter)
        .bind(limit)
        .fetch_all(pool)
        .await?)
}

/// Dead letters the filter matches, oldest first (at most `limit`).
pub async fn oldest(pool: &PgPool, filter: &Filter, limit: i64) -> Result<Vec<DeadLetter>, Error> {
    let sql =
        format!("SELECT {COLUMNS} FROM postal.dead_letters WHERE {WHERE} ORDER BY id LIMIT $7");
    Ok(bind(sqlx::query_as(&sql), filter)
        .bind(limit)
        .fetch_all(pool)
        .await?)
}

/// How many dead letters the filter matches.
pub async fn count(pool: &PgPool, filter: &Filter) -> Result<i64, Error> {
    let sql = format!("SELECT count(*) FROM postal.dead_letters WHERE {WHERE}");
    let (n,): (i64,) = bind(sqlx::query_as(&sql), filter).fetch_one(pool).await?;
    Ok(n)
}

/// One dead letter, whole.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Full {
    /// As listed.
    #[sqlx(flatten)]
    pub listed: DeadLetter,
    /// The record's key.
    pub record_key: Option<Vec<u8>>,
    /// The record's value.
    pub payload: Option<Vec<u8>>,
    /// Header names.
    pub header_names: Vec<String>,
    /// Header values, in the order of the names.
    pub header_values: Vec<Vec<u8>>,
}

/// The dead letter `id`.
pub async fn show(pool: &PgPool, id: i64) -> Result<Option<Full>, Error> {
    let sql = format!(
        "SELECT {COLUMNS}, record_key, payload, header_names, header_values
         FROM postal.dead_letters WHERE id = $1"
    );
    Ok(sqlx::query_as(&sql).bind(id).fetch_optional(pool).await?)
}

pub(crate) const OPEN_PER_CONSUMER_SQL: &str = "SELECT consumer_name, count(*)
    FROM postal.dead_letters WHERE replayed_at IS NULL AND resolved_at IS NULL
    GROUP BY 1 ORDER BY 1";

/// Open dead letters per consumer.
pub async fn open_per_consumer(pool: &PgPool) -> Result<Vec<(String, i64)>, Error> {
    Ok(sqlx::query_as(OPEN_PER_CONSUMER_SQL)
        .fetch_all(pool)
        .await?)
}

/// The open dead letters among `ids` (or, when `ids` is empty, that `filter` matches), oldest
/// first. More than `cap`: refused.
pub async fn matched(
    pool: &PgPool,
    ids: &[i64],
    filter: &Filter,
    cap: Option<usize>,
) -> Result<Vec<i64>, Error> {
    let found: Vec<i64> = if ids.is_empty() {
        let sql = format!("SELECT id FROM postal.dead_letters WHERE {WHERE} AND replayed_at IS NULL AND resolved_at IS NULL ORDER BY id");
        let rows: Vec<(i64,)> = bind(sqlx::query_as(&sql), filter).fetch_all(pool).await?;
        rows.into_iter().map(|(i,)| i).collect()
    } else {
        sqlx::query_scalar(
            "SELECT id FROM postal.dead_letters
             WHERE id = ANY($1) AND replayed_at IS NULL AND resolved_at IS NULL ORDER BY id",
        )
        .bind(ids)
        .fetch_all(pool)
        .await?
    };
    if let Some(cap) = cap {
        if found.len() > cap {
            return Err(Error::OverCap {
                matched: found.len(),
                cap,
            });
        }
    }
    Ok(found)
}

/// Marks open dead letters resolved by `by` (settled without a replay: their dedup rows
/// stay, so no copy of their events is ever applied), recorded in the audit trail as `resolve`
/// on `target` (what the operator gave: ids or a filter). Returns how many.
pub async fn resolve(
    pool: &PgPool,
    by: &Operator,
    target: &serde_json::Value,
    ids: &[i64],
) -> Result<u64, Error> {
    let recording = audit::open(pool, by, "resolve", target, ids.len()).await?;
    let outcome = async {
        let mut tx = postal_shared::cancel_safe::begin(pool).await?;
        let n = sqlx::query(
            "UPDATE postal.dead_letters SET resolved_at = now(), resolved_by = $2
         WHERE id = ANY($1) AND replayed_at IS NULL AND resolved_at IS NULL",
        )
        .bind(ids)
        .bind(recording.actor())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        recording.add(&mut tx, n, None).await?;
        tx.commit().await?;
        Ok::<u64, Error>(n)
    }
    .await;
    recording.end(pool, outcome).await
}

/// The original record of a dead letter, as it is replayed.
fn record(r: &Record) -> FutureRecord<'_, [u8], [u8]> {
    let mut h = OwnedHeaders::new_with_capacity(r.header_names.len());
    for (i, (n, v)) in r.header_names.iter().zip(&r.header_values).enumerate() {
        h = h.insert(Header {
            key: n,
            value: postal_shared::headers::kept_value(v, &r.header_absent, i),
        });
    }
    let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&r.topic).headers(h);
    if let Some(k) = &r.record_key {
        rec = rec.key(k.as_slice());
    }
    if let Some(p) = &r.payload {
        rec = rec.payload(p.as_slice());
    }
    rec
}

#[derive(sqlx::FromRow)]
struct Record {
    id: i64,
    consumer_name: String,
    topic: String,
    record_key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    header_names: Vec<String>,
    header_values: Vec<Vec<u8>>,
    header_absent: Vec<i32>,
}

/// At most this many dead letters are replayed in one chunk (one transaction).
const REPLAY_CHUNK_ROWS: usize = 500;

/// About the most bytes of dead letters (key, value, headers) one replay chunk holds; a dead
/// letter larger than this goes alone.
const REPLAY_CHUNK_BYTES: i64 = 4 << 20;

/// The ids of `sized` ((id, bytes), in order) in chunks of at most [`REPLAY_CHUNK_ROWS`] and
/// about [`REPLAY_CHUNK_BYTES`].
fn replay_chunks(sized: &[(i64, i64)]) -> Vec<Vec<i64>> {
    let mut chunks: Vec<Vec<i64>> = Vec::new();
    let mut bytes = 0i64;
    for &(id, size) in sized {
        match chunks.last_mut() {
            Some(last)
                if last.len() < REPLAY_CHUNK_ROWS
                    && bytes.saturating_add(size) <= REPLAY_CHUNK_BYTES =>
            {
                last.push(id);
                bytes = bytes.saturating_add(size);
            }
            _ => {
                chunks.push(vec![id]);
                bytes = size;
            }
        }
    }
    chunks
}

/// Sends open dead letters back to the topic they came from, with their original key, value
/// and headers (so their original event id), for the consumer's handler to process again. A
/// dead letter keeps its event's dedup row, so that no copy of it is ever applied by itself;
/// replay removes that row just before sending, so the event goes through the handler once
/// more — once. `progress` gets the running total. On a failed send, the dead letters of that
/// chunk that were not sent stand again (with their dedup rows), the replay stops there, and
/// the error says how many of those selected were replayed. Recorded in the audit trail as
/// `replay` by `by` on `target` (what the operator gave: ids or a filter), each chunk's count
/// in the chunk's transaction, and how it ended (the error's line, if it failed).
///
/// Refused, before anything is sent, when a selected dead letter was recorded at or before the
/// dedup retention horizon of another consumer (`postal.dedup_horizon`): a consumer that read
/// the event then may have deleted its dedup row since, and would apply the replayed record
/// again. [`replay_past_retention`] replays anyway.
pub async fn replay<C: rdkafka::ClientContext + 'static>(
    pool: &PgPool,
    producer: &FutureProducer<C>,
    by: &Operator,
    target: &serde_json::Value,
    ids: &[i64],
    progress: impl FnMut(u64),
) -> Result<u64, Error> {
    // Another consumer processed the event at the earliest when it was produced, which is at
    // or after its `ce_time` (when it occurred) and before the dead letter was recorded: a
    // horizon at or after the earlier of the two may have deleted that consumer's dedup row.
    // (`ce_time` is read here, not in SQL: a foreign producer's malformed one is ignored.)
    let horizons: Vec<(String, DateTime<Utc>)> =
        sqlx::query_as("SELECT consumer_name, horizon FROM postal.dedup_horizon")
            .fetch_all(pool)
            .await?;
    let mut past: Option<(i64, String, DateTime<Utc>)> = None;
    if !horizons.is_empty() {
        // (id, consumer, recorded at, its `ce_time` header's bytes)
        type Letter = (i64, String, DateTime<Utc>, Option<Vec<u8>>);
        let letters: Vec<Letter> = sqlx::query_as(
            "SELECT d.id, d.consumer_name, d.created_at,
                    (SELECT v FROM unnest(d.header_names, d.header_values) AS u(n, v)
                     WHERE n = 'ce_time' LIMIT 1)
             FROM postal.dead_letters d
             WHERE d.id = ANY($1) AND d.replayed_at IS NULL AND d.resolved_at IS NULL
             ORDER BY d.id",
        )
        .bind(ids)
        .fetch_all(pool)
        .await?;
        past = letters.into_iter().find_map(|(id, own, created, ce_time)| {
            let occurred = ce_time
                .and_then(|v| String::from_utf8(v).ok())
                .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
                .map(|t| t.with_timezone(&Utc));
            let since = occurred.map_or(created, |o| o.min(created));
            horizons
                .iter()
                .filter(|(c, h)| *c != own && *h >= since)
                .max_by_key(|(_, h)| *h)
                .map(|(c, h)| (id, c.clone(), *h))
        });
    }
    if let Some((id, consumer, horizon)) = past {
        return Err(Error::Invalid(format!(
            "dead letter {id} was recorded before consumer {}'s dedup retention horizon ({}): that consumer may have deleted its dedup row of the event and would apply the replayed record again; nothing was replayed (leave that dead letter out, or replay past retention: `postal dead-letters replay --force-past-retention`)",
            postal_shared::text::quoted(&consumer),
            horizon.format("%Y-%m-%d %H:%M:%S UTC")
        )));
    }
    replay_past_retention(pool, producer, by, target, ids, progress).await
}

/// [`replay`] without its check of other consumers' dedup retention horizons: a consumer
/// past its horizon applies the replayed record again.
pub async fn replay_past_retention<C: rdkafka::ClientContext + 'static>(
    pool: &PgPool,
    producer: &FutureProducer<C>,
    by: &Operator,
    target: &serde_json::Value,
    ids: &[i64],
    progress: impl FnMut(u64),
) -> Result<u64, Error> {
    let recording = audit::open(pool, by, "replay", target, ids.len()).await?;
    let outcome = replay_recorded(pool, producer, &recording, ids, progress).await;
    recording.end(pool, outcome).await
}

/// [`replay`] under its audit row `recording`.
async fn replay_recorded<C: rdkafka::ClientContext + 'static>(
    pool: &PgPool,
    producer: &FutureProducer<C>,
    recording: &audit::Recording,
    ids: &[i64],
    mut progress: impl FnMut(u64),
) -> Result<u64, Error> {
    // Sizes first, then each chunk's rows when its turn comes: a replay of many large dead
    // letters (a record's headers are kept whole, however many) holds one chunk at a time.
    let sized: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT id, (coalesce(octet_length(payload), 0) + coalesce(octet_length(record_key), 0)
                     + 64 * cardinality(header_names)
                     + coalesce((SELECT sum(octet_length(v)) FROM unnest(header_values) AS v), 0)
                    )::int8
         FROM postal.dead_letters
         WHERE replayed_at IS NULL AND resolved_at IS NULL AND id = ANY($1)
         ORDER BY id",
    )
    .bind(ids)
    .fetch_all(pool)
    .await?;
    // A keyed dead letter waits while an older open dead letter of its consumer, topic and key
    // is not in this replay (a filter or a list of ids left it out): sent, it would come
    // before that one once it is replayed.
    let older_open: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT d.id, min(o.id) FROM postal.dead_letters d
         JOIN postal.dead_letters o
           ON o.consumer_name = d.consumer_name AND o.topic = d.topic
          AND o.record_key = d.record_key AND o.id < d.id
          AND o.replayed_at IS NULL AND o.resolved_at IS NULL AND NOT (o.id = ANY($1))
         WHERE d.id = ANY($1) AND d.record_key IS NOT NULL
         GROUP BY d.id",
    )
    .bind(ids)
    .fetch_all(pool)
    .await?;
    let older_open: std::collections::HashMap<i64, i64> = older_open.into_iter().collect();
    // The (consumer, topic, key)s a failure held back in an earlier chunk: their later dead
    // letters are held back in the chunks after it too. Per consumer: each consumer's order
    // is its own (another consumer's copy of a replayed record is a duplicate its dedup row
    // drops), so one consumer's dead letter never waits for another's.
    let mut held_keys: std::collections::HashSet<(String, String, Vec<u8>)> = Default::default();
    let scope = |r: &Record, key: &[u8]| (r.consumer_name.clone(), r.topic.clone(), key.to_vec());
    let mut first_error: Option<String> = None;
    let mut done = 0u64;
    for chunk_ids in replay_chunks(&sized) {
        let rows: Vec<Record> = sqlx::query_as(
            "SELECT id, consumer_name, topic, record_key, payload, header_names, header_values,
                    header_absent
             FROM postal.dead_letters
             WHERE replayed_at IS NULL AND resolved_at IS NULL AND id = ANY($1)
             ORDER BY id",
        )
        .bind(&chunk_ids)
        .fetch_all(pool)
        .await?;
        // Not sent at all, and not claimed: a key held back by a failure in an earlier chunk,
        // or a dead letter with an older open one of its key outside the replay.
        let rows: Vec<Record> = rows
            .into_iter()
            .filter(|r| {
                let Some(key) = &r.record_key else {
                    return true;
                };
                let why = if let Some(older) = older_open.get(&r.id) {
                    format!("not sent: dead letter {older} of its key, older and still open, is not in this replay (replay it with this one)")
                } else if held_keys.contains(&scope(r, key)) {
                    "not sent: a dead letter of its key before it was not sent in this replay (replay again once it can be)".to_owned()
                } else {
                    return true;
                };
                first_error.get_or_insert_with(|| {
                    format!("replaying dead letter {} to {:?} failed: {why}", r.id, r.topic)
                });
                held_keys.insert(scope(r, key));
                false
            })
            .collect();
        let chunk = &rows[..];
        // One transaction per chunk, open until the broker acknowledged the sends: it claims
        // the chunk (a replay running at the same time waits for it, then takes none of these)
        // and removes the dedup rows these dead letters wrote — only those: written in the dead
        // letter's own transaction, they carry its time. A row from an applied copy (a replay
        // before, or a dead letter recorded before dead letters kept their row) stays, and the
        // replayed record is then a duplicate. If this process dies before the commit, nothing
        // of it happened: the dead letters stand with their rows (a record that went out
        // meanwhile is a duplicate) and the replay can be run again. A consumer that reads a
        // replayed record before the commit waits for it on the dedup row.
        let ids: Vec<i64> = chunk.iter().map(|r| r.id).collect();
        let mut tx = postal_shared::cancel_safe::begin(pool).await?;
        let claimed: Vec<i64> = sqlx::query_scalar(
            "UPDATE postal.dead_letters SET replayed_at = now()
             WHERE id = ANY($1) AND replayed_at IS NULL AND resolved_at IS NULL RETURNING id",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
        sqlx::query(
            "DELETE FROM postal.processed_events p USING postal.dead_letters d
             WHERE d.id = ANY($1) AND p.consumer_name = d.consumer_name
               AND p.event_id = d.event_id AND p.processed_at = d.created_at",
        )
        .bind(&claimed)
        .execute(&mut *tx)
        .await?;
        let chunk: Vec<&Record> = chunk.iter().filter(|r| claimed.contains(&r.id)).collect();
        // One key's dead letters (of one consumer) go out one at a time, in id order; different
        // keys at once.
        // Sent together, a key's records could share a record batch that the broker refuses
        // for its size (it checks a whole batch against the topic's `max.message.bytes`) while
        // a later one of the key is written: re-sent alone afterwards, the earlier ones would
        // land after it. So a key whose record is refused for its size sends nothing more in
        // this first pass; afterwards, one record at a time across all keys (alone, so that
        // only its own size counts), that record and the rest of its key go out in order.
        let same_key = |a: &Record, b: &Record| {
            a.consumer_name == b.consumer_name && a.topic == b.topic && a.record_key == b.record_key
        };
        let mut by_key: Vec<Vec<usize>> = Vec::new();
        for (i, r) in chunk.iter().enumerate() {
            match by_key.iter_mut().find(|m| same_key(chunk[m[0]], r)) {
                Some(members) => members.push(i),
                None => by_key.push(vec![i]),
            }
        }
        let chunk = &chunk;
        // The written offset, or the error as shown.
        let shown = |res: Result<
            rdkafka::producer::future_producer::Delivery,
            (rdkafka::error::KafkaError, rdkafka::message::OwnedMessage),
        >| { res.map(|d| d.offset).map_err(|(e, _)| e.to_string()) };
        // A keyed record that is not sent holds back the rest of its key in this replay: sent,
        // they would come before it once it is (records without a key keep no order).
        let held_back = |r: &Record| {
            Err(format!(
                "not sent: dead letter {} of its key before it was not (replay again once it can be)",
                r.id
            ))
        };
        let first = by_key.iter().map(|members| async move {
            let mut out = Vec::with_capacity(members.len());
            let keyed = chunk[members[0]].record_key.is_some();
            for (n, &i) in members.iter().enumerate() {
                let res = producer.send(record(chunk[i]), Duration::from_secs(15)).await;
                if matches!(&res, Err((e, _)) if postal_shared::kafka_producer::refused_for_itself(e)) {
                    return (out, Some(&members[n..]));
                }
                // A delivery without an offset is not known to be written: it holds back its
                // key's later ones as a failure does.
                let failed = !matches!(&res, Ok(d) if postal_shared::kafka_producer::written(d.offset));
                out.push((i, shown(res)));
                if failed && keyed {
                    out.extend(members[n + 1..].iter().map(|&j| (j, held_back(chunk[i]))));
                    break;
                }
            }
            (out, None)
        });
        let mut results = Vec::with_capacity(chunk.len());
        let mut alone = Vec::new();
        for (out, rest) in futures::future::join_all(first).await {
            results.extend(out);
            alone.extend(rest);
        }
        for rest in alone {
            let keyed = chunk[rest[0]].record_key.is_some();
            let mut not_sent: Option<&Record> = None;
            for &i in rest {
                if let Some(before) = not_sent {
                    results.push((i, held_back(before)));
                    continue;
                }
                let res = producer
                    .send(record(chunk[i]), Duration::from_secs(15))
                    .await;
                let failed =
                    !matches!(&res, Ok(d) if postal_shared::kafka_producer::written(d.offset));
                if failed && keyed {
                    not_sent = Some(chunk[i]);
                }
                results.push((i, shown(res)));
            }
        }
        results.sort_by_key(|(i, _)| *i);
        let results = results.into_iter().map(|(_, res)| res);
        let mut sent = 0u64;
        let mut failed = Vec::new();
        for (r, res) in chunk.iter().zip(results) {
            let res = match res {
                Ok(offset) if !postal_shared::kafka_producer::written(offset) => {
                    Err(postal_shared::kafka_producer::UNCONFIRMED.to_owned())
                }
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            match res {
                Ok(()) => sent += 1,
                Err(e) => {
                    first_error.get_or_insert_with(|| {
                        format!(
                            "replaying dead letter {} to {:?} failed: {e}",
                            r.id, r.topic
                        )
                    });
                    if let Some(key) = &r.record_key {
                        held_keys.insert(scope(r, key));
                    }
                    failed.push(r.id);
                }
            }
        }
        if !failed.is_empty() {
            // Not sent: the dead letter stands again, with its dedup row.
            sqlx::query("UPDATE postal.dead_letters SET replayed_at = NULL WHERE id = ANY($1)")
                .bind(&failed)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
                 SELECT consumer_name, event_id, created_at FROM postal.dead_letters
                 WHERE id = ANY($1) AND event_id IS NOT NULL
                 ON CONFLICT DO NOTHING",
            )
            .bind(&failed)
            .execute(&mut *tx)
            .await?;
        }
        recording.add(&mut tx, sent, None).await?;
        tx.commit().await?;
        done += sent;
        progress(done);
    }
    // A failure stops nothing but its key: the later chunks went on (other keys' dead letters
    // are not held back by it); the first error is told after the last chunk.
    match first_error {
        Some(e) => Err(Error::Kafka(format!(
            "{e} ({done} of {} replayed; the others stay open: run the same replay again for them)",
            sized.len()
        ))),
        None => Ok(done),
    }
}
