//! Claiming committed outbox rows for publishing.
//!
//! A claim is an open transaction that took its rows with `FOR UPDATE SKIP LOCKED`, so
//! concurrent relays skip them. In the default mode the claim deletes the rows right away
//! (uncommitted): when the broker acknowledges, committing is all that is left, so each
//! published row costs one write; rows that failed are written back, rescheduled or parked, in
//! the same transaction ([`Claim::complete`]). When published rows are kept, the claim only
//! locks them and completion marks them. If the relay dies, its connection closes and the
//! transaction rolls back: the rows are back at once, unchanged.
//!
//! Because a claim's rows are skipped by every other claim, a claim must never outlive its
//! relay's ownership of their key partitions, or the next owner would publish a key's later
//! events before the claimed earlier ones. The fence ([`crate::fence`]): the claim holds a
//! shared advisory lock on each of its partitions for its transaction's whole life, taken
//! before it checks its leases, and a relay takes a partition over only with the exclusive
//! lock, terminating the backends of claims whose partition lease expired. This holds whatever
//! the claim's backend is doing (idle, blocked writing to a frozen client, waiting on a
//! relation lock). In addition, a claim idle for half the lease is ended by PostgreSQL
//! (`idle_in_transaction_session_timeout`), its session gets `tcp_user_timeout` for the same
//! time, completion re-checks ownership before it commits ([`Claim::complete`]), and the relay
//! hands rows over only before the claim's send deadline ([`Claim::send_deadline_passed`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use postal_shared::EventId;
use sqlx::{PgPool, Postgres, Transaction};

use crate::config::TopicFilter;
use uuid::Uuid;

use crate::complete::{self, Failure};
use crate::skipped::{self, Skipped};
use crate::transport::OutboundEvent;

pub use crate::lease::KEY_PARTITIONS;

/// Every key partition: what a relay claims from when it is the only one.
#[cfg_attr(not(feature = "test-util"), allow(dead_code))] // the tests' and the bench's (`testing`)
pub fn all_partitions() -> Vec<i16> {
    (0..KEY_PARTITIONS).collect()
}

/// Planner settings for the rest of the claim's transaction (`set_config(…, true)` is
/// transaction-local), as select-list expressions.
///
/// The claim must walk the partial index `outbox_pending_seq_partition` in sequence order and
/// stop after `LIMIT` rows. It orders by `(seq, key_partition)` — the same order, `seq` being
/// unique — which only that index delivers without a sort, so that the planner cannot take the
/// primary key instead and check the partition range in the table, row by row. With
/// statistics that lag behind the table — a backlog committed since the last `ANALYZE`, which
/// is exactly when the relay is busiest — PostgreSQL otherwise picked a bitmap scan of every
/// pending row plus a sort: `postal-bench explain` measured 375.6 ms instead of 8.9 ms for a
/// claim of 2,000 rows out of a fresh 300,000-row backlog (with the previous index on `seq`).
/// A bitmap scan also cannot mark the index entries of deleted rows as dead, so on a busy
/// outbox each claim would revisit all of them until vacuum.
/// Sequential scans are off for the same reason: the claim's check for rows that hold back
/// their key must use the partial index `outbox_held_key_seq`, never read the table. The
/// generic plan is built once per connection instead of planning every claim anew.
macro_rules! plan_settings {
    () => {
        "set_config('enable_sort', 'off', true), set_config('enable_incremental_sort', 'off', true), \
         set_config('enable_bitmapscan', 'off', true), \
         set_config('enable_seqscan', 'off', true), \
         set_config('plan_cache_mode', 'force_generic_plan', true)"
    };
}

/// `SELECT` of the planner settings the relay applies before each claim (see the claim
/// statements); public so that `EXPLAIN` shows the relay's plan.
#[cfg_attr(not(feature = "test-util"), allow(dead_code))] // the tests' and the bench's (`testing`)
pub const PLAN_SETTINGS: &str = concat!("SELECT ", plan_settings!());

/// The names of the columns in [`returned!`], in order: what [`decode`]'s positions mean.
const RETURNED_NAMES: [&str; 16] = [
    "seq",
    "event_id",
    "topic",
    "event_key",
    "event_type",
    "schema_version",
    "occurred_at",
    "content_type",
    "payload",
    "headers",
    "attempts",
    "created_at",
    "last_error",
    "raw_times",
    "skipped",
    "passed",
];

/// A claimed row, decoded by position in the order of the claim statements' column list
/// ([`returned!`]): a claim decodes thousands of rows, and looking each column up by name cost
/// more than the decoding itself. Debug builds (the test suite) check the names once per claim
/// ([`claim`]), so that a reordered column list cannot silently put one text column into
/// another.
pub(crate) fn decode(
    row: &sqlx::postgres::PgRow,
) -> Result<(OutboundEvent, Kept, Option<Skipped>), sqlx::Error> {
    use sqlx::Row as _;
    // Decoded leniently: a stored header whose value is not a string (a row written around
    // `postal.enqueue`) must park its row with the reason, not fail the whole claim.
    let stored: sqlx::types::Json<serde_json::Value> = row.try_get(9)?;
    let headers: Vec<(String, String)> = match stored.0 {
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (postal_shared::headers::not_a_string(&k), other.to_string()),
            })
            .collect(),
        other => vec![(
            postal_shared::headers::not_a_string("(the headers are not a JSON object)"),
            other.to_string(),
        )],
    };
    let seq: i64 = row.try_get(0)?;
    let event_id: Uuid = row.try_get(1)?;
    Ok((
        OutboundEvent {
            seq,
            // Unreachable (the outbox's CHECK constraint forbids the nil id); an error rather
            // than a panic, naming the row.
            id: EventId::from_uuid(event_id).map_err(|e| sqlx::Error::ColumnDecode {
                index: format!("event_id of outbox row {seq}"),
                source: e.into(),
            })?,
            topic: row.try_get(2)?,
            key: row.try_get(3)?,
            event_type: row.try_get(4)?,
            schema_version: row.try_get(5)?,
            occurred_at: row
                .try_get::<Option<DateTime<Utc>>, _>(6)?
                .unwrap_or(DateTime::UNIX_EPOCH),
            content_type: row.try_get(7)?,
            payload: row.try_get(8)?,
            headers,
            attempts: row.try_get(10)?,
        },
        Kept {
            created_at: row
                .try_get::<Option<DateTime<Utc>>, _>(11)?
                .unwrap_or(DateTime::UNIX_EPOCH),
            last_error: row.try_get(12)?,
            raw_times: row.try_get(13)?,
        },
        Skipped::from_column(row.try_get(14)?),
    ))
}

