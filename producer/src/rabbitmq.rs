//! The RabbitMQ transport: persistent messages on durable topic exchanges, with publisher
//! confirms awaited per batch before any row is marked.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use postal_shared::headers as h;

use crate::transport::{FailureKind, OutboundEvent, PublishError, Transport};
use crate::Error;

/// Settings of the RabbitMQ transport.
#[derive(Clone)]
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
fn redact_uri(uri: &str) -> String {
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

#[derive(Clone, Debug)]
enum ExchangeState {
    Ready,
    /// Refused, with when it was found out and how long the verdict holds: a refused
    /// declaration is checked again after [`REFUSED_RECHECK`]; a refused publish (the
    /// declaration passes, so only a publish can tell) after [`PUBLISH_REFUSED_RECHECK`].
    Refused(String, std::time::Instant, Duration),
}

/// The open connection (each batch publishes on a confirm-mode channel of its own).
struct Link {
    connection: Connection,
}

impl Link {
    fn usable(&self) -> bool {
        self.connection.status().connected()
    }
}

/// The outcome of an attempt to open the link, once there is one.
type Opened = Option<Result<Arc<Link>, PublishError>>;

/// The link, or the attempt to open one.
enum LinkSlot {
    Closed,
    Open(Arc<Link>),
    Opening {
        result: tokio::sync::watch::Receiver<Opened>,
        started: std::time::Instant,
        attempt: u64,
    },
}

/// Publishes outbox events to RabbitMQ.
///
/// Message layout: exchange = the event's topic (a durable `topic` exchange), routing key =
/// the event type (or its configured mapping), body = payload, persistent (`delivery-mode` 2),
/// `message-id` = event id, `type` = event type, `content-type`, `timestamp` = occurred-at
/// (seconds), `app-id` = source, and the same headers as Kafka records: `ce_id`, `ce_type`,
/// `ce_source`, `ce_time`, `ce_specversion`, `ce_subject` (key), `ce_schemaversion`,
/// `ce_postalseq`, `content-type`, then user headers (including `traceparent`).
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

    /// The open link, or the one the attempt in progress opens within `connect_timeout`.
    async fn link(&self) -> Result<Arc<Link>, PublishError> {
        let limit = self.config.connect_timeout;
        let (mut result, attempt) = {
            let mut slot = self.link.lock().expect("link slot");
            let pending = match &*slot {
                LinkSlot::Open(link) if link.usable() => return Ok(link.clone()),
                LinkSlot::Open(_) => {
                    tracing::info!("RabbitMQ connection or channel closed; reconnecting");
                    None
                }
                LinkSlot::Opening {
                    result,
                    started,
                    attempt,
                } => {
                    // An attempt that has an outcome is used whatever its age.
                    if started.elapsed() < limit * 6 || result.borrow().is_some() {
                        Some((result.clone(), *attempt))
                    } else {
                        tracing::warn!(waited = ?started.elapsed(), "RabbitMQ has not answered a connection attempt; leaving it and starting another");
                        None
                    }
                }
                LinkSlot::Closed => None,
            };
            match pending {
                Some(p) => p,
                None => {
                    let attempt = self.attempts.fetch_add(1, Ordering::Relaxed);
                    let (done, result) = tokio::sync::watch::channel(None);
                    tokio::spawn(open_link(self.config.uri.clone(), done));
                    *slot = LinkSlot::Opening {
                        result: result.clone(),
                        started: std::time::Instant::now(),
                        attempt,
                    };
                    (result, attempt)
                }
            }
        };
        let opened = match tokio::time::timeout(limit, result.wait_for(Option::is_some)).await {
            Err(_) => return Err(no_answer("connecting to RabbitMQ", limit)),
            Ok(Ok(opened)) => opened.clone().expect("waited for an outcome"),
            Ok(Err(_)) => Err(PublishError::new(
                FailureKind::Unavailable,
                "connecting to RabbitMQ: the attempt ended without an outcome",
            )),
        };
        let mut slot = self.link.lock().expect("link slot");
        // The first to see the attempt's outcome records it.
        if matches!(&*slot, LinkSlot::Opening { attempt: a, .. } if *a == attempt) {
            *slot = match &opened {
                Ok(link) => {
                    // Exchanges may have been deleted while we were away: check them again.
                    self.exchanges.lock().expect("exchange cache").clear();
                    tracing::info!(uri = %redact_uri(&self.config.uri), "connected to RabbitMQ");
                    LinkSlot::Open(link.clone())
                }
                Err(_) => LinkSlot::Closed,
            };
        }
        opened
    }

    /// Declares (or, with declaration disabled, checks) the exchange of `topic`, on a channel
    /// of its own: a refused declaration closes the channel it was made on.
    async fn ensure_exchange(&self, link: &Link, topic: &str) -> Result<(), PublishError> {
        let cached = self
            .exchanges
            .lock()
            .expect("exchange cache")
            .get(topic)
            .cloned();
        match cached {
            Some(ExchangeState::Ready) => return Ok(()),
            Some(ExchangeState::Refused(reason, at, holds)) if at.elapsed() < holds => {
                return Err(PublishError::new(FailureKind::Waiting, reason));
            }
            // Not known yet, or refused a while ago: the operator may have fixed it since.
            _ => {}
        }
        let limit = self.config.connect_timeout;
        let channel = bounded(limit, "opening a channel", link.connection.create_channel()).await?;
        let options = ExchangeDeclareOptions {
            durable: true,
            passive: !self.config.declare_exchanges,
            ..ExchangeDeclareOptions::default()
        };
        let declared = tokio::time::timeout(
            limit,
            channel.exchange_declare(
                topic.into(),
                ExchangeKind::Topic,
                options,
                FieldTable::default(),
            ),
        )
        .await
        .map_err(|_| no_answer(&format!("declaring exchange {topic:?}"), limit))?;
        let state = match declared {
            Ok(()) => {
                let _ = tokio::time::timeout(limit, channel.close(200, "declared".into())).await;
                ExchangeState::Ready
            }
            Err(e) => match soft_error(&e) {
                Some(AMQPSoftError::NOTFOUND) => refused(format!(
                    "exchange {topic:?} does not exist and exchange declaration is disabled: create it (a durable topic exchange: rabbitmqadmin declare exchange name={topic} type=topic durable=true); its events wait until it exists"
                )),
                Some(AMQPSoftError::PRECONDITIONFAILED) => refused(format!(
                    "exchange {topic:?} exists with other settings (Postal needs a durable topic exchange; {e}): recreate it as one; its events wait until then"
                )),
                Some(AMQPSoftError::ACCESSREFUSED) => refused(format!(
                    "not allowed to use exchange {topic:?} ({e}): grant the relay's user configure/write permission on it; its events wait until then"
                )),
                _ => return Err(unavailable(&format!("declaring exchange {topic:?}"), &e)),
            },
        };
        if let ExchangeState::Ready = state {
            tracing::debug!(exchange = topic, "exchange ready");
        }
        self.exchanges
            .lock()
            .expect("exchange cache")
            .insert(topic.to_owned(), state.clone());
        match state {
            ExchangeState::Ready => Ok(()),
            // The exchange's problem, not the event's: its events wait (retried every minute,
            // without using attempts), as for a missing Kafka topic.
            ExchangeState::Refused(reason, _, _) => {
                tracing::warn!(exchange = topic, "{reason}");
                Err(PublishError::new(FailureKind::Waiting, reason))
            }
        }
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

fn refused(reason: String) -> ExchangeState {
    ExchangeState::Refused(reason, std::time::Instant::now(), REFUSED_RECHECK)
}

fn soft_error(e: &lapin::Error) -> Option<AMQPSoftError> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => match p.kind() {
            AMQPErrorKind::Soft(s) => Some(s.clone()),
            AMQPErrorKind::Hard(_) => None,
        },
        _ => None,
    }
}

