//! Rows a claim skipped because another session row-locks them.
//!
//! A claim takes its rows `FOR UPDATE SKIP LOCKED`: it must skip the rows that this relay's
//! own earlier claims still hold (they are in flight, and the key chain orders the batches of
//! one relay), or the relay could not have several batches in flight. But `SKIP LOCKED` skips
//! a row whoever locks it: an operator's `UPDATE` in an open `psql` transaction, an
//! application's `SELECT … FOR SHARE`, a foreign-key check (`FOR KEY SHARE`), a task run's
//! lease renewal that reached the database after the run's lease ended, or a claim of a relay
//! in another relay group whose topic filter overlaps this one's. Such a skipped row is due and
//! unpublished, and the claim would otherwise take its key's later events without it: the
//! first copy of a later event would reach the destination before an earlier one.
//!
//! So the claim statement reads its candidates in sequence order without locking them, then
//! locks what it can (see `claim::claimed!`), and returns with each claimed row the rows of its
//! topic and key that it passed without taking, when another session locks them (their
//! `xmax`: the transaction that locks them). A row that is pending in the statement's snapshot,
//! publishable, and passed in sequence order without being taken was locked when the statement
//! reached it. When one such row is not locked by a claim of this relay (their transaction ids
//! are registered here *before* their claim statements run, and checked again after the
//! statement, so a concurrent claim of the same relay is always recognised), or is a row that
//! one of its claims left behind (written back in that claim's still open transaction, so
//! that others see it as it was, locked by that claim), the claim keeps
//! none of the key's rows after it: they are written back in the claim's transaction, holding
//! their key for [`RECHECK`] (no attempt used), and the key is tried again then. The rows of
//! other keys go out as usual. Once the other session lets go of its lock, the skipped row is
//! claimed, then the rest of its key, in order.
//!
//! A claim reads as many candidates as it may take, plus the rows the relay's running claims
//! hold (they come first), plus the rows of other sessions' that the last claims passed; a
//! claim that took nothing from a window full of rows locked elsewhere doubles that extra (up
//! to 64 batches, with a WARN line), so that rows locked elsewhere do not keep a relay from
//! the rows after them.
//!
//! A row counts as one of this relay's claims' only when its `xmax` is that claim's transaction
//! id *and* the row is one the claim took: a lock shared by several sessions shows a multixact
//! id in `xmax`, from a counter of its own, which can equal a claim's transaction id
//! (`row_locks_relay::a_multixact_equal_to_a_remembered_claims_xid_still_holds_the_key` makes the
//! counters meet on purpose). An *ended* claim holds no lock: a lock with its id counts as its
//! own only if it ended after the judging claim registered (`row_locks_ended_claims::`).
//!
//! Known limit of the claim statement alone: the own claims' ids and rows (`$8`, `$9`) are read
//! when a claim registers, so a claim that writes a row back untried (`HeldBack`) and commits
//! between that registration and the statement still counts as holding the row there; a
//! multixact with its id on that row would then let the later claim take the key's next event.
//! In the relay this cannot reach the destination: the failed batch's key stays in the key
//! chain until its outcome is recorded, and the later batch holds the key's events back
//! (`row_locks_ended_mid_claim::a_relay_holds_the_key_when_its_claim_passes_a_written_back_row_as_an_ended_claims`;
//! the statement-level schedule is the ignored test beside it).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use uuid::Uuid;

use crate::complete::Failure;
use crate::transport::OutboundEvent;

/// How long a key whose earlier event another session row-locks waits before its events are
/// tried again.
pub(crate) const RECHECK: Duration = Duration::from_secs(1);

/// How many of a relay's ended claims still count as its own: a claim that ended just after
/// another one's statement met its lock must still be recognised (far more than a relay ends
/// during one claim statement).
const REMEMBERED: usize = 64;

/// The most rows a claim reads past its limit and the rows the relay's other claims hold,
/// in limits: the window grows by the rows other sessions lock (see [`Own::window`]).
const MAX_EXTRA_WINDOWS: usize = 64;

/// One line every 30 s about windows full of rows locked elsewhere.
static FULL_WINDOW_LOG: LazyLock<postal_shared::LogThrottle> =
    LazyLock::new(|| postal_shared::LogThrottle::new(Duration::from_secs(30)));

