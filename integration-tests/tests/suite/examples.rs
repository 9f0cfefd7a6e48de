//! The examples of `examples/` (package `postal-examples`), run as the processes a reader runs
//! with `cargo run -p postal-examples --example <name>`: each against this test's own database
//! and topics, its effect checked in the database and on the broker, then stopped with SIGTERM
//! and expected to exit with status 0. Proves they work, not only that they compile.
//!
//! The example binaries must be built first (`target/<profile>/examples/`):
//! `cargo build -p postal-examples --examples` (`scripts/test.sh` does).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use postal_integration_tests::{kafka, services, unique, wait};
use postal_shared::EventId;
use sqlx::PgPool;

use crate::common::create_topic;
use crate::procs::{bin_dir, scalar, Proc};

const WAIT: Duration = Duration::from_secs(60);

/// The examples' directory (`target/<profile>/examples/`), checked to hold `names`.
fn examples_dir(names: &[&str]) -> PathBuf {
    let dir = bin_dir().join("examples");
    for name in names {
        let path = dir.join(name);
        assert!(
            path.is_file(),
            "example binary {} is missing: build the examples first (cargo build -p postal-examples --examples)",
            path.display()
        );
    }
    dir
}

/// Runs a one-shot example to its end; panics with its output unless it exits with status 0.
async fn run_to_end(program: &Path, args: &[&str], env: &[(&str, String)]) {
    let mut command = std::process::Command::new(program);
    command
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    let out = tokio::time::timeout(WAIT, tokio::task::spawn_blocking(move || command.output()))
        .await
        .unwrap_or_else(|_| panic!("{} did not finish within {WAIT:?}", program.display()))
        .expect("output thread")
        .expect("run the example");
    assert!(
        out.status.success(),
        "{} failed ({}):\n{}{}",
        program.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    scalar(pool, sql).await.unwrap_or(0)
}

/// Records of `topic` that consumer group `group` has applied (its stored offsets' sum).
async fn consumed(pool: &PgPool, group: &str, topic: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(next_offset), 0)::bigint FROM postal.consumer_offsets
         WHERE group_id = $1 AND topic = $2",
    )
    .bind(group)
    .bind(topic)
    .fetch_one(pool)
    .await
    .unwrap_or(0)
}

