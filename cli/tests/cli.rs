//! The `postal` binary: one-shot commands fail fast with one line; migrate and status work
//! against a real database (when `DATABASE_URL` names a server).

use std::process::Command;
use std::time::{Duration, Instant};

fn postal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_postal"))
}

/// Guarantee: a one-shot command against an unreachable database fails within its connect
/// timeout with a single line naming what is unreachable, and no panic.
#[test]
fn migrate_against_unreachable_database_fails_fast_with_one_line() {
    let started = Instant::now();
    let out = postal()
        .args(["migrate", "--connect-timeout", "2s"])
        .env(
            "DATABASE_URL",
            "postgres://postgres:secret@127.0.0.1:1/nowhere",
        )
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(started.elapsed() < Duration::from_secs(10), "bounded time");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(
        lines[0].starts_with("error: cannot reach PostgreSQL at 127.0.0.1:1"),
        "{stderr}"
    );
    assert!(!stderr.contains("secret"), "the password never appears");
    assert!(!stderr.contains("panicked"));
}

/// Guarantee: a mistyped `DATABASE_URL` (no `://`) is refused in one line that never shows its
/// password, by every command that connects (before: `postgres//app:S3cr3tPW@db…` was printed
/// whole).
#[test]
fn a_mistyped_database_url_is_refused_without_its_password() {
    // The second parses as a URL without a host (localhost): the one-shot commands fail to
    // reach it, in one line; a relay would wait for it (long-running), so only the first.
    for (url, commands) in [
        (
            "postgres//app:S3cr3tPW@db.internal:5432/shop",
            &[&["status"][..], &["migrate"][..], &["relay"][..]][..],
        ),
        (
            "postgres:/app:S3cr3tPW@127.0.0.1:1/shop",
            &[
                &["status", "--connect-timeout", "2s"][..],
                &["migrate", "--connect-timeout", "2s"][..],
            ][..],
        ),
    ] {
        for cmd in commands {
            let mut c = postal();
            c.args(*cmd).env("DATABASE_URL", url);
            let line = one_error_line(c);
            assert!(
                (line.contains("DATABASE_URL") || line.contains("cannot reach PostgreSQL"))
                    && !line.contains("S3cr3tPW"),
                "{cmd:?}: {line}"
            );
        }
    }
}

/// Guarantee: a password planted in `DATABASE_URL` appears in nothing a command prints — its
/// error line, and every log line at `trace` level — whatever the shape of the string: a URL
/// with the password in its user part (with an `@` in it, or percent-encoded), under a query
/// parameter (known, misspelt or unknown to sqlx), after an `@` in the query, a mistyped
/// scheme, or a libpq `key=value` string with a misspelt key. One-shot commands (`status`,
/// `migrate`), the long-running relay (killed after its first retries), and the dashboard
/// (its log, and its overview page and `/metrics` when it serves them).
#[test]
fn a_planted_password_appears_in_no_output_at_any_log_level() {
    const PW: &str = "Pl4ntedPw";
    let shapes = [
        format!("postgres://app:{PW}@127.0.0.1:1/shop"),
        format!("postgres://app:{PW}x@y@127.0.0.1:1/shop"),
        format!("postgres://app:{PW}%40x@127.0.0.1:1/shop"),
        format!("postgres://app@127.0.0.1:1/shop?password={PW}"),
        format!("postgres://app@127.0.0.1:1/shop?pasword={PW}"),
        format!("postgres://app@127.0.0.1:1/shop?sslmode=disable&x={PW}@y"),
        format!("postgres//app:{PW}@127.0.0.1:1/shop"),
        format!("host=127.0.0.1 port=1 user=app pass={PW}"),
        format!("host=127.0.0.1 port=1 user=app password = '{PW} x'"),
    ];
    for url in &shapes {
        for cmd in [
            &["status", "--connect-timeout", "2s"][..],
            &["migrate", "--connect-timeout", "2s"][..],
        ] {
            let out = postal()
                .args(cmd)
                .env("DATABASE_URL", url)
                .env("POSTAL_LOG", "trace")
                .env("RUST_LOG", "trace")
                .output()
                .unwrap();
            let all = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(!out.status.success(), "{cmd:?} {url}: {all}");
            assert!(
                !all.contains(PW),
                "{cmd:?} with {url:?} printed the password: {all}"
            );
        }
    }
    // The relay waits for its database and retries, logging as it goes: a few seconds of it.
    for url in &shapes[..4] {
        let mut child = postal()
            .args(["relay"])
            .env("DATABASE_URL", url)
            .env("POSTAL_LOG", "trace")
            .env("RUST_LOG", "trace")
            .env("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_secs(3));
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!all.is_empty(), "the relay logged something for {url}");
        assert!(
            !all.contains(PW),
            "relay with {url:?} printed the password: {all}"
        );
    }
    // The dashboard: its log and, when it serves, its overview page and metrics.
    for url in &shapes[..4] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut child = postal()
            .args(["dashboard", "--listen", &format!("127.0.0.1:{port}")])
            .env("DATABASE_URL", url)
            .env("POSTAL_LOG", "trace")
            .env("RUST_LOG", "trace")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_secs(3));
        let mut served = String::new();
        for path in ["/", "/metrics"] {
            if let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                use std::io::{Read as _, Write as _};
                let _ = c.set_read_timeout(Some(Duration::from_secs(10)));
                let _ = write!(c, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
                let _ = c.read_to_string(&mut served);
            }
        }
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        let all = format!(
            "{served}{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !all.contains(PW),
            "dashboard with {url:?} showed the password: {all}"
        );
    }
}