/// The claim's `passed` column: how many rows of other sessions' it passed (the same in every
/// row).
fn passed(row: &sqlx::postgres::PgRow) -> Result<usize, sqlx::Error> {
    use sqlx::Row as _;
    Ok(usize::try_from(row.try_get::<i64, _>(15)?).unwrap_or(0))
}

/// What is needed to write a row back after a failed publish (delete-on-claim mode).
pub(crate) struct Kept {
    created_at: DateTime<Utc>,
    last_error: Option<String>,
    /// `occurred_at|created_at` as stored, when either lies outside the times the relay can
    /// carry (see [`returned!`]): the row is parked and written back with them unchanged.
    raw_times: Option<String>,
}

impl Kept {
    /// When the row was enqueued (its history row keeps it).
    pub(crate) fn created_at(&self) -> DateTime<Utc> {
        self.created_at
    }

    /// Why the row is parked before it is sent, when its `occurred_at` or `created_at` lies
    /// outside the times the relay can carry (written around `enqueue`, e.g. `'infinity'`).
    pub(crate) fn times_refused(&self) -> Option<String> {
        let raw = self.raw_times.as_deref()?;
        let (occurred, created) = raw.split_once('|').unwrap_or((raw, ""));
        Some(format!(
            "occurred_at {occurred:?} or created_at {created:?} lies outside the times Postal can carry (a row written around postal.enqueue): parked; fix the row and requeue it, or discard it"
        ))
    }
}

/// Rows claimed in one open transaction.
pub struct Claim {
    tx: Transaction<'static, Postgres>,
    /// Registered as this relay's while it lives (see `skipped`).
    _own: skipped::OwnClaim,
    events: Vec<OutboundEvent>,
    /// When each claimed row was enqueued, by sequence number (for the end-to-end lag the
    /// relay tallies, [`crate::activity`]).
    enqueued: crate::activity::Enqueued,
    /// `Some` when the rows were deleted at claim time (per row, in claim order).
    deleted: Option<Vec<Kept>>,
    /// Write acknowledged rows into `postal.outbox_history` (delete-on-claim mode only).
    history: bool,
    /// The relay, the key partitions whose leases the claim relied on, and the lease.
    relay: Uuid,
    partitions: Vec<i16>,
    lease: Duration,
    /// The relay's clock: hand the rows over to a transport only before this
    /// ([`Claim::send_deadline_passed`]).
    send_by: std::time::Instant,
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("events", &self.events.len())
            .finish()
    }
}

impl Claim {
    /// The claimed events, in sequence order.
    #[cfg_attr(not(feature = "test-util"), allow(dead_code))] // the tests' and the bench's (`testing`)
    pub fn events(&self) -> &[OutboundEvent] {
        &self.events
    }

    /// Takes out when each claimed row was enqueued, by sequence number.
    pub(crate) fn take_enqueued(&mut self) -> crate::activity::Enqueued {
        std::mem::take(&mut self.enqueued)
    }

    /// Takes the events out (the locks stay held until `complete` or drop).
    pub fn take_events(&mut self) -> Vec<OutboundEvent> {
        std::mem::take(&mut self.events)
    }

    /// Records the outcome in one statement and commits: acknowledged rows are gone (deleted at
    /// claim time, or marked published), failed ones are rescheduled or parked. `batch` is
    /// what [`Claim::take_events`] returned.
    ///
    /// Before it commits, the fence check: the relay must still own every partition of the
    /// claim. If it does not, the transaction rolls back ([`crate::Error::LeaseLost`]): the
    /// rows are published again (consumers drop the duplicates), never lost, and nothing this
    /// relay recorded lands behind a later event that the new owner already published.
    pub async fn complete(
        mut self,
        batch: &[OutboundEvent],
        published: &[i64],
        failures: &[Failure],
    ) -> Result<(), crate::Error> {
        let written = match &self.deleted {
            Some(kept) => {
                let mut r = Ok(());
                if !failures.is_empty() {
                    r = complete::restore(&mut self.tx, batch, kept_view(kept), failures).await;
                }
                if r.is_ok() && self.history {
                    r = complete::archive(&mut self.tx, batch, kept_view(kept), published).await;
                }
                r
            }
            None => complete::mark(&mut self.tx, published, failures).await,
        };
        if let Err(e) = written {
            // Rolled back before this returns: the rows are free again for the next claim.
            let _ = self.tx.rollback().await;
            return Err(e.into());
        }
        self.fence_and_commit().await
    }

