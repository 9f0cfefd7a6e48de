//! The configuration vocabulary every Postal binary and library loader shares: the environment
//! variables Postal reads, how their values are written (durations as `500ms`, `20s`, `7d`;
//! `off` where "never" or "keep forever" is meant; booleans `true`/`false`), and the one-line
//! errors naming the variable.
//!
//! [`VARIABLES`] lists every variable a user sets; README's configuration table is checked
//! against it. [`warn_unknown`] logs the `POSTAL_*` variables of the environment Postal does not
//! read (a typo, or a name from an older release), once each.

use std::time::Duration;

/// Who reads a variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reader {
    /// `postal relay` and `RelayConfig::with_env` / `KafkaConfig::with_env`.
    Relay,
    /// `ConsumerConfig::with_env`.
    Consumer,
    /// Both.
    Both,
    /// Every `postal` command.
    Cli,
    /// `postal dashboard`.
    Dashboard,
}

/// One variable: its name, who reads it, its default (as written), what it sets.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Variable {
    /// The name.
    pub name: &'static str,
    /// Who reads it.
    pub reader: Reader,
    /// The default, as written (`-` when there is none).
    pub default: &'static str,
}

const fn var(name: &'static str, reader: Reader, default: &'static str) -> Variable {
    Variable {
        name,
        reader,
        default,
    }
}

/// Every variable Postal's binaries and loaders read (README's configuration table lists each).
pub const VARIABLES: &[Variable] = &[
    var("DATABASE_URL", Reader::Cli, "-"),
    var("KAFKA_BOOTSTRAP_SERVERS", Reader::Both, "-"),
    var("AMQP_URL", Reader::Relay, "-"),
    var("POSTAL_CONNECT_TIMEOUT", Reader::Cli, "5s"),
    var("POSTAL_LOG", Reader::Both, "info"),
    var("POSTAL_LOG_FORMAT", Reader::Both, "text"),
    var("POSTAL_METRICS_ADDR", Reader::Both, "off"),
    var("POSTAL_KAFKA", Reader::Both, "-"),
    var("POSTAL_KAFKA_FILE", Reader::Both, "-"),
    var("POSTAL_MAX_ATTEMPTS", Reader::Both, "10"),
    var(
        "POSTAL_BACKOFF_BASE",
        Reader::Both,
        "500ms (consumer: 100ms)",
    ),
    var("POSTAL_BACKOFF_MAX", Reader::Both, "5m (consumer: 30s)"),
    var(
        "POSTAL_SHUTDOWN_TIMEOUT",
        Reader::Both,
        "20s (consumer: 10s)",
    ),
    var("POSTAL_GROUP", Reader::Relay, "default"),
    var("POSTAL_TOPICS", Reader::Relay, "all"),
    var("POSTAL_EXCLUDE_TOPICS", Reader::Relay, "-"),
    var("POSTAL_BATCH_SIZE", Reader::Relay, "2000"),
    var("POSTAL_MAX_IN_FLIGHT", Reader::Relay, "4"),
    var("POSTAL_LANES", Reader::Relay, "4"),
    var("POSTAL_LEASE", Reader::Relay, "60s"),
    var("POSTAL_POLL_INTERVAL", Reader::Relay, "1s"),
    var("POSTAL_NO_LISTEN", Reader::Relay, "false"),
    var("POSTAL_KEEP_PUBLISHED", Reader::Relay, "false"),
    var("POSTAL_RETENTION", Reader::Relay, "off"),
    var("POSTAL_HISTORY", Reader::Relay, "off"),
    var("POSTAL_MIGRATE", Reader::Relay, "false"),
    var("POSTAL_READ_FROM", Reader::Relay, "poll"),
    var("POSTAL_WAL_SLOT", Reader::Relay, "postal_relay"),
    var("POSTAL_WAL_PUBLICATION", Reader::Relay, "postal_outbox"),
    var("POSTAL_SOURCE", Reader::Relay, "postal"),
    var("POSTAL_NO_CREATE_TOPICS", Reader::Relay, "false"),
    var("POSTAL_ALLOW_TOPICS", Reader::Relay, "all but *.dlq"),
    var("POSTAL_TOPIC_PARTITIONS", Reader::Relay, "12"),
    var("POSTAL_TOPIC_REPLICATION", Reader::Relay, "-1"),
    var("POSTAL_DESTINATION", Reader::Relay, "kafka"),
    var("POSTAL_ROUTE", Reader::Relay, "-"),
    var("POSTAL_RABBITMQ_ROUTING_KEY", Reader::Relay, "-"),
    var("POSTAL_RABBITMQ_NO_DECLARE", Reader::Relay, "false"),
    var("POSTAL_RABBITMQ_CONFIRM_TIMEOUT", Reader::Relay, "20s"),
    var("POSTAL_RABBITMQ_CONNECT_TIMEOUT", Reader::Relay, "10s"),
    var(
        "POSTAL_RABBITMQ_MAX_MESSAGE_BYTES",
        Reader::Relay,
        "16777216",
    ),
    var("POSTAL_CONSUMER_GROUP", Reader::Consumer, "-"),
    var("POSTAL_MAX_BATCH", Reader::Consumer, "1"),
    var("POSTAL_MAX_CONCURRENT_PARTITIONS", Reader::Consumer, "8"),
    var("POSTAL_MEMORY_BUDGET_BYTES", Reader::Consumer, "off"),
    var("POSTAL_DEDUP_RETENTION", Reader::Consumer, "7d"),
    var("POSTAL_DEAD_LETTER_RETENTION", Reader::Consumer, "off"),
    var("POSTAL_CLEANUP_INTERVAL", Reader::Consumer, "60s"),
    var("POSTAL_LOST_CONNECTION_TIMEOUT", Reader::Consumer, "30s"),
    var("POSTAL_FINAL_FAILURE", Reader::Consumer, "dead-letter"),
    var(
        "POSTAL_DASHBOARD_LISTEN",
        Reader::Dashboard,
        "127.0.0.1:9470",
    ),
    var("POSTAL_DASHBOARD_TOKEN", Reader::Dashboard, "-"),
    var("POSTAL_DASHBOARD_ALLOW_ACTIONS", Reader::Dashboard, "false"),
    var("POSTAL_DASHBOARD_ACTION_CAP", Reader::Dashboard, "1000"),
];

