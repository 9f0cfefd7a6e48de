//! One log line per burst of the same trouble.
//!
//! A Kafka client reports an unreachable broker from each of its threads every time a
//! connection attempt fails: hundreds of lines a minute that say the same thing, some of them
//! misleading ("0/1 brokers are down" once it is back). [`LogThrottle`] lets the first report
//! of a kind through, then at most one per interval carrying the count of the ones it held back.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Rate limit for repeated log lines, per kind.
#[derive(Debug)]
pub struct LogThrottle {
    every: Duration,
    kinds: Mutex<HashMap<String, (Instant, u64)>>,
}

impl LogThrottle {
    /// At most one line per kind every `every`.
    pub fn new(every: Duration) -> Self {
        LogThrottle {
            every,
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a line of `kind` should be logged now: `Some(n)` with the number of lines of
    /// that kind held back since the last one, or `None` to stay quiet.
    pub fn admit(&self, kind: &str) -> Option<u64> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match kinds.get_mut(kind) {
            Some((last, held)) if now.duration_since(*last) < self.every => {
                *held += 1;
                None
            }
            Some((last, held)) => {
                *last = now;
                Some(std::mem::take(held))
            }
            None => {
                kinds.insert(kind.to_owned(), (now, 0));
                Some(0)
            }
        }
    }
}

impl LogThrottle {
    /// Logs a Kafka client's global error: one that says the broker cannot be reached
    /// (`unreachable`: all brokers down, a failed connection, a name that does not resolve)
    /// as one warning per interval, saying that the client retries; any other as an error.
    pub fn kafka_client_error(
        &self,
        unreachable: bool,
        error: &dyn std::fmt::Display,
        reason: &str,
    ) {
        if !unreachable {
            tracing::error!("Kafka client error: {error}: {reason}");
        } else if let Some(held_back) = self.admit("unreachable") {
            tracing::warn!(
                held_back,
                "Kafka broker unreachable, retrying: {reason} (at most one such line every {:?})",
                self.every
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_line_of_a_kind_passes_then_one_per_interval_with_the_count_held_back() {
        let t = LogThrottle::new(Duration::from_millis(50));
        assert_eq!(t.admit("down"), Some(0));
        assert_eq!(t.admit("down"), None);
        assert_eq!(t.admit("down"), None);
        assert_eq!(t.admit("other"), Some(0), "kinds are counted apart");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(t.admit("down"), Some(2));
        assert_eq!(t.admit("down"), None);
    }
}