    /// The fence check, then the commit: the relay must still own every partition of the
    /// claim, else the transaction rolls back ([`crate::Error::LeaseLost`]). Last, so that the
    /// check is as close to the commit as it can be. (With the claim's partition locks, no
    /// relay can take them over meanwhile; this fences a takeover that bypassed them, e.g. a
    /// relay of an earlier version during a rolling upgrade.)
    async fn fence_and_commit(mut self) -> Result<(), crate::Error> {
        let lost: Result<Vec<i16>, sqlx::Error> = sqlx::query_scalar(
            "SELECT ARRAY(SELECT p FROM unnest($2::int2[]) p
                 WHERE NOT EXISTS (SELECT 1 FROM postal.relay_partitions r
                                   WHERE r.owner = $1 AND r.key_partition = p))",
        )
        .bind(self.relay)
        .bind(&self.partitions)
        .fetch_one(&mut *self.tx)
        .await;
        let lost = match lost {
            Ok(lost) => lost,
            Err(e) => {
                let _ = self.tx.rollback().await;
                return Err(e.into());
            }
        };
        if !lost.is_empty() {
            self.tx.rollback().await?;
            return Err(crate::Error::LeaseLost { partitions: lost });
        }
        Ok(self.tx.commit().await?)
    }

    /// Checks out the rows `seqs` of this claim (keep-published claims only, see
    /// [`crate::Transport::checks_out`]) and commits: each gets the next run number (`runs`),
    /// is marked `running`, holds its key and comes due again `lease` after the claim's start.
    /// A row still marked `running` had its previous run cut off without an outcome (the relay
    /// died, or lost the run lease): that run counts as a failed attempt now, and a row whose
    /// attempts that uses up is parked instead, with that reason (its run number still goes
    /// up, so that the cut-off run can never match it again). Returns `(seq, run, attempts,
    /// parked)` per row. On any error the transaction is rolled back before this returns, so that no later
    /// claim of the relay can run while it still holds the rows.
    pub(crate) async fn check_out(
        mut self,
        seqs: &[i64],
        lease: Duration,
        max_attempts: i32,
    ) -> Result<Vec<(i64, i32, i32, bool)>, crate::Error> {
        let marked: Result<Vec<(i64, i32, i32, bool)>, sqlx::Error> = sqlx::query_as(
            "WITH r AS (
                 SELECT seq, least(attempts::int8 + running::int, 2147483647)::int4 AS attempts,
                        running AND attempts::int8 + 1 >= $3 AS park
                 FROM postal.outbox WHERE seq = ANY($1) AND status = 'pending')
             UPDATE postal.outbox o
             SET runs = least(o.runs::int8 + 1, 2147483647)::int4,
                 attempts = r.attempts,
                 running = NOT r.park,
                 status = CASE WHEN r.park THEN 'failed' ELSE 'pending' END,
                 available_at = CASE WHEN r.park THEN now()
                                     ELSE now() + $2 * interval '1 millisecond' END,
                 held = true,
                 last_error = CASE WHEN r.park
                     THEN format('parked: %s attempts used, the last ended without an outcome (the relay died or lost its run lease); error before: %s',
                                 r.attempts, coalesce(o.last_error, 'none'))
                     ELSE o.last_error END
             FROM r WHERE o.seq = r.seq
             RETURNING o.seq, o.runs, o.attempts, r.park",
        )
        .bind(seqs)
        .bind(lease.as_millis() as i64)
        .bind(max_attempts)
        .fetch_all(&mut *self.tx)
        .await;
        match marked {
            Ok(rows) => {
                self.fence_and_commit().await?;
                Ok(rows)
            }
            Err(e) => {
                let _ = self.tx.rollback().await;
                Err(e.into())
            }
        }
    }

    /// Whether the claim's send deadline has passed by this process's monotonic clock: the
    /// lease its partitions had left when it was claimed (read with the server's clock), less
    /// a quarter of the lease for the hand-over itself. The relay then gives the rows back
    /// unsent ([`Claim::release`]): a process frozen (or starved) between claim and hand-over
    /// must not publish once its leases may have passed to another relay, which would then
    /// have published the same events, and the key's later ones, before it.
    pub fn send_deadline_passed(&self) -> bool {
        std::time::Instant::now() >= self.send_by
    }

    /// History mode: when completed, acknowledged rows are also written into the
    /// day-partitioned `postal.outbox_history` in the same transaction (delete-on-claim
    /// claims only; see [`crate::RelayConfig::history`]).
    pub fn keep_history(&mut self) {
        self.history = self.deleted.is_some();
    }

    /// Keeps the claim's transaction from counting as idle (PostgreSQL ends a claim idle for
    /// half the lease) while the relay still holds the leases of the claim's key partitions.
    /// The relay calls it while a transport is still working on the batch (a slow broker).
    ///
    /// The statement reads the leases with the server's clock and shortens the transaction's
    /// idle limit to what they have left, less a twentieth of the lease: however late it
    /// arrives, it never lets the claim outlive them. Returns `false` when a lease was lost or
    /// has less than that left: the claim can then not be kept idle at all, and the relay must
    /// give the batch up. (The relay gives up earlier by its own clock, with a quarter of the
    /// lease left, so that its work on the batch has stopped well before; this is the hard limit.)
    pub async fn keep_alive(&mut self) -> Result<bool, sqlx::Error> {
        let margin = self.lease / 20;
        let (held, left_ms): (i64, Option<f64>) = sqlx::query_as(
            "WITH l AS (
                 SELECT count(*) AS held,
                        extract(epoch FROM min(lease_until) - clock_timestamp()) * 1000 AS left_ms
                 FROM postal.relay_partitions WHERE owner = $1 AND key_partition = ANY($2))
             SELECT held, left_ms::float8 FROM l,
                    set_config('idle_in_transaction_session_timeout',
                               greatest(1, least($3, coalesce(floor(left_ms), 0) - $4))::bigint
                                   || 'ms',
                               true)",
        )
        .bind(self.relay)
        .bind(&self.partitions)
        .bind((self.lease / 2).as_millis() as i64)
        .bind(margin.as_millis() as i64)
        .fetch_one(&mut *self.tx)
        .await?;
        Ok(held == self.partitions.len() as i64
            && left_ms.is_some_and(|ms| ms > margin.as_millis() as f64))
    }

    /// Gives the rows back without recording anything (they are claimable again at once).
    pub async fn release(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }
}

