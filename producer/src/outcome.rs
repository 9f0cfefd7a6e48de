//! What a batch's per-event outcomes mean for its rows: published, released for a later claim,
//! rescheduled with backoff, or parked, and what the relay's counters and pause make of them.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::complete::Failure;
use crate::config::RelayConfig;
use crate::transport::{FailureKind, OutboundEvent, PublishError};

/// Longest pause while the destination is unreachable: the backoff grows up to here, not to
/// `backoff.max`, so a relay resumes within seconds of the broker coming back.
const MAX_UNAVAILABLE_PAUSE: Duration = Duration::from_secs(10);

/// When an event that waits for its destination (e.g. a missing topic) is claimed again. Long:
/// each retry rewrites the row, and a backlog of waiting events rewritten faster than this
/// comes due again before the relay gets past it to other topics' events.
const WAITING_RETRY: Duration = Duration::from_secs(60);

/// The relay's running totals (returned as [`crate::RelayStats`] when it stops).
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) published: AtomicU64,
    pub(crate) parked: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) held_back: AtomicU64,
    /// The same per minute and topic, for the dashboard's charts.
    pub(crate) activity: Arc<crate::activity::Activity>,
}

/// A batch's outcomes as row changes.
pub(crate) struct Verdict {
    /// Sequence numbers of the acknowledged rows.
    pub(crate) published: Vec<i64>,
    /// The rows to write back: released, rescheduled or parked.
    pub(crate) failures: Vec<Failure>,
}

