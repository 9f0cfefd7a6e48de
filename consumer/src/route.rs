//! Routing records to handlers by topic, event type and (optionally) schema version.

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use sqlx::{Postgres, Transaction};

use crate::batch_handler::{Batch, BatchHandler};
use crate::handler::{Handler, HandlerError};
use crate::record::{decode, Meta, Record};

/// Why a routed call failed.
pub(crate) enum Failure {
    Undecodable(String),
    Handler(HandlerError),
}

/// A handler with its payload type erased.
pub(crate) trait Route: Send + Sync {
    fn name(&self) -> &str;
    fn consumer(&self) -> &str;
    fn call<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        record: &'a Record,
        meta: &'a Meta,
    ) -> BoxFuture<'a, Result<(), Failure>>;
    /// Whether the handler takes batches ([`call_batch`](Self::call_batch)).
    fn batched(&self) -> bool {
        false
    }
    /// Calls the handler once with all of `items` (in order); a record that does not decode
    /// fails the call. Only for batch routes.
    fn call_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        items: &'a [(&'a Record, &'a Meta)],
    ) -> BoxFuture<'a, Result<(), Failure>>;
}

struct Routed<H>(H);

/// A batch handler with its payload type erased.
struct BatchRouted<H>(H);

impl<H: BatchHandler> Route for BatchRouted<H> {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn consumer(&self) -> &str {
        self.0.consumer()
    }

    fn batched(&self) -> bool {
        true
    }

    /// One record: a batch of one.
    fn call<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        record: &'a Record,
        meta: &'a Meta,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            let event = decode::<H::Payload>(record, meta).map_err(Failure::Undecodable)?;
            self.0
                .handle_batch(tx, Batch::new(vec![event]))
                .await
                .map_err(Failure::Handler)
        })
    }

    fn call_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        items: &'a [(&'a Record, &'a Meta)],
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            let events = items
                .iter()
                .map(|(r, m)| decode::<H::Payload>(r, m))
                .collect::<Result<Vec<_>, _>>()
                .map_err(Failure::Undecodable)?;
            self.0
                .handle_batch(tx, Batch::new(events))
                .await
                .map_err(Failure::Handler)
        })
    }
}

impl<H: Handler> Route for Routed<H> {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn consumer(&self) -> &str {
        self.0.consumer()
    }

    fn call<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        record: &'a Record,
        meta: &'a Meta,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            let event = decode::<H::Payload>(record, meta).map_err(Failure::Undecodable)?;
            self.0.handle(tx, event).await.map_err(Failure::Handler)
        })
    }

    /// Not called for single-event routes; one call per record, in order, if it were.
    fn call_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        items: &'a [(&'a Record, &'a Meta)],
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            for (record, meta) in items {
                self.call(tx, record, meta).await?;
            }
            Ok(())
        })
    }
}

/// Handlers of one (topic, event type), by schema version (`None`: any version).
type Versions = Vec<(Option<i32>, Arc<dyn Route>)>;

/// The routing table: topic → event type → versions (looked up per record without allocating).
#[derive(Default)]
pub(crate) struct Router {
    routes: HashMap<String, HashMap<String, Versions>>,
}

impl Router {
    /// Adds a route; `false` if the same (topic, type, version) is already routed.
    pub fn add<H: Handler>(
        &mut self,
        topic: &str,
        event_type: &str,
        version: Option<i32>,
        handler: H,
    ) -> bool {
        self.insert(topic, event_type, version, Arc::new(Routed(handler)))
    }

    /// Adds a batch route; `false` if the same (topic, type, version) is already routed.
    pub fn add_batch<H: BatchHandler>(
        &mut self,
        topic: &str,
        event_type: &str,
        version: Option<i32>,
        handler: H,
    ) -> bool {
        self.insert(topic, event_type, version, Arc::new(BatchRouted(handler)))
    }

    fn insert(
        &mut self,
        topic: &str,
        event_type: &str,
        version: Option<i32>,
        route: Arc<dyn Route>,
    ) -> bool {
        let list = self
            .routes
            .entry(topic.to_owned())
            .or_default()
            .entry(event_type.to_owned())
            .or_default();
        if list.iter().any(|(v, _)| *v == version) {
            return false;
        }
        list.push((version, route));
        true
    }

    /// The handler for a record: an exact version match first, then a version-agnostic one.
    pub fn find(&self, topic: &str, event_type: &str, version: i32) -> Option<&Arc<dyn Route>> {
        let list = self.routes.get(topic)?.get(event_type)?;
        list.iter()
            .find(|(v, _)| *v == Some(version))
            .or_else(|| list.iter().find(|(v, _)| v.is_none()))
            .map(|(_, r)| r)
    }

    pub fn topics(&self) -> Vec<String> {
        let mut t: Vec<String> = self.routes.keys().cloned().collect();
        t.sort();
        t
    }

    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Event;

    struct Named(&'static str);

    impl Handler for Named {
        type Payload = serde_json::Value;
        fn consumer(&self) -> &str {
            "c"
        }
        fn name(&self) -> &str {
            self.0
        }
        fn handle<'a, 'c>(
            &'a self,
            _tx: &'a mut Transaction<'c, Postgres>,
            _event: Event<serde_json::Value>,
        ) -> BoxFuture<'a, Result<(), HandlerError>> {
            Box::pin(async { Ok(()) })
        }
    }

    /// Routing prefers the exact schema version, falls back to the version-agnostic route,
    /// and refuses the same route twice.
    #[test]
    fn routes_by_topic_type_and_version() {
        let mut r = Router::default();
        assert!(r.add("orders", "created", None, Named("any")));
        assert!(r.add("orders", "created", Some(2), Named("v2")));
        assert!(!r.add("orders", "created", Some(2), Named("again")));
        let name = |t: &str, ty: &str, v: i32| r.find(t, ty, v).map(|h| h.name());
        assert_eq!(name("orders", "created", 2), Some("v2"));
        assert_eq!(name("orders", "created", 1), Some("any"));
        assert_eq!(name("orders", "paid", 1), None);
        assert_eq!(name("payments", "created", 2), None);
        assert_eq!(r.topics(), ["orders"]);
    }
}
