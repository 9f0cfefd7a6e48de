//! A normal start says nothing alarming: a consumer that subscribes before its topic exists, a
//! relay whose lanes all find that topic missing at once, a database already migrated. An
//! operator reads every ERROR and WARN line as trouble; such a start has none.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use postal_integration_tests::{services, unique, wait, KillOnDrop};

use crate::procs::bin_dir;

/// Starts `program args` with `env`, its stdout and stderr into `log`.
fn start(program: &Path, args: &[&str], env: &[(&str, &str)], log: &Path) -> KillOnDrop {
    let file = std::fs::File::create(log).expect("log file");
    KillOnDrop(
        Command::new(program)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::from(file.try_clone().expect("log file")))
            .stderr(Stdio::from(file))
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", program.display())),
    )
}

/// SIGTERM, then waits for a clean exit.
fn stop(child: &mut Child, name: &str) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            assert!(status.success(), "{name} did not stop cleanly ({status})");
            return;
        }
        assert!(Instant::now() < deadline, "{name} ignored SIGTERM for 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Guarantee: a normal start of `postal relay --migrate` and a consumer (`billing_service`),
/// both at log level `info`, on a database already migrated, with the consumer subscribed
/// before its topic exists and the relay's 4 lanes finding it missing at once, logs no ERROR or
/// WARN line and no PostgreSQL notice (`schema "postal" already exists, skipping`), says
/// `created topic` once per topic, and says the consumer waits for its topic — while every
/// event goes through. (Failed before: the consumer logged ERROR `UnknownTopicOrPartition …
/// Subscribed topic not available` and WARN `kafka consumer error`, and both processes logged
/// sqlx notices at INFO.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_normal_start_logs_no_error_warning_or_notice() {
    const EVENTS: i64 = 24;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let (orders, invoices) = (unique("quiet-orders"), unique("quiet-invoices"));
    let dir = std::env::temp_dir().join(unique("postal-quiet-start"));
    std::fs::create_dir_all(&dir).expect("log dir");
    let (consumer_log, relay_log) = (dir.join("consumer.log"), dir.join("relay.log"));
    let env: Vec<(&str, &str)> = vec![
        ("DATABASE_URL", &db.url),
        ("KAFKA_BOOTSTRAP_SERVERS", &svc.bootstrap),
        ("POSTAL_LOG", "info"),
        ("ORDERS_TOPIC", &orders),
        ("INVOICES_TOPIC", &invoices),
        ("POSTAL_CONSUMER_GROUP", &orders),
    ];
    let bins = bin_dir();
    let mut consumer = start(&bins.join("billing_service"), &[], &env, &consumer_log);
    // Until the broker has told the consumer that its topic does not exist (in whatever
    // words).
    wait::until(
        Duration::from_secs(60),
        "the consumer to find its topic missing",
        || async {
            let text = std::fs::read_to_string(&consumer_log).unwrap_or_default();
            text.contains("waiting for topic") || text.contains("Unknown topic")
        },
    )
    .await;
    // One event per key, so that every lane of the relay has some when it starts.
    for i in 0..EVENTS {
        sqlx::query(
            "SELECT postal.enqueue($1, $2, 'order.created',
                 jsonb_build_object('order_id', $3::bigint, 'customer', $2, 'seq', 1))",
        )
        .bind(&orders)
        .bind(format!("customer-{i}"))
        .bind(i)
        .execute(&db.pool)
        .await
        .expect("enqueue");
    }
    let mut relay = start(
        &bins.join("postal"),
        &["relay", "--migrate", "--lanes", "4"],
        &env,
        &relay_log,
    );
    wait::until(
        Duration::from_secs(90),
        "every order booked and its invoice published",
        || async {
            let (booked, left): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM ledger), (SELECT count(*) FROM postal.outbox)",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap_or((0, 1));
            booked == EVENTS && left == 0
        },
    )
    .await;
    stop(&mut consumer.0, "billing_service");
    stop(&mut relay.0, "postal relay");
    let consumer_text = std::fs::read_to_string(&consumer_log).expect("consumer log");
    let relay_text = std::fs::read_to_string(&relay_log).expect("relay log");
    let mut problems = Vec::new();
    for (name, text) in [("consumer", &consumer_text), ("relay", &relay_text)] {
        for line in text.lines() {
            if line.contains(" ERROR ") || line.contains(" WARN ") || line.contains("notice") {
                problems.push(format!("{name}: {line}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "a normal start logged:\n{}",
        problems.join("\n")
    );
    for topic in [&orders, &invoices] {
        let said = relay_text
            .lines()
            .filter(|l| l.contains("created topic") && l.contains(topic.as_str()))
            .count();
        assert_eq!(said, 1, "`created topic` for {topic}:\n{relay_text}");
    }
    assert!(
        consumer_text.contains(&format!("waiting for topic \"{orders}\" to exist")),
        "{consumer_text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
