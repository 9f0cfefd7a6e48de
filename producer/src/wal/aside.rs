//! Chunks whose acknowledgements are slow, set aside so that other keys go on.
//!
//! A chunk handed to the transport whose acknowledgements have not all come within
//! [`SLOW_ACK`] (a slow partition leader, a record waiting for a broker) is set aside: it keeps
//! its transaction (its rows locked or taken) while the relay publishes the following chunks
//! and reads on from the slot. While it is aside, its rows are passed to every lock as rows
//! not to send ([`super::rows::lock`]'s `defer`), so that its keys' later rows are carried,
//! not sent: per key, nothing passes a row whose outcome is not known. Its outcomes are
//! recorded as soon as they come (marked in its own transaction), in any order against the
//! other chunks: no two chunks in flight share a key. The slot is not confirmed while a chunk
//! is aside. At most `max_in_flight_batches - 1` chunks are aside (the chunk being sent is
//! the last); past that the relay waits for the oldest.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use super::rows;
use crate::complete::Failure;
use crate::transport::{OutboundEvent, PublishError, Transport};

/// How long a chunk's acknowledgements are awaited before it is set aside.
pub(super) const SLOW_ACK: Duration = Duration::from_millis(500);

/// How many chunks may be aside at once for `config`.
pub(super) fn max_aside(config: &crate::config::RelayConfig) -> usize {
    config.max_in_flight_batches.saturating_sub(1).max(1)
}

/// A chunk handed to the transport whose outcomes are awaited.
pub(super) struct Chunk<T: Transport> {
    /// Its rows in commit order: the sent ones and those parked before they were sent.
    pub seqs: Vec<i64>,
    pub locked: rows::Locked,
    pub events: Vec<OutboundEvent>,
    pub refused: Vec<Failure>,
    acks: Pin<Box<T::Acks>>,
    outcomes: Option<Vec<Result<(), PublishError>>>,
}

impl<T: Transport> Chunk<T> {
    pub(super) fn new(
        seqs: Vec<i64>,
        locked: rows::Locked,
        events: Vec<OutboundEvent>,
        refused: Vec<Failure>,
        acks: Pin<Box<T::Acks>>,
    ) -> Self {
        Chunk {
            seqs,
            locked,
            events,
            refused,
            acks,
            outcomes: None,
        }
    }

    /// Its outcomes, once they came.
    pub(super) fn outcomes(&mut self) -> Vec<Result<(), PublishError>> {
        self.outcomes.take().unwrap_or_default()
    }

    /// Polls its acknowledgements; `true` once its outcomes are in.
    fn poll_done(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        if self.outcomes.is_none() {
            if let Poll::Ready(o) = self.acks.as_mut().poll(cx) {
                self.outcomes = Some(o);
            }
        }
        self.outcomes.is_some()
    }
}

/// The chunks set aside, oldest first.
pub(super) struct Aside<T: Transport> {
    chunks: VecDeque<Chunk<T>>,
    /// Told of the chunks given up when this is dropped (`Transport::recorded(_, false)`:
    /// the Kafka transport's key fence lets a batch's keys go only then).
    transport: Option<std::sync::Arc<T>>,
}

impl<T: Transport> Aside<T> {
    /// Chunks aside for `transport`, which is told of those given up (the session ended, the
    /// lease lost, the shutdown timeout over) when this is dropped.
    pub(super) fn new(transport: std::sync::Arc<T>) -> Self {
        Aside {
            chunks: VecDeque::new(),
            transport: Some(transport),
        }
    }

    /// Chunks aside that are always settled before this is dropped (a relay played by hand).
    #[cfg(feature = "test-util")]
    pub(super) fn settled_by_caller() -> Self {
        Aside {
            chunks: VecDeque::new(),
            transport: None,
        }
    }
}

impl<T: Transport> Drop for Aside<T> {
    fn drop(&mut self) {
        // Given up unrecorded: their transactions roll back (the rows are read again from the
        // slot), and the transport hears that they were not recorded (helper-70: the session
        // ending or the lease lost with a chunk aside left its keys fenced in the Kafka
        // transport).
        if let Some(t) = &self.transport {
            for c in &self.chunks {
                t.recorded(&c.events, false);
            }
        }
    }
}

impl<T: Transport> Aside<T> {
    pub(super) fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.chunks.len()
    }

    pub(super) fn push(&mut self, chunk: Chunk<T>) {
        self.chunks.push_back(chunk);
    }

    /// Every row aside, oldest chunk first.
    pub(super) fn seqs(&self) -> Vec<i64> {
        self.chunks
            .iter()
            .flat_map(|c| c.seqs.iter().copied())
            .collect()
    }

    /// Resolves once a chunk's outcomes are in (cancel-safe: they are kept).
    pub(super) fn ready(&mut self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| {
            let mut any = false;
            for c in &mut self.chunks {
                any |= c.poll_done(cx);
            }
            if any {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }

    /// The chunks whose outcomes are in, taken out.
    pub(super) fn take_done(&mut self) -> Vec<Chunk<T>> {
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        let mut done = Vec::new();
        let mut kept = VecDeque::with_capacity(self.chunks.len());
        for mut c in self.chunks.drain(..) {
            if c.poll_done(&mut cx) {
                done.push(c);
            } else {
                kept.push_back(c);
            }
        }
        self.chunks = kept;
        done
    }

    /// The oldest chunk, once its outcomes are in.
    pub(super) async fn oldest(&mut self) -> Option<Chunk<T>> {
        let first = self.chunks.front_mut()?;
        std::future::poll_fn(|cx| {
            if first.poll_done(cx) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        self.chunks.pop_front()
    }
}
