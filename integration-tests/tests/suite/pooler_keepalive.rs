//! A consumer cut off behind PgBouncer (issue 51, finding 6's last part): PostgreSQL's socket
//! faces PgBouncer, not the consumer, so the consumer's `lost_connection_timeout` (keepalives,
//! `tcp_user_timeout` on the server session) cannot find a consumer that went silent. Its
//! transaction, and what it holds (the partition's next record's dedup row, its offset row),
//! lasts until PgBouncer drops its client connection. Measured here, on test hosts (network
//! namespaces): the consumer's connections reach a session-mode PgBouncer on host `pooler`
//! from host `edge` (a forwarder), PgBouncer reaches PostgreSQL through its unix socket;
//! `edge` is cut (silence: no reset) while the consumer's handler is inside its transaction,
//! the consumer dies, and another consumer of the group takes the partition.
//!
//! `POSTAL_POOLER_CUT_LIMIT` (seconds) bounds the wait of the measurements with PgBouncer's
//! defaults (ignored by default: about 2 h 11 min and 15 min).

use std::time::{Duration, Instant};

use postal_integration_tests::hosts::{Forwarder, TestHosts};
use postal_integration_tests::pgbouncer::{self, Options, PgBouncer, PoolMode};
use postal_integration_tests::{services, unique};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

use crate::common::{consumer_config, create_topic, effects_table, produce, RawRecord};
use crate::handlers::{Probe, CONSUMER};

/// What docs/operations.md#poolers recommends in `pgbouncer.ini`: the consumer's 30 s bound.
const RECOMMENDED: [&str; 4] = [
    "tcp_keepidle = 15",
    "tcp_keepintvl = 5",
    "tcp_keepcnt = 3",
    "tcp_user_timeout = 30000",
];

/// Where the consumer was when its host was cut off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    /// In its handler, between statements: the server session idles in its transaction and
    /// PgBouncer has nothing to send (only keepalives can find the silence).
    Idle,
    /// Waiting for a statement's answer: the answer comes after the cut, and PgBouncer's copy
    /// of it to the consumer is never acknowledged (retransmissions, `tcp_user_timeout`).
    AnswerPending,
}

