//! Releasing held keys: an operator's `postal held release` (sets `release` on the key's row)
//! or the retry policy (`due_at`) makes the partition's owner apply the key's held records in
//! offset order, between its batches, each in its own transaction with its dedup row, its
//! effects, the deletion of its held row and the epoch check; a final failure makes the
//! record the key's head again (the key stays held).

use sqlx::PgConnection;

use crate::config::UnknownTypes;
use crate::dead_letter::Reason;
use crate::offsets::{self, Ownership};
use crate::record::{meta, Meta, Record};

use super::process::{run_body, Attempt, BodyFailure};
use super::{Dead, Step, Worker};

/// A held key due for release: (key, the operator's release, if any).
type KeyRelease = (Vec<u8>, Option<String>);

/// A held record as stored.
#[derive(sqlx::FromRow)]
struct Row {
    kafka_offset: i64,
    record_key: Vec<u8>,
    payload: Option<Vec<u8>>,
    header_names: Vec<String>,
    header_values: Vec<Vec<u8>>,
    kafka_timestamp: Option<chrono::DateTime<chrono::Utc>>,
    bytes: i64,
    unreadable_header: Option<i32>,
    header_absent: Vec<i32>,
}

/// A release being applied.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Release {
    /// The retry policy's (`due_at`): apply the head, then the rest.
    Policy,
    /// An operator's: apply the head, then the rest.
    Retry,
    /// Dead-letter the head, then apply the rest.
    Skip,
}

/// The most held records one look at the releases settles: a release larger than this goes
/// on at the next look, and the partition's other records are taken in between (in the
/// meantime the key stays held: its records arriving are held behind the rest).
pub(super) const RELEASE_CHUNK: usize = 64;

