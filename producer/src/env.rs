//! Relay and Kafka settings from environment variables: the names and value forms `postal
//! relay` reads (it uses these loaders), so a service embedding the relay reads the same
//! configuration as the CLI. See `postal_shared::env` for the shared vocabulary.

use postal_shared::env;

use crate::config::{RelayConfig, TopicFilter};
use crate::kafka::KafkaConfig;
use crate::Error;

fn config(e: String) -> Error {
    Error::Config(e)
}

impl RelayConfig {
    /// Overrides settings from the process environment (see [`RelayConfig::with_vars`]), and
    /// warns once of `POSTAL_*` variables Postal does not read.
    pub fn with_env(self) -> Result<Self, Error> {
        env::warn_unknown();
        self.with_vars(|name| std::env::var(name).ok())
    }

    /// Overrides settings from variables looked up by `var`; unset variables keep the current
    /// value, an invalid one is a one-line error naming it. Durations are written `500ms`,
    /// `20s`, `7d`; `off` means keep forever; booleans `true`/`false`. The result is validated.
    ///
    /// | variable | setting |
    /// |---|---|
    /// | `POSTAL_BATCH_SIZE` | [`batch_size`](Self::batch_size) |
    /// | `POSTAL_MAX_IN_FLIGHT` | [`max_in_flight_batches`](Self::max_in_flight_batches) |
    /// | `POSTAL_LANES` | [`lanes`](Self::lanes) |
    /// | `POSTAL_LEASE` | [`lease`](Self::lease) |
    /// | `POSTAL_POLL_INTERVAL` | [`poll_interval`](Self::poll_interval) |
    /// | `POSTAL_NO_LISTEN` | `true`: [`listen`](Self::listen) off |
    /// | `POSTAL_MAX_ATTEMPTS` | [`max_attempts`](Self::max_attempts) |
    /// | `POSTAL_BACKOFF_BASE`, `POSTAL_BACKOFF_MAX` | [`backoff`](Self::backoff) |
    /// | `POSTAL_KEEP_PUBLISHED` | `true`: keep published rows ([`delete_on_publish`](Self::delete_on_publish) off) |
    /// | `POSTAL_RETENTION` | [`retention`](Self::retention) (with `POSTAL_KEEP_PUBLISHED`) |
    /// | `POSTAL_HISTORY` | [`history`](Self::history) |
    /// | `POSTAL_SHUTDOWN_TIMEOUT` | [`shutdown_timeout`](Self::shutdown_timeout) |
    /// | `POSTAL_GROUP` | [`group`](Self::group) |
    /// | `POSTAL_TOPICS`, `POSTAL_EXCLUDE_TOPICS` | [`topics`](Self::topics) (comma-separated) |
    /// | `POSTAL_READ_FROM` | `poll` or `wal`: [`source`](Self::source); `wal` reads slot `POSTAL_WAL_SLOT` (default `postal_relay`) with publication `POSTAL_WAL_PUBLICATION` (default `postal_outbox`) over `DATABASE_URL` |
    pub fn with_vars(mut self, var: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        env::refuse_renamed(&var).map_err(config)?;
        if let Some(v) = var("POSTAL_BATCH_SIZE") {
            self.batch_size = env::number("POSTAL_BATCH_SIZE", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_MAX_IN_FLIGHT") {
            self.max_in_flight_batches = env::number("POSTAL_MAX_IN_FLIGHT", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_LANES") {
            self.lanes = env::number("POSTAL_LANES", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_LEASE") {
            self.lease = env::duration("POSTAL_LEASE", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_POLL_INTERVAL") {
            self.poll_interval = env::duration("POSTAL_POLL_INTERVAL", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_NO_LISTEN") {
            self.listen = !env::boolean("POSTAL_NO_LISTEN", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_MAX_ATTEMPTS") {
            self.max_attempts = env::number("POSTAL_MAX_ATTEMPTS", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_BACKOFF_BASE") {
            self.backoff.base = env::duration("POSTAL_BACKOFF_BASE", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_BACKOFF_MAX") {
            self.backoff.max = env::duration("POSTAL_BACKOFF_MAX", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_KEEP_PUBLISHED") {
            self.delete_on_publish = !env::boolean("POSTAL_KEEP_PUBLISHED", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_RETENTION") {
            self.retention = env::optional_duration("POSTAL_RETENTION", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_HISTORY") {
            self.history = env::optional_duration("POSTAL_HISTORY", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_SHUTDOWN_TIMEOUT") {
            self.shutdown_timeout = env::duration("POSTAL_SHUTDOWN_TIMEOUT", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_GROUP") {
            self.group = v.trim().to_owned();
        }
        let only = var("POSTAL_TOPICS").map(|v| env::list(&v));
        let except = var("POSTAL_EXCLUDE_TOPICS").map(|v| env::list(&v));
        match (only, except) {
            (Some(o), Some(e)) if !o.is_empty() && !e.is_empty() => {
                return Err(config(
                    "POSTAL_TOPICS and POSTAL_EXCLUDE_TOPICS are both set: a relay claims either only some topics or all but some".into(),
                ))
            }
            (Some(o), _) if !o.is_empty() => self.topics = TopicFilter::Only(o),
            (_, Some(e)) if !e.is_empty() => self.topics = TopicFilter::Except(e),
            _ => {}
        }
        if let Some(v) = var("POSTAL_READ_FROM") {
            self.source = match v.trim() {
                "poll" => crate::config::RelaySource::Poll,
                "wal" => {
                    let url = var("DATABASE_URL").ok_or_else(|| {
                        config("POSTAL_READ_FROM=wal reads the slot over DATABASE_URL, which is not set".into())
                    })?;
                    let slot = var("POSTAL_WAL_SLOT").unwrap_or_else(|| "postal_relay".into());
                    let publication =
                        var("POSTAL_WAL_PUBLICATION").unwrap_or_else(|| "postal_outbox".into());
                    crate::config::RelaySource::Wal(crate::wal::WalSource::new(
                        url,
                        slot.trim(),
                        publication.trim(),
                    ))
                }
                _ => return Err(config("POSTAL_READ_FROM must be poll or wal".into())),
            };
        }
        self.validate()?;
        Ok(self)
    }
}

impl KafkaConfig {
    /// Overrides settings from the process environment (see [`KafkaConfig::with_vars`]).
    pub fn with_env(self) -> Result<Self, Error> {
        self.with_vars(|name| std::env::var(name).ok())
    }

    /// Overrides settings from variables looked up by `var` (unset ones keep the current
    /// value; an invalid one is a one-line error naming it):
    ///
    /// | variable | setting |
    /// |---|---|
    /// | `KAFKA_BOOTSTRAP_SERVERS` | [`bootstrap_servers`](Self::bootstrap_servers) |
    /// | `POSTAL_KAFKA_FILE` | librdkafka properties from a file, one `key=value` per line: the place for credentials |
    /// | `POSTAL_KAFKA` | librdkafka properties, `key=value` comma-separated; they override the file's |
    /// | `POSTAL_SOURCE` | [`source`](Self::source) |
    /// | `POSTAL_NO_CREATE_TOPICS` | `true`: [`create_topics`](Self::create_topics) off |
    /// | `POSTAL_TOPIC_PARTITIONS`, `POSTAL_TOPIC_REPLICATION` | partitions and replication factor of created topics |
    /// | `POSTAL_ALLOW_TOPICS` | [`allowed_topics`](Self::allowed_topics) (comma-separated names or `prefix*`) |
    pub fn with_vars(mut self, var: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        if let Some(v) = var("KAFKA_BOOTSTRAP_SERVERS") {
            self.bootstrap_servers = v.trim().to_owned();
        }
        if let Some(path) = var("POSTAL_KAFKA_FILE") {
            let props = postal_shared::secret::read_properties_file(path.as_ref())
                .map_err(|e| config(format!("POSTAL_KAFKA_FILE: {e}")))?;
            self.properties.extend(props);
        }
        if let Some(v) = var("POSTAL_KAFKA") {
            let props = postal_shared::secret::parse_properties(&v)
                .map_err(|e| config(format!("POSTAL_KAFKA: {e}")))?;
            self.properties.extend(props);
        }
        if let Some(v) = var("POSTAL_SOURCE") {
            self.source = v.trim().to_owned();
        }
        if let Some(v) = var("POSTAL_NO_CREATE_TOPICS") {
            self.create_topics = !env::boolean("POSTAL_NO_CREATE_TOPICS", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_TOPIC_PARTITIONS") {
            self.topic_partitions = env::number("POSTAL_TOPIC_PARTITIONS", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_TOPIC_REPLICATION") {
            self.topic_replication = env::number("POSTAL_TOPIC_REPLICATION", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_ALLOW_TOPICS") {
            let patterns = env::list(&v);
            if !patterns.is_empty() {
                self.allowed_topics = crate::TopicAllowList::only(patterns)?;
            }
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |n: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        }
    }

    /// Guarantee: the relay's variables set the library's settings (the CLI reads the same),
    /// in the shared forms, and a bad or renamed one is a one-line error naming it.
    #[test]
    fn relay_settings_from_variables() {
        let c = RelayConfig::default()
            .with_vars(vars(&[
                ("POSTAL_LEASE", "30s"),
                ("POSTAL_POLL_INTERVAL", "250ms"),
                ("POSTAL_NO_LISTEN", "true"),
                ("POSTAL_KEEP_PUBLISHED", "true"),
                ("POSTAL_RETENTION", "7d"),
                ("POSTAL_TOPICS", "orders, payments"),
                ("POSTAL_GROUP", "billing"),
                ("POSTAL_LANES", "2"),
            ]))
            .unwrap();
        assert_eq!(c.lease, Duration::from_secs(30));
        assert_eq!(c.poll_interval, Duration::from_millis(250));
        assert!(!c.listen && !c.delete_on_publish);
        assert_eq!(c.retention, Some(Duration::from_secs(7 * 86_400)));
        assert!(matches!(&c.topics, TopicFilter::Only(t) if t == &["orders", "payments"]));
        assert_eq!((c.group.as_str(), c.lanes), ("billing", 2));
        let err = RelayConfig::default()
            .with_vars(vars(&[("POSTAL_LEASE", "60")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("POSTAL_LEASE=\"60\" is not valid"), "{err}");
        let err = RelayConfig::default()
            .with_vars(vars(&[("POSTAL_LEASE_SECS", "60")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("set POSTAL_LEASE instead"), "{err}");
        // Retention without keeping published rows would do nothing: refused.
        let err = RelayConfig::default()
            .with_vars(vars(&[("POSTAL_RETENTION", "7d")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("POSTAL_KEEP_PUBLISHED"), "{err}");
        let k = KafkaConfig::new("x:9092")
            .with_vars(vars(&[
                ("KAFKA_BOOTSTRAP_SERVERS", "k1:9092"),
                ("POSTAL_KAFKA", "linger.ms=5,sasl.password=a,b"),
                ("POSTAL_NO_CREATE_TOPICS", "1"),
                ("POSTAL_TOPIC_PARTITIONS", "6"),
            ]))
            .unwrap();
        assert_eq!(k.bootstrap_servers, "k1:9092");
        assert_eq!(k.properties["sasl.password"], "a,b");
        assert!(!k.create_topics);
        assert_eq!(k.topic_partitions, 6);
    }
}