fn unavailable(what: &str, e: &lapin::Error) -> PublishError {
    PublishError::new(FailureKind::Unavailable, format!("{what}: {e}"))
}

/// What a channel closed while publishing to `exchange` means for that message. The broker
/// closes the channel with ACCESS_REFUSED or NOT_FOUND when the relay may not publish to an
/// exchange (it may declare it but not write to it) or the exchange is gone: that exchange's
/// events wait, like a missing Kafka topic, instead of pausing the relay as an outage; the
/// other messages on the channel are released for the next claim without an attempt.
/// Anything else is the broker being unavailable.
fn lost(what: &str, e: &lapin::Error, exchange: &str) -> PublishError {
    match soft_error(e) {
        Some(AMQPSoftError::ACCESSREFUSED | AMQPSoftError::NOTFOUND) => {
            // The broker names the exchange as `exchange 'X'` (its text also quotes the vhost
            // and the user, which may be named like another exchange).
            if e.to_string().contains(&format!("exchange '{exchange}'")) {
                PublishError::new(
                    FailureKind::Waiting,
                    format!(
                        "RabbitMQ refused publishing to exchange {exchange:?} ({e}): grant the relay's user write permission on it, or create it; its events wait until then"
                    ),
                )
            } else {
                PublishError::new(
                    FailureKind::HeldBack,
                    format!(
                        "not confirmed: RabbitMQ closed the channel over another exchange ({e})"
                    ),
                )
            }
        }
        // The broker is closing the channel (its reason reaches the message that caused it):
        // not sent, to be claimed again without an attempt.
        _ if matches!(e.kind(), lapin::ErrorKind::InvalidChannelState(..)) => PublishError::new(
            FailureKind::HeldBack,
            format!("not sent: the channel was closing ({e})"),
        ),
        _ => unavailable(what, e),
    }
}