/// One claim's transaction id (32-bit, as `xmax` shows it) and the rows it left behind
/// (written back in its own transaction, holding their key: until it commits, others still
/// see them as they were, locked by it).
struct Xact {
    xid: i64,
    /// The rows its claim statement locked (sorted): a row it passed is this claim's only if
    /// it is one of them (a multixact id, from a counter of its own, can equal the claim's
    /// transaction id).
    taken: Vec<i64>,
    left_behind: Vec<i64>,
    /// When it ended, on the registration counter ([`NEXT`]; `u64::MAX` while it runs): a
    /// claim that ended before another registered held no lock during that one's statement.
    ended_at: u64,
    /// Whether its rows that wait are known (its claim statement returned and was judged, or
    /// it ended).
    settled: bool,
}

/// One relay's claims in this process.
#[derive(Default)]
struct Claims {
    /// Running claims and how many rows they hold, by registration number.
    running: HashMap<u64, (Xact, usize)>,
    /// The latest ended claims.
    ended: VecDeque<Xact>,
    /// How many more candidates the next claim reads: rows other sessions locked in the
    /// last claims' window.
    extra: usize,
}

static CLAIMS: LazyLock<Mutex<HashMap<Uuid, Claims>>> = LazyLock::new(Default::default);
static NEXT: AtomicU64 = AtomicU64::new(0);
/// Woken whenever a claim is settled.
static SETTLED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// How long a claim waits for an earlier claim of its relay, whose locks it passed, to be
/// settled; past it those locks count as another session's (its keys wait, the safe side).
const SETTLE_WAIT: Duration = Duration::from_secs(2);

fn claims() -> std::sync::MutexGuard<'static, HashMap<Uuid, Claims>> {
    CLAIMS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running claim of a relay, registered with its transaction id; it counts as ended when
/// dropped (with its claim).
pub(crate) struct OwnClaim {
    relay: Uuid,
    id: u64,
}

/// Registers a claim of `relay` whose transaction id is `xid`, before its claim statement locks
/// a row.
pub(crate) fn register(relay: Uuid, xid: i64) -> OwnClaim {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    claims().entry(relay).or_default().running.insert(
        id,
        (
            Xact {
                xid,
                taken: Vec::new(),
                left_behind: Vec::new(),
                ended_at: u64::MAX,
                settled: false,
            },
            0,
        ),
    );
    OwnClaim { relay, id }
}

impl OwnClaim {
    /// After a claim that took nothing: `full` when its window held as many candidates as it
    /// could, `foreign` of them locked by other sessions. A window full of those doubles the
    /// relay's extra window (up to [`MAX_EXTRA_WINDOWS`] batches: 128,000 rows at the default
    /// batch size; past it the rows after them wait for the locks to go), with a WARN line
    /// every 30 s; any other empty claim (nothing pending, or only the relay's own rows in
    /// flight) resets it.
    pub(crate) fn empty(&self, limit: usize, full: bool, foreign: usize) {
        let mut all = claims();
        let Some(c) = all.get_mut(&self.relay) else {
            return;
        };
        if let Some((x, _)) = c.running.get_mut(&self.id) {
            x.settled = true;
        }
        let cap = limit.saturating_mul(MAX_EXTRA_WINDOWS);
        if full && foreign > 0 {
            let at_cap = c.extra >= cap;
            c.extra = (c.extra.saturating_mul(2) + limit).min(cap);
            if let Some(suppressed) = FULL_WINDOW_LOG.admit("full window") {
                tracing::warn!(
                    locked_elsewhere = foreign,
                    window = limit + c.extra,
                    suppressed,
                    "the oldest publishable rows are row-locked by sessions that are not claims of this relay (an open transaction on postal.outbox?); {}",
                    if at_cap {
                        "the relay reads no further: the rows after them wait until the locks are gone"
                    } else {
                        "the relay reads further past them"
                    }
                );
            }
        } else {
            c.extra = 0;
        }
        drop(all);
        SETTLED.notify_waiters();
    }

