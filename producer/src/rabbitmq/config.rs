//! The RabbitMQ transport's settings.

use std::collections::BTreeMap;
use std::time::Duration;

/// Settings of the RabbitMQ transport.
#[derive(Clone)]
#[non_exhaustive]
pub struct RabbitConfig {
    /// AMQP URI, e.g. `amqp://user:pass@127.0.0.1:5672/%2f` (`amqps://` for TLS).
    pub uri: String,
    /// CloudEvents `source` and AMQP `app-id` written on every message (default `postal`).
    pub source: String,
    /// Routing key per event type; an event type not listed is its own routing key.
    pub routing_keys: BTreeMap<String, String>,
    /// Declare each topic's exchange (durable, type `topic`) before its first publish
    /// (default `true`). When `false`, the exchange must exist: events for a missing exchange
    /// are parked with a clear error. A refused exchange (missing, other settings, access
    /// refused) is checked again after a second, so fixing the broker un-sticks new events.
    pub declare_exchanges: bool,
    /// The topics (exchanges) the relay may publish to and declare (default: every topic
    /// except dead-letter topics). Events for others are parked with the reason.
    pub allowed_topics: crate::TopicAllowList,
    /// Largest message body accepted; bigger events are parked as permanent failures instead of
    /// being sent (RabbitMQ closes the channel on them). Default 16 MiB; RabbitMQ's own
    /// `max_message_size` defaults to 128 MiB.
    pub max_message_bytes: usize,
    /// How long a round of a batch (the next event of each of its keys) may wait for its
    /// confirms before they count as unavailable (default 20 s).
    pub confirm_timeout: Duration,
    /// How long a batch waits for the link to open (TCP and TLS connect, AMQP handshake), for
    /// its channel (open, confirm mode), and how long declaring an exchange or closing may take, before
    /// it counts as unavailable (default 10 s). Bounds the relay's wait on a broker that
    /// accepts connections but does not answer.
    ///
    /// One attempt to open the link runs at a time, in a task of its own: batches that find it
    /// still running wait for it (each at most this long) instead of starting another. A new
    /// attempt starts when it failed, or when it has had no answer for six times this long
    /// (lapin cannot cancel a handshake in progress: the attempt left behind keeps its socket
    /// and thread until the broker answers or closes the connection).
    pub connect_timeout: Duration,
}

postal_shared::setters!(RabbitConfig {
    uri: String,
    source: String,
    routing_keys: BTreeMap<String, String>,
    declare_exchanges: bool,
    allowed_topics: crate::TopicAllowList,
    max_message_bytes: usize,
    confirm_timeout: Duration,
    connect_timeout: Duration,
});

impl std::fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("uri", &redact_uri(&self.uri))
            .field("source", &self.source)
            .field("routing_keys", &self.routing_keys)
            .field("declare_exchanges", &self.declare_exchanges)
            .field("allowed_topics", &self.allowed_topics)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

/// The URI with its password replaced, for logs.
pub(super) fn redact_uri(uri: &str) -> String {
    postal_shared::secret::redact_url(uri)
}

impl RabbitConfig {
    /// Defaults for the given AMQP URI.
    pub fn new(uri: impl Into<String>) -> Self {
        RabbitConfig {
            uri: uri.into(),
            source: "postal".into(),
            routing_keys: BTreeMap::new(),
            declare_exchanges: true,
            allowed_topics: crate::TopicAllowList::any(),
            max_message_bytes: 16 * 1024 * 1024,
            confirm_timeout: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// The routing key of an event type.
    pub fn routing_key<'a>(&'a self, event_type: &'a str) -> &'a str {
        self.routing_keys
            .get(event_type)
            .map(String::as_str)
            .unwrap_or(event_type)
    }
}
