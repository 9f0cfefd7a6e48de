//! One rule for every subcommand that names a consumer group (`--group`) or a consumer
//! (`--consumer`, the dedup scope): a name the database knows nothing of is a typo, refused
//! with one line naming the known ones, before anything changes.

use sqlx::PgPool;

use crate::shown::shown;

/// How many known names a refusal lists.
const LISTED: i64 = 20;

/// Consumer groups this database knows: stored offsets, held keys, consumer pauses, dead
/// letters.
const GROUPS: &str = "SELECT group_id FROM postal.consumer_offsets
    UNION SELECT group_id FROM postal.held_keys
    UNION SELECT group_name FROM postal.pauses WHERE side = 'consumer' AND group_name IS NOT NULL
    UNION SELECT group_id FROM postal.dead_letters";

/// Consumers (dedup scopes) this database knows: dedup rows (read by a skip scan of their
/// primary key, not the whole table), a dedup horizon, declared settings, dead letters.
const CONSUMERS: &str = "WITH RECURSIVE deduplicated(name) AS (
        (SELECT consumer_name FROM postal.processed_events ORDER BY consumer_name LIMIT 1)
        UNION ALL
        SELECT (SELECT consumer_name FROM postal.processed_events
                WHERE consumer_name > d.name ORDER BY consumer_name LIMIT 1)
        FROM deduplicated d WHERE d.name IS NOT NULL
    )
    SELECT name FROM deduplicated WHERE name IS NOT NULL
    UNION SELECT consumer_name FROM postal.dedup_horizon
    UNION SELECT consumer_name FROM postal.consumer_settings
    UNION SELECT consumer_name FROM postal.dead_letters";

async fn names(pool: &PgPool, sql: &str) -> anyhow::Result<Vec<String>> {
    Ok(sqlx::query_scalar(&format!(
        "SELECT n FROM ({sql}) AS known(n) ORDER BY n LIMIT {}",
        LISTED + 1
    ))
    .fetch_all(pool)
    .await?)
}

async fn contains(pool: &PgPool, sql: &str, name: &str) -> anyhow::Result<bool> {
    Ok(sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM ({sql}) AS known(n) WHERE n = $1)"
    ))
    .bind(name)
    .fetch_one(pool)
    .await?)
}

/// `a, b, c` (and "…" past [`LISTED`]), or "none".
fn listing(known: &[String]) -> String {
    if known.is_empty() {
        return "none".into();
    }
    let mut list: Vec<String> = known
        .iter()
        .take(LISTED as usize)
        .map(|n| shown(n, false).into_owned())
        .collect();
    if known.len() > LISTED as usize {
        list.push("…".into());
    }
    list.join(", ")
}

/// Refuses a consumer group this database knows nothing of. `new_group` is the command's
/// `--new-group` flag (`None` for a command without one, as for a group's held keys): a group
/// that has not run yet, e.g. paused before its first start.
pub async fn group(pool: &PgPool, group: &str, new_group: Option<bool>) -> anyhow::Result<()> {
    if new_group == Some(true) || contains(pool, GROUPS, group).await? {
        return Ok(());
    }
    let known = names(pool, GROUPS).await?;
    anyhow::bail!(
        "consumer group {} has no stored offsets, held keys, pauses or dead letters in this database (a typo?); known groups: {}; nothing changed{}",
        shown(group, false),
        listing(&known),
        if new_group.is_some() {
            ": pass --new-group for a group that has not run yet"
        } else {
            ""
        }
    )
}

/// Refuses a consumer name (dedup scope) this database knows nothing of.
pub async fn consumer(pool: &PgPool, name: &str) -> anyhow::Result<()> {
    if contains(pool, CONSUMERS, name).await? {
        return Ok(());
    }
    let known = names(pool, CONSUMERS).await?;
    anyhow::bail!(
        "unknown consumer {} (a typo? --consumer is the handlers' dedup scope, #[idempotent(consumer = \"...\")]); consumers known to this database: {}",
        shown(name, false),
        listing(&known)
    )
}
