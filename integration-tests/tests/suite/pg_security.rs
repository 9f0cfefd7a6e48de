//! PostgreSQL over TLS: the `--secure` PostgreSQL of `scripts/stack.sh` (TLS only, a password,
//! its certificate from a local CA). Relay, consumer and CLI connect with
//! `sslmode=verify-full` and the CA as `sslrootcert`.

use std::time::{Duration, Instant};

use postal_integration_tests::{services, unique};
use postal_producer::{enqueue, NewEvent};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

use crate::common::{consumer_config, create_topic, effects, effects_table, start_apply};
use crate::procs::{bin_dir, Proc};

/// The secure PostgreSQL as `scripts/stack.sh pg-up --secure` prints it: its URL (with the
/// superuser's password) and its CA.
fn secure() -> Option<(String, String)> {
    match (
        std::env::var("POSTGRES_TLS_URL"),
        std::env::var("POSTGRES_TLS_CA"),
    ) {
        (Ok(url), Ok(ca)) => Some((url, ca)),
        _ if std::env::var("POSTAL_REQUIRE_SECURE").as_deref() == Ok("1") => {
            panic!("POSTGRES_TLS_URL and POSTGRES_TLS_CA are not set: start it with scripts/stack.sh pg-up --secure")
        }
        _ => {
            eprintln!("PostgreSQL TLS test NOT RUN: POSTGRES_TLS_URL is not set (scripts/test.sh starts it)");
            None
        }
    }
}

/// `url` with database `db` and TLS verified against `ca`.
fn verified(url: &str, db: &str, ca: &str) -> String {
    let base = url.rsplit_once('/').expect("a database path").0;
    format!("{base}/{db}?sslmode=verify-full&sslrootcert={ca}")
}

/// A fresh database on the secure server.
async fn fresh_db(url: &str, ca: &str) -> String {
    let name = unique("postal_tls").replace('-', "_");
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&verified(url, "postgres", ca))
        .await
        .expect("the secure server answers over verified TLS");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    name
}

