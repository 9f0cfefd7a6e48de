//! Shared values whose last handle is dropped on a thread of its own.
//!
//! Dropping a librdkafka client blocks until its threads end, and dropping a consumer first
//! leaves its group, which waits inside librdkafka without a limit of its own (with a
//! Kafka-protocol broker a revocation once never got its answer). On an async worker that stalls the runtime; on the
//! runtime's blocking pool it keeps the runtime from ever shutting down, because dropping a
//! tokio runtime waits for its blocking tasks (a CI run hung exactly so). A detached thread
//! holds nothing. So the relay's producer and the consumer's client are shared through
//! [`DetachedDrop`]: whichever handle goes last, wherever it goes (a task that ends, a future
//! that is dropped), hands the value to a thread to drop.

use std::sync::Arc;

/// A shared handle to a `T` whose last drop runs on a detached thread (see the module docs).
pub struct DetachedDrop<T: Send + Sync + 'static> {
    value: Option<Arc<T>>,
    thread: &'static str,
}

impl<T: Send + Sync + 'static> DetachedDrop<T> {
    /// Shares `value`; its last drop runs on a thread named `thread`.
    pub fn new(value: T, thread: &'static str) -> Self {
        DetachedDrop {
            value: Some(Arc::new(value)),
            thread,
        }
    }

    /// The value itself when this is the last handle (the caller drops it, where it chooses),
    /// else `None` (this handle is simply gone).
    pub fn into_last(mut self) -> Option<T> {
        self.value.take().and_then(Arc::into_inner)
    }
}

impl<T: Send + Sync + 'static> Clone for DetachedDrop<T> {
    fn clone(&self) -> Self {
        DetachedDrop {
            value: self.value.clone(),
            thread: self.thread,
        }
    }
}

impl<T: Send + Sync + 'static> std::ops::Deref for DetachedDrop<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.value
            .as_deref()
            .expect("a handle holds its value until it is dropped")
    }
}

impl<T: Send + Sync + 'static> Drop for DetachedDrop<T> {
    fn drop(&mut self) {
        // `Arc::into_inner` yields the value to exactly one handle, the last.
        let Some(last) = self.value.take().and_then(Arc::into_inner) else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name(self.thread.into())
            .spawn(move || drop(last));
        if let Err(e) = spawned {
            // The closure, and the value with it, was dropped right here.
            tracing::warn!(error = %e, thread = self.thread, "could not start a thread to drop a client; dropped it in place");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the name of the thread it is dropped on.
    struct Recorder(std::sync::mpsc::Sender<Option<String>>);

    impl Drop for Recorder {
        fn drop(&mut self) {
            let _ = self
                .0
                .send(std::thread::current().name().map(str::to_owned));
        }
    }

    #[test]
    fn only_the_last_handle_drops_the_value_and_on_a_thread_of_its_own() {
        let (tx, rx) = std::sync::mpsc::channel();
        let a = DetachedDrop::new(Recorder(tx), "test-detached-drop");
        let b = a.clone();
        drop(a);
        assert!(rx.try_recv().is_err(), "not dropped while a handle remains");
        drop(b);
        let thread = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("dropped once the last handle went");
        assert_eq!(thread.as_deref(), Some("test-detached-drop"));
    }

    #[test]
    fn into_last_hands_the_value_over_only_from_the_last_handle() {
        let (tx, rx) = std::sync::mpsc::channel();
        let a = DetachedDrop::new(Recorder(tx), "test-detached-drop");
        let b = a.clone();
        assert!(a.into_last().is_none(), "another handle remains");
        let value = b.into_last().expect("the last handle");
        assert!(rx.try_recv().is_err(), "handing over does not drop it");
        drop(value);
        assert_eq!(
            rx.recv().unwrap().as_deref(),
            std::thread::current().name(),
            "dropped where the caller chose"
        );
    }
}
