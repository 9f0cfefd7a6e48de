//! Fixtures the batch handler attack modules share (`batch_attack`, `batch_split_attack`,
//! `batch_fit_attack`): a job record, the `effects` table's order, the dead letters' count.

use sqlx::PgPool;
use uuid::Uuid;

use crate::common::RawRecord;

/// A `job` event of `key` with `payload`.
pub fn job(id: Uuid, key: &str, payload: serde_json::Value) -> RawRecord {
    RawRecord::event(id, key, "job", payload)
}

/// The `n` of each effect row, in the order the rows were written.
pub async fn order(pool: &PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT n FROM effects ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// How many dead letters the database holds.
pub async fn dead_letter_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.dead_letters")
        .fetch_one(pool)
        .await
        .unwrap()
}