/// Runs `postal ARGS` to its end with `DATABASE_URL=url`: (success, stderr).
fn postal(url: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(bin_dir().join("postal"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("POSTAL_CONNECT_TIMEOUT", "10s")
        .output()
        .expect("postal runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Guarantee (issue: PostgreSQL security): with `sslmode=verify-full` against a server that
/// takes only TLS, `postal migrate`, `postal status`, a `postal relay` process and a consumer
/// work end to end — every event published and applied once — and every session of the
/// database is encrypted (`pg_stat_ssl`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_consumer_and_cli_work_over_verified_tls() {
    let Some((url, ca)) = secure() else { return };
    let svc = services().await;
    let db = fresh_db(&url, &ca).await;
    let db_url = verified(&url, &db, &ca);
    let (ok, stderr) = postal(&db_url, &["migrate"]);
    assert!(ok, "postal migrate over verified TLS: {stderr}");
    let pool: PgPool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&db_url)
        .await
        .unwrap();
    effects_table(&pool).await;
    let topic = unique("tls-pg");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut tx = pool.begin().await.unwrap();
    for n in 0..20 {
        let e = NewEvent::json(topic.as_str(), "k", "job", &serde_json::json!({ "n": n })).unwrap();
        enqueue(&mut tx, e).await.unwrap();
    }
    tx.commit().await.unwrap();
    let dir = bin_dir();
    let logs = dir.join(format!("pg-security-{db}"));
    std::fs::create_dir_all(&logs).unwrap();
    let mut relay = Proc::new(&dir, &logs, "relay", "postal", &["relay"]).env(&[
        ("DATABASE_URL", db_url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ("POSTAL_LOG", "info,rdkafka=warn".into()),
    ]);
    relay.start();
    let consumer = start_apply(
        &pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), crate::handlers::CONSUMER),
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    while effects(&pool).await.1 < 20 {
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "not applied over TLS: {:?}",
            effects(&pool).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (ok, stderr) = postal(&db_url, &["status"]);
    assert!(ok, "postal status over verified TLS: {stderr}");
    let sessions: Vec<(bool,)> = sqlx::query_as(
        "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
          WHERE a.datname = current_database()",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(sessions.len() >= 2, "the relay's and ours: {sessions:?}");
    assert!(sessions.iter().all(|(ssl,)| *ssl), "{sessions:?}");
    consumer.stop().await;
    relay.stop();
    assert_eq!(effects(&pool).await, (20, 20), "each event applied once");
}

/// Guarantee (issue 50, PostgreSQL security): a WAL relay reads its slot over
/// `sslmode=verify-full` with the CA as `sslrootcert` (the replication session reads the same
/// URL settings as the relay's pool), publishes every event once, and its replication session
/// is encrypted (`pg_stat_ssl`). Before, the replication session ignored `sslrootcert` (a
/// private CA could not be verified) and used no TLS at all unless `sslmode` said so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wal_relay_reads_its_slot_over_verified_tls() {
    let Some((url, ca)) = secure() else { return };
    let svc = services().await;
    let db = fresh_db(&url, &ca).await;
    let db_url = verified(&url, &db, &ca);
    let pool: PgPool = PgPoolOptions::new()
        .max_connections(12)
        .connect(&db_url)
        .await
        .unwrap();
    postal_shared::migrate(&pool).await.unwrap();
    let id = uuid::Uuid::now_v7().simple().to_string();
    let (slot, publication) = (format!("postal_t_slot_{id}"), format!("postal_t_pub_{id}"));
    postal_producer::wal::slot::create(&pool, &slot, &publication)
        .await
        .expect("create slot and publication");
    let topic = unique("tls-pg-wal");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let source = postal_producer::WalSource::new(db_url.clone(), slot.clone(), publication);
    let relay = crate::common::RunningRelay::start(
        &pool,
        crate::common::kafka_transport(&svc.bootstrap),
        crate::common::fast_config().source(postal_producer::RelaySource::Wal(source)),
    );
    let mut ids = std::collections::BTreeSet::new();
    let mut tx = pool.begin().await.unwrap();
    for n in 0..20 {
        let e = NewEvent::json(topic.as_str(), "k", "job", &serde_json::json!({ "n": n })).unwrap();
        ids.insert(enqueue(&mut tx, e).await.unwrap().to_string());
    }
    tx.commit().await.unwrap();
    let records = postal_integration_tests::kafka::read_all(
        &svc.bootstrap,
        &topic,
        20,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(postal_integration_tests::kafka::event_ids(&records), ids);
    let streaming: Vec<(bool,)> = sqlx::query_as(
        "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_replication r USING (pid)
          WHERE r.application_name = 'postal-wal-relay'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    relay.stop().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while sqlx::query_scalar::<_, bool>(
        "SELECT coalesce((SELECT active FROM pg_replication_slots WHERE slot_name = $1), false)",
    )
    .bind(&slot)
    .fetch_one(&pool)
    .await
    .unwrap()
    {
        assert!(Instant::now() < deadline, "the slot stayed active");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&slot)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        streaming,
        vec![(true,)],
        "the relay's replication session over TLS"
    );
}

/// Guarantee (issue: PostgreSQL security): a one-shot command that cannot verify the server's
/// certificate (a CA that did not sign it), or that asks for no encryption from a server that
/// requires it, fails at once with one line saying so; a relay in the same situation keeps
/// running and says why in its log, and publishes nothing meanwhile (no event lost: they wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unverifiable_or_unencrypted_postgres_connection_is_said_plainly() {
    let Some((url, ca)) = secure() else { return };
    let db = fresh_db(&url, &ca).await;
    let system_ca = "/etc/ssl/certs/ca-certificates.crt";
    let untrusted = verified(&url, &db, system_ca);
    let (ok, stderr) = postal(&untrusted, &["status"]);
    assert!(!ok, "status with an untrusted server certificate succeeded");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("TLS certificate could not be verified: set sslrootcert"),
        "says it is the certificate, and what to do: {stderr}"
    );
    let password = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .and_then(|(user, _)| user.split_once(':'))
        .map(|(_, p)| p.to_owned())
        .unwrap();
    assert!(
        !stderr.contains(&password),
        "the password is shown: {stderr}"
    );
    let plain = format!("{}/{db}?sslmode=disable", url.rsplit_once('/').unwrap().0);
    let (ok, stderr) = postal(&plain, &["status"]);
    assert!(!ok);
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("the server requires TLS: add sslmode=verify-full"),
        "{stderr}"
    );

    let dir = bin_dir();
    let logs = dir.join(format!("pg-security-{db}"));
    std::fs::create_dir_all(&logs).unwrap();
    let mut relay = Proc::new(&dir, &logs, "relay-untrusted", "postal", &["relay"]).env(&[
        ("DATABASE_URL", untrusted.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1".into()),
        ("POSTAL_LOG", "info,rdkafka=off".into()),
    ]);
    relay.start();
    let log = logs.join("relay-untrusted.log");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("TLS certificate could not be verified") {
            assert!(!text.contains(&password), "the password is in the log");
            break;
        }
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "the relay never said the certificate failed:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    relay.assert_alive();
    relay.stop();
}

/// `url` with its user replaced by `role` (the dev stack trusts loopback logins).
pub(crate) fn as_role(url: &str, role: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (_, host) = rest.split_once('@').unwrap();
    format!("{scheme}://{role}@{host}")
}

/// Guarantee (issue: PostgreSQL security): after `postal grant --app A --relay R --consumer C`
/// (run as the schema's owner), role A enqueues — `enqueue`, `enqueue_once` and the SQL
/// `postal.enqueue` — but cannot change or delete outbox rows, nor touch the relay's or the
/// consumers' tables (SQLSTATE 42501); a
/// `postal relay` running as R publishes every event; a consumer running as C applies each
/// once. No role but the owner holds more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privilege_roles_enqueue_relay_and_consume() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let suffix = unique("r").replace('-', "_");
    let (app, relay_role, consumer_role) = (
        format!("app_{suffix}"),
        format!("relay_{suffix}"),
        format!("consumer_{suffix}"),
    );
    for role in [&app, &relay_role, &consumer_role] {
        sqlx::query(&format!("CREATE ROLE {role} LOGIN"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    // The handler's own table: the application grants it.
    sqlx::raw_sql(&format!(
        "GRANT ALL ON effects TO {consumer_role}; GRANT USAGE ON SEQUENCE effects_id_seq TO {consumer_role}"
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let (ok, stderr) = postal(
        &db.url,
        &[
            "grant",
            "--app",
            &app,
            "--relay",
            &relay_role,
            "--consumer",
            &consumer_role,
        ],
    );
    assert!(ok, "postal grant: {stderr}");

    let topic = unique("roles");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let app_pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&as_role(&db.url, &app))
        .await
        .unwrap();
    let mut tx = app_pool.begin().await.unwrap();
    for n in 0..10 {
        let e = NewEvent::json(topic.as_str(), "k", "job", &serde_json::json!({ "n": n })).unwrap();
        enqueue(&mut tx, e).await.expect("the app role enqueues");
    }
    let once = NewEvent::json(topic.as_str(), "k", "job", &serde_json::json!({ "n": 10 }))
        .unwrap()
        .with_id(postal_shared::EventId::new());
    postal_producer::enqueue_once(&mut tx, once.clone())
        .await
        .expect("enqueue_once");
    postal_producer::enqueue_once(&mut tx, once)
        .await
        .expect("enqueue_once again: recognised, not an error");
    sqlx::query("SELECT postal.enqueue($1, 'k', 'job', '{\"n\": 11}'::jsonb)")
        .bind(&topic)
        .execute(&mut *tx)
        .await
        .expect("the SQL postal.enqueue");
    tx.commit().await.unwrap();
    for forbidden in [
        "UPDATE postal.outbox SET attempts = attempts + 1",
        "DELETE FROM postal.outbox",
        "SELECT attempts FROM postal.outbox",
        "INSERT INTO postal.relay_partitions DEFAULT VALUES",
        "DELETE FROM postal.processed_events",
    ] {
        let err = sqlx::query(forbidden)
            .execute(&app_pool)
            .await
            .expect_err(forbidden);
        assert_eq!(
            err.as_database_error().and_then(|d| d.code()).as_deref(),
            Some("42501"),
            "{forbidden}: {err}"
        );
    }
    app_pool.close().await;

    let dir = bin_dir();
    let logs = dir.join(format!("pg-security-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let mut relay = Proc::new(&dir, &logs, "relay-role", "postal", &["relay"]).env(&[
        ("DATABASE_URL", as_role(&db.url, &relay_role)),
        ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ("POSTAL_LOG", "info,rdkafka=warn".into()),
    ]);
    relay.start();
    let consumer_pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&as_role(&db.url, &consumer_role))
        .await
        .unwrap();
    let consumer = start_apply(
        &consumer_pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), crate::handlers::CONSUMER),
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if left == 0 && effects(&db.pool).await.1 == 12 {
            break;
        }
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "{left} left in the outbox, effects {:?}; relay log:\n{}",
            effects(&db.pool).await,
            std::fs::read_to_string(logs.join("relay-role.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    consumer.stop().await;
    relay.stop();
    assert_eq!(effects(&db.pool).await, (12, 12), "each event applied once");
    let log = std::fs::read_to_string(logs.join("relay-role.log")).unwrap_or_default();
    assert!(
        !log.contains("permission denied"),
        "the relay role lacked a privilege:\n{log}"
    );
    let reported: Option<i64> =
        sqlx::query_scalar("SELECT sum(published)::int8 FROM postal.relay_minutes")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reported, Some(12), "the relay role reports its activity");
    consumer_pool.close().await;
    for role in [&app, &relay_role, &consumer_role] {
        let _ = sqlx::query(&format!("DROP OWNED BY {role}"))
            .execute(&db.pool)
            .await;
        let _ = sqlx::query(&format!("DROP ROLE {role}"))
            .execute(&db.pool)
            .await;
    }
}
