//! The Kafka consumer client that the runtime's tasks share.
//!
//! Dropping librdkafka's consumer closes it: it leaves the group, and the revocation that
//! triggers waits inside librdkafka without a limit of its own. The last handle to go,
//! wherever it goes (the end of [`crate::Consumer::run`], a dropped `run` future, a task that
//! held a handle), therefore closes it on a detached thread ([`postal_shared::DetachedDrop`]).

use rdkafka::consumer::StreamConsumer;

use crate::context::Context;

/// A shared handle to the consumer client.
pub(crate) type Client = postal_shared::DetachedDrop<StreamConsumer<Context>>;

/// The name of the thread that closes the client.
pub(crate) const CLOSE_THREAD: &str = "postal-consumer-close";
