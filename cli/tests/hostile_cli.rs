//! Review 46, hostile input on the `postal` CLI: numbers in flags, and stored rows whose fields
//! hold terminal escapes, bidirectional controls, invalid UTF-8 or timestamps outside the
//! range of the CLI's time type. Needs `DATABASE_URL` (skipped otherwise).

use std::process::Command;

use sqlx::PgPool;
use uuid::Uuid;

fn postal(url: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postal"));
    c.env("DATABASE_URL", url).env("POSTAL_LOG", "warn");
    c
}

struct Env {
    url: String,
    pool: PgPool,
    _db: postal_integration_tests::TestDb,
}

async fn env() -> Option<Env> {
    let Ok(server) = std::env::var("DATABASE_URL") else {
        eprintln!("DATABASE_URL not set: skipping (scripts/test.sh sets it)");
        return None;
    };
    let db = postal_integration_tests::create_db(&server).await;
    let (url, pool) = (db.url.clone(), db.pool.clone());
    postal_shared::migrate(&pool).await.unwrap();
    Some(Env { url, pool, _db: db })
}

/// What a run printed, and how it ended.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn run(url: &str, args: &[&str]) -> Run {
    let out = postal(url).args(args).output().unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Characters that must never reach a terminal from the non-`--raw` outputs: ESC, CSI (C1),
/// BEL, CR, and the bidirectional override.
fn terminal_hazards(s: &str) -> Vec<char> {
    s.chars()
        .filter(|c| {
            matches!(
                c,
                '\u{1b}' | '\u{9b}' | '\u{7}' | '\r' | '\u{202e}' | '\u{2067}'
            )
        })
        .collect()
}

/// A run that ended the way the bar allows: success, or a non-zero exit whose stderr is a
/// short error (never a panic, which exits 101 with a backtrace hint).
fn clean(args: &[&str], r: &Run) {
    assert_ne!(r.code, Some(101), "{args:?} panicked: {}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{args:?}: {}", r.stderr);
    if r.code != Some(0) {
        let lines = r.stderr.lines().filter(|l| !l.trim().is_empty()).count();
        assert!(
            (1..=6).contains(&lines),
            "{args:?}: {} lines: {}",
            lines,
            r.stderr
        );
    }
}

/// Input: `--limit` of `-1`, `0`, `-9223372036854775808` and `99999999999999999999` (over
/// i64), as `--limit N` and `--limit=N`, on `failed list`, `dead-letters list` and
/// `audit list`, text and `--json`.
/// Guarantee: each run succeeds (an empty list for 0) or exits non-zero with a short error;
/// none panics, and a negative limit never lists everything.
#[tokio::test]
async fn negative_zero_and_huge_limits_are_refused_or_obeyed() {
    let Some(e) = env().await else { return };
    // One parked row, so that a limit that is ignored shows.
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status, last_error)
         VALUES ($1, 'orders', 'k', 'order.created', '{}'::bytea, 'failed', 'boom')",
    )
    .bind(Uuid::now_v7())
    .execute(&e.pool)
    .await
    .unwrap();
    for cmd in [
        &["failed", "list"][..],
        &["dead-letters", "list"],
        &["audit", "list"],
    ] {
        for limit in ["-1", "0", "-9223372036854775808", "99999999999999999999"] {
            // `--limit -1` is refused by the argument parser (it reads `-1` as a flag);
            // `--limit=-1` reaches the command.
            let joined = format!("--limit={limit}");
            for (json, form) in [(false, 0), (true, 0), (false, 1), (true, 1)] {
                let mut args: Vec<&str> = cmd.to_vec();
                if form == 0 {
                    args.extend(["--limit", limit]);
                } else {
                    args.push(&joined);
                }
                if json {
                    args.push("--json");
                }
                let r = run(&e.url, &args);
                clean(&args, &r);
                if cmd[0] == "failed" && limit.starts_with('-') && r.code == Some(0) {
                    assert!(!r.stdout.contains("boom"), "{args:?} listed: {}", r.stdout);
                }
                if cmd[0] == "failed" && limit == "0" {
                    assert_eq!(r.code, Some(0), "{args:?}: {}", r.stderr);
                    assert!(!r.stdout.contains("boom"), "{args:?} listed: {}", r.stdout);
                }
            }
        }
    }
}

