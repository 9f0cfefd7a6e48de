//! Dead letters: written in the transaction that moves the partition past their record.

use crate::dead_letter::{self, DeadLetter, Reason};
use crate::offsets::{self, Ownership};
use crate::record::{Meta, Record};

use super::{Step, Worker};

impl Worker {
    /// Records a dead letter in the transaction that advances the offset past it.
    pub(super) async fn dead_letter(
        &self,
        own: &Ownership,
        record: &Record,
        meta: Option<&Meta>,
        reason: Reason,
        error: &str,
        attempts: i32,
    ) -> Step {
        let dead = Dead {
            meta,
            reason,
            error,
            attempts,
        };
        match self.write_with_retry(own, record, Some(dead)).await {
            Written::DeadLetter => {
                self.shared
                    .stats
                    .dead_letters(&self.shared.config.consumer, &record.topic, 1);
                self.shared.dlq_wake.notify_one();
                Step::Done
            }
            Written::Duplicate => {
                self.shared
                    .stats
                    .duplicates(&self.shared.config.consumer, &record.topic, 1);
                Step::Done
            }
            Written::Offset => Step::Done,
            Written::Stop => Step::Stop,
            Written::Fenced => Step::Fenced,
            Written::Paused => Step::Paused,
        }
    }

    /// Records the dead letter (if any) and the offset advance in one transaction, retrying
    /// database failures until it commits, the worker is cancelled, or the partition is fenced.
    ///
    /// A dead letter with an event id also gets the event's dedup row, in the same
    /// transaction: a copy of the event at a later offset is then a duplicate, never applied
    /// after the events that followed it (replaying a dead letter, `postal dead-letters
    /// replay`, removes that row on purpose). If the row is there already, another copy of
    /// the event was applied meanwhile: the record is a duplicate, not a dead letter.
    pub(super) async fn write_with_retry(
        &self,
        own: &Ownership,
        record: &Record,
        dead: Option<Dead<'_>>,
    ) -> Written {
        let mut failures = 0u32;
        loop {
            let result: Result<(offsets::Advance, Written), sqlx::Error> = async {
                let mut tx = self.shared.begin_for(&record.topic).await?;
                let mut written = Written::Offset;
                if let Some(d) = dead {
                    let fresh = match d.meta {
                        Some(m) => {
                            crate::dedup::record_many(
                                &mut tx,
                                &self.shared.config.consumer,
                                &[m.id],
                            )
                            .await?
                            .len()
                                == 1
                        }
                        None => true,
                    };
                    if fresh {
                        self.record_dead(&mut tx, record, d).await?;
                        written = Written::DeadLetter;
                    } else {
                        written = Written::Duplicate;
                    }
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
                Ok((owned, written))
            }
            .await;
            match result {
                Ok((offsets::Advance::Advanced, written)) => return written,
                Ok((offsets::Advance::Paused, _)) => return Written::Paused,
                Ok((offsets::Advance::Fenced, _)) => {
                    self.shared
                        .stats
                        .fenced(&self.shared.config.consumer, &record.topic, 1);
                    return Written::Fenced;
                }
                Err(e) => {
                    tracing::warn!(error = %e, topic = %record.topic, partition = record.partition, offset = record.offset, "cannot record the outcome; retrying");
                    if !self.wait(failures).await {
                        return Written::Stop;
                    }
                    failures = failures.saturating_add(1);
                }
            }
        }
    }
}

/// What [`Worker::write_with_retry`] committed.
pub(super) enum Written {
    /// The offset advance only.
    Offset,
    /// The dead letter (with its event's dedup row) and the offset advance.
    DeadLetter,
    /// The offset advance: the event was applied from another copy meanwhile.
    Duplicate,
    /// Nothing: cancelled.
    Stop,
    /// Nothing: another owner's claim bumped the epoch.
    Fenced,
    /// Nothing: the group or topic is paused.
    Paused,
}

/// What a dead letter says about its record.
#[derive(Clone, Copy)]
pub(crate) struct Dead<'a> {
    pub meta: Option<&'a Meta>,
    pub reason: Reason,
    pub error: &'a str,
    pub attempts: i32,
}

impl Worker {
    /// Inserts the dead letter of `record` in the caller's transaction (which also moves the
    /// partition past it) and logs it.
    pub(crate) async fn record_dead(
        &self,
        conn: &mut sqlx::PgConnection,
        record: &Record,
        d: Dead<'_>,
    ) -> Result<(), sqlx::Error> {
        let config = &self.shared.config;
        let dlq_topic = format!("{}{}", record.topic, config.dlq_suffix);
        dead_letter::record(
            conn,
            DeadLetter {
                consumer: &config.consumer,
                group: &config.group,
                record,
                event_id: d.meta.map(|m| m.id.as_uuid()),
                event_type: d.meta.map(|m| m.event_type.as_str()),
                reason: d.reason,
                error: d.error,
                attempts: d.attempts,
                dlq_topic: &dlq_topic,
            },
        )
        .await?;
        tracing::error!(
            topic = %record.topic, partition = record.partition, offset = record.offset,
            event_id = ?d.meta.map(|m| m.id), reason = d.reason.as_str(),
            error = %postal_shared::text::bounded(d.error, postal_shared::text::MAX_ERROR_BYTES),
            "dead-lettered; the partition moves on"
        );
        Ok(())
    }
}
