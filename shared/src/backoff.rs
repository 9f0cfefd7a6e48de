//! Exponential backoff with full jitter.

use std::time::Duration;

use rand::Rng;

/// Exponential backoff: attempt `n` (0-based) waits a uniformly random time in
/// `[0, min(max, base · 2ⁿ)]` ("full jitter"), so retrying relays do not synchronise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Ceiling of the first wait.
    pub base: Duration,
    /// Largest wait.
    pub max: Duration,
}

impl Backoff {
    /// The ceiling for attempt `n` (before jitter).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(30)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// A jittered wait for attempt `n`.
    pub fn delay(&self, attempt: u32) -> Duration {
        let ceiling = self.ceiling(attempt);
        let ms = ceiling.as_millis() as u64;
        if ms == 0 {
            return Duration::ZERO;
        }
        Duration::from_millis(rand::rng().random_range(0..=ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_and_caps() {
        let b = Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(2),
        };
        assert_eq!(b.ceiling(0), Duration::from_millis(100));
        assert_eq!(b.ceiling(3), Duration::from_millis(800));
        assert_eq!(b.ceiling(10), Duration::from_secs(2));
        assert_eq!(b.ceiling(1000), Duration::from_secs(2));
        for n in 0..20 {
            assert!(b.delay(n) <= b.ceiling(n));
        }
    }
}
