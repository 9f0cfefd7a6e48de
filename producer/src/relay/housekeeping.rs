//! Housekeeping: the backlog and database-health gauges, history maintenance, retention
//! cleanup and the pruning of the relays' activity table, every 15 s.

use std::sync::Arc;
use std::time::Duration;

use super::Shared;
use crate::transport::Transport;

impl<T: Transport> Shared<T> {
    /// Every 15 s: the backlog, oldest-pending and oldest-transaction gauges, and retention
    /// cleanup (when configured).
    pub(super) async fn housekeeping(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(15).min(self.config.lease));
        let summary = crate::backlog::summary_sql(false);
        loop {
            tick.tick().await;
            // Each check in a transaction of its own whose statements end after
            // `CHECK_TIMEOUT`: a check stuck behind a lock fails (and says so) instead of
            // leaving every gauge at its last value without a sign.
            // Cancel-safe: a stopping relay aborts this task, possibly mid-`BEGIN`, and the
            // pool may be the application's.
            let checks = postal_shared::cancel_safe::begin_with(
                &self.pool,
                format!(
                    "BEGIN; SET LOCAL statement_timeout = '{}ms'",
                    CHECK_TIMEOUT.as_millis()
                ),
            );
            let backlog = async {
                let mut tx = checks.await?;
                let row = sqlx::query_as::<_, (i64, i64, i64, Option<f64>)>(&summary)
                    .fetch_one(&mut *tx)
                    .await?;
                // The oldest transaction of this database that holds back the visibility
                // horizon (and the keys it wrote), and how far a replication slot holds it.
                let (oldest_tx, slot_age) = sqlx::query_as::<_, (Option<f64>, Option<f64>)>(
                    "SELECT (SELECT extract(epoch FROM now() - min(xact_start))::float8
                             FROM pg_stat_activity
                             WHERE datname = current_database()
                               AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)),
                            (SELECT max(age(xmin))::float8 FROM pg_replication_slots
                             WHERE xmin IS NOT NULL
                               AND (database IS NULL OR database = current_database()))",
                )
                .fetch_one(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok::<_, sqlx::Error>((row, oldest_tx, slot_age))
            };
            match backlog.await {
                Ok(((pending, scheduled, failed, oldest), oldest_tx, slot_age)) => {
                    metrics::gauge!("postal_relay_backlog").set(pending as f64);
                    metrics::gauge!("postal_relay_oldest_pending_seconds")
                        .set(oldest.unwrap_or(0.0));
                    metrics::gauge!("postal_relay_parked").set(failed as f64);
                    metrics::gauge!("postal_relay_scheduled").set(scheduled as f64);
                    metrics::gauge!("postal_relay_oldest_transaction_seconds")
                        .set(oldest_tx.unwrap_or(0.0));
                    metrics::gauge!("postal_relay_replication_slot_xmin_age")
                        .set(slot_age.unwrap_or(0.0));
                }
                Err(e) => check_failed("backlog", &e),
            }
            if let Some(retention) = self.config.history {
                match crate::retention::maintain_history(&self.pool, retention).await {
                    Ok(Some(m)) => {
                        if !m.created.is_empty() || m.moved_rows > 0 {
                            tracing::info!(created = ?m.created, moved_rows = m.moved_rows, "history partitions created");
                        }
                        if !m.dropped.is_empty() || m.default_rows_deleted > 0 {
                            tracing::info!(dropped = ?m.dropped, default_rows_deleted = m.default_rows_deleted, "history retention dropped old partitions");
                        }
                        for step in &m.failed {
                            tracing::warn!(step = %postal_shared::text::bounded(step, postal_shared::text::MAX_ERROR_BYTES), "history maintenance step failed; will retry");
                        }
                        metrics::counter!("postal_relay_check_failures_total", "check" => "history")
                            .increment(m.failed.len() as u64);
                        metrics::gauge!("postal_relay_history_maintenance_ok").set(if m.ok() {
                            1.0
                        } else {
                            0.0
                        });
                    }
                    // Another instance maintains the history now.
                    Ok(None) => {}
                    Err(e) => {
                        metrics::gauge!("postal_relay_history_maintenance_ok").set(0.0);
                        check_failed("history", &e);
                    }
                }
            }
            if let Err(e) = crate::activity::prune(&self.pool).await {
                check_failed("activity", &e);
            }
            if let (false, Some(retention)) = (self.config.delete_on_publish, self.config.retention)
            {
                match crate::retention::cleanup_published(&self.pool, retention, 1000, |_| {}).await
                {
                    Ok(Some(n)) if n > 0 => {
                        tracing::info!(rows = n, "retention cleanup deleted published rows")
                    }
                    Ok(_) => {}
                    Err(e) => check_failed("retention", &e),
                }
            }
        }
    }
}

/// How long a housekeeping check's statement may run (`statement_timeout`).
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// A housekeeping check or job that failed: counted by kind (`postal_relay_check_failures_total`,
/// alert `PostalRelayChecksFailing`) and logged; it runs again at the next round, and the
/// gauges it sets keep their last value meanwhile.
fn check_failed(check: &'static str, e: &sqlx::Error) {
    metrics::counter!("postal_relay_check_failures_total", "check" => check).increment(1);
    tracing::warn!(check, error = %e, "relay housekeeping failed; will retry");
}
