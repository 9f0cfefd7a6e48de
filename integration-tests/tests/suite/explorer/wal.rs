//! The explorer's WAL relay (issue 50): a relay that reads the slot's committed transactions
//! and publishes them with the WAL relay's own code (`postal_producer::testing::wal`: its
//! row take, lock, verdict and marks under the slot's lease), through the gate like every
//! other session. The stream is played by SQL reads of the slot
//! (`pg_logical_slot_peek_binary_changes`): each read gives the transactions committed since
//! the slot's confirmed position, of which the relay takes those it has not received yet, as a
//! replication session goes on from where it is. The slot is confirmed
//! (`pg_replication_slot_advance`) only past a batch that left nothing to carry, as the relay
//! confirms it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use postal_producer::testing::wal;
use postal_producer::{Backoff, FailureKind, OutboundEvent, PublishError, RelayConfig, Transport};
use sqlx::PgPool;
use uuid::Uuid;

use super::{note, Fail, Published, Shared, LEASE, MAX_ATTEMPTS};

/// The slot and publication of an explorer database.
#[derive(Clone)]
pub struct SlotNames {
    pub slot: String,
    pub publication: String,
}

/// The destination of a WAL relay played by hand: accepts or fails each event as the
/// scenario says, and holds back a key's later events of a send after one of them failed,
/// as a transport must. The relay's verdict turns its failures into row changes.
pub struct Destination {
    pub name: &'static str,
    pub fails: Arc<HashMap<Uuid, Fail>>,
    pub log: Shared,
    /// The drain's: nothing fails.
    pub drain: bool,
}

impl Transport for Destination {
    type Acks = futures::future::Ready<Vec<Result<(), PublishError>>>;

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        let mut log = self.log.lock().unwrap();
        let mut blocked: HashSet<(&str, &str)> = HashSet::new();
        let mut out = Vec::with_capacity(batch.len());
        for e in batch {
            let scope = (e.topic.as_str(), e.key.as_str());
            let id = e.id.as_uuid();
            if blocked.contains(&scope) {
                log.saw("wal destination: held back behind its key's failure");
                out.push(Err(PublishError::new(FailureKind::HeldBack, "held back")));
                continue;
            }
            let before = log.failed.get(&id).copied().unwrap_or(0);
            let fail = if self.drain {
                None
            } else {
                match self.fails.get(&id).copied().unwrap_or(Fail::None) {
                    Fail::Transient { times, .. } if before < times => Some(FailureKind::Transient),
                    Fail::Permanent if before < 1 => Some(FailureKind::Permanent),
                    Fail::Fenced { times } if before < times => Some(FailureKind::HeldBack),
                    _ => None,
                }
            };
            match fail {
                Some(kind) => {
                    log.saw(match kind {
                        FailureKind::Transient => "wal destination: failed (an attempt)",
                        FailureKind::Permanent => "wal destination: failed for good",
                        _ => "wal destination: key fence (held back first)",
                    });
                    *log.failed.entry(id).or_default() += 1;
                    blocked.insert(scope);
                    out.push(Err(PublishError::new(kind, "explorer")));
                }
                None => {
                    if !self.drain {
                        log.saw(if self.name == "r2" {
                            "r2 published from the slot"
                        } else {
                            "r1 published from the slot"
                        });
                    }
                    log.published.push(Published {
                        seq: e.seq,
                        id,
                        topic: e.topic.clone(),
                        key: e.key.clone(),
                        by: self.name,
                    });
                    out.push(Ok(()));
                }
            }
        }
        futures::future::ready(out)
    }
}

/// The WAL relay's configuration in the explorer: one chunk per batch (the scenarios are
/// small), the explorer's attempts, and retries at once or (`later`) within an hour.
pub fn config(delete_on_publish: bool, later: bool) -> RelayConfig {
    let backoff = if later {
        Backoff {
            base: Duration::from_secs(3600),
            max: Duration::from_secs(3600),
        }
    } else {
        Backoff {
            base: Duration::ZERO,
            max: Duration::ZERO,
        }
    };
    RelayConfig::default()
        .batch_size(100)
        .lease(LEASE)
        .max_attempts(MAX_ATTEMPTS)
        .backoff(backoff)
        .delete_on_publish(delete_on_publish)
}

