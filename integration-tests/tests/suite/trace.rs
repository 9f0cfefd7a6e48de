//! One trace from the producer's span to the consumer's handler span.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use postal_consumer::Consumer;
use postal_integration_tests::{services, unique, wait};
use postal_producer::{enqueue, NewEvent};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

use crate::common::{consumer_config, create_topic, effects_table, RunningConsumer, RunningRelay};
use crate::handlers::{self, apply};

/// Collects finished spans.
#[derive(Clone, Debug, Default)]
struct Collected(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Collected {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.lock().unwrap().extend(batch);
        Ok(())
    }
}

/// Guarantee: the W3C trace context flows from the span that enqueued an event, through the
/// outbox row and the Kafka headers, to the consumer's handler span, which is a child of the
/// enqueueing span in the same trace.
#[tokio::test]
async fn handler_span_is_a_child_of_the_enqueueing_span() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("traced");
    create_topic(&svc.bootstrap, &topic, 1).await;

    let spans = Collected::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(spans.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("postal-test")));
    // Thread-local: this test's current-thread runtime runs the relay and consumer tasks too.
    let _guard = tracing::subscriber::set_default(subscriber);

    let checkout = tracing::info_span!("checkout");
    let producer_sc = checkout.context().span().span_context().clone();
    async {
        let mut tx = db.pool.begin().await.unwrap();
        enqueue(
            &mut tx,
            NewEvent::json(topic.as_str(), "k", "job", &serde_json::json!({"n": 1})).unwrap(),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    .instrument(checkout)
    .await;

    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    let consumer = RunningConsumer::start(
        Consumer::builder(
            db.pool.clone(),
            consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
        )
        .state(handlers::Probe::default())
        .on(&topic, "job", apply)
        .build()
        .unwrap(),
    );
    let stats = consumer.stats.clone();
    wait::until(Duration::from_secs(60), "the event applied", || {
        let s = stats.snapshot();
        async move { s.applied == 1 }
    })
    .await;
    consumer.stop().await;
    relay.stop().await;
    let _ = provider.force_flush();

    let spans = spans.0.lock().unwrap();
    let handle = spans
        .iter()
        .find(|s| s.name == "postal.handle")
        .expect("a handler span was exported");
    assert_eq!(
        handle.span_context.trace_id(),
        producer_sc.trace_id(),
        "same trace as the producer"
    );
    assert_eq!(
        handle.parent_span_id,
        producer_sc.span_id(),
        "child of the enqueueing span"
    );
}
