//! `postal grant`: the least privileges each role of a Postal deployment needs, granted on the
//! tables, sequences and functions of the `postal` schema (the owner — the role that runs
//! `postal migrate` — has them all).
//!
//! - **app**: a service that enqueues events: insert outbox rows (`enqueue`, `enqueue_once`,
//!   `postal.enqueue(…)`) and read what it compares (`enqueue_once`); it cannot change or
//!   delete them, nor touch the relay's or consumers' tables.
//! - **relay**: claims, publishes and marks or deletes outbox rows; keeps its leases.
//! - **WAL relay** (`--wal-relay`): what a relay may, and the `REPLICATION` attribute its
//!   replication session needs (`ALTER ROLE … REPLICATION`: PostgreSQL 15 lets only a
//!   superuser give it; without it the statement is reported, not run).
//! - **consumer**: dedup rows, stored offsets, dead letters; and what `app` may (a handler that
//!   enqueues, a chain).
//!
//! Grants cover the objects that exist: run it again after `postal migrate` added some.

use crate::out::say;
use clap::Args;
use sqlx::PgPool;

/// Which roles to grant to.
#[derive(Args, Debug)]
pub struct GrantArgs {
    /// Roles of services that enqueue events (repeatable).
    #[arg(long = "app")]
    apps: Vec<String>,
    /// Roles the relay runs as (repeatable).
    #[arg(long = "relay")]
    relays: Vec<String>,
    /// Roles WAL relays run as (`postal relay --read-from wal`; repeatable): a relay's
    /// privileges and the `REPLICATION` attribute.
    #[arg(long = "wal-relay")]
    wal_relays: Vec<String>,
    /// Roles consumers run as (repeatable).
    #[arg(long = "consumer")]
    consumers: Vec<String>,
    /// Print the statements instead of running them.
    #[arg(long)]
    print: bool,
}

/// The statements for `role` as an app (enqueue only).
fn app(role: &str) -> Vec<String> {
    vec![
        format!("GRANT USAGE ON SCHEMA postal TO {role}"),
        format!("GRANT INSERT ON postal.outbox TO {role}"),
        // enqueue_once compares an event already there with the one it was given.
        format!("GRANT SELECT (event_id, topic, event_key, event_type, payload, schema_version, content_type, headers) ON postal.outbox TO {role}"),
        format!("GRANT USAGE ON SEQUENCE postal.outbox_seq_seq TO {role}"),
        // shown_text: how postal.enqueue_bytes names a refused header or content type
        // (migration 31), for a database whose functions are not executable by PUBLIC.
        format!("GRANT EXECUTE ON FUNCTION postal.enqueue, postal.enqueue_bytes, postal.uuid_v7, postal.shown_text TO {role}"),
        format!("GRANT SELECT ON postal.schema_contract, postal._sqlx_migrations TO {role}"),
    ]
}

/// The statements for `role` as a relay.
fn relay(role: &str) -> Vec<String> {
    vec![
        format!("GRANT USAGE ON SCHEMA postal TO {role}"),
        format!("GRANT SELECT, UPDATE, DELETE ON postal.outbox TO {role}"),
        format!("GRANT SELECT, INSERT ON postal.outbox_history TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON postal.relay_instances, postal.relay_partitions, postal.relay_minutes TO {role}"),
        // A WAL relay's slot lease (docs/wal-relay.md, One reader per slot).
        format!("GRANT SELECT, INSERT, UPDATE ON postal.wal_slot_leases TO {role}"),
        format!("GRANT SELECT ON postal.schema_contract, postal._sqlx_migrations, postal.pauses TO {role}"),
    ]
}

/// For `role` as a WAL relay, after [`relay`]'s: the replication session's attribute.
fn wal_replication(role: &str) -> String {
    format!("ALTER ROLE {role} REPLICATION")
}

/// Optional for `role` as a relay: the oldest-transaction gauge reads every session's
/// transaction start, which only `pg_read_all_stats` shows (granting it needs a superuser or
/// ADMIN on it; without it the gauge sees only the relay role's own sessions).
fn relay_stats(role: &str) -> String {
    format!("GRANT pg_read_all_stats TO {role}")
}

