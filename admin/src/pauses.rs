//! Pausing and resuming: a topic (or a whole relay group) at the relay, a consumer group (or
//! one of its topics) at the consumer. A pause is a row of `postal.pauses`, so it outlasts
//! restarts and rebalances; pausing and resuming are audited (`pause`, `resume`) in the
//! transaction that writes the row.
//!
//! What "takes effect" means, exactly (docs/operations.md, "Pausing"):
//!
//! - **Relay.** A claim reads the pauses in a statement it already runs, after it took the
//!   shared lock of each key partition it claims from (`postal_producer`'s fence). A claim
//!   whose transaction began after the pause committed takes nothing of what it pauses. The
//!   pause, once committed, waits ([`wait_for_relay_claims`]) for the exclusive lock of every
//!   key partition of the group(s) in turn, i.e. until every claim that held one when it
//!   asked has ended (its batch acknowledged and recorded, or given back): when it returns,
//!   nothing claimed before the pause is still on its way.
//! - **Consumer.** [`pause`] takes the exclusive advisory lock of the group or (group, topic)
//!   that every processing transaction holds shared from its `BEGIN` on
//!   ([`postal_shared::pause`]), so it commits only once the transactions in flight have ended,
//!   and every later transaction sees the pause where it advances the stored offset and rolls
//!   back whole: nothing is applied, the offset stays, the records are applied on resume.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use crate::audit::{self, Operator};
use crate::Error;

/// Who honours a pause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Side {
    /// The relays: nothing of it is claimed (published).
    Relay,
    /// The consumers: nothing of it is applied.
    Consumer,
}

impl Side {
    /// As stored: `relay` or `consumer`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Relay => "relay",
            Side::Consumer => "consumer",
        }
    }
}

/// What a pause covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    side: Side,
    group: Option<String>,
    topic: Option<String>,
}

impl Scope {
    /// At the relay: `topic` (`None`: every topic) of relay group `group` (`None`: of every
    /// relay group).
    pub fn relay(group: Option<&str>, topic: Option<&str>) -> Result<Self, Error> {
        Self::new(Side::Relay, group, topic)
    }

    /// At the consumer: consumer group `group`, its `topic` only or (`None`) every topic.
    pub fn consumer(group: &str, topic: Option<&str>) -> Result<Self, Error> {
        Self::new(Side::Consumer, Some(group), topic)
    }

    fn new(side: Side, group: Option<&str>, topic: Option<&str>) -> Result<Self, Error> {
        for (what, name) in [("group", group), ("topic", topic)] {
            if name.is_some_and(|n| n.trim().is_empty()) {
                return Err(Error::Invalid(format!("an empty {what} name")));
            }
        }
        Ok(Scope {
            side,
            group: group.map(str::to_owned),
            topic: topic.map(str::to_owned),
        })
    }

    /// Who honours it.
    pub fn side(&self) -> Side {
        self.side
    }

    /// The group (`None`: every relay group).
    pub fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }

    /// The topic (`None`: every topic of the group).
    pub fn topic(&self) -> Option<&str> {
        self.topic.as_deref()
    }

    /// In words, e.g. `relay topic orders of every relay group`.
    pub fn describe(&self) -> String {
        let topic = match &self.topic {
            Some(t) => format!("topic {}", postal_shared::text::quoted(t)),
            None => "every topic".into(),
        };
        match (self.side, &self.group) {
            (Side::Relay, None) => format!("relay: {topic} of every relay group"),
            (Side::Relay, Some(g)) => {
                format!(
                    "relay: {topic} of relay group {}",
                    postal_shared::text::quoted(g)
                )
            }
            (Side::Consumer, g) => format!(
                "consumer group {}: {topic}",
                postal_shared::text::quoted(g.as_deref().unwrap_or_default())
            ),
        }
    }

    fn target(&self, reason: Option<&str>) -> serde_json::Value {
        serde_json::json!({
            "side": self.side.as_str(),
            "group": self.group,
            "topic": self.topic,
            "reason": reason,
        })
    }
}

/// A pause in force.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Pause {
    /// `relay` or `consumer`.
    pub side: String,
    /// The relay or consumer group (`None`: every relay group).
    pub group_name: Option<String>,
    /// The topic (`None`: every topic of the group).
    pub topic: Option<String>,
    /// Since when.
    pub paused_at: DateTime<Utc>,
    /// Who paused it (as in the audit trail).
    pub paused_by: String,
    /// Why, as given.
    pub reason: Option<String>,
}

