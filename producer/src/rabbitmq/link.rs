//! The connection: opened lazily in a task of its own, bounded in time, re-opened after a
//! loss; one confirm-mode channel per batch.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::types::LongString;
use lapin::{Channel, Connection, ConnectionProperties};

use crate::transport::{FailureKind, PublishError};

use super::config::redact_uri;
use super::failure::unavailable;
use super::RabbitTransport;

impl RabbitTransport {
    /// The open link, or the one the attempt in progress opens within `connect_timeout`.
    pub(super) async fn link(&self) -> Result<Arc<Link>, PublishError> {
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
}

/// The open connection (each batch publishes on a confirm-mode channel of its own).
pub(super) struct Link {
    pub(super) connection: Connection,
}

impl Link {
    pub(super) fn usable(&self) -> bool {
        self.connection.status().connected()
    }
}

/// The outcome of an attempt to open the link, once there is one.
pub(super) type Opened = Option<Result<Arc<Link>, PublishError>>;

/// The link, or the attempt to open one.
pub(super) enum LinkSlot {
    Closed,
    Open(Arc<Link>),
    Opening {
        result: tokio::sync::watch::Receiver<Opened>,
        started: std::time::Instant,
        attempt: u64,
    },
}

/// Opens a connection and reports the outcome through `done`.
/// Runs to the end in a task of its own (see [`RabbitConfig::connect_timeout`]); an outcome
/// nobody waits for any more is dropped, which closes its connection.
pub(super) async fn open_link(uri: String, done: tokio::sync::watch::Sender<Opened>) {
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
pub(super) fn no_answer(what: &str, limit: Duration) -> PublishError {
    PublishError::new(
        FailureKind::Unavailable,
        format!("{what}: no answer within {limit:?}"),
    )
}

/// Runs one AMQP operation for at most `limit`: an error or no answer is "unavailable".
pub(super) async fn bounded<T>(
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
pub(super) async fn close(limit: Duration, connection: &Connection, code: u16, reason: &str) {
    if tokio::time::timeout(limit, connection.close(code, reason.into()))
        .await
        .is_err()
    {
        tracing::warn!(timeout = ?limit, "RabbitMQ did not answer the connection close in time; no longer waiting for it");
    }
}

/// Opens a confirm-mode channel for one batch.
pub(super) async fn batch_channel(link: &Link, limit: Duration) -> Result<Channel, PublishError> {
    let channel = bounded(limit, "opening a channel", link.connection.create_channel()).await?;
    bounded(
        limit,
        "enabling publisher confirms",
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    Ok(channel)
}
