//! `postal pause` and `postal resume`: a topic or a relay group at the relay, a consumer group
//! or one of its topics at the consumer (`postal_admin::pauses`); `postal pause list`.

use std::time::Duration;

use clap::{Args, Subcommand};
use postal_admin::pauses::{self, Scope, Side};
use sqlx::PgPool;

use crate::out::say;
use crate::shown::{json, shown};

/// Pause: relay, consumer, list.
#[derive(Subcommand, Debug)]
pub enum PauseCommand {
    /// Stop the relays claiming a topic (--topic) or everything (--all) of a relay group
    /// (--group; without it, of every relay group). Returns once the batches claimed before
    /// the pause have finished: from then on nothing of it is published until `postal resume
    /// relay` with the same flags. Other topics keep flowing.
    Relay(RelayScope),
    /// Stop a consumer group applying anything (or only --topic): returns once its
    /// transactions in flight have ended; from then on nothing of it is applied (its records
    /// wait at their stored offsets, fetching stops) until `postal resume consumer`.
    Consumer(ConsumerScope),
    /// The pauses in force: side, group, topic, since when, by whom, why.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Resume: relay, consumer.
#[derive(Subcommand, Debug)]
pub enum ResumeCommand {
    /// Lift a relay pause given with the same flags; the relays are woken at once.
    Relay(RelayScope),
    /// Lift a consumer pause given with the same flags; its consumers go on within a second
    /// from their stored offsets.
    Consumer(ConsumerScope),
}

/// What a relay pause covers.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["topic", "all"])))]
pub struct RelayScope {
    /// The topic.
    #[arg(long)]
    topic: Option<String>,
    /// Every topic of the relay group.
    #[arg(long)]
    all: bool,
    /// The relay group (`postal relay --group`); without it, every relay group.
    #[arg(long)]
    group: Option<String>,
    #[command(flatten)]
    common: Common,
}

/// What a consumer pause covers.
#[derive(Args, Debug)]
pub struct ConsumerScope {
    /// The consumer group (`ConsumerConfig`'s group id).
    #[arg(long)]
    group: String,
    /// Only this topic of the group.
    #[arg(long)]
    topic: Option<String>,
    /// The group is new (it has not run yet: no stored offsets, held keys, pauses or dead
    /// letters in this database). Without it, an unknown group (a typo) is refused.
    #[arg(long)]
    new_group: bool,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct Common {
    /// Why (recorded with the pause and in the audit trail).
    #[arg(long)]
    reason: Option<String>,
    /// How long to wait for the work in flight to end (relay batches, consumer transactions).
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    wait: Duration,
}

impl RelayScope {
    fn scope(&self) -> anyhow::Result<Scope> {
        Ok(Scope::relay(self.group.as_deref(), self.topic.as_deref())?)
    }
}

impl ConsumerScope {
    fn scope(&self) -> anyhow::Result<Scope> {
        Ok(Scope::consumer(&self.group, self.topic.as_deref())?)
    }
}

pub async fn pause(pool: &PgPool, cmd: PauseCommand) -> anyhow::Result<()> {
    let (scope, common) = match &cmd {
        PauseCommand::Relay(r) => (r.scope()?, &r.common),
        PauseCommand::Consumer(c) => (c.scope()?, &c.common),
        PauseCommand::List { json: as_json } => return list(pool, *as_json).await,
    };
    if let PauseCommand::Consumer(c) = &cmd {
        crate::known::group(pool, &c.group, Some(c.new_group)).await?;
    }
    let by = crate::audit::operator();
    let mut tx = pool.begin().await?;
    let new = pauses::pause(&mut tx, &by, &scope, common.reason.as_deref(), common.wait).await?;
    tx.commit().await?;
    let what = shown(&scope.describe(), false).into_owned();
    say!("{} {what}", if new { "paused" } else { "already paused:" });
    if scope.side() == Side::Relay {
        match pauses::wait_for_relay_claims(pool, &scope, common.wait).await {
            Ok(_) => say!("the batches claimed before the pause have finished: nothing of it is published until `postal resume`"),
            Err(e) => anyhow::bail!("the pause is in force, but batches claimed before it may still be published: {e}"),
        }
    } else {
        say!(
            "the transactions in flight have ended: nothing of it is applied until `postal resume`"
        );
    }
    Ok(())
}

pub async fn resume(pool: &PgPool, cmd: ResumeCommand) -> anyhow::Result<()> {
    let scope = match &cmd {
        ResumeCommand::Relay(r) => r.scope()?,
        ResumeCommand::Consumer(c) => {
            crate::known::group(pool, &c.group, Some(c.new_group)).await?;
            c.scope()?
        }
    };
    let by = crate::audit::operator();
    let mut tx = pool.begin().await?;
    let lifted = pauses::resume(&mut tx, &by, &scope).await?;
    tx.commit().await?;
    let what = shown(&scope.describe(), false).into_owned();
    if lifted {
        say!("resumed {what}");
    } else {
        say!("not paused: {what}");
    }
    for p in pauses::covering(pool, &scope).await? {
        say!(
            "still paused by: {} (since {}, by {})",
            shown(&describe(&p), false),
            p.paused_at.format("%Y-%m-%d %H:%M:%S"),
            shown(&p.paused_by, false)
        );
    }
    Ok(())
}

fn describe(p: &pauses::Pause) -> String {
    let scope = match p.side.as_str() {
        "relay" => Scope::relay(p.group_name.as_deref(), p.topic.as_deref()),
        _ => Scope::consumer(
            p.group_name.as_deref().unwrap_or_default(),
            p.topic.as_deref(),
        ),
    };
    scope.map(|s| s.describe()).unwrap_or_default()
}

async fn list(pool: &PgPool, as_json: bool) -> anyhow::Result<()> {
    let all = pauses::list(pool).await?;
    if as_json {
        say!("{}", json(&all, true)?);
        return Ok(());
    }
    say!(
        "{:<9} {:<16} {:<24} {:<20} {:<16} REASON",
        "SIDE",
        "GROUP",
        "TOPIC",
        "SINCE (UTC)",
        "BY"
    );
    for p in &all {
        say!(
            "{:<9} {:<16} {:<24} {:<20} {:<16} {}",
            p.side,
            shown(p.group_name.as_deref().unwrap_or("(every)"), false),
            shown(p.topic.as_deref().unwrap_or("(every)"), false),
            p.paused_at.format("%Y-%m-%d %H:%M:%S"),
            shown(&p.paused_by, false),
            shown(p.reason.as_deref().unwrap_or("-"), false)
        );
    }
    if all.is_empty() {
        say!("(nothing paused)");
    }
    Ok(())
}
