//! Chaos: the real binaries (`postal relay` ×2, polling or reading the WAL, `order_service`,
//! `billing_service` holding the keys of blocked customers, `invoice_recorder`) run against a
//! private PostgreSQL and a private Apache Kafka broker, while the test kill -9s relays and
//! consumers at random moments and restarts the broker and PostgreSQL once each.
//!
//! Guarantee proved: every order committed by the order service has exactly one ledger row and
//! exactly one invoice record (two hops, each through an outbox and an idempotent consumer), no
//! extra rows exist, each customer's effects were applied in the order of its orders, the
//! outbox is drained with nothing parked or held, nothing was dead-lettered, and the keys held
//! meanwhile were all released and applied.
//!
//! The binaries are found next to the test binary (`target/<profile>/`) or in
//! `POSTAL_BIN_DIR`: the services are the demo's (package `postal-demo`, `demo/src/bin/`),
//! built with `postal` by `scripts/test.sh` first (`cargo build -p postal-cli -p postal-demo`). Knobs: `POSTAL_CHAOS_ORDERS` (default 6,000; CI's time), `POSTAL_CHAOS_KILLS`
//! (kills of each of relay, billing and invoices; default 6), `POSTAL_CHAOS_RATE` (orders/s,
//! default 120, so orders keep flowing while the kills go on), `POSTAL_CHAOS_SEED` (replays a
//! kill schedule), `POSTAL_CHAOS_SOAK=1` (soak mode: 200,000 orders and 60 kills each unless
//! set explicitly). Logs of every process stay in `target/<profile>/chaos-<run>/`.

use std::time::{Duration, Instant};

use postal_integration_tests::private::{PrivateBroker, PrivatePostgres};
use postal_integration_tests::{create_db, free_port, unique};
use rand::{Rng, SeedableRng};
use sqlx::PgPool;

use crate::common::create_topic;
use crate::procs::{
    bin_dir, check_wire, env_u64, log_tail, records_in, scalar, wait_for_claims_in_flight,
    wal_flags, Proc,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restarts_never_lose_or_double_apply_an_order() {
    chaos(Source::Polling).await;
}

/// The same with both relays reading the outbox from a logical replication slot
/// (`postal relay --read-from wal`): one streams while it holds the slot's lease, the other
/// stands by; each is killed at random, the broker and PostgreSQL restarted once (the holder
/// streams again from the slot's confirmed position). Smaller by default (5,000 orders, 4
/// kills each; the same knobs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restarts_never_lose_or_double_apply_an_order_read_from_the_wal() {
    chaos(Source::Wal).await;
}

/// Where the chaos run's relays read the outbox.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    Polling,
    Wal,
}

