//! Held keys ([`FinalFailure::HoldKey`](crate::FinalFailure)): an event that failed for good
//! is stored with every later record of its key, in the transactions that move the offset
//! past them, and none of them is applied until the key is released.
//!
//! The partition's owner is the only writer of its held keys' records: it holds them here, and
//! applies them when released (`release`); past the group's byte bound it waits. The set of
//! held keys of the partition is read at each takeover and kept in memory ([`Worker::held`]):
//! only this worker changes it while it owns the partition.

use std::collections::HashSet;

use rdkafka::consumer::Consumer;
use sqlx::PgConnection;

use crate::config::FinalFailure;
use crate::dead_letter::Reason;
use crate::offsets::{self, Ownership};
use crate::record::{Meta, Record};

use super::{tpl, Owned, Step, Worker};

/// Why a held key's head failed, as stored with the key.
#[derive(Clone, Copy)]
pub(crate) struct Head<'a> {
    pub reason: Reason,
    pub error: &'a str,
    pub attempts: i32,
}

/// What holding a record found.
pub(crate) enum Held {
    /// Stored (and counted against the group's bound).
    Stored,
    /// Held already (a copy delivered again, or a hold run again after its COMMIT's answer
    /// was lost): nothing stored, nothing counted.
    Again,
    /// Not stored: the group's held bytes would pass `held_bytes_limit` (the record's bytes).
    OverBound(i64),
}

impl Worker {
    /// Whether records of `key` are held on this partition now.
    pub(crate) fn is_held(&self, key: Option<&[u8]>) -> bool {
        key.is_some_and(|k| self.held.lock().expect("held keys").contains(k))
    }

    /// The held keys of this partition, as a copy (for a batch transaction, which adds the
    /// keys it holds to its own copy until it commits).
    pub(crate) fn held_keys(&self) -> HashSet<Vec<u8>> {
        self.held.lock().expect("held keys").clone()
    }

    /// Adds keys held by a committed transaction.
    pub(crate) fn now_held(&self, keys: impl IntoIterator<Item = Vec<u8>>) {
        self.held.lock().expect("held keys").extend(keys);
    }

    /// What to do with `record`'s event, which failed for good in `handler`: hold its key
    /// (when configured and the record has a key and an envelope) or dead-letter it.
    pub(crate) fn holds(
        &self,
        record: &Record,
        meta: Option<&Meta>,
        handler: Option<&str>,
    ) -> bool {
        meta.is_some()
            && record.key.is_some()
            && record.too_many_headers.is_none()
            && self.shared.config.final_failure_of(handler) == FinalFailure::HoldKey
    }

