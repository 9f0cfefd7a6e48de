//! Writing events: atomic with the business transaction, validated, ordered.

use postal_integration_tests::{services, unique};
use postal_producer::{enqueue, enqueue_batch, ContentType, EventId, NewEvent};

/// Guarantee: a rolled-back transaction leaves neither the business row nor the event.
#[tokio::test]
async fn rollback_leaves_neither_row_nor_event() {
    let db = services().await.fresh_db().await;
    sqlx::query("CREATE TABLE orders (id bigint PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    enqueue(
        &mut tx,
        NewEvent::json("orders", "1", "order.created", &1).unwrap(),
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!((orders, events), (0, 0));
}

/// Guarantee: a batch keeps the given order as outbox sequence order and stores every field.
#[tokio::test]
async fn batch_enqueue_keeps_order_and_fields() {
    let db = services().await.fresh_db().await;
    let events: Vec<NewEvent> = (0..100)
        .map(|i| {
            NewEvent::json(
                "t",
                format!("k{}", i % 7),
                "thing.happened",
                &serde_json::json!({"i": i}),
            )
            .unwrap()
            .with_header("x-tenant", "acme")
            .unwrap()
        })
        .collect();
    let mut conn = db.pool.acquire().await.unwrap();
    let ids = enqueue_batch(&mut conn, events).await.unwrap();
    let stored: Vec<(uuid::Uuid, serde_json::Value, String)> = sqlx::query_as(
        "SELECT event_id, headers, convert_from(payload, 'UTF8') FROM postal.outbox ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(stored.len(), 100);
    for (i, (id, headers, payload)) in stored.iter().enumerate() {
        assert_eq!(*id, ids[i].as_uuid(), "sequence order is the batch order");
        assert_eq!(headers["x-tenant"], "acme");
        assert_eq!(payload, &format!("{{\"i\":{i}}}"));
    }
}

/// Guarantee: a duplicate caller-supplied id is a clear error and does not disturb the first.
#[tokio::test]
async fn duplicate_event_id_is_rejected() {
    let db = services().await.fresh_db().await;
    let id = EventId::new();
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue(
        &mut conn,
        NewEvent::json("t", "k", "e", &1).unwrap().with_id(id),
    )
    .await
    .unwrap();
    let err = enqueue(
        &mut conn,
        NewEvent::json("t", "k", "e", &2).unwrap().with_id(id),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, postal_producer::Error::DuplicateEventId),
        "{err}"
    );
}

/// Guarantee: bad input is refused at the call with a reason, before touching the database.
#[tokio::test]
async fn invalid_envelopes_fail_at_the_call() {
    assert!(NewEvent::json("bad topic", "k", "e", &1)
        .unwrap_err()
        .to_string()
        .contains("topic"));
    assert!(NewEvent::json("t", "", "e", &1)
        .unwrap_err()
        .to_string()
        .contains("key"));
    assert!(NewEvent::json("t", "k", "", &1)
        .unwrap_err()
        .to_string()
        .contains("event type"));
    let big = vec![0u8; postal_producer::MAX_PAYLOAD_BYTES + 1];
    let err = NewEvent::bytes(
        "t",
        "k",
        "e",
        ContentType::new("application/octet-stream").unwrap(),
        big,
    )
    .unwrap_err();
    assert!(err.to_string().contains("exceeds"), "{err}");
    let err = NewEvent::json("t", "k", "e", &1)
        .unwrap()
        .with_header("ce_id", "x")
        .unwrap_err();
    assert!(err.to_string().contains("reserved"), "{err}");
}

/// Guarantee: the SQL function writes the same rows as the Rust API, validates its input and
/// assigns a v7 id when none is given.
#[tokio::test]
async fn sql_enqueue_function() {
    let db = services().await.fresh_db().await;
    let mut tx = db.pool.begin().await.unwrap();
    let id: uuid::Uuid = sqlx::query_scalar(
        "SELECT postal.enqueue('orders', 'c-1', 'order.created', '{\"order\": 1}'::jsonb, '{\"x-a\": \"b\"}'::jsonb)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(id.get_version_num(), 7);
    let bytes_id: uuid::Uuid = sqlx::query_scalar(
        "SELECT postal.enqueue_bytes('orders', 'c-1', 'order.raw', 'application/x-protobuf', '\\x0102'::bytea)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let rows: Vec<(uuid::Uuid, String, Vec<u8>)> =
        sqlx::query_as("SELECT event_id, content_type, payload FROM postal.outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(rows[0].0, id);
    assert_eq!(rows[0].1, "application/json");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&rows[0].2).unwrap()["order"],
        1
    );
    assert_eq!(
        rows[1],
        (bytes_id, "application/x-protobuf".to_owned(), vec![1u8, 2])
    );

    let err = sqlx::query("SELECT postal.enqueue('bad topic', 'k', 'e', '{}'::jsonb)")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("invalid topic"), "{err}");
    let err = sqlx::query(
        "SELECT postal.enqueue('t', 'k', 'e', '{}'::jsonb, '{\"ce_id\": \"x\"}'::jsonb)",
    )
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert!(err.to_string().contains("reserved"), "{err}");
}

/// Guarantee: the W3C trace context of the span that enqueues an event is stored with it, so
/// the relay carries it to Kafka as `traceparent`.
#[tokio::test]
async fn enqueue_captures_the_current_trace_context() {
    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    let db = services().await.fresh_db().await;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("postal-test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let span = tracing::info_span!("create_order");
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    assert!(sc.is_valid());
    let id = async {
        let mut conn = db.pool.acquire().await.unwrap();
        enqueue(&mut conn, NewEvent::json("t", "k", "e", &1).unwrap())
            .await
            .unwrap()
    }
    .instrument(span)
    .await;
    let headers: serde_json::Value =
        sqlx::query_scalar("SELECT headers FROM postal.outbox WHERE event_id = $1")
            .bind(id.as_uuid())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let tp = headers["traceparent"]
        .as_str()
        .expect("traceparent captured");
    assert_eq!(tp, format!("00-{}-{}-01", sc.trace_id(), sc.span_id()));
}

/// Guarantee: `enqueue_once` takes an existing row for the same event only when it is the
/// same event — same topic, key, type, schema version, content type, headers (trace context
/// aside) and payload — and refuses a different event under that id with `DuplicateEventId`.
/// (From a second review: another schema version or other headers were taken as the same.)
#[tokio::test]
async fn enqueue_once_refuses_a_different_event_under_the_same_id() {
    use postal_producer::{enqueue_once, SchemaVersion};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("review2-once");
    let id = EventId::derived(EventId::new(), "out");
    let mut conn = db.pool.acquire().await.unwrap();
    let first = NewEvent::json(topic.as_str(), "k", "t", &"p")
        .unwrap()
        .with_id(id);
    enqueue_once(&mut conn, first).await.unwrap();
    let other_version = NewEvent::json(topic.as_str(), "k", "t", &"p")
        .unwrap()
        .with_id(id)
        .with_schema_version(SchemaVersion::new(2).unwrap());
    let r1 = enqueue_once(&mut conn, other_version).await;
    let other_headers = NewEvent::json(topic.as_str(), "k", "t", &"p")
        .unwrap()
        .with_id(id)
        .with_header("tenant", "b")
        .unwrap();
    let r2 = enqueue_once(&mut conn, other_headers).await;
    assert!(
        r1.is_err() && r2.is_err(),
        "a different event under the same id was accepted as the same: version {r1:?}, headers {r2:?}"
    );
    // The same event again (its trace context aside) is no error and writes nothing.
    let same = NewEvent::json(topic.as_str(), "k", "t", &"p")
        .unwrap()
        .with_id(id)
        .with_header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .unwrap();
    assert_eq!(enqueue_once(&mut conn, same).await.unwrap(), id);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(rows, 1);
}

/// Guarantee (issue 46: no size stalls a path): an event with a key of the longest length
/// enqueue allows (`MAX_KEY_LEN`, 4,096 bytes, incompressible) can be scheduled and parked.
/// Both make its row hold back its key (`held`), and the index of such rows once held the key
/// whole: over about 2,700 bytes PostgreSQL refused the index row ("index row size … exceeds
/// btree version 4 maximum"), so a scheduled event failed at enqueue and a parked one could
/// never be parked (the relay sent it again and again). Keys are indexed by a hash since
/// migration 39.
#[tokio::test]
async fn the_longest_key_can_be_scheduled_and_parked() {
    let db = postal_integration_tests::fresh_postgres_db().await;
    let mut x = uuid::Uuid::now_v7().as_u128() as u64 | 1;
    let key: String = (0..postal_shared::MAX_KEY_LEN)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'!' + (x % 90) as u8)
        })
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    enqueue_batch(
        &mut tx,
        vec![
            NewEvent::json("orders", key.as_str(), "order.scheduled", &1)
                .unwrap()
                .deliver_at(later),
            NewEvent::json("orders", key.as_str(), "order.created", &2).unwrap(),
        ],
    )
    .await
    .expect("a scheduled event of the longest key is enqueued");
    tx.commit().await.unwrap();
    // Parked as the relay parks (`complete`: status failed, the row holds its key back).
    let parked = sqlx::query(
        "UPDATE postal.outbox SET status = 'failed', held = true, last_error = 'refused'
         WHERE event_type = 'order.created'",
    )
    .execute(&db.pool)
    .await
    .expect("an event of the longest key is parked")
    .rows_affected();
    assert_eq!(parked, 1);
    let held: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE held AND event_key = $1")
            .bind(&key)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(held, 2);
}
