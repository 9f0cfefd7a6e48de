//! The relay's steps as plain functions, for tests that play a relay by hand: take a lease,
//! claim rows, complete them, and the WAL relay's (read a slot's transactions, take its lease,
//! publish a batch) (feature `test-util`; not a stable API).

/// Claiming rows for publication (see `Claim`).
pub mod claim {
    pub use crate::claim::{
        all_partitions, claim, lease_reserve, Claim, CLAIM_DELETE, PLAN_SETTINGS,
    };
    pub use crate::complete::Failure;
}

/// Partition leases between relays.
pub mod lease {
    pub use crate::lease::{heartbeat, Lease, DEFAULT_GROUP};
}

/// The WAL relay's steps: a slot's changes read by SQL decoded into transactions, the slot's
/// lease, one batch published.
pub mod wal {
    pub use crate::wal::by_hand::{
        publish, take_lease, transactions, Committed, LeaseLost, SlotLease,
    };
}