/// How long after the cut another consumer applied the record the cut-off one was inside,
/// and PgBouncer's log lines about closing connections meanwhile. `None` (with a message) when
/// this machine cannot run it.
async fn cut_off_consumer_frees_its_partition_after(
    test: &str,
    settings: &[&str],
    cut: Cut,
    limit: Duration,
) -> Option<(Duration, String)> {
    let bin = pgbouncer::binary(test)?;
    if let Err(why) = TestHosts::available() {
        eprintln!("{test} NOT RUN: {why}");
        return None;
    }
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    // PgBouncer on its host reaches PostgreSQL through the server's unix socket.
    let sockets: String = sqlx::query_scalar("SHOW unix_socket_directories")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let Some(socket_dir) = sockets
        .split(',')
        .map(str::trim)
        .find(|d| d.starts_with('/'))
    else {
        eprintln!("{test} NOT RUN: PostgreSQL has no unix socket ({sockets:?})");
        return None;
    };
    let hosts = TestHosts::create(&["edge", "pooler"]);
    let bouncer = PgBouncer::start_with(
        &bin,
        &svc.database_url,
        PoolMode::Session,
        10,
        &[],
        Options {
            netns: Some(hosts.netns("pooler").to_owned()),
            listen_addr: Some(hosts.addr("pooler").to_owned()),
            server_host: Some(socket_dir.to_owned()),
            settings: settings.iter().map(|s| s.to_string()).collect(),
        },
    );
    let keepalive_sysctls: Vec<String> = [
        "tcp_keepalive_time",
        "tcp_keepalive_intvl",
        "tcp_keepalive_probes",
        "tcp_retries2",
    ]
    .iter()
    .map(|k| {
        let out = hosts
            .command("pooler", "cat")
            .arg(format!("/proc/sys/net/ipv4/{k}"))
            .output()
            .expect("read a sysctl");
        format!("{k}={}", String::from_utf8_lossy(&out.stdout).trim())
    })
    .collect();
    eprintln!(
        "{test}: PgBouncer settings {settings:?}; host pooler's kernel: {}",
        keepalive_sysctls.join(" ")
    );
    let target: std::net::SocketAddr = format!("{}:{}", hosts.addr("pooler"), bouncer.port)
        .parse()
        .unwrap();
    let forwarder = Forwarder::start(hosts.netns("edge"), target).await;
    // Consumer A, on host `edge` as far as PgBouncer can tell.
    let pool_a = PgPoolOptions::new()
        .max_connections(4)
        .connect(&format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            forwarder.port, db.name
        ))
        .await
        .expect("through the forwarder and PgBouncer");
    let topic = unique("pooler-cut");
    let group = unique("g-cut");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let config = consumer_config(&svc.bootstrap, &group, CONSUMER);
    let probe_a = Probe::default();
    let a = crate::common::start_apply_with(&pool_a, &topic, config.clone(), probe_a.clone());
    let job = |n: i64, fail: Option<&str>| {
        let id = Uuid::now_v7();
        let mut payload = json!({ "n": n });
        if let Some(f) = fail {
            payload["fail"] = f.into();
        }
        (id, RawRecord::event(id, "k", "job", payload))
    };
    let applied = |n: i64| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects WHERE n = $1")
                .bind(n)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let (_, first) = job(1, None);
    produce(&svc.bootstrap, &topic, Some(0), &[first]).await;
    postal_integration_tests::wait::until(Duration::from_secs(60), "A at work", || async {
        applied(1).await == 1
    })
    .await;
    // The record A is inside when its host is cut off.
    let (held, record, lock) = match cut {
        Cut::Idle => {
            let (id, record) = job(2, Some("block"));
            (id, record, None)
        }
        Cut::AnswerPending => {
            // A's insert waits for this lock; its answer comes once the lock goes, after
            // the cut.
            let mut lock = db.pool.begin().await.unwrap();
            sqlx::query("LOCK TABLE effects IN ACCESS EXCLUSIVE MODE")
                .execute(&mut *lock)
                .await
                .unwrap();
            let (id, record) = job(2, None);
            (id, record, Some(lock))
        }
    };
    produce(&svc.bootstrap, &topic, Some(0), &[record]).await;
    match cut {
        Cut::Idle => {
            postal_integration_tests::wait::until(
                Duration::from_secs(60),
                "A inside its handler",
                || async { probe_a.entered(held) },
            )
            .await
        }
        Cut::AnswerPending => {
            let name = db.name.clone();
            postal_integration_tests::wait::until(
                Duration::from_secs(60),
                "A's insert waiting for the lock",
                || async {
                    sqlx::query_scalar::<_, i64>(
                        "SELECT count(*) FROM pg_stat_activity
                         WHERE datname = $1 AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO effects%'",
                    )
                    .bind(&name)
                    .fetch_one(&db.pool)
                    .await
                    .unwrap()
                        == 1
                },
            )
            .await
        }
    }
    // PgBouncer's sockets towards the cut host, with their timers (keepalive, or
    // retransmissions of data sent into the silence) and unacknowledged bytes.
    let sockets = || {
        let out = hosts
            .command("pooler", "ss")
            .args(["-tno", "state", "established", "dst", hosts.addr("edge")])
            .output()
            .expect("ss runs");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>()
            .join(" | ")
    };
    if cut == Cut::Idle {
        // Idle means nothing of PgBouncer's unacknowledged: an answer whose acknowledgement
        // the cut catches (a delayed ACK) is the other case, retransmitted into the silence.
        let unacknowledged = || {
            let out = hosts
                .command("pooler", "ss")
                .args(["-tn", "state", "established", "dst", hosts.addr("edge")])
                .output()
                .expect("ss runs");
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .skip(1)
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>()
        };
        postal_integration_tests::wait::until(
            Duration::from_secs(30),
            "PgBouncer's data to A acknowledged",
            || async { unacknowledged() == 0 },
        )
        .await;
    }
    // The cut: A's host goes silent, then A dies with its transaction open (the group's
    // session timeout is 6 s: the longer wait below is PostgreSQL's and PgBouncer's).
    hosts.cut("edge");
    let cut_at = Instant::now();
    if let Some(lock) = lock {
        lock.commit().await.unwrap();
    }
    a.kill().await;
    drop(pool_a);
    // Consumer B, connected directly, with the held record let through.
    let probe_b = Probe::default();
    probe_b.release(held);
    let b = crate::common::start_apply_with(&db.pool, &topic, config, probe_b);
    let deadline = cut_at + limit;
    let mut last_report = Instant::now();
    let mut shown = false;
    let freed = loop {
        if applied(2).await == 1 {
            break Some(cut_at.elapsed());
        }
        if Instant::now() > deadline {
            break None;
        }
        if !shown && cut_at.elapsed() > Duration::from_secs(5) {
            eprintln!(
                "{test}: 5 s after the cut, PgBouncer's client sockets: {}",
                sockets()
            );
            shown = true;
        }
        if last_report.elapsed() > Duration::from_secs(300) {
            eprintln!(
                "{test}: still held {:.0}s after the cut; PgBouncer's client sockets: {}",
                cut_at.elapsed().as_secs_f64(),
                sockets()
            );
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let closing: String = bouncer
        .log()
        .lines()
        .filter(|l| l.contains("closing because"))
        .collect::<Vec<_>>()
        .join("\n");
    b.stop().await;
    drop(forwarder);
    drop(bouncer);
    drop(hosts);
    let freed = freed.unwrap_or_else(|| {
        panic!(
            "{test}: another consumer could not take the partition within {limit:?} of the cut; PgBouncer: {closing}"
        )
    });
    assert_eq!(applied(2).await, 1, "applied once");
    eprintln!(
        "{test}: {cut:?}: the partition moved {:.1}s after the cut; PgBouncer: {closing}",
        freed.as_secs_f64()
    );
    Some((freed, closing))
}

/// Guarantee: with the keepalive settings docs/operations.md#poolers recommends for
/// `pgbouncer.ini`, a consumer cut off (no reset, silence) behind a session-mode PgBouncer
/// while its handler idles inside its transaction holds its partition for about the 30 s of
/// its `lost_connection_timeout`, not PgBouncer's default 2 h 11 min: another consumer of the
/// group applies the record within 60 s of the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_cut_off_behind_pgbouncer_with_the_recommended_keepalives_frees_its_partition_within_a_minute(
) {
    let Some((freed, closing)) = cut_off_consumer_frees_its_partition_after(
        "pooler_keepalive::recommended_idle",
        &RECOMMENDED,
        Cut::Idle,
        Duration::from_secs(120),
    )
    .await
    else {
        return;
    };
    assert!(
        freed < Duration::from_secs(60),
        "{:.1}s; {closing}",
        freed.as_secs_f64()
    );
}

