//! Per-key order across the batches one relay has in flight at once.
//!
//! A claim skips rows that another claim of this relay still locks (`SKIP LOCKED`), and until
//! that claim commits, a failed row of it is not yet written back as holding its key. So a
//! later claim can take a key's later events while its earlier ones are in flight in another
//! batch: if the earlier one then fails (refused, nacked, timed out), the later one must not be
//! published ahead of it. The chain makes that impossible for every transport whose rows are
//! not checked out ([`crate::Transport::checks_out`]):
//!
//! - each batch registers its keys when it is handed over, in claim order, and depends on the
//!   batches before it that hold any of its keys and have not been recorded yet;
//! - before its events are handed over, it waits for the outcome of those batches (their
//!   acknowledgements, not their commit); its events whose key had a failure there (or was held
//!   back there) are not sent but held back, to be claimed again behind the failed event, which
//!   by then holds the key in the outbox;
//! - a batch with failures leaves the chain only once the relay recorded it, under the relay's
//!   record gate, which every claim holds until its batch is handed over: a claim whose
//!   snapshot predates that commit (and so took the key's later events) still sees the failure.
//!
//! Batches without a key in common wait for nothing, so unrelated keys keep their pipelining;
//! a key with events in two batches at once hands the later ones over only after the earlier
//! ones' acknowledgements.
//!
//! A held-back batch holds its keys back in turn, in the batches registered while it was
//! unrecorded: under a steady backlog, with a claim made while each batch is in flight, one
//! failure would hold its keys back in every later batch, for good (a batch given up in full
//! held every key of a small key set back and the relay published nothing more). So a batch
//! that the chain holds back (and a batch given up) asks the relay to *settle*: its next claim
//! waits until no batch that holds a key back is left in the chain ([`KeyChain::settled`]),
//! each of them recorded and its failed and held-back rows back in the outbox, and takes each
//! key from its earliest unpublished event again. Batches without a failure stay in flight
//! meanwhile, and a failure that holds nothing back in a later batch (its key in no other batch
//! in flight) does not settle at all: unrelated keys keep their pipelining.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{watch, Notify};

use crate::transport::{OutboundEvent, PublishError};

/// A key as the chain knows it: a hash of its topic and key (order is per key within a topic;
/// a collision only makes two keys wait for each other).
fn key_of(event: &OutboundEvent) -> u64 {
    let mut h = DefaultHasher::new();
    event.topic.hash(&mut h);
    event.key.hash(&mut h);
    h.finish()
}

/// One batch in the chain.
pub(crate) struct Link {
    /// `Some(keys with a failure)` once the batch's outcome is known.
    outcome: watch::Sender<Option<Arc<HashSet<u64>>>>,
    /// The batch holds a key back from later batches: one of its events failed, or the chain
    /// held some back in it (known before its outcome is).
    holds: AtomicBool,
}

impl Link {
    /// The keys that failed (or were held back) in this batch, once its outcome is known.
    async fn failed(&self) -> Arc<HashSet<u64>> {
        let mut rx = self.outcome.subscribe();
        loop {
            if let Some(failed) = rx.borrow_and_update().clone() {
                return failed;
            }
            if rx.changed().await.is_err() {
                // Unreachable while `self` holds the sender; count everything as failed.
                return Arc::new(HashSet::new());
            }
        }
    }
}

/// The batches of one relay that are in flight or not yet recorded, by key.
#[derive(Default)]
pub(crate) struct KeyChain {
    /// Key → every batch registered with it and not yet removed.
    batches: Mutex<HashMap<u64, Vec<Arc<Link>>>>,
    settle: Arc<Settle>,
}

/// Whether a hold was passed on since the relay last settled, and the wake-up when a batch
/// leaves the chain.
#[derive(Default)]
struct Settle {
    wanted: Mutex<bool>,
    left: Notify,
}

impl Settle {
    /// `link` holds a key back: the relay settles before its next claim.
    fn hold(&self, link: &Link) {
        link.holds.store(true, Ordering::SeqCst);
        *self.wanted.lock().expect("settle") = true;
    }
}

