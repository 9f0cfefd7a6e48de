//! Destination per topic: one relay serving Kafka, RabbitMQ and in-process task topics at once.

use std::sync::Arc;
use std::time::Duration;

use futures::future::{join_all, BoxFuture};
use futures::FutureExt;

use crate::transport::{FailureKind, OutboundEvent, PublishError, Transport};
use crate::Error;

type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

/// An object-safe [`Transport`], so that transports of different types can sit in one
/// [`Router`]. Every `Transport` is one.
pub trait DynTransport: Send + Sync + 'static {
    /// [`Transport::send`], boxed.
    fn send_dyn<'a>(&'a self, batch: &'a [OutboundEvent]) -> BoxFuture<'a, Acks>;
    /// [`Transport::delivery_timeout`].
    fn delivery_timeout_dyn(&self) -> Option<Duration>;
    /// [`Transport::flush`], boxed.
    fn flush_dyn(&self, timeout: Duration) -> BoxFuture<'_, ()>;
    /// [`Transport::recorded`].
    fn recorded_dyn(&self, batch: &[OutboundEvent], committed: bool);
    /// [`Transport::checks_out`].
    fn checks_out_dyn(&self) -> Option<usize>;
    /// [`Transport::abort_running`].
    fn abort_running_dyn(&self);
}

impl<T: Transport> DynTransport for T {
    fn send_dyn<'a>(&'a self, batch: &'a [OutboundEvent]) -> BoxFuture<'a, Acks> {
        self.send(batch).map(|acks| acks.boxed()).boxed()
    }

    fn delivery_timeout_dyn(&self) -> Option<Duration> {
        self.delivery_timeout()
    }

    fn flush_dyn(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        self.flush(timeout).boxed()
    }

    fn recorded_dyn(&self, batch: &[OutboundEvent], committed: bool) {
        self.recorded(batch, committed)
    }

    fn checks_out_dyn(&self) -> Option<usize> {
        self.checks_out()
    }

    fn abort_running_dyn(&self) {
        self.abort_running()
    }
}

/// A transport that sends each event to the destination configured for its topic.
///
/// Routes are topic names or prefixes ending in `*` (`emails.*`; `*` alone matches every
/// topic), tried in the order they were added; a topic no route matches goes to the fallback
/// destination, or is parked with a clear error when there is none.
///
/// Per-key order holds within each destination. Events of one key that go to different
/// destinations are handed over in outbox order, but their acknowledgements are independent:
/// keep a key's events on one destination when their relative order matters downstream.
///
/// ```
/// # fn build(kafka: postal_producer::KafkaTransport, rabbit: postal_producer::RabbitTransport) -> Result<(), postal_producer::Error> {
/// use postal_producer::{Router, TaskTransport};
///
/// let router = Router::new()
///     .destination("kafka", kafka)
///     .destination("rabbitmq", rabbit)
///     .destination("tasks", TaskTransport::new(Default::default()))
///     .route("notifications.*", "rabbitmq")?
///     .route("reports", "tasks")?
///     .fallback("kafka")?;
/// # let _ = router; Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct Router {
    destinations: Vec<(String, Arc<dyn DynTransport>)>,
    routes: Vec<(String, usize)>,
    fallback: Option<usize>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = |i: usize| self.destinations[i].0.as_str();
        f.debug_struct("Router")
            .field(
                "routes",
                &self
                    .routes
                    .iter()
                    .map(|(p, i)| (p.as_str(), name(*i)))
                    .collect::<Vec<_>>(),
            )
            .field("fallback", &self.fallback.map(name))
            .finish()
    }
}

impl Router {
    /// A router without destinations.
    pub fn new() -> Self {
        Router::default()
    }

    /// Adds a destination under `name` (replacing one of the same name).
    pub fn destination(mut self, name: impl Into<String>, transport: impl Transport) -> Self {
        let name = name.into();
        let transport: Arc<dyn DynTransport> = Arc::new(transport);
        match self.destinations.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = transport,
            None => self.destinations.push((name, transport)),
        }
        self
    }

    fn index(&self, name: &str) -> Result<usize, Error> {
        self.destinations
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| {
                let known: Vec<&str> = self.destinations.iter().map(|(n, _)| n.as_str()).collect();
                Error::Config(format!(
                    "unknown destination {name:?} (configured: {})",
                    known.join(", ")
                ))
            })
    }

    /// Sends topics matching `pattern` (a topic, or a prefix ending in `*`) to `destination`.
    pub fn route(mut self, pattern: impl Into<String>, destination: &str) -> Result<Self, Error> {
        let pattern = pattern.into();
        if pattern.is_empty() || pattern[..pattern.len() - 1].contains('*') {
            return Err(Error::Config(format!(
                "invalid route pattern {pattern:?}: a topic, or a prefix ending in '*'"
            )));
        }
        let i = self.index(destination)?;
        self.routes.push((pattern, i));
        Ok(self)
    }

    /// Sends topics no route matches to `destination`.
    pub fn fallback(mut self, destination: &str) -> Result<Self, Error> {
        self.fallback = Some(self.index(destination)?);
        Ok(self)
    }

    /// The destination name of `topic`, if any.
    pub fn destination_of(&self, topic: &str) -> Option<&str> {
        self.pick(topic).map(|i| self.destinations[i].0.as_str())
    }

    fn pick(&self, topic: &str) -> Option<usize> {
        self.routes
            .iter()
            .find(|(p, _)| match p.strip_suffix('*') {
                Some(prefix) => topic.starts_with(prefix),
                None => p == topic,
            })
            .map(|(_, i)| *i)
            .or(self.fallback)
    }
}

