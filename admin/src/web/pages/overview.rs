//! The overview: counts, the last hour, backlog, relays, consumers, dead letters.

use std::fmt::Write as _;

use axum::extract::State as Extract;
use axum::response::{Html, IntoResponse, Response};

use crate::overview;
use crate::web::form::failed;
use crate::web::html::{age, bars, esc, page, q, table};
use crate::web::State;

pub(crate) async fn overview(Extract(state): Extract<State>) -> Response {
    let mut o = match overview::read(&state.pool).await {
        Ok(o) => o,
        Err(e) => return failed(&e),
    };
    if let Some(client) = &state.watermarks {
        overview::fill_lag(&mut o, client.clone(), crate::web::LAG_BUDGET).await;
    }
    let pending: i64 = o.backlog.iter().map(|b| b.pending).sum();
    let parked_n: i64 = o.backlog.iter().map(|b| b.failed).sum();
    let oldest = o
        .backlog
        .iter()
        .filter_map(|b| b.oldest_pending_age_s)
        .fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.max(a))));
    let dead: i64 = o.dead_letters.iter().map(|d| d.1).sum();
    let behind: i64 = o.behind_parked.iter().map(|b| b.waiting).sum();
    let held_keys: i64 = o.held.iter().map(|h| h.keys).sum();
    let mut body = format!(
        "<section class=\"cards\">\
         <div class=\"card\" id=\"card-pending\">Pending<b>{pending}</b></div>\
         <div class=\"card\" id=\"card-oldest\">Oldest pending<b>{}</b></div>\
         <div class=\"card\" id=\"card-parked\">Parked<b>{parked_n}</b></div>\
         <div class=\"card\" id=\"card-dead\">Open dead letters<b>{dead}</b></div>\
         <div class=\"card\" id=\"card-relays\">Relays<b>{}</b></div></section>",
        oldest.map(age).unwrap_or_else(|| "–".into()),
        o.relays.iter().filter(|r| r.heartbeat_age_s < 60.0).count(),
    );
    // What waits and why, said in words: pending events behind a parked one of their key are
    // not published until it is released; a held key's records are not applied until then.
    if behind > 0 {
        let keys: i64 = o.behind_parked.iter().map(|b| b.keys).sum();
        let _ = write!(
            body,
            "<p class=\"notice bad\" id=\"waiting-behind-parked\"><b>{behind}</b> pending \
             event(s) of {keys} key(s) wait behind a parked event of their key: they are not \
             published until it is requeued or discarded. \
             <a href=\"{}/blocked\">Blocked keys</a></p>",
            state.base
        );
    }
    if held_keys > 0 {
        let records: i64 = o.held.iter().map(|h| h.records).sum();
        let _ = write!(
            body,
            "<p class=\"notice bad\" id=\"waiting-behind-held\"><b>{held_keys}</b> key(s) held \
             by consumers ({records} record(s) stored, not applied until released). \
             <a href=\"{}/held\">Held keys</a></p>",
            state.base
        );
    }
    let label = |m: &overview::Minute| m.minute.format("%H:%M").to_string();
    body.push_str("<section class=\"charts\">");
    type Value = fn(&overview::Minute) -> f64;
    let charts: [(&str, &str, &str, Value); 6] = [
        ("chart-published", "Published", "events", |m| {
            m.published as f64
        }),
        ("chart-retried", "Failed attempts, retried", "events", |m| {
            m.retried as f64
        }),
        ("chart-parked", "Parked", "events", |m| m.parked as f64),
        ("chart-dead", "Dead letters", "records", |m| {
            m.dead_letters as f64
        }),
        (
            "chart-lag",
            "End-to-end lag (enqueue to publish recorded), average",
            "ms",
            |m| m.lag_ms.unwrap_or(0.0).round(),
        ),
        (
            "chart-lag-max",
            "End-to-end lag, slowest event",
            "ms",
            |m| m.lag_max_ms.unwrap_or(0.0).round(),
        ),
    ];
    for (id, title, unit, value) in charts {
        let points: Vec<(String, f64)> = o.minutes.iter().map(|m| (label(m), value(m))).collect();
        body.push_str(&bars(id, title, unit, &points));
    }
    body.push_str("</section>");
    body.push_str(
        "<p class=\"muted\">Publishing, retries, parking and lag as the relays report them \
         (every 5 s; relays from before migration 0018 report nothing); dead letters as the \
         consumers record them.</p>",
    );
    body.push_str("<h2>Backlog per destination</h2>");
    let rows: Vec<Vec<String>> = o
        .backlog
        .iter()
        .map(|b| {
            vec![
                esc(&b.topic),
                b.pending.to_string(),
                b.scheduled.to_string(),
                if b.failed > 0 {
                    format!(
                        "<a href=\"{}/parked?topic={}\">{}</a>",
                        state.base,
                        q(&b.topic),
                        b.failed
                    )
                } else {
                    "0".into()
                },
                b.oldest_pending_age_s
                    .map(age)
                    .unwrap_or_else(|| "–".into()),
                match o.behind_parked.iter().find(|w| w.topic == b.topic) {
                    Some(w) => format!(
                        "<a href=\"{}/blocked\"><b>{}</b></a> ({} key(s))",
                        state.base, w.waiting, w.keys
                    ),
                    None => "0".into(),
                },
            ]
        })
        .collect();
    body.push_str(&table(
        "backlog",
        &[
            "Topic",
            "Pending",
            "Scheduled",
            "Parked",
            "Oldest pending",
            "Pending behind parked",
        ],
        &rows,
        "The outbox is empty.",
    ));
    body.push_str("<h2>Relays</h2>");
    let rows: Vec<Vec<String>> = o
        .relays
        .iter()
        .map(|r| {
            vec![
                format!("<code>{}</code>", r.relay_id),
                esc(&r.relay_group),
                esc(&r.host),
                r.partitions.to_string(),
                age(r.heartbeat_age_s),
            ]
        })
        .collect();
    body.push_str(&table(
        "relays",
        &[
            "Relay",
            "Group",
            "Host",
            "Partition leases (of 256)",
            "Heartbeat",
        ],
        &rows,
        "No relay has registered.",
    ));
    if !o.wal_slots.is_empty() {
        body.push_str("<h2>WAL relay slots</h2>");
        let bytes = |b: Option<i64>| b.map(|b| format!("{b} B")).unwrap_or_else(|| "–".into());
        let rows: Vec<Vec<String>> = o
            .wal_slots
            .iter()
            .map(|w| {
                vec![
                    format!("<code>{}</code>", esc(&w.slot)),
                    match (w.present, w.active) {
                        (false, _) => "<b>missing</b>".into(),
                        (true, true) => "active".into(),
                        (true, false) => "<b>inactive</b>".into(),
                    },
                    bytes(w.lag_bytes),
                    bytes(w.retained_bytes),
                    esc(w.wal_status.as_deref().unwrap_or("–")),
                    match (&w.holder, w.lease_left_s) {
                        (Some(h), Some(left)) if left > 0.0 => format!(
                            "<code>{h}</code> on {}",
                            esc(w.holder_host.as_deref().unwrap_or(""))
                        ),
                        (Some(_), _) => "<b>expired</b>".into(),
                        _ => "none".into(),
                    },
                ]
            })
            .collect();
        body.push_str(&table(
            "wal-slots",
            &[
                "Slot",
                "State",
                "Lag",
                "Retained WAL",
                "WAL status",
                "Lease",
            ],
            &rows,
            "",
        ));
    }
    body.push_str("<h2>Consumers</h2>");
    body.push_str(&consumers(&o));
    if state.watermarks.is_none() && !o.consumers.is_empty() {
        body.push_str("<p class=\"muted\">Lag needs the broker: start the dashboard with --bootstrap-servers.</p>");
    }
    body.push_str("<h2>Open dead letters</h2>");
    let rows: Vec<Vec<String>> = o
        .dead_letters
        .iter()
        .map(|(c, n)| {
            vec![
                esc(c),
                format!(
                    "<a href=\"{}/dead-letters?consumer={}\">{n}</a>",
                    state.base,
                    q(c)
                ),
            ]
        })
        .collect();
    body.push_str(&table(
        "dead-letter-counts",
        &["Consumer", "Open"],
        &rows,
        "No open dead letters.",
    ));
    Html(page(&state.base, "/", "Overview", &body, true, "")).into_response()
}

