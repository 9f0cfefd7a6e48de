//! The confirmation rule: which LSN the relay may report as flushed to its slot.
//!
//! PostgreSQL starts a restarted slot's stream at the first transaction that commits after
//! the confirmed position, and may recycle the WAL before it. So the relay confirms a position
//! only when every outbox insert committed before it was acknowledged by the broker and its
//! row marked (or was found already published): the end LSN of the last commit of a batch it
//! finished, once the whole batch is done. With nothing of its own outstanding, it may also
//! confirm the position of a keepalive (everything the server had to send before it was
//! received and finished), so that an outbox that stays idle while the rest of the database
//! writes does not hold back WAL.

/// What the relay has received and finished, as LSNs (`u64`).
#[derive(Debug, Default)]
pub(crate) struct Confirm {
    /// The highest position confirmed so far (never goes back).
    confirmed: u64,
    /// The end LSN of the last commit received whose batch is not finished yet.
    outstanding: Option<u64>,
}

impl Confirm {
    /// A batch ending with the commit at `end_lsn` was received; it is not finished.
    pub(crate) fn received(&mut self, end_lsn: u64) {
        self.outstanding = Some(end_lsn.max(self.outstanding.unwrap_or(0)));
    }

    /// The batch received last is finished: its position may be confirmed.
    pub(crate) fn finished(&mut self) -> u64 {
        if let Some(end) = self.outstanding.take() {
            self.confirmed = self.confirmed.max(end);
        }
        self.confirmed
    }

    /// A keepalive at `wal_end`: confirmable only with nothing outstanding.
    pub(crate) fn keepalive(&mut self, wal_end: u64) -> Option<u64> {
        if self.outstanding.is_some() || wal_end <= self.confirmed {
            return None;
        }
        self.confirmed = wal_end;
        Some(wal_end)
    }

    /// The highest position confirmed so far.
    #[cfg(test)]
    pub(crate) fn confirmed(&self) -> u64 {
        self.confirmed
    }
}

#[cfg(test)]
mod tests {
    use super::Confirm;

    /// Guarantee: nothing past a received batch is confirmed before that batch is finished,
    /// not even by a keepalive, and the confirmed position never goes back.
    #[test]
    fn a_received_batch_blocks_confirmation_until_finished() {
        let mut c = Confirm::default();
        assert_eq!(c.keepalive(100), Some(100));
        c.received(200);
        assert_eq!(c.keepalive(300), None);
        assert_eq!(c.confirmed(), 100);
        assert_eq!(c.finished(), 200);
        assert_eq!(c.keepalive(150), None);
        assert_eq!(c.keepalive(300), Some(300));
        assert_eq!(c.finished(), 300);
    }
}
