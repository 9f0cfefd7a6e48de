//! Extra librdkafka properties (`KafkaConfig::properties`, `postal relay --kafka key=value`)
//! that would silently break what the relay promises are refused before a client is created.
//!
//! The relay deletes (or marks) an outbox row once the broker acknowledged its record, and
//! promises per-key order on the topic. So it needs: acknowledgement by every in-sync replica
//! (`acks=all`), retries that cannot reorder (the idempotent producer with at most 5 requests in
//! flight, or a single request in flight without it), retries at all, and the Java-compatible
//! murmur2 partitioner (every Postal relay and every Kafka client put a key on the same
//! partition; another partitioner moves keys between partitions, and the consumers process
//! partitions independently).

use std::collections::BTreeMap;

use crate::Error;

/// Checks the user's properties on top of Postal's producer defaults; the error names the
/// property, its value and why it is refused.
pub(crate) fn check(properties: &BTreeMap<String, String>) -> Result<(), Error> {
    let get = |names: &[&'static str]| -> Option<(&'static str, &str)> {
        names
            .iter()
            .find_map(|&n| properties.get(n).map(|v| (n, v.trim())))
    };
    let refuse = |key: &str, value: &str, why: &str| {
        Err(Error::Config(format!(
            "Kafka property {key}={value} is refused: {why}"
        )))
    };
    if let Some((k, v)) = get(&["acks", "request.required.acks"]) {
        if !matches!(v.to_ascii_lowercase().as_str(), "all" | "-1") {
            return refuse(
                k,
                v,
                "the relay forgets an event once the broker acknowledged it, and only acks=all keeps acknowledged records through a leader change",
            );
        }
    }
    if let Some((k, v)) = get(&["partitioner"]) {
        if !matches!(v, "murmur2_random" | "murmur2") {
            return refuse(
                k,
                v,
                "per-key order needs every key on the partition Kafka's default (murmur2) partitioner picks; another partitioner moves keys between partitions",
            );
        }
    }
    if let Some((k, v)) = get(&["retries", "message.send.max.retries"]) {
        if v == "0" {
            return refuse(
                k,
                v,
                "without retries a failed request is sent again later by the relay, behind records of the same key sent after it",
            );
        }
    }
    if let Some((k, v)) = get(&["queuing.strategy"]) {
        if v != "fifo" {
            return refuse(k, v, "records must be sent in the order they were produced");
        }
    }
    if let Some((k, v)) = get(&["enable.gapless.guarantee"]) {
        if matches!(v.to_ascii_lowercase().as_str(), "true" | "t" | "1") {
            return refuse(
                k,
                v,
                "it makes the whole producer fatal on one record's permanent error (a topic the relay may not write, a record too large), pausing every topic; the relay keeps per-key order itself by holding back a failed record's key",
            );
        }
    }
    let idempotent = match get(&["enable.idempotence"]) {
        Some((_, v)) => !matches!(v.to_ascii_lowercase().as_str(), "false" | "f" | "0"),
        None => true,
    };
    let in_flight = get(&["max.in.flight.requests.per.connection", "max.in.flight"]);
    let in_flight_n = in_flight.and_then(|(_, v)| v.parse::<i64>().ok());
    if idempotent {
        if let (Some((k, v)), Some(n)) = (in_flight, in_flight_n) {
            if n > 5 {
                return refuse(
                    k,
                    v,
                    "the idempotent producer keeps order across retries only with at most 5 requests in flight",
                );
            }
        }
    } else if in_flight_n != Some(1) {
        let shown = in_flight.map_or("the default 1000000", |(_, v)| v);
        return refuse(
            "enable.idempotence",
            "false",
            &format!(
                "without the idempotent producer a retried request lands behind later ones of the same key unless max.in.flight.requests.per.connection=1 (it is {shown})"
            ),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    /// Creates a relay's Kafka transport (clients connect lazily: no broker needed) with these
    /// extra properties.
    fn transport(pairs: &[(&str, &str)]) -> Result<(), String> {
        let mut config = crate::KafkaConfig::new("127.0.0.1:1");
        for (k, v) in pairs {
            config.properties.insert((*k).into(), (*v).into());
        }
        crate::KafkaTransport::new(config)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// Guarantee: a relay's Kafka transport is not created with an override that breaks
    /// acknowledged-means-durable or per-key order; the error is one line naming the property,
    /// its value and the reason.
    #[test]
    fn ordering_and_durability_breaking_overrides_are_refused() {
        let refused: &[(&[(&str, &str)], &str)] = &[
            (&[("acks", "1")], "acks=1"),
            (&[("acks", "0")], "acks=0"),
            (&[("request.required.acks", "1")], "request.required.acks=1"),
            (
                &[("partitioner", "consistent_random")],
                "partitioner=consistent_random",
            ),
            (&[("partitioner", "fnv1a")], "partitioner=fnv1a"),
            (&[("retries", "0")], "retries=0"),
            (
                &[("message.send.max.retries", "0")],
                "message.send.max.retries=0",
            ),
            (&[("queuing.strategy", "lifo")], "queuing.strategy=lifo"),
            (
                &[("enable.gapless.guarantee", "true")],
                "enable.gapless.guarantee=true",
            ),
            (
                &[("max.in.flight.requests.per.connection", "6")],
                "max.in.flight.requests.per.connection=6",
            ),
            (&[("max.in.flight", "100")], "max.in.flight=100"),
            (
                &[("enable.idempotence", "false")],
                "enable.idempotence=false",
            ),
            (
                &[
                    ("enable.idempotence", "false"),
                    ("max.in.flight.requests.per.connection", "5"),
                ],
                "enable.idempotence=false",
            ),
        ];
        for (pairs, named) in refused {
            let err = transport(pairs).unwrap_err();
            assert!(err.contains(named), "{pairs:?}: {err}");
            assert!(err.contains("is refused: "), "{pairs:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{pairs:?}: one line: {err}");
        }
    }

    /// Guarantee: overrides that keep the relay's guarantees (including stricter or equivalent
    /// values of the checked properties) still create the transport.
    #[test]
    fn safe_overrides_are_accepted() {
        let accepted: &[&[(&str, &str)]] = &[
            &[],
            &[("compression.type", "gzip"), ("linger.ms", "5")],
            &[("acks", "all")],
            &[("acks", "-1")],
            &[("partitioner", "murmur2")],
            &[("partitioner", "murmur2_random")],
            &[("retries", "5")],
            &[("max.in.flight.requests.per.connection", "5")],
            &[("enable.idempotence", "true"), ("max.in.flight", "1")],
            &[
                ("enable.idempotence", "false"),
                ("max.in.flight.requests.per.connection", "1"),
            ],
            &[("enable.gapless.guarantee", "false")],
        ];
        for pairs in accepted {
            transport(pairs).unwrap_or_else(|e| panic!("{pairs:?}: {e}"));
        }
    }
}