/// Guarantee: the same when the cut-off consumer was waiting for a statement's answer, which
/// PgBouncer then sends into the silence (`tcp_user_timeout = 30000` ends the retransmissions;
/// the kernel's own limit is about 15 min).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_cut_off_waiting_for_an_answer_behind_pgbouncer_with_the_recommended_settings_frees_its_partition_within_a_minute(
) {
    let Some((freed, closing)) = cut_off_consumer_frees_its_partition_after(
        "pooler_keepalive::recommended_answer_pending",
        &RECOMMENDED,
        Cut::AnswerPending,
        Duration::from_secs(120),
    )
    .await
    else {
        return;
    };
    assert!(
        freed < Duration::from_secs(60),
        "{:.1}s; {closing}",
        freed.as_secs_f64()
    );
}

fn limit() -> Duration {
    Duration::from_secs(crate::procs::env_u64("POSTAL_POOLER_CUT_LIMIT", 3 * 3600))
}

/// Measurement (the figure docs/operations.md#poolers gives): with PgBouncer's defaults
/// (`tcp_keepalive = 1` with the kernel's keepalive times) the cut-off consumer idle in its
/// transaction holds its partition until the kernel's keepalives give up on PgBouncer's
/// client connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: about 2 h 11 min; `-- --ignored --nocapture pooler_keepalive::`"]
async fn a_consumer_cut_off_behind_a_default_pgbouncer_holds_its_partition_until_the_kernels_keepalives_give_up(
) {
    cut_off_consumer_frees_its_partition_after(
        "pooler_keepalive::defaults_idle",
        &[],
        Cut::Idle,
        limit(),
    )
    .await;
}

/// Measurement: with PgBouncer's defaults, a cut-off consumer that was waiting for an answer
/// holds its partition until the kernel gives up retransmitting that answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: about 15 min; `-- --ignored --nocapture pooler_keepalive::`"]
async fn a_consumer_cut_off_waiting_for_an_answer_behind_a_default_pgbouncer_holds_its_partition_until_retransmissions_give_up(
) {
    cut_off_consumer_frees_its_partition_after(
        "pooler_keepalive::defaults_answer_pending",
        &[],
        Cut::AnswerPending,
        limit(),
    )
    .await;
}