    /// Records the rows the claim locked (`taken`, those it left behind among them: the rows
    /// it holds come first in the relay's next claims), and how many rows of other sessions'
    /// it passed (`passed`: the next window reads that many more).
    pub(crate) fn claimed(
        &self,
        mut taken: Vec<i64>,
        left_behind: Vec<i64>,
        limit: usize,
        passed: usize,
    ) {
        taken.sort_unstable();
        let mut all = claims();
        let Some(c) = all.get_mut(&self.relay) else {
            return;
        };
        if let Some((x, n)) = c.running.get_mut(&self.id) {
            *n = taken.len().saturating_sub(left_behind.len());
            x.taken = taken;
            x.left_behind = left_behind;
            x.settled = true;
        }
        c.extra = passed.min(limit.saturating_mul(MAX_EXTRA_WINDOWS));
        drop(all);
        SETTLED.notify_waiters();
    }

    /// Per claimed row (in sequence order), whether it must wait: the claim passed a row of
    /// its topic and key with a lower sequence number that is locked elsewhere — by a session
    /// that is no claim of this relay, or left behind by one (see [`elsewhere`]). A row locked
    /// by an earlier claim of the relay that is not settled yet waits for it to be (up to
    /// [`SETTLE_WAIT`]); one locked by a later claim that is not settled counts as elsewhere.
    /// Returns the verdicts and one [`Blocked`] per key that waits; computes nothing (empty)
    /// when the claim skipped nothing.
    pub(crate) async fn verdicts(
        &self,
        events: &[OutboundEvent],
        skipped: &[Option<Skipped>],
    ) -> (Vec<bool>, Vec<Blocked>) {
        if skipped.iter().all(Option::is_none) {
            return (Vec::new(), Vec::new());
        }
        let deadline = tokio::time::Instant::now() + SETTLE_WAIT;
        loop {
            let settled = SETTLED.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            let patient = tokio::time::Instant::now() < deadline;
            if let Some(v) = self.judge(events, skipped, patient) {
                return v;
            }
            let _ = tokio::time::timeout_at(deadline, settled).await;
        }
    }

    /// [`OwnClaim::verdicts`] as things stand: `None` when it has to wait for an earlier claim
    /// (`patient`), else the verdicts.
    fn judge(
        &self,
        events: &[OutboundEvent],
        skipped: &[Option<Skipped>],
        patient: bool,
    ) -> Option<(Vec<bool>, Vec<Blocked>)> {
        let all = claims();
        let c = all.get(&self.relay);
        let mut blocked: Vec<Blocked> = Vec::new();
        let mut verdicts = Vec::with_capacity(events.len());
        for (e, s) in events.iter().zip(skipped) {
            let mut first = None;
            for &(seq, xmax) in s.as_ref().map(|s| s.0.as_slice()).unwrap_or_default() {
                if seq >= e.seq {
                    break;
                }
                match elsewhere(c, self.id, seq, xmax) {
                    Some(true) => {
                        first = Some((seq, xmax));
                        break;
                    }
                    Some(false) => {}
                    None if patient => return None,
                    None => {
                        first = Some((seq, xmax));
                        break;
                    }
                }
            }
            if let Some((locked_seq, xmax)) = first {
                if !blocked
                    .iter()
                    .any(|b| b.topic == e.topic && b.locked_seq == locked_seq)
                {
                    blocked.push(Blocked {
                        topic: e.topic.clone(),
                        locked_seq,
                        xmax,
                        first_seq: e.seq,
                    });
                }
            }
            verdicts.push(first.is_some());
        }
        Some((verdicts, blocked))
    }
}

impl Drop for OwnClaim {
    fn drop(&mut self) {
        let mut all = claims();
        let Some(c) = all.get_mut(&self.relay) else {
            return;
        };
        if let Some((mut x, _)) = c.running.remove(&self.id) {
            x.settled = true;
            x.ended_at = NEXT.fetch_add(1, Ordering::Relaxed);
            if c.ended.len() == REMEMBERED {
                c.ended.pop_front();
            }
            c.ended.push_back(x);
        }
        drop(all);
        SETTLED.notify_waiters();
    }
}

/// What a claim of a relay needs to know of the relay's other claims.
#[derive(Default)]
pub(crate) struct Own {
    /// The transaction ids of its claims (running and lately ended) that left no row behind:
    /// rows they lock are theirs, ordered by the key chain (`$8`) — provided the row is one
    /// they took (`held`).
    pub(crate) plain: Vec<i64>,
    /// The rows the running ones of those claims took (`$9`): a row locked by an id in `plain`
    /// that is not one of these is locked by someone else (a multixact whose id happens to
    /// equal the claim's transaction id), and reported.
    pub(crate) held: Vec<i64>,
    /// How many more candidates to read: the rows its running claims hold, plus the rows of
    /// other sessions' that the last claims passed (`$7`).
    pub(crate) window: usize,
}

