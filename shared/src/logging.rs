//! Log set-up for Postal's binaries (feature `logging`): one vocabulary for every process.
//!
//! - `POSTAL_LOG` (else `RUST_LOG`) filters, in `tracing`'s `EnvFilter` syntax; else the
//!   binary's default, with `sqlx=warn,lapin=off` added for a crate it does not name (sqlx
//!   logs each notice, "relation ... already exists, skipping", at INFO; lapin logs what the
//!   relay reports itself): `init_logging("info")` is `info,sqlx=warn,lapin=off`.
//! - `POSTAL_LOG_FORMAT`: `text` (default) or `json` (one JSON object per line, for log
//!   shippers).
//! - Colours only when standard error is a terminal: a log file or a pipe gets plain text.

use std::io::IsTerminal;

use crate::Error;

/// The log format `POSTAL_LOG_FORMAT` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    /// Parses `text` or `json`.
    pub fn parse(s: &str) -> Result<Self, Error> {
        match s.trim() {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(Error::Invalid {
                what: "POSTAL_LOG_FORMAT",
                reason: format!("{other:?} is not `text` or `json`"),
            }),
        }
    }
}

/// Directives added to a binary's default filter for the crates it does not name.
const QUIETED: [(&str, &str); 2] = [("sqlx", "warn"), ("lapin", "off")];

/// `default_filter` with [`QUIETED`]'s directives for the crates it does not name.
fn default_directives(default_filter: &str) -> String {
    let mut filter = default_filter.trim().to_owned();
    for (krate, level) in QUIETED {
        let named = filter.split(',').any(|d| {
            let target = d.trim().split(['=', '[']).next().unwrap_or_default();
            target == krate || target.starts_with(&format!("{krate}::"))
        });
        if !named {
            if !filter.is_empty() {
                filter.push(',');
            }
            filter.push_str(&format!("{krate}={level}"));
        }
    }
    filter
}

/// Installs the global `tracing` subscriber, writing to standard error (see the module docs:
/// `default_filter`, used when neither `POSTAL_LOG` nor `RUST_LOG` is set, gets
/// `sqlx=warn,lapin=off` unless it names those crates). An invalid `POSTAL_LOG_FORMAT` is an
/// error; nothing is installed then.
pub fn init_logging(default_filter: &str) -> Result<(), Error> {
    let format = match std::env::var("POSTAL_LOG_FORMAT") {
        Ok(v) => LogFormat::parse(&v)?,
        Err(_) => LogFormat::Text,
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("POSTAL_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_directives(default_filter)));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().init(),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: `init_logging("info")` filters as the docs say, `info,sqlx=warn,lapin=off`:
    /// sqlx's INFO notices ("relation ... already exists, skipping") are not printed, its
    /// warnings are, and a default that names sqlx keeps its own level. (Failed before: the
    /// default filter was used as given, so sqlx logged at INFO.)
    #[test]
    fn the_default_filter_quiets_sqlx_notices() {
        assert_eq!(default_directives("info"), "info,sqlx=warn,lapin=off");
        assert_eq!(
            default_directives("debug,sqlx=info"),
            "debug,sqlx=info,lapin=off"
        );
        assert_eq!(
            default_directives("info,sqlx=warn,lapin=off"),
            "info,sqlx=warn,lapin=off"
        );
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(default_directives(
                "info",
            )))
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(target: "sqlx::postgres::notice", "relation \"ledger\" already exists, skipping");
            tracing::warn!(target: "sqlx::query", "slow statement");
            tracing::info!(target: "app", "consumer started");
        });
        let logged = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(!logged.contains("already exists"), "{logged}");
        assert!(logged.contains("slow statement"), "{logged}");
        assert!(logged.contains("consumer started"), "{logged}");
    }
}
