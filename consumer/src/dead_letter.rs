//! Dead letters: recorded in the transaction that moves the partition past them, then
//! published to `<topic>.dlq` with the original key, value and headers plus the error (cut to
//! fit when too large, `crate::dlq_copy`). A copy the broker refuses for its size is sent again
//! alone (refused with others, it may fit alone: the broker checks whole record batches), then
//! cut further. A dead letter whose copy the broker refuses even cut is marked
//! (`dlq_unpublishable`, the reason) and passed over: it comes after every other dead letter,
//! and is tried again when a batch has room. A topic that cannot take its dead letters now (it
//! cannot be created, a send failed) backs off on its own, and its dead letters come after the
//! other topics' when it is tried again: they never fill the batch the others wait behind. A
//! topic found missing (deleted under a running consumer) is created again.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::FutureProducer;
use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::dlq_copy::Cut;
use crate::record::Record;
use crate::Backoff;

pub use crate::reason::Reason;

/// What is written for one dead letter.
#[derive(Clone, Copy)]
pub(crate) struct DeadLetter<'a> {
    pub consumer: &'a str,
    pub group: &'a str,
    pub record: &'a Record,
    pub event_id: Option<uuid::Uuid>,
    pub event_type: Option<&'a str>,
    pub reason: Reason,
    pub error: &'a str,
    pub attempts: i32,
    pub dlq_topic: &'a str,
}

/// Inserts the dead letter in the caller's transaction; returns its id.
pub(crate) async fn record(conn: &mut PgConnection, d: DeadLetter<'_>) -> Result<i64, sqlx::Error> {
    // A record with more headers than `max_headers` is kept whole too: its headers, packed
    // since it was read, are unpacked here for its row, one record at a time. A header without
    // a value keeps an empty one in `header_values` (as binaries before migration 32 read it)
    // and its position, from 1, in `header_absent`.
    let mut absent: Vec<i32> = Vec::new();
    let mut keep = |(i, (n, v)): (usize, (&str, Option<&[u8]>))| {
        if v.is_none() {
            absent.push(i as i32 + 1);
        }
        (n.to_owned(), v.unwrap_or_default().to_vec())
    };
    let (names, values): (Vec<String>, Vec<Vec<u8>>) = match &d.record.too_many_headers {
        Some(all) => all.iter().enumerate().map(&mut keep).unzip(),
        None => d.record.headers.iter().enumerate().map(&mut keep).unzip(),
    };
    sqlx::query_scalar(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition, kafka_offset,
             event_id, event_type, record_key, payload, header_names, header_values, reason,
             error, attempts, dlq_topic, header_absent)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)
         RETURNING id",
    )
    .bind(d.consumer)
    .bind(d.group)
    .bind(&d.record.topic)
    .bind(d.record.partition)
    .bind(d.record.offset)
    .bind(d.event_id)
    // The type as read (its bytes stay in the headers), NUL escaped: `text` refuses it.
    .bind(d.event_type.map(postal_shared::text::storable))
    .bind(d.record.key.as_deref())
    .bind(d.record.payload.as_deref())
    .bind(names)
    .bind(values)
    .bind(d.reason.as_str())
    // Bounded: the copy on `<topic>.dlq` carries it as a header and must stay publishable.
    .bind(postal_shared::text::bounded(d.error, postal_shared::text::MAX_ERROR_BYTES).as_ref())
    .bind(d.attempts)
    .bind(d.dlq_topic)
    .bind(absent)
    .fetch_one(conn)
    .await
}

/// An unpublished dead letter, as its copy is made from it (`crate::dlq_copy`).
#[derive(sqlx::FromRow)]
pub(crate) struct Row {
    pub(crate) id: i64,
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) kafka_offset: i64,
    pub(crate) record_key: Option<Vec<u8>>,
    pub(crate) payload: Option<Vec<u8>>,
    pub(crate) header_names: Vec<String>,
    pub(crate) header_values: Vec<Vec<u8>>,
    /// The positions (from 1, ascending) of the headers that had no value.
    pub(crate) header_absent: Vec<i32>,
    pub(crate) reason: String,
    pub(crate) error: String,
    pub(crate) attempts: i32,
    pub(crate) dlq_topic: String,
    /// Refused even cut before (`dlq_unpublishable` set).
    pub(crate) marked: bool,
    /// How many rows the pass locked (those over its byte bound are left for the next).
    pub(crate) locked: i64,
}

