//! Hostile input on the consumer's decode path: records no Kafka client library would write,
//! sent byte by byte.

use std::time::Duration;

use postal_integration_tests::raw_produce::produce_raw;
use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, start_apply, RawRecord,
};
use crate::handlers;

const WAIT: Duration = Duration::from_secs(60);

/// Guarantee: a record with a header name that is not valid UTF-8 (the Kafka client library
/// panics reading it) neither crashes nor stops the consumer: it is dead-lettered as
/// undecodable with a one-line reason naming the header, and the records after it are
/// applied. Before, the consumer panicked outside any handler and exited, and did the same
/// after every restart with the offset never moving.
#[tokio::test]
async fn a_header_name_that_is_not_utf8_is_dead_lettered_and_the_partition_moves_on() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("hostile");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let bad = Uuid::now_v7().to_string();
    let (b, t) = (svc.bootstrap.clone(), topic.clone());
    let code = tokio::task::spawn_blocking(move || {
        produce_raw(
            &b,
            &t,
            0,
            b"k",
            br#"{"n": 0}"#,
            &[
                (b"ce_id", bad.as_bytes()),
                (b"ce_type", b"job"),
                (b"content-type", b"application/json"),
                (&[0xff, 0xfe, b'x'], b"v"),
            ],
        )
    })
    .await
    .unwrap()
    .expect("raw produce");
    assert_eq!(code, 0, "the broker stored the raw record");
    let good = Uuid::now_v7();
    produce(
        &svc.bootstrap,
        &topic,
        Some(0),
        &[RawRecord::event(good, "k", "job", json!({"n": 1}))],
    )
    .await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    wait::until(
        WAIT,
        "the bad record dead-lettered and the good one applied",
        || {
            let s = stats.snapshot();
            async move { s.dead_letters == 1 && s.applied == 1 }
        },
    )
    .await;
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (1, 1));
    let (reason, error): (String, String) =
        sqlx::query_as("SELECT reason, error FROM postal.dead_letters WHERE topic = $1")
            .bind(&topic)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reason, "undecodable");
    assert_eq!(error, "header #3 has a name that is not valid UTF-8");
}
