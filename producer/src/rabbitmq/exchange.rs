//! Exchanges: declared (or checked) before their first publish; a refusal is remembered
//! for a while and checked again.

use std::time::Duration;

use lapin::options::ExchangeDeclareOptions;
use lapin::protocol::AMQPSoftError;
use lapin::types::FieldTable;
use lapin::ExchangeKind;

use crate::transport::{FailureKind, PublishError};

use super::failure::{soft_error, unavailable};
use super::link::{bounded, no_answer, Link};
use super::RabbitTransport;

impl RabbitTransport {
    /// Declares (or, with declaration disabled, checks) the exchange of `topic`, on a channel
    /// of its own: a refused declaration closes the channel it was made on.
    pub(super) async fn ensure_exchange(
        &self,
        link: &Link,
        topic: &str,
    ) -> Result<(), PublishError> {
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
}

#[derive(Clone, Debug)]
pub(super) enum ExchangeState {
    Ready,
    /// Refused, with when it was found out and how long the verdict holds: a refused
    /// declaration is checked again after [`REFUSED_RECHECK`]; a refused publish (the
    /// declaration passes, so only a publish can tell) after [`PUBLISH_REFUSED_RECHECK`].
    Refused(String, std::time::Instant, Duration),
}

pub(super) fn refused(reason: String) -> ExchangeState {
    ExchangeState::Refused(reason, std::time::Instant::now(), REFUSED_RECHECK)
}

/// How long a refused exchange (missing with declaration disabled, declared with other
/// settings, access refused) is taken as refused before it is checked again: fixing the broker
/// un-sticks its events within this time.
pub(super) const REFUSED_RECHECK: Duration = Duration::from_secs(1);

/// How long a refused publish keeps its exchange's events from being published at all (they
/// wait, as the refused event does, instead of closing the channel under every batch beside
/// them).
pub(super) const PUBLISH_REFUSED_RECHECK: Duration = Duration::from_secs(60);
