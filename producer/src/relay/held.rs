//! Events the key chain holds back: which of a claimed batch go out, and its outcomes with the
//! held-back ones merged in.

use crate::transport::{FailureKind, OutboundEvent, PublishError};

/// The events to hand over: all, unless the chain holds some back (`held`, per event; empty
/// when none was).
pub(super) fn unheld(batch: &[OutboundEvent], held: &[bool]) -> Vec<OutboundEvent> {
    if held.iter().any(|h| *h) {
        batch
            .iter()
            .zip(held)
            .filter(|(_, h)| !**h)
            .map(|(e, _)| e.clone())
            .collect()
    } else {
        batch.to_vec()
    }
}

/// The outcomes of a claimed batch of which the key chain held some events back (`held`, per
/// event; empty when none was): the handed-over events' outcomes from the transport, in
/// order, and `HeldBack` for the others (released for a later claim without an attempt).
pub(super) fn merge_held<A>(
    handed: Option<A>,
    held: Vec<bool>,
) -> futures::future::BoxFuture<'static, Vec<Result<(), PublishError>>>
where
    A: std::future::Future<Output = Vec<Result<(), PublishError>>> + Send + 'static,
{
    use futures::FutureExt as _;
    async move {
        let mut sent = match handed {
            Some(acks) => acks.await,
            None => Vec::new(),
        }
        .into_iter();
        if held.is_empty() {
            return sent.collect();
        }
        held.into_iter()
            .map(|h| {
                if h {
                    Err(PublishError::new(
                        FailureKind::HeldBack,
                        "an earlier event of this key failed in another batch",
                    ))
                } else {
                    sent.next().unwrap_or_else(|| {
                        Err(PublishError::new(
                            FailureKind::Unavailable,
                            "the destination returned no outcome",
                        ))
                    })
                }
            })
            .collect()
    }
    .boxed()
}