impl Worker {
    /// Applies the releases of this partition's held keys that operators asked for and the
    /// retries that are due, at most [`RELEASE_CHUNK`] held records. `(Done, false)` when
    /// nothing is left to do now; `(Done, true)` when releases go on at the next look.
    pub(crate) async fn apply_releases(&self, own: &Ownership) -> (Step, bool) {
        let due: Result<Vec<KeyRelease>, sqlx::Error> = sqlx::query_as(
            "SELECT record_key, release FROM postal.held_keys
             WHERE group_id = $1 AND topic = $2 AND partition = $3
               AND (release IS NOT NULL OR due_at <= now())
             ORDER BY held_at",
        )
        .bind(&self.shared.config.group)
        .bind(&self.topic)
        .bind(self.partition)
        .fetch_all(&self.shared.pool)
        .await;
        let due = match due {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "cannot read the releases of held keys; trying again later");
                return (Step::Done, false);
            }
        };
        let mut budget = RELEASE_CHUNK;
        for (key, release) in due {
            if budget == 0 {
                return (Step::Done, true);
            }
            if !self.held.lock().expect("held keys").contains(&key) {
                // Not this ownership's to know (held after the takeover elsewhere?): the next
                // takeover reads it.
                continue;
            }
            let mode = match release.as_deref() {
                Some("skip") => Release::Skip,
                Some(_) => Release::Retry,
                None => Release::Policy,
            };
            match self.release_key(own, &key, mode, &mut budget).await {
                Step::Done => {}
                other => return (other, false),
            }
        }
        (Step::Done, budget == 0)
    }

    /// Applies `key`'s held records in offset order, each in its own transaction, until none
    /// is left (the key is no longer held), one fails for good (it becomes the head; the key
    /// stays held) or `budget` records were settled (the key's row says it is being released:
    /// the next look goes on).
    async fn release_key(
        &self,
        own: &Ownership,
        key: &[u8],
        mut mode: Release,
        budget: &mut usize,
    ) -> Step {
        tracing::info!(topic = %self.topic, partition = self.partition, skip_head = (mode == Release::Skip), "releasing a held key");
        // The record the last pass of the loop worked on: met again, it was not applied (it
        // failed for good again and is the head, or its transaction was rolled back), and
        // this release ends; the next one is asked again or due by the retry policy.
        let mut last: Option<i64> = None;
        loop {
            if *budget == 0 {
                return Step::Done;
            }
            *budget -= 1;
            let row = match self.next_held(key).await {
                Some(Ok(Some(r))) if last == Some(r.kafka_offset) => return Step::Done,
                Some(Ok(Some(r))) => {
                    last = Some(r.kafka_offset);
                    r
                }
                Some(Ok(None)) => {
                    // Nothing left (released by an earlier ownership that stopped before
                    // deleting the key's row cannot happen: the last record's transaction
                    // deletes it); forget the key.
                    self.held.lock().expect("held keys").remove(key);
                    return Step::Done;
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "cannot read a held record; trying again later");
                    return Step::Done;
                }
                None => return Step::Stop,
            };
            let record = row.record(&self.topic, self.partition, self.shared.config.max_headers);
            let m = match meta(&record) {
                Ok(m) => m,
                Err((reason, error)) => {
                    // Held without an envelope behind its key's head: dead-lettered now, in
                    // its key's order, as it would have been when read.
                    match self
                        .settle_held(own, &record, &row, None, Some((reason, error)))
                        .await
                    {
                        Step::Done => continue,
                        other => return other,
                    }
                }
            };
            if mode == Release::Skip {
                let (head, reason, error) = match self.head_reason(key).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read the held key's reason; trying again later");
                        return Step::Done;
                    }
                };
                if row.kafka_offset < head {
                    // A copy delivered again below the head (a reset): applied (a duplicate,
                    // as a rule); the head is still to be skipped.
                    match self.apply_held(own, &record, &m, &row, mode).await {
                        Step::Done => continue,
                        other => return other,
                    }
                }
                match self
                    .settle_held(own, &record, &row, Some(&m), Some((reason, error)))
                    .await
                {
                    Step::Done => {
                        mode = Release::Retry;
                        continue;
                    }
                    other => return other,
                }
            }
            match self.apply_held(own, &record, &m, &row, mode).await {
                Step::Done => continue,
                other => return other,
            }
        }
    }

    /// The next held record of `key` (`None`: cancelled).
    async fn next_held(&self, key: &[u8]) -> Option<Result<Option<Row>, sqlx::Error>> {
        if self.cancel.is_cancelled() {
            return None;
        }
        Some(
            sqlx::query_as(
                "SELECT kafka_offset, record_key, payload, header_names, header_values,
                        kafka_timestamp, bytes, unreadable_header, header_absent
                 FROM postal.held_records
                 WHERE group_id = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4) AND record_key = $4
                 ORDER BY kafka_offset LIMIT 1",
            )
            .bind(&self.shared.config.group)
            .bind(&self.topic)
            .bind(self.partition)
            .bind(key)
            .fetch_optional(&self.shared.pool)
            .await,
        )
    }

    /// Why the held key's head failed: (its offset, reason, error).
    async fn head_reason(&self, key: &[u8]) -> Result<(i64, Reason, String), sqlx::Error> {
        let (offset, reason, error): (i64, String, String) = sqlx::query_as(
            "SELECT head_offset, reason, error FROM postal.held_keys
             WHERE group_id = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4) AND record_key = $4",
        )
        .bind(&self.shared.config.group)
        .bind(&self.topic)
        .bind(self.partition)
        .bind(key)
        .fetch_one(&self.shared.pool)
        .await?;
        Ok((offset, reason_named(&reason), error))
    }

    /// Applies one released held record, retrying as a fresh record is retried; a final
    /// failure makes it the key's head again.
    async fn apply_held(
        &self,
        own: &Ownership,
        record: &Record,
        m: &Meta,
        row: &Row,
        mode: Release,
    ) -> Step {
        let consumer = self.shared.config.consumer.as_str();
        if let Some(error) = crate::record::too_many_headers(record) {
            // As when read from the partition (the head of a key is never such a record:
            // it is dead-lettered, not held): a dead letter keeping every header.
            return self
                .settle_held(
                    own,
                    record,
                    row,
                    Some(m),
                    Some((Reason::Undecodable, error)),
                )
                .await;
        }
        let route = self
            .shared
            .router
            .find(&record.topic, &m.event_type, m.schema_version)
            .cloned();
        let Some(route) = route else {
            return match self.shared.config.unknown_types {
                UnknownTypes::Skip => self.settle_held(own, record, row, None, None).await,
                _ => {
                    let error = format!(
                        "no handler for event type {} (schema version {}) on topic {}",
                        postal_shared::text::quoted(&m.event_type),
                        m.schema_version,
                        postal_shared::text::quoted(&record.topic)
                    );
                    self.settle_held(
                        own,
                        record,
                        row,
                        Some(m),
                        Some((Reason::UnknownType, error)),
                    )
                    .await
                }
            };
        };
        let mut attempts = 0u32;
        let mut outages = 0u32;
        loop {
            if self.cancel.is_cancelled() {
                return Step::Stop;
            }
            let result = self
                .apply_held_once(own, record, m, row, route.as_ref())
                .await;
            let (reason, error) = match result {
                Ok(applied) => {
                    if applied {
                        self.shared.stats.applied(consumer, &record.topic, 1);
                    } else {
                        self.shared.stats.duplicates(consumer, &record.topic, 1);
                    }
                    return Step::Done;
                }
                Err(Attempt::Paused) => return Step::Paused,
                Err(Attempt::OverBound(_)) => return Step::Done,
                Err(Attempt::Fenced) => {
                    self.shared.stats.fenced(consumer, &record.topic, 1);
                    return Step::Fenced;
                }
                Err(Attempt::Unavailable(e)) => {
                    tracing::warn!(error = %e, event_id = %m.id, "database or dependency unavailable while releasing a held key; retrying");
                    if !self.wait(outages).await {
                        return Step::Stop;
                    }
                    outages = outages.saturating_add(1);
                    continue;
                }
                Err(Attempt::Retryable(e)) | Err(Attempt::SessionEnded(e)) => {
                    attempts += 1;
                    if attempts < self.shared.config.max_attempts {
                        self.shared.stats.retries(consumer, &record.topic, 1);
                        if !self.wait(attempts - 1).await {
                            return Step::Stop;
                        }
                        continue;
                    }
                    (
                        Reason::RetriesExhausted,
                        format!("gave up after {attempts} attempts: {e}"),
                    )
                }
                Err(Attempt::Permanent(reason, e)) => {
                    attempts += 1;
                    (reason, e)
                }
            };
            return self
                .rehead(own, record, m, reason, &error, attempts, mode)
                .await;
        }
    }

    /// One transaction applying a released held record: dedup row, body, deletion of its held
    /// row (and of its key's, if it was the last), epoch check. `Ok(true)` applied,
    /// `Ok(false)` duplicate.
    async fn apply_held_once(
        &self,
        own: &Ownership,
        record: &Record,
        m: &Meta,
        row: &Row,
        route: &dyn crate::route::Route,
    ) -> Result<bool, Attempt> {
        let mut tx = self
            .shared
            .begin_for(&record.topic)
            .await
            .map_err(Attempt::db)?;
        let fresh = crate::dedup::record(&mut tx, route.consumer(), m.id)
            .await
            .map_err(|e| match e {
                crate::Error::Database(d) => Attempt::db(d),
                other => Attempt::Retryable(other.to_string()),
            })?;
        if fresh {
            run_body(route, &mut tx, record, m)
                .await
                .map_err(BodyFailure::into_attempt)?;
        }
        let last = self.unhold_in(&mut tx, row).await.map_err(Attempt::db)?;
        self.confirm(&mut tx, own).await?;
        tx.commit().await.map_err(Attempt::db)?;
        if last {
            self.released(&row.record_key);
        }
        Ok(fresh)
    }

    /// Settles a released held record without applying it: dead-letters it (`dead`, with its
    /// dedup row) or skips it (none), deleting its held row, in one transaction.
    async fn settle_held(
        &self,
        own: &Ownership,
        record: &Record,
        row: &Row,
        m: Option<&Meta>,
        dead: Option<(Reason, String)>,
    ) -> Step {
        let mut failures = 0u32;
        loop {
            let result: Result<(bool, bool), Attempt> = async {
                let mut tx = self
                    .shared
                    .begin_for(&record.topic)
                    .await
                    .map_err(Attempt::db)?;
                let mut dead_lettered = false;
                if let Some((reason, error)) = &dead {
                    let fresh = match m {
                        Some(m) => {
                            crate::dedup::record_many(
                                &mut tx,
                                &self.shared.config.consumer,
                                &[m.id],
                            )
                            .await
                            .map_err(Attempt::db)?
                            .len()
                                == 1
                        }
                        None => true,
                    };
                    if fresh {
                        let d = Dead {
                            meta: m,
                            reason: *reason,
                            error,
                            attempts: 0,
                        };
                        self.record_dead(&mut tx, record, d)
                            .await
                            .map_err(Attempt::db)?;
                        dead_lettered = true;
                    }
                }
                let last = self.unhold_in(&mut tx, row).await.map_err(Attempt::db)?;
                self.confirm(&mut tx, own).await?;
                tx.commit().await.map_err(Attempt::db)?;
                Ok((last, dead_lettered))
            }
            .await;
            match result {
                Ok((last, dead_lettered)) => {
                    if dead_lettered {
                        self.shared.stats.dead_letters(
                            &self.shared.config.consumer,
                            &record.topic,
                            1,
                        );
                        self.shared.dlq_wake.notify_one();
                    }
                    if last {
                        self.released(&row.record_key);
                    }
                    return Step::Done;
                }
                Err(Attempt::Paused) => return Step::Paused,
                Err(Attempt::Fenced) => return Step::Fenced,
                Err(
                    Attempt::Unavailable(e)
                    | Attempt::Retryable(e)
                    | Attempt::SessionEnded(e)
                    | Attempt::Permanent(_, e),
                ) => {
                    tracing::warn!(error = %e, "cannot settle a held record; retrying");
                    if !self.wait(failures).await {
                        return Step::Stop;
                    }
                    failures = failures.saturating_add(1);
                }
                Err(Attempt::OverBound(_)) => return Step::Done,
            }
        }
    }

    /// A released held record failed for good again: it is its key's head now (reason,
    /// attempts, the next due retry); the key stays held and its release (`mode`) is done.
    /// An operator's release asked while the retry policy's ran (`mode` is `Policy`; the
    /// operator's ask is the only writer of `released_by`) stays, to be applied next.
    #[allow(clippy::too_many_arguments)]
    async fn rehead(
        &self,
        own: &Ownership,
        record: &Record,
        m: &Meta,
        reason: Reason,
        error: &str,
        attempts: u32,
        mode: Release,
    ) -> Step {
        let mut failures = 0u32;
        loop {
            let result: Result<(), Attempt> = async {
                let mut tx = self
                    .shared
                    .begin_for(&record.topic)
                    .await
                    .map_err(Attempt::db)?;
                sqlx::query(
                    "UPDATE postal.held_keys
                     SET head_offset = $9, reason = $5, error = $6, attempts = attempts + $7,
                         release = CASE WHEN $10 OR released_by IS NULL THEN NULL
                                        ELSE release END,
                         released_by = CASE WHEN $10 THEN NULL ELSE released_by END,
                         due_at = now() + $8 * interval '1 millisecond'
                     WHERE group_id = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4) AND record_key = $4",
                )
                .bind(&self.shared.config.group)
                .bind(&self.topic)
                .bind(self.partition)
                .bind(record.key.as_deref())
                .bind(reason.as_str())
                .bind(postal_shared::text::bounded(
                    error,
                    postal_shared::text::MAX_ERROR_BYTES,
                ))
                .bind(attempts as i32)
                .bind(
                    self.shared
                        .config
                        .hold_retry_after
                        .map(|d| d.as_millis() as f64),
                )
                .bind(record.offset)
                .bind(mode != Release::Policy)
                .execute(&mut *tx)
                .await
                .map_err(Attempt::db)?;
                self.confirm(&mut tx, own).await?;
                tx.commit().await.map_err(Attempt::db)
            }
            .await;
            match result {
                Ok(()) => {
                    tracing::error!(topic = %record.topic, partition = record.partition, offset = record.offset,
                        event_id = %m.id, reason = reason.as_str(),
                        error = %postal_shared::text::bounded(error, postal_shared::text::MAX_ERROR_BYTES),
                        "a released held event failed for good again; its key stays held");
                    return Step::Done;
                }
                Err(Attempt::Paused) => return Step::Paused,
                Err(Attempt::Fenced) => return Step::Fenced,
                Err(Attempt::OverBound(_)) => return Step::Done,
                Err(
                    Attempt::Unavailable(e)
                    | Attempt::Retryable(e)
                    | Attempt::SessionEnded(e)
                    | Attempt::Permanent(_, e),
                ) => {
                    tracing::warn!(error = %e, "cannot record the held key's new head; retrying");
                    if !self.wait(failures).await {
                        return Step::Stop;
                    }
                    failures = failures.saturating_add(1);
                }
            }
        }
    }

    /// Deletes a held record's row in the caller's transaction and takes its bytes off the
    /// group's count; if it was its key's last, deletes the key's row too, else marks the key
    /// as being released (a takeover after a crash goes on applying the rest). `true` if it
    /// was the last.
    async fn unhold_in(&self, conn: &mut PgConnection, row: &Row) -> Result<bool, sqlx::Error> {
        let group = &self.shared.config.group;
        // The bytes taken off are those of the row this transaction deleted: a release run
        // again after its COMMIT's answer was lost (it had committed) deletes nothing and
        // takes nothing off.
        sqlx::query(
            "WITH gone AS (DELETE FROM postal.held_records
                           WHERE group_id = $1 AND topic = $2 AND partition = $3
                             AND kafka_offset = $4
                           RETURNING bytes)
             UPDATE postal.held_bytes
             SET bytes = greatest(bytes - (SELECT sum(bytes) FROM gone), 0)
             WHERE group_id = $1 AND EXISTS (SELECT 1 FROM gone)",
        )
        .bind(group)
        .bind(&self.topic)
        .bind(self.partition)
        .bind(row.kafka_offset)
        .execute(&mut *conn)
        .await?;
        let last: bool = sqlx::query_scalar(
            "WITH rest AS (SELECT EXISTS (SELECT 1 FROM postal.held_records
                               WHERE group_id = $1 AND topic = $2 AND partition = $3
                                 AND key_hash = sha256($4) AND record_key = $4) AS remaining),
                  gone AS (DELETE FROM postal.held_keys
                           WHERE group_id = $1 AND topic = $2 AND partition = $3
                             AND key_hash = sha256($4) AND record_key = $4 AND NOT (SELECT remaining FROM rest)
                           RETURNING 1),
                  -- A skip stays one until the head is settled.
                  going AS (UPDATE postal.held_keys
                            SET release = CASE WHEN release = 'skip' AND $5 < head_offset
                                               THEN 'skip' ELSE 'retry' END
                            WHERE group_id = $1 AND topic = $2 AND partition = $3
                              AND key_hash = sha256($4) AND record_key = $4 AND (SELECT remaining FROM rest)
                            RETURNING 1)
             SELECT NOT (SELECT remaining FROM rest)",
        )
        .bind(group)
        .bind(&self.topic)
        .bind(self.partition)
        .bind(&row.record_key)
        .bind(row.kafka_offset)
        .fetch_one(&mut *conn)
        .await?;
        Ok(last)
    }

    /// The epoch and pause check of a release transaction (its offset stays).
    async fn confirm(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
        own: &Ownership,
    ) -> Result<(), Attempt> {
        let owned = offsets::confirm(
            tx,
            &self.shared.config.group,
            &self.topic,
            self.partition,
            own.epoch,
        )
        .await
        .map_err(Attempt::db)?;
        Attempt::owned(owned)
    }

    /// The key's last held record was settled: its records flow again.
    fn released(&self, key: &[u8]) {
        self.held.lock().expect("held keys").remove(key);
        tracing::info!(topic = %self.topic, partition = self.partition, "held key released: its records flow again");
    }
}

