//! Keeps each key's order when the Kafka producer is replaced.
//!
//! After a delivery timeout or a fatal error the transport replaces its producer at once
//! ([`super::ProducerSlot::replace`]); the old producer's queued and in-flight records are
//! purged and come back held back, to be claimed again. The relay keeps several batches in
//! flight per lane, and a later batch may hold later events of a key whose earlier events are
//! still in an earlier batch: without a fence, K:10 could go out through the new producer and
//! be acknowledged while K:9, purged from the old one (or still without an outcome there), is
//! republished only after it — the key's first deliveries out of order.
//!
//! So every key with a record that the old producer had no outcome for when it was replaced is
//! *fenced*: the transport hands no record of that key to any producer meanwhile, but returns it
//! held back (not attempted; the relay releases it without using up an attempt). The fence is
//! held by the batch that carried the unresolved record, and a batch that was held back by the
//! fence holds it too (its own held-back rows are written back only when it is recorded). A
//! batch lets go of its keys once every record of it that was handed over has an outcome *and*
//! the relay recorded the batch ([`crate::Transport::recorded`]): only then are its failed or
//! purged rows back in the outbox, so that the next claim of the key starts with them.
//!
//! The happy path costs one hash per record (kept for the case of a replacement), a few atomic
//! operations per record and one short lock per batch to register it and one when it is
//! recorded; fenced keys are looked up only while any key is fenced.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use postal_shared::EventId;

use crate::transport::OutboundEvent;

/// A record not handed to a producer (yet, or at all).
const IDLE: u8 = 0;
/// Handed to a producer, no outcome yet.
const HANDED: u8 = 1;
/// Its outcome is known (acknowledged, failed or purged).
const RESOLVED: u8 = 2;

/// Why a record of a fenced key was held back.
pub(super) const FENCED: &str =
    "an earlier event of this key has no recorded outcome yet in a replaced Kafka producer";

/// One batch as the fence sees it: which producer generation it went to, its records' keys
/// and whether each has an outcome yet.
pub(super) struct Tracked {
    /// The first event's id: what [`KeyFence::recorded`] finds the batch by.
    id: Option<EventId>,
    generation: u64,
    /// Hash of (topic, key) per record.
    keys: Box<[u64]>,
    /// [`IDLE`], [`HANDED`] or [`RESOLVED`] per record.
    states: Box<[AtomicU8]>,
    /// Set once the batch holds keys in the fence: the last outcome then tries to release it.
    holding: AtomicBool,
}

impl Tracked {
    /// Notes that record `index` is about to be handed over. Sequentially consistent with the
    /// generation check that follows it and with [`KeyFence::fence_generation`]: either the
    /// replacement sees the record as handed over (and fences its key), or the sender sees
    /// the new generation (and does not hand it to the old producer).
    pub(super) fn handing(&self, index: usize) {
        self.states[index].store(HANDED, Ordering::SeqCst);
    }

    /// Record `index` was not handed over after all.
    pub(super) fn not_handed(&self, index: usize) {
        self.states[index].store(IDLE, Ordering::SeqCst);
    }

    /// Record `index` has its outcome; `true` when the batch holds keys in the fence (then the
    /// caller tries to release them, [`KeyFence::try_release`]).
    pub(super) fn resolved(&self, index: usize) -> bool {
        self.states[index].store(RESOLVED, Ordering::SeqCst);
        self.holding.load(Ordering::SeqCst)
    }

    pub(super) fn id(&self) -> Option<EventId> {
        self.id
    }

    fn unresolved(&self) -> bool {
        self.states
            .iter()
            .any(|s| s.load(Ordering::SeqCst) == HANDED)
    }
}

/// The keys that no record may be handed over for now, and the batches that hold them.
#[derive(Default)]
pub(super) struct KeyFence {
    state: Mutex<State>,
    /// How many keys are fenced: zero (nearly always) means nothing to look up.
    fenced: AtomicUsize,
}

#[derive(Default)]
struct State {
    /// Batches handed to the transport and not yet recorded, by their first event's id.
    batches: HashMap<EventId, Entry>,
    /// Fenced key → how many holds (by batches) it has.
    keys: HashMap<u64, usize>,
    /// Size of `batches` at which entries that can no longer matter are dropped (a transport
    /// used without a relay never hears of its batches being recorded).
    prune_at: usize,
}

struct Entry {
    tracked: Weak<Tracked>,
    /// The keys this batch holds (a key may appear more than once).
    holds: Vec<u64>,
    /// The relay recorded the batch.
    recorded: bool,
}

/// The fence's key for a record: its topic and key (order is per key within a topic).
fn key_of(event: &OutboundEvent) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    event.topic.hash(&mut h);
    event.key.hash(&mut h);
    h.finish()
}

