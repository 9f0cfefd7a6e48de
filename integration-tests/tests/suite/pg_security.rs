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
