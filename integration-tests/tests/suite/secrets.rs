//! Secrets never reach an output: every binary is started with a password planted in each
//! place a secret can be given — the user part and the query of `DATABASE_URL`, an AMQP URL,
//! `POSTAL_KAFKA` (a value with commas in it) and a property file — against a database that
//! does not answer, so that each runs its start, retry and error paths; then everything it
//! printed is searched for the planted text.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use postal_integration_tests::{free_port, services};

use crate::procs::bin_dir;

const PLANTED: &str = "PLANTED-s3cr3t";

/// A binary's run: program, arguments, extra environment, and text it prints on the path
/// under test.
type Run = (
    &'static str,
    Vec<&'static str>,
    Vec<(&'static str, String)>,
    &'static str,
);

/// Runs `program args` with `env` until it exits or its output contains `marker` (then kills
/// it); returns everything it printed (stdout and stderr).
fn output_of(program: &Path, args: &[&str], env: &[(&str, String)], marker: &str) -> String {
    let dir = tempfile_dir();
    let log = dir.join("out.log");
    let file = std::fs::File::create(&log).expect("log file");
    let mut child = postal_integration_tests::KillOnDrop(
        Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("RUST_LIB_BACKTRACE", "0")
            .stdout(Stdio::from(file.try_clone().expect("log file")))
            .stderr(Stdio::from(file))
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", program.display())),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut text = String::new();
    loop {
        text.clear();
        std::fs::File::open(&log)
            .and_then(|mut f| f.read_to_string(&mut text))
            .expect("read log");
        if text.contains(marker) || child.0.try_wait().expect("wait").is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} printed no {marker:?} within 60 s:\n{text}",
            program.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(child);
    text.clear();
    std::fs::File::open(&log)
        .and_then(|mut f| f.read_to_string(&mut text))
        .expect("read log");
    let _ = std::fs::remove_dir_all(&dir);
    text
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("postal-secrets-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Guarantee: no binary prints a planted secret — not at start, not while it retries an
/// unreachable database, not in the error it stops with, not for a malformed setting — from
/// any of the places a secret can be given (URL user part, URL query, AMQP URL, `POSTAL_KAFKA`,
/// `POSTAL_KAFKA_FILE`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_binary_prints_a_planted_secret() {
    let bootstrap = services().await.bootstrap.clone();
    // For the paths that need the database first (the consumer creates its Kafka client
    // once connected).
    let reachable = services().await.fresh_db().await;
    let dir = bin_dir();
    let closed = free_port();
    let db = format!(
        "postgres://postgres:{PLANTED}-user@127.0.0.1:{closed}/nowhere?password={PLANTED}-query&application_name=secrets"
    );
    let props_dir = tempfile_dir();
    let props = props_dir.join("client.properties");
    std::fs::write(
        &props,
        format!("# credentials\nssl.key.password={PLANTED}-file\n"),
    )
    .expect("property file");
    let kafka = format!(
        "sasl.username=relay,sasl.password={PLANTED},with,commas,sasl.oauthbearer.config=principal={PLANTED}-oauth"
    );
    let amqp = format!("amqp://guest:{PLANTED}-amqp@127.0.0.1:{closed}/%2f");
    let env = |extra: &[(&'static str, String)]| {
        let mut v = vec![
            ("DATABASE_URL", db.clone()),
            ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.clone()),
            ("POSTAL_KAFKA", kafka.clone()),
            ("POSTAL_KAFKA_FILE", props.display().to_string()),
            ("AMQP_URL", amqp.clone()),
        ];
        v.extend(extra.iter().cloned());
        v
    };
    let postal = dir.join("postal");
    // (program, args, extra env, a line it prints on the path under test)
    let runs: Vec<Run> = vec![
        (
            "postal",
            vec!["relay", "--route", "mq*=rabbitmq"],
            vec![],
            "retrying",
        ),
        ("postal", vec!["relay", "--migrate"], vec![], "retrying"),
        ("postal", vec!["status"], vec![], "cannot reach PostgreSQL"),
        ("postal", vec!["migrate"], vec![], "cannot reach PostgreSQL"),
        (
            "postal",
            vec!["status"],
            vec![(
                "DATABASE_URL",
                format!("postgres://u:{PLANTED}@127.0.0.1:notaport/x"),
            )],
            "DATABASE_URL",
        ),
        (
            "postal",
            vec!["status"],
            vec![(
                "DATABASE_URL",
                format!("postgres://127.0.0.1/x?sslpassword={PLANTED}"),
            )],
            "sslpassword",
        ),
        (
            "postal",
            vec!["relay"],
            vec![("POSTAL_KAFKA", format!("{PLANTED},linger.ms=5"))],
            "has no '='",
        ),
        (
            "postal",
            vec!["relay"],
            vec![(
                "DATABASE_URL",
                format!("postgres://postgres@127.0.0.1:{closed}/x?password={PLANTED}@x"),
            )],
            "retrying",
        ),
        (
            "postal",
            vec!["relay"],
            vec![(
                "POSTAL_KAFKA",
                format!("sasl.jaas.config=x required password=\"{PLANTED}\";"),
            )],
            "kafka configuration",
        ),
        (
            "postal",
            vec!["relay"],
            vec![("POSTAL_KAFKA", format!("sasl.pasword={PLANTED}"))],
            "kafka configuration",
        ),
        (
            "postal",
            vec!["relay", "--route", "mq*=rabbitmq"],
            vec![("AMQP_URL", format!("amqp:relay:{PLANTED}@mq"))],
            "invalid AMQP URI",
        ),
        (
            "billing_service",
            vec![],
            vec![
                ("DATABASE_URL", reachable.url.clone()),
                ("POSTAL_KAFKA", format!("sasl.pasword={PLANTED}")),
            ],
            "kafka error",
        ),
        ("roundtrip", vec![], vec![], "cannot reach PostgreSQL"),
        ("demo", vec![], vec![], "cannot reach PostgreSQL"),
        ("billing_service", vec![], vec![], "PostgreSQL unreachable"),
        ("invoice_recorder", vec![], vec![], "PostgreSQL unreachable"),
        ("order_service", vec![], vec![], "PostgreSQL unreachable"),
        ("report_worker", vec![], vec![], "PostgreSQL unreachable"),
        (
            "billing_service",
            vec![],
            vec![("POSTAL_KAFKA", PLANTED.to_string())],
            "POSTAL_KAFKA",
        ),
    ];
    let mut problems = Vec::new();
    for (program, args, extra, marker) in &runs {
        let path = if *program == "postal" {
            postal.clone()
        } else {
            dir.join(program)
        };
        assert!(
            path.is_file(),
            "{} is missing: build the binaries first (cargo build -p postal-cli -p postal-demo -p postal-integration-tests --bins)",
            path.display()
        );
        let out = output_of(&path, args, &env(extra), marker);
        if let Some(line) = out.lines().find(|l| l.contains(PLANTED)) {
            problems.push(format!("{program} {args:?} printed the secret: {line}"));
        }
        if !out.contains(marker) {
            problems.push(format!(
                "{program} {args:?} did not reach the path under test (no {marker:?}):\n{out}"
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&props_dir);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