impl Transport for Router {
    type Acks = Acks;

    async fn send(&self, batch: &[OutboundEvent]) -> Acks {
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); self.destinations.len()];
        let mut unrouted = Vec::new();
        for (i, e) in batch.iter().enumerate() {
            match self.pick(&e.topic) {
                Some(d) => groups[d].push(i),
                None => unrouted.push(i),
            }
        }
        // The common case, one destination for the whole batch: no copies.
        if unrouted.is_empty() {
            if let Some(d) = groups.iter().position(|g| g.len() == batch.len()) {
                return self.destinations[d].1.send_dyn(batch).await;
            }
        }
        let mut parts = Vec::new();
        for (d, positions) in groups.into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let sub: Vec<OutboundEvent> = positions.iter().map(|&i| batch[i].clone()).collect();
            let acks = self.destinations[d].1.send_dyn(&sub).await;
            parts.push((positions, acks));
        }
        let n = batch.len();
        let unrouted: Vec<(usize, String)> = unrouted
            .into_iter()
            .map(|i| (i, batch[i].topic.clone()))
            .collect();
        async move {
            let mut outcomes: Vec<Result<(), PublishError>> = vec![Ok(()); n];
            for (i, topic) in unrouted {
                outcomes[i] = Err(PublishError::new(
                    FailureKind::Permanent,
                    format!("no destination is configured for topic {topic:?}"),
                ));
            }
            let (positions, acks): (Vec<_>, Vec<_>) = parts.into_iter().unzip();
            for (positions, results) in positions.into_iter().zip(join_all(acks).await) {
                for (i, r) in positions.into_iter().zip(results) {
                    outcomes[i] = r;
                }
            }
            outcomes
        }
        .boxed()
    }

    fn delivery_timeout(&self) -> Option<Duration> {
        self.destinations
            .iter()
            .filter_map(|(_, t)| t.delivery_timeout_dyn())
            .max()
    }

    async fn flush(&self, timeout: Duration) {
        join_all(self.destinations.iter().map(|(_, t)| t.flush_dyn(timeout))).await;
    }

    /// The whole batch goes to every destination: each knows the events it was handed.
    fn recorded(&self, batch: &[OutboundEvent], committed: bool) {
        for (_, t) in &self.destinations {
            t.recorded_dyn(batch, committed);
        }
    }

    /// When any destination does, with the sum of their limits: the relay then checks out
    /// every row it claims, also those for the other destinations (route task topics through
    /// a relay group of their own, [`crate::TopicFilter`], to keep the others on the faster
    /// claim).
    fn abort_running(&self) {
        for (_, t) in &self.destinations {
            t.abort_running_dyn();
        }
    }

    fn checks_out(&self) -> Option<usize> {
        self.destinations
            .iter()
            .filter_map(|(_, t)| t.checks_out_dyn())
            .reduce(|a, b| a.saturating_add(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::{TaskConfig, TaskTransport};

    fn tasks() -> TaskTransport {
        TaskTransport::new(TaskConfig::default())
    }

    /// Exact topics, `*` prefixes and the fallback pick destinations in the order routes were
    /// added; unknown destinations and malformed patterns are configuration errors.
    #[test]
    fn routes_pick_destinations() {
        let r = Router::new()
            .destination("a", tasks())
            .destination("b", tasks())
            .route("emails.*", "b")
            .unwrap()
            .route("reports", "a")
            .unwrap();
        assert_eq!(r.destination_of("emails.welcome"), Some("b"));
        assert_eq!(r.destination_of("reports"), Some("a"));
        assert_eq!(r.destination_of("reports.daily"), None);
        let r = r.fallback("a").unwrap();
        assert_eq!(r.destination_of("orders"), Some("a"));
        let err = Router::new().route("x", "nope").unwrap_err();
        assert!(err.to_string().contains("unknown destination"), "{err}");
        let err = Router::new()
            .destination("a", tasks())
            .route("a*b", "a")
            .unwrap_err();
        assert!(err.to_string().contains("invalid route pattern"), "{err}");
    }
}
