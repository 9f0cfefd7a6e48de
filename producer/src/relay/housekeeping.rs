//! Housekeeping: the backlog and database-health gauges, history maintenance, retention
//! cleanup and the pruning of the relays' activity table, every 15 s.

use std::time::Duration;

use sqlx::PgPool;

use crate::config::RelayConfig;

/// Every 15 s: the backlog, oldest-pending and oldest-transaction gauges, and retention
/// cleanup (when configured). Polling and WAL relays alike run it.
pub(crate) async fn housekeeping(pool: PgPool, config: RelayConfig) {
    let mut tick = tokio::time::interval(Duration::from_secs(15).min(config.lease));
    let summary = crate::backlog::summary_sql(true);
    // Topics whose oldest-pending gauge was set last round (set to 0 once drained).
    let mut shown_topics = std::collections::HashSet::<String>::new();
    // Topics whose paused gauge was 1 last round (set to 0 once resumed).
    let mut shown_paused = std::collections::HashSet::<String>::new();
    let mut history = HistoryWatch::new();
    loop {
        tick.tick().await;
        // Each check in a transaction of its own whose statements end after
        // `CHECK_TIMEOUT`: a check stuck behind a lock fails (and says so) instead of
        // leaving every gauge at its last value without a sign.
        // Cancel-safe: a stopping relay aborts this task, possibly mid-`BEGIN`, and the
        // pool may be the application's.
        let checks = postal_shared::cancel_safe::begin_with(
            &pool,
            format!(
                "BEGIN; SET LOCAL statement_timeout = '{}ms'",
                CHECK_TIMEOUT.as_millis()
            ),
        );
        let backlog = async {
            let mut tx = checks.await?;
            let rows = sqlx::query_as::<_, (String, i64, i64, i64, Option<f64>)>(&summary)
                .fetch_all(&mut *tx)
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
            // The pauses in force for this relay's group (`None`: every topic).
            let paused: Vec<Option<String>> = sqlx::query_scalar(
                "SELECT topic FROM postal.pauses
                     WHERE side = 'relay' AND (group_name IS NULL OR group_name = $1)",
            )
            .bind(&config.group)
            .fetch_all(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>((rows, oldest_tx, slot_age, paused))
        };
        match backlog.await {
            Ok((rows, oldest_tx, slot_age, paused)) => {
                // Per topic this relay claims: 1 while a pause keeps it from claiming
                // the topic (the alerts on a topic's age leave it out), 0 once resumed.
                let all_paused = paused.iter().any(Option::is_none);
                let mut now_paused = std::collections::HashSet::new();
                for topic in rows.iter().map(|r| &r.0).chain(paused.iter().flatten()) {
                    let is_paused = all_paused || paused.iter().flatten().any(|p| p == topic);
                    if is_paused && config.topics.claims(topic) {
                        now_paused.insert(topic.clone());
                    }
                }
                for topic in &now_paused {
                    metrics::gauge!("postal_relay_topic_paused", "topic" => topic.clone()).set(1.0);
                }
                for resumed in shown_paused.difference(&now_paused) {
                    metrics::gauge!("postal_relay_topic_paused", "topic" => resumed.clone())
                        .set(0.0);
                }
                shown_paused = now_paused;
                let (mut pending, mut scheduled, mut failed) = (0, 0, 0);
                let mut oldest: Option<f64> = None;
                let mut topics = std::collections::HashSet::new();
                for (topic, p, s, f, age) in rows {
                    (pending, scheduled, failed) = (pending + p, scheduled + s, failed + f);
                    oldest = match (oldest, age) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    };
                    // Per topic: one stuck topic shows while the others flow.
                    if let Some(age) = age {
                        metrics::gauge!("postal_relay_topic_oldest_pending_seconds", "topic" => topic.clone())
                                .set(age);
                        topics.insert(topic);
                    }
                }
                for gone in shown_topics.difference(&topics) {
                    metrics::gauge!("postal_relay_topic_oldest_pending_seconds", "topic" => gone.clone())
                            .set(0.0);
                }
                shown_topics = topics;
                metrics::gauge!("postal_relay_backlog").set(pending as f64);
                metrics::gauge!("postal_relay_oldest_pending_seconds").set(oldest.unwrap_or(0.0));
                metrics::gauge!("postal_relay_parked").set(failed as f64);
                metrics::gauge!("postal_relay_scheduled").set(scheduled as f64);
                metrics::gauge!("postal_relay_oldest_transaction_seconds")
                    .set(oldest_tx.unwrap_or(0.0));
                metrics::gauge!("postal_relay_replication_slot_xmin_age")
                    .set(slot_age.unwrap_or(0.0));
            }
            Err(e) => check_failed("backlog", &e),
        }
        if let Some(retention) = config.history {
            match crate::retention::maintain_history(&pool, retention).await {
                Ok(Some(m)) => {
                    history.ran(m.ok());
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
                // Another session holds the maintenance lock: said, counted, and the age
                // of the last successful run here keeps growing.
                Ok(None) => history.skipped(&pool).await,
                Err(e) => {
                    metrics::gauge!("postal_relay_history_maintenance_ok").set(0.0);
                    check_failed("history", &e);
                }
            }
            metrics::gauge!("postal_relay_history_maintenance_age_seconds")
                .set(history.last_ok.elapsed().as_secs_f64());
        }
        if let Err(e) = crate::activity::prune(&pool).await {
            check_failed("activity", &e);
        }
        if let (false, Some(retention)) = (config.delete_on_publish, config.retention) {
            match crate::retention::cleanup_published(&pool, retention, 1000, |_| {}).await {
                Ok(Some(n)) if n > 0 => {
                    tracing::info!(rows = n, "retention cleanup deleted published rows")
                }
                Ok(_) => {}
                Err(e) => check_failed("retention", &e),
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

/// How long history maintenance may go without a successful run here, skipped because another
/// session holds its lock, before the relay warns.
const HISTORY_SKIPS_WARN_AFTER: Duration = Duration::from_secs(300);

/// History maintenance as this relay saw it: when it last succeeded here (or the relay
/// started), and whether the last runs were skipped.
struct HistoryWatch {
    last_ok: std::time::Instant,
    skipping: bool,
    warned: bool,
}

impl HistoryWatch {
    fn new() -> Self {
        HistoryWatch {
            last_ok: std::time::Instant::now(),
            skipping: false,
            warned: false,
        }
    }

    /// A run took the lock (`ok`: every step succeeded).
    fn ran(&mut self, ok: bool) {
        if ok {
            self.last_ok = std::time::Instant::now();
        }
        if self.skipping {
            tracing::info!("history maintenance took its lock again");
        }
        (self.skipping, self.warned) = (false, false);
    }

    /// The lock was held by another session: counted (`postal_relay_history_maintenance_skipped_total`),
    /// logged with the holder once per run of skips, and a warning once maintenance has not
    /// succeeded here for [`HISTORY_SKIPS_WARN_AFTER`].
    async fn skipped(&mut self, pool: &sqlx::PgPool) {
        metrics::counter!("postal_relay_history_maintenance_skipped_total").increment(1);
        let stale = self.last_ok.elapsed() >= HISTORY_SKIPS_WARN_AFTER;
        if self.skipping && (self.warned || !stale) {
            return;
        }
        let holder = match crate::retention::history_lock_holder(pool).await {
            Ok(Some(h)) => h,
            Ok(None) => "a session that has let it go since".into(),
            Err(e) => format!("a session not known ({e})"),
        };
        if stale {
            tracing::warn!(holder = %holder, since_last_run_s = self.last_ok.elapsed().as_secs(),
                "history maintenance skipped again: another session holds its lock; tomorrow's partition may be missing (end that session if it is stuck)");
            self.warned = true;
        } else {
            tracing::info!(holder = %holder, "history maintenance skipped: another session holds its lock");
        }
        self.skipping = true;
    }
}
