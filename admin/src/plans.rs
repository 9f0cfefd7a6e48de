//! The query plans of the dashboard's pages, for the test that checks they read Postal's large
//! tables through indexes, and for the page benchmark. Not a stable API.

use sqlx::PgPool;

use crate::{dead_letters, parked, Error};

/// Tables that grow with traffic: a page must not read them from end to end.
pub const LARGE_TABLES: &[&str] = &[
    "outbox",
    "outbox_history",
    "dead_letters",
    "processed_events",
    "operator_audit",
    "relay_minutes",
];

async fn plan<'q>(
    pool: &PgPool,
    q: sqlx::query::QueryAs<'q, sqlx::Postgres, (String,), sqlx::postgres::PgArguments>,
) -> Result<String, Error> {
    let rows: Vec<(String,)> = q.fetch_all(pool).await?;
    Ok(rows
        .into_iter()
        .map(|(l,)| l)
        .collect::<Vec<_>>()
        .join("\n"))
}

/// `(what, plan)` of every query the pages run with user input, filled with the given sample
/// values (an event id, a key, a topic, a consumer).
pub async fn explain(
    pool: &PgPool,
    event_id: uuid::Uuid,
    key: &str,
    topic: &str,
    consumer: &str,
) -> Result<Vec<(String, String)>, Error> {
    let mut out = Vec::new();
    let filters = [
        ("parked, no filter", parked::Filter::default()),
        (
            "parked by event id",
            parked::Filter {
                event_id: Some(event_id),
                ..Default::default()
            },
        ),
        (
            "parked by key",
            parked::Filter {
                key: Some(key.into()),
                ..Default::default()
            },
        ),
        (
            "parked by topic and reason",
            parked::Filter {
                topic: Some(topic.into()),
                reason: Some("timeout".into()),
                ..Default::default()
            },
        ),
        (
            "parked in a time range",
            parked::Filter {
                since: Some(chrono::Utc::now() - chrono::Duration::hours(1)),
                until: Some(chrono::Utc::now()),
                ..Default::default()
            },
        ),
    ];
    for (name, f) in &filters {
        let sql = format!(
            "EXPLAIN SELECT seq FROM postal.outbox WHERE {} ORDER BY seq LIMIT $8",
            parked::WHERE
        );
        out.push((
            format!("{name}: list"),
            plan(pool, parked::bind(sqlx::query_as(&sql), f).bind(200_i64)).await?,
        ));
        let sql = format!(
            "EXPLAIN SELECT {} AS f, count(*) FROM postal.outbox WHERE {} GROUP BY 1 LIMIT $8",
            parked::FINGERPRINT_SQL,
            parked::WHERE
        );
        out.push((
            format!("{name}: groups"),
            plan(pool, parked::bind(sqlx::query_as(&sql), f).bind(20_i64)).await?,
        ));
    }
    let dfilters = [
        ("dead letters, open", dead_letters::Filter::default()),
        (
            "dead letters of a consumer",
            dead_letters::Filter {
                consumer: Some(consumer.into()),
                ..Default::default()
            },
        ),
        (
            "dead letters by event id, all",
            dead_letters::Filter {
                event_id: Some(event_id),
                all: true,
                ..Default::default()
            },
        ),
    ];
    for (name, f) in &dfilters {
        let sql = format!(
            "EXPLAIN SELECT id FROM postal.dead_letters WHERE {} ORDER BY id DESC LIMIT $7",
            dead_letters::WHERE
        );
        out.push((
            format!("{name}: list"),
            plan(
                pool,
                dead_letters::bind(sqlx::query_as(&sql), f).bind(200_i64),
            )
            .await?,
        ));
    }
    let backlog = postal_producer::backlog::summary_sql(true);
    out.push((
        "overview: backlog per topic".into(),
        plan(pool, sqlx::query_as(&format!("EXPLAIN {backlog}"))).await?,
    ));
    let sql = format!("EXPLAIN {}", crate::parked::BLOCKED_SQL);
    out.push((
        "blocked keys".into(),
        plan(pool, sqlx::query_as(&sql).bind(200_i64)).await?,
    ));
    for (name, sql) in crate::overview::SQL {
        out.push((
            (*name).to_owned(),
            plan(pool, sqlx::query_as(&format!("EXPLAIN {sql}"))).await?,
        ));
    }
    let q = sqlx::query_as(
        "EXPLAIN SELECT processed_at FROM postal.processed_events
         WHERE consumer_name = $2 AND event_id = $1",
    )
    .bind(event_id)
    .bind(consumer);
    out.push(("dedup lookup".into(), plan(pool, q).await?));
    Ok(out)
}

/// The large tables a plan reads end to end (`Seq Scan on <table>`).
pub fn full_scans(plan: &str) -> Vec<String> {
    plan.lines()
        .filter_map(|l| l.split("Seq Scan on ").nth(1))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter(|t| {
            LARGE_TABLES
                .iter()
                .any(|big| *t == *big || t.starts_with(&format!("{big}_")))
        })
        .map(str::to_owned)
        .collect()
}
