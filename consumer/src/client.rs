//! The Kafka consumer client that the runtime's tasks share, and where it is closed.
//!
//! Dropping librdkafka's consumer closes it: it leaves the group, and the revocation that
//! triggers runs `assign` inside librdkafka, which waits without a time limit. With tansu such
//! a revocation once never got its answer. On an async worker that would stall the runtime; on
//! the runtime's blocking pool it would keep the runtime from ever shutting down, because
//! dropping a tokio runtime waits for its blocking tasks (a CI run hung exactly so). So the last
//! handle to go, wherever it goes (the end of [`crate::Consumer::run`], a dropped `run` future,
//! a task that held a handle), hands the client to a detached thread to close.

use std::sync::Arc;

use rdkafka::consumer::StreamConsumer;

use crate::context::Context;

/// A shared handle to the consumer client (see the module docs).
pub(crate) struct Client(Option<Arc<StreamConsumer<Context>>>);

impl Client {
    pub fn new(consumer: StreamConsumer<Context>) -> Client {
        Client(Some(Arc::new(consumer)))
    }

    /// The client itself when this is the last handle (the caller closes it), else `None`
    /// (this handle is simply gone).
    pub fn into_last(mut self) -> Option<StreamConsumer<Context>> {
        self.0.take().and_then(Arc::into_inner)
    }
}

impl Clone for Client {
    fn clone(&self) -> Client {
        Client(self.0.clone())
    }
}

impl std::ops::Deref for Client {
    type Target = StreamConsumer<Context>;

    fn deref(&self) -> &StreamConsumer<Context> {
        self.0
            .as_deref()
            .expect("a client handle holds its client until dropped")
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // `Arc::into_inner` yields the client to exactly one of the handles, the last.
        let Some(last) = self.0.take().and_then(Arc::into_inner) else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("postal-consumer-close".into())
            .spawn(move || drop(last));
        if let Err(e) = spawned {
            // The closure, and the client with it, was dropped right here.
            tracing::warn!(error = %e, "could not start a thread to close the Kafka consumer; closed it in place");
        }
    }
}