impl KeyFence {
    /// Registers a batch about to be handed to producer `generation`.
    pub(super) fn track(&self, batch: &[OutboundEvent], generation: u64) -> Arc<Tracked> {
        let tracked = Arc::new(Tracked {
            id: batch.first().map(|e| e.id),
            generation,
            keys: batch.iter().map(key_of).collect(),
            states: batch.iter().map(|_| AtomicU8::new(IDLE)).collect(),
            holding: AtomicBool::new(false),
        });
        let Some(id) = tracked.id else {
            return tracked;
        };
        let mut state = self.state.lock().expect("key fence");
        let mut entry = Entry {
            tracked: Arc::downgrade(&tracked),
            holds: Vec::new(),
            recorded: false,
        };
        // The same events sent again before the relay recorded the first attempt (only a
        // caller other than the relay does that): the holds stay until this one is recorded.
        if let Some(old) = state.batches.remove(&id) {
            entry.holds = old.holds;
            if !entry.holds.is_empty() {
                tracked.holding.store(true, Ordering::SeqCst);
            }
        }
        state.batches.insert(id, entry);
        if state.batches.len() >= state.prune_at {
            // A batch whose records all have their outcome (its tracking is gone) and that
            // holds nothing has nothing left to release.
            state
                .batches
                .retain(|_, e| !e.holds.is_empty() || e.tracked.strong_count() > 0);
            state.prune_at = state.batches.len() * 2 + 64;
        }
        tracked
    }

    /// Whether any key is fenced (an atomic load; see [`KeyFence::hold_if_fenced`]).
    pub(super) fn any(&self) -> bool {
        self.fenced.load(Ordering::Acquire) > 0
    }

    /// If the key of record `index` of the batch is fenced, the batch holds it too (so that
    /// the key stays fenced until this held-back record is written back) and `true` is
    /// returned: the record must not be handed over.
    pub(super) fn hold_if_fenced(&self, tracked: &Tracked, index: usize) -> bool {
        let mut state = self.state.lock().expect("key fence");
        if !state.keys.contains_key(&tracked.keys[index]) {
            return false;
        }
        self.hold(&mut state, tracked, index);
        true
    }

    /// Fences the key of record `index` of the batch, held by that batch.
    pub(super) fn hold_key(&self, tracked: &Tracked, index: usize) {
        let mut state = self.state.lock().expect("key fence");
        self.hold(&mut state, tracked, index);
    }

    fn hold(&self, state: &mut State, tracked: &Tracked, index: usize) {
        let Some(id) = tracked.id else { return };
        let key = tracked.keys[index];
        tracked.holding.store(true, Ordering::SeqCst);
        let entry = state.batches.entry(id).or_insert_with(|| Entry {
            tracked: Weak::new(),
            holds: Vec::new(),
            recorded: false,
        });
        entry.holds.push(key);
        *state.keys.entry(key).or_insert(0) += 1;
        self.fenced.store(state.keys.len(), Ordering::Release);
    }

    /// The producer of generation `old` is being replaced (called before the new one is
    /// handed out): every key with a record handed to it and still without an outcome is
    /// fenced, held by that record's batch.
    pub(super) fn fence_generation(&self, old: u64) {
        let mut state = self.state.lock().expect("key fence");
        let batches: Vec<Arc<Tracked>> = state
            .batches
            .values()
            .filter_map(|e| e.tracked.upgrade())
            .filter(|t| t.generation == old)
            .collect();
        let mut fenced = 0;
        for tracked in batches {
            // Before reading the states (see `Tracked::handing`): an outcome arriving from now
            // on tries to release the batch.
            tracked.holding.store(true, Ordering::SeqCst);
            for (index, s) in tracked.states.iter().enumerate() {
                if s.load(Ordering::SeqCst) == HANDED {
                    self.hold(&mut state, &tracked, index);
                    fenced += 1;
                }
            }
        }
        if fenced > 0 {
            tracing::info!(
                records = fenced,
                keys = state.keys.len(),
                "holding back the keys of records the replaced Kafka producer had no outcome for"
            );
        }
    }

    /// The relay recorded `batch` (or gave it back): its keys are released once its records
    /// all have their outcome.
    pub(super) fn recorded(&self, batch: &[OutboundEvent]) {
        let Some(id) = batch.first().map(|e| e.id) else {
            return;
        };
        let mut state = self.state.lock().expect("key fence");
        if let Some(entry) = state.batches.get_mut(&id) {
            entry.recorded = true;
            self.release(&mut state, id);
        }
    }

    /// Releases the batch's keys if it is recorded and every record of it has its outcome.
    pub(super) fn try_release(&self, id: EventId) {
        let mut state = self.state.lock().expect("key fence");
        self.release(&mut state, id);
    }

    fn release(&self, state: &mut State, id: EventId) {
        let Some(entry) = state.batches.get(&id) else {
            return;
        };
        if !entry.recorded || entry.tracked.upgrade().is_some_and(|t| t.unresolved()) {
            return;
        }
        let entry = state.batches.remove(&id).expect("present");
        for key in entry.holds {
            if let Some(n) = state.keys.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    state.keys.remove(&key);
                }
            }
        }
        self.fenced.store(state.keys.len(), Ordering::Release);
    }

    /// Whether the key of this event is fenced (tests).
    #[cfg(test)]
    pub(super) fn is_fenced(&self, event: &OutboundEvent) -> bool {
        self.state
            .lock()
            .expect("key fence")
            .keys
            .contains_key(&key_of(event))
    }
}