/// The lease a relay must have left on a partition to claim from it: the longest a claim's
/// transaction lives on after its last statement (half the lease, then PostgreSQL ends it)
/// plus a twentieth of the lease (which also covers the claim statement itself). The check
/// reads the clock when it runs (`clock_timestamp()`), not the transaction's start: a claim
/// whose statements were held up after its `BEGIN` (a lock wait, a slow link, a pooler's
/// queue) must not count on lease time that has already passed. A claim whose relay never
/// sends another statement thus ends before the leases of its partitions run out, and the next
/// owner takes them over without having to terminate it (a claim kept alive shortens its idle
/// limit the same way, [`Claim::keep_alive`]). A claim whose backend stays active past them is
/// held off by the fence (the relay's `fence` module). Relays renew their leases every quarter
/// of the lease, so a healthy relay always has more left.
pub fn lease_reserve(lease: Duration) -> Duration {
    lease / 2 + lease / 20
}

/// How much before the end of its leases (as read at claim time) a claim's rows must have been
/// handed to the transport: a quarter of the lease, the same margin the relay keeps for work in
/// flight (it gives a batch up with a quarter of the lease left unrenewed).
fn send_margin(lease: Duration) -> Duration {
    lease / 4
}

/// Claims up to `limit` publishable rows of the given key partitions that `relay` holds a live
/// lease on (see the `lease` module) and whose fence lock it got (the `fence` module), in sequence
/// order. Returns `None` when there is nothing to publish. The claim's transaction may stay
/// idle for at most half the lease.
///
/// A row is publishable when it is pending, due (not `held`, or `available_at` passed), not
/// claimed by anyone else, and no earlier row of its topic and key holds it back (parked,
/// waiting for a retry, or scheduled for later). Only topics that `topics` lets through are
/// claimed.
#[cfg_attr(not(feature = "test-util"), allow(dead_code))] // the tests' and the bench's (`testing`)
pub async fn claim(
    pool: &PgPool,
    relay: Uuid,
    partitions: &[i16],
    limit: usize,
    lease: Duration,
    delete_on_claim: bool,
    topics: &TopicFilter,
) -> Result<Option<Claim>, sqlx::Error> {
    claim_below(
        pool,
        relay,
        partitions,
        limit,
        lease,
        delete_on_claim,
        topics,
        i64::MAX,
    )
    .await
}

