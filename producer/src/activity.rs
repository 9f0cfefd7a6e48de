//! The relay's activity per minute and topic — events published, retried and parked, and their
//! end-to-end lag — for the dashboard's charts (`postal.relay_minutes`, migration 0018).
//!
//! Outcomes are tallied in memory as they are recorded, and the running totals are written to
//! the table every [`REPORT_EVERY`] on a connection of their own, never on a claim's
//! transaction: publishing never waits for the table, and a table that cannot be written
//! (locked, database gone) only delays the charts.
//!
//! The totals are written as they stand (a row only grows: `greatest` of the stored and the
//! written value), not added: a write that committed but whose answer was lost, or that was
//! cut off, is simply written again, never counted twice. A minute's totals stay in memory
//! until a write of them as they stand went through, so a cancelled write loses nothing
//! either. A relay killed outright loses its last few seconds of counts; the events
//! themselves are unaffected.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

/// When each claimed row was enqueued (`created_at`), by sequence number.
pub(crate) type Enqueued = HashMap<i64, DateTime<Utc>>;

/// How often a relay adds its tallies to `postal.relay_minutes`.
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(5);

/// How long the rows are kept (the dashboard shows the last hour).
const KEEP: &str = "1 day";

/// Totals of minutes older than this are forgotten while the table cannot be written.
const HELD_MINUTES: i64 = 60;

/// What became of one event in a recorded batch.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Outcome {
    /// Recorded published; when it was enqueued, if known.
    Published(Option<DateTime<Utc>>),
    /// A failed attempt, rescheduled.
    Retried,
    /// Parked as failed.
    Parked,
}

/// One minute of one topic: the running totals, and how many changes they had and had when
/// last written.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    published: i64,
    retried: i64,
    parked: i64,
    lag_events: i64,
    lag_ms_sum: f64,
    lag_ms_max: f64,
    changes: u64,
    written: u64,
}

/// Minute (Unix minutes) → topic → tally.
type Tallies = HashMap<i64, HashMap<String, Tally>>;

/// A written row: its minute, topic and totals.
type Row = (i64, String, Tally);

/// The relay's totals of the minutes not yet written as they stand.
#[derive(Default)]
pub(crate) struct Activity {
    tallies: Mutex<Held>,
}

/// The totals held, and the newest minute already forgotten: an outcome is never tallied into
/// a minute at or before it (its row was written whole; a fresh total from zero would be lost
/// under `greatest`), but into the one after.
#[derive(Default)]
struct Held {
    minutes: Tallies,
    forgotten_through: i64,
}

/// Rows per upsert (each in a transaction of its own, within the statement timeout however
/// many topics and minutes are held).
const WRITE_CHUNK: usize = 1000;

impl Activity {
    /// Tallies recorded outcomes, each with its event's topic, in the current minute.
    pub(crate) fn record<'a>(&self, outcomes: impl IntoIterator<Item = (&'a str, Outcome)>) {
        let mut held = self.tallies.lock().expect("activity lock");
        // The clock is read under the lock: a thread stalled before taking it cannot tally
        // into a minute forgotten meanwhile.
        let now = Utc::now();
        let minute = now
            .timestamp()
            .div_euclid(60)
            .max(held.forgotten_through + 1);
        let tallies = &mut held.minutes;
        let topics = tallies.entry(minute).or_default();
        for (topic, outcome) in outcomes {
            if !topics.contains_key(topic) {
                topics.insert(topic.to_owned(), Tally::default());
            }
            let tally = topics.get_mut(topic).expect("inserted above");
            tally.changes += 1;
            match outcome {
                Outcome::Published(enqueued) => {
                    tally.published += 1;
                    if let Some(at) = enqueued {
                        let ms = (now - at).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e3;
                        let ms = ms.max(0.0);
                        tally.lag_events += 1;
                        tally.lag_ms_sum += ms;
                        tally.lag_ms_max = tally.lag_ms_max.max(ms);
                    }
                }
                Outcome::Retried => tally.retried += 1,
                Outcome::Parked => tally.parked += 1,
            }
        }
        if topics.is_empty() {
            tallies.remove(&minute);
        }
    }

    /// The totals changed since last written, as they stand now.
    fn unwritten(&self) -> Vec<Row> {
        let held = self.tallies.lock().expect("activity lock");
        held.minutes
            .iter()
            .flat_map(|(minute, topics)| {
                topics
                    .iter()
                    .filter(|(_, t)| t.changes != t.written)
                    .map(|(topic, t)| (*minute, topic.clone(), *t))
            })
            .collect()
    }

    /// `rows` are in the table as they stood: marks them written.
    fn written(&self, rows: &[Row]) {
        let mut held = self.tallies.lock().expect("activity lock");
        for (minute, topic, snapshot) in rows {
            if let Some(t) = held.minutes.get_mut(minute).and_then(|m| m.get_mut(topic)) {
                t.written = t.written.max(snapshot.changes);
            }
        }
    }

    /// Forgets the minutes that are over and written whole, and those older than
    /// [`HELD_MINUTES`] whatever their state (the table could not be written for that long:
    /// memory stays bounded by the topics of the last hour).
    fn forget(&self) {
        let now = Utc::now().timestamp().div_euclid(60);
        let mut held = self.tallies.lock().expect("activity lock");
        let mut newest_forgotten = held.forgotten_through;
        held.minutes.retain(|minute, topics| {
            let keep = *minute >= now - HELD_MINUTES
                && (*minute >= now || topics.values().any(|t| t.changes != t.written));
            if !keep {
                newest_forgotten = newest_forgotten.max(*minute);
            }
            keep
        });
        held.forgotten_through = newest_forgotten;
    }

    /// Writes the totals changed since last written to `postal.relay_minutes` as `relay`'s,
    /// [`WRITE_CHUNK`] rows per transaction, each bounded by a statement and lock timeout.
    /// Whatever is not known to be written (an error, or this future dropped) is written by a
    /// later call. Returns the rows written.
    pub(crate) async fn flush(&self, pool: &PgPool, relay: Uuid) -> Result<usize, sqlx::Error> {
        self.forget();
        let rows = self.unwritten();
        for chunk in rows.chunks(WRITE_CHUNK) {
            write(pool, relay, chunk).await?;
            self.written(chunk);
        }
        self.forget();
        Ok(rows.len())
    }
}