/// A batch's place in the chain, from hand-over until it is recorded.
pub(crate) struct Entry {
    link: Arc<Link>,
    keys: Vec<u64>,
    /// Earlier batches with a key of this one, not yet recorded when it registered.
    deps: Vec<Arc<Link>>,
    resolved: bool,
    failed_any: bool,
    settle: Arc<Settle>,
}

impl KeyChain {
    /// Registers `batch` (called in claim order, before any later claim can register).
    pub(crate) fn register(&self, batch: &[OutboundEvent]) -> Entry {
        let (tx, _) = watch::channel(None);
        let link = Arc::new(Link {
            outcome: tx,
            holds: AtomicBool::new(false),
        });
        let keys: Vec<u64> = batch.iter().map(key_of).collect();
        let mut deps: Vec<Arc<Link>> = Vec::new();
        let mut last = self.batches.lock().expect("key chain");
        let mut seen = HashSet::new();
        for k in &keys {
            if !seen.insert(*k) {
                continue;
            }
            let links = last.entry(*k).or_default();
            for prev in links.iter() {
                if !deps.iter().any(|d| Arc::ptr_eq(d, prev)) {
                    deps.push(prev.clone());
                }
            }
            links.push(link.clone());
        }
        Entry {
            link,
            keys,
            deps,
            resolved: false,
            failed_any: false,
            settle: self.settle.clone(),
        }
    }

    /// Returns at once unless a hold was passed on to a later batch since the relay last
    /// settled; then waits until no batch that holds a key back (one with a failure, or with
    /// events the chain held back) is left in the chain, so that the next claim registers
    /// behind none of them and takes their keys from the earliest unpublished event. Batches
    /// without a failure stay in flight meanwhile (a slow one does not stop the relay). Called
    /// by a lane before it claims, holding no claim of its own.
    pub(crate) async fn settled(&self) {
        loop {
            let left = self.settle.left.notified();
            tokio::pin!(left);
            left.as_mut().enable();
            {
                let mut wanted = self.settle.wanted.lock().expect("settle");
                if !*wanted {
                    return;
                }
                let holding = self
                    .batches
                    .lock()
                    .expect("key chain")
                    .values()
                    .flatten()
                    .any(|l| l.holds.load(Ordering::SeqCst));
                if !holding {
                    *wanted = false;
                    return;
                }
            }
            left.await;
        }
    }

    /// Takes the batch out of the chain: its keys no longer make later batches wait.
    pub(crate) fn remove(&self, entry: &Entry) {
        // The keys this batch failed: the batches registered behind it with one of them are
        // held back there (marked now, before their own `wait` may have seen it).
        let failed = entry.link.outcome.borrow().clone();
        let mut passed_on = false;
        let mut last = self.batches.lock().expect("key chain");
        for k in &entry.keys {
            if let Some(links) = last.get_mut(k) {
                if let Some(pos) = links.iter().position(|l| Arc::ptr_eq(l, &entry.link)) {
                    if failed.as_ref().is_some_and(|f| f.contains(k)) {
                        for later in &links[pos + 1..] {
                            later.holds.store(true, Ordering::SeqCst);
                            passed_on = true;
                        }
                    }
                    links.remove(pos);
                }
                if links.is_empty() {
                    last.remove(k);
                }
            }
        }
        drop(last);
        if passed_on {
            *self.settle.wanted.lock().expect("settle") = true;
        }
        self.settle.left.notify_waiters();
    }
}

impl Entry {
    /// Waits for the batches this one depends on; returns, per event of the batch, whether it
    /// must be held back (an earlier event of its key failed or was held back there).
    pub(crate) async fn wait(&self) -> Vec<bool> {
        let mut failed: HashSet<u64> = HashSet::new();
        for dep in &self.deps {
            failed.extend(dep.failed().await.iter().copied());
        }
        let held: Vec<bool> = self.keys.iter().map(|k| failed.contains(k)).collect();
        if held.iter().any(|h| *h) {
            // A hold passed on to this batch, which passes it on in turn: settle.
            self.settle.hold(&self.link);
        }
        held
    }

