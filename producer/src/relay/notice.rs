//! The transport's word that a batch was recorded (or never will be), given exactly once.

use std::sync::Arc;

use super::Shared;
use crate::key_chain;
use crate::transport::{OutboundEvent, PublishError, Transport};

/// Tells the transport about a batch exactly once: [`RecordedNotice::recorded`] after the
/// relay recorded it, or "not recorded" when the task recording it is dropped first (aborted
/// at shutdown), so that nothing the transport chains behind the batch waits for good.
pub(super) struct RecordedNotice<T: Transport> {
    pub(super) shared: Arc<Shared<T>>,
    /// The claimed batch, as recorded.
    pub(super) batch: Vec<OutboundEvent>,
    /// What of it was handed to the transport (all of it, unless the key chain held some back).
    sent: Vec<OutboundEvent>,
    /// The batch's place in the relay's key chain (transports that do not chain keys).
    chain: Option<key_chain::Entry>,
    told: bool,
}

impl<T: Transport> RecordedNotice<T> {
    /// The notice for a batch just handed over, not told yet.
    pub(super) fn new(
        shared: Arc<Shared<T>>,
        batch: Vec<OutboundEvent>,
        sent: Vec<OutboundEvent>,
        chain: Option<key_chain::Entry>,
    ) -> Self {
        RecordedNotice {
            shared,
            batch,
            sent,
            chain,
            told: false,
        }
    }

    pub(super) async fn recorded(mut self, committed: bool) {
        // A batch with failures leaves the chain (and the transport hears of its commit) only
        // between claims: a claim in progress took its snapshot before this commit.
        let failed = self
            .chain
            .as_ref()
            .is_some_and(key_chain::Entry::failed_any);
        let _gate = if self.shared.chained || failed {
            Some(self.shared.record_gate.write().await)
        } else {
            None
        };
        if let Some(entry) = &self.chain {
            self.shared.key_chain.remove(entry);
        }
        self.shared.transport.recorded(&self.sent, committed);
        self.told = true;
    }

    /// The batch's outcome, for the batches of the key chain that wait for it.
    pub(super) fn resolve(&mut self, outcomes: &[Result<(), PublishError>]) {
        if let Some(entry) = &mut self.chain {
            entry.resolve(outcomes);
        }
    }

    /// The batch was given up: for the key chain, all of it failed.
    pub(super) fn resolve_failed(&mut self) {
        if let Some(entry) = &mut self.chain {
            entry.resolve_failed();
        }
    }
}

impl<T: Transport> Drop for RecordedNotice<T> {
    fn drop(&mut self) {
        if !self.told {
            if let Some(entry) = &self.chain {
                self.shared.key_chain.remove(entry);
            }
            self.shared.transport.recorded(&self.sent, false);
        }
    }
}
