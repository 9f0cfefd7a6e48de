//! Which topics a relay may publish to — and so create (Kafka topics, RabbitMQ exchanges).
//! Anyone who can write the outbox names the topic of a row; without a limit the relay would
//! publish to, and create, whatever name a row carries, a consumer group's dead-letter topic
//! included. An event whose topic is refused is parked with the reason (its key's later events
//! wait behind it); nothing is created for it.

use crate::transport::{FailureKind, PublishError};

/// The topics a relay may publish to: every topic except dead-letter topics (the default), or
/// only those an allow-list names — exact names or `prefix*` patterns (`*` alone: every
/// topic). A dead-letter topic (`….dlq`) is allowed only when the list names it exactly
/// (`orders.dlq`), never by a pattern.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopicAllowList {
    /// `None`: every topic except dead-letter topics.
    patterns: Option<Vec<String>>,
}

/// The suffix of the dead-letter topics the consumer runtime writes (`<topic>.dlq`).
const DEAD_LETTER_SUFFIX: &str = ".dlq";

impl TopicAllowList {
    /// Every topic except dead-letter topics (the default).
    pub fn any() -> Self {
        TopicAllowList { patterns: None }
    }

    /// Only the topics named, exactly or as `prefix*`. Errors on an empty list, an empty
    /// entry, or a `*` anywhere but at the end.
    pub fn only<I, S>(patterns: I) -> Result<Self, crate::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let patterns: Vec<String> = patterns
            .into_iter()
            .map(Into::into)
            .map(|p| p.trim().to_owned())
            .collect();
        if patterns.is_empty() {
            return Err(crate::Error::Config(
                "a topic allow-list needs at least one topic or prefix*".into(),
            ));
        }
        for p in &patterns {
            let stem = p.strip_suffix('*').unwrap_or(p);
            if stem.is_empty() && p != "*" {
                return Err(crate::Error::Config(
                    "a topic allow-list entry is empty".into(),
                ));
            }
            if stem.contains('*') {
                return Err(crate::Error::Config(format!(
                    "topic allow-list entry {} may have `*` only at its end",
                    postal_shared::text::quoted(p)
                )));
            }
        }
        Ok(TopicAllowList {
            patterns: Some(patterns),
        })
    }

    /// Why the relay may not publish to `topic`, or `None` when it may.
    pub fn refusal(&self, topic: &str) -> Option<String> {
        let named_exactly = |ps: &[String]| ps.iter().any(|p| p == topic);
        let matched = |ps: &[String]| {
            ps.iter().any(|p| match p.strip_suffix('*') {
                Some(prefix) => topic.starts_with(prefix),
                None => p == topic,
            })
        };
        let shown = postal_shared::text::quoted(topic);
        match &self.patterns {
            _ if topic.ends_with(DEAD_LETTER_SUFFIX)
                && !self.patterns.as_deref().is_some_and(named_exactly) =>
            {
                Some(format!(
                    "topic {shown} is a dead-letter topic: the relay publishes to one only when \
                     the topic allow-list (--allow-topics) names it exactly"
                ))
            }
            Some(ps) if !matched(ps) => Some(format!(
                "topic {shown} is not in this relay's topic allow-list (--allow-topics)"
            )),
            _ => None,
        }
    }

    /// The refusal as a publish error: permanent (the event is parked with it).
    pub(crate) fn check(&self, topic: &str) -> Result<(), PublishError> {
        match self.refusal(topic) {
            Some(reason) => Err(PublishError::new(FailureKind::Permanent, reason)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: by default every topic but a dead-letter topic is allowed; an allow-list
    /// allows exactly its names and prefixes, and a dead-letter topic only when named exactly.
    #[test]
    fn allow_lists_match_names_and_prefixes_and_keep_dead_letter_topics_out() {
        let any = TopicAllowList::any();
        assert_eq!(any.refusal("orders"), None);
        assert!(any
            .refusal("orders.dlq")
            .unwrap()
            .contains("dead-letter topic"));
        let only = TopicAllowList::only(["orders", "billing.*", "orders.dlq"]).unwrap();
        assert_eq!(only.refusal("orders"), None);
        assert_eq!(only.refusal("billing.invoices"), None);
        assert_eq!(only.refusal("orders.dlq"), None);
        assert!(only.refusal("billing.invoices.dlq").is_some());
        assert!(only.refusal("ordersx").unwrap().contains("allow-list"));
        assert!(TopicAllowList::only(["*"])
            .unwrap()
            .refusal("x.dlq")
            .is_some());
        assert!(TopicAllowList::only(Vec::<String>::new()).is_err());
        assert!(TopicAllowList::only(["a*b"]).is_err());
        assert!(TopicAllowList::only([""]).is_err());
    }
}
