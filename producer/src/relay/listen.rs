//! `LISTEN`/`NOTIFY` wake-ups: the claim loops hear of newly committed events at once instead
//! of at their next poll.

use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;

use crate::enqueue::NOTIFY_CHANNEL;

/// Forwards `postal_outbox` notifications to `wake`, reconnecting with backoff when the
/// listening connection drops. Notifications are only a hint: the relay also polls.
pub(super) async fn listen(pool: PgPool, wake: tokio::sync::watch::Sender<u64>, poll: Duration) {
    let mut failures = 0u32;
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                let wait = (poll * failures.min(30)).min(Duration::from_secs(30));
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "cannot LISTEN for outbox notifications; polling meanwhile");
                tokio::time::sleep(wait).await;
                continue;
            }
        };
        if let Err(e) = listener.listen(NOTIFY_CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN failed; polling meanwhile");
            tokio::time::sleep(poll).await;
            continue;
        }
        failures = 0;
        // After (re)connecting, notifications may have been missed: wake once to re-check.
        wake.send_modify(|n| *n = n.wrapping_add(1));
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => wake.send_modify(|n| *n = n.wrapping_add(1)),
                Ok(None) => {
                    tracing::warn!("notification connection lost; reconnecting");
                    wake.send_modify(|n| *n = n.wrapping_add(1));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "notification connection failed; reconnecting");
                    break;
                }
            }
        }
    }
}
