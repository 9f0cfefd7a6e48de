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

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A shared handle to a `T` whose last drop runs on a detached thread (see the module docs).
pub struct DetachedDrop<T: Send + Sync + 'static> {
    value: Option<Arc<T>>,
    /// Every handle that goes while others remain says so here ([`DetachedDrop::into_last_within`]).
    gone: Arc<(Mutex<()>, Condvar)>,
    thread: &'static str,
}

impl<T: Send + Sync + 'static> DetachedDrop<T> {
    /// Shares `value`; its last drop runs on a thread named `thread`.
    pub fn new(value: T, thread: &'static str) -> Self {
        DetachedDrop {
            value: Some(Arc::new(value)),
            gone: Arc::new((Mutex::new(()), Condvar::new())),
            thread,
        }
    }

    /// The value itself when this is the last handle (the caller drops it, where it chooses),
    /// else `None` (this handle is simply gone).
    pub fn into_last(mut self) -> Option<T> {
        let guard = lock(&self.gone.0);
        let last = self.value.take().and_then(Arc::into_inner);
        drop(guard);
        self.gone.1.notify_all();
        last
    }

    /// The value itself once every other handle is gone, waiting up to `within` for them (a
    /// task still finishing a call with its handle); after that, this handle back (`Err`).
    /// The caller then drops the value where it chooses: a consumer leaves its group there,
    /// before the process exits, instead of on a detached thread racing the exit.
    pub fn into_last_within(mut self, within: Duration) -> Result<T, Self> {
        let deadline = Instant::now() + within;
        let gone = self.gone.clone();
        let (mutex, others_gone) = &*gone;
        let mut guard = lock(mutex);
        loop {
            let value = self.value.as_ref().expect("a handle holds its value");
            // Other handles go under the lock, so none goes unseen between this check and
            // the wait.
            if Arc::strong_count(value) == 1 {
                let last = self.value.take().and_then(Arc::into_inner);
                drop(guard);
                return Ok(last.expect("the only handle"));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(guard);
                return Err(self);
            }
            guard = others_gone
                .wait_timeout(guard, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn lock(m: &Mutex<()>) -> std::sync::MutexGuard<'_, ()> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T: Send + Sync + 'static> Clone for DetachedDrop<T> {
    fn clone(&self) -> Self {
        DetachedDrop {
            value: self.value.clone(),
            gone: self.gone.clone(),
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
        // `Arc::into_inner` yields the value to exactly one handle, the last. A handle that
        // is not the last goes under the lock and says so (`into_last_within` waits for that).
        let guard = lock(&self.gone.0);
        let last = self.value.take().and_then(Arc::into_inner);
        drop(guard);
        self.gone.1.notify_all();
        let Some(last) = last else {
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

    #[test]
    fn into_last_within_waits_for_the_other_handles_to_go() {
        let (tx, rx) = std::sync::mpsc::channel();
        let a = DetachedDrop::new(Recorder(tx), "test-detached-drop");
        let b = a.clone();
        let (went_tx, went_rx) = std::sync::mpsc::channel();
        let other = std::thread::spawn(move || {
            // Goes once the waiter is waiting (or about to: either way it sees it go).
            went_rx.recv().unwrap();
            drop(b);
        });
        went_tx.send(()).unwrap();
        let value = a
            .into_last_within(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("the other handle went"));
        other.join().unwrap();
        assert!(rx.try_recv().is_err(), "handed over, not dropped");
        drop(value);
        assert_eq!(
            rx.recv().unwrap().as_deref(),
            std::thread::current().name(),
            "dropped where the caller chose"
        );
    }

    #[test]
    fn into_last_within_gives_the_handle_back_while_another_remains() {
        let (tx, rx) = std::sync::mpsc::channel();
        let a = DetachedDrop::new(Recorder(tx), "test-detached-drop");
        let b = a.clone();
        let a = a
            .into_last_within(Duration::from_millis(50))
            .err()
            .expect("b still holds it");
        drop(a);
        assert!(rx.try_recv().is_err(), "b still holds it");
        drop(b);
        let thread = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("dropped once the last handle went");
        assert_eq!(thread.as_deref(), Some("test-detached-drop"));
    }
}