    /// Reads the partition's held keys (at a takeover: the previous owner's holds committed
    /// before the claim that fenced it). `false` if cancelled meanwhile.
    pub(crate) async fn load_held(&self) -> bool {
        let mut failures = 0u32;
        loop {
            let keys: Result<Vec<Vec<u8>>, sqlx::Error> = sqlx::query_scalar(
                "SELECT record_key FROM postal.held_keys
                 WHERE group_id = $1 AND topic = $2 AND partition = $3",
            )
            .bind(&self.shared.config.group)
            .bind(&self.topic)
            .bind(self.partition)
            .fetch_all(&self.shared.pool)
            .await;
            match keys {
                Ok(keys) => {
                    if !keys.is_empty() {
                        tracing::info!(topic = %self.topic, partition = self.partition, keys = keys.len(), "partition taken over with held keys: their records stay held until released");
                    }
                    *self.held.lock().expect("held keys") = keys.into_iter().collect();
                    return true;
                }
                Err(sqlx::Error::Database(d))
                    if d.code().as_deref() == Some("42501") && !self.shared.config.may_hold() =>
                {
                    // A role granted before migration 32 (`postal grant --consumer` again
                    // grants it), on a consumer that never holds: as before held keys existed.
                    tracing::warn!(topic = %self.topic, partition = self.partition, "no right to read postal.held_keys (run `postal grant --consumer` again); this consumer holds no keys, so it goes on without them");
                    self.held.lock().expect("held keys").clear();
                    return true;
                }
                Err(e) => {
                    tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "cannot read the held keys; retrying");
                    if !self.wait(failures).await {
                        return false;
                    }
                    failures = failures.saturating_add(1);
                }
            }
        }
    }

    /// Stores `record` as held in the caller's transaction (which also moves the offset past
    /// it); with `head`, its key becomes held with it as the head. Its dedup row is not
    /// written: it is written when the record is applied. A record without a readable
    /// envelope (`meta` is `None`: no `ce_id`, a header name that is not UTF-8, …) of a held
    /// key is held too, whole, and dead-lettered in its key's order at the release: as read
    /// from the partition then.
    ///
    /// `already`: the bytes the caller's transaction holds so far. A group that held nothing
    /// before the transaction takes all of the transaction's holds, however many bytes: else
    /// a batch whose holds together pass the bound would be refused for ever, with nothing
    /// held whose release could make room.
    ///
    /// Run again after a COMMIT whose answer was lost (it had committed), it finds its rows
    /// and holds nothing twice; a row of another event at the record's offset (a log replaced
    /// under held records that no reset cleared) is an error, never taken for a copy.
    pub(crate) async fn hold_in(
        &self,
        conn: &mut PgConnection,
        record: &Record,
        meta: Option<&Meta>,
        head: Option<Head<'_>>,
        already: i64,
    ) -> Result<Held, sqlx::Error> {
        let config = &self.shared.config;
        let key = record.key.as_deref().expect("held records have a key");
        let bytes = record.weight as i64;
        if let Some(h) = head {
            sqlx::query(
                "INSERT INTO postal.held_keys (group_id, topic, partition, record_key, head_offset,
                     consumer_name, reason, error, attempts, due_at, dlq_topic)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9,
                         now() + $10 * interval '1 millisecond', $11)
                 ON CONFLICT (group_id, topic, partition, key_hash) DO NOTHING",
            )
            .bind(&config.group)
            .bind(&record.topic)
            .bind(record.partition)
            .bind(key)
            .bind(record.offset)
            .bind(&config.consumer)
            .bind(h.reason.as_str())
            .bind(postal_shared::text::bounded(
                h.error,
                postal_shared::text::MAX_ERROR_BYTES,
            ))
            .bind(h.attempts)
            .bind(config.hold_retry_after.map(|d| d.as_millis() as f64))
            .bind(format!("{}{}", record.topic, config.dlq_suffix))
            .execute(&mut *conn)
            .await?;
        }
        // As a dead letter keeps them (`crate::dead_letter::record`): a header without a value
        // keeps an empty one in `header_values` and its position, from 1, in `header_absent`.
        // A record over `max_headers` is kept whole too (its headers packed since it was
        // read): rebuilt at the release as read then, it is dead-lettered as undecodable.
        let mut absent: Vec<i32> = Vec::new();
        let mut keep = |(i, (n, v)): (usize, (&str, Option<&[u8]>))| {
            if v.is_none() {
                absent.push(i as i32 + 1);
            }
            (n.to_owned(), v.unwrap_or_default().to_vec())
        };
        let (names, values): (Vec<String>, Vec<Vec<u8>>) = match &record.too_many_headers {
            Some(all) => all.iter().enumerate().map(&mut keep).unzip(),
            None => record.headers.iter().enumerate().map(&mut keep).unzip(),
        };
        // A copy delivered again (a `postal consumer reset` below it) is held once.
        let inserted = sqlx::query(
            "INSERT INTO postal.held_records (group_id, topic, partition, kafka_offset, record_key,
                 event_id, event_type, payload, header_names, header_values, kafka_timestamp, bytes,
                 unreadable_header, header_absent)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
             ON CONFLICT DO NOTHING",
        )
        .bind(&config.group)
        .bind(&record.topic)
        .bind(record.partition)
        .bind(record.offset)
        .bind(key)
        // No envelope: the nil UUID (never an event's id), so that binaries before migration
        // 36 list such a row as they list any other.
        .bind(meta.map_or(uuid::Uuid::nil(), |m| m.id.as_uuid()))
        .bind(postal_shared::text::storable(
            meta.map(|m| m.event_type.as_str())
                .or_else(|| record.headers.get(postal_shared::headers::CE_TYPE))
                .unwrap_or_default(),
        ))
        .bind(record.payload.as_deref())
        .bind(names)
        .bind(values)
        .bind(record.timestamp)
        .bind(bytes)
        .bind(record.unreadable_header.map(|i| i as i32))
        .bind(absent)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        if inserted == 0 {
            let stored: Option<uuid::Uuid> = sqlx::query_scalar(
                "SELECT event_id FROM postal.held_records
                 WHERE group_id = $1 AND topic = $2 AND partition = $3 AND kafka_offset = $4",
            )
            .bind(&config.group)
            .bind(&record.topic)
            .bind(record.partition)
            .bind(record.offset)
            .fetch_optional(&mut *conn)
            .await?;
            let id = meta.map_or(uuid::Uuid::nil(), |m| m.id.as_uuid());
            if stored.is_some_and(|s| s != id) {
                // Proof that the log was replaced (a topic deleted and re-created that the
                // watermarks could not show): the topic is stopped for the group, as for a
                // stored offset above the high watermark, so that `postal status` shows it and
                // `postal consumer reset` treats the log as replaced (the old log's held
                // records become dead letters).
                let stop = crate::replaced::Stop {
                    partition: record.partition,
                    stored_offset: record.offset,
                    low_watermark: -1,
                    high_watermark: -1,
                };
                if let Err(e) =
                    crate::replaced::record(&self.shared.pool, &config.group, &record.topic, stop)
                        .await
                {
                    tracing::warn!(error = %e, topic = %record.topic, partition = record.partition, "cannot record the topic's stop in postal.consumer_stops");
                }
                return Err(sqlx::Error::Protocol(format!(
                    "offset {} of {} partition {} already holds another event ({}): the topic's log was replaced under held records, and the topic is stopped; stop the group's consumers, then `postal consumer reset --to earliest --execute` dead-letters the old log's held records",
                    record.offset,
                    postal_shared::text::quoted(&record.topic),
                    record.partition,
                    stored.unwrap_or_default()
                )));
            }
            return Ok(Held::Again);
        }
        // A group that held nothing before this transaction takes its holds, however large
        // (see `already`): else a record, or a batch's records, larger than the bound would
        // wait forever.
        let within: Option<i64> = sqlx::query_scalar(
            "INSERT INTO postal.held_bytes AS b (group_id, bytes) VALUES ($1, $2)
             ON CONFLICT (group_id) DO UPDATE SET bytes = b.bytes + EXCLUDED.bytes
                 WHERE b.bytes = $4 OR b.bytes + EXCLUDED.bytes <= $3
             RETURNING bytes",
        )
        .bind(&config.group)
        .bind(bytes)
        .bind(i64::try_from(config.held_bytes_limit).unwrap_or(i64::MAX))
        .bind(already)
        .fetch_optional(&mut *conn)
        .await?;
        if within.is_none() {
            // The caller rolls the transaction back (the rows above with it).
            return Ok(Held::OverBound(bytes));
        }
        if let (Some(h), Some(m)) = (head, meta) {
            tracing::error!(
                topic = %record.topic, partition = record.partition, offset = record.offset,
                event_id = %m.id, reason = h.reason.as_str(),
                error = %postal_shared::text::bounded(h.error, postal_shared::text::MAX_ERROR_BYTES),
                "failed for good; its key is held: its later records wait until it is released (postal held release)"
            );
        }
        metrics::counter!("postal_consumer_held_total", "consumer" => config.consumer.clone(), "topic" => record.topic.clone())
            .increment(1);
        Ok(Held::Stored)
    }

    /// Holds `record` (with `head`: as its key's head) in the transaction that moves the
    /// offset past it, retrying database failures.
    pub(crate) async fn hold(
        &self,
        own: &Ownership,
        record: &Record,
        meta: Option<&Meta>,
        head: Option<Head<'_>>,
    ) -> Step {
        let mut failures = 0u32;
        loop {
            let result: Result<(offsets::Advance, Option<i64>), sqlx::Error> = async {
                let mut tx = self.shared.begin_for(&record.topic).await?;
                if let Held::OverBound(bytes) = self.hold_in(&mut tx, record, meta, head, 0).await?
                {
                    return Ok((offsets::Advance::Advanced, Some(bytes)));
                }
                let owned = offsets::advance(
                    &mut tx,
                    &self.shared.config.group,
                    &record.topic,
                    record.partition,
                    own.epoch,
                    record.offset + 1,
                )
                .await?;
                if owned == offsets::Advance::Advanced {
                    tx.commit().await?;
                }
                Ok((owned, None))
            }
            .await;
            match result {
                Ok((_, Some(need))) => return Step::OverBound(need),
                Ok((offsets::Advance::Advanced, None)) => {
                    if head.is_some() {
                        self.now_held(record.key.clone());
                    }
                    return Step::Done;
                }
                Ok((offsets::Advance::Paused, _)) => return Step::Paused,
                Ok((offsets::Advance::Fenced, _)) => {
                    self.shared
                        .stats
                        .fenced(&self.shared.config.consumer, &record.topic, 1);
                    return Step::Fenced;
                }
                Err(e) => {
                    tracing::warn!(error = %e, topic = %record.topic, partition = record.partition, offset = record.offset, "cannot hold the record; retrying");
                    if !self.wait(failures).await {
                        return Step::Stop;
                    }
                    failures = failures.saturating_add(1);
                }
            }
        }
    }

    /// An event failed for good in `handler`: holds its key or dead-letters it.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn failed_for_good(
        &self,
        own: &Ownership,
        record: &Record,
        meta: Option<&Meta>,
        handler: Option<&str>,
        reason: Reason,
        error: &str,
        attempts: i32,
    ) -> Step {
        match meta {
            Some(m) if self.holds(record, meta, handler) => {
                let head = Head {
                    reason,
                    error,
                    attempts,
                };
                self.hold(own, record, Some(m), Some(head)).await
            }
            _ => {
                self.dead_letter(own, record, meta, reason, error, attempts)
                    .await
            }
        }
    }

    /// A hold would take the group past `held_bytes_limit`: stops fetching from the
    /// partition, drops what was fetched (`taken`, and what arrives: read again later), says
    /// so, and waits — applying releases meanwhile — until what the refused transaction
    /// would have held (`need` bytes) fits: the group holds nothing, or at most the bound
    /// less `need` (`hold_in`'s rule). Then the partition is taken over again from the stored
    /// offset. Nothing is dropped for good. (Resuming as soon as the group was below the
    /// bound took the partition over, and refused the same hold, every `held_poll`.)
    pub(super) async fn over_bound(
        &mut self,
        own: &Ownership,
        lowest: Option<i64>,
        need: i64,
    ) -> Owned {
        {
            let mut paused = self.paused.lock().expect("pause flag");
            if self
                .shared
                .consumer
                .pause(&tpl(&self.topic, self.partition))
                .is_ok()
            {
                *paused = true;
            }
        }
        let config = &self.shared.config;
        tracing::warn!(group = %config.group, topic = %self.topic, partition = self.partition, limit = config.held_bytes_limit,
            "the group's held records reached held_bytes_limit: the partition waits (nothing is dropped) until held keys are released (postal held list / release)");
        let gauge = metrics::gauge!("postal_consumer_held_full", "group" => config.group.clone(), "consumer" => config.consumer.clone(), "topic" => self.topic.clone(), "partition" => self.partition.to_string());
        gauge.set(1.0);
        self.shared.stats.held_full(true);
        let poll = config.held_poll;
        let limit = i64::try_from(config.held_bytes_limit).unwrap_or(i64::MAX);
        let ended = loop {
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break Owned::Ended,
                r = self.rx.recv() => match r {
                    Some(r) => {
                        self.queued.sub(1, r.weight);
                        self.shared.stats.buffered(-(r.weight as i64));
                        continue;
                    }
                    None => break Owned::Ended,
                },
                _ = tokio::time::sleep(poll) => {}
            }
            // Nothing else of the partition is taken meanwhile: releases go on to their end.
            let step = loop {
                match self.apply_releases(own).await {
                    (Step::Done, true) => {}
                    (step, _) => break step,
                }
            };
            match step {
                Step::Done => {}
                Step::Fenced => break Owned::Fenced(lowest),
                Step::Stop => break Owned::Ended,
                Step::Paused | Step::OverBound(_) => {}
            }
            let held: Result<Option<i64>, sqlx::Error> =
                sqlx::query_scalar("SELECT bytes FROM postal.held_bytes WHERE group_id = $1")
                    .bind(&self.shared.config.group)
                    .fetch_optional(&self.shared.pool)
                    .await;
            if matches!(held, Ok(b) if b.unwrap_or(0) == 0 || b.unwrap_or(0).saturating_add(need) <= limit)
            {
                tracing::info!(topic = %self.topic, partition = self.partition, "the group's held records leave room under held_bytes_limit again: the partition resumes");
                break Owned::Resumed(lowest);
            }
        };
        gauge.set(0.0);
        self.shared.stats.held_full(false);
        self.queued.waiting.advanced();
        ended
    }
}
