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
        /// The record key, as text (UTF-8).
        #[arg(
            long,
            required_unless_present = "key_base64",
            conflicts_with = "key_base64"
        )]
        key: Option<String>,
        /// The record key's bytes in base64 (any key, UTF-8 or not: as `postal held list`
        /// shows it, `key_base64` in --json).
        #[arg(long)]
        key_base64: Option<String>,
        /// Dead-letter the head instead of retrying it.
        #[arg(long)]
        skip_head: bool,
        /// Do it (without: show what would be released).
        #[arg(long)]
        yes: bool,
    },
}

/// `--key-base64`'s value: standard base64, padded or not.
fn parse_base64(s: &str) -> anyhow::Result<Vec<u8>> {
    use base64::Engine as _;
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    engine
        .decode(s.trim())
        .map_err(|e| anyhow::anyhow!("--key-base64 {}: not base64 ({e})", shown(s, false)))
}

/// Refuses a group this database knows nothing of (a typo), as other commands do.
async fn known(pool: &PgPool, group: &str) -> anyhow::Result<()> {
    crate::known::group(pool, group, None).await
}

pub async fn run(pool: &PgPool, cmd: HeldCommand) -> anyhow::Result<()> {
    match cmd {
        HeldCommand::List { group, json: true } => {
            known(pool, &group).await?;
            say!("{}", json(&held::list(pool, &group).await?, true)?);
        }
        HeldCommand::List { group, json: false } => {
            known(pool, &group).await?;
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
            key_base64,
            skip_head,
            yes,
        } => {
            known(pool, &group).await?;
            let key = match (key_base64, key) {
                (Some(b), _) => parse_base64(&b)?,
                (None, Some(k)) => k.into_bytes(),
                (None, None) => anyhow::bail!("name the key: --key or --key-base64"),
            };
            let found = held::find(pool, &group, &topic, &key).await?;
            if found.is_empty() {
                anyhow::bail!(
                    "no held key {} on topic {} of group {}",
                    shown(&held::key_named(&key), false),
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
        shown(&held::key_named(&k.key_bytes), false),
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