/// Guarantee: the examples do what their headers say. `enqueue` commits N orders, each with
/// its event; `relay` publishes them; `consumer_with_state` books exactly one invoice per order
/// although two instances in different Kafka groups each receive every order; the
/// `throughput_consumer`'s totals count each order once; `batch_consumer`'s batch handler
/// writes one ledger row per order; `chain` records one shipment per
/// order and enqueues one follow-up each, which the relay publishes with ids derived from the
/// orders'. Each long-running example stops on SIGTERM with exit status 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn examples_apply_each_order_once_and_stop_cleanly() {
    let dir = examples_dir(&[
        "enqueue",
        "relay",
        "consumer_with_state",
        "throughput_consumer",
        "batch_consumer",
        "chain",
    ]);
    let svc = services().await;
    let db = svc.fresh_db().await;
    let logs = bin_dir().join(format!("examples-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log directory");
    let (orders, shipments) = (unique("orders"), unique("shipments"));
    create_topic(&svc.bootstrap, &orders, 3).await;
    create_topic(&svc.bootstrap, &shipments, 3).await;
    let env = vec![
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ("ORDERS_TOPIC", orders.clone()),
        ("SHIPMENTS_TOPIC", shipments.clone()),
    ];
    let n = 12;

    run_to_end(&dir.join("enqueue"), &[&n.to_string()], &env).await;
    assert_eq!(count(&db.pool, "SELECT count(*) FROM orders").await, n);
    let order_events: BTreeSet<uuid::Uuid> =
        sqlx::query_scalar("SELECT event_id FROM postal.outbox WHERE topic = $1")
            .bind(&orders)
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(
        order_events.len() as i64,
        n,
        "one event per order, in the outbox"
    );

    let groups = [
        unique("billing-a"),
        unique("billing-b"),
        unique("totals"),
        unique("shipping"),
        unique("ledger"),
    ];
    let process = |name: &str, program: &str, group: Option<&String>| {
        let mut p = Proc::new(&dir, &logs, name, program, &[]).env(&env);
        if let Some(g) = group {
            p = p.env(&[("POSTAL_CONSUMER_GROUP", g.clone())]);
        }
        p
    };
    let mut procs = vec![
        process("relay", "relay", None),
        process("billing-a", "consumer_with_state", Some(&groups[0])),
        process("totals", "throughput_consumer", Some(&groups[2])),
        process("chain", "chain", Some(&groups[3])),
        process("ledger", "batch_consumer", Some(&groups[4])),
    ];
    for p in &mut procs {
        p.start();
    }
    // A second billing instance, in a group of its own: it receives every order again. Started
    // once the first created the table (two concurrent `CREATE TABLE IF NOT EXISTS` can clash).
    wait::until(WAIT, "the invoices table", || {
        procs.iter_mut().for_each(Proc::assert_alive);
        let pool = db.pool.clone();
        async move {
            count(
                &pool,
                "SELECT count(*) FROM pg_tables WHERE tablename = 'invoices'",
            )
            .await
                == 1
        }
    })
    .await;
    let mut second = process("billing-b", "consumer_with_state", Some(&groups[1]));
    second.start();
    procs.push(second);

    wait::until(
        WAIT,
        "every group through every order, the outbox drained",
        || {
            procs.iter_mut().for_each(Proc::assert_alive);
            let (pool, groups, orders) = (db.pool.clone(), groups.clone(), orders.clone());
            async move {
                for g in &groups {
                    if consumed(&pool, g, &orders).await < n {
                        return false;
                    }
                }
                count(&pool, "SELECT count(*) FROM postal.outbox").await == 0
            }
        },
    )
    .await;
    for p in &mut procs {
        p.stop(); // SIGTERM; asserts exit status 0
    }

    let invoices: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT event_id FROM invoices")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        invoices.len() as i64,
        n,
        "one invoice per order, across both billing groups"
    );
    assert_eq!(invoices.into_iter().collect::<BTreeSet<_>>(), order_events);
    let (totals, cents): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT sum(orders)::bigint FROM customer_totals),
                (SELECT sum(cents)::bigint FROM customer_totals) - (SELECT sum(total_cents)::bigint FROM orders)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((totals, cents), (n, 0), "the totals count each order once");
    let ledger: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT event_id FROM order_ledger")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(ledger.len() as i64, n, "one ledger row per order");
    assert_eq!(ledger.into_iter().collect::<BTreeSet<_>>(), order_events);
    let shipped = count(
        &db.pool,
        "SELECT count(DISTINCT order_event_id) FROM shipments",
    )
    .await;
    assert_eq!(count(&db.pool, "SELECT count(*) FROM shipments").await, n);
    assert_eq!(shipped, n, "one shipment per order");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM postal.dead_letters").await,
        0
    );
    let records = kafka::read_all(&svc.bootstrap, &shipments, n as usize, WAIT).await;
    let derived: BTreeSet<String> = order_events
        .iter()
        .map(|id| {
            EventId::derived(EventId::from_uuid(*id).unwrap(), "shipment.requested").to_string()
        })
        .collect();
    assert_eq!(
        kafka::event_ids(&records),
        derived,
        "one follow-up per order published, its id derived from the order's"
    );
}

/// Guarantee: the `tasks` example runs each task it enqueued exactly once (one receipt per
/// task, none left in the outbox) without a broker, and stops on SIGTERM with exit status 0.
#[tokio::test]
async fn tasks_example_runs_each_task_once_and_stops_cleanly() {
    let dir = examples_dir(&["tasks"]);
    let svc = services().await;
    let db = svc.fresh_db().await;
    let logs = bin_dir().join(format!("examples-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log directory");
    let mut tasks =
        Proc::new(&dir, &logs, "tasks", "tasks", &["5"]).env(&[("DATABASE_URL", db.url.clone())]);
    tasks.start();
    wait::until(WAIT, "five receipts sent, the outbox drained", || {
        tasks.assert_alive();
        let pool = db.pool.clone();
        async move {
            count(&pool, "SELECT count(*) FROM sent_receipts").await == 5
                && count(&pool, "SELECT count(*) FROM postal.outbox").await == 0
        }
    })
    .await;
    tasks.stop(); // SIGTERM; asserts exit status 0
    let per_order: Vec<(i64, i64)> =
        sqlx::query_as("SELECT order_id, count(*) FROM sent_receipts GROUP BY 1 ORDER BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(per_order, (1..=5).map(|o| (o, 1)).collect::<Vec<_>>());
}
