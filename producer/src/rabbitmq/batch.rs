//! One batch's publishing: rounds of at most one unconfirmed message per key, returns
//! matched by message id.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::join_all;
use lapin::options::BasicPublishOptions;
use lapin::Confirmation;
use lapin::{BasicProperties, Channel};

use crate::transport::{FailureKind, PublishError};

use super::exchange::{ExchangeState, PUBLISH_REFUSED_RECHECK};
use super::failure::{blocked_error, lost};
use super::link::{close, no_answer, Link};

/// One event of a batch, ready to publish (owned: the publishing runs in the acks future).
pub(super) struct Prepared {
    pub(super) index: usize,
    /// Its key's queue in [`BatchRun::keys`].
    pub(super) slot: usize,
    pub(super) id: String,
    pub(super) exchange: String,
    pub(super) routing_key: String,
    pub(super) payload: Vec<u8>,
    pub(super) properties: BasicProperties,
}

/// What the broker said about one published message of a round.
pub(super) enum Heard {
    Ack,
    Nack,
    /// The channel or connection failed.
    Lost(PublishError),
    /// No confirm within the confirm timeout.
    TimedOut,
}

/// Publishes a batch on its own confirm-mode channel, in rounds: a round sends the next event
/// of every key that is still clear and waits for all its confirms. So per key at most one
/// message is unconfirmed at a time (other keys pipeline within the round), and a key whose
/// message was nacked, returned or lost sends nothing more in this batch: its later events are
/// held back, as RabbitMQ cannot take back a message once sent.
///
/// Returned (unroutable) messages are matched to events by their message id (the event id),
/// never by which confirm lapin attached them to: lapin hands the oldest waiting return to
/// whichever confirm it resolves next. Once every confirm of the channel resolved, every
/// return the broker sent for them is attached to one of them (the broker sends a message's
/// return before its ack), so after a round all its returns are known.
pub(super) struct BatchRun {
    pub(super) link: Arc<Link>,
    pub(super) channel: Channel,
    /// Per key, its events' indexes into `prepared`, in batch order.
    pub(super) keys: Vec<std::collections::VecDeque<usize>>,
    pub(super) prepared: Vec<Prepared>,
    pub(super) outcomes: Vec<Option<Result<(), PublishError>>>,
    pub(super) confirm_timeout: Duration,
    pub(super) connect_timeout: Duration,
    pub(super) exchanges: Arc<Mutex<HashMap<String, ExchangeState>>>,
}