/// [`claim`], of rows whose `seq` is below `below` only: the WAL relay's sweep
/// (`crate::wal::sweep`) leaves the rows its stream has not passed yet to the stream. A bound
/// on `seq` keeps every key's order: a key's earlier rows have lower sequence numbers, so a
/// row below the bound has all of its key's earlier rows below it too (a bound on a time would
/// not: `created_at` is the start of the writer's transaction).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn claim_below(
    pool: &PgPool,
    relay: Uuid,
    partitions: &[i16],
    limit: usize,
    lease: Duration,
    delete_on_claim: bool,
    topics: &TopicFilter,
    below: i64,
) -> Result<Option<Claim>, sqlx::Error> {
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    let requested = mask(partitions);
    let reserve = lease_reserve(lease).as_secs_f64();
    // The fence, first half ([`crate::fence`]): a shared lock on each partition this relay
    // holds, with enough lease left, that the claim may take rows from; a takeover needs the
    // exclusive lock, so none can happen while this transaction lives. `try`: a partition
    // being taken over right now is left for the next claim. The CASE keeps the lock off
    // every other partition (a lock there would hold up another relay's takeover).
    let locked: Vec<i16> = sqlx::query_scalar(concat!(
        "SELECT ARRAY(SELECT key_partition FROM postal.relay_partitions
                WHERE CASE WHEN owner = $1
                                AND lease_until > clock_timestamp() + make_interval(secs => $3)
                                AND ($2::bool[] IS NULL OR ($2::bool[])[key_partition + 1])
                           THEN pg_try_advisory_xact_lock_shared(",
        crate::fence::fence_lock_class!("relay_group"),
        ", key_partition)
                           ELSE false END)"
    ))
    .bind(relay)
    .bind(&requested)
    .bind(reserve)
    .fetch_one(&mut *tx)
    .await?;
    if locked.is_empty() {
        tx.rollback().await?;
        return Ok(None);
    }
    // The second half, in a statement of its own so that it reads the leases with a snapshot
    // taken after the locks: a takeover that committed before a lock was granted shows here.
    // Only partitions whose lease this relay holds for longer than the claim's transaction can
    // outlive its last statement ([`lease_reserve`]) are kept, and the lease they have left
    // (by the server's clock) sets the claim's send deadline ([`Claim::send_deadline_passed`]).
    // A separate statement keeps the claim on its ordered index scan; it also pins the claim's
    // plan to that scan (see `PLAN_SETTINGS`), ends the transaction if it stays idle for half
    // the lease, and sets `tcp_user_timeout` (half the lease) for the transaction, so that
    // the kernel drops the connection when the client stops acknowledging the claim's rows.
    // The claim commits with the server's
    // `synchronous_commit` (on by default), waiting for its WAL flush: while a backlog drains,
    // each claim walks the index entries of the rows its lane's earlier claims deleted until
    // a scan marks them dead, and PostgreSQL lets a scan do that only once the deletion is
    // older than every running snapshot and the deleting commit's WAL is flushed (it sets the
    // commit hint bit only then). After an asynchronous commit the claims that follow within
    // milliseconds walked those entries more often (`scripts/claim-index-walk.py`), and the
    // relay-only drain's median was lower, within a wide spread (BENCHMARKS.md).
    let checked_at = std::time::Instant::now();
    let half = format!("{}ms", (lease / 2).as_millis().max(1));
    // The same statement reads the pauses in force for this relay's group
    // (`postal.pauses`, `postal pause relay`): a pause committed before this statement began
    // stops the claim, so that a claim whose transaction began after a pause committed takes
    // nothing it pauses. (`postal pause` also waits for the claims that hold a partition lock
    // of the group when it commits, so that it returns only once the batches claimed before
    // it have finished: `crate::pause`.)
    type Checked = (Vec<i16>, Option<f64>, String, i64, bool, Vec<String>);
    let (owned, left_ms, _, xid, paused_all, paused_topics): Checked = sqlx::query_as(concat!(
        "WITH o AS (SELECT key_partition, lease_until, relay_group FROM postal.relay_partitions
                WHERE owner = $1 AND key_partition = ANY($2)
                  AND lease_until > clock_timestamp() + make_interval(secs => $4)),
              p AS (SELECT topic FROM postal.pauses
                    WHERE side = 'relay'
                      AND (group_name IS NULL
                           OR group_name = (SELECT relay_group FROM o LIMIT 1)))
         SELECT ARRAY(SELECT key_partition FROM o ORDER BY key_partition),
                (extract(epoch FROM (SELECT min(lease_until) FROM o) - clock_timestamp())
                    * 1000)::float8,
                concat(",
        plan_settings!(),
        ", set_config('idle_in_transaction_session_timeout', $3, true),
           set_config('tcp_user_timeout', $3, true),
           set_config('postal.claim_below', $5, true)),
                pg_current_xact_id()::xid::text::int8,
                EXISTS (SELECT 1 FROM p WHERE p.topic IS NULL),
                ARRAY(SELECT p.topic FROM p WHERE p.topic IS NOT NULL ORDER BY p.topic)"
    ))
    .bind(relay)
    .bind(&locked)
    .bind(&half)
    .bind(reserve)
    .bind(below.to_string())
    .fetch_one(&mut *tx)
    .await?;
    // A paused group claims nothing; paused topics leave the claim's topic filter. A key's
    // scope is its topic and key, so leaving a whole topic out keeps every key's order.
    let topics = match topics.without(paused_all, &paused_topics) {
        Some(t) if !owned.is_empty() => t,
        _ => {
            tx.rollback().await?;
            return Ok(None);
        }
    };
    // This claim's transaction id, registered before its claim statement locks a row: a
    // concurrent claim of this relay that meets one of those locks knows it for its own
    // (`skipped`). The relay's other claims: their transaction ids, and how many rows they
    // hold (the claim reads that many more candidates, see `claimed!`).
    let own = skipped::register(relay, xid);
    let others = skipped::own(relay);
    let left = Duration::from_secs_f64(left_ms.unwrap_or(0.0).max(0.0) / 1e3);
    let send_by = checked_at + left.saturating_sub(send_margin(lease));
    // The range of the owned partitions is checked inside the index; the mask (one array
    // lookup per row instead of a search through the list) then keeps exactly the owned ones.
    // Every partition: no mask at all.
    let (lo, hi) = (
        owned.iter().copied().min().unwrap_or(0),
        owned.iter().copied().max().unwrap_or(KEY_PARTITIONS - 1),
    );
    // `owned` is the part of the requested partitions still leased: as many means all of
    // them, and the mask already built stands.
    let requested_count = requested.as_ref().map_or(KEY_PARTITIONS as usize, |m| {
        m.iter().filter(|&&b| b).count()
    });
    let filter = if owned.len() == requested_count {
        requested
    } else {
        mask(&owned)
    };
    let sql = if delete_on_claim {
        CLAIM_DELETE
    } else {
        CLAIM_LOCK
    };
    let (only, except) = topics.binds();
    // Sized for a light-load claim; a full batch grows it a few times.
    let mut rows: Vec<(OutboundEvent, Kept, Option<Skipped>)> = Vec::with_capacity(limit.min(256));
    let mut passed = 0;
    {
        use futures::TryStreamExt as _;
        let mut stream = sqlx::query(sql)
            .bind(filter.clone())
            .bind(limit as i64)
            .bind(only)
            .bind(except)
            .bind(lo)
            .bind(hi)
            .bind(others.window as i64)
            .bind(&others.plain)
            .bind(&others.held)
            .fetch(&mut *tx);
        while let Some(row) = stream.try_next().await? {
            // The columns are the statement's, the same for every row: checked once.
            debug_assert!(
                !rows.is_empty() || {
                    use sqlx::{Column as _, Row as _};
                    row.columns()
                        .iter()
                        .map(|c| c.name())
                        .eq(RETURNED_NAMES.iter().copied())
                },
                "the claim's columns are not in the order decode reads them"
            );
            if rows.is_empty() {
                passed = self::passed(&row)?;
            }
            rows.push(decode(&row)?);
        }
    }
    if rows.is_empty() {
        // Nothing is pending, or every candidate is locked: by this relay's running claims
        // (their rows come first), or by other sessions. Only the last widens the next window.
        let (candidates, foreign): (i64, i64) = sqlx::query_as(WINDOW)
            .bind(filter)
            .bind(limit as i64)
            .bind(only)
            .bind(except)
            .bind(lo)
            .bind(hi)
            .bind(others.window as i64)
            .bind(&others.plain)
            .bind(&others.held)
            .fetch_one(&mut *tx)
            .await?;
        let full = candidates as usize >= limit + others.window;
        own.empty(limit, full, foreign as usize);
        tx.rollback().await?;
        return Ok(None);
    }
    // The statement returns its rows in tuple order, not in sequence order.
    rows.sort_unstable_by_key(|(e, _, _)| e.seq);
    let (rows, skipped): (Vec<(OutboundEvent, Kept)>, Vec<Option<Skipped>>) =
        rows.into_iter().map(|(e, k, b)| ((e, k), b)).unzip();
    let (mut events, mut kept): (Vec<OutboundEvent>, Vec<Kept>) = rows.into_iter().unzip();
    let mut skipped = skipped;
    if kept.iter().any(|k| k.raw_times.is_some()) {
        if let Err(e) = park_rows_with_times_out_of_range(
            &mut tx,
            delete_on_claim,
            &mut events,
            &mut kept,
            &mut skipped,
        )
        .await
        {
            let _ = tx.rollback().await;
            return Err(e);
        }
    }
    // Which rows wait behind a row locked elsewhere (or left behind by an earlier claim of
    // this relay, which this one may have to wait for to know), recorded before anything else
    // (a later claim of the relay that passes this one's locks waits for it to know).
    let (waits, blocked) = own.verdicts(&events, &skipped).await;
    let left_behind: Vec<i64> = events
        .iter()
        .zip(&waits)
        .filter(|(_, w)| **w)
        .map(|(e, _)| e.seq)
        .collect();
    own.claimed(
        events.iter().map(|e| e.seq).collect(),
        left_behind,
        limit,
        passed,
    );
    if let Err(e) = leave_keys_behind_locked_rows(
        &mut tx,
        delete_on_claim,
        &mut events,
        &mut kept,
        waits,
        &blocked,
    )
    .await
    {
        let _ = tx.rollback().await;
        return Err(e);
    }
    let enqueued = events
        .iter()
        .zip(&kept)
        .map(|(e, k)| (e.seq, k.created_at))
        .collect();
    let claim = Claim {
        tx,
        _own: own,
        events,
        enqueued,
        deleted: delete_on_claim.then_some(kept),
        history: false,
        relay,
        partitions: owned,
        lease,
        send_by,
    };
    if claim.events.is_empty() {
        // Every claimed row waits: their write-back is all there is to commit.
        return match claim.fence_and_commit().await {
            Ok(()) | Err(crate::Error::LeaseLost { .. }) => Ok(None),
            Err(crate::Error::Database(e)) => Err(e),
            Err(other) => Err(sqlx::Error::Protocol(other.to_string())),
        };
    }
    Ok(Some(claim))
}

