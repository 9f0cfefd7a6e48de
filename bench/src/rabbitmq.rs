//! RabbitMQ drain: Postal's relay publishing a backlog through its RabbitMQ transport, next to
//! a raw lapin publisher with confirms sending the same messages (persistent, mandatory, same
//! headers), both into a durable topic exchange with one durable queue bound.

use std::time::Instant;

use anyhow::Context;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use postal_producer::{RabbitConfig, RabbitTransport, Relay, RelayConfig};

use crate::{fresh_db, outbox_len, payload, rate, seed};

/// Options of the RabbitMQ benchmark.
pub struct RabbitOpts {
    pub n: usize,
    pub payload_bytes: usize,
    pub keys: usize,
    pub batch_size: usize,
}

/// Declares a durable topic exchange with a durable queue bound to every routing key.
async fn exchange_with_queue(conn: &Connection, name: &str) -> anyhow::Result<String> {
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        name.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    let queue = format!("{name}.q");
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        queue.as_str().into(),
        name.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.close(200, "declared".into()).await?;
    Ok(queue)
}

/// Messages waiting in `queue`.
async fn queue_depth(conn: &Connection, queue: &str) -> anyhow::Result<u32> {
    let ch = conn.create_channel().await?;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    ch.close(200, "counted".into()).await?;
    Ok(q.message_count())
}

async fn delete_queue(conn: &Connection, queue: &str) {
    if let Ok(ch) = conn.create_channel().await {
        let _ = ch.queue_delete(queue.into(), Default::default()).await;
        let _ = ch.close(200, "deleted".into()).await;
    }
}

pub async fn rabbitmq_bench(url: &str, amqp: &str, o: RabbitOpts) -> anyhow::Result<()> {
    let n = o.n;
    println!(
        "backlog {n} events, payload {} B, {} keys; RabbitMQ {}",
        o.payload_bytes,
        o.keys,
        amqp.split('@').next_back().unwrap_or(amqp)
    );
    let conn = Connection::connect(amqp, ConnectionProperties::default())
        .await
        .context("connect to RabbitMQ")?;

    // Raw lapin: one confirm-mode channel, every publish handed over without waiting for its
    // confirm, then all confirms awaited.
    let exchange = format!("bench-raw-{}", uuid::Uuid::now_v7().simple());
    let queue = exchange_with_queue(&conn, &exchange).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let bodies: Vec<Vec<u8>> = (0..n)
        .map(|i| serde_json::to_vec(&payload(o.payload_bytes, i)).expect("json"))
        .collect();
    let t = Instant::now();
    let mut confirms = Vec::with_capacity(n);
    for (i, body) in bodies.iter().enumerate() {
        let mut headers = FieldTable::default();
        let id = uuid::Uuid::now_v7().to_string();
        for (k, v) in [
            ("ce_id", id.as_str()),
            ("ce_type", "bench.event"),
            ("ce_subject", &format!("key-{}", i % o.keys)),
            ("content-type", "application/json"),
        ] {
            headers.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
        }
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_headers(headers);
        confirms.push(
            ch.basic_publish(
                exchange.as_str().into(),
                "bench.event".into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body,
                props,
            )
            .await?,
        );
    }
    let mut acked = 0;
    for c in confirms {
        if let Confirmation::Ack(None) = c.await? {
            acked += 1;
        }
    }
    anyhow::ensure!(acked == n, "raw publisher: only {acked}/{n} confirmed");
    let raw = rate(n, t.elapsed());
    ch.close(200, "published".into()).await?;
    println!("(raw) lapin, confirms awaited in bulk:              {raw:>9.0} events/s");
    anyhow::ensure!(
        queue_depth(&conn, &queue).await? as usize == n,
        "raw: queue depth"
    );
    delete_queue(&conn, &queue).await;

    // Postal: the relay drains the same backlog through its RabbitMQ transport.
    let pool = fresh_db(url, 20).await?;
    let topic = format!("bench-rmq-{}", uuid::Uuid::now_v7().simple());
    let queue = exchange_with_queue(&conn, &topic).await?;
    seed(&pool, &topic, n, o.payload_bytes, o.keys).await?;
    let transport = RabbitTransport::new(RabbitConfig::new(amqp))?;
    let config = RelayConfig::default().batch_size(o.batch_size);
    let relay = Relay::new(pool.clone(), transport, config)?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let t = Instant::now();
    let handle = tokio::spawn(relay.run(async move {
        let _ = stop_rx.await;
    }));
    while outbox_len(&pool).await? > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let postal = rate(n, t.elapsed());
    let _ = stop_tx.send(());
    let stats = handle.await??;
    anyhow::ensure!(
        stats.published as usize == n,
        "relay published {}",
        stats.published
    );
    anyhow::ensure!(
        queue_depth(&conn, &queue).await? as usize == n,
        "postal: queue depth"
    );
    delete_queue(&conn, &queue).await;
    println!(
        "(postal) relay, batch {}, confirms per batch:        {postal:>9.0} events/s",
        o.batch_size
    );
    println!("postal / raw = {:.2}", postal / raw);
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}