/// Names earlier releases read, and the variable that replaced each.
pub const RENAMED: &[(&str, &str)] = &[
    ("POSTAL_SHUTDOWN_TIMEOUT_MS", "POSTAL_SHUTDOWN_TIMEOUT"),
    ("POSTAL_DEDUP_RETENTION_SECS", "POSTAL_DEDUP_RETENTION"),
    ("POSTAL_CLEANUP_INTERVAL_SECS", "POSTAL_CLEANUP_INTERVAL"),
    ("POSTAL_LEASE_SECS", "POSTAL_LEASE"),
];

/// Prefixes of the variables of Postal's development scripts and test suite (not warned about).
const DEVELOPER_PREFIXES: &[&str] = &[
    "POSTAL_TEST_",
    "POSTAL_STACK_",
    "POSTAL_KAFKA_PORT",
    "POSTAL_KAFKA_CONTROLLER_PORT",
    "POSTAL_KAFKA_CLUSTER_PORT",
    "POSTAL_KAFKA_SECURE_PORT",
    "POSTAL_KAFKA_HEAP",
    "POSTAL_KAFKA_LIB",
    "POSTAL_KAFKA_VERSION",
    "POSTAL_KAFKA_DEBUG",
    "POSTAL_PG_",
    "POSTAL_AMQP_PORT",
    "POSTAL_RABBITMQ_BIN",
    "POSTAL_DEBIAN_MIRROR",
    "POSTAL_CHAOS_",
    "POSTAL_CLUSTER_",
    "POSTAL_NETSPLIT_",
    "POSTAL_CHILD_",
    "POSTAL_FENCE_CHILD_",
    "POSTAL_PROTOCOL_",
    "POSTAL_RELAY_RANDOM_",
    "POSTAL_RABBIT_RANDOM_",
    "POSTAL_REQUIRE_",
    "POSTAL_PREVIOUS_BIN",
    "POSTAL_PROMTOOL",
    "POSTAL_BIN_DIR",
    "POSTAL_EXPECT_MODE",
    "POSTAL_SKIP_TESTCONTAINERS",
    "POSTAL_NO_RABBITMQ",
    "POSTAL_PGBOUNCER_",
    "POSTAL_NO_PGBOUNCER",
    "POSTAL_INTEROP_",
    "POSTAL_SCREENSHOTS",
    "POSTAL_BENCH_",
];

/// The error for a variable whose value is not valid: `NAME="value" is not valid: why`.
pub fn invalid(name: &str, value: &str, why: impl std::fmt::Display) -> String {
    format!("{name}={value:?} is not valid: {why}")
}