/// Takes out of the claim the rows that wait (`waits`, per row: every row of a key from its
/// first claimed row after a row locked elsewhere on), and writes them back in the claim's
/// transaction, holding their key for [`skipped::RECHECK`] (see the `skipped` module). Logs one
/// line per key that waits (`blocked`).
async fn leave_keys_behind_locked_rows(
    tx: &mut Transaction<'static, Postgres>,
    delete_on_claim: bool,
    events: &mut Vec<OutboundEvent>,
    kept: &mut Vec<Kept>,
    waits: Vec<bool>,
    blocked: &[skipped::Blocked],
) -> Result<(), sqlx::Error> {
    if blocked.is_empty() {
        return Ok(());
    }
    for b in blocked {
        tracing::warn!(
            topic = %b.topic,
            locked_seq = b.locked_seq,
            locked_by_xid = b.xmax,
            waiting_seq = b.first_seq,
            retry_in_ms = skipped::RECHECK.as_millis() as u64,
            "an event is row-locked by a session that is not a claim of this relay (an open transaction on postal.outbox?); its key's later events wait for it"
        );
    }
    let (mut waiting, mut waiting_kept) = (Vec::new(), Vec::new());
    let all = std::mem::take(events).into_iter().zip(std::mem::take(kept));
    for ((e, k), w) in all.zip(waits) {
        if w {
            waiting.push(e);
            waiting_kept.push(k);
        } else {
            events.push(e);
            kept.push(k);
        }
    }
    let failures: Vec<Failure> = waiting.iter().map(|e| skipped::wait(e.seq)).collect();
    if delete_on_claim {
        complete::restore(tx, &waiting, kept_view(&waiting_kept), &failures).await
    } else {
        complete::mark(tx, &[], &failures).await
    }
}

/// Takes out of the claim the rows whose `occurred_at` or `created_at` the relay cannot carry
/// (see [`returned!`]; written around `enqueue`, e.g. `'infinity'`) and the rows of their (topic,
/// key) after them, and writes them back in the claim's transaction: the first parked with the
/// reason, holding its key like any parked event, the rest released behind it (no attempt
/// used). Their stored times are written back unchanged.
async fn park_rows_with_times_out_of_range(
    tx: &mut Transaction<'static, Postgres>,
    delete_on_claim: bool,
    events: &mut Vec<OutboundEvent>,
    kept: &mut Vec<Kept>,
    skipped: &mut Vec<Option<Skipped>>,
) -> Result<(), sqlx::Error> {
    let mut parked_keys: Vec<(String, String)> = Vec::new();
    let mut failures = Vec::new();
    let (mut out_events, mut out_kept) = (Vec::new(), Vec::new());
    let all = std::mem::take(events)
        .into_iter()
        .zip(std::mem::take(kept))
        .zip(std::mem::take(skipped));
    for ((e, k), s) in all {
        let key = (e.topic.clone(), e.key.clone());
        if let Some(reason) = k.times_refused() {
            tracing::warn!(seq = e.seq, topic = %postal_shared::text::field(&e.topic), "{reason}");
            failures.push(Failure {
                seq: e.seq,
                counts: false,
                park: true,
                hold: true,
                retry_in: Duration::ZERO,
                reason: Some(reason),
            });
            parked_keys.push(key);
        } else if parked_keys.contains(&key) {
            failures.push(Failure {
                seq: e.seq,
                counts: false,
                park: false,
                hold: false,
                retry_in: Duration::ZERO,
                reason: None,
            });
        } else {
            events.push(e);
            kept.push(k);
            skipped.push(s);
            continue;
        }
        out_events.push(e);
        out_kept.push(k);
    }
    if delete_on_claim {
        complete::restore(tx, &out_events, kept_view(&out_kept), &failures).await
    } else {
        complete::mark(tx, &[], &failures).await
    }
}

