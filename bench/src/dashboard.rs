//! The dashboard's pages on large tables: how long the server takes to answer each page, and
//! whether the plans read the large tables through indexes.

use std::time::{Duration, Instant};

use postal_admin::web::{serve, Dashboard};
use postal_integration_tests::http::request;
use sqlx::PgPool;

/// What to fill the tables with.
pub struct Opts {
    pub published: i64,
    pub parked: i64,
    pub dead_letters: i64,
    pub requests: usize,
}

async fn fill(pool: &PgPool, o: &Opts) -> anyhow::Result<()> {
    let t = Instant::now();
    // Published rows kept in the outbox, spread over the last 24 hours (so ~1/24 in the last
    // hour, which the charts read), 20 topics, 5,000 keys, 200-byte payloads.
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                    created_at, published_at, available_at)
         SELECT gen_random_uuid(), 'orders-' || (i % 20), 'k' || (i % 5000), 'order.placed',
                convert_to(rpad('{\"n\":' || i || '}', 200), 'UTF8'), 'published',
                now() - (i % 86400) * interval '1 second' - interval '40 milliseconds',
                now() - (i % 86400) * interval '1 second', now()
         FROM generate_series(1, $1) AS i",
    )
    .bind(o.published)
    .execute(pool)
    .await?;
    // Parked events on 3,000 keys, five kinds of error (with ids and numbers in them), parked
    // over the last 24 hours; each key's later events wait behind them (one per parked event).
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status, held,
                                    attempts, last_error, available_at)
         SELECT gen_random_uuid(), 'orders-' || (i % 20), 'p' || (i % 3000), 'order.placed',
                convert_to('{}', 'UTF8'), 'failed', true, 10,
                (ARRAY['broker timeout after ' || (i % 977) || ' ms',
                       'record of about ' || (1000000 + i) || ' bytes exceeds the limit',
                       'topic authorization failed for ' || gen_random_uuid(),
                       'unroutable: no queue bound for key ' || i,
                       'handler said: invoice ' || i || ' already exists'])[1 + i % 5],
                now() - (i % 86400) * interval '1 second'
         FROM generate_series(1, $1) AS i",
    )
    .bind(o.parked)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload)
         SELECT gen_random_uuid(), 'orders-' || (i % 20), 'p' || (i % 3000), 'order.placed',
                convert_to('{}', 'UTF8')
         FROM generate_series(1, $1) AS i",
    )
    .bind(o.parked)
    .execute(pool)
    .await?;
    // Dead letters of five consumers; one in five still open.
    sqlx::query(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition, kafka_offset,
             event_id, event_type, payload, reason, error, attempts, dlq_topic, created_at,
             replayed_at)
         SELECT 'c' || (i % 5), 'c' || (i % 5), 'orders-' || (i % 20), i % 8, i, gen_random_uuid(),
                'order.placed', convert_to('{}', 'UTF8'), 'permanent',
                'handler said: order ' || i || ' is invalid', 1, 'orders.dlq',
                now() - (i % 86400) * interval '1 second',
                CASE WHEN i % 5 = 0 THEN NULL ELSE now() END
         FROM generate_series(1, $1) AS i",
    )
    .bind(o.dead_letters)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id)
         SELECT 'c' || (i % 5), gen_random_uuid() FROM generate_series(1, $1) AS i",
    )
    .bind(o.published)
    .execute(pool)
    .await?;
    // The relays' reports of a full day (what they keep): 3 relays, 20 topics, every minute.
    sqlx::query(
        "INSERT INTO postal.relay_minutes (minute, relay_id, topic, published, retried, parked,
                                           lag_events, lag_ms_sum, lag_ms_max)
         SELECT date_trunc('minute', now()) - m * interval '1 minute', r.id, 'orders-' || t,
                700, 3, 1, 700, 700 * 40.0, 250.0
         FROM generate_series(0, 1439) AS m,
              (SELECT gen_random_uuid() AS id FROM generate_series(1, 3)) AS r,
              generate_series(0, 19) AS t",
    )
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO postal.operator_audit (actor, action, target, affected)
         SELECT 'local', 'requeue', '{}'::jsonb, 1 FROM generate_series(1, 1000)",
    )
    .execute(pool)
    .await?;
    sqlx::query("VACUUM ANALYZE").execute(pool).await?;
    println!(
        "filled: {} published, {} parked (+{} waiting behind them), {} dead letters, {} dedup rows, a day of 3 relays' reports on 20 topics in {:.1} s",
        o.published,
        o.parked,
        o.parked,
        o.dead_letters,
        o.published,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

pub async fn run(pool: PgPool, o: Opts) -> anyhow::Result<()> {
    fill(&pool, &o).await?;
    let parked_id: uuid::Uuid = sqlx::query_scalar(
        "SELECT event_id FROM postal.outbox WHERE status = 'failed' ORDER BY seq OFFSET $1 LIMIT 1",
    )
    .bind(o.parked / 2)
    .fetch_one(&pool)
    .await?;
    let (dead_id, dead_event): (i64, uuid::Uuid) = sqlx::query_as(
        "SELECT id, event_id FROM postal.dead_letters ORDER BY id OFFSET $1 LIMIT 1",
    )
    .bind(o.dead_letters / 2)
    .fetch_one(&pool)
    .await?;
    let processed: uuid::Uuid = sqlx::query_scalar(
        "SELECT event_id FROM postal.processed_events WHERE consumer_name = 'c1' LIMIT 1",
    )
    .fetch_one(&pool)
    .await?;

    println!("\nplans (the real planner, these tables):");
    let plans = postal_admin::plans::explain(&pool, parked_id, "p7", "orders-3", "c1").await?;
    let mut full = 0;
    for (what, plan) in &plans {
        // Tables a page may read whole: small ones (the empty default partition of the history).
        let mut scans = Vec::new();
        for t in postal_admin::plans::full_scans(plan) {
            let rows: f32 = sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE relname = $1")
                .bind(&t)
                .fetch_one(&pool)
                .await?;
            if rows > 1000.0 {
                scans.push(t);
            }
        }
        if scans.is_empty() {
            println!("  index only  {what}");
        } else {
            full += 1;
            println!("  FULL SCAN   {what}: {scans:?}\n{plan}");
        }
    }
    println!(
        "  {} queries, {full} reading a large table end to end",
        plans.len()
    );

    let (addr, server) = serve(
        "127.0.0.1:0".parse()?,
        Dashboard::new(pool.clone()).actions(true),
    )
    .await?;
    let since = (chrono::Utc::now() - chrono::Duration::hours(2)).format("%Y-%m-%dT%H:%M");
    let pages = [
        "/".to_owned(),
        "/parked".to_owned(),
        "/parked?key=p7".to_owned(),
        format!("/parked?event_id={parked_id}"),
        "/parked?reason=timeout".to_owned(),
        format!("/parked?topic=orders-3&since={since}"),
        format!("/parked/{parked_id}"),
        "/blocked".to_owned(),
        "/dead-letters".to_owned(),
        "/dead-letters?consumer=c0".to_owned(),
        format!("/dead-letters?event_id={dead_event}&all=1"),
        format!("/dead-letters/{dead_id}"),
        format!("/lookup?consumer=c1&event_id={processed}"),
        "/audit".to_owned(),
    ];
    println!(
        "\nserver time per page ({} requests each after one warm-up, one at a time, loopback HTTP):",
        o.requests
    );
    println!(
        "  {:<58} {:>9} {:>9} {:>9} {:>8}",
        "page", "median", "p95", "max", "bytes"
    );
    let mut worst = Duration::ZERO;
    for path in &pages {
        let a = request(addr, "GET", path, &[], "").await;
        anyhow::ensure!(a.status == 200, "{path}: HTTP {}: {}", a.status, a.body);
        let mut times = Vec::with_capacity(o.requests);
        let mut bytes = 0;
        for _ in 0..o.requests {
            let t = Instant::now();
            let a = request(addr, "GET", path, &[], "").await;
            times.push(t.elapsed());
            bytes = a.body.len();
        }
        times.sort();
        let median = times[times.len() / 2];
        let p95 = times[(times.len() * 95 / 100).min(times.len() - 1)];
        let max = *times.last().unwrap_or(&Duration::ZERO);
        worst = worst.max(p95);
        let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
        let shown: String = path.chars().take(58).collect();
        println!(
            "  {shown:<58} {:>9} {:>9} {:>9} {bytes:>8}",
            ms(median),
            ms(p95),
            ms(max)
        );
    }
    println!(
        "\nslowest p95: {:.1} ms ({} the 200 ms target)",
        worst.as_secs_f64() * 1000.0,
        if worst < Duration::from_millis(200) {
            "within"
        } else {
            "OVER"
        }
    );
    server.abort();
    Ok(())
}
