//! The outbox rows of a batch read from the slot: locked, published, marked.
//!
//! The WAL says which rows were committed and in which order; the outbox row says whether one
//! is still to publish. A batch's rows are locked (`FOR UPDATE`, waiting for any other session
//! that holds one, such as a polling relay finishing its claim) and only those still pending,
//! due at once and not behind a held row of their key are published, in commit order. The
//! acknowledged ones are marked in the same transaction, the way polling marks them (deleted,
//! or marked `published` with `--keep-published`), and it commits before the relay confirms
//! the slot's position. So a row already published by a polling relay, or by this relay before
//! a crash that came before its confirmation, is not published again.

use sqlx::{PgPool, Postgres, Transaction};

use crate::transport::OutboundEvent;

/// The batch's rows that are to publish, locked, in the order of `seqs`.
pub(crate) struct Locked {
    tx: Transaction<'static, Postgres>,
    /// In commit order.
    pub events: Vec<OutboundEvent>,
    /// Rows of the batch still pending that the relay does not publish: held, or behind a held
    /// row of their key (scheduled for later, waiting for a retry, parked, checked out).
    pub left: usize,
}

/// Locks the rows `seqs` that are still to publish and reads them.
pub(crate) async fn lock(pool: &PgPool, seqs: &[i64]) -> Result<Locked, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query(concat!(
        "SELECT ",
        crate::claim::returned!(),
        ", NULL::int8[] AS skipped, 0::int8 AS passed, \
         (d.held OR d.running OR EXISTS (SELECT 1 FROM postal.outbox h \
              WHERE h.held AND h.event_key = d.event_key AND h.topic = d.topic \
              AND h.seq < d.seq)) AS left_behind \
         FROM postal.outbox d WHERE d.seq = ANY($1) AND d.status = 'pending' \
         FOR UPDATE OF d"
    ))
    .bind(seqs)
    .fetch_all(&mut *tx)
    .await?;
    let mut found = std::collections::HashMap::with_capacity(rows.len());
    let mut left = 0;
    for row in &rows {
        use sqlx::Row as _;
        if row.try_get::<bool, _>(16)? {
            left += 1;
            continue;
        }
        let (event, _, _) = crate::claim::decode(row)?;
        found.insert(event.seq, event);
    }
    let events = seqs.iter().filter_map(|s| found.remove(s)).collect();
    Ok(Locked { tx, events, left })
}

impl Locked {
    /// Marks the acknowledged rows `published` as polling does (deleted, or kept and marked
    /// `published`) and commits.
    pub(crate) async fn mark(mut self, published: &[i64], delete: bool) -> Result<(), sqlx::Error> {
        if delete {
            sqlx::query("DELETE FROM postal.outbox WHERE seq = ANY($1) AND status = 'pending'")
                .bind(published)
                .execute(&mut *self.tx)
                .await?;
        } else {
            crate::complete::mark(&mut self.tx, published, &[]).await?;
        }
        self.tx.commit().await
    }
}