/// Opens a connection and reports the outcome through `done`.
/// Runs to the end in a task of its own (see [`RabbitConfig::connect_timeout`]); an outcome
/// nobody waits for any more is dropped, which closes its connection.
async fn open_link(uri: String, done: tokio::sync::watch::Sender<Opened>) {
    let opened = async {
        let props =
            ConnectionProperties::default().with_connection_name(LongString::from("postal-relay"));
        let connection = Connection::connect(&uri, props)
            .await
            .map_err(|e| unavailable("connecting to RabbitMQ", &e))?;
        Ok(Arc::new(Link { connection }))
    }
    .await;
    let _ = done.send(Some(opened));
}

/// An operation that got no answer within `limit`.
fn no_answer(what: &str, limit: Duration) -> PublishError {
    PublishError::new(
        FailureKind::Unavailable,
        format!("{what}: no answer within {limit:?}"),
    )
}

/// Runs one AMQP operation for at most `limit`: an error or no answer is "unavailable".
async fn bounded<T>(
    limit: Duration,
    what: &str,
    op: impl std::future::Future<Output = Result<T, lapin::Error>>,
) -> Result<T, PublishError> {
    match tokio::time::timeout(limit, op).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(unavailable(what, &e)),
        Err(_) => Err(no_answer(what, limit)),
    }
}

/// Closes a connection, waiting at most `limit` for the broker's answer (a broker that stopped
/// answering would otherwise hold the caller forever).
async fn close(limit: Duration, connection: &Connection, code: u16, reason: &str) {
    if tokio::time::timeout(limit, connection.close(code, reason.into()))
        .await
        .is_err()
    {
        tracing::warn!(timeout = ?limit, "RabbitMQ did not answer the connection close in time; no longer waiting for it");
    }
}

type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

/// How long a refused exchange (missing with declaration disabled, declared with other
/// settings, access refused) is taken as refused before it is checked again: fixing the broker
/// un-sticks its events within this time.
const REFUSED_RECHECK: Duration = Duration::from_secs(1);

/// How long a refused publish keeps its exchange's events from being published at all (they
/// wait, as the refused event does, instead of closing the channel under every batch beside
/// them).
const PUBLISH_REFUSED_RECHECK: Duration = Duration::from_secs(60);