/// The statements for `role` as a consumer.
fn consumer(role: &str) -> Vec<String> {
    let mut out = app(role);
    out.extend([
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON postal.processed_events, postal.consumer_offsets, postal.consumer_settings, postal.dead_letters, postal.dedup_horizon, postal.offset_marks, postal.consumer_stops, postal.held_keys, postal.held_records, postal.held_bytes TO {role}"),
        format!("GRANT SELECT ON postal.pauses TO {role}"),
        format!("GRANT USAGE ON SEQUENCE postal.dead_letters_id_seq TO {role}"),
        // The batch seal's count of its refusals (migration 0041; the functions run as their
        // owner), for a database whose functions are not executable by PUBLIC.
        format!("GRANT EXECUTE ON FUNCTION postal.batch_seal_refused, postal.batch_seal_refusals TO {role}"),
    ]);
    out
}

/// A role name as an SQL identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Every statement for the roles of `args`, in order.
fn statements(args: &GrantArgs) -> Vec<String> {
    let mut out = Vec::new();
    for r in &args.apps {
        out.extend(app(&ident(r)));
    }
    for r in args.relays.iter().chain(&args.wal_relays) {
        out.extend(relay(&ident(r)));
    }
    for r in &args.consumers {
        out.extend(consumer(&ident(r)));
    }
    out
}

pub async fn run(pool: &PgPool, args: GrantArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !(args.apps.is_empty()
            && args.relays.is_empty()
            && args.wal_relays.is_empty()
            && args.consumers.is_empty()),
        "say which roles: --app ROLE, --relay ROLE, --wal-relay ROLE and/or --consumer ROLE"
    );
    let all = statements(&args);
    let relays: Vec<&String> = args.relays.iter().chain(&args.wal_relays).collect();
    let stats: Vec<String> = relays.iter().map(|r| relay_stats(&ident(r))).collect();
    let replication: Vec<String> = args
        .wal_relays
        .iter()
        .map(|r| wal_replication(&ident(r)))
        .collect();
    if args.print {
        for s in all.iter().chain(&replication).chain(&stats) {
            say!("{s};");
        }
        return Ok(());
    }
    // Recorded in the audit trail as `grant` (the roles, how many statements), in the
    // transaction that grants: the privileges change only with their row.
    let by = crate::audit::operator();
    let target = serde_json::json!({
        "app": args.apps, "relay": args.relays, "wal_relay": args.wal_relays,
        "consumer": args.consumers,
    });
    let mut tx = pool.begin().await?;
    postal_admin::audit::record(&mut tx, &by, "grant", &target, all.len(), all.len() as u64)
        .await?;
    for s in &all {
        sqlx::query(s).execute(&mut *tx).await.map_err(|e| {
            anyhow::anyhow!(
                "{s}: {}",
                e.as_database_error()
                    .map(|d| d.message().to_owned())
                    .unwrap_or_else(|| e.to_string())
            )
        })?;
    }
    tx.commit().await?;
    say!("granted: {} statement(s)", all.len());
    for (s, role) in replication.iter().zip(&args.wal_relays) {
        let mut tx = pool.begin().await?;
        match sqlx::query(s).execute(&mut *tx).await {
            Ok(_) => {
                postal_admin::audit::record(
                    &mut tx,
                    &by,
                    "grant",
                    &serde_json::json!({ "wal_relay": [role], "replication": true }),
                    1,
                    1,
                )
                .await?;
                tx.commit().await?;
                say!("granted: {s}");
            }
            Err(e) => {
                let why = e
                    .as_database_error()
                    .map(|d| d.message().to_owned())
                    .unwrap_or_else(|| e.to_string());
                say!("not granted ({why}): {s}; a superuser must run it, or the WAL relay cannot stream");
            }
        }
    }
    for (s, role) in stats.iter().zip(relays) {
        let mut tx = pool.begin().await?;
        let granted = sqlx::query(s).execute(&mut *tx).await;
        if granted.is_ok() {
            postal_admin::audit::record(
                &mut tx,
                &by,
                "grant",
                &serde_json::json!({ "relay": [role], "pg_read_all_stats": true }),
                1,
                1,
            )
            .await?;
            tx.commit().await?;
        }
        if let Err(e) = granted {
            let why = e
                .as_database_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_else(|| e.to_string());
            say!("not granted ({why}): {s}; without it the relay's oldest-transaction gauge sees only its own sessions");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Role names are quoted, so a name cannot smuggle SQL in.
    #[test]
    fn role_names_are_identifiers() {
        assert_eq!(ident("app"), "\"app\"");
        assert_eq!(
            ident("a\"; DROP TABLE x; --"),
            "\"a\"\"; DROP TABLE x; --\""
        );
    }
}
