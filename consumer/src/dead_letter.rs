//! Dead letters: recorded in the transaction that moves the partition past them, then
//! published to `<topic>.dlq` with the original key, value and headers plus the error (cut to
//! fit when too large, `crate::dlq_copy`). A dead letter whose copy the broker refuses even
//! cut is marked (`dlq_unpublishable`, the reason) and passed over: it comes after every other
//! dead letter, and is tried again when a batch has room.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    let (names, values): (Vec<String>, Vec<Vec<u8>>) = d
        .record
        .headers
        .iter()
        .map(|(n, v)| (n.to_owned(), v.unwrap_or_default().to_vec()))
        .unzip();
    sqlx::query_scalar(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition, kafka_offset,
             event_id, event_type, record_key, payload, header_names, header_values, reason,
             error, attempts, dlq_topic)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
         RETURNING id",
    )
    .bind(d.consumer)
    .bind(d.group)
    .bind(&d.record.topic)
    .bind(d.record.partition)
    .bind(d.record.offset)
    .bind(d.event_id)
    .bind(d.event_type)
    .bind(d.record.key.as_deref())
    .bind(d.record.payload.as_deref())
    .bind(names)
    .bind(values)
    .bind(d.reason.as_str())
    // Bounded: the copy on `<topic>.dlq` carries it as a header and must stay publishable.
    .bind(postal_shared::text::bounded(d.error, postal_shared::text::MAX_ERROR_BYTES).as_ref())
    .bind(d.attempts)
    .bind(d.dlq_topic)
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
    pub(crate) reason: String,
    pub(crate) error: String,
    pub(crate) attempts: i32,
    pub(crate) dlq_topic: String,
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
    pub backoff: Backoff,
}

const BATCH: i64 = 100;

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

    /// Publishes one batch; `Ok(true)` when a full batch went out (there may be more).
    async fn publish_pending(&self) -> Result<bool, String> {
        let mut tx = postal_shared::cancel_safe::begin(&self.pool)
            .await
            .map_err(|e| e.to_string())?;
        let invalid: Vec<String> = self
            .invalid
            .lock()
            .expect("invalid topics")
            .iter()
            .cloned()
            .collect();
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT id, topic, partition, kafka_offset, record_key, payload, header_names,
                    header_values, reason, error, attempts, dlq_topic
             FROM postal.dead_letters
             WHERE consumer_name = $1 AND published_at IS NULL
               AND dlq_topic <> ALL($3)
             ORDER BY dlq_unpublishable IS NOT NULL, id LIMIT $2 FOR UPDATE SKIP LOCKED",
        )
        .bind(&self.consumer)
        .bind(BATCH)
        .bind(&invalid)
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
        if rows.is_empty() {
            return Ok(false);
        }
        // Dead letters refused even cut (`dlq_unpublishable`) come after every other, so they
        // never hold one back, and are tried again when the batch has room: a topic whose
        // limit an operator raises takes them then.
        // A topic that cannot take its dead letters holds back only its own.
        let mut first_error = None;
        let mut skipped = HashSet::new();
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
                first_error.get_or_insert_with(|| {
                    format!(
                        "dead-letter topic {} is not a valid topic name",
                        postal_shared::text::quoted(&topic)
                    )
                });
                skipped.insert(topic);
            } else if let Err(e) = self.ensure_topic(&topic).await {
                first_error.get_or_insert(e);
                skipped.insert(topic);
            }
        }
        let rows: Vec<Row> = rows
            .into_iter()
            .filter(|r| !skipped.contains(&r.dlq_topic))
            .collect();
        let producer = self.producer.lock().expect("dlq producer").clone();
        // Each copy cut to what the producer takes (`dlq_copy`); the table keeps it whole.
        let limit = crate::dlq_copy::limit(&self.producer_config);
        let cuts: Vec<Cut> = rows
            .iter()
            .map(|r| Cut::to_fit(r, &self.consumer, limit))
            .collect();
        let sends = rows.iter().zip(&cuts).map(|(r, cut)| {
            producer.send(
                crate::dlq_copy::record(r, &self.consumer, *cut),
                Duration::from_secs(30),
            )
        });
        let mut results = join_all(sends).await;
        // A copy refused for its own size (a topic that takes less than the producer) is sent
        // again with only Postal's headers; refused again, the dead letter is marked and
        // passed over, so that it never holds back the later ones.
        let again: Vec<usize> = (0..rows.len())
            .filter(|&i| {
                cuts[i] != Cut::All
                    && matches!(&results[i], Err((e, _)) if crate::dlq_copy::refused_for_itself(e))
            })
            .collect();
        let resent = join_all(again.iter().map(|&i| {
            producer.send(
                crate::dlq_copy::record(&rows[i], &self.consumer, Cut::All),
                Duration::from_secs(30),
            )
        }))
        .await;
        for (i, res) in again.into_iter().zip(resent) {
            results[i] = res;
        }
        self.replace_if_fatal(&producer);
        let mut done = Vec::with_capacity(rows.len());
        let mut unpublishable: Vec<(i64, String)> = Vec::new();
        for ((row, res), cut) in rows.iter().zip(results).zip(&cuts) {
            match res {
                Ok(d) if !postal_shared::kafka_producer::written(d.offset) => {
                    first_error.get_or_insert_with(|| {
                        format!(
                            "dead letter {}: {}",
                            row.id,
                            postal_shared::kafka_producer::UNCONFIRMED
                        )
                    });
                }
                Ok(_) => {
                    if let Some(marker) = cut.marker() {
                        tracing::info!(dead_letter = row.id, cut = marker, limit, "dead letter too large for its .dlq topic: published without its {marker} (whole in postal.dead_letters)");
                        metrics::counter!("postal_consumer_dead_letters_cut_total", "consumer" => self.consumer.clone()).increment(1);
                    }
                    done.push(row.id);
                }
                Err((e, _)) if crate::dlq_copy::refused_for_itself(&e) => {
                    let reason = format!(
                        "the broker refuses even its copy without value, headers and key ({e})"
                    );
                    tracing::warn!(dead_letter = row.id, topic = %postal_shared::text::quoted(&row.dlq_topic), reason = %reason, "dead letter cannot be published to its .dlq topic: passed over (it stays in postal.dead_letters; replay it with `postal dead-letters replay`)");
                    metrics::counter!("postal_consumer_dead_letters_unpublishable_total", "consumer" => self.consumer.clone()).increment(1);
                    unpublishable.push((row.id, reason));
                }
                Err((e, _)) => {
                    first_error.get_or_insert_with(|| format!("dead letter {}: {e}", row.id));
                }
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
            "UPDATE postal.dead_letters SET published_at = now(), dlq_unpublishable = NULL
             WHERE id = ANY($1)",
        )
        .bind(&done)
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        tracing::debug!(count = done.len(), "published dead letters");
        // More may wait only when a whole batch went out (a batch holding a dead letter that
        // cannot go waits for the next round instead of spinning on it).
        let full = done.len() as i64 == BATCH;
        match first_error {
            Some(e) => Err(e),
            None => Ok(full),
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