/// One event of a batch, ready to publish (owned: the publishing runs in the acks future).
struct Prepared {
    index: usize,
    /// Its key's queue in [`BatchRun::keys`].
    slot: usize,
    id: String,
    exchange: String,
    routing_key: String,
    payload: Vec<u8>,
    properties: BasicProperties,
}

/// What the broker said about one published message of a round.
enum Heard {
    Ack,
    Nack,
    /// The channel or connection failed.
    Lost(PublishError),
    /// No confirm within the confirm timeout.
    TimedOut,
}

fn blocked_error() -> PublishError {
    PublishError::new(
        FailureKind::Unavailable,
        "RabbitMQ blocks publishing on this connection (a resource alarm: memory or disk)",
    )
}

/// Publishes a batch on its own confirm-mode channel, in rounds: a round sends the next event
/// of every key that is still clear and waits for all its confirms. So per key at most one
/// message is unconfirmed at a time (other keys pipeline within the round), and a key whose
/// message was nacked, returned or lost sends nothing more in this batch: its later events are
/// held back, as RabbitMQ cannot take back a message once sent.
///
/// Returned (unroutable) messages are matched to events by their message id (the event id),
/// never by which confirm lapin attached them to: lapin hands the oldest waiting return to
/// whichever confirm it resolves next. Once every confirm of the channel resolved, every
/// return the broker sent for them is attached to one of them (the broker sends a message's
/// return before its ack), so after a round all its returns are known.
struct BatchRun {
    link: Arc<Link>,
    channel: Channel,
    /// Per key, its events' indexes into `prepared`, in batch order.
    keys: Vec<std::collections::VecDeque<usize>>,
    prepared: Vec<Prepared>,
    outcomes: Vec<Option<Result<(), PublishError>>>,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    exchanges: Arc<Mutex<HashMap<String, ExchangeState>>>,
}

