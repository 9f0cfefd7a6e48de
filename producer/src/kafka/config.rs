//! The Kafka transport's settings and the librdkafka configuration made of them.

use std::collections::BTreeMap;

use rdkafka::config::ClientConfig;

/// Settings of the Kafka transport.
#[derive(Clone)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// CloudEvents `source` written on every record (default `postal`).
    pub source: String,
    /// Create missing topics through the admin API (default `true`). When `false` (or when the
    /// cluster refuses), events for a missing topic wait, retried every few seconds without
    /// using up attempts, and the relay logs which topic to create.
    pub create_topics: bool,
    /// Partition count of created topics (default 12).
    pub topic_partitions: i32,
    /// Replication factor of created topics (default -1: the broker's
    /// `default.replication.factor`, so a replicated cluster's policy applies); -1 or at least 1.
    pub topic_replication: i32,
    /// Extra librdkafka properties (TLS, SASL, tuning); they override Postal's defaults.
    pub properties: BTreeMap<String, String>,
    /// The topics the relay may publish to and create (default: every topic except
    /// dead-letter topics). Events for others are parked with the reason.
    pub allowed_topics: crate::TopicAllowList,
}

postal_shared::setters!(KafkaConfig {
    bootstrap_servers: String,
    source: String,
    create_topics: bool,
    topic_partitions: i32,
    topic_replication: i32,
    properties: BTreeMap<String, String>,
    allowed_topics: crate::TopicAllowList,
});

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let props = postal_shared::secret::redacted_properties(&self.properties);
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("source", &self.source)
            .field("create_topics", &self.create_topics)
            .field("topic_partitions", &self.topic_partitions)
            .field("topic_replication", &self.topic_replication)
            .field("properties", &props)
            .field("allowed_topics", &self.allowed_topics)
            .finish()
    }
}

impl KafkaConfig {
    /// Defaults for the given bootstrap servers.
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        KafkaConfig {
            bootstrap_servers: bootstrap_servers.into(),
            source: "postal".into(),
            create_topics: true,
            topic_partitions: 12,
            topic_replication: -1,
            properties: BTreeMap::new(),
            allowed_topics: crate::TopicAllowList::any(),
        }
    }

    /// The librdkafka producer configuration: Postal's defaults, then the user's properties
    /// ([`postal_shared::kafka_producer::config`], the one every Postal producer is made from,
    /// lists the defaults and why). Unchecked here: [`KafkaTransport::new`](crate::KafkaTransport::new)
    /// refuses properties that break durability or per-key order.
    pub fn client_config(&self) -> ClientConfig {
        postal_shared::kafka_producer::config_unchecked(&self.bootstrap_servers, &self.properties)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SASL and TLS secrets given as librdkafka properties never show in `Debug` output (which
    /// is what gets logged), while the rest of the configuration does.
    #[test]
    fn debug_output_redacts_secrets() {
        let mut c = KafkaConfig::new("broker:9092");
        c.properties
            .insert("sasl.password".into(), "hunter2".into());
        c.properties
            .insert("ssl.key.password".into(), "s3cret".into());
        c.properties.insert("sasl.username".into(), "relay".into());
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(
            shown.contains("relay") && shown.contains("broker:9092"),
            "{shown}"
        );
    }

    /// Guarantee: topics the relay creates take the cluster's own replication factor unless
    /// told otherwise (`-1`, the broker's `default.replication.factor`, never a fixed 1 that a
    /// replicated cluster would not choose); an explicit factor is kept; anything else (0, -2)
    /// is refused with one line naming the setting and the value.
    #[test]
    fn created_topics_take_the_brokers_replication_unless_given() {
        assert_eq!(KafkaConfig::new("b:9092").topic_replication, -1);
        for ok in [-1, 1, 3] {
            let c = KafkaConfig::new("b:9092").topic_replication(ok);
            let t = crate::KafkaTransport::new(c).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert!(format!("{t:?}").contains(&format!("topic_replication: {ok}")));
        }
        for bad in [0, -2] {
            let c = KafkaConfig::new("b:9092").topic_replication(bad);
            let e = crate::KafkaTransport::new(c).unwrap_err().to_string();
            assert!(
                e.contains("replication factor must be -1") && e.contains(&bad.to_string()),
                "{e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