/// Pauses `scope` in the caller's transaction, with its audit row (action `pause`, affected 0
/// when it was paused already; the reason is in the row's target). Returns whether the pause
/// is new. Commit to put it in force.
///
/// At the consumer this waits, for at most `wait`, for the transactions of the group (or
/// topic) in flight to end (see the module): when the caller's commit returns, nothing more
/// is applied. At the relay, call [`wait_for_relay_claims`] after the commit.
pub async fn pause(
    tx: &mut PgConnection,
    by: &Operator,
    scope: &Scope,
    reason: Option<&str>,
    wait: Duration,
) -> Result<bool, Error> {
    let new = sqlx::query_scalar::<_, bool>(
        "INSERT INTO postal.pauses (side, group_name, topic, paused_by, reason)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (side, coalesce(group_name, ''), coalesce(topic, '')) DO NOTHING
         RETURNING true",
    )
    .bind(scope.side.as_str())
    .bind(&scope.group)
    .bind(&scope.topic)
    .bind(by.name())
    .bind(reason)
    .fetch_optional(&mut *tx)
    .await?
    .is_some();
    audit::record(tx, by, "pause", &scope.target(reason), 1, u64::from(new)).await?;
    if scope.side == Side::Consumer {
        let group = scope.group.as_deref().unwrap_or_default();
        let (class, key) = postal_shared::pause::consumer_lock(group, scope.topic.as_deref());
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{}ms", wait.as_millis().max(1)))
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
            .bind(class)
            .bind(key)
            .execute(&mut *tx)
            .await
            .map_err(|e| timed_out(e, wait, "consumer transactions", scope))?;
    }
    Ok(new)
}

/// Resumes `scope` in the caller's transaction, with its audit row (action `resume`, affected
/// 0 when it was not paused). Returns whether a pause was lifted. A relay pause wakes the
/// relays at the commit (`NOTIFY postal_outbox`); consumers notice within a second.
///
/// Only the pause of exactly this scope is lifted: a topic stays paused while its whole
/// group is ([`covering`] says which pauses still apply).
pub async fn resume(tx: &mut PgConnection, by: &Operator, scope: &Scope) -> Result<bool, Error> {
    let lifted = sqlx::query(
        "DELETE FROM postal.pauses
         WHERE side = $1 AND group_name IS NOT DISTINCT FROM $2 AND topic IS NOT DISTINCT FROM $3",
    )
    .bind(scope.side.as_str())
    .bind(&scope.group)
    .bind(&scope.topic)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        > 0;
    audit::record(tx, by, "resume", &scope.target(None), 1, u64::from(lifted)).await?;
    if lifted && scope.side == Side::Relay {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(postal_producer::NOTIFY_CHANNEL)
            .execute(&mut *tx)
            .await?;
    }
    Ok(lifted)
}

/// After a relay pause committed: waits, for at most `wait` per key partition, until every
/// claim of the paused group(s) that holds a key partition's lock has ended. Returns how many
/// relay groups it waited on (those with leased key partitions).
pub async fn wait_for_relay_claims(
    pool: &PgPool,
    scope: &Scope,
    wait: Duration,
) -> Result<usize, Error> {
    let groups: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT relay_group FROM postal.relay_partitions
         WHERE $1::text IS NULL OR relay_group = $1 ORDER BY relay_group",
    )
    .bind(&scope.group)
    .fetch_all(pool)
    .await?;
    // One group at a time, each in its own transaction: the locks held here stop the group's
    // claims (and a WAL relay's next chunk) until the transaction ends, so a group must not
    // stay stopped while the pause waits for another group's claims.
    for group in &groups {
        let mut tx = postal_shared::cancel_safe::begin(pool).await?;
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{}ms", wait.as_millis().max(1)))
            .execute(&mut *tx)
            .await?;
        // One exclusive lock after the other, in partition order (as a takeover takes them):
        // a claim holds its partitions' locks shared for its transaction's whole life, and
        // asks for them with `try`, so a claim that starts meanwhile skips a partition held
        // here (and sees the pause on the next). Then 256, which a WAL relay's stream holds
        // shared while a chunk it took is in flight (`postal_producer`'s `wal/rows.rs`, which
        // checks that the key partitions are 0–255): its next chunk waits for this
        // transaction's end, then sees the pause.
        sqlx::query(
            "SELECT count(pg_advisory_xact_lock(hashtext('postal.relay:' || $1), p)::text)
             FROM generate_series(0, 256) p",
        )
        .bind(group)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| timed_out(e, wait, "relay claims", scope))?;
        tx.rollback().await?;
    }
    Ok(groups.len())
}

/// The pauses in force, oldest first.
pub async fn list(pool: &PgPool) -> Result<Vec<Pause>, Error> {
    Ok(sqlx::query_as(
        "SELECT side, group_name, topic, paused_at, paused_by, reason
         FROM postal.pauses ORDER BY paused_at, side, group_name, topic",
    )
    .fetch_all(pool)
    .await?)
}

/// The pauses in force that cover `scope` (itself, its group's, every relay group's).
pub async fn covering(pool: &PgPool, scope: &Scope) -> Result<Vec<Pause>, Error> {
    Ok(sqlx::query_as(
        "SELECT side, group_name, topic, paused_at, paused_by, reason
         FROM postal.pauses
         WHERE side = $1
           AND (group_name IS NULL OR group_name = $2)
           AND (topic IS NULL OR topic = $3)
         ORDER BY paused_at",
    )
    .bind(scope.side.as_str())
    .bind(&scope.group)
    .bind(&scope.topic)
    .fetch_all(pool)
    .await?)
}

fn timed_out(e: sqlx::Error, wait: Duration, what: &str, scope: &Scope) -> Error {
    let lock_timeout = e
        .as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03");
    if lock_timeout {
        Error::StillRunning(format!(
            "{what} of {} still running after {} s (pg_stat_activity shows them)",
            scope.describe(),
            wait.as_secs_f64()
        ))
    } else {
        Error::Database(e)
    }
}