/// The key partitions as a `bool[256]` mask (`true` = included), or `None` for all of them:
/// one array lookup per row instead of a search through a list.
fn mask(partitions: &[i16]) -> Option<Vec<bool>> {
    let mut mask = vec![false; KEY_PARTITIONS as usize];
    for &p in partitions {
        if let Some(m) = usize::try_from(p).ok().and_then(|p| mask.get_mut(p)) {
            *m = true;
        }
    }
    (!mask.iter().all(|&m| m)).then_some(mask)
}

fn kept_view(kept: &[Kept]) -> Vec<(DateTime<Utc>, Option<&str>, Option<&str>)> {
    kept.iter()
        .map(|k| {
            (
                k.created_at,
                k.last_error.as_deref(),
                k.raw_times.as_deref(),
            )
        })
        .collect()
}

/// The columns a claim returns, in the order [`decode`] reads them by position.
///
/// `occurred_at` and `created_at` are NULL when they lie outside the times the relay can carry
/// (`infinity`, `-infinity`, or past the year 262,000: PostgreSQL stores them, chrono cannot
/// hold them, and decoding one panicked inside sqlx, leaving the claim's locks behind:
/// `hostile_sizes::`); `raw_times` then holds both as stored, and the claim parks the row
/// with its reason ([`park_rows_with_times_out_of_range`]).
macro_rules! returned {
    () => {
        "d.seq, d.event_id, d.topic, d.event_key, d.event_type, d.schema_version, \
         CASE WHEN d.occurred_at > '-infinity' AND d.occurred_at < '262000-01-01' \
         THEN d.occurred_at END AS occurred_at, d.content_type, d.payload, d.headers, \
         d.attempts, CASE WHEN d.created_at > '-infinity' AND d.created_at < '262000-01-01' \
         THEN d.created_at END AS created_at, d.last_error, \
         CASE WHEN NOT (d.occurred_at > '-infinity' AND d.occurred_at < '262000-01-01' \
         AND d.created_at > '-infinity' AND d.created_at < '262000-01-01') \
         THEN d.occurred_at::text || '|' || d.created_at::text END AS raw_times"
    };
}
pub(crate) use returned;

/// The last column a claim returns: the rows of the claimed row's topic and key that the
/// statement passed but could not lock (`SKIP LOCKED`) and that no claim of this relay locks
/// by the lists it was given (`$8`, `$9`), as `[seq…, xmax…]` (their sequence numbers, then the
/// transactions that lock them, both in sequence order), or NULL when there are none. The
/// relay checks them against its claims once more ([`crate::skipped`]). Nearly always NULL:
/// the hashed `IN` costs one lookup per row.
macro_rules! skipped_column {
    () => {
        "CASE WHEN (d.topic, d.event_key) IN (SELECT s.topic, s.event_key FROM s) \
         THEN (SELECT array_agg(s.seq ORDER BY s.seq) || array_agg(s.xmax ORDER BY s.seq) \
               FROM s WHERE s.topic = d.topic AND s.event_key = d.event_key) END AS skipped, \
         (SELECT count(*) FROM s) AS passed"
    };
}

/// Which rows are publishable (shared by both claim forms).
///
/// Order never rests on comparing times taken in different transactions. A row that is not
/// `held` is due at once, whatever its `available_at` says: `available_at` of a row that
/// `enqueue` wrote is the start of the *writer's* transaction, and a claim whose transaction
/// began after an earlier writer's but before a later one's would otherwise find the key's
/// later event due and its earlier one not, and take the later one alone. A row that waits for
/// a time (scheduled with `deliver_at`, a retry's backoff, a checked-out run's lease, a
/// requeue) is `held`: it is due once `available_at` has passed by this statement's `now()`,
/// and until then it holds its key's later rows back; so does a parked row. Whether a held row
/// is due and whether it holds its key back are read with the same `now()`, so a due row is
/// taken, a row not yet due holds its key's later rows back. (A due row that another session
/// has row-locked is skipped, `SKIP LOCKED`; the claim then leaves its key's later rows behind,
/// see `claimed!` and the `skipped` module.) A key's scope is its topic and key
/// ([`crate::OutboundEvent::order_key`]): the topic filters of relay groups pass or stop both
/// rows alike. Only rows below `postal.claim_below` (a transaction-local setting, unset but
/// for the WAL relay's sweep: [`claim_below`]) are taken; a condition on the index's leading
/// column, read once per statement.
macro_rules! publishable {
    () => {
        r#"
            SELECT o.ctid, o.seq, o.xmax
            FROM postal.outbox o
            WHERE o.status = 'pending'
              AND (NOT o.held OR o.available_at <= now())
              AND o.key_partition BETWEEN $5 AND $6
              AND o.seq < coalesce(nullif(current_setting('postal.claim_below', true), '')::int8,
                                   9223372036854775807)
              AND ($1::bool[] IS NULL OR ($1::bool[])[o.key_partition + 1])
              AND ($3::text[] IS NULL OR o.topic = ANY($3))
              AND ($4::text[] IS NULL OR o.topic <> ALL($4))
              AND (NOT EXISTS (SELECT 1 FROM postal.outbox h WHERE h.held)
                   OR NOT EXISTS (
                  SELECT 1 FROM postal.outbox b
                  WHERE b.held
                    AND hashtextextended(b.event_key, 0) = hashtextextended(o.event_key, 0)
                    AND b.event_key = o.event_key AND b.seq < o.seq
                    AND b.topic = o.topic
                    AND (b.status = 'failed' OR b.available_at > now())
              ))
            ORDER BY o.seq, o.key_partition
            LIMIT $2 + $7
        "#
    };
}

