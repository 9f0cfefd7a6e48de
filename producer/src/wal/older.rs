//! Relays of an earlier release beside a WAL relay.
//!
//! A claim of this release leaves a key's later rows behind a row another session holds locked
//! (`crate::skipped`); the claim of 0.1.x does not. The stream holds a chunk's rows locked until
//! the broker acknowledged them, so a 0.1.x polling relay claiming beside it could publish a
//! key's later row first (helper-69: 1 run in 11 of `previous_release::…_wal`). Relays write
//! their release into `postal.relay_instances` (migration 0043); a 0.1.x relay leaves it NULL.
//! While one is live the WAL relay does not stream: it waits, with one line naming the hosts,
//! and streams again once it stopped (its heartbeat is older than the lease).

use std::time::Duration;

use sqlx::PgPool;

/// The live relays of an earlier release (heartbeat within `within`), as `host (relay id)`.
pub(super) async fn live(pool: &PgPool, within: Duration) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT coalesce(nullif(host, ''), '?') || ' (' || relay_id::text || ')'
         FROM postal.relay_instances
         WHERE release IS NULL AND heartbeat_at > now() - $1 * interval '1 millisecond'
         ORDER BY relay_id",
    )
    .bind(within.as_millis() as i64)
    .fetch_all(pool)
    .await
}

/// The line a WAL relay logs while it waits for them.
pub(super) fn waiting_line(relays: &[String]) -> String {
    format!(
        "WAL relay: a relay of an earlier release runs on this outbox ({}): its claim can pass a row the stream holds locked and publish a key's later event first, so the stream waits until it stops (upgrade it: docs/wal-relay.md, Handing over between polling and WAL)",
        relays.join(", ")
    )
}