/// Publishes this consumer's unpublished dead letters; woken after every dead letter and
/// polling as a safety net.
pub(crate) struct Publisher {
    pub pool: PgPool,
    /// Replaced when it fails for good (a fatal error: e.g. the principal could write no topic
    /// when it started): a fatal producer never sends again.
    pub producer: Mutex<FutureProducer>,
    pub producer_config: rdkafka::ClientConfig,
    pub admin: AdminClient<DefaultClientContext>,
    pub consumer: String,
    pub topic_partitions: i32,
    pub topic_replication: i32,
    pub wake: Arc<Notify>,
    pub created: Mutex<HashSet<String>>,
    /// Dead-letter topics whose names are not valid topic names (a source topic near the
    /// 249-character limit): their dead letters stay in the table, and are not picked again
    /// until a restart, so that they do not hold back the others.
    pub invalid: Mutex<HashSet<String>>,
    /// Dead-letter topics whose last pass failed (the topic could not be created, a send
    /// failed): left out of the passes until their backoff is over, so that their dead letters,
    /// however many, never fill the batch the other topics' wait behind.
    pub cooling: Mutex<HashMap<String, Cooling>>,
    /// The last dead letter refused even cut (`dlq_unpublishable`) that a pass tried: the
    /// next pass tries those after it first, and then from the oldest again.
    pub marked_after: Mutex<i64>,
    pub backoff: Backoff,
}

/// A dead-letter topic's backoff after failures in a row.
pub(crate) struct Cooling {
    until: Instant,
    failures: u32,
}

/// What became of one copy sent.
enum Sent {
    /// The broker wrote it (its delivery report has an offset).
    Written,
    /// Refused for its size or form (`dlq_copy::refused_for_itself`): this copy as it is can
    /// never be sent to this topic.
    Refused(String),
    /// Not written, for a cause that may pass: the error, and whether the broker does not know
    /// the topic (deleted under the consumer, or never created).
    Failed(String, bool),
}

impl Sent {
    fn of(res: rdkafka::producer::future_producer::OwnedDeliveryResult) -> Sent {
        match res {
            Ok(d) if !postal_shared::kafka_producer::written(d.offset) => {
                Sent::Failed(postal_shared::kafka_producer::UNCONFIRMED.to_owned(), false)
            }
            Ok(_) => Sent::Written,
            Err((e, _)) if crate::dlq_copy::refused_for_itself(&e) => Sent::Refused(e.to_string()),
            Err((e, _)) => {
                let missing = matches!(
                    e.rdkafka_error_code(),
                    Some(
                        RDKafkaErrorCode::UnknownTopic | RDKafkaErrorCode::UnknownTopicOrPartition
                    )
                );
                Sent::Failed(e.to_string(), missing)
            }
        }
    }
}

const BATCH: i64 = 100;

/// About how many bytes of dead letters one publishing pass reads into memory (a row over it
/// is read alone): payload, key, and 64 bytes plus the value per header, so that rows keeping
/// a record's many headers whole (more than `max_headers`) are read a few at a time.
const BATCH_BYTES: i64 = 16 << 20;

