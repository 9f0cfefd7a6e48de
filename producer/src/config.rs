//! Relay settings with their documented defaults.

use std::time::Duration;

use crate::Error;
use postal_shared::Backoff;

/// How the relay claims, retries and cleans up. Every field has a default (see
/// [`RelayConfig::default`]); [`RelayConfig::validate`] rejects nonsensical values.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Rows claimed per statement (default 2000).
    pub batch_size: usize,
    /// Batches handed to the transport whose acknowledgements are still awaited (default 4).
    pub max_in_flight_batches: usize,
    /// Parallel claim loops of the whole relay group (default 4), each over its own share of
    /// the key partitions and with an equal share (rounded up) of `max_in_flight_batches` (one
    /// batch in flight each by default). With `n` live relays in the group each runs
    /// `lanes / n` of them, rounded up: adding relays adds standbys and spreads the relays'
    /// own work without multiplying the claims that compete in PostgreSQL.
    pub lanes: usize,
    /// Lease on key partitions (default 60 s), renewed every quarter of it: a dead relay's
    /// partitions move to the others within this time. A claim transaction may stay idle for at
    /// most half of it, which must exceed the transport's delivery timeout (Kafka:
    /// `message.timeout.ms`, 20 s by default). A relay claims only with more than 55 % of the
    /// lease left, and one whose heartbeats fail gives up its batches in flight when a quarter
    /// is left.
    pub lease: Duration,
    /// Safety-net polling interval when no notification arrives (default 1 s).
    pub poll_interval: Duration,
    /// Wake up on `LISTEN postal_outbox` notifications (default `true`).
    pub listen: bool,
    /// Attempts before an event is parked as failed (default 10). Unavailability of the
    /// destination never counts as an attempt.
    pub max_attempts: i32,
    /// Retry backoff: exponential with full jitter (default 500 ms doubling up to 5 min).
    /// While the destination is unreachable the pause grows the same way but stops at 10 s.
    pub backoff: Backoff,
    /// Delete rows once published (default `true`); when `false` they are marked `published`
    /// and removed later by retention cleanup.
    pub delete_on_publish: bool,
    /// With `delete_on_publish = false`: delete published rows older than this, in batches,
    /// every 15 s (or every `lease`, when shorter), one instance at a time (default: keep them;
    /// no cleanup).
    pub retention: Option<Duration>,
    /// History mode (default off): keep published events this long in
    /// `postal.outbox_history`, a table partitioned by UTC day of publication. Each published
    /// row is still deleted from the outbox at once and written to the history in the same
    /// transaction; partitions are created a day ahead and dropped whole once their day ended
    /// more than this long ago (no row-by-row DELETE, no vacuum), by one instance at a time.
    /// Requires `delete_on_publish` (it replaces keeping rows in the outbox).
    pub history: Option<Duration>,
    /// How long shutdown waits for a batch still being handed to the destination, and then
    /// for in-flight acknowledgements (default 20 s each).
    pub shutdown_timeout: Duration,
    /// Relay group (default `default`). Relays split the key partitions among the live members
    /// of their own group; give relays that serve different topics of one outbox (see
    /// `topics`) different groups.
    pub group: String,
    /// Which topics this relay claims (default: all).
    pub topics: TopicFilter,
    /// Where the relay finds committed events: by polling the outbox (default) or from a
    /// logical replication slot ([`RelaySource::Wal`], docs/wal-relay.md).
    pub source: RelaySource,
}

/// Where a relay finds the committed events it publishes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RelaySource {
    /// Claims from `postal.outbox` (the default).
    #[default]
    Poll,
    /// Reads the outbox inserts from a logical replication slot, in commit order, and marks
    /// the rows it published as polling does. One relay streams from a slot at a time (a
    /// lease; others stand by), and while it does it runs a sweep, a polling relay of its
    /// group for the rows the stream leaves pending (from before the slot, scheduled,
    /// retried): docs/wal-relay.md. With a topic filter it publishes only those topics of the
    /// stream (another relay group, on a slot of its own or polling, publishes the others).
    /// Do not run other polling relays of its topics on the same outbox.
    Wal(crate::wal::WalSource),
}

postal_shared::setters!(RelayConfig {
    batch_size: usize,
    max_in_flight_batches: usize,
    lanes: usize,
    lease: Duration,
    poll_interval: Duration,
    listen: bool,
    max_attempts: i32,
    backoff: Backoff,
    delete_on_publish: bool,
    retention: Option<Duration>,
    history: Option<Duration>,
    shutdown_timeout: Duration,
    group: String,
    topics: TopicFilter,
    source: RelaySource,
});

/// The topics a relay claims from the outbox.
///
/// Several relay groups can share one outbox by topic: e.g. `postal relay` for every topic
/// except `reports` (its group `default`), and the reporting service's embedded relay running
/// task handlers for `reports` only (group `reports`). Per-key order holds within each group;
/// a parked event still holds back the later events of its key in every group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TopicFilter {
    /// Every topic.
    #[default]
    All,
    /// Only these topics.
    Only(Vec<String>),
    /// Every topic except these.
    Except(Vec<String>),
}

impl TopicFilter {
    /// (`only`, `except`) as bound to the claim statement.
    pub(crate) fn binds(&self) -> (Option<&[String]>, Option<&[String]>) {
        match self {
            TopicFilter::All => (None, None),
            TopicFilter::Only(t) => (Some(t), None),
            TopicFilter::Except(t) => (None, Some(t)),
        }
    }