/// A duration: `500ms`, `20s`, `5m`, `7d` (humantime's forms).
pub fn duration(name: &str, value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value.trim()).map_err(|e| {
        invalid(
            name,
            value,
            format!("{e} (write a duration such as 500ms, 20s, 7d)"),
        )
    })
}

/// A duration, or `off` (also `0s`) for none: "never" or "keep forever".
pub fn optional_duration(name: &str, value: &str) -> Result<Option<Duration>, String> {
    if value.trim().eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let d = duration(name, value)?;
    Ok((!d.is_zero()).then_some(d))
}

/// A boolean: `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`).
pub fn boolean(name: &str, value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" | "" => Ok(false),
        _ => Err(invalid(name, value, "write true or false")),
    }
}

/// A number (or anything else `FromStr`).
pub fn number<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    value.trim().parse().map_err(|e| invalid(name, value, e))
}

/// A comma-separated list (empty items dropped).
pub fn list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Refuses a variable an earlier release read under another name, if `var` has it set: its
/// value is no longer read, and silently ignoring it would run with a default the user did not
/// choose.
pub fn refuse_renamed(var: &impl Fn(&str) -> Option<String>) -> Result<(), String> {
    for (old, new) in RENAMED {
        if var(old).is_some() {
            return Err(format!(
                "{old} is no longer read: set {new} instead (a duration such as 10s; see README's configuration table)"
            ));
        }
    }
    Ok(())
}

/// The `POSTAL_*` variable names among `names` that Postal does not read, with a hint each
/// (the renamed variable, when it is one).
pub fn unknown<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut out = Vec::new();
    for name in names {
        if !name.starts_with("POSTAL_")
            || VARIABLES.iter().any(|v| v.name == name)
            || DEVELOPER_PREFIXES.iter().any(|p| name.starts_with(p))
        {
            continue;
        }
        match RENAMED.iter().find(|(old, _)| *old == name) {
            Some((_, new)) => out.push(format!("{name} (renamed: {new})")),
            None => out.push(name.to_owned()),
        }
    }
    out.sort();
    out
}

/// Logs, once, a warning naming each `POSTAL_*` variable of this process's environment that
/// Postal does not read.
pub fn warn_unknown() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let names: Vec<String> = std::env::vars_os()
            .filter_map(|(k, _)| k.into_string().ok())
            .collect();
        let unknown = unknown(names.iter().map(String::as_str));
        if !unknown.is_empty() {
            tracing::warn!(
                variables = %unknown.join(", "),
                "environment variables Postal does not read (a typo, or a name of an older release); see README's configuration table"
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: values are written one way everywhere, and a bad one is a one-line error
    /// naming the variable.
    #[test]
    fn values_parse_one_way() {
        assert_eq!(duration("X", "500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("X", " 7d "), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(optional_duration("X", "off"), Ok(None));
        assert_eq!(optional_duration("X", "0s"), Ok(None));
        assert_eq!(
            optional_duration("X", "2m"),
            Ok(Some(Duration::from_secs(120)))
        );
        let err = duration("POSTAL_LEASE", "60").unwrap_err();
        assert!(
            err.starts_with("POSTAL_LEASE=\"60\" is not valid: "),
            "{err}"
        );
        assert!(!err.contains('\n'));
        assert_eq!(boolean("X", "true"), Ok(true));
        assert_eq!(boolean("X", "0"), Ok(false));
        assert!(boolean("X", "maybe").is_err());
        assert_eq!(number::<u32>("X", " 12 "), Ok(12));
        assert_eq!(list(" a, b,,c "), ["a", "b", "c"]);
    }

    /// Guarantee: variables of earlier releases are refused with the name that replaced them,
    /// and unknown `POSTAL_*` names are reported (developer variables are not).
    #[test]
    fn renamed_and_unknown_variables_are_named() {
        let old = |n: &str| (n == "POSTAL_SHUTDOWN_TIMEOUT_MS").then(|| "5000".to_owned());
        let err = refuse_renamed(&old).unwrap_err();
        assert!(err.contains("set POSTAL_SHUTDOWN_TIMEOUT instead"), "{err}");
        assert!(refuse_renamed(&|_: &str| None).is_ok());
        assert_eq!(
            unknown([
                "POSTAL_LEASE",
                "POSTAL_LAESE",
                "POSTAL_TEST_LOG",
                "PATH",
                "POSTAL_LEASE_SECS"
            ]),
            ["POSTAL_LAESE", "POSTAL_LEASE_SECS (renamed: POSTAL_LEASE)"]
        );
    }
}