async fn chaos(source: Source) {
    let wal = source == Source::Wal;
    let soak = std::env::var("POSTAL_CHAOS_SOAK").is_ok_and(|v| v == "1");
    let orders = env_u64(
        "POSTAL_CHAOS_ORDERS",
        match (soak, wal) {
            (true, _) => 200_000,
            (false, false) => 6_000,
            (false, true) => 5_000,
        },
    );
    let kills_each = env_u64(
        "POSTAL_CHAOS_KILLS",
        match (soak, wal) {
            (true, _) => 60,
            (false, false) => 6,
            (false, true) => 4,
        },
    ) as u32;
    let rate = env_u64("POSTAL_CHAOS_RATE", 120);
    let seed = env_u64("POSTAL_CHAOS_SEED", rand::rng().random());
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let mut pg = PrivatePostgres::start().await;
    let mut broker = PrivateBroker::start().await;
    let db = create_db(&pg.url()).await;
    // As an operator would: the schema first (a relay refuses to start without it).
    postal_shared::migrate(&db.pool).await.expect("migrate");
    let bootstrap = broker.bootstrap();
    let (orders_topic, invoices_topic) = (unique("chaos-orders"), unique("chaos-invoices"));
    create_topic(&bootstrap, &orders_topic, 6).await;
    create_topic(&bootstrap, &invoices_topic, 6).await;

    let dir = bin_dir();
    let logs = dir.join(format!("chaos-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    eprintln!(
        "chaos ({source:?}): {orders} orders at {rate}/s, {kills_each} kill -9 each of relay/billing/invoices, seed {seed} (POSTAL_CHAOS_SEED), logs in {}",
        logs.display()
    );
    let common = [
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.clone()),
        ("ORDERS_TOPIC", orders_topic.clone()),
        ("INVOICES_TOPIC", invoices_topic.clone()),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ];
    // Consumers: Kafka's defaults except a 6 s session timeout (librdkafka's default is 45 s),
    // so that the partitions of a killed member move on within seconds; it is a failover
    // setting (CONTRIBUTING.md, "Settings the tests change"), not a safety one. A killed
    // consumer starts again at once.
    let consumer_env = [(
        "POSTAL_KAFKA",
        "session.timeout.ms=6000,heartbeat.interval.ms=1000".to_string(),
    )];
    let consumer_restart_delay = Duration::from_millis(200);
    // Relays: Postal's producer defaults (idempotent producer, acks=all, default batching and
    // linger). Failover timing only: a 20 s lease instead of 60 s, because a kill -9ed relay's
    // key partitions wait for its lease to expire and this run kills relays every few seconds;
    // a lease must be more than twice the delivery timeout, hence 9 s instead of 20 s.
    // WAL relays: one holder at a time, so a killed holder's standby takes over only when
    // its lease ends: 8 s (a delivery timeout of 3 s, under half of it).
    let slot = unique("chaos_slot").replace('-', "_");
    let mut relay_args = vec!["relay"];
    if wal {
        relay_args.extend(wal_flags(&db.pool, &slot).await);
        relay_args.extend(["--lease", "8s", "--kafka", "message.timeout.ms=3000"]);
    } else {
        relay_args.extend(["--lease", "20s", "--kafka", "message.timeout.ms=9000"]);
    }
    let mut relays = [
        Proc::new(&dir, &logs, "relay-a", "postal", &relay_args).env(&common),
        Proc::new(&dir, &logs, "relay-b", "postal", &relay_args).env(&common),
    ];
    // Billing holds keys: the orders of blocked customers fail for good and their keys wait
    // (`POSTAL_FINAL_FAILURE=hold-key`), through the kills, until halfway through the kills
    // the customers are unblocked and their keys released (as `postal held release` does),
    // releases being applied while the kills go on.
    sqlx::raw_sql(
        "CREATE TABLE blocked_customers (customer text PRIMARY KEY);
         INSERT INTO blocked_customers
         VALUES ('customer-3'), ('customer-17'), ('customer-42'), ('customer-99'), ('customer-150')",
    )
    .execute(&db.pool)
    .await
    .expect("blocked customers");
    let mut billing = Proc::new(&dir, &logs, "billing", "billing_service", &[])
        .env(&common)
        .env(&consumer_env)
        .env(&[("POSTAL_FINAL_FAILURE", "hold-key".into())])
        .with_metrics()
        .restart_after(consumer_restart_delay, Duration::from_secs(6));
    let mut held = Held::default();
    // The second hop in throughput mode, so both consumer paths are under fire.
    let mut invoices = Proc::new(&dir, &logs, "invoices", "invoice_recorder", &[])
        .env(&common)
        .env(&consumer_env)
        .env(&[("POSTAL_MAX_BATCH", "50".into())])
        .with_metrics()
        .restart_after(consumer_restart_delay, Duration::from_secs(6));
    let mut generator = Proc::new(&dir, &logs, "order_service", "order_service", &[])
        .env(&common)
        .env(&[
            ("ORDERS", orders.to_string()),
            ("ORDER_RATE", rate.to_string()),
            ("CUSTOMERS", "200".into()),
        ]);
    for r in &mut relays {
        r.start();
    }
    billing.start();
    invoices.start();
    generator.start();
    let started = Instant::now();

    // The kill schedule: random victims at random intervals (mean ≈ the generator's run time
    // spread over all kills), the broker restart after a third of them, PostgreSQL after two
    // thirds.
    let total_kills = 3 * kills_each;
    let mean_gap_ms = (orders * 1000 / rate / u64::from(total_kills)).clamp(300, 5000);
    let (mut relay_kills, mut done) = (0u32, 0u32);
    let (mut broker_restarted, mut pg_restarted) = (false, false);
    while done < total_kills {
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..=2 * mean_gap_ms))).await;
        for p in relays.iter_mut().chain([&mut billing, &mut invoices]) {
            p.restart_if_due();
        }
        held.look(&db.pool, done >= total_kills / 2).await;
        generator.assert_alive_or_finished();
        let mut choices = Vec::new();
        if relay_kills < kills_each && relays.iter().any(Proc::killable) {
            choices.push(0);
        }
        if billing.kills < kills_each && billing.killable() {
            choices.push(1);
        }
        if invoices.kills < kills_each && invoices.killable() {
            choices.push(2);
        }
        if choices.is_empty() {
            continue;
        }
        match choices[rng.random_range(0..choices.len())] {
            0 => {
                let live: Vec<usize> = (0..relays.len())
                    .filter(|&i| relays[i].killable())
                    .collect();
                relays[live[rng.random_range(0..live.len())]].kill();
                relay_kills += 1;
            }
            1 => billing.kill(),
            _ => invoices.kill(),
        }
        done += 1;
        if !broker_restarted && done >= total_kills / 3 {
            // Hang the broker first, so that relays have batches sent and unacknowledged
            // when it dies (their claims stay open, holding their rows locked), then kill -9:
            // the idempotent producers retry those batches across the restart.
            broker.freeze();
            let in_flight = wait_for_claims_in_flight(&db.pool).await;
            eprintln!(
                "  {:>6.1}s broker kill -9 + restart with {in_flight} outbox rows claimed and unacknowledged",
                started.elapsed().as_secs_f64()
            );
            broker.kill();
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..3000))).await;
            broker.restart().await;
            broker_restarted = true;
        }
        if !pg_restarted && done >= 2 * total_kills / 3 {
            eprintln!(
                "  {:>6.1}s PostgreSQL crash + restart",
                started.elapsed().as_secs_f64()
            );
            pg.crash();
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..2000))).await;
            pg.restart().await;
            pg_restarted = true;
        }
        if done % 6 == 0 {
            eprintln!(
                "  {:>6.1}s kills: relay {relay_kills}, billing {}, invoices {}; orders {:?}, ledger {:?}, invoices {:?}",
                started.elapsed().as_secs_f64(),
                billing.kills,
                invoices.kills,
                scalar(&db.pool, "SELECT count(*) FROM orders").await,
                scalar(&db.pool, "SELECT count(*) FROM ledger").await,
                scalar(&db.pool, "SELECT count(*) FROM invoices").await,
            );
        }
    }
    let chaos_secs = started.elapsed().as_secs_f64();

    // Drain: the generator finishes, then both hops catch up.
    let deadline = Instant::now() + Duration::from_secs(if soak { 3600 } else { 900 });
    let mut last = Instant::now();
    loop {
        for p in relays.iter_mut().chain([&mut billing, &mut invoices]) {
            p.restart_if_due();
        }
        held.look(&db.pool, true).await;
        generator.assert_alive_or_finished();
        let o = scalar(&db.pool, "SELECT count(*) FROM orders").await;
        let l = scalar(&db.pool, "SELECT count(*) FROM ledger").await;
        let i = scalar(&db.pool, "SELECT count(*) FROM invoices").await;
        let outbox = scalar(&db.pool, "SELECT count(*) FROM postal.outbox").await;
        let want = Some(orders as i64);
        // Also wait until every process has been up for its minimum uptime: one restarted a
        // moment ago may not have installed its SIGTERM handler yet.
        let settled = relays
            .iter()
            .chain([&billing, &invoices])
            .all(Proc::killable);
        if settled
            && generator.finished()
            && o == want
            && l == want
            && i == want
            && outbox == Some(0)
        {
            break;
        }
        if last.elapsed() > Duration::from_secs(10) {
            eprintln!(
                "  {:>6.1}s draining: orders {o:?}, ledger {l:?}, invoices {i:?}, outbox {outbox:?}",
                started.elapsed().as_secs_f64()
            );
            last = Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "not drained in time: orders {o:?}, ledger {l:?}, invoices {i:?}, outbox {outbox:?}; logs in {}",
            logs.display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let total_secs = started.elapsed().as_secs_f64();
    billing.stop();
    invoices.stop();
    for r in &mut relays {
        r.stop();
    }

    let pool = &db.pool;
    let q = |sql: &'static str| async move { scalar(pool, sql).await.expect(sql) };
    let not_once = q("SELECT count(*) FROM orders o
         WHERE (SELECT count(*) FROM ledger l WHERE l.order_id = o.id) <> 1
            OR (SELECT count(*) FROM invoices i WHERE i.order_id = o.id) <> 1")
    .await;
    let ledger_rows = q("SELECT count(*) FROM ledger").await;
    let invoice_rows = q("SELECT count(*) FROM invoices").await;
    let strays = q("SELECT (SELECT count(*) FROM ledger WHERE order_id NOT IN (SELECT id FROM orders))
                         + (SELECT count(*) FROM invoices WHERE order_id NOT IN (SELECT id FROM orders))")
    .await;
    let out_of_order = q("SELECT count(*) FROM (
             SELECT seq, lag(seq) OVER (PARTITION BY customer ORDER BY id) AS prev FROM ledger
             UNION ALL
             SELECT seq, lag(seq) OVER (PARTITION BY customer ORDER BY id) AS prev FROM invoices) s
         WHERE prev IS NOT NULL AND seq <> prev + 1")
    .await;
    let outbox_left = q("SELECT count(*) FROM postal.outbox").await;
    let held_or_parked =
        q("SELECT count(*) FROM postal.outbox WHERE held OR status = 'failed'").await;
    let dead = q("SELECT count(*) FROM postal.dead_letters").await;
    let consumed_orders = q("SELECT coalesce(sum(next_offset), 0)::bigint FROM postal.consumer_offsets WHERE group_id = 'billing'").await;
    let consumed_invoices = q("SELECT coalesce(sum(next_offset), 0)::bigint FROM postal.consumer_offsets WHERE group_id = 'invoices'").await;
    let in_orders_topic = records_in(&bootstrap, &orders_topic);
    let in_invoices_topic = records_in(&bootstrap, &invoices_topic);
    let order_ids: std::collections::BTreeSet<String> =
        sqlx::query_scalar::<_, String>("SELECT id::text FROM orders")
            .fetch_all(pool)
            .await
            .expect("order ids")
            .into_iter()
            .collect();
    let wire_orders = check_wire(&bootstrap, &orders_topic, in_orders_topic, &order_ids).await;
    let wire_invoices =
        check_wire(&bootstrap, &invoices_topic, in_invoices_topic, &order_ids).await;

    let c = |p: &Proc, k: &str| p.counters.get(k).copied().unwrap_or(0);
    eprintln!("chaos report (seed {seed}):");
    eprintln!(
        "  time                      {chaos_secs:.1} s of kills, {total_secs:.1} s until drained"
    );
    eprintln!(
        "  kill -9                   relay {relay_kills} (a {}, b {}), billing {}, invoices {}; broker restarted 1, PostgreSQL restarted 1",
        relays[0].kills, relays[1].kills, billing.kills, invoices.kills
    );
    eprintln!("  orders                    {orders}");
    eprintln!(
        "  published                 {} events; records in Kafka: orders {in_orders_topic}, invoices {in_invoices_topic} (relay re-publishes after kills: {})",
        2 * orders,
        in_orders_topic + in_invoices_topic - 2 * orders as i64
    );
    for (name, w) in [("orders", &wire_orders), ("invoices", &wire_invoices)] {
        eprintln!(
            "  read back ({name:<8})      {} records, {} distinct orders, {} missing, {} first seen out of order (independent reader)",
            w.records,
            w.distinct,
            w.missing,
            w.out_of_order.len()
        );
        for line in w.out_of_order.iter().take(10) {
            eprintln!("    {line}");
        }
    }
    eprintln!("  consumed (stored offsets) orders {consumed_orders}, invoices {consumed_invoices}");
    eprintln!(
        "  deduplicated              {} (committed deliveries whose event was already applied)",
        consumed_orders + consumed_invoices - ledger_rows - invoice_rows
    );
    eprintln!(
        "  redelivered               at least {} records re-fetched below the stored offset after a kill, {} handler transactions fenced (from /metrics before each kill)",
        c(&billing, "replays_skipped") + c(&invoices, "replays_skipped"),
        c(&billing, "fenced") + c(&invoices, "fenced"),
    );
    eprintln!("  applied                   ledger {ledger_rows}, invoices {invoice_rows}");
    let held_left = q("SELECT (SELECT count(*) FROM postal.held_keys)
                            + (SELECT count(*) FROM postal.held_records)")
    .await;
    eprintln!(
        "  held keys (billing)       at most {} records of {} keys held at once; {} releases asked; {} left",
        held.most_records, held.most_keys, held.released, held_left
    );

    assert_eq!(
        not_once, 0,
        "orders without exactly one ledger row and one invoice"
    );
    assert_eq!(ledger_rows, orders as i64, "ledger rows");
    assert_eq!(invoice_rows, orders as i64, "invoice rows");
    assert_eq!(strays, 0, "effects for orders that do not exist");
    for (name, w, expected) in [
        ("orders", &wire_orders, in_orders_topic),
        ("invoices", &wire_invoices, in_invoices_topic),
    ] {
        assert_eq!(w.records as i64, expected, "{name}: records read back");
        assert_eq!(w.missing, 0, "{name}: orders missing on the wire");
        assert_eq!(
            w.distinct, orders as usize,
            "{name}: distinct orders on the wire"
        );
        assert!(
            w.out_of_order.is_empty(),
            "{name}: per-customer order broken on the wire"
        );
    }
    if out_of_order > 0 {
        let rows: Vec<(String, String, i32, i32)> = sqlx::query_as(
            "SELECT t, customer, prev, seq FROM (
                 SELECT 'ledger' AS t, customer, seq, lag(seq) OVER (PARTITION BY customer ORDER BY id) AS prev FROM ledger
                 UNION ALL
                 SELECT 'invoices', customer, seq, lag(seq) OVER (PARTITION BY customer ORDER BY id) FROM invoices) s
             WHERE prev IS NOT NULL AND seq <> prev + 1 LIMIT 10",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        eprintln!("  out of order (table, customer, previous seq, seq): {rows:?}");
    }
    assert_eq!(out_of_order, 0, "effects applied out of per-customer order");
    assert_eq!(outbox_left, 0, "outbox not drained");
    assert_eq!(held_or_parked, 0, "rows held back or parked");
    assert_eq!(dead, 0, "dead letters");
    assert!(
        held.most_keys > 0 && held.released > 0,
        "blocked customers' keys were held and released"
    );
    assert_eq!(held_left, 0, "held keys or records left");
    assert_eq!(
        consumed_orders, in_orders_topic,
        "billing consumed every record"
    );
    assert_eq!(
        consumed_invoices, in_invoices_topic,
        "invoices consumed every record"
    );
    assert!(
        relay_kills >= kills_each && billing.kills >= kills_each && invoices.kills >= kills_each
    );
    assert!(broker_restarted && pg_restarted);
}

/// Guarantee: a consumer service started while PostgreSQL crashes halfway through its start-up
/// (here: inside the migrator, waiting for a lock on sqlx's bookkeeping table) waits for the
/// server to come back and then starts, instead of exiting. (Before this was handled, the
/// connection lost inside the migrator ended `billing_service` with exit status 1, which a
/// chaos run hit when a consumer restart met the PostgreSQL crash.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_starting_while_postgres_crashes_waits_for_it() {
    let mut pg = PrivatePostgres::start().await;
    let db = create_db(&pg.url()).await;
    postal_shared::migrate(&db.pool).await.expect("migrate");
    // Holds sqlx's bookkeeping table so that the service's migrator stops on it.
    let mut holder = db.pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE postal._sqlx_migrations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .expect("lock");

    let dir = bin_dir();
    let logs = dir.join(format!("startup-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    // No broker listens there: the consumer connects lazily, so this does not stop it starting.
    let env = [
        ("DATABASE_URL", db.url.clone()),
        (
            "KAFKA_BOOTSTRAP_SERVERS",
            format!("127.0.0.1:{}", free_port()),
        ),
        ("ORDERS_TOPIC", unique("startup-orders")),
        ("RUST_LOG", "info,rdkafka=off".into()),
    ];
    let mut billing = Proc::new(&dir, &logs, "billing", "billing_service", &[]).env(&env);
    billing.start();

    let deadline = Instant::now() + Duration::from_secs(60);
    // The service's migrator is waiting for the table lock.
    loop {
        billing.assert_alive();
        let waiting = scalar(
            &db.pool,
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'postal._sqlx_migrations'::regclass",
        )
        .await;
        if waiting.unwrap_or(0) > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for the migrator to wait for the lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Crash with the lock still held (released before, the migrator could finish first).
    pg.crash();
    drop(holder);
    db.pool.close().await;
    pg.restart().await;

    billing
        .await_log("consumer started", Duration::from_secs(60))
        .await;
    assert!(
        billing.logged("PostgreSQL unreachable"),
        "the crash did not reach the service's start-up:\n{}",
        log_tail(&billing.log)
    );
    let pool = PgPool::connect(&db.url).await.expect("reconnect");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM ledger").await,
        Some(0),
        "billing created its table after the restart"
    );
    billing.stop();
}

/// Guarantee: a consumer service told to stop (SIGTERM) while its start-up still waits for an
/// unreachable PostgreSQL exits cleanly (status 0) instead of being killed by the signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_stopped_while_waiting_for_postgres_exits_cleanly() {
    let dir = bin_dir();
    let logs = dir.join(unique("startup-stop"));
    std::fs::create_dir_all(&logs).expect("log dir");
    // Nothing listens on either port.
    let env = [
        (
            "DATABASE_URL",
            format!("postgres://postgres@127.0.0.1:{}/postgres", free_port()),
        ),
        (
            "KAFKA_BOOTSTRAP_SERVERS",
            format!("127.0.0.1:{}", free_port()),
        ),
        ("RUST_LOG", "info,rdkafka=off".into()),
    ];
    let mut billing = Proc::new(&dir, &logs, "billing", "billing_service", &[]).env(&env);
    billing.start();
    billing
        .await_log("PostgreSQL unreachable", Duration::from_secs(60))
        .await;
    billing.stop();
}

/// The chaos run's held keys (billing holds the keys of blocked customers): how many were seen
/// held at once, and the releases asked once the customers are unblocked.
#[derive(Default)]
struct Held {
    most_keys: i64,
    most_records: i64,
    released: u64,
    unblocked: bool,
}

impl Held {
    /// Notes what is held; with `release`, unblocks the customers (once) and asks for the
    /// release of every held key not yet released, as `postal held release` does. Errors (the
    /// database restarting) are left for the next look.
    async fn look(&mut self, pool: &sqlx::PgPool, release: bool) {
        let Ok((keys, records)) = sqlx::query_as::<_, (i64, i64)>(
            "SELECT (SELECT count(*) FROM postal.held_keys),
                    (SELECT count(*) FROM postal.held_records)",
        )
        .fetch_one(pool)
        .await
        else {
            return;
        };
        self.most_keys = self.most_keys.max(keys);
        self.most_records = self.most_records.max(records);
        // Unblocked only once keys were seen held: on a slow machine billing may reach the
        // blocked customers' orders only after half the kills (the drain releases them then).
        if !release || self.most_keys == 0 {
            return;
        }
        if !self.unblocked {
            if sqlx::query("DELETE FROM blocked_customers")
                .execute(pool)
                .await
                .is_err()
            {
                return;
            }
            self.unblocked = true;
        }
        let Ok(waiting) = sqlx::query_as::<_, (String, Vec<u8>)>(
            "SELECT topic, record_key FROM postal.held_keys
             WHERE group_id = 'billing' AND release IS NULL",
        )
        .fetch_all(pool)
        .await
        else {
            return;
        };
        let by = postal_admin::audit::Operator::cli("chaos");
        for (topic, key) in waiting {
            if postal_admin::held::release(pool, &by, "billing", &topic, &key, false)
                .await
                .is_ok()
            {
                self.released += 1;
            }
        }
    }
}
