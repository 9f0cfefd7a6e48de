//! The relay's steps as plain functions, for tests that play a relay by hand: take a lease,
//! claim rows, complete them (feature `test-util`; not a stable API).

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