/// Guarantee: invalid relay settings (including `--kafka` overrides that break durability or
/// per-key order) stop the process at start-up with a clear error.
#[test]
fn invalid_relay_settings_are_rejected() {
    relay_rejects(
        &["--batch-size", "0"],
        "batch size must be between 1 and 100000",
    );
    relay_rejects(&["--lease", "10s"], "lease 10s is too short");
    relay_rejects(
        &["--history", "10s"],
        "history retention must be at least 60s",
    );
    relay_rejects(
        &["--history", "3d", "--keep-published"],
        "cannot be used with",
    );
    relay_rejects(
        &["--kafka", "no-equals-sign"],
        "--kafka (or POSTAL_KAFKA): a property of 14 characters has no '='",
    );
    relay_rejects(&["--route", "orders=sqs"], "unknown destination");
    relay_rejects(
        &["--kafka", "partitioner=consistent_random"],
        "Kafka property partitioner=consistent_random is refused",
    );
    relay_rejects(
        &["--kafka", "enable.idempotence=false"],
        "Kafka property enable.idempotence=false is refused",
    );
    relay_rejects(
        &["--destination", "rabbitmq"],
        "--rabbitmq-url (or AMQP_URL) is required",
    );
    relay_rejects(
        &["--destination", "rabbitmq", "--rabbitmq-url", "http://mq"],
        "invalid AMQP URI",
    );
}