/// The relay's other claims, as the claim statement takes them.
pub(crate) fn own(relay: Uuid) -> Own {
    let all = claims();
    let Some(c) = all.get(&relay) else {
        return Own::default();
    };
    let xacts = c.running.values().map(|(x, _)| x).chain(c.ended.iter());
    let plain = |x: &&Xact| x.settled && x.left_behind.is_empty();
    Own {
        plain: xacts.filter(plain).map(|x| x.xid).collect(),
        held: c
            .running
            .values()
            .map(|(x, _)| x)
            .filter(plain)
            .flat_map(|x| x.taken.iter().copied())
            .collect(),
        window: c.running.values().map(|(_, n)| n).sum::<usize>() + c.extra,
    }
}

/// Whether a row claim `me` passed (`seq`, locked by `xmax`) is locked elsewhere: by a session
/// that is no claim of this relay (`Some(true)`), or left behind by one (`Some(true)`), not a
/// row one of its claims has in flight (`Some(false)`); `None` while the claim that locks it
/// is an earlier one of the relay not settled yet. A later one not settled counts as
/// elsewhere (waiting for each other could deadlock; this way only a rare interleaving makes a
/// key wait a second for nothing).
fn elsewhere(c: Option<&Claims>, me: u64, seq: i64, xmax: i64) -> Option<bool> {
    let Some(c) = c else {
        return Some(true);
    };
    if let Some((id, (x, _))) = c.running.iter().find(|(_, (x, _))| x.xid == xmax) {
        return match (x.settled, *id < me) {
            (true, _) => Some(x.not_in_flight(seq)),
            (false, true) => None,
            (false, false) => Some(true),
        };
    }
    // An ended claim locks nothing: its lock can only have been met if it ended after this
    // claim registered (before its statement). One that ended earlier gave its rows back or
    // finished them before this statement began, so a lock with its id is someone else's (a
    // multixact of the same number on a row it gave back).
    match c.ended.iter().find(|x| x.xid == xmax) {
        Some(x) => Some(x.ended_at < me || x.not_in_flight(seq)),
        None => Some(true),
    }
}

impl Xact {
    /// Whether row `seq`, locked by this claim's transaction id, is not one the claim has in
    /// flight: one it left behind, or one it never took (the lock is a multixact's whose id
    /// equals this transaction id).
    fn not_in_flight(&self, seq: i64) -> bool {
        self.left_behind.contains(&seq) || self.taken.binary_search(&seq).is_err()
    }
}

/// Rows of a claimed row's topic and key that the claim statement passed without taking: their
/// sequence numbers and `xmax`, in sequence order.
#[derive(Clone, Debug, Default)]
pub(crate) struct Skipped(Vec<(i64, i64)>);

impl Skipped {
    /// From the claim's `skipped` column (`[seq…, xmax…]`, or NULL when there are none).
    pub(crate) fn from_column(column: Option<Vec<i64>>) -> Option<Self> {
        let column = column?;
        let (seqs, xmaxes) = column.split_at(column.len() / 2);
        Some(Self(
            seqs.iter().copied().zip(xmaxes.iter().copied()).collect(),
        ))
    }

    #[cfg(test)]
    fn of(rows: &[(i64, i64)]) -> Self {
        Self(rows.to_vec())
    }
}

/// A key held back by a row another session locks, for the log line.
#[derive(Debug)]
pub(crate) struct Blocked {
    pub(crate) topic: String,
    /// The earlier row the claim skipped.
    pub(crate) locked_seq: i64,
    /// The transaction (or multixact) that locks it.
    pub(crate) xmax: i64,
    /// The key's first claimed row that waits for it.
    pub(crate) first_seq: i64,
}

