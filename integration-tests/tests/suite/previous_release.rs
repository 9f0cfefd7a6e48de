//! The previous release's relay on the current schema: what the upgrade contract promises
//! (docs/operations.md, "Schema and upgrades": migrate, then upgrade services one at a time, old and new
//! side by side meanwhile). `scripts/previous-release.sh` builds that relay (the release named
//! in `scripts/previous-release`); `scripts/test.sh` runs it and requires this test to run.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use postal_integration_tests::{services, unique, wait};
use postal_producer::{enqueue, NewEvent};

use crate::common::create_topic;
use crate::procs::{bin_dir, check_wire, http_get, Proc};

/// The previous release's `postal` binary, or `None` (with a line saying why) when it was not
/// built; `POSTAL_REQUIRE_PREVIOUS=1` (set by `scripts/test.sh`) makes that a failure.
fn previous_bin() -> Option<PathBuf> {
    match std::env::var_os("POSTAL_PREVIOUS_BIN") {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(
                p.is_file(),
                "POSTAL_PREVIOUS_BIN={} is not a file",
                p.display()
            );
            Some(p)
        }
        None if std::env::var("POSTAL_REQUIRE_PREVIOUS").as_deref() == Ok("1") => {
            panic!("POSTAL_PREVIOUS_BIN is not set: run scripts/previous-release.sh")
        }
        None => {
            eprintln!("previous-release test NOT RUN: POSTAL_PREVIOUS_BIN is not set (scripts/test.sh builds it with scripts/previous-release.sh)");
            None
        }
    }
}

/// `program relay` with further arguments `args` (`--read-from wal …`).
fn relay(
    program: &std::path::Path,
    logs: &std::path::Path,
    name: &str,
    url: &str,
    bootstrap: &str,
    args: &[&str],
) -> Proc {
    let dir = program.parent().expect("binary directory");
    let file = program
        .file_name()
        .and_then(|f| f.to_str())
        .expect("binary name");
    Proc::new(dir, logs, name, file, &[&["relay"], args].concat())
        .env(&[
            ("DATABASE_URL", url.to_owned()),
            ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.to_owned()),
            ("RUST_LOG", "info,rdkafka=warn".into()),
        ])
        .with_metrics()
}

