//! The WAL relay's steps as plain functions, for tests that play it by hand (feature
//! `test-util`, re-exported as `crate::testing::wal`): the slot's changes read by SQL
//! (`pg_logical_slot_peek_binary_changes`) turned into whole transactions, the slot's lease
//! taken without a renewal task, and one batch published with the relay's own code
//! ([`super::publish::publish`]).

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use super::{lease, pgoutput, publish, stream};
use crate::config::RelayConfig;
use crate::relay::{RelayHealth, RelayStats};
use crate::transport::Transport;

/// One committed transaction as the slot gives it: its id, its outbox inserts' `seq` in
/// order, and its commit's end LSN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    /// The transaction's id (32 bits, as pgoutput's `Begin` gives it).
    pub xid: u32,
    /// Its outbox inserts' `seq`, in order.
    pub seqs: Vec<i64>,
    /// Its commit's end LSN.
    pub end_lsn: u64,
}

/// Decodes the pgoutput messages of one SQL read of a slot (the `data` column of
/// `pg_logical_slot_peek_binary_changes(slot, NULL, NULL, 'proto_version', '1',
/// 'publication_names', publication)`, in order) into whole transactions, in commit order.
pub fn transactions(messages: &[Vec<u8>]) -> Result<Vec<Committed>, String> {
    let mut decoder = pgoutput::Decoder::default();
    let mut open: Option<(u32, Vec<i64>)> = None;
    let mut out = Vec::new();
    for m in messages {
        match m.first() {
            // Begin: final LSN (8), commit time (8), xid (4).
            Some(b'B') => {
                let xid = m
                    .get(17..21)
                    .ok_or("a truncated begin")?
                    .try_into()
                    .map(u32::from_be_bytes)
                    .map_err(|_| "a truncated begin")?;
                open = Some((xid, Vec::new()));
            }
            // Commit: flags (1), commit LSN (8), end LSN (8), commit time (8).
            Some(b'C') => {
                let end_lsn = m
                    .get(10..18)
                    .ok_or("a truncated commit")?
                    .try_into()
                    .map(u64::from_be_bytes)
                    .map_err(|_| "a truncated commit")?;
                let (xid, seqs) = open.take().ok_or("a commit without its begin")?;
                out.push(Committed { xid, seqs, end_lsn });
            }
            _ => {
                if let pgoutput::Change::Outbox(seq) = decoder.decode(m)? {
                    open.as_mut()
                        .ok_or("an outbox insert outside a transaction")?
                        .1
                        .push(seq);
                }
            }
        }
    }
    Ok(out)
}

/// The slot's lease, held by a relay played by hand: not renewed (the test ends it in the
/// database when it wants), and by this process's clock valid for as long as `lease`.
pub struct SlotLease(lease::Held);

impl SlotLease {
    /// The lease's fencing token.
    pub fn token(&self) -> i64 {
        self.0.token
    }
}

/// Takes the slot's lease for `holder` if it is free or expired (`None`: another holder's).
pub async fn take_lease(
    pool: &PgPool,
    slot: &str,
    holder: Uuid,
    lease: Duration,
) -> Result<Option<SlotLease>, sqlx::Error> {
    Ok(lease::take(pool, slot, holder, "", lease)
        .await?
        .map(|(token, until)| SlotLease(lease::Held::unrenewed(slot, holder, token, lease, until))))
}

/// The slot's lease moved to another relay while a batch was published: nothing more of it
/// was marked.
#[derive(Debug, PartialEq, Eq)]
pub struct LeaseLost;

/// Publishes `batch` (whole transactions, in commit order) after the rows `carried` from the
/// call before, as the WAL relay publishes a batch read from its slot: each row locked or
/// taken, handed to `transport`, judged and marked under `lease`. Returns the rows to carry
/// into the next call (the slot is not to be confirmed past the batch while there are any).
/// The carried rows are sent again only when `due`.
pub async fn publish<T: Transport>(
    pool: &PgPool,
    transport: &T,
    config: &RelayConfig,
    carried: Vec<i64>,
    due: bool,
    batch: &[Committed],
    lease: &SlotLease,
) -> Result<Vec<i64>, LeaseLost> {
    let mut b = stream::Batch::default();
    for t in batch {
        if !t.seqs.is_empty() {
            b.xids.push(t.xid);
        }
        b.seqs.extend(&t.seqs);
        b.end_lsn = t.end_lsn;
    }
    let health = RelayHealth::default();
    let mut busy = publish::BusyWatch::new(&health);
    let judge = crate::outcome::Judge {
        config: config.clone(),
        counters: Default::default(),
        unavailable_streak: Default::default(),
        paused_until: Default::default(),
    };
    let mut stats = RelayStats::default();
    // Chunks aside (slow acknowledgements) are waited for before the call returns.
    let mut aside = super::aside::Aside::<T>::settled_by_caller();
    let carry = publish::publish(
        pool, transport, config, carried, due, &b, &lease.0, &mut busy, &judge, &mut stats,
        &mut aside,
    )
    .await;
    if !aside.is_empty() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3600);
        if !publish::settle_aside(
            transport, config, &judge, &lease.0, &mut stats, &mut aside, deadline,
        )
        .await
        {
            return Err(LeaseLost);
        }
    }
    match carry {
        Ok(carry) => Ok(carry.rows),
        Err(super::LeaseLost) => Err(LeaseLost),
    }
}
