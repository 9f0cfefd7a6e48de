//! `postal audit`: the audit trail of operator actions (the CLI's and the dashboard's) — list,
//! show; and who the CLI records as acting.

use clap::Subcommand;
use postal_admin::audit::{self, Operator};
use sqlx::PgPool;

use crate::out::say;
use crate::shown::{json, shown};

/// The audit trail in `postal.operator_audit`.
#[derive(Subcommand, Debug)]
pub enum AuditCommand {
    /// List recorded actions, newest first: when, who (OS or dashboard user, via, database
    /// role), what, on what, how many matched and were affected.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show one recorded action; for a discard, the discarded events whole, one JSON line each
    /// (read one at a time).
    #[command(group(clap::ArgGroup::new("which").required(true).args(["id", "id_flag"])))]
    Show {
        /// The entry's id (first column of `list`; or `--id`).
        id: Option<i64>,
        /// The entry's id.
        #[arg(long = "id", value_name = "ID", conflicts_with = "id")]
        id_flag: Option<i64>,
    },
}

/// The operator the CLI's actions are recorded as: the OS user running it (the database role
/// is recorded beside it by the database).
pub fn operator() -> Operator {
    let uid = nix::unistd::getuid();
    let name = match nix::unistd::User::from_uid(uid) {
        Ok(Some(user)) => user.name,
        _ => format!("uid {uid}"),
    };
    Operator::cli(name)
}

pub async fn run(pool: &PgPool, cmd: AuditCommand) -> anyhow::Result<()> {
    match cmd {
        AuditCommand::List { limit, json: true } => {
            say!("{}", json(&audit::latest(pool, limit).await?, true)?);
        }
        AuditCommand::List { limit, json: false } => {
            let entries = audit::latest(pool, limit).await?;
            say!(
                "{:>6}  {:<20} {:<16} {:<9} {:<14} {:<11} {:>7} {:>8}  ON",
                "ID",
                "WHEN (UTC)",
                "WHO",
                "VIA",
                "ROLE",
                "ACTION",
                "MATCHED",
                "AFFECTED"
            );
            for e in &entries {
                say!(
                    "{:>6}  {:<20} {:<16} {:<9} {:<14} {:<11} {:>7} {:>8}  {}",
                    e.id,
                    e.at.format("%Y-%m-%d %H:%M:%S"),
                    shown(&e.actor, false),
                    shown(e.via.as_deref().unwrap_or("-"), false),
                    shown(e.db_role.as_deref().unwrap_or("-"), false),
                    shown(&e.action, false),
                    e.matched.map_or_else(|| "-".into(), |m| m.to_string()),
                    e.affected,
                    shown(
                        &postal_shared::text::bounded(&e.target.to_string(), 400),
                        false
                    )
                );
            }
            if entries.is_empty() {
                say!("(no actions yet)");
            }
        }
        AuditCommand::Show { id, id_flag } => {
            let id = id.or(id_flag).expect("clap requires one");
            let Some((entry, removed)) = audit::get(pool, id).await? else {
                anyhow::bail!("no audit entry {id}");
            };
            say!("{}", json(&entry, false)?);
            for event in removed
                .as_ref()
                .and_then(|r| r.as_array())
                .into_iter()
                .flatten()
            {
                say!("{}", json(event, false)?);
            }
            for seq in audit::removed_seqs(pool, id).await? {
                if let Some(event) = audit::removed_event(pool, id, seq).await? {
                    let line = json(&event, false)?;
                    drop(event);
                    say!("{line}");
                }
            }
        }
    }
    Ok(())
}