/// The rows a claim takes, and those it passed without taking (shared by both claim forms).
///
/// `c`: the publishable rows in sequence order, as many as the claim may take plus `$7` (the
/// rows this relay's running claims hold, which are locked and come first, and the rows other
/// sessions locked in the last claims' window), read without locking. `l`: the first `$2` of
/// them that the statement can lock, in that order (`SKIP LOCKED`, by tuple id: the nested
/// loop keeps `c`'s order; any other plan would only leave more rows unlocked, which makes
/// their keys wait, never the reverse). `s`: the candidates before the last row taken that `l`
/// did not take and that are not rows of this relay's plain claims — locked by one of their
/// transaction ids (`$8`) *and* among the rows those claims took (`$9`): a lock shared by
/// several sessions shows a multixact id, from a counter of its own, that can equal a claim's
/// transaction id. Their `xmax`, read after `l` locked its rows, names the session that locks
/// them (read only when `l` passed a candidate: nearly always it
/// took every one up to its last). A claimed row of the same topic and key after one of
/// those must not go out before it: see `skipped_column!` and the `skipped` module. (`$8` is
/// read before the statement; the relay checks again after it, with claims registered
/// meanwhile.)
macro_rules! claimed {
    () => {
        concat!(
            "WITH c AS MATERIALIZED (",
            publishable!(),
            "), l AS MATERIALIZED (
                SELECT o.ctid, c.seq FROM c JOIN postal.outbox o ON o.ctid = c.ctid
                LIMIT $2 FOR UPDATE OF o SKIP LOCKED
            ), s AS MATERIALIZED (
                SELECT o.seq, o.topic, o.event_key, o.xmax::text::int8 AS xmax
                FROM c JOIN postal.outbox o ON o.ctid = c.ctid
                WHERE c.seq < (SELECT max(l.seq) FROM l)
                  AND (SELECT count(*) FROM l)
                      < (SELECT count(*) FROM c WHERE c.seq <= (SELECT max(l.seq) FROM l))
                  AND c.seq NOT IN (SELECT l.seq FROM l)
                  AND NOT (o.xmax::text::int8 = ANY($8::int8[])
                           AND c.seq IN (SELECT unnest($9::int8[])))
            ) "
        )
    };
}

/// The claim statement (delete-on-claim form). Parameters: `$1` key partitions (`bool[256]`
/// mask, `true` = claim from it, or NULL for all), `$2` limit, `$3` only these topics
/// (`text[]` or NULL), `$4` not these topics (`text[]` or NULL), `$5`/`$6` the lowest and
/// highest key partition in the mask (`int2`): a condition
/// on the index (`outbox_pending_seq_partition`), so that rows outside that range are skipped
/// without reading the table; `$7` how many rows this relay's other claims hold (`int8`, 0
/// when none), `$8` the transaction ids of this relay's claims (`int8[]`, empty when none), `$9`
/// the rows its running claims took (`int8[]`; see `claimed!`). Public for `EXPLAIN`.
///
/// The picked rows are deleted by tuple id: this statement holds their row locks until the
/// transaction ends, so nobody can move them, and the delete needs no index lookup per row.
pub const CLAIM_DELETE: &str = concat!(
    claimed!(),
    "DELETE FROM postal.outbox d WHERE d.ctid = ANY(ARRAY(SELECT l.ctid FROM l)) RETURNING ",
    returned!(),
    ", ",
    skipped_column!()
);

/// After a claim that took nothing: how many candidates its window held and how many of them
/// another session locks (not a row a settled plain claim of this relay took: `$8`, `$9`). The
/// same parameters as the claim statements.
const WINDOW: &str = concat!(
    "SELECT count(*), count(*) - count(h.seq) FROM (",
    publishable!(),
    ") c LEFT JOIN (SELECT DISTINCT unnest($9::int8[]) AS seq) h
         ON h.seq = c.seq AND c.xmax::text::int8 = ANY($8::int8[])"
);

const CLAIM_LOCK: &str = concat!(
    claimed!(),
    "SELECT ",
    returned!(),
    ", ",
    skipped_column!(),
    " FROM postal.outbox d WHERE d.ctid = ANY(ARRAY(SELECT l.ctid FROM l))"
);

#[cfg(test)]
mod tests {
    use super::*;

    /// `decode` reads the claim's columns by position: the statements' column list and the
    /// names it checks them against (debug builds) must be the same, in the same order.
    #[test]
    fn the_claim_returns_the_columns_decode_expects() {
        let listed: Vec<&str> = returned!()
            .split(',')
            .map(|c| {
                let c = c.trim();
                c.rsplit_once(" AS ")
                    .map_or(c, |(_, alias)| alias)
                    .trim_start_matches("d.")
            })
            .collect();
        assert_eq!(listed, RETURNED_NAMES[..RETURNED_NAMES.len() - 2]);
        assert!(skipped_column!().ends_with(" AS passed"));
        assert!(CLAIM_DELETE.ends_with(concat!(returned!(), ", ", skipped_column!())));
        assert!(CLAIM_LOCK.contains(concat!(
            "SELECT ",
            returned!(),
            ", ",
            skipped_column!(),
            " FROM"
        )));
    }

    /// The partition mask that the fence and the claim filter by: exactly the listed
    /// partitions, none for an empty list, and no mask at all (every row) for all of them.
    #[test]
    fn the_partition_mask_holds_exactly_the_listed_partitions() {
        let some = mask(&[0, 7, 255]).expect("a mask");
        assert_eq!(some.len(), KEY_PARTITIONS as usize);
        let set: Vec<usize> = (0..some.len()).filter(|&i| some[i]).collect();
        assert_eq!(set, vec![0, 7, 255]);
        assert!(mask(&[]).expect("a mask").iter().all(|&m| !m));
        assert_eq!(mask(&all_partitions()), None);
        // Out-of-range values are ignored rather than panicking.
        assert_eq!(
            mask(&[-1, 300])
                .expect("a mask")
                .iter()
                .filter(|&&m| m)
                .count(),
            0
        );
    }
}