    /// Whether the batch waits for another one.
    pub(crate) fn has_deps(&self) -> bool {
        !self.deps.is_empty()
    }

    /// Publishes the batch's outcome to the batches that wait for it: the keys of events that
    /// did not succeed.
    pub(crate) fn resolve(&mut self, outcomes: &[Result<(), PublishError>]) {
        let failed: HashSet<u64> = self
            .keys
            .iter()
            .zip(outcomes)
            .filter(|(_, o)| o.is_err())
            .map(|(k, _)| *k)
            .collect();
        self.failed_any = !failed.is_empty();
        self.resolved = true;
        if self.failed_any {
            // Marked, not settled for: it holds keys back only from batches registered behind
            // it, whose `wait` asks for the settle.
            self.link.holds.store(true, Ordering::SeqCst);
        }
        self.link.outcome.send_replace(Some(Arc::new(failed)));
    }

    /// The batch is given up without outcomes: every key counts as failed.
    pub(crate) fn resolve_failed(&mut self) {
        let failed: HashSet<u64> = self.keys.iter().copied().collect();
        self.failed_any = !failed.is_empty();
        self.resolved = true;
        if self.failed_any {
            self.settle.hold(&self.link);
        }
        self.link.outcome.send_replace(Some(Arc::new(failed)));
    }

    /// Whether some key failed: leaving the chain must then wait for the record gate.
    pub(crate) fn failed_any(&self) -> bool {
        self.failed_any
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        // Never leave a waiting batch hanging: an entry dropped unresolved failed everything.
        if !self.resolved {
            self.resolve_failed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{sample_event, FailureKind};

    fn keyed(seq: i64, key: &str) -> OutboundEvent {
        OutboundEvent {
            key: key.into(),
            ..sample_event("t", seq)
        }
    }

    /// A batch waits only for earlier unrecorded batches that share a key with it, and holds
    /// back exactly its events whose key failed there; keys without an earlier batch go at
    /// once; a removed batch no longer makes anyone wait.
    #[tokio::test]
    async fn a_later_batch_holds_back_only_the_keys_that_failed_before_it() {
        let chain = KeyChain::default();
        let mut a = chain.register(&[keyed(1, "k"), keyed(2, "j")]);
        let b = chain.register(&[keyed(3, "k"), keyed(4, "x"), keyed(5, "j")]);
        let c = chain.register(&[keyed(6, "y")]);
        assert!(!a.has_deps() && b.has_deps() && !c.has_deps());
        let waiting = tokio::spawn(async move { (b.wait().await, b) });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "b waits for a's outcome");
        a.resolve(&[
            Err(PublishError::new(FailureKind::Transient, "nack")),
            Ok(()),
        ]);
        let (held, mut b) = waiting.await.unwrap();
        assert_eq!(held, vec![true, false, false]);
        // b's held-back k counts as failed for whatever comes after b.
        b.resolve(&[
            Err(PublishError::new(FailureKind::HeldBack, "held")),
            Ok(()),
            Ok(()),
        ]);
        let d = chain.register(&[keyed(7, "k")]);
        assert_eq!(d.wait().await, vec![true]);
        chain.remove(&a);
        chain.remove(&b);
        chain.remove(&d);
        let e = chain.register(&[keyed(8, "k")]);
        assert!(!e.has_deps(), "nothing left to wait for");
    }

    /// A batch dropped before its outcome (given up, aborted) counts as failed for every key,
    /// so nothing waits for it forever and nothing overtakes it.
    #[tokio::test]
    async fn a_dropped_batch_fails_its_keys_for_the_batches_behind_it() {
        let chain = KeyChain::default();
        let a = chain.register(&[keyed(1, "k")]);
        let b = chain.register(&[keyed(2, "k")]);
        drop(a);
        assert_eq!(b.wait().await, vec![true]);
    }
}
