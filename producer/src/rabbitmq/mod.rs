//! The RabbitMQ transport: persistent messages on durable topic exchanges, with publisher
//! confirms awaited per batch before any row is marked.
//!
//! - `config`: [`RabbitConfig`];
//! - `link`: the connection and the per-batch channel;
//! - `exchange`: declaring and checking exchanges;
//! - `batch`: publishing one batch in confirm rounds;
//! - `failure`: what a lapin error means for the events.

mod batch;
mod config;
mod exchange;
mod failure;
mod frame;
mod link;

pub use config::RabbitConfig;

use batch::{BatchRun, Prepared};
use exchange::ExchangeState;
use failure::blocked_error;
use link::{batch_channel, close, LinkSlot};

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;

use postal_shared::headers as h;

use crate::transport::{FailureKind, OutboundEvent, PublishError, Transport};
use crate::Error;

/// Publishes outbox events to RabbitMQ.
///
/// Message layout: exchange = the event's topic (a durable `topic` exchange), routing key =
/// the event type (or its configured mapping), body = payload, persistent (`delivery-mode` 2),
/// `message-id` = event id, `type` = event type, `content-type`, `timestamp` = occurred-at
/// (seconds), `app-id` = source, and the same headers as Kafka records: `ce_id`, `ce_type`,
/// `ce_source`, `ce_time`, `ce_specversion`, `ce_subject` (key), `ce_schemaversion`,
/// `ce_postalseq`, `content-type`, then user headers (including `traceparent`).
///
/// A message whose body exceeds `max_message_bytes`, or whose properties and headers do not
/// fit in one frame of the connection's negotiated `frame_max` (AMQP cannot split them, and
/// RabbitMQ closes the whole connection on such a frame), is parked before it is sent.
///
/// Every message is published `mandatory`: a message no queue is bound for comes back and
/// counts as a failed attempt ("unroutable"), as does a nack; a lost connection or a confirm
/// that does not arrive within `confirm_timeout` is "unavailable" (retried without using up
/// attempts). The connection is re-opened on the next batch.
///
/// Each batch publishes on a confirm-mode channel of its own, in rounds: per key at most one
/// unconfirmed message at a time, so that a nacked, returned or lost message holds back the
/// later events of its key (other keys pipeline within a round; a batch of one key sends one
/// message per confirm round trip). Returned messages are matched to events by message id. A
/// connection the broker blocks (resource alarm) gets nothing more to publish: its batches
/// are unavailable at once, and it is kept, not replaced, until the broker unblocks it.
pub struct RabbitTransport {
    config: RabbitConfig,
    /// Never held across an await.
    link: Mutex<LinkSlot>,
    attempts: AtomicU64,
    exchanges: Arc<Mutex<HashMap<String, ExchangeState>>>,
}

impl std::fmt::Debug for RabbitTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitTransport")
            .field("config", &self.config)
            .finish()
    }
}