/// Turns outcomes into row changes and keeps the relay's totals and its pause while the
/// destination is unavailable.
#[derive(Clone)]
pub(crate) struct Judge {
    pub(crate) config: RelayConfig,
    pub(crate) counters: Arc<Counters>,
    pub(crate) unavailable_streak: Arc<AtomicU32>,
    pub(crate) paused_until: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl Judge {
    /// The row changes for `outcomes` (one per event of `batch`, in order), with each event's
    /// `attempts` as the failed attempts before this one. An unavailable destination pauses
    /// the relay.
    pub(crate) fn verdict(
        &self,
        batch: &[OutboundEvent],
        outcomes: Vec<Result<(), PublishError>>,
    ) -> Verdict {
        let mut published = Vec::with_capacity(batch.len());
        let mut failures = Vec::new();
        let mut any_unavailable = false;
        let streak = self.unavailable_streak.load(Ordering::Relaxed);
        // Keys (topic and key, [`OutboundEvent::order_key`]) with a failed event earlier in
        // this batch: their later failures were caused by (or queued behind) it and do not
        // count as attempts of their own.
        let mut failed_keys: HashSet<(&str, &str)> = HashSet::new();
        let mut overtaken = 0usize;
        for (event, outcome) in batch.iter().zip(outcomes) {
            let outcome = match outcome {
                Err(_) if !failed_keys.insert(event.order_key()) => Err(PublishError::new(
                    FailureKind::HeldBack,
                    "an earlier event of this key failed",
                )),
                Ok(()) if failed_keys.contains(&event.order_key()) => {
                    // The transport broke its contract (`Transport::send`): published after
                    // an earlier event of its key failed. Recorded as published (it is), and
                    // said loudly: the key's order is broken at the destination.
                    overtaken += 1;
                    Ok(())
                }
                other => other,
            };
            match outcome {
                Ok(()) => published.push(event.seq),
                Err(err) if err.kind == FailureKind::HeldBack => failures.push(Failure {
                    seq: event.seq,
                    counts: false,
                    park: false,
                    hold: false,
                    retry_in: Duration::ZERO,
                    reason: None,
                }),
                Err(err) => {
                    let counts =
                        !matches!(err.kind, FailureKind::Unavailable | FailureKind::Waiting);
                    let attempts = event.attempts.saturating_add(i32::from(counts));
                    // Only a failure that counts can use up the attempts (an event whose count
                    // is already at a lowered `max_attempts` is not parked for an outage).
                    let park = err.kind == FailureKind::Permanent
                        || (counts && attempts >= self.config.max_attempts);
                    // A parked row's `available_at` records when it was parked (the
                    // dashboard's time filter and chart read it): no backoff for it.
                    let retry_in = match err.kind {
                        _ if park => Duration::ZERO,
                        FailureKind::Unavailable => {
                            any_unavailable = true;
                            self.config.backoff.delay(streak).min(MAX_UNAVAILABLE_PAUSE)
                        }
                        FailureKind::Waiting => WAITING_RETRY,
                        _ => self.config.backoff.delay(attempts.max(0) as u32),
                    };
                    // Bounded and escaped: stored as `last_error`, shown by `postal failed`.
                    let reason = postal_shared::text::bounded(
                        &err.reason,
                        postal_shared::text::MAX_ERROR_BYTES,
                    )
                    .into_owned();
                    if park {
                        tracing::warn!(event_id = %event.id, topic = %postal_shared::text::field(&event.topic), key = %postal_shared::text::field(&event.key), attempts, reason = %reason, "event parked as failed");
                    } else if err.kind == FailureKind::Waiting {
                        tracing::debug!(event_id = %event.id, reason = %reason, "event waits for its destination");
                    } else {
                        tracing::debug!(event_id = %event.id, reason = %reason, "publish failed; will retry");
                    }
                    failures.push(Failure {
                        seq: event.seq,
                        counts,
                        park,
                        hold: true,
                        retry_in,
                        reason: Some(reason),
                    });
                }
            }
        }
        if overtaken > 0 {
            tracing::error!(
                events = overtaken,
                "the transport published events after an earlier event of their key failed in the same batch: their key's order is broken at the destination (a transport must hold them back)"
            );
        }
        if any_unavailable {
            let n = self.unavailable_streak.fetch_add(1, Ordering::Relaxed);
            let wait = self
                .config
                .backoff
                .delay(n)
                .clamp(Duration::from_millis(200), MAX_UNAVAILABLE_PAUSE);
            tracing::warn!(retry_in_ms = wait.as_millis() as u64, reason = %failures.iter().filter(|f| !f.counts).find_map(|f| f.reason.as_deref()).unwrap_or(""), "destination unavailable; pausing the relay");
            *self.paused_until.lock().expect("pause lock") = Some(Instant::now() + wait);
        } else if !published.is_empty() {
            self.unavailable_streak.store(0, Ordering::Relaxed);
        }
        Verdict {
            published,
            failures,
        }
    }

    /// Counts a recorded verdict: of `batch`, the rows in `published` were recorded published
    /// and `failures` written back; `enqueued` has their enqueue times (for the lag).
    pub(crate) fn count(
        &self,
        batch: &[OutboundEvent],
        enqueued: &crate::activity::Enqueued,
        published: &[i64],
        failures: &[Failure],
    ) {
        use crate::activity::Outcome;
        let topics: std::collections::HashMap<i64, &str> =
            batch.iter().map(|e| (e.seq, e.topic.as_str())).collect();
        let charted = published
            .iter()
            .map(|seq| (*seq, Outcome::Published(enqueued.get(seq).copied())))
            .chain(failures.iter().filter_map(|f| match f {
                f if f.park => Some((f.seq, Outcome::Parked)),
                // Released unsent behind an earlier failure of its key: not an attempt.
                f if !f.hold && !f.counts => None,
                f => Some((f.seq, Outcome::Retried)),
            }))
            .filter_map(|(seq, o)| Some((*topics.get(&seq)?, o)));
        self.counters.activity.record(charted);
        let published = published.len();
        let parked = failures.iter().filter(|f| f.park).count() as u64;
        // Released unsent (no attempt used) behind an earlier failure of their key.
        let held_back = failures.iter().filter(|f| !f.hold && !f.counts).count() as u64;
        let retried = failures.len() as u64 - parked - held_back;
        self.counters
            .published
            .fetch_add(published as u64, Ordering::Relaxed);
        self.counters.parked.fetch_add(parked, Ordering::Relaxed);
        self.counters.retried.fetch_add(retried, Ordering::Relaxed);
        self.counters
            .held_back
            .fetch_add(held_back, Ordering::Relaxed);
        metrics::counter!("postal_relay_published_total").increment(published as u64);
        metrics::counter!("postal_relay_failed_total").increment(parked);
        metrics::counter!("postal_relay_retried_total").increment(retried);
        metrics::counter!("postal_relay_held_back_total").increment(held_back);
    }
}
