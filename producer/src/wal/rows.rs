//! The outbox rows of a batch read from the slot: locked, published, marked.
//!
//! The WAL says which rows were committed and in which order; the outbox row says whether one
//! is still to publish. A batch's rows are locked (`FOR UPDATE SKIP LOCKED`) and only those
//! still pending, due at once and not behind a held row of their key are published, in commit
//! order. A row still pending that another session holds locked (an operator's open
//! transaction, a polling relay finishing its claim) is [`Busy`]: it and its key's later rows
//! of the batch are tried again later, while the batch's other keys go on. The
//! acknowledged ones are marked in the same transaction, the way polling marks them (deleted,
//! or marked `published` with `--keep-published`), and it commits before the relay confirms
//! the slot's position. So a row already published by a polling relay, or by this relay before
//! a crash that came before its confirmation, is not published again.

use sqlx::{PgPool, Postgres, Transaction};

use crate::transport::OutboundEvent;

/// The batch's rows that are to publish, locked, in the order of `seqs`.
pub(crate) struct Locked {
    tx: Transaction<'static, Postgres>,
    /// The rows of `events` are already deleted in `tx` ([`take`]): the mark only commits when
    /// every one was acknowledged.
    taken: bool,
    /// In commit order.
    pub events: Vec<OutboundEvent>,
    /// When each row of `events` was enqueued, by `seq`: what its history row keeps.
    created: std::collections::HashMap<i64, chrono::DateTime<chrono::Utc>>,
    /// Rows of the batch still pending that the relay does not publish: held, or behind a held
    /// row of their key (scheduled for later, waiting for a retry, parked, checked out), or
    /// behind a pending row of their key that the stream did not give ([`older_column`]).
    pub left: Vec<i64>,
    /// Rows still pending that another session holds locked, in commit order.
    pub busy: Vec<Busy>,
    /// The rows to try again: the busy and deferred ones and their keys' later rows of `seqs`.
    pub again: std::collections::HashSet<i64>,
    /// Rows parked before they are sent, with the reason (their `occurred_at` or `created_at`
    /// lies outside the times the relay can carry, as a claim parks them); their keys' later
    /// rows of `seqs` are in `left`.
    pub refused: Vec<crate::complete::Failure>,
}

/// A row of the batch still pending that another session holds locked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Busy {
    pub seq: i64,
    pub topic: String,
    pub key: String,
    /// The backend holding the row's lock, when PostgreSQL tells (`pg_locks` on the row's
    /// locking transaction; not for a lock shared by several).
    pub pid: Option<i32>,
}