/// Runs `postal relay ARGS` (no reachable database, no `AMQP_URL`) and checks that it fails
/// with `expected` in its error output.
fn relay_rejects(args: &[&str], expected: &str) {
    let out = postal()
        .arg("relay")
        .args(args)
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere")
        .env_remove("AMQP_URL")
        .output()
        .unwrap();
    assert!(!out.status.success(), "relay {args:?} must fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(expected), "relay {args:?}: {stderr}");
}

/// A fresh database on the server named by `DATABASE_URL` (dropped when the test passed) and a
/// runtime to use it from; `None`, and the test skips, when the variable is unset.
fn fresh_db() -> Option<(tokio::runtime::Runtime, postal_integration_tests::TestDb)> {
    let Ok(server) = std::env::var("DATABASE_URL") else {
        eprintln!("DATABASE_URL not set: skipping (scripts/test.sh sets it)");
        return None;
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = rt.block_on(postal_integration_tests::create_db(&server));
    Some((rt, db))
}

/// Guarantee: `postal migrate` applies the schema (twice is a no-op) and `postal status --json`
/// reports the backlog, on a fresh database of the server named by `DATABASE_URL`.
#[test]
fn migrate_then_status() {
    let Some((rt, db)) = fresh_db() else {
        return;
    };
    let url = db.url.clone();
    for _ in 0..2 {
        let out = postal()
            .arg("migrate")
            .env("DATABASE_URL", &url)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    rt.block_on(async {
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::query("SELECT postal.enqueue('orders', 'c-1', 'order.created', '{}'::jsonb)")
            .execute(&pool)
            .await
            .unwrap();
        // A live relay of the group `reports` (as its heartbeat leaves it).
        sqlx::query(
            "INSERT INTO postal.relay_instances (relay_id, relay_group, host)
             VALUES (gen_random_uuid(), 'reports', 'worker-1')",
        )
        .execute(&pool)
        .await
        .unwrap();
    });
    let out = postal()
        .args(["status", "--json"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["topics"][0]["topic"], "orders");
    assert_eq!(status["topics"][0]["pending"], 1);
    assert_eq!(status["topics"][0]["failed"], 0);
    assert_eq!(status["relays"][0]["relay_group"], "reports");
    assert_eq!(status["relays"][0]["host"], "worker-1");
}

/// Guarantee: `postal relay --migrate` stops at once, with the reason, on a migration error that
/// waiting cannot fix: here a migration that was applied and has been modified since (its
/// checksum no longer matches). (It still waits for an unreachable database.)
#[test]
fn relay_with_migrate_stops_on_a_modified_migration() {
    let Some((rt, db)) = fresh_db() else {
        return;
    };
    rt.block_on(async {
        postal_shared::migrate(&db.pool).await.unwrap();
        sqlx::query(
            "UPDATE postal._sqlx_migrations SET checksum = decode('00', 'hex')
             WHERE version = (SELECT min(version) FROM postal._sqlx_migrations)",
        )
        .execute(&db.pool)
        .await
        .unwrap();
    });
    let mut child = postal()
        .args(["relay", "--migrate"])
        .env("DATABASE_URL", &db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(
        &mut child,
        Duration::from_secs(60),
        "the relay kept retrying a migration that cannot be applied",
    );
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot apply migrations") && stderr.contains("has been modified"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Guarantee: SIGTERM is a graceful stop from the relay's first moment: told to stop while it
/// still waits for an unreachable database at start-up (its migrations retrying), `postal
/// relay` exits with status 0 instead of being killed by the signal.
#[test]
fn relay_stops_gracefully_on_sigterm_while_it_still_waits_to_start() {
    let (mut child, rest) = relay_that_said(
        "postgres://postal@127.0.0.1:1/postal",
        "warn,librdkafka=off,postal_shared=off",
        "cannot apply migrations yet",
    );
    sigterm(&child);
    let status = wait_exit(
        &mut child,
        Duration::from_secs(30),
        "the relay did not stop on SIGTERM while waiting to start",
    );
    let rest = rest.join().unwrap();
    assert!(status.success(), "{status}: {rest:?}");
}

/// Guarantee (from a review): a stop during a migration attempt is acted on at once, not when
/// the attempt ends: `postal relay --migrate` waiting for Postal's migration lock (held by another
/// migrator; it would wait up to a minute) exits 0 promptly on SIGTERM.
#[test]
fn relay_stops_on_sigterm_while_a_migration_attempt_waits_for_the_lock() {
    let Some((rt, db)) = fresh_db() else {
        return;
    };
    // Another migrator holds Postal's migration lock (shared/src/migrate.rs `MIGRATE_LOCK`).
    let holder = rt.block_on(async {
        use sqlx::Connection;
        let mut c = sqlx::PgConnection::connect(&db.url).await.unwrap();
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(0x706f_7374_616c_6d67_i64)
            .execute(&mut c)
            .await
            .unwrap();
        c
    });
    let (mut child, rest) = relay_that_said(
        &db.url,
        "info,librdkafka=off",
        "waiting for Postal's migration lock",
    );
    let sent = Instant::now();
    sigterm(&child);
    let status = wait_exit(
        &mut child,
        Duration::from_secs(90),
        "did not stop within 90 s of SIGTERM",
    );
    let took = sent.elapsed();
    let rest = rest.join().unwrap();
    rt.block_on(async {
        use sqlx::Connection;
        let _ = holder.close().await;
    });
    assert!(
        took < Duration::from_secs(10) && status.success(),
        "SIGTERM during a migration attempt: {status} after {took:?}; {rest:?}"
    );
}

/// `postal relay --migrate` on `url` (its broker unreachable, logging by `log`), returned once
/// a line of its stderr contains `said`; the rest of its stderr is collected in the background.
fn relay_that_said(
    url: &str,
    log: &str,
    said: &str,
) -> (std::process::Child, std::thread::JoinHandle<Vec<String>>) {
    use std::io::BufRead;
    let mut child = postal()
        .args(["relay", "--migrate"])
        .env("DATABASE_URL", url)
        .env("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
        .env("POSTAL_LOG", log)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let found = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.contains(said));
    assert!(found, "the relay never said {said:?}");
    let rest = std::thread::spawn(move || lines.map_while(Result::ok).collect());
    (child, rest)
}

fn sigterm(child: &std::process::Child) {
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
}

/// `child`'s exit status, waited for at most `limit` (then it is killed and `what` is the panic).
fn wait_exit(
    child: &mut std::process::Child,
    limit: Duration,
    what: &str,
) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The single stderr line of a command expected to fail (asserts there is exactly one).
fn one_error_line(mut c: Command) -> String {
    let out = c.env("POSTAL_LOG", "error").output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes in a pipe: {stderr:?}"
    );
    lines[0].to_owned()
}

/// Guarantee (errors said once, with what to do): every command that works on Postal's tables
/// says, on a database without Postal's schema, exactly "Postal's schema is missing in database
/// "<name>": run `postal migrate` …" (before: "error returned from database: relation
/// "postal.outbox" does not exist: relation "postal.outbox" does not exist"); a connection the
/// server refuses names the cause instead of "pool timed out"; a missing database is named; an
/// invalid log format is refused in one line.
#[test]
fn errors_are_one_line_said_once_with_what_to_do() {
    let Some((_rt, db)) = fresh_db() else {
        return;
    };
    // fresh_db() has no Postal schema.
    let (bare, bare_url) = (db.name.clone(), db.url.clone());
    let admin = std::env::var("DATABASE_URL").unwrap();
    let expected = format!(
        "error: Postal's schema is missing in database \"{bare}\": run `postal migrate` (or postal_shared::migrate) first"
    );
    for args in [
        &["status"][..],
        &["failed", "list"],
        &["dead-letters", "list"],
        &["cleanup", "--dedup-retention", "7d"],
        &[
            "consumer", "reset", "--group", "g", "--topic", "t", "--to", "earliest",
        ],
    ] {
        let mut c = postal();
        c.args(args).env("DATABASE_URL", &bare_url);
        assert_eq!(one_error_line(c), expected, "postal {args:?}");
    }
    let mut c = postal();
    c.args(["status"]).env(
        "DATABASE_URL",
        format!("{}/{bare}_nonexistent", admin.rsplit_once('/').unwrap().0),
    );
    let line = one_error_line(c);
    assert!(
        line.contains(&format!("database \"{bare}_nonexistent\" does not exist"))
            && line.ends_with("check the database name in DATABASE_URL"),
        "{line}"
    );
    let mut c = postal();
    c.args(["status", "--connect-timeout", "2s"])
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/x");
    let line = one_error_line(c);
    assert!(
        line.starts_with("error: cannot reach PostgreSQL at 127.0.0.1:1: ")
            && line.contains("Connection refused")
            && !line.contains("pool timed out"),
        "{line}"
    );
    let mut c = postal();
    c.args(["status"])
        .env("DATABASE_URL", &bare_url)
        .env("POSTAL_LOG_FORMAT", "yaml");
    assert_eq!(
        one_error_line(c),
        "error: invalid POSTAL_LOG_FORMAT: \"yaml\" is not `text` or `json`"
    );
}

/// Guarantee: every subcommand of `postal failed` is named in its help's first line.
#[test]
fn failed_help_names_every_subcommand() {
    let out = postal().args(["failed", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.lines()
            .next()
            .is_some_and(|l| ["list", "show", "requeue", "discard"]
                .iter()
                .all(|s| l.contains(s))),
        "{help}"
    );
}

/// Guarantee: `postal dashboard` on a non-loopback address without a token exits at once with one
/// line that says what to do; on loopback it serves its pages (read-only: no action buttons) and
/// exits 0 on SIGTERM.
#[test]
fn dashboard_refuses_an_open_public_bind_and_serves_on_loopback() {
    use std::io::{BufRead, Read, Write};
    let Some((rt, db)) = fresh_db() else {
        return;
    };
    rt.block_on(async {
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        postal_shared::migrate(&pool).await.unwrap();
    });
    let mut open = postal();
    open.args(["dashboard", "--listen", "0.0.0.0:0"])
        .env("DATABASE_URL", &db.url)
        .env_remove("POSTAL_DASHBOARD_TOKEN");
    assert_eq!(
        one_error_line(open),
        "error: refusing to serve the dashboard on 0.0.0.0:0 without a token: set --token (POSTAL_DASHBOARD_TOKEN), or listen on 127.0.0.1"
    );

    let port = postal_integration_tests::free_port();
    let mut child = postal()
        .args(["dashboard", "--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &db.url)
        .env("POSTAL_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert_eq!(
        first.trim(),
        format!("postal dashboard on http://127.0.0.1:{port}/ (read-only)")
    );
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET /parked HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    assert!(page.starts_with("HTTP/1.0 200"), "{page}");
    assert!(page.contains("No parked events match."), "{page}");
    assert!(
        !page.contains("data-test=\"requeue"),
        "read-only shows no buttons"
    );
    sigterm(&child);
    let status = wait_exit(
        &mut child,
        Duration::from_secs(10),
        "the dashboard ignored SIGTERM",
    );
    assert!(status.success(), "{status}");
}