    /// This filter less the paused topics (`paused_all`: every topic is paused), or `None`
    /// when nothing is left to claim.
    pub(crate) fn without(&self, paused_all: bool, paused: &[String]) -> Option<TopicFilter> {
        if paused_all {
            return None;
        }
        if paused.is_empty() {
            return Some(self.clone());
        }
        match self {
            TopicFilter::All => Some(TopicFilter::Except(paused.to_vec())),
            TopicFilter::Only(t) => {
                let left: Vec<String> = t.iter().filter(|t| !paused.contains(t)).cloned().collect();
                (!left.is_empty()).then_some(TopicFilter::Only(left))
            }
            TopicFilter::Except(t) => {
                let mut all = t.clone();
                all.extend(paused.iter().filter(|p| !t.contains(p)).cloned());
                Some(TopicFilter::Except(all))
            }
        }
    }

    /// Whether this filter lets `topic` through.
    pub(crate) fn claims(&self, topic: &str) -> bool {
        match self {
            TopicFilter::All => true,
            TopicFilter::Only(t) => t.iter().any(|t| t == topic),
            TopicFilter::Except(t) => !t.iter().any(|t| t == topic),
        }
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch_size: 2000,
            max_in_flight_batches: 4,
            lanes: 4,
            lease: Duration::from_secs(60),
            poll_interval: Duration::from_secs(1),
            listen: true,
            max_attempts: 10,
            backoff: Backoff {
                base: Duration::from_millis(500),
                max: Duration::from_secs(300),
            },
            delete_on_publish: true,
            retention: None,
            history: None,
            shutdown_timeout: Duration::from_secs(20),
            group: crate::lease::DEFAULT_GROUP.into(),
            topics: TopicFilter::All,
            source: RelaySource::Poll,
        }
    }
}

impl RelayConfig {
    /// The connections this configuration can use at once: a claim per lane and per batch in
    /// flight, plus the lease heartbeat, the `LISTEN` session, housekeeping and the activity
    /// report (the dashboard's charts). A WAL relay wants its own (two row-locking
    /// transactions, the lease, housekeeping and the slot's metrics) and its sweep's (one lane,
    /// its batches in flight, its lease heartbeat, its activity report, its bound). Size the
    /// relay's pool so (`postal relay` does); a smaller pool makes claims wait.
    pub fn connections_wanted(&self) -> u32 {
        match self.source {
            RelaySource::Poll => (self.max_in_flight_batches + self.lanes + 4) as u32,
            RelaySource::Wal(_) => (5 + self.max_in_flight_batches + 1 + 4) as u32,
        }
    }

    /// Checks the settings; the error names the offending one.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: &str| Err(Error::Config(m.to_owned()));
        if self.batch_size == 0 || self.batch_size > 100_000 {
            return bad("batch size must be between 1 and 100000");
        }
        if self.max_in_flight_batches == 0 || self.max_in_flight_batches > 64 {
            return bad("max in-flight batches must be between 1 and 64");
        }
        if self.lanes == 0 || self.lanes > 256 {
            return bad("lanes must be between 1 and 256");
        }
        if self.lease < Duration::from_secs(2) {
            return bad("lease must be at least 2s");
        }
        if self.poll_interval.is_zero() {
            return bad("poll interval must be positive");
        }
        if self.max_attempts < 1 {
            return bad("max attempts must be at least 1");
        }
        if self.backoff.base.is_zero() || self.backoff.max < self.backoff.base {
            return bad("backoff base must be positive and not above the backoff max");
        }
        if self.retention.is_some() && self.delete_on_publish {
            return bad("retention applies to published rows kept in the outbox, and none are kept: set delete_on_publish = false (--keep-published, POSTAL_KEEP_PUBLISHED=true) or drop the retention");
        }
        if let Some(h) = self.history {
            if !self.delete_on_publish {
                return bad("history mode replaces keeping published rows in the outbox: use one or the other");
            }
            if h < Duration::from_secs(60) {
                return bad("history retention must be at least 60s");
            }
        }
        if self.group.is_empty() || self.group.len() > 100 {
            return bad("relay group must be 1 to 100 characters");
        }
        if let TopicFilter::Only(t) = &self.topics {
            if t.is_empty() {
                return bad("a relay limited to topics needs at least one topic");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::TopicFilter;

    /// Guarantee: a relay's topic filter less the paused topics lets through exactly the
    /// topics it let through that are not paused, and nothing when every topic is paused or
    /// every topic it claims is.
    #[test]
    fn a_filter_without_the_paused_topics_claims_exactly_the_rest() {
        let p = |t: &[&str]| t.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let filters = [
            TopicFilter::All,
            TopicFilter::Only(p(&["a", "b"])),
            TopicFilter::Except(p(&["c"])),
        ];
        for f in &filters {
            assert_eq!(f.without(true, &[]), None);
            assert_eq!(f.without(false, &[]).as_ref(), Some(f));
            let left = f.without(false, &p(&["a", "x"])).expect("something left");
            for t in ["a", "b", "c", "x", "y"] {
                let want = f.claims(t) && t != "a" && t != "x";
                assert_eq!(left.claims(t), want, "{f:?} less a, x: {t}");
            }
        }
        assert_eq!(
            TopicFilter::Only(p(&["a"])).without(false, &p(&["a"])),
            None
        );
    }
}