impl BatchRun {
    async fn run(mut self) -> Vec<Result<(), PublishError>> {
        let mut failure: Option<PublishError> = None;
        // The exchange whose refusal `failure` is, when it is one (its events wait).
        let mut refused_exchange: Option<String> = None;
        let mut timed_out = false;
        loop {
            let round: Vec<usize> = self
                .keys
                .iter_mut()
                .filter_map(std::collections::VecDeque::pop_front)
                .collect();
            if round.is_empty() {
                break;
            }
            let deadline = tokio::time::Instant::now() + self.confirm_timeout;
            let mut confirms = Vec::with_capacity(round.len());
            let mut unsent = Vec::new();
            for &p in &round {
                if failure.is_some() {
                    unsent.push(p);
                    continue;
                }
                if self.link.connection.status().blocked() {
                    failure = Some(blocked_error());
                    unsent.push(p);
                    continue;
                }
                let m = &self.prepared[p];
                // Handing a message over can wait on the broker's flow control: bounded like
                // a confirm.
                let published = tokio::time::timeout_at(
                    deadline,
                    self.channel.basic_publish(
                        m.exchange.as_str().into(),
                        m.routing_key.as_str().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &m.payload,
                        m.properties.clone(),
                    ),
                )
                .await;
                match published {
                    Ok(Ok(confirm)) => confirms.push((p, confirm)),
                    Ok(Err(e)) => {
                        let err = lost("publishing", &e, &m.exchange);
                        if err.kind == FailureKind::Waiting {
                            refused_exchange = Some(m.exchange.clone());
                            self.publish_refused(&m.exchange, &err.reason);
                        }
                        failure = Some(err);
                        unsent.push(p);
                    }
                    Err(_) => {
                        timed_out = true;
                        failure = Some(no_answer("publishing", self.confirm_timeout));
                        unsent.push(p);
                    }
                }
            }
            // Every confirm of the round, each until the round's deadline.
            let prepared = &self.prepared;
            let heard = join_all(confirms.into_iter().map(|(p, confirm)| async move {
                match tokio::time::timeout_at(deadline, confirm).await {
                    Ok(Ok(Confirmation::Ack(r))) => (p, Heard::Ack, r),
                    Ok(Ok(Confirmation::Nack(r))) => (p, Heard::Nack, r),
                    Ok(Ok(Confirmation::NotRequested)) => (
                        p,
                        Heard::Lost(PublishError::new(
                            FailureKind::Unavailable,
                            "publisher confirms are not enabled on the channel",
                        )),
                        None,
                    ),
                    Ok(Err(e)) => (
                        p,
                        Heard::Lost(lost(
                            "awaiting the publisher confirm",
                            &e,
                            &prepared[p].exchange,
                        )),
                        None,
                    ),
                    Err(_) => (p, Heard::TimedOut, None),
                }
            }))
            .await;
            let mut returned: HashMap<String, String> = HashMap::new();
            let mut anonymous_returns = 0usize;
            for (_, _, r) in &heard {
                if let Some(r) = r {
                    let reason = format!("{} {}", r.reply_code, r.reply_text);
                    match r.properties.message_id() {
                        Some(id) => {
                            returned.insert(id.as_str().to_owned(), reason);
                        }
                        None => anonymous_returns += 1,
                    }
                }
            }
            let round_ids: HashSet<&str> = heard
                .iter()
                .map(|(p, _, _)| self.prepared[*p].id.as_str())
                .collect();
            let strays = returned
                .keys()
                .filter(|id| !round_ids.contains(id.as_str()))
                .count();
            if strays + anonymous_returns > 0 {
                // Cannot happen on a channel of our own; if it does, no acked message of the
                // round may count as published.
                tracing::error!(
                    strays,
                    anonymous_returns,
                    "RabbitMQ returned messages that match no event of the round"
                );
            }
            for (p, heard, _) in heard {
                let m = &self.prepared[p];
                let outcome = match heard {
                    Heard::Ack if strays + anonymous_returns > 0 => Err(PublishError::new(
                        FailureKind::Unavailable,
                        "RabbitMQ returned a message that could not be matched to its event",
                    )),
                    Heard::Ack => match returned.get(&m.id) {
                        None => Ok(()),
                        Some(reason) => Err(PublishError::new(
                            FailureKind::Transient,
                            format!(
                                "unroutable: exchange {:?} has no queue bound for routing key {:?} ({reason})",
                                m.exchange, m.routing_key
                            ),
                        )),
                    },
                    Heard::Nack => Err(PublishError::new(
                        FailureKind::Transient,
                        "RabbitMQ nacked the message (it could not store it)",
                    )),
                    Heard::TimedOut => {
                        timed_out = true;
                        let err = PublishError::new(
                            FailureKind::Unavailable,
                            format!("no publisher confirm within {:?}", self.confirm_timeout),
                        );
                        if failure.is_none() {
                            failure = Some(err.clone());
                        }
                        Err(err)
                    }
                    Heard::Lost(err) => {
                        if err.kind == FailureKind::Waiting {
                            self.publish_refused(&m.exchange, &err.reason);
                        }
                        if failure.is_none() {
                            if err.kind == FailureKind::Waiting {
                                refused_exchange = Some(m.exchange.clone());
                            }
                            failure = Some(err.clone());
                        }
                        Err(err)
                    }
                };
                let index = m.index;
                if outcome.is_err() {
                    self.clear_key_of(p);
                }
                self.outcomes[index] = Some(outcome);
            }
            for p in unsent {
                let mut err = failure.clone().expect("unsent only after a failure");
                if err.kind == FailureKind::Waiting
                    && refused_exchange.as_deref() != Some(self.prepared[p].exchange.as_str())
                {
                    // Another exchange's refusal closed the channel: not this one's problem.
                    err = PublishError::new(
                        FailureKind::HeldBack,
                        "not sent: RabbitMQ closed the channel over another exchange",
                    );
                }
                self.clear_key_of(p);
                self.outcomes[self.prepared[p].index] = Some(Err(err));
            }
            if failure.is_some() {
                // Whatever is left is not sent on this channel.
                break;
            }
        }
        // Events never sent: behind a failed event of their key (held back), or left when the
        // channel failed (unavailable).
        for q in &self.keys {
            for &p in q {
                let err = match &failure {
                    Some(f) => f.clone(),
                    None => PublishError::new(
                        FailureKind::HeldBack,
                        "an earlier event of this key failed",
                    ),
                };
                self.outcomes[self.prepared[p].index] = Some(Err(err));
            }
        }
        self.finish(failure.is_some(), timed_out).await;
        self.outcomes
            .into_iter()
            .map(|o| o.expect("every event has an outcome"))
            .collect()
    }