/// The consumer groups, one row each (topics, partitions, total lag, the partition that
/// advanced longest ago, held keys), each with its partitions on demand.
fn consumers(o: &overview::Overview) -> String {
    let mut groups: Vec<(&str, Vec<&overview::ConsumerPartition>)> = Vec::new();
    for c in &o.consumers {
        match groups.last_mut() {
            Some((g, parts)) if *g == c.group_id => parts.push(c),
            _ => groups.push((&c.group_id, vec![c])),
        }
    }
    let mut rows: Vec<Vec<String>> = Vec::new();
    for (i, (group, parts)) in groups.iter().enumerate() {
        let mut topics: Vec<&str> = parts.iter().map(|c| c.topic.as_str()).collect();
        topics.dedup();
        let lag = parts
            .iter()
            .map(|c| c.lag)
            .try_fold(0i64, |sum, l| l.map(|l| sum + l));
        let stalest = parts.iter().map(|c| c.updated_age_s).fold(0.0, f64::max);
        let held = o.held.iter().find(|h| h.group_id == *group);
        let detail: Vec<Vec<String>> = parts
            .iter()
            .map(|c| {
                vec![
                    esc(&c.topic),
                    c.partition.to_string(),
                    c.next_offset
                        .map(|n| n.to_string())
                        .unwrap_or_else(|| "–".into()),
                    c.lag.map(|l| l.to_string()).unwrap_or_else(|| "?".into()),
                    age(c.updated_age_s),
                ]
            })
            .collect();
        rows.push(vec![
            esc(group),
            topics.iter().map(|t| esc(t)).collect::<Vec<_>>().join(", "),
            format!(
                "<details><summary>{}</summary>{}</details>",
                parts.len(),
                table(
                    &format!("consumer-partitions-{i}"),
                    &["Topic", "Partition", "Next offset", "Lag", "Last advanced"],
                    &detail,
                    "",
                )
            ),
            lag.map(|l| l.to_string()).unwrap_or_else(|| "?".into()),
            age(stalest),
            match held {
                Some(h) => format!(
                    "<b>{}</b> ({} record(s), {} bytes)",
                    h.keys, h.records, h.bytes
                ),
                None => "0".into(),
            },
        ]);
    }
    table(
        "consumers",
        &[
            "Group",
            "Topics",
            "Partitions",
            "Lag",
            "Longest since a partition advanced",
            "Held keys",
        ],
        &rows,
        "No consumer has stored an offset.",
    )
}