/// A WAL relay played by hand.
pub struct SimWal {
    pub pool: PgPool,
    pub id: Uuid,
    pub name: &'static str,
    pub slot: SlotNames,
    pub config: RelayConfig,
    pub destination: Destination,
    pub log: Shared,
    /// The slot's lease, once taken (r1's before the schedule starts).
    pub lease: Option<wal::SlotLease>,
    /// The end LSN of the last transaction received.
    pub received: u64,
    /// Rows carried to the next batch (the slot is not confirmed meanwhile).
    pub carried: Vec<i64>,
}

impl SimWal {
    /// Takes the slot's lease over (once its holder's ran out), then reads and publishes
    /// `rounds` times.
    pub async fn run(mut self, rounds: u32, takes_over: bool) {
        if takes_over {
            match wal::take_lease(&self.pool, &self.slot.slot, self.id, LEASE).await {
                Ok(Some(l)) => {
                    note(
                        &self.log,
                        "wal: took the slot's lease over",
                        format!(
                            "{}: holds the slot's lease (token {})",
                            self.name,
                            l.token()
                        ),
                    );
                    self.lease = Some(l);
                }
                Ok(None) => note(
                    &self.log,
                    "wal: takeover found the slot leased",
                    format!("{}: the slot's lease is another's", self.name),
                ),
                Err(e) => note(
                    &self.log,
                    "wal: lease take failed",
                    format!("{}: could not take the slot's lease: {e}", self.name),
                ),
            }
        }
        for _ in 0..rounds {
            self.round(false).await;
        }
    }

    /// One read of the slot, the publication of what it gave (after the carried rows), and
    /// the slot's confirmation when nothing is left to carry.
    pub async fn round(&mut self, drain: bool) {
        let Some(lease) = &self.lease else {
            return;
        };
        let read: Result<Vec<Vec<u8>>, sqlx::Error> = sqlx::query_scalar(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                 'proto_version', '1', 'publication_names', $2)",
        )
        .bind(&self.slot.slot)
        .bind(&self.slot.publication)
        .fetch_all(&self.pool)
        .await;
        let messages = match read {
            Ok(m) => m,
            Err(e) => {
                note(
                    &self.log,
                    "wal: slot read failed",
                    format!("{}: could not read the slot: {e}", self.name),
                );
                return;
            }
        };
        let received = self.received;
        let batch: Vec<wal::Committed> = wal::transactions(&messages)
            .expect("the slot's pgoutput messages decode")
            .into_iter()
            .filter(|t| t.end_lsn > received)
            .collect();
        if let Some(t) = batch.last() {
            self.received = t.end_lsn;
        }
        if batch.iter().all(|t| t.seqs.is_empty()) && self.carried.is_empty() {
            if !drain {
                self.log.lock().unwrap().saw("wal: read nothing new");
            }
            if !batch.is_empty() {
                self.confirm(drain).await;
            }
            return;
        }
        let carried = std::mem::take(&mut self.carried);
        let published = wal::publish(
            &self.pool,
            &self.destination,
            &self.config,
            carried,
            true,
            &batch,
            lease,
        )
        .await;
        match published {
            Ok(carry) if carry.is_empty() => self.confirm(drain).await,
            Ok(carry) => {
                if !drain {
                    self.log
                        .lock()
                        .unwrap()
                        .saw("wal: rows carried to the next batch");
                }
                self.carried = carry;
            }
            Err(wal::LeaseLost) => {
                note(
                    &self.log,
                    "wal: marks refused, the slot's lease moved",
                    format!("{}: lost the slot's lease with a batch in hand", self.name),
                );
                // As the relay: it stops streaming and stands by.
                self.lease = None;
            }
        }
    }

    /// Confirms the slot up to the last transaction received.
    async fn confirm(&mut self, drain: bool) {
        let lsn = format!(
            "{:X}/{:X}",
            self.received >> 32,
            self.received & 0xFFFF_FFFF
        );
        let r = sqlx::query("SELECT pg_replication_slot_advance($1, $2::pg_lsn)")
            .bind(&self.slot.slot)
            .bind(&lsn)
            .execute(&self.pool)
            .await;
        match r {
            Ok(_) if !drain => self.log.lock().unwrap().saw("wal: confirmed the slot"),
            Ok(_) => {}
            Err(e) => note(
                &self.log,
                "wal: slot confirmation failed",
                format!("{}: could not confirm the slot: {e}", self.name),
            ),
        }
    }
}