    /// The event `p` failed: the later events of its key in the batch are held back.
    /// Notes that the broker refused a publish to `exchange`: its later events wait without
    /// being published for [`PUBLISH_REFUSED_RECHECK`].
    fn publish_refused(&self, exchange: &str, reason: &str) {
        self.exchanges.lock().expect("exchange cache").insert(
            exchange.to_owned(),
            ExchangeState::Refused(
                reason.to_owned(),
                std::time::Instant::now(),
                PUBLISH_REFUSED_RECHECK,
            ),
        );
    }

    fn clear_key_of(&mut self, p: usize) {
        let slot = self.prepared[p].slot;
        for later in std::mem::take(&mut self.keys[slot]) {
            self.outcomes[self.prepared[later].index] = Some(Err(PublishError::new(
                FailureKind::HeldBack,
                "an earlier event of this key failed",
            )));
        }
    }

    /// Closes the batch's channel. A channel that failed may mean a deleted exchange (the
    /// broker closes the channel with NOT_FOUND): the exchanges are checked again. A connection
    /// that failed or stopped answering is closed (the next batch opens a fresh one), unless
    /// the broker blocks it (a resource alarm): a blocked connection cannot even send its
    /// close, so it is kept, and used again once the broker unblocks it, instead of leaving a
    /// blocked connection behind per retry whose buffered messages arrive later.
    async fn finish(&self, failed: bool, timed_out: bool) {
        let blocked = self.link.connection.status().blocked();
        if failed && !self.channel.status().connected() {
            // Ready exchanges are checked again; refusals keep their own time.
            self.exchanges
                .lock()
                .expect("exchange cache")
                .retain(|_, state| matches!(state, ExchangeState::Refused(..)));
        }
        if blocked {
            // Closes once the broker unblocks the connection (or the connection ends).
            let channel = self.channel.clone();
            tokio::spawn(async move {
                let _ = channel.close(200, "batch done".into()).await;
            });
            return;
        }
        if self.channel.status().connected() && !timed_out {
            let _ = tokio::time::timeout(
                self.connect_timeout,
                self.channel.close(200, "batch done".into()),
            )
            .await;
        }
        if timed_out || !self.link.usable() {
            close(
                self.connect_timeout,
                &self.link.connection,
                320,
                "postal relay reconnects",
            )
            .await;
        }
    }
}

/// Opens a confirm-mode channel for one batch.
async fn batch_channel(link: &Link, limit: Duration) -> Result<Channel, PublishError> {
    let channel = bounded(limit, "opening a channel", link.connection.create_channel()).await?;
    bounded(
        limit,
        "enabling publisher confirms",
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    Ok(channel)
}

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
        // Refused before sending: the later events of their keys are held back.
        let mut outcomes: Vec<Option<Result<(), PublishError>>> = vec![None; batch.len()];
        let mut blocked: HashSet<&str> = HashSet::new();
        let mut slots: HashMap<&str, usize> = HashMap::new();
        let mut keys: Vec<std::collections::VecDeque<usize>> = Vec::new();
        let mut prepared = Vec::new();
        for (index, e) in batch.iter().enumerate() {
            let refused = if blocked.contains(e.key.as_str()) {
                Some(PublishError::new(
                    FailureKind::HeldBack,
                    "an earlier event of this key failed",
                ))
            } else if let Err(err) = &exchange_ok[e.topic.as_str()] {
                Some(err.clone())
            } else if let Some(err) = crate::transport::reserved_header(e) {
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
            if let Some(err) = refused {
                blocked.insert(e.key.as_str());
                outcomes[index] = Some(Err(err));
                continue;
            }
            let slot = *slots.entry(e.key.as_str()).or_insert_with(|| {
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
                properties: self.properties(e),
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