impl BatchRun {
    pub(super) async fn run(mut self) -> Vec<Result<(), PublishError>> {
        let mut failure: Option<PublishError> = None;
        // The exchange whose refusal `failure` is, when it is one (its events wait).
        let mut refused_exchange: Option<String> = None;
        let mut timed_out = false;
        loop {
            let round: Vec<usize> = self
                .keys
                .iter_mut()
                .filter_map(std::collections::VecDeque::pop_front)
                .collect();
            if round.is_empty() {
                break;
            }
            let deadline = tokio::time::Instant::now() + self.confirm_timeout;
            let mut confirms = Vec::with_capacity(round.len());
            let mut unsent = Vec::new();
            for &p in &round {
                if failure.is_some() {
                    unsent.push(p);
                    continue;
                }
                if self.link.connection.status().blocked() {
                    failure = Some(blocked_error());
                    unsent.push(p);
                    continue;
                }
                let m = &self.prepared[p];
                // Handing a message over can wait on the broker's flow control: bounded like
                // a confirm.
                let published = tokio::time::timeout_at(
                    deadline,
                    self.channel.basic_publish(
                        m.exchange.as_str().into(),
                        m.routing_key.as_str().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &m.payload,
                        m.properties.clone(),
                    ),
                )
                .await;
                match published {
                    Ok(Ok(confirm)) => confirms.push((p, confirm)),
                    Ok(Err(e)) => {
                        let err = lost("publishing", &e, &m.exchange);
                        if err.kind == FailureKind::Waiting {
                            refused_exchange = Some(m.exchange.clone());
                            self.publish_refused(&m.exchange, &err.reason);
                        }
                        failure = Some(err);
                        unsent.push(p);
                    }
                    Err(_) => {
                        timed_out = true;
                        failure = Some(no_answer("publishing", self.confirm_timeout));
                        unsent.push(p);
                    }
                }
            }
            // Every confirm of the round, each until the round's deadline.
            let prepared = &self.prepared;
            let heard = join_all(confirms.into_iter().map(|(p, confirm)| async move {
                match tokio::time::timeout_at(deadline, confirm).await {
                    Ok(Ok(Confirmation::Ack(r))) => (p, Heard::Ack, r),
                    Ok(Ok(Confirmation::Nack(r))) => (p, Heard::Nack, r),
                    Ok(Ok(Confirmation::NotRequested)) => (
                        p,
                        Heard::Lost(PublishError::new(
                            FailureKind::Unavailable,
                            "publisher confirms are not enabled on the channel",
                        )),
                        None,
                    ),
                    Ok(Err(e)) => (
                        p,
                        Heard::Lost(lost(
                            "awaiting the publisher confirm",
                            &e,
                            &prepared[p].exchange,
                        )),
                        None,
                    ),
                    Err(_) => (p, Heard::TimedOut, None),
                }
            }))
            .await;
            let mut returned: HashMap<String, String> = HashMap::new();
            let mut anonymous_returns = 0usize;
            for (_, _, r) in &heard {
                if let Some(r) = r {
                    let reason = format!("{} {}", r.reply_code, r.reply_text);
                    match r.properties.message_id() {
                        Some(id) => {
                            returned.insert(id.as_str().to_owned(), reason);
                        }
                        None => anonymous_returns += 1,
                    }
                }
            }
            let round_ids: HashSet<&str> = heard
                .iter()
                .map(|(p, _, _)| self.prepared[*p].id.as_str())
                .collect();
            let strays = returned
                .keys()
                .filter(|id| !round_ids.contains(id.as_str()))
                .count();
            if strays + anonymous_returns > 0 {
                // Cannot happen on a channel of our own; if it does, no acked message of the
                // round may count as published.
                tracing::error!(
                    strays,
                    anonymous_returns,
                    "RabbitMQ returned messages that match no event of the round"
                );
            }
            for (p, heard, _) in heard {
                let m = &self.prepared[p];
                let outcome = match heard {
                    Heard::Ack if strays + anonymous_returns > 0 => Err(PublishError::new(
                        FailureKind::Unavailable,
                        "RabbitMQ returned a message that could not be matched to its event",
                    )),
                    Heard::Ack => match returned.get(&m.id) {
                        None => Ok(()),
                        Some(reason) => Err(PublishError::new(
                            FailureKind::Transient,
                            format!(
                                "unroutable: exchange {:?} has no queue bound for routing key {:?} ({reason})",
                                m.exchange, m.routing_key
                            ),
                        )),
                    },
                    Heard::Nack => Err(PublishError::new(
                        FailureKind::Transient,
                        "RabbitMQ nacked the message (it could not store it)",
                    )),
                    Heard::TimedOut => {
                        timed_out = true;
                        let err = PublishError::new(
                            FailureKind::Unavailable,
                            format!("no publisher confirm within {:?}", self.confirm_timeout),
                        );
                        if failure.is_none() {
                            failure = Some(err.clone());
                        }
                        Err(err)
                    }
                    Heard::Lost(err) => {
                        if err.kind == FailureKind::Waiting {
                            self.publish_refused(&m.exchange, &err.reason);
                        }
                        if failure.is_none() {
                            if err.kind == FailureKind::Waiting {
                                refused_exchange = Some(m.exchange.clone());
                            }
                            failure = Some(err.clone());
                        }
                        Err(err)
                    }
                };
                let index = m.index;
                if outcome.is_err() {
                    self.clear_key_of(p);
                }
                self.outcomes[index] = Some(outcome);
            }
            for p in unsent {
                let mut err = failure.clone().expect("unsent only after a failure");
                if err.kind == FailureKind::Waiting
                    && refused_exchange.as_deref() != Some(self.prepared[p].exchange.as_str())
                {
                    // Another exchange's refusal closed the channel: not this one's problem.
                    err = PublishError::new(
                        FailureKind::HeldBack,
                        "not sent: RabbitMQ closed the channel over another exchange",
                    );
                }
                self.clear_key_of(p);
                self.outcomes[self.prepared[p].index] = Some(Err(err));
            }
            if failure.is_some() {
                // Whatever is left is not sent on this channel.
                break;
            }
        }
        // Events never sent: behind a failed event of their key (held back), or left when the
        // channel failed (unavailable).
        for q in &self.keys {
            for &p in q {
                let err = match &failure {
                    Some(f) => f.clone(),
                    None => PublishError::new(
                        FailureKind::HeldBack,
                        "an earlier event of this key failed",
                    ),
                };
                self.outcomes[self.prepared[p].index] = Some(Err(err));
            }
        }
        self.finish(failure.is_some(), timed_out).await;
        self.outcomes
            .into_iter()
            .map(|o| o.expect("every event has an outcome"))
            .collect()
    }

    /// The event `p` failed: the later events of its key in the batch are held back.
    /// Notes that the broker refused a publish to `exchange`: its later events wait without
    /// being published for [`PUBLISH_REFUSED_RECHECK`].
    pub(super) fn publish_refused(&self, exchange: &str, reason: &str) {
        self.exchanges.lock().expect("exchange cache").insert(
            exchange.to_owned(),
            ExchangeState::Refused(
                reason.to_owned(),
                std::time::Instant::now(),
                PUBLISH_REFUSED_RECHECK,
            ),
        );
    }

    pub(super) fn clear_key_of(&mut self, p: usize) {
        let slot = self.prepared[p].slot;
        for later in std::mem::take(&mut self.keys[slot]) {
            self.outcomes[self.prepared[later].index] = Some(Err(PublishError::new(
                FailureKind::HeldBack,
                "an earlier event of this key failed",
            )));
        }
    }

    /// Closes the batch's channel. A channel that failed may mean a deleted exchange (the
    /// broker closes the channel with NOT_FOUND): the exchanges are checked again. A connection
    /// that failed or stopped answering is closed (the next batch opens a fresh one), unless
    /// the broker blocks it (a resource alarm): a blocked connection cannot even send its
    /// close, so it is kept, and used again once the broker unblocks it, instead of leaving a
    /// blocked connection behind per retry whose buffered messages arrive later.
    pub(super) async fn finish(&self, failed: bool, timed_out: bool) {
        let blocked = self.link.connection.status().blocked();
        if failed && !self.channel.status().connected() {
            // Ready exchanges are checked again; refusals keep their own time.
            self.exchanges
                .lock()
                .expect("exchange cache")
                .retain(|_, state| matches!(state, ExchangeState::Refused(..)));
        }
        if blocked {
            // Closes once the broker unblocks the connection (or the connection ends).
            let channel = self.channel.clone();
            tokio::spawn(async move {
                let _ = channel.close(200, "batch done".into()).await;
            });
            return;
        }
        if self.channel.status().connected() && !timed_out {
            let _ = tokio::time::timeout(
                self.connect_timeout,
                self.channel.close(200, "batch done".into()),
            )
            .await;
        }
        if timed_out || !self.link.usable() {
            close(
                self.connect_timeout,
                &self.link.connection,
                320,
                "postal relay reconnects",
            )
            .await;
        }
    }
}
