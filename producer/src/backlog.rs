//! What the outbox holds, in one definition for the relay's gauges and `postal status`.
//!
//! An event scheduled for later (`deliver_at`) is held with no error until its time (a failed
//! attempt always sets `last_error`): before then it is neither backlog nor late. Once due,
//! its age counts from its delivery time; after a failed attempt, from its creation.

/// SQL for a summary of the pending and parked events: the columns `pending` (due),
/// `scheduled` (not due yet), `failed` (parked) and `oldest_pending_age_s` (seconds since the
/// oldest due event became due), per `topic` (first column, ordered) when `by_topic`, else one
/// row for the whole outbox. Pending and parked rows are read apart, each through its partial
/// index, so that published rows kept in the outbox are never scanned.
pub fn summary_sql(by_topic: bool) -> String {
    let (select, group) = if by_topic {
        ("topic, ", " GROUP BY topic ORDER BY topic")
    } else {
        ("", "")
    };
    format!(
        "SELECT {select}
                count(*) FILTER (WHERE status = 'pending' AND NOT scheduled) AS pending,
                count(*) FILTER (WHERE status = 'pending' AND scheduled) AS scheduled,
                count(*) FILTER (WHERE status = 'failed') AS failed,
                extract(epoch FROM now() - min(due_since)
                                           FILTER (WHERE status = 'pending' AND NOT scheduled))::float8
                    AS oldest_pending_age_s
         FROM (SELECT topic, status,
                      held AND last_error IS NULL AND available_at > now() AS scheduled,
                      CASE WHEN held AND last_error IS NULL THEN greatest(created_at, available_at)
                           ELSE created_at END AS due_since
               FROM postal.outbox WHERE status = 'pending'
               UNION ALL
               SELECT topic, status, false, created_at
               FROM postal.outbox WHERE status = 'failed') AS o{group}"
    )
}