/// The opening of every transaction here: `BEGIN` with a statement and lock timeout, so that
/// a table locked by someone else fails the write after a second instead of keeping the
/// relay's background work waiting.
const BEGIN: &str = "BEGIN; SET LOCAL statement_timeout = '2s'; SET LOCAL lock_timeout = '1s'";

/// One upsert of `rows` as `relay`'s rows, each written as it stands.
async fn write(pool: &PgPool, relay: Uuid, rows: &[Row]) -> Result<(), sqlx::Error> {
    let mut minutes = Vec::with_capacity(rows.len());
    let mut topics = Vec::with_capacity(rows.len());
    let mut counts: [Vec<i64>; 4] = Default::default();
    let mut lag_sums = Vec::with_capacity(rows.len());
    let mut lag_maxes = Vec::with_capacity(rows.len());
    for (minute, topic, t) in rows {
        minutes.push(DateTime::<Utc>::from_timestamp(minute * 60, 0).unwrap_or_default());
        topics.push(topic.as_str());
        counts[0].push(t.published);
        counts[1].push(t.retried);
        counts[2].push(t.parked);
        counts[3].push(t.lag_events);
        lag_sums.push(t.lag_ms_sum);
        lag_maxes.push(t.lag_ms_max);
    }
    let [published, retried, parked, lag_events] = counts;
    // Cancel-safe: a relay stopping cuts this task off, possibly mid-`BEGIN`, and the pool
    // may be the application's.
    let mut tx = postal_shared::cancel_safe::begin_with(pool, BEGIN.into()).await?;
    sqlx::query(
        "INSERT INTO postal.relay_minutes AS r
             (minute, relay_id, topic, published, retried, parked, lag_events, lag_ms_sum, lag_ms_max)
         SELECT u.minute, $1, u.topic, u.published, u.retried, u.parked, u.lag_events,
                u.lag_ms_sum, u.lag_ms_max
         FROM unnest($2::timestamptz[], $3::text[], $4::int8[], $5::int8[], $6::int8[],
                     $7::int8[], $8::float8[], $9::float8[])
              AS u(minute, topic, published, retried, parked, lag_events, lag_ms_sum, lag_ms_max)
         ON CONFLICT (minute, relay_id, topic) DO UPDATE SET
             published = greatest(r.published, excluded.published),
             retried = greatest(r.retried, excluded.retried),
             parked = greatest(r.parked, excluded.parked),
             lag_events = greatest(r.lag_events, excluded.lag_events),
             lag_ms_sum = greatest(r.lag_ms_sum, excluded.lag_ms_sum),
             lag_ms_max = greatest(r.lag_ms_max, excluded.lag_ms_max)",
    )
    .bind(relay)
    .bind(&minutes)
    .bind(&topics)
    .bind(&published)
    .bind(&retried)
    .bind(&parked)
    .bind(&lag_events)
    .bind(&lag_sums)
    .bind(&lag_maxes)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Deletes rows older than a day (the relays' housekeeping), bounded like [`Activity::flush`];
/// returns how many.
pub(crate) async fn prune(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let mut tx = postal_shared::cancel_safe::begin_with(pool, BEGIN.into()).await?;
    let done = sqlx::query(&format!(
        "DELETE FROM postal.relay_minutes WHERE minute < now() - interval '{KEEP}'"
    ))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(done.rows_affected())
}

/// Writes `activity` to the table every [`REPORT_EVERY`], and once more when `stop` is
/// cancelled, then returns (the relay's background task; the relay waits for it, bounded, as
/// it stops). A write under way finishes before that last one: cut off, it could still hold
/// the rows' locks on the server while the last write waits for them. A failure is logged
/// when the first write fails and again when writing works again, not at every try.
pub(crate) async fn report(
    activity: std::sync::Arc<Activity>,
    pool: PgPool,
    relay: Uuid,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut tick = tokio::time::interval(REPORT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        let last = tokio::select! {
            _ = tick.tick() => false,
            () = stop.cancelled() => true,
        };
        match activity.flush(&pool, relay).await {
            Ok(_) if failing => {
                failing = false;
                tracing::info!("the relay's activity is recorded for the dashboard again");
            }
            Ok(_) => {}
            Err(e) => {
                metrics::counter!("postal_relay_check_failures_total", "check" => "activity")
                    .increment(1);
                if !failing {
                    failing = true;
                    tracing::warn!(error = %e, "could not record the relay's activity for the dashboard's charts (publishing goes on); keeping it in memory and retrying every 5 s");
                }
            }
        }
        if last {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tallies_outcomes_per_topic_with_their_lag() {
        let a = Activity::default();
        let enqueued = Utc::now() - chrono::Duration::milliseconds(250);
        a.record([
            ("orders", Outcome::Published(Some(enqueued))),
            ("orders", Outcome::Published(None)),
            ("orders", Outcome::Retried),
            ("invoices", Outcome::Parked),
        ]);
        let held = a.tallies.lock().unwrap();
        let minute = held.minutes.values().next().expect("one minute");
        let orders = minute["orders"];
        assert_eq!((orders.published, orders.retried, orders.parked), (2, 1, 0));
        assert_eq!(
            orders.lag_events, 1,
            "only the event with a known enqueue time"
        );
        assert!(
            (250.0..10_000.0).contains(&orders.lag_ms_sum),
            "{}",
            orders.lag_ms_sum
        );
        assert_eq!(orders.lag_ms_max, orders.lag_ms_sum);
        assert_eq!(minute["invoices"].parked, 1);
    }

    #[test]
    fn totals_are_written_as_they_stand_until_a_write_of_them_went_through() {
        let a = Activity::default();
        a.record([("orders", Outcome::Published(None))]);
        let first = a.unwritten();
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].2.published, 1);
        // A write that failed or was cut off: nothing is marked, the same totals go again.
        assert_eq!(a.unwritten()[0].2.published, 1);
        // More outcomes while a write is under way: that write does not cover them.
        a.record([("orders", Outcome::Published(None))]);
        a.written(&first);
        let second = a.unwritten();
        assert_eq!(second.len(), 1, "changed since the write");
        assert_eq!(
            second[0].2.published, 2,
            "the running total, not the difference"
        );
        a.written(&second);
        assert!(a.unwritten().is_empty());
        // The current minute stays (it may grow), written.
        a.forget();
        assert_eq!(a.tallies.lock().unwrap().minutes.len(), 1);
    }

    #[test]
    fn minutes_unwritten_for_an_hour_are_forgotten_and_never_tallied_into_again() {
        let a = Activity::default();
        let now = Utc::now().timestamp().div_euclid(60);
        a.tallies.lock().unwrap().minutes.insert(
            now - HELD_MINUTES - 1,
            HashMap::from([(
                "orders".to_owned(),
                Tally {
                    published: 5,
                    changes: 5,
                    ..Tally::default()
                },
            )]),
        );
        a.forget();
        assert!(a.unwritten().is_empty(), "bounded while writes fail");
        // A minute forgotten (here: one still running, as if the clock stepped back) is never
        // tallied into again: its row may hold more than a fresh total from zero.
        a.tallies.lock().unwrap().forgotten_through = now + 2;
        a.record([("orders", Outcome::Retried)]);
        let rows = a.unwritten();
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].0, rows[0].2.retried), (now + 3, 1));
    }

    #[test]
    fn an_empty_batch_tallies_nothing() {
        let a = Activity::default();
        a.record([]);
        assert!(a.tallies.lock().unwrap().minutes.is_empty());
    }
}