/// Input: a parked row and a dead letter whose every free-text field carries terminal and
/// bidi controls: event type `inv\u{202e}fdp.exe` (a right-to-left override, which
/// `postal.enqueue`'s `[:cntrl:]` rule lets through), content type `text/plain\x1b[2J`
/// (clear screen; `postal.enqueue_bytes` lets it through), key `k\x1b]0;owned\x07` (an OSC
/// title), a header named `x-\u{9b}31m`, an OSC 52 clipboard write in a header value, and a
/// dead letter's key and header value that are not UTF-8. Guarantee: no `list`, `show` or
/// `--json` output of `failed` and `dead-letters` carries ESC, CSI, BEL, CR or a bidi
/// override (docs/security.md, "Operator output").
#[tokio::test]
async fn every_field_of_parked_rows_and_dead_letters_reaches_the_terminal_escaped() {
    let Some(e) = env().await else { return };
    let parked = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, content_type, payload,
                                    headers, status, last_error)
         VALUES ($1, 'orders', $2, $3, $4, convert_to($5, 'UTF8'), $6, 'failed', $7)",
    )
    .bind(parked)
    .bind("k\u{1b}]0;owned\u{7}")
    .bind("inv\u{202e}fdp.exe")
    .bind("text/plain\u{1b}[2J")
    .bind("pay\u{1b}[31mload\r")
    .bind(serde_json::json!({"x-\u{9b}31m": "v", "x-clip": "\u{1b}]52;c;cm0gLXJmIH4K\u{7}"}))
    .bind("boom \u{1b}[2J\u{2067}")
    .execute(&e.pool)
    .await
    .unwrap();
    let dead: i64 = sqlx::query_scalar(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition, kafka_offset,
                                          event_id, event_type, record_key, payload, header_names,
                                          header_values, reason, error, dlq_topic)
         VALUES ('c\u{1b}[1m', 'g', 'orders', 0, 7, $1, $2, '\\xff1b5b324a'::bytea,
                 '\\x1b5d303b6f776e6564070d'::bytea, ARRAY[$3, 'x-raw'],
                 ARRAY['\\x1b5b324a'::bytea, '\\xfe1b5b33316d'::bytea], 'undecodable', $4,
                 'orders.dlq')
         RETURNING id",
    )
    .bind(Uuid::now_v7())
    .bind("inv\u{202e}fdp.exe")
    .bind("x-\u{1b}[2J")
    .bind("bad \u{1b}]52;c;cm0K\u{7} \u{9b}31m")
    .fetch_one(&e.pool)
    .await
    .unwrap();
    let parked_id = parked.to_string();
    let dead_id = dead.to_string();
    let runs: Vec<Vec<&str>> = vec![
        vec!["failed", "list"],
        vec!["failed", "list", "--json"],
        vec!["failed", "show", &parked_id],
        vec!["dead-letters", "list"],
        vec!["dead-letters", "list", "--json"],
        vec!["dead-letters", "show", &dead_id],
        vec!["status"],
    ];
    let mut bad = Vec::new();
    for args in &runs {
        let r = run(&e.url, args);
        clean(args, &r);
        if r.code == Some(2) && r.stderr.contains("unrecognized subcommand") {
            continue; // no such subcommand in this version
        }
        let must_show = if args[0] == "failed" {
            parked_id.as_str()
        } else {
            "orders"
        };
        if args[0] != "status" {
            assert!(
                r.stdout.contains(must_show),
                "{args:?} did not show the row: {}",
                r.stdout
            );
        }
        let hazards = terminal_hazards(&r.stdout);
        let err_hazards = terminal_hazards(&r.stderr);
        if !hazards.is_empty() || !err_hazards.is_empty() {
            bad.push(format!(
                "{args:?}: stdout {hazards:?}, stderr {err_hazards:?}"
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "raw controls reached the terminal:\n{}",
        bad.join("\n")
    );
}

/// Input: a parked row inserted by the application role with `occurred_at`, `created_at` and
/// `available_at` = `infinity` (valid `timestamptz`s outside chrono's range; `postal.enqueue`
/// takes `p_occurred_at => 'infinity'` and `p_deliver_at => 'infinity'` too). Guarantee:
/// `postal failed list|show` and `postal status` succeed or exit with a short error;
/// none panics.
#[tokio::test]
async fn timestamps_outside_chronos_range_give_errors_not_panics() {
    let Some(e) = env().await else { return };
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                    last_error, occurred_at, created_at, available_at)
         VALUES ($1, 'orders', 'k', 'order.created', '{}'::bytea, 'failed', 'boom',
                 'infinity', 'infinity', 'infinity')",
    )
    .bind(id)
    .execute(&e.pool)
    .await
    .unwrap();
    let id = id.to_string();
    let mut panics = Vec::new();
    for args in [
        vec!["failed", "list"],
        vec!["failed", "list", "--json"],
        vec!["failed", "show", id.as_str()],
        vec!["status"],
    ] {
        let r = run(&e.url, &args);
        if r.code == Some(101) || r.stderr.contains("panicked") {
            panics.push(format!(
                "{args:?}: {}",
                r.stderr.lines().take(2).collect::<Vec<_>>().join(" | ")
            ));
        }
    }
    assert!(panics.is_empty(), "panics:\n{}", panics.join("\n"));
}