impl RabbitTransport {
    /// Checks the configuration; the connection opens lazily on the first batch (an
    /// unreachable broker is not an error here: the relay waits and retries).
    pub fn new(config: RabbitConfig) -> Result<Self, Error> {
        postal_shared::headers::check_source(&config.source).map_err(Error::Config)?;
        if config.source.len() > 255 {
            return Err(Error::Config(
                "source is longer than the 255 bytes an AMQP app-id holds".into(),
            ));
        }
        config
            .uri
            .parse::<lapin::uri::AMQPUri>()
            // lapin's error quotes the whole URI, password included: neither is shown.
            .map_err(|_| {
                Error::Config(
                    "invalid AMQP URI (not shown: it may hold a password); expected \
                     amqp://user:password@host:port/vhost or amqps://…"
                        .into(),
                )
            })?;
        if config.max_message_bytes == 0
            || config.confirm_timeout.is_zero()
            || config.connect_timeout.is_zero()
        {
            return Err(Error::Config(
                "max message bytes, confirm timeout and connect timeout must be positive".into(),
            ));
        }
        Ok(RabbitTransport {
            config,
            link: Mutex::new(LinkSlot::Closed),
            attempts: AtomicU64::new(0),
            exchanges: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    fn properties(&self, e: &OutboundEvent) -> BasicProperties {
        let mut headers = FieldTable::default();
        let mut put = |k: &str, v: &str| {
            headers.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
        };
        let id = e.id.to_string();
        put(h::CE_ID, &id);
        put(h::CE_TYPE, &e.event_type);
        put(h::CE_SOURCE, &self.config.source);
        put(
            h::CE_TIME,
            &e.occurred_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        );
        put(h::CE_SPECVERSION, h::SPEC_VERSION);
        put(h::CE_SUBJECT, &e.key);
        put(h::CE_SCHEMA_VERSION, &e.schema_version.to_string());
        put(h::CE_POSTAL_SEQ, &e.seq.to_string());
        put(h::CONTENT_TYPE, &e.content_type);
        for (k, v) in &e.headers {
            put(k, v);
        }
        BasicProperties::default()
            .with_message_id(id.into())
            .with_type(e.event_type.as_str().into())
            .with_content_type(e.content_type.as_str().into())
            .with_delivery_mode(2)
            .with_timestamp(e.occurred_at.timestamp().max(0) as u64)
            .with_app_id(self.config.source.as_str().into())
            .with_headers(headers)
    }
}

type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

impl Transport for RabbitTransport {
    type Acks = Acks;

    async fn send(&self, batch: &[OutboundEvent]) -> Acks {
        let everything = |err: PublishError| -> Acks {
            let all = vec![Err(err); batch.len()];
            async move { all }.boxed()
        };
        let link = match self.link().await {
            Ok(l) => l,
            Err(err) => {
                tracing::warn!(reason = %err.reason, "RabbitMQ unreachable");
                return everything(err);
            }
        };
        if link.connection.status().blocked() {
            // Nothing is handed to a blocked connection: it would sit in its buffer and
            // arrive whenever the alarm clears, long after this batch gave up on it.
            return everything(blocked_error());
        }
        let mut exchange_ok: HashMap<&str, Result<(), PublishError>> = HashMap::new();
        // After one exchange could not be checked (no answer, channel error), the others are
        // not tried on this link: each would wait as long.
        let mut unreachable: Option<PublishError> = None;
        for e in batch {
            if !exchange_ok.contains_key(e.topic.as_str()) {
                // A refused topic's exchange is never checked, let alone declared.
                let r = match (&unreachable, self.config.allowed_topics.check(&e.topic)) {
                    (_, Err(refused)) => Err(refused),
                    (Some(err), _) => Err(err.clone()),
                    (None, Ok(())) => self.ensure_exchange(&link, &e.topic).await,
                };
                if let Err(err) = &r {
                    if err.kind == FailureKind::Unavailable {
                        unreachable = Some(err.clone());
                    }
                }
                exchange_ok.insert(e.topic.as_str(), r);
            }
        }
        // Negotiated when the connection opened (the broker's `frame_max`, 128 KiB by
        // default, or a lower one asked for with `?frame_max=` in the URI).
        let frame_max = link.connection.configuration().frame_max() as usize;
        // Refused before sending: the later events of their keys are held back.
        let mut outcomes: Vec<Option<Result<(), PublishError>>> = vec![None; batch.len()];
        let mut blocked: HashSet<(&str, &str)> = HashSet::new();
        let mut slots: HashMap<(&str, &str), usize> = HashMap::new();
        let mut keys: Vec<std::collections::VecDeque<usize>> = Vec::new();
        let mut prepared = Vec::new();
        for (index, e) in batch.iter().enumerate() {
            let refused = if blocked.contains(&e.order_key()) {
                Some(PublishError::new(
                    FailureKind::HeldBack,
                    "an earlier event of this key failed",
                ))
            } else if let Err(err) = &exchange_ok[e.topic.as_str()] {
                Some(err.clone())
            } else if let Some(err) = crate::transport::stored_headers_refused(e) {
                Some(err)
            } else if e.content_type.len() > 255 || e.event_type.len() > 255 {
                // AMQP short strings (the content-type and type properties) hold 255 bytes.
                Some(PublishError::new(
                    FailureKind::Permanent,
                    "the content type or event type is longer than the 255 bytes an AMQP property holds",
                ))
            } else if e.payload.len() > self.config.max_message_bytes {
                Some(PublishError::new(
                    FailureKind::Permanent,
                    format!(
                        "message body of {} bytes exceeds the RabbitMQ transport's limit of {} bytes",
                        e.payload.len(),
                        self.config.max_message_bytes
                    ),
                ))
            } else {
                None
            };
            let properties = self.properties(e);
            // AMQP carries all properties and headers in one content-header frame: one over
            // the connection's frame_max would make the broker close the connection.
            let refused = refused.or_else(|| {
                let size = frame::content_header_bytes(&properties);
                (size > frame_max).then(|| {
                    PublishError::new(
                        FailureKind::Permanent,
                        format!(
                            "the message's properties and headers take {size} bytes, more than the connection's frame_max of {frame_max} bytes (AMQP cannot split them; RabbitMQ would close the connection)"
                        ),
                    )
                })
            });
            if let Some(err) = refused {
                blocked.insert(e.order_key());
                outcomes[index] = Some(Err(err));
                continue;
            }
            let slot = *slots.entry(e.order_key()).or_insert_with(|| {
                keys.push(std::collections::VecDeque::new());
                keys.len() - 1
            });
            keys[slot].push_back(prepared.len());
            prepared.push(Prepared {
                index,
                slot,
                id: e.id.to_string(),
                exchange: e.topic.clone(),
                routing_key: self.config.routing_key(&e.event_type).to_owned(),
                payload: e.payload.clone(),
                properties,
            });
        }
        if prepared.is_empty() {
            let all = outcomes.into_iter().map(|o| o.expect("refused")).collect();
            return async move { all }.boxed();
        }
        // A channel per batch: its confirms and returns are this batch's only.
        let channel = match batch_channel(&link, self.config.connect_timeout).await {
            Ok(c) => c,
            Err(err) => {
                let all = outcomes
                    .into_iter()
                    .map(|o| o.unwrap_or_else(|| Err(err.clone())))
                    .collect();
                if !link.connection.status().blocked() {
                    close(
                        self.config.connect_timeout,
                        &link.connection,
                        320,
                        "postal relay reconnects",
                    )
                    .await;
                }
                return async move { all }.boxed();
            }
        };
        BatchRun {
            link,
            channel,
            keys,
            prepared,
            outcomes,
            confirm_timeout: self.config.confirm_timeout,
            connect_timeout: self.config.connect_timeout,
            exchanges: self.exchanges.clone(),
        }
        .run()
        .boxed()
    }

    fn delivery_timeout(&self) -> Option<Duration> {
        Some(self.config.confirm_timeout)
    }

    async fn flush(&self, timeout: Duration) {
        let link = match &*self.link.lock().expect("link slot") {
            LinkSlot::Open(link) => Some(link.clone()),
            _ => None,
        };
        if let Some(link) = link {
            let limit = self.config.connect_timeout.min(timeout);
            close(limit, &link.connection, 200, "postal relay stopped").await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    /// The password in the AMQP URI never shows in `Debug` output (which is what gets logged).
    #[test]
    fn debug_output_redacts_the_password() {
        let c = RabbitConfig::new("amqps://relay:hunter2@mq.example:5671/prod");
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("relay:<redacted>@mq.example"), "{shown}");
    }

    /// A malformed URI is refused when the transport is built, not at the first publish.
    #[test]
    fn bad_uri_is_a_config_error() {
        let err = RabbitTransport::new(RabbitConfig::new("http://nope")).unwrap_err();
        assert!(err.to_string().contains("invalid AMQP URI"), "{err}");
    }

    /// Event types map to routing keys through the configured table, else stand for themselves.
    #[test]
    fn routing_key_mapping() {
        let mut c = RabbitConfig::new("amqp://127.0.0.1");
        c.routing_keys
            .insert("order.created".into(), "orders.v1.created".into());
        assert_eq!(c.routing_key("order.created"), "orders.v1.created");
        assert_eq!(c.routing_key("order.paid"), "order.paid");
    }

    /// Guarantee: a broker that accepts the TCP connection but never answers the AMQP handshake
    /// (a hung or half-dead RabbitMQ) does not hold the relay: every batch comes back as
    /// "unavailable" (retried without using up attempts) after `connect_timeout`, whether it
    /// waits alone or with others, and the batches share the one attempt to connect instead of
    /// each leaving a handshake of its own behind (lapin cannot cancel one).
    #[tokio::test]
    async fn a_broker_that_never_answers_the_handshake_is_unavailable_after_the_connect_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicU64::new(0));
        // Accepts connections and keeps them open without a word.
        let silent = tokio::spawn({
            let accepted = accepted.clone();
            async move {
                let mut held = Vec::new();
                while let Ok((socket, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    held.push(socket);
                }
            }
        });
        let mut config = RabbitConfig::new(format!("amqp://guest:guest@127.0.0.1:{port}/%2f"));
        config.connect_timeout = Duration::from_millis(300);
        let transport = RabbitTransport::new(config).unwrap();
        let event = crate::transport::sample_event("orders", 1);
        let send = || async {
            tokio::time::timeout(Duration::from_secs(10), async {
                transport.send(std::slice::from_ref(&event)).await.await
            })
            .await
            .expect("send must give up after the connect timeout")
        };
        // One batch after another, then four at once (the relay's lanes).
        let mut outcomes = vec![send().await, send().await];
        outcomes.extend(futures::future::join_all((0..4).map(|_| send())).await);
        for o in &outcomes {
            let err = o[0].clone().unwrap_err();
            assert_eq!(err.kind, FailureKind::Unavailable, "{err}");
            assert!(err.reason.contains("no answer within"), "{err}");
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the batches should share one attempt to connect"
        );
        silent.abort();
    }
}
