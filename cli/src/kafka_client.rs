//! The Kafka clients one-shot commands make (`status` for lag, `consumer reset`,
//! `dead-letters replay`) take the same librdkafka properties as the relay: `--kafka`,
//! `--kafka-file` (`POSTAL_KAFKA`, `POSTAL_KAFKA_FILE`), set once at start.

use std::collections::BTreeMap;
use std::sync::OnceLock;

static PROPERTIES: OnceLock<BTreeMap<String, String>> = OnceLock::new();

/// Sets the properties every client of this process gets (the first call wins).
pub fn set(properties: BTreeMap<String, String>) {
    let _ = PROPERTIES.set(properties);
}

/// A client configuration for `bootstrap` with the command's properties (TLS, SASL, …).
pub fn config(bootstrap: &str) -> rdkafka::ClientConfig {
    let mut cfg = rdkafka::ClientConfig::new();
    cfg.set("bootstrap.servers", bootstrap);
    for (k, v) in PROPERTIES.get().into_iter().flatten() {
        cfg.set(k, v);
    }
    cfg
}

/// A producer configuration for `bootstrap` to replay dead letters: the relay's (the one every
/// Postal producer is made from, `postal_shared::kafka_producer`) with the command's
/// properties, taking records as large as the topic does
/// (`postal_shared::kafka_producer::replay_config`).
pub fn producer_config(bootstrap: &str) -> anyhow::Result<rdkafka::ClientConfig> {
    Ok(postal_shared::kafka_producer::replay_config(
        bootstrap,
        PROPERTIES.get().into_iter().flatten(),
    )?)
}

/// A client context that logs nothing and keeps the most telling error librdkafka reported
/// (an authentication or TLS failure rather than "all brokers down"), for the command's one
/// line.
#[derive(Default)]
pub struct Capture {
    last: std::sync::Mutex<Option<String>>,
}

impl rdkafka::ClientContext for Capture {
    fn log(&self, _level: rdkafka::config::RDKafkaLogLevel, _fac: &str, _log_message: &str) {}

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        use rdkafka::types::RDKafkaErrorCode as C;
        let mut last = self.last.lock().expect("error slot");
        let generic = matches!(
            error.rdkafka_error_code(),
            Some(C::AllBrokersDown | C::BrokerTransportFailure)
        );
        if last.is_none() || !generic {
            *last = Some(reason.to_owned());
        }
    }
}

impl rdkafka::consumer::ConsumerContext for Capture {}

/// A consumer of a one-shot command.
pub type Consumer = rdkafka::consumer::BaseConsumer<Capture>;

/// The error of a broker call, with the cause librdkafka reported when it has one (its error
/// events are served by polling the client).
pub fn why(client: &Consumer, bootstrap: &str, e: rdkafka::error::KafkaError) -> anyhow::Error {
    use rdkafka::consumer::Consumer as _;
    for _ in 0..5 {
        if let Some(Err(_)) | None = client.poll(std::time::Duration::from_millis(100)) {
            if client.context().last.lock().expect("error slot").is_some() {
                break;
            }
        }
    }
    match client.context().last.lock().expect("error slot").clone() {
        Some(cause) => anyhow::anyhow!(
            "cannot reach the broker at {bootstrap}: {cause}; check KAFKA_BOOTSTRAP_SERVERS and the properties of --kafka-file (POSTAL_KAFKA_FILE)"
        ),
        None => anyhow::anyhow!("cannot reach the broker at {bootstrap}: {e}"),
    }
}