/// The write-back of rows that wait: pending, holding their key until [`RECHECK`] has passed,
/// without using an attempt or changing their recorded error.
pub(crate) fn wait(seq: i64) -> Failure {
    Failure {
        seq,
        counts: false,
        park: false,
        hold: true,
        retry_in: RECHECK,
        reason: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: i64, topic: &str, key: &str) -> OutboundEvent {
        OutboundEvent {
            key: key.into(),
            ..crate::transport::sample_event(topic, seq)
        }
    }

    /// A row goes out unless the claim passed an earlier row of its topic and key that someone
    /// other than the relay's own claims locks; then it waits, and so does every later row of
    /// its key (only of its key: the same key on another topic goes out).
    #[tokio::test]
    async fn only_the_keys_behind_a_row_locked_elsewhere_wait() {
        let relay = Uuid::now_v7();
        let mine = register(relay, 700);
        mine.claimed(vec![5], Vec::new(), 10, 0);
        let me = register(relay, 701);
        let events = [
            event(10, "t", "a"), // passed row 5, locked by the relay's own claim 700
            event(11, "t", "b"), // passed row 6, locked by transaction 900 (someone else)
            event(13, "t", "b"), // the same
            event(14, "u", "b"), // the same key on another topic: its own scope
            event(15, "t", "c"), // passed nothing
            event(16, "t", "d"), // passed row 20 of its key, which comes after it
        ];
        let skipped = [
            Some(Skipped::of(&[(5, 700)])),
            Some(Skipped::of(&[(6, 900)])),
            Some(Skipped::of(&[(6, 900)])),
            None,
            None,
            Some(Skipped::of(&[(20, 900)])),
        ];
        let (verdicts, blocked) = me.verdicts(&events, &skipped).await;
        assert_eq!(verdicts, [false, true, true, false, false, false]);
        assert_eq!(blocked.len(), 1);
        assert_eq!((blocked[0].locked_seq, blocked[0].xmax), (6, 900));
        assert_eq!(blocked[0].first_seq, 11);
    }

    /// Another relay's transaction ids are not this relay's (a claim of a relay in an
    /// overlapping relay group holds the key), and an ended claim of this relay still is.
    #[tokio::test]
    async fn another_relays_claim_is_not_this_relays() {
        let (mine, theirs) = (Uuid::now_v7(), Uuid::now_v7());
        let theirs_claim = register(theirs, 42);
        let ended = register(mine, 43);
        ended.claimed(vec![1], Vec::new(), 10, 0);
        let me = register(mine, 44);
        drop(ended); // during `me`'s statement
        let (verdicts, _) = me
            .verdicts(
                &[event(2, "t", "k"), event(3, "t", "j")],
                &[Some(Skipped::of(&[(1, 42)])), Some(Skipped::of(&[(1, 43)]))],
            )
            .await;
        assert_eq!(verdicts, [true, false]);
        drop(theirs_claim);
    }

    /// A claim that skipped nothing decides nothing (no verdicts).
    #[tokio::test]
    async fn nothing_skipped_means_no_verdicts() {
        let me = register(Uuid::now_v7(), 1);
        let (verdicts, blocked) = me
            .verdicts(&[event(1, "t", "k"), event(2, "t", "k")], &[None, None])
            .await;
        assert!(verdicts.is_empty() && blocked.is_empty());
    }

    /// A row locked by an earlier claim of the relay that is not settled yet: the later claim
    /// waits until it is, then judges by what it left behind; a row left behind holds its key
    /// even once that claim ended, its other rows do not.
    #[tokio::test]
    async fn a_later_claim_waits_for_an_earlier_one_to_know_what_it_left_behind() {
        let relay = Uuid::now_v7();
        let earlier = register(relay, 1);
        let later = register(relay, 2);
        let events = [event(8, "t", "k"), event(9, "t", "j")];
        let skipped = [Some(Skipped::of(&[(7, 1)])), Some(Skipped::of(&[(6, 1)]))];
        let judged = tokio::spawn(async move {
            let v = later.verdicts(&events, &skipped).await;
            (v, later)
        });
        tokio::task::yield_now().await;
        earlier.claimed(vec![6, 7], vec![7], 10, 0);
        let ((verdicts, _), later) = judged.await.unwrap();
        assert_eq!(verdicts, [true, false]);
        drop(earlier);
        let (verdicts, _) = later
            .verdicts(
                &[event(8, "t", "k"), event(9, "t", "j")],
                &[Some(Skipped::of(&[(7, 1)])), Some(Skipped::of(&[(6, 1)]))],
            )
            .await;
        assert_eq!(verdicts, [true, false], "the same once it ended");
        assert!(!own(relay).plain.contains(&1), "its locks are reported");
    }

    /// Running claims count their rows; ended ones are remembered, the oldest forgotten; a
    /// running claim is not plain until it is settled.
    #[test]
    fn running_claims_count_their_rows_and_ended_ones_are_remembered() {
        let relay = Uuid::now_v7();
        let a = register(relay, 1);
        assert!(!own(relay).plain.contains(&1), "not settled yet");
        a.claimed((0..30).collect(), Vec::new(), 100, 0);
        let b = register(relay, 2);
        b.claimed((100..112).collect(), Vec::new(), 100, 0);
        let own_now = own(relay);
        assert_eq!(own_now.window, 42);
        assert!(own_now.plain.contains(&1) && own_now.plain.contains(&2));
        assert_eq!(own_now.held.len(), 42, "the rows they took");
        drop(a);
        assert_eq!(own(relay).window, 12);
        assert!(own(relay).plain.contains(&1));
        drop(b);
        for xid in 100..(100 + REMEMBERED as i64) {
            drop(register(relay, xid));
        }
        let own_later = own(relay);
        assert!(!own_later.plain.contains(&1) && own_later.window == 0);
    }

    /// A claim that took nothing from a window full of rows locked elsewhere widens the next
    /// window (doubling, up to a bound); an empty claim that found nothing locked elsewhere
    /// resets it (an idle relay keeps a small window); one that took rows sets it to the other
    /// sessions' rows it passed.
    #[test]
    fn the_window_grows_past_rows_locked_elsewhere() {
        let relay = Uuid::now_v7();
        let claim = register(relay, 1);
        claim.empty(10, true, 10);
        assert_eq!(own(relay).window, 10);
        claim.empty(10, true, 10);
        assert_eq!(own(relay).window, 30);
        for _ in 0..20 {
            claim.empty(10, true, 10);
        }
        assert_eq!(own(relay).window, 10 * MAX_EXTRA_WINDOWS);
        claim.empty(10, false, 0);
        assert_eq!(own(relay).window, 0, "idle: reset");
        claim.empty(10, true, 0);
        assert_eq!(
            own(relay).window,
            0,
            "full of the relay's own rows only: no growth"
        );
        claim.claimed((0..5).collect(), Vec::new(), 10, 3);
        assert_eq!(own(relay).window, 5 + 3);
    }

    /// A row locked by an id equal to one of the relay's claims' transaction ids, but that
    /// the claim never took, is locked by someone else (a multixact whose id is the same
    /// number): its key waits. Before, the id alone decided.
    #[tokio::test]
    async fn a_lock_with_a_claims_id_on_a_row_it_never_took_is_someone_elses() {
        let relay = Uuid::now_v7();
        let running = register(relay, 500);
        running.claimed(vec![3], Vec::new(), 10, 0);
        let ended = register(relay, 501);
        ended.claimed(vec![4], Vec::new(), 10, 0);
        let gone = register(relay, 503);
        gone.claimed(vec![5], Vec::new(), 10, 0);
        drop(gone); // before `me` registered: it held no lock during `me`'s statement
        let me = register(relay, 502);
        drop(ended); // during `me`'s statement
        let events = [
            event(10, "t", "a"),
            event(11, "t", "b"),
            event(12, "t", "c"),
            event(13, "t", "d"),
            event(14, "t", "e"),
        ];
        let skipped = [
            Some(Skipped::of(&[(3, 500)])), // taken by the running claim: its own
            Some(Skipped::of(&[(9, 500)])), // same id, never taken by it: someone else's
            Some(Skipped::of(&[(4, 501)])), // taken by a claim that ended meanwhile: its own
            Some(Skipped::of(&[(8, 501)])), // same id, never taken: someone else's
            Some(Skipped::of(&[(5, 503)])), // taken by a claim that had ended before: not its lock
        ];
        let (verdicts, _) = me.verdicts(&events, &skipped).await;
        assert_eq!(verdicts, [false, true, false, true, true]);
        assert!(
            !own(relay).held.contains(&4),
            "only running claims' rows go to the statement"
        );
        drop(running);
    }

    /// The column splits into (seq, xmax) pairs.
    #[test]
    fn the_column_pairs_seqs_with_their_xmax() {
        let s = Skipped::from_column(Some(vec![3, 7, 900, 901])).expect("some");
        assert_eq!(s.0, [(3, 900), (7, 901)]);
        assert!(Skipped::from_column(None).is_none());
    }
}
