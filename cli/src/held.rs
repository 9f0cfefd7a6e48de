//! `postal held`: the held keys of a consumer group (`FinalFailure::HoldKey`) — list what
//! waits behind each key; release one (its head retried, or dead-lettered with `--skip-head`,
//! then the rest in order), after a confirmation that lists the events (`--yes`).

use clap::Subcommand;
use postal_admin::held;
use sqlx::PgPool;

use crate::out::say;
use crate::shown::{json, shown};

/// Held keys: list, release.
#[derive(Subcommand, Debug)]
pub enum HeldCommand {
    /// What waits behind each held key of a consumer group: the head's reason and error,
    /// how many records and bytes, the first events.
    List {
        /// The consumer group.
        #[arg(long)]
        group: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Release a held key: its owning consumer retries the head, then applies the rest in
    /// order (with --skip-head it dead-letters the head first). Lists the events and changes
    /// nothing unless --yes is given. Audited.
    Release {
        /// The consumer group.
        #[arg(long)]
        group: String,
        /// The topic.
        #[arg(long)]
        topic: String,
        /// The record key.
        #[arg(long)]
        key: String,
        /// Dead-letter the head instead of retrying it.
        #[arg(long)]
        skip_head: bool,
        /// Do it (without: show what would be released).
        #[arg(long)]
        yes: bool,
    },
}

pub async fn run(pool: &PgPool, cmd: HeldCommand) -> anyhow::Result<()> {
    match cmd {
        HeldCommand::List { group, json: true } => {
            say!("{}", json(&held::list(pool, &group).await?, true)?);
        }
        HeldCommand::List { group, json: false } => {
            let keys = held::list(pool, &group).await?;
            say!(
                "{} held key(s), {} bytes held by group {}",
                keys.len(),
                held::group_bytes(pool, &group).await?,
                shown(&group, false)
            );
            for k in &keys {
                show(k)?;
            }
        }
        HeldCommand::Release {
            group,
            topic,
            key,
            skip_head,
            yes,
        } => {
            let found = held::find(pool, &group, &topic, &key).await?;
            if found.is_empty() {
                anyhow::bail!(
                    "no held key {} on topic {} of group {}",
                    shown(&key, false),
                    shown(&topic, false),
                    shown(&group, false)
                );
            }
            let count: i64 = found.iter().map(|k| k.count).sum();
            let what = if skip_head {
                "dead-letter the head, then apply the rest in order"
            } else {
                "retry the head, then apply the rest in order"
            };
            say!("release of {count} held event(s): {what}");
            for k in &found {
                show(k)?;
            }
            if !yes {
                say!("nothing changed; add --yes to release them");
                return Ok(());
            }
            let by = crate::audit::operator();
            held::release(pool, &by, &group, &topic, &key, skip_head).await?;
            say!("release asked: the partition's consumer applies it within its held poll (postal held list shows what is left)");
        }
    }
    Ok(())
}

fn show(k: &held::HeldKey) -> anyhow::Result<()> {
    say!(
        "topic {} partition {} key {}: {} record(s), {} bytes, held since {}{}{}",
        shown(&k.topic, false),
        k.partition,
        shown(&k.key, false),
        k.count,
        k.bytes,
        k.held_at.format("%Y-%m-%d %H:%M:%S"),
        k.due_at
            .map(|d| format!(", retried at {}", d.format("%H:%M:%S")))
            .unwrap_or_default(),
        k.release
            .as_deref()
            .map(|r| format!(", release ({r}) under way"))
            .unwrap_or_default()
    );
    say!(
        "  head failed ({}, {} attempt(s)): {}",
        k.reason,
        k.attempts,
        shown(&k.error, false)
    );
    for e in &k.first {
        say!("  {}", shown(e, false));
    }
    if k.count > k.first.len() as i64 {
        say!("  … and {} more", k.count - k.first.len() as i64);
    }
    Ok(())
}