impl Row {
    /// The record as it was read from the partition (what a handler needs of it), as a
    /// consumer with `max_headers` reads it.
    fn record(&self, topic: &str, partition: i32, max_headers: usize) -> Record {
        let (headers, too_many_headers) = Record::read_headers(
            self.header_names
                .iter()
                .zip(&self.header_values)
                .enumerate()
                .map(|(i, (n, v))| {
                    let v = postal_shared::headers::kept_value(v, &self.header_absent, i);
                    (n.clone(), v.map(<[u8]>::to_vec))
                })
                .collect(),
            max_headers,
        );
        Record {
            topic: topic.to_owned(),
            partition,
            offset: self.kafka_offset,
            key: Some(self.record_key.clone()),
            payload: self.payload.clone(),
            weight: self.bytes as usize,
            headers,
            timestamp: self.kafka_timestamp,
            unreadable_header: self.unreadable_header.map(|i| i as usize),
            too_many_headers,
        }
    }
}

/// The [`Reason`] stored under `name`.
fn reason_named(name: &str) -> Reason {
    [
        Reason::Permanent,
        Reason::Undecodable,
        Reason::MissingEventId,
        Reason::UnknownType,
        Reason::Panic,
        Reason::RetriesExhausted,
    ]
    .into_iter()
    .find(|r| r.as_str() == name)
    .unwrap_or(Reason::RetriesExhausted)
}