/// Waits until the transactions `xids` (32-bit ids from the stream) are visible to new
/// snapshots. PostgreSQL writes a commit to the WAL, where the slot's stream finds it, before
/// the committing session leaves the proc array: a snapshot taken in between does not see the
/// transaction's rows yet, and [`lock`] would take them for rows another relay had published.
/// The wait is that gap, normally microseconds; it is polled (1 ms, doubling to 64 ms).
pub(crate) async fn visible(pool: &PgPool, xids: &[u32]) -> Result<(), sqlx::Error> {
    if xids.is_empty() {
        return Ok(());
    }
    // The full (epoch-qualified) ids, from the current snapshot's xmax: each id is within 2^31
    // of it, before or after.
    let xmax: i64 =
        sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8")
            .fetch_one(pool)
            .await?;
    let full: Vec<i64> = xids.iter().map(|&x| widen(xmax, x)).collect();
    let mut wait = std::time::Duration::from_millis(1);
    loop {
        let all: bool = sqlx::query_scalar(
            "SELECT bool_and(pg_visible_in_snapshot(x::text::xid8, pg_current_snapshot()))
             FROM unnest($1::int8[]) AS x",
        )
        .bind(&full)
        .fetch_one(pool)
        .await?;
        if all {
            return Ok(());
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(std::time::Duration::from_millis(64));
    }
}

/// The 64-bit transaction id whose low 32 bits are `xid`, nearest to `near` (a full id).
fn widen(near: i64, xid: u32) -> i64 {
    let diff = (xid as i64 - (near & 0xffff_ffff)).rem_euclid(1 << 32);
    if diff < 1 << 31 {
        near + diff
    } else {
        near - ((1 << 32) - diff)
    }
}

/// The column that names a row's key's newest pending row before it (`NULL`: none), one
/// backward probe of the index `outbox_key_pending_seq` (migration 0042). The slot's stream
/// holds only rows committed after its start: a row pending that is not in it — committed
/// before the slot existed (or while it was dropped and made again), requeued by an operator,
/// or left pending by an earlier batch — must go before the key's later rows. Per key, commit
/// order is `seq` order for the rows `enqueue` writes, but not for a row written back after a
/// failed publish (`complete::restore` inserts it again, same `seq`, in a later transaction):
/// the stream may give it after a later row of its key. So the check is by rank in the
/// stream ([`Known`]), against the newest pending row before the row: the rows before that
/// one were checked, in stream order, when it was.
macro_rules! older_column {
    () => {
        "(SELECT p.seq FROM postal.outbox p WHERE p.status = 'pending' \
              AND hashtextextended(p.event_key, 0) = hashtextextended(d.event_key, 0) \
              AND p.event_key = d.event_key AND p.topic = d.topic AND p.seq < d.seq \
              ORDER BY hashtextextended(p.event_key, 0) DESC, p.seq DESC LIMIT 1) AS older"
    };
}

/// The condition that a row's topic is paused for relays of the group `$2` (`postal.pauses`,
/// `postal pause relay`), read by the statement that takes or locks it, as a claim reads it:
/// a paused row is left pending, its key's later rows behind it, and the sweep publishes them
/// once resumed.
macro_rules! paused {
    () => {
        "EXISTS (SELECT 1 FROM postal.pauses z WHERE z.side = 'relay' \
              AND (z.group_name IS NULL OR z.group_name = $2) \
              AND (z.topic IS NULL OR z.topic = d.topic))"
    };
}

/// The condition that a row's topic is one the relay publishes (its topic filter, `only` and
/// `except` as [`crate::config::TopicFilter::binds`] gives them): the stream's rows of other
/// topics are another relay group's, neither published, left nor waited for here.
macro_rules! ours {
    ($only:literal, $except:literal) => {
        concat!(
            "(",
            $only,
            "::text[] IS NULL OR d.topic = ANY(",
            $only,
            ")) AND (",
            $except,
            "::text[] IS NULL OR d.topic <> ALL(",
            $except,
            "))"
        )
    };
}

/// The advisory lock a chunk's transaction holds shared for its whole life (taken by its
/// first statement; the group is `$2`), so that `postal pause relay`
/// (`postal_admin::pauses::wait_for_relay_claims`, which takes the group's partition locks
/// one after the other and then this one, exclusively) returns only once the chunks taken
/// before the pause ended, as it does for claims. A group's key partitions are 0–255; the
/// stream's lock is 256, which no partition's takeover fences. Both [`take`] and [`lock`]
/// only try it, never queue for it: [`take`] may run while an earlier chunk's transaction is
/// still open, which a waiting pause waits for (waiting there would hold both until the
/// pause's `--wait` ends), and [`lock`] asks again until the pause is through.
macro_rules! stream_lock {
    ($f:literal) => {
        concat!($f, "(", crate::fence::fence_lock_class!("$2"), ", 256)")
    };
}

// The stream's lock (256, [`stream_lock`]) must be past every key partition's, or a
// partition's takeover would fence the stream's chunks as stale claims.
const _: () = assert!(crate::lease::KEY_PARTITIONS == 256);

/// The rows the slot's stream gave a call of `publish`, each with its rank in commit order; a
/// row left pending by the call stops being one.
pub(crate) type Known = std::collections::HashMap<i64, usize>;

/// Whether the row `seq` must wait for its key's newest earlier pending row, `older` (its
/// column [`older_column`]): unless that row is one of `known` and comes before this one in
/// the stream (it is then published first, or holds this one back when it fails).
fn behind_unknown(seq: i64, older: Option<i64>, known: &Known) -> bool {
    older.is_some_and(|p| match (known.get(&p), known.get(&seq)) {
        (Some(rank_older), Some(rank)) => rank_older > rank,
        _ => true,
    })
}

/// A chunk's transaction: idle for at most `idle` (its session drops a client that stops
/// acknowledging data after as long, `tcp_user_timeout`), holding the group's stream lock
/// shared if it could be had at once ([`stream_lock`]; `false`: a pause waits for it). Also
/// the session's own `lock_timeout`, which [`take`] restores after its short wait.
async fn begin(
    pool: &PgPool,
    group: &str,
    idle: std::time::Duration,
) -> Result<(Transaction<'static, Postgres>, String, bool), sqlx::Error> {
    // Cancel-safe: the publish future is dropped when the slot's lease is lost or the
    // shutdown timeout ends, maybe here (a bare `pool.begin()` cancelled after its `BEGIN` was
    // sent leaves the pooled connection inside a transaction: helper-68's finding).
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    let (own_wait, _, _, locked): (String, String, String, bool) = sqlx::query_as(concat!(
        "SELECT current_setting('lock_timeout'), \
                set_config('idle_in_transaction_session_timeout', $1, true), \
                set_config('tcp_user_timeout', $1, true), ",
        stream_lock!("pg_try_advisory_xact_lock_shared")
    ))
    .bind(idle.as_millis().max(1).to_string())
    .bind(group)
    .fetch_one(&mut *tx)
    .await?;
    Ok((tx, own_wait, locked))
}

/// How long [`take`]'s delete waits for a row another session holds locked before it gives
/// the chunk to [`lock`] (which skips such rows): far below `deadlock_timeout` (1 s).
const TAKE_LOCK_WAIT: &str = "50ms";

/// The rows `seqs` still to publish, read and deleted in one statement, in a transaction that
/// commits only once each is acknowledged ([`Locked::mark`]): the common case of a chunk with
/// nothing deferred, costing one statement and one tuple write per row where [`lock`] then
/// the mark cost two of each. The delete locks each row it takes as `FOR UPDATE` would, so a
/// polling relay or an operator sees them as [`lock`] leaves them. Only with
/// `delete_on_publish` and nothing deferred; `Ok(None)`: a row is locked by another session
/// (its lock waited [`TAKE_LOCK_WAIT`]), or a pause is waiting for the stream's chunks
/// ([`stream_lock`]), and nothing was taken; [`lock`] does the chunk.
pub(crate) async fn take(
    pool: &PgPool,
    seqs: &[i64],
    known: &Known,
    group: &str,
    topics: &crate::config::TopicFilter,
    idle: std::time::Duration,
) -> Result<Option<Locked>, sqlx::Error> {
    use sqlx::Row as _;
    let (only, except) = topics.binds();
    let (mut tx, own_wait, locked) = begin(pool, group, idle).await?;
    // A pause waits for the stream's chunks in flight: `lock` waits for it.
    if !locked {
        tx.rollback().await?;
        return Ok(None);
    }
    // The lock wait is set inside the savepoint: undoing the take (`Locked::mark`) restores
    // the session's own for the marks.
    sqlx::query("SAVEPOINT postal_wal_take")
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(TAKE_LOCK_WAIT)
        .execute(&mut *tx)
        .await?;
    let taken = sqlx::query(concat!(
        "DELETE FROM postal.outbox d WHERE d.seq = ANY($1) AND d.status = 'pending' \
         AND NOT d.held AND NOT d.running \
         AND NOT EXISTS (SELECT 1 FROM postal.outbox h \
              WHERE h.held AND hashtextextended(h.event_key, 0) = hashtextextended(d.event_key, 0) \
              AND h.event_key = d.event_key AND h.topic = d.topic AND h.seq < d.seq) \
         AND NOT ",
        paused!(),
        " AND ",
        ours!("$3", "$4"),
        " RETURNING ",
        crate::claim::returned!(),
        ", NULL::int8[] AS skipped, 0::int8 AS passed, ",
        older_column!()
    ))
    .bind(seqs)
    .bind(group)
    .bind(only)
    .bind(except)
    .fetch_all(&mut *tx)
    .await;
    let rows = match taken {
        Ok(rows) => rows,
        // 55P03: a row locked by another session.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
            tx.rollback().await?;
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    // A row behind an earlier pending row of its key that the stream did not give: the chunk
    // is not taken whole; `lock` leaves such rows pending.
    for row in &rows {
        if behind_unknown(row.try_get(0)?, row.try_get::<Option<i64>, _>(16)?, known) {
            tx.rollback().await?;
            return Ok(None);
        }
    }
    // The marks and the lease's check wait for locks as the session would.
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(&own_wait)
        .execute(&mut *tx)
        .await?;
    let mut found = std::collections::HashMap::with_capacity(rows.len());
    let mut created = std::collections::HashMap::with_capacity(rows.len());
    for row in &rows {
        let (event, kept, _) = crate::claim::decode(row)?;
        // A row to park before it is sent: `lock` does the chunk.
        if kept.times_refused().is_some() {
            tx.rollback().await?;
            return Ok(None);
        }
        created.insert(event.seq, kept.created_at());
        found.insert(event.seq, event);
    }
    // Rows not taken: published or deleted meanwhile, or still pending behind a held row of
    // their key (counted for the warning, left for a polling relay).
    let left: Vec<(i64, String, String)> = if found.len() == seqs.len() {
        Vec::new()
    } else {
        let missing: Vec<i64> = seqs
            .iter()
            .copied()
            .filter(|s| !found.contains_key(s))
            .collect();
        sqlx::query_as(concat!(
            "SELECT d.seq, d.topic, d.event_key FROM postal.outbox d
             WHERE d.seq = ANY($1) AND d.status = 'pending' AND ",
            ours!("$2", "$3"),
            " ORDER BY d.seq"
        ))
        .bind(&missing)
        .bind(only)
        .bind(except)
        .fetch_all(&mut *tx)
        .await?
    };
    // A row taken after a row of its key left here (checked out, say: not `held`, so the
    // delete's condition did not see it): `lock` does the chunk, leaving both.
    let passes = left.iter().any(|(first, topic, key)| {
        found
            .values()
            .any(|e| e.seq > *first && e.topic == *topic && e.key == *key)
    });
    if passes {
        tx.rollback().await?;
        return Ok(None);
    }
    let left = left.into_iter().map(|(seq, _, _)| seq).collect();
    let events = seqs.iter().filter_map(|s| found.remove(s)).collect();
    Ok(Some(Locked {
        tx,
        taken: true,
        events,
        created,
        left,
        busy: Vec::new(),
        again: std::collections::HashSet::new(),
        refused: Vec::new(),
    }))
}

/// Locks the rows `seqs` that are still to publish and reads them, without waiting for a row
/// another session holds ([`Locked::busy`]). Such a row, a row of `defer` (not to send now),
/// and their keys' later rows of `seqs` are left out, to try again ([`Locked::again`]). The transaction may stay idle for at most `idle` (half the slot's
/// lease), and its session drops a client that stops acknowledging data after as long
/// (`tcp_user_timeout`): a frozen or cut-off relay's locks end by themselves, and the slot's
/// next holder gets the rows.
pub(crate) async fn lock(
    pool: &PgPool,
    seqs: &[i64],
    known: &Known,
    defer: &std::collections::HashSet<i64>,
    group: &str,
    topics: &crate::config::TopicFilter,
    idle: std::time::Duration,
) -> Result<Locked, sqlx::Error> {
    use sqlx::Row as _;
    let (only, except) = topics.binds();
    // A pause waiting for the group's chunks in flight ([`stream_lock`]) is waited for here,
    // asked again every 10–500 ms rather than queued behind it, with one line when the wait
    // starts and one when it ends (the pause's own `--wait` bounds it).
    let mut waited: Option<std::time::Instant> = None;
    let mut tx = loop {
        let (tx, _, locked) = begin(pool, group, idle).await?;
        if locked {
            if let Some(since) = waited {
                tracing::info!(waited_ms = since.elapsed().as_millis() as u64, "WAL relay: the pause is through waiting; the stream goes on (what it pauses is left pending)");
            }
            break tx;
        }
        tx.rollback().await?;
        let since = *waited.get_or_insert_with(|| {
            tracing::info!(group, "WAL relay: a `postal pause relay` is waiting for this group's batches in flight; the stream waits for it, then leaves what it pauses pending");
            std::time::Instant::now()
        });
        let wait = (since.elapsed() / 4).clamp(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_millis(500),
        );
        tokio::time::sleep(wait).await;
    };
    let rows = sqlx::query(concat!(
        "SELECT ",
        crate::claim::returned!(),
        ", NULL::int8[] AS skipped, 0::int8 AS passed, \
         (d.held OR d.running OR EXISTS (SELECT 1 FROM postal.outbox h \
              WHERE h.held AND hashtextextended(h.event_key, 0) = hashtextextended(d.event_key, 0) \
              AND h.event_key = d.event_key AND h.topic = d.topic \
              AND h.seq < d.seq) OR ",
        paused!(),
        ") AS left_behind, ",
        older_column!(),
        " FROM postal.outbox d WHERE d.seq = ANY($1) AND d.status = 'pending' AND ",
        ours!("$3", "$4"),
        " FOR UPDATE OF d SKIP LOCKED"
    ))
    .bind(seqs)
    .bind(group)
    .bind(only)
    .bind(except)
    .fetch_all(&mut *tx)
    .await?;
    let mut found = std::collections::HashMap::with_capacity(rows.len());
    let mut behind = std::collections::HashSet::new();
    // The keys of the rows left behind, with the first such row: the key's later rows of the
    // chunk stay behind it too (a row left because it is checked out is not `held`).
    let mut left_keys = std::collections::HashMap::<(String, String), i64>::new();
    let mut refused = Vec::new();
    let mut created = std::collections::HashMap::with_capacity(rows.len());
    for row in &rows {
        if row.try_get::<bool, _>(16)? || behind_unknown(row.try_get(0)?, row.try_get(17)?, known) {
            let seq = row.try_get::<i64, _>(0)?;
            behind.insert(seq);
            let key = (row.try_get::<String, _>(2)?, row.try_get::<String, _>(3)?);
            let first = left_keys.entry(key).or_insert(seq);
            *first = (*first).min(seq);
            continue;
        }
        let (event, kept, _) = crate::claim::decode(row)?;
        if let Some(reason) = kept.times_refused() {
            // Parked at the mark, holding its key's later rows back as a parked row does.
            let first = left_keys
                .entry((event.topic.clone(), event.key.clone()))
                .or_insert(event.seq);
            *first = (*first).min(event.seq);
            refused.push(crate::complete::Failure {
                seq: event.seq,
                counts: false,
                park: true,
                hold: true,
                retry_in: std::time::Duration::ZERO,
                reason: Some(reason),
            });
            continue;
        }
        created.insert(event.seq, kept.created_at());
        found.insert(event.seq, event);
    }
    found.retain(|seq, event| {
        let later = left_keys
            .get(&(event.topic.clone(), event.key.clone()))
            .is_some_and(|first| first < seq);
        if later {
            behind.insert(*seq);
        }
        !later
    });
    // The rows not locked here: published or deleted meanwhile, or still pending and held by
    // another session (whose pid the row's locking transaction tells).
    let missing: Vec<i64> = seqs
        .iter()
        .copied()
        .filter(|s| {
            !found.contains_key(s) && !behind.contains(s) && !refused.iter().any(|f| f.seq == *s)
        })
        .collect();
    let mut busy: Vec<Busy> = if missing.is_empty() {
        Vec::new()
    } else {
        sqlx::query_as::<_, (i64, String, String, Option<i32>)>(concat!(
            "SELECT d.seq, d.topic, d.event_key,
                    (SELECT l.pid FROM pg_locks l
                     WHERE l.locktype = 'transactionid' AND l.transactionid = d.xmax
                       AND l.mode = 'ExclusiveLock' AND l.granted LIMIT 1)
             FROM postal.outbox d WHERE d.seq = ANY($1) AND d.status = 'pending' AND ",
            ours!("$2", "$3")
        ))
        .bind(&missing)
        .bind(only)
        .bind(except)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|(seq, topic, key, pid)| Busy {
            seq,
            topic,
            key,
            pid,
        })
        .collect()
    };
    busy.sort_by_key(|b| seqs.iter().position(|s| *s == b.seq));
    // A busy or deferred row holds back its key's later rows of the batch.
    let mut again = std::collections::HashSet::new();
    let mut blocked = std::collections::HashSet::<(String, String)>::new();
    let mut events = Vec::with_capacity(found.len());
    for seq in seqs {
        if let Some(b) = busy.iter().find(|b| b.seq == *seq) {
            blocked.insert((b.topic.clone(), b.key.clone()));
            again.insert(*seq);
        } else if let Some(event) = found.remove(seq) {
            let key = (event.topic.clone(), event.key.clone());
            if defer.contains(seq) || blocked.contains(&key) {
                blocked.insert(key);
                again.insert(*seq);
            } else {
                events.push(event);
            }
        }
    }
    Ok(Locked {
        tx,
        taken: false,
        events,
        created,
        left: seqs
            .iter()
            .copied()
            .filter(|s| behind.contains(s))
            .collect(),
        busy,
        again,
        refused,
    })
}

impl Locked {
    /// Whether the rows were taken in one statement ([`take`]).
    pub(crate) fn is_taken(&self) -> bool {
        self.taken
    }

    /// Gives the rows up unmarked (a take undone: they are pending again).
    pub(crate) async fn undo(self) {
        if let Err(e) = self.tx.rollback().await {
            tracing::debug!(error = %e, "WAL relay: rolling back rows taken ahead failed (the session's end rolls them back)");
        }
    }

    /// Marks the acknowledged rows `published` as polling does (deleted, or kept and marked
    /// `published`), parks the rows in `parked` (refused for good: `status = 'failed'`,
    /// holding their key's later rows back, as polling parks them) and commits — only while
    /// `lease` is still this relay's (checked in the transaction, [`super::lease::check`]).
    /// With `history`, the acknowledged rows (deleted) are written into
    /// `postal.outbox_history` in the same transaction, as polling's history mode writes them.
    /// `Ok(false)`: the lease moved to another relay; nothing was marked.
    pub(crate) async fn mark(
        mut self,
        published: &[i64],
        parked: &[crate::complete::Failure],
        delete: bool,
        history: bool,
        lease: &super::lease::Held,
    ) -> Result<bool, sqlx::Error> {
        // Taken rows ([`take`]) all acknowledged: their deletes stand. Otherwise the deletes
        // are undone, and the acknowledged rows deleted (the refused ones parked) as after
        // [`lock`].
        let stand = self.taken && published.len() == self.events.len();
        if self.taken && !stand {
            sqlx::query("ROLLBACK TO SAVEPOINT postal_wal_take")
                .execute(&mut *self.tx)
                .await?;
        }
        if !stand && delete {
            sqlx::query("DELETE FROM postal.outbox WHERE seq = ANY($1) AND status = 'pending'")
                .bind(published)
                .execute(&mut *self.tx)
                .await?;
            if !parked.is_empty() {
                crate::complete::mark(&mut self.tx, &[], parked).await?;
            }
        } else if !stand {
            crate::complete::mark(&mut self.tx, published, parked).await?;
        }
        if history && delete && !published.is_empty() {
            let kept: Vec<_> = self
                .events
                .iter()
                .map(|e| {
                    let created = self.created.get(&e.seq).copied();
                    (created.unwrap_or(chrono::DateTime::UNIX_EPOCH), None, None)
                })
                .collect();
            crate::complete::archive(&mut self.tx, &self.events, kept, published).await?;
        }
        if !super::lease::check(&mut self.tx, &lease.slot, lease.holder, lease.token).await? {
            self.tx.rollback().await?;
            return Ok(false);
        }
        self.tx.commit().await?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::{behind_unknown, widen, Known};

    /// Guarantee: a row waits for its key's earlier pending row unless the stream gave that
    /// row before it — not for a row written back after a failed publish (inserted again,
    /// same `seq`, after the row in the stream), nor for one the stream did not give.
    #[test]
    fn a_row_waits_for_an_earlier_row_the_stream_gives_after_it() {
        // Stream order: 30, 157, then 40 (a write-back's insert).
        let known: Known = [(30, 0), (157, 1), (40, 2)].into_iter().collect();
        assert!(!behind_unknown(157, None, &known));
        assert!(!behind_unknown(157, Some(30), &known));
        assert!(behind_unknown(157, Some(40), &known));
        assert!(behind_unknown(157, Some(12), &known), "not in the stream");
        assert!(!behind_unknown(40, Some(30), &known));
    }

    #[test]
    fn ids_widen_to_the_nearest_epoch() {
        let epoch1 = 1i64 << 32;
        // Same epoch, before and after the reference.
        assert_eq!(widen(epoch1 + 1000, 990), epoch1 + 990);
        assert_eq!(widen(epoch1 + 1000, 1010), epoch1 + 1010);
        // Just past a wraparound: an id near the top is the previous epoch's.
        assert_eq!(widen(epoch1 + 5, u32::MAX - 2), epoch1 - 3);
        // Just before a wraparound: a small id is the next epoch's.
        assert_eq!(widen(2 * epoch1 - 3, 4), 2 * epoch1 + 4);
    }
}
