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
    /// role), what, on what, how many matched and were affected, and how it ended (`done`,
    /// `failed` with its error, or `-` while running or when its process died).
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
        #[arg(value_parser = crate::ids::audit_entry)]
        id: Option<i64>,
        /// The entry's id.
        #[arg(long = "id", value_name = "ID", conflicts_with = "id", value_parser = crate::ids::audit_entry)]
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
                "{:>6}  {:<20} {:<16} {:<9} {:<14} {:<11} {:>7} {:>8} {:<7} ON",
                "ID",
                "WHEN (UTC)",
                "WHO",
                "VIA",
                "ROLE",
                "ACTION",
                "MATCHED",
                "AFFECTED",
                "OUTCOME"
            );
            for e in &entries {
                let error = e
                    .error
                    .as_deref()
                    .map_or_else(String::new, |err| format!("  error: {}", shown(err, false)));
                say!(
                    "{:>6}  {:<20} {:<16} {:<9} {:<14} {:<11} {:>7} {:>8} {:<7} {}{error}",
                    e.id,
                    e.at.format("%Y-%m-%d %H:%M:%S"),
                    shown(&e.actor, false),
                    shown(e.via.as_deref().unwrap_or("-"), false),
                    shown(e.db_role.as_deref().unwrap_or("-"), false),
                    shown(&e.action, false),
                    e.matched.map_or_else(|| "-".into(), |m| m.to_string()),
                    e.affected,
                    e.outcome(),
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
                print_kept(pool, id, seq).await?;
            }
        }
    }
    Ok(())
}

/// How many payload bytes `audit show` reads at a time: a multiple of 3, so that pieces in
/// base64 join.
const PIECE: i32 = 3 << 20;

/// How many bytes of text are escaped at a time (about: up to a character boundary).
const ESCAPED: usize = 64 << 10;

/// Prints the event `seq` a discard `id` kept as one JSON line, its payload read and written
/// in pieces of [`PIECE`] bytes (an event can be hundreds of MiB): as text when it is UTF-8
/// without NUL (the database tells), else in base64 — the line a whole read printed.
async fn print_kept(pool: &PgPool, id: i64, seq: i64) -> anyhow::Result<()> {
    use postal_admin::kept_events;
    use std::io::Write as _;
    let Some((event, size)) = kept_events::head(pool, id, seq).await? else {
        return Ok(());
    };
    let text = kept_events::payload_is_text(pool, id, seq).await?;
    let head = json(&event, false)?;
    let head = head
        .strip_suffix('}')
        .ok_or_else(|| anyhow::anyhow!("an event printed as JSON ends with }}"))?;
    let field = if text { "payload" } else { "payload_base64" };
    write!(std::io::stdout().lock(), "{head},\"{field}\":\"")?;
    // A character cut at a piece's end, carried to the next.
    let mut carry: Vec<u8> = Vec::new();
    let mut from = 0i64;
    while from < size {
        if !text {
            let piece = kept_events::piece_base64(pool, id, seq, from, PIECE).await?;
            if piece.is_empty() {
                break;
            }
            write!(std::io::stdout().lock(), "{piece}")?;
            from += i64::from(PIECE);
            continue;
        }
        let piece = kept_events::piece(pool, id, seq, from, PIECE).await?;
        if piece.is_empty() {
            break;
        }
        from += piece.len() as i64;
        let buf = if carry.is_empty() {
            piece
        } else {
            carry.extend_from_slice(&piece);
            std::mem::take(&mut carry)
        };
        let valid = match std::str::from_utf8(&buf) {
            Ok(_) => buf.len(),
            Err(e) => e.valid_up_to(),
        };
        let part = std::str::from_utf8(&buf[..valid]).expect("checked above");
        write_escaped(part)?;
        carry = buf[valid..].to_vec();
    }
    say!("\"}}");
    Ok(())
}

/// Writes `text` as the inside of a JSON string escaped for a terminal (as [`json`] escapes a
/// whole line), a few KiB at a time.
fn write_escaped(mut text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    while !text.is_empty() {
        let mut cut = text.len().min(ESCAPED);
        while !text.is_char_boundary(cut) {
            cut += 1;
        }
        let quoted = serde_json::to_string(&text[..cut])?;
        let inner = &quoted[1..quoted.len() - 1];
        out.write_all(postal_shared::text::json_escaped(inner).as_bytes())?;
        text = &text[cut..];
    }
    Ok(())
}