impl Publisher {
    pub async fn run(self, stop: CancellationToken) {
        let mut failures = 0u32;
        loop {
            match self.publish_pending().await {
                Ok(true) => {
                    failures = 0;
                    continue;
                }
                Ok(false) => {
                    failures = 0;
                    self.count_unpublished().await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "publishing dead letters failed; retrying");
                    self.count_unpublished().await;
                    let wait = self.backoff.delay(failures);
                    failures = failures.saturating_add(1);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => continue,
                        _ = stop.cancelled() => return,
                    }
                }
            }
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                _ = stop.cancelled() => {
                    // One last pass for dead letters recorded during shutdown.
                    if let Err(e) = self.publish_pending().await {
                        tracing::warn!(error = %e, "dead letters left unpublished at shutdown; the next start publishes them");
                    }
                    return;
                }
            }
        }
    }

    /// Sets `postal_consumer_dead_letters_unpublished` (alert `PostalDeadLettersUnpublished`):
    /// how many dead letters are not in their `.dlq` topic, those refused even cut included,
    /// when the database answers.
    async fn count_unpublished(&self) {
        if let Ok(n) = sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM postal.dead_letters
             WHERE consumer_name = $1 AND published_at IS NULL",
        )
        .bind(&self.consumer)
        .fetch_one(&self.pool)
        .await
        {
            metrics::gauge!("postal_consumer_dead_letters_unpublished", "consumer" => self.consumer.clone())
                .set(n as f64);
        }
    }

    /// Publishes one batch; `Ok(true)` when a full batch went out (there may be more). `Err`
    /// only when the database failed; a topic that cannot take its dead letters now (it cannot
    /// be created, a send failed) is logged and left out of the next passes for a backoff of
    /// its own ([`Publisher::cooling`]), so that it holds back only its own dead letters.
    async fn publish_pending(&self) -> Result<bool, String> {
        let mut tx = postal_shared::cancel_safe::begin(&self.pool)
            .await
            .map_err(|e| e.to_string())?;
        let now = Instant::now();
        let mut excluded: Vec<String> = self
            .invalid
            .lock()
            .expect("invalid topics")
            .iter()
            .cloned()
            .collect();
        // Topics that failed lately: left out until their backoff is over, then taken after
        // the others' dead letters, so that theirs never fill the batch the others wait behind.
        let mut failing: Vec<String> = Vec::new();
        for (topic, c) in self.cooling.lock().expect("cooling topics").iter() {
            if c.until > now {
                excluded.push(topic.clone());
            } else {
                failing.push(topic.clone());
            }
        }
        let marked_after = *self.marked_after.lock().expect("marked cursor");
        // Up to BATCH rows are locked, and read in that order while their sizes stay within
        // BATCH_BYTES (the first always): the rest stay for the next pass.
        let rows: Vec<Row> = sqlx::query_as(
            "WITH locked AS (
                 SELECT id, dlq_unpublishable IS NOT NULL AS k1, dlq_topic = ANY($4) AS k2,
                        (dlq_unpublishable IS NOT NULL AND id <= $5) AS k3,
                        coalesce(octet_length(payload), 0) + coalesce(octet_length(record_key), 0)
                        + 64 * coalesce(cardinality(header_names), 0)
                        + coalesce(pg_column_size(header_values), 0) AS cost
                 FROM postal.dead_letters
                 WHERE consumer_name = $1 AND published_at IS NULL
                   AND dlq_topic <> ALL($3)
                 ORDER BY dlq_unpublishable IS NOT NULL, dlq_topic = ANY($4),
                          dlq_unpublishable IS NOT NULL AND id <= $5, id
                 LIMIT $2 FOR UPDATE SKIP LOCKED),
             taken AS (
                 SELECT id, k1, k2, k3,
                        sum(cost) OVER (ORDER BY k1, k2, k3, id) - cost AS before
                 FROM locked)
             SELECT d.id, d.topic, d.partition, d.kafka_offset, d.record_key, d.payload,
                    d.header_names, d.header_values, d.header_absent, d.reason, d.error,
                    d.attempts, d.dlq_topic, t.k1 AS marked, (SELECT count(*) FROM locked) AS locked
             FROM taken t JOIN postal.dead_letters d ON d.id = t.id
             WHERE t.before < $6
             ORDER BY t.k1, t.k2, t.k3, t.id",
        )
        .bind(&self.consumer)
        .bind(BATCH)
        .bind(&excluded)
        .bind(&failing)
        .bind(marked_after)
        .bind(BATCH_BYTES)
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
        if rows.is_empty() {
            return Ok(false);
        }
        // Dead letters refused even cut (`dlq_unpublishable`) come after every other, so they
        // never hold one back, and are tried again when the batch has room: a topic whose
        // limit an operator raises takes them then. They take turns (those after the last one
        // tried first, [`Publisher::marked_after`]), so that those the topic takes now are not
        // left behind a full batch of older ones it still refuses.
        if let Some(last) = rows.iter().filter(|r| r.marked).map(|r| r.id).max() {
            *self.marked_after.lock().expect("marked cursor") = last;
        }
        // A topic that cannot take its dead letters holds back only its own: the first error
        // of each such topic this pass.
        let mut failed: HashMap<String, String> = HashMap::new();
        // Topics the broker does not know: created again on the next pass.
        let mut missing: HashSet<String> = HashSet::new();
        for topic in rows
            .iter()
            .map(|r| r.dlq_topic.clone())
            .collect::<HashSet<_>>()
        {
            if postal_shared::Topic::new(topic.as_str()).is_err() {
                tracing::warn!(topic = %postal_shared::text::quoted(&topic), "dead-letter topic name is not a valid topic name: its dead letters stay in postal.dead_letters (replay them with `postal dead-letters replay`)");
                self.invalid
                    .lock()
                    .expect("invalid topics")
                    .insert(topic.clone());
                // Left out until a restart; not a failure to retry.
                failed.insert(topic, String::new());
            } else if let Err(e) = self.ensure_topic(&topic).await {
                failed.insert(topic, e);
            }
        }
        let producer = self.producer.lock().expect("dlq producer").clone();
        // Each copy cut to what the producer takes (`dlq_copy`); the table keeps it whole.
        let limit = crate::dlq_copy::limit(&self.producer_config);
        let mut cuts: Vec<Cut> = rows
            .iter()
            .map(|r| Cut::to_fit(r, &self.consumer, limit))
            .collect();
        let mut outcomes: Vec<Option<Sent>> = rows.iter().map(|_| None).collect();
        // First the dead letters not refused before, all at once.
        let fresh: Vec<usize> = (0..rows.len())
            .filter(|&i| !rows[i].marked && !failed.contains_key(&rows[i].dlq_topic))
            .collect();
        // A key's copies one at a time, in id order; different keys (and copies without a key)
        // at once. Sent together, a key's copies could share a record batch the broker refuses
        // for its size while a later one of the key is written: sent again alone afterwards,
        // the earlier ones would land after it. A key whose copy is not written sends nothing
        // more in this pass: its rest goes alone below, in order.
        let mut by_key: Vec<Vec<usize>> = Vec::new();
        for &i in &fresh {
            let same = |g: &Vec<usize>| {
                let first = &rows[g[0]];
                first.record_key.is_some()
                    && first.record_key == rows[i].record_key
                    && first.dlq_topic == rows[i].dlq_topic
            };
            match by_key.iter_mut().find(|g| same(g)) {
                Some(g) => g.push(i),
                None => by_key.push(vec![i]),
            }
        }
        let rows_ref = &rows;
        let cuts_ref = &cuts;
        let producer_ref = &producer;
        let consumer = self.consumer.as_str();
        let results: Vec<(usize, Sent)> = join_all(by_key.iter().map(|members| async move {
            let mut out = Vec::with_capacity(members.len());
            for &i in members {
                let sent = Sent::of(
                    producer_ref
                        .send(
                            crate::dlq_copy::record(&rows_ref[i], consumer, cuts_ref[i]),
                            Duration::from_secs(30),
                        )
                        .await,
                );
                let written = matches!(sent, Sent::Written);
                out.push((i, sent));
                if !written {
                    break;
                }
            }
            out
        }))
        .await
        .into_iter()
        .flatten()
        .collect();
        for (i, sent) in results {
            outcomes[i] = match sent {
                // Refused for size: maybe not for its own, but for the record batch librdkafka
                // packed it into with others (the broker checks a whole batch against the
                // topic's `max.message.bytes`). Sent again alone below.
                Sent::Refused(_) => None,
                other => Some(other),
            };
            if let Some(Sent::Failed(e, gone)) = &outcomes[i] {
                if *gone {
                    missing.insert(rows[i].dlq_topic.clone());
                }
                failed
                    .entry(rows[i].dlq_topic.clone())
                    .or_insert_with(|| format!("dead letter {}: {e}", rows[i].id));
            }
        }
        // Then, one at a time (so that each is a record batch of its own), those refused for
        // size and those refused before: as cut above, then cut further while the broker
        // refuses it for its size (a topic that takes less than the producer), down to Postal's
        // headers only. Refused even so, the dead letter is marked and passed over, so that it
        // never holds back the later ones.
        for i in 0..rows.len() {
            if outcomes[i].is_some() || failed.contains_key(&rows[i].dlq_topic) {
                continue;
            }
            let mut outcome = Sent::Refused(String::new());
            for cut in cuts[i].and_further() {
                let sent = producer
                    .send(
                        crate::dlq_copy::record(&rows[i], &self.consumer, cut),
                        Duration::from_secs(30),
                    )
                    .await;
                outcome = Sent::of(sent);
                if let Sent::Written = outcome {
                    cuts[i] = cut;
                }
                if !matches!(outcome, Sent::Refused(_)) {
                    break;
                }
            }
            if let Sent::Failed(e, gone) = &outcome {
                if *gone {
                    missing.insert(rows[i].dlq_topic.clone());
                }
                failed
                    .entry(rows[i].dlq_topic.clone())
                    .or_insert_with(|| format!("dead letter {}: {e}", rows[i].id));
            }
            outcomes[i] = Some(outcome);
        }
        self.replace_if_fatal(&producer);
        let mut done = Vec::with_capacity(rows.len());
        // What each published copy left out (the table keeps the whole record: retention
        // keeps the row until the dead letter is replayed or resolved).
        let mut done_cuts: Vec<Option<&'static str>> = Vec::with_capacity(rows.len());
        let mut unpublishable: Vec<(i64, String)> = Vec::new();
        for ((row, outcome), cut) in rows.iter().zip(outcomes).zip(&cuts) {
            match outcome {
                Some(Sent::Written) => {
                    if let Some(marker) = cut.marker() {
                        tracing::info!(dead_letter = row.id, cut = marker, limit, "dead letter too large for its .dlq topic: published without its {marker} (whole in postal.dead_letters)");
                        metrics::counter!("postal_consumer_dead_letters_cut_total", "consumer" => self.consumer.clone()).increment(1);
                    }
                    done.push(row.id);
                    done_cuts.push(cut.marker());
                }
                Some(Sent::Refused(e)) => {
                    let reason = format!(
                        "the broker refuses even its copy without value, headers and key ({e})"
                    );
                    tracing::warn!(dead_letter = row.id, topic = %postal_shared::text::quoted(&row.dlq_topic), reason = %reason, "dead letter cannot be published to its .dlq topic: passed over (it stays in postal.dead_letters; replay it with `postal dead-letters replay`)");
                    metrics::counter!("postal_consumer_dead_letters_unpublishable_total", "consumer" => self.consumer.clone()).increment(1);
                    unpublishable.push((row.id, reason));
                }
                // Failed, or not sent because its topic failed: left for a later pass.
                Some(Sent::Failed(..)) | None => {}
            }
        }
        if !unpublishable.is_empty() {
            let (ids, reasons): (Vec<i64>, Vec<String>) = unpublishable.into_iter().unzip();
            sqlx::query(
                "UPDATE postal.dead_letters d SET dlq_unpublishable = u.reason
                 FROM unnest($1::int8[], $2::text[]) AS u(id, reason) WHERE d.id = u.id",
            )
            .bind(&ids)
            .bind(&reasons)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        }
        sqlx::query(
            "UPDATE postal.dead_letters d
             SET published_at = now(), dlq_unpublishable = NULL, dlq_cut = u.cut
             FROM unnest($1::int8[], $2::text[]) AS u(id, cut) WHERE d.id = u.id",
        )
        .bind(&done)
        .bind(&done_cuts)
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        tracing::debug!(count = done.len(), "published dead letters");
        for topic in &missing {
            self.created.lock().expect("topic set").remove(topic);
        }
        self.cool(&rows, &failed);
        // More may wait only when a whole batch went out, or all that the byte bound let
        // this pass read (a batch holding a dead letter that cannot go waits for the next
        // round instead of spinning on it).
        let locked = rows.first().map_or(0, |r| r.locked);
        Ok(done.len() as i64 == BATCH || (done.len() == rows.len() && locked > rows.len() as i64))
    }

    /// Leaves the topics that failed this pass (`failed`: topic → error) out of the next
    /// passes for a backoff that grows with each failure in a row, and forgets the others of
    /// `rows`.
    fn cool(&self, rows: &[Row], failed: &HashMap<String, String>) {
        let now = Instant::now();
        let mut cooling = self.cooling.lock().expect("cooling topics");
        for topic in rows.iter().map(|r| &r.dlq_topic) {
            if !failed.contains_key(topic) {
                cooling.remove(topic);
            }
        }
        for (topic, error) in failed {
            if error.is_empty() {
                continue;
            }
            let c = cooling.entry(topic.clone()).or_insert(Cooling {
                until: now,
                failures: 0,
            });
            let wait = self.backoff.delay(c.failures);
            c.failures = c.failures.saturating_add(1);
            c.until = now + wait;
            tracing::warn!(topic = %postal_shared::text::quoted(topic), error = %error, retry_in = ?wait, "publishing dead letters to their .dlq topic failed; retrying (the other topics' go on)");
        }
    }

    /// Replaces `producer` if it failed for good, so that publishing resumes once the cause is
    /// fixed (an ACL granted) without a restart.
    fn replace_if_fatal(&self, producer: &FutureProducer) {
        use rdkafka::producer::Producer as _;
        let Some((code, reason)) = producer.client().fatal_error() else {
            return;
        };
        match self.producer_config.create::<FutureProducer>() {
            Ok(fresh) => {
                tracing::warn!(error = %code, reason, "the dead-letter producer failed for good; replaced by a new one (dead letters stay in postal.dead_letters until published)");
                *self.producer.lock().expect("dlq producer") = fresh;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the dead-letter producer failed for good and a new one could not be created; retrying later");
            }
        }
    }

    async fn ensure_topic(&self, topic: &str) -> Result<(), String> {
        if self.created.lock().expect("topic set").contains(topic) {
            return Ok(());
        }
        let new = NewTopic::new(
            topic,
            self.topic_partitions,
            TopicReplication::Fixed(self.topic_replication),
        );
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = self
            .admin
            .create_topics([&new], &opts)
            .await
            .map_err(|e| format!("creating dead-letter topic {topic:?}: {e}"))?;
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                // A least-privilege principal may write the topic an operator created without
                // being allowed to create it: publish; a missing topic then fails the send.
                Err((
                    _,
                    RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::ClusterAuthorizationFailed,
                )) => return Ok(()),
                Err((_, code)) => {
                    return Err(format!("creating dead-letter topic {topic:?}: {code}"))
                }
            }
        }
        self.created
            .lock()
            .expect("topic set")
            .insert(topic.to_owned());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::producer::future_producer::Delivery;

    use super::Sent;

    fn delivered(offset: i64) -> Sent {
        Sent::of(Ok(Delivery {
            partition: 0,
            offset,
            timestamp: rdkafka::Timestamp::NotAvailable,
        }))
    }

    /// Guarantee: a copy is marked published only when its delivery report has an offset; one
    /// reported delivered without (librdkafka's "implicit ack", which before Kafka 4.5 can
    /// stand for a record never written, KAFKA-15591) stays unpublished and fails its topic's
    /// pass, to be sent again.
    #[test]
    fn a_copy_reported_delivered_without_an_offset_is_not_published() {
        assert!(matches!(delivered(0), Sent::Written));
        assert!(matches!(delivered(41), Sent::Written));
        for offset in [-1, -1001] {
            match delivered(offset) {
                Sent::Failed(e, gone) => {
                    assert_eq!(e, postal_shared::kafka_producer::UNCONFIRMED);
                    assert!(!gone);
                }
                _ => panic!("offset {offset} taken as written"),
            }
        }
    }
}
