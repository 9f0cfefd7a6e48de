//! Log set-up for Postal's binaries (feature `logging`): one vocabulary for every process.
//!
//! - `POSTAL_LOG` (else `RUST_LOG`) filters, in `tracing`'s `EnvFilter` syntax; else the
//!   binary's default.
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

/// Installs the global `tracing` subscriber, writing to standard error (see the module docs).
/// An invalid `POSTAL_LOG_FORMAT` is an error; nothing is installed then.
pub fn init_logging(default_filter: &str) -> Result<(), Error> {
    let format = match std::env::var("POSTAL_LOG_FORMAT") {
        Ok(v) => LogFormat::parse(&v)?,
        Err(_) => LogFormat::Text,
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("POSTAL_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().init(),
    }
    Ok(())
}
