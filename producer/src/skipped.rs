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
//! statement, so a concurrent claim of the same relay is always recognised), the claim keeps
//! none of the key's rows after it: they are written back in the claim's transaction, holding
//! their key for [`RECHECK`] (no attempt used), and the key is tried again then. The rows of
//! other keys go out as usual. Once the other session lets go of its lock, the skipped row is
//! claimed, then the rest of its key, in order.
//!
//! A lock taken by two sessions at once shows as a multixact id in `xmax`, which never matches
//! a registered transaction id of this relay except by a coincidence of counters; it then
//! counts as not this relay's, the safe side.

use std::collections::{HashMap, HashSet, VecDeque};
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

/// One relay's claims in this process.
#[derive(Default)]
struct Claims {
    /// Running claims: their transaction id (32-bit, as `xmax` shows it) and how many rows
    /// they hold, by registration number.
    running: HashMap<u64, (i64, usize)>,
    /// The transaction ids of the latest ended claims.
    ended: VecDeque<i64>,
}

static CLAIMS: LazyLock<Mutex<HashMap<Uuid, Claims>>> = LazyLock::new(Default::default);
static NEXT: AtomicU64 = AtomicU64::new(0);

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
    claims()
        .entry(relay)
        .or_default()
        .running
        .insert(id, (xid, 0));
    OwnClaim { relay, id }
}

impl OwnClaim {
    /// Records how many rows the claim holds (they come first in the relay's next claims).
    pub(crate) fn holds(&self, rows: usize) {
        if let Some(c) = claims().get_mut(&self.relay) {
            if let Some(r) = c.running.get_mut(&self.id) {
                r.1 = rows;
            }
        }
    }
}

impl Drop for OwnClaim {
    fn drop(&mut self) {
        let mut all = claims();
        let Some(c) = all.get_mut(&self.relay) else {
            return;
        };
        if let Some((xid, _)) = c.running.remove(&self.id) {
            if c.ended.len() == REMEMBERED {
                c.ended.pop_front();
            }
            c.ended.push_back(xid);
        }
    }
}

/// The transaction ids of `relay`'s claims (running and lately ended), and how many rows its
/// running claims hold.
pub(crate) fn own(relay: Uuid) -> (Vec<i64>, usize) {
    let all = claims();
    let Some(c) = all.get(&relay) else {
        return (Vec::new(), 0);
    };
    let xids = c
        .running
        .values()
        .map(|(x, _)| *x)
        .chain(c.ended.iter().copied())
        .collect();
    (xids, c.running.values().map(|(_, n)| n).sum())
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

/// Per claimed row (in sequence order), whether it must wait: the claim passed a row of its
/// topic and key with a lower sequence number that no claim of `relay` locks (checked against
/// the claims registered now). Returns the verdicts and one [`Blocked`] per key that waits;
/// computes nothing (empty) when the claim skipped nothing of another session's.
pub(crate) fn verdicts(
    relay: Uuid,
    events: &[OutboundEvent],
    skipped: &[Option<Skipped>],
) -> (Vec<bool>, Vec<Blocked>) {
    if skipped.iter().all(Option::is_none) {
        return (Vec::new(), Vec::new());
    }
    let own: HashSet<i64> = own(relay).0.into_iter().collect();
    let mut blocked: Vec<Blocked> = Vec::new();
    let verdicts = events
        .iter()
        .zip(skipped)
        .map(|(e, s)| {
            let first = s.as_ref().and_then(|s| {
                s.0.iter()
                    .find(|(seq, xmax)| *seq < e.seq && !own.contains(xmax))
            });
            if let Some(&(locked_seq, xmax)) = first {
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
            first.is_some()
        })
        .collect();
    (verdicts, blocked)
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
    #[test]
    fn only_the_keys_behind_a_row_locked_elsewhere_wait() {
        let relay = Uuid::now_v7();
        let _mine = register(relay, 700);
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
        let (verdicts, blocked) = verdicts(relay, &events, &skipped);
        assert_eq!(verdicts, [false, true, true, false, false, false]);
        assert_eq!(blocked.len(), 1);
        assert_eq!((blocked[0].locked_seq, blocked[0].xmax), (6, 900));
        assert_eq!(blocked[0].first_seq, 11);
    }

    /// Another relay's transaction ids are not this relay's (a claim of a relay in an
    /// overlapping relay group holds the key), and an ended claim of this relay still is.
    #[test]
    fn another_relays_claim_is_not_this_relays() {
        let (mine, theirs) = (Uuid::now_v7(), Uuid::now_v7());
        let _theirs = register(theirs, 42);
        drop(register(mine, 43));
        let (verdicts, _) = verdicts(
            mine,
            &[event(2, "t", "k"), event(3, "t", "j")],
            &[Some(Skipped::of(&[(1, 42)])), Some(Skipped::of(&[(1, 43)]))],
        );
        assert_eq!(verdicts, [true, false]);
    }

    /// A claim that skipped nothing decides nothing (no verdicts).
    #[test]
    fn nothing_skipped_means_no_verdicts() {
        let (verdicts, blocked) = verdicts(
            Uuid::now_v7(),
            &[event(1, "t", "k"), event(2, "t", "k")],
            &[None, None],
        );
        assert!(verdicts.is_empty() && blocked.is_empty());
    }

    /// Running claims count their rows; ended ones are remembered, the oldest forgotten.
    #[test]
    fn running_claims_count_their_rows_and_ended_ones_are_remembered() {
        let relay = Uuid::now_v7();
        let a = register(relay, 1);
        a.holds(30);
        let b = register(relay, 2);
        b.holds(12);
        assert_eq!(own(relay).1, 42);
        drop(a);
        assert_eq!(own(relay).1, 12);
        assert!(own(relay).0.contains(&1));
        for xid in 100..(100 + REMEMBERED as i64) {
            drop(register(relay, xid));
        }
        let (xids, rows) = own(relay);
        assert!(!xids.contains(&1) && xids.contains(&2) && rows == 12);
    }

    /// The column splits into (seq, xmax) pairs.
    #[test]
    fn the_column_pairs_seqs_with_their_xmax() {
        let s = Skipped::from_column(Some(vec![3, 7, 900, 901])).expect("some");
        assert_eq!(s.0, [(3, 900), (7, 901)]);
        assert!(Skipped::from_column(None).is_none());
    }
}
