use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Error;

/// The identity of one event, assigned once when it is enqueued and carried unchanged through
/// the outbox, every publish attempt and the consumer's dedup table. A UUIDv7, so ids sort by
/// creation time.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, sqlx::Type,
)]
#[serde(transparent)]
#[sqlx(transparent)]
pub struct EventId(Uuid);

impl EventId {
    /// A fresh time-ordered (v7) id.
    pub fn new() -> Self {
        EventId(Uuid::now_v7())
    }

    /// Wraps an existing id (for example one supplied by the caller for idempotent retries).
    /// The nil UUID is rejected: it cannot identify an event.
    pub fn from_uuid(id: Uuid) -> Result<Self, Error> {
        if id.is_nil() {
            return Err(Error::invalid(
                "event id",
                "the nil UUID is not an event id",
            ));
        }
        Ok(EventId(id))
    }

    /// The id of an event that handling `input` emits, derived from the input's id and a name
    /// for the output (e.g. its event type): the same input always yields the same output id
    /// (a name-based UUIDv5 in the input id's namespace). A consume-transform-produce handler
    /// that derives its output ids this way emits the same event again if its input is ever
    /// applied again (a replay past the dedup retention, a dead letter replayed), so the next
    /// hop recognises it as a duplicate instead of applying a second output. Enqueue such
    /// events with `postal_producer::enqueue_once`.
    pub fn derived(input: EventId, name: &str) -> Self {
        // A v5 UUID is never nil (its version bits are set).
        EventId(Uuid::new_v5(&input.0, name.as_bytes()))
    }

    /// The underlying UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for EventId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let id = Uuid::parse_str(s.trim())
            .map_err(|e| Error::invalid("event id", format!("{s:?} is not a UUID: {e}")))?;
        EventId::from_uuid(id)
    }
}

impl From<EventId> for Uuid {
    fn from(id: EventId) -> Uuid {
        id.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A derived id depends only on the input id and the name: the same pair always gives the
    /// same id, a different input or name a different one.
    #[test]
    fn derived_ids_are_stable_and_distinct() {
        let input = EventId::new();
        let a = EventId::derived(input, "invoice.created");
        assert_eq!(a, EventId::derived(input, "invoice.created"));
        assert_ne!(a, EventId::derived(input, "invoice.sent"));
        assert_ne!(a, EventId::derived(EventId::new(), "invoice.created"));
        assert_ne!(a, input);
        assert!(!a.as_uuid().is_nil());
    }

    #[test]
    fn new_ids_are_v7_and_ordered() {
        let a = EventId::new();
        let b = EventId::new();
        assert_eq!(a.as_uuid().get_version_num(), 7);
        assert!(a < b, "v7 ids created later sort later");
    }

    #[test]
    fn parse_rejects_garbage_and_nil() {
        assert!("not-a-uuid".parse::<EventId>().is_err());
        assert!(Uuid::nil().to_string().parse::<EventId>().is_err());
        let id = EventId::new();
        assert_eq!(id.to_string().parse::<EventId>().unwrap(), id);
    }
}