fn published(port: Option<u16>) -> f64 {
    port.and_then(|p| http_get(p, "/metrics"))
        .and_then(|text| {
            text.lines().find_map(|l| {
                l.strip_prefix("postal_relay_published_total ")?
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .unwrap_or(0.0)
}

/// Guarantee (upgrade contract): the previous release's relay keeps publishing while this
/// release's migrations run under it (enqueue transactions meanwhile stay under 2 s), then runs
/// beside this release's relay in one relay group: they share the key partitions,
/// both publish, and every event reaches the topic, each key's events first delivered in
/// order (read back by an independent client). Its migrator accepts the schema (before:
/// "migration 9 was previously applied but has been modified"). When the contract no longer admits
/// the previous release, its relay refuses to start with one line saying to upgrade it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_releases_relay_runs_beside_this_one_on_the_new_schema() {
    previous_beside_this_one(false).await;
}

/// Guarantee (upgrade contract, WAL mode): the same upgrade with this release's relay reading
/// the WAL (`postal relay --read-from wal`, its slot and publication created on the previous
/// release's schema before any event): the previous release's polling relay keeps publishing
/// while this release's migrations run under it and the slot. This release's WAL relay joins
/// but does not stream while the previous release's relay is live — it says so in one line —
/// because the previous release's claim takes a key's later row past an earlier one another
/// session holds locked (no `skipped` rule), and a stream chunk holds its rows locked until
/// they are acknowledged: side by side, a key's event N+1 went out before its event N about 1
/// run in 11 (helper-69). Its sweep claims beside the previous relay meanwhile. Once the
/// previous relay stopped, the WAL relay streams what is committed after, and confirms its
/// slot. Every event reaches the topic, each key's events first delivered in order (read back
/// by an independent client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_releases_relay_runs_beside_this_one_on_the_new_schema_wal() {
    previous_beside_this_one(true).await;
}

/// Round `round` of the orders: one event for each of `keys` customers, in one transaction.
async fn enqueue_round(
    pool: &sqlx::PgPool,
    topic: &str,
    keys: u64,
    round: u64,
    want: &mut BTreeSet<String>,
) {
    let mut tx = pool.begin().await.unwrap();
    for k in 0..keys {
        let order = round * keys + k;
        want.insert(order.to_string());
        let payload =
            serde_json::json!({"order_id": order, "customer": format!("c{k}"), "seq": round});
        let event =
            NewEvent::json(topic, format!("c{k}").as_str(), "order.created", &payload).unwrap();
        enqueue(&mut tx, event).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// The previous release's relay, the upgrade under it, then this release's relay beside it
/// (reading the WAL when `wal`).
async fn previous_beside_this_one(wal: bool) {
    let Some(previous) = previous_bin() else {
        return;
    };
    let svc = services().await;
    // The previous release's schema, as before the upgrade: its own `postal migrate`.
    let db = svc.empty_db().await;
    let migrated = std::process::Command::new(&previous)
        .arg("migrate")
        .env("DATABASE_URL", &db.url)
        .output()
        .expect("the previous release's postal runs");
    assert!(
        migrated.status.success(),
        "the previous release's migrate: {}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let topic = unique("previous");
    // On the previous release's schema (its outbox is the publication's table), before any
    // event: the upgrade's migrations and every event are in the slot's stream.
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let created_at = match &slot {
        Some(slot) => slot.confirmed(&db.pool).await,
        None => 0,
    };
    let wal_args = slot
        .as_ref()
        .map(|slot| {
            vec![
                "--read-from",
                "wal",
                "--wal-slot",
                slot.source.slot.as_str(),
                "--wal-publication",
                slot.source.publication.as_str(),
            ]
        })
        .unwrap_or_default();
    create_topic(&svc.bootstrap, &topic, 4).await;
    let logs = bin_dir().join(format!("previous-release-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let mut old = relay(
        &previous,
        &logs,
        "previous-relay",
        &db.url,
        &svc.bootstrap,
        &[],
    );
    let mut new = relay(
        &bin_dir().join("postal"),
        &logs,
        "relay",
        &db.url,
        &svc.bootstrap,
        &wal_args,
    );
    // The previous release's relay runs on its schema; the upgrade migrates under it while
    // events are enqueued, then this release's relay joins.
    old.start();
    until_owners(&db.pool, 1, &mut old, None).await;
    let (keys, per_key) = (64, 40);
    let mut want = BTreeSet::new();
    let mut migrating = Some({
        let pool = db.pool.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            postal_shared::migrate(&pool).await.map(|()| t.elapsed())
        })
    });
    let mut slowest = Duration::ZERO;
    for round in 0..per_key {
        if round == per_key / 2 {
            let took = migrating
                .take()
                .expect("once")
                .await
                .unwrap()
                .expect("the upgrade migrates under the previous release's relay");
            eprintln!("upgrade under the previous release's relay: {took:?}, slowest enqueue transaction so far {slowest:?}");
            new.start();
            until_owners(&db.pool, 2, &mut old, Some(&mut new)).await;
            if slot.is_some() {
                // This release's WAL relay does not stream beside the previous release's.
                wait::until(
                    Duration::from_secs(60),
                    "the WAL relay saying it waits for the previous release's relay",
                    || {
                        new.assert_alive();
                        let waits = new.logged("a relay of an earlier release runs on this outbox");
                        async move { waits }
                    },
                )
                .await;
            }
        }
        let t = Instant::now();
        enqueue_round(&db.pool, &topic, keys, round, &mut want).await;
        slowest = slowest.max(t.elapsed());
    }
    assert!(
        slowest < Duration::from_secs(2),
        "an enqueue transaction took {slowest:?} during the upgrade"
    );
    let left = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM postal.outbox WHERE status <> 'published'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    // Until nothing is left to publish, or 120 s (then the assertion says how many are left).
    let deadline = Instant::now() + Duration::from_secs(120);
    wait::until(Duration::from_secs(130), "every event published", || {
        old.assert_alive();
        new.assert_alive();
        let pool = db.pool.clone();
        async move { left(pool).await == 0 || Instant::now() > deadline }
    })
    .await;
    let never = left(db.pool.clone()).await;
    assert_eq!(never, 0, "{never} events never published");
    let mut by_old = None;
    if let Some(slot) = &slot {
        let name = slot.source.slot.clone();
        let streaming = |pool: sqlx::PgPool, name: String| async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&name)
            .fetch_one(&pool)
            .await
            .unwrap()
        };
        assert!(
            !streaming(db.pool.clone(), name.clone()).await,
            "the WAL relay streams beside the previous release's relay"
        );
        // The previous release's relay stops: the WAL relay streams (once its heartbeat is a
        // lease old) what is committed from then on, and confirms its slot past it.
        by_old = Some(published(old.metrics_port()));
        old.stop();
        wait::until(Duration::from_secs(90), "the WAL relay streaming", || {
            new.assert_alive();
            streaming(db.pool.clone(), name.clone())
        })
        .await;
        enqueue_round(&db.pool, &topic, keys, per_key, &mut want).await;
        wait::until(
            Duration::from_secs(60),
            "the events after the stop published",
            || {
                new.assert_alive();
                let pool = db.pool.clone();
                async move { left(pool).await == 0 }
            },
        )
        .await;
        wait::until(
            Duration::from_secs(30),
            "the WAL relay confirming its slot past the events",
            || async { slot.confirmed(&db.pool).await > created_at },
        )
        .await;
    }
    let by_old = by_old.unwrap_or_else(|| published(old.metrics_port()));
    let by_new = published(new.metrics_port());
    if !wal {
        old.stop();
    }
    new.stop();
    let wire = check_wire(&svc.bootstrap, &topic, want.len() as i64, &want).await;
    assert_eq!(wire.missing, 0, "events missing from the topic");
    assert!(
        wire.out_of_order.is_empty(),
        "{:?}",
        &wire.out_of_order[..wire.out_of_order.len().min(5)]
    );
    assert!(
        by_old > 0.0 && by_new > 0.0,
        "both relays published (previous {by_old}, this {by_new})"
    );
    eprintln!(
        "previous release beside this one{}: {} events, {} records, published by the previous relay {by_old}, by this one {by_new}",
        if wal { " (reading the WAL)" } else { "" },
        want.len(),
        wire.records
    );
    if wal {
        // What follows is the previous release's migrator and contract, not a relay's mode:
        // the polling test checks it.
        return;
    }

    // The previous release's migrator accepts this schema (a service that migrates at start,
    // as the examples do, restarts during the upgrade): nothing to apply, nothing refused.
    let migrate = std::process::Command::new(&previous)
        .arg("migrate")
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(
        migrate.status.success(),
        "the previous release's migrator refused this schema: {}",
        String::from_utf8_lossy(&migrate.stderr)
    );

    // A contract that admits only binaries newer than the previous release (this release
    // adds no migration, so its own version would still admit the previous one).
    sqlx::query("UPDATE postal.schema_contract SET oldest_compatible = $1")
        .bind(postal_shared::known_version() + 1)
        .execute(&db.pool)
        .await
        .unwrap();
    let mut refused = std::process::Command::new(&previous)
        .arg("relay")
        .env("DATABASE_URL", &db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", &svc.bootstrap)
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = refused.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = refused.kill();
            panic!("the previous release's relay ran on a schema whose contract excludes it");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut refused.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("upgrade it"), "{stderr}");
}

/// Waits until `n` relays hold key partitions (a WAL relay's sweep is a polling relay of the
/// group: it holds partitions while the relay holds its slot).
async fn until_owners(pool: &sqlx::PgPool, n: i64, a: &mut Proc, mut b: Option<&mut Proc>) {
    wait::until(
        Duration::from_secs(60),
        &format!("{n} relays sharing the partitions"),
        || {
            a.assert_alive();
            if let Some(b) = b.as_deref_mut() {
                b.assert_alive();
            }
            let pool = pool.clone();
            async move {
                let owners: i64 = sqlx::query_scalar(
                    "SELECT count(DISTINCT owner) FROM postal.relay_partitions
                     WHERE lease_until > now()",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                owners == n
            }
        },
    )
    .await;
}
