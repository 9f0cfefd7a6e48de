//! The pages (GET): overview, parked events, blocked keys, dead letters, dedup lookup, audit.

use std::fmt::Write as _;

use axum::extract::{Path, Query, State as Extract};
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use chrono::{DateTime, NaiveDateTime, Utc};
use uuid::Uuid;

use super::html::{age, bars, bytes, esc, page, q, table};
use super::State;
use crate::{dead_letters, lookup, overview, parked, Error};

pub(crate) type Pairs = Query<Vec<(String, String)>>;

/// A page that failed: one escaped line.
pub(crate) fn failed(e: &Error) -> Response {
    let status = match e {
        Error::Invalid(_) | Error::OverCap { .. } => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    tracing::warn!(error = %e, "dashboard page failed");
    (
        status,
        Html(format!(
            "<!doctype html><title>Error</title><p class=\"notice bad\">{}</p>",
            esc(&e.to_string())
        )),
    )
        .into_response()
}

/// The value of `name` in the query or form, empty ones as absent.
pub(crate) fn get<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, v)| k == name && !v.trim().is_empty())
        .map(|(_, v)| v.trim())
}

fn time(v: Option<&str>, name: &str) -> Result<Option<DateTime<Utc>>, Error> {
    let Some(v) = v else { return Ok(None) };
    if let Ok(t) = DateTime::parse_from_rfc3339(v) {
        return Ok(Some(t.with_timezone(&Utc)));
    }
    for f in ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(v, f) {
            return Ok(Some(t.and_utc()));
        }
    }
    Err(Error::Invalid(format!(
        "{name}: {:?} is not a time (use 2026-11-27T10:30, UTC)",
        postal_shared::text::bounded(v, 60)
    )))
}

fn uuid(v: Option<&str>, name: &str) -> Result<Option<Uuid>, Error> {
    v.map(|v| {
        Uuid::parse_str(v).map_err(|_| {
            Error::Invalid(format!(
                "{name}: {:?} is not an event id (a UUID)",
                postal_shared::text::bounded(v, 60)
            ))
        })
    })
    .transpose()
}

/// The parked-events filter in a query or form.
pub(crate) fn parked_filter(p: &[(String, String)]) -> Result<parked::Filter, Error> {
    Ok(parked::Filter {
        event_id: uuid(get(p, "event_id"), "event id")?,
        topic: get(p, "topic").map(str::to_owned),
        key: get(p, "key").map(str::to_owned),
        event_type: get(p, "event_type").map(str::to_owned),
        reason: get(p, "reason").map(str::to_owned),
        since: time(get(p, "since"), "parked since")?,
        until: time(get(p, "until"), "parked until")?,
    })
}

/// The dead-letters filter in a query or form.
pub(crate) fn dead_filter(p: &[(String, String)]) -> Result<dead_letters::Filter, Error> {
    Ok(dead_letters::Filter {
        consumer: get(p, "consumer").map(str::to_owned),
        topic: get(p, "topic").map(str::to_owned),
        event_id: uuid(get(p, "event_id"), "event id")?,
        reason: get(p, "reason").map(str::to_owned),
        error: get(p, "error").map(str::to_owned),
        all: get(p, "all").is_some(),
    })
}

/// Hidden inputs carrying the query's filter fields into a form.
pub(crate) fn hidden(pairs: &[(String, String)], names: &[&str]) -> String {
    let mut s = String::new();
    for n in names {
        if let Some(v) = get(pairs, n) {
            let _ = write!(
                s,
                "<input type=\"hidden\" name=\"{n}\" value=\"{}\">",
                esc(v)
            );
        }
    }
    s
}

const PARKED_FIELDS: &[&str] = &[
    "event_id",
    "topic",
    "key",
    "event_type",
    "reason",
    "since",
    "until",
];
const DEAD_FIELDS: &[&str] = &["consumer", "topic", "event_id", "reason", "error", "all"];

/// A POST form with one button.
pub(crate) fn button(
    state: &State,
    action: &str,
    fields: &str,
    label: &str,
    class: &str,
    test_id: &str,
) -> String {
    format!(
        "<form method=\"post\" class=\"inline\" action=\"{}{action}\">\
         <input type=\"hidden\" name=\"csrf\" value=\"{}\">{fields}\
         <button type=\"submit\" class=\"{class}\" data-test=\"{test_id}\">{label}</button></form>",
        state.base, state.csrf
    )
}

fn input(p: &[(String, String)], name: &str, label: &str, kind: &str) -> String {
    format!(
        "<label>{label}<input type=\"{kind}\" name=\"{name}\" value=\"{}\"></label>",
        esc(get(p, name).unwrap_or(""))
    )
}

pub(crate) async fn overview(Extract(state): Extract<State>) -> Response {
    let mut o = match overview::read(&state.pool).await {
        Ok(o) => o,
        Err(e) => return failed(&e),
    };
    if let Some(client) = &state.watermarks {
        overview::fill_lag(&mut o, client.clone(), super::LAG_BUDGET).await;
    }
    let pending: i64 = o.backlog.iter().map(|b| b.pending).sum();
    let parked_n: i64 = o.backlog.iter().map(|b| b.failed).sum();
    let oldest = o
        .backlog
        .iter()
        .filter_map(|b| b.oldest_pending_age_s)
        .fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.max(a))));
    let dead: i64 = o.dead_letters.iter().map(|d| d.1).sum();
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
    let label = |m: &overview::Minute| m.minute.format("%H:%M").to_string();
    body.push_str("<section class=\"charts\">");
    type Value = fn(&overview::Minute) -> f64;
    let charts: [(&str, &str, &str, Value); 4] = [
        ("chart-published", "Published", "events", |m| {
            m.published as f64
        }),
        ("chart-parked", "Parked", "events", |m| m.parked as f64),
        ("chart-dead", "Dead letters", "records", |m| {
            m.dead_letters as f64
        }),
        (
            "chart-lag",
            "End-to-end lag (enqueue to broker ack), average",
            "ms",
            |m| m.lag_ms.unwrap_or(0.0).round(),
        ),
    ];
    for (id, title, unit, value) in charts {
        let points: Vec<(String, f64)> = o.minutes.iter().map(|m| (label(m), value(m))).collect();
        body.push_str(&bars(id, title, unit, &points));
    }
    body.push_str("</section>");
    if !o.publishes_recorded {
        body.push_str(
            "<p class=\"muted\">No published rows in the last hour: the publish and lag charts \
             count published rows the outbox keeps (relay --keep-published) or its history \
             (--history); a relay that deletes them at once leaves these two charts empty.</p>",
        );
    }
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
            ]
        })
        .collect();
    body.push_str(&table(
        "backlog",
        &["Topic", "Pending", "Scheduled", "Parked", "Oldest pending"],
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
    body.push_str("<h2>Consumers</h2>");
    let rows: Vec<Vec<String>> = o
        .consumers
        .iter()
        .map(|c| {
            vec![
                esc(&c.group_id),
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
    body.push_str(&table(
        "consumers",
        &[
            "Group",
            "Topic",
            "Partition",
            "Next offset",
            "Lag",
            "Last advanced",
        ],
        &rows,
        "No consumer has stored an offset.",
    ));
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

pub(crate) async fn parked(Extract(state): Extract<State>, Query(p): Pairs) -> Response {
    let filter = match parked_filter(&p) {
        Ok(f) => f,
        Err(e) => return failed(&e),
    };
    let (rows, total, groups) = match tokio::try_join!(
        parked::search(&state.pool, &filter, 200),
        parked::count(&state.pool, &filter),
        parked::groups(&state.pool, &filter, 20),
    ) {
        Ok(x) => x,
        Err(e) => return failed(&e),
    };
    let mut body = format!(
        "<form method=\"get\" class=\"filters\" action=\"{}/parked\">{}{}{}{}{}{}{}\
         <button type=\"submit\">Search</button> <a href=\"{}/parked\">clear</a></form>",
        state.base,
        input(&p, "event_id", "Event id", "text"),
        input(&p, "key", "Key", "text"),
        input(&p, "topic", "Topic", "text"),
        input(&p, "event_type", "Type", "text"),
        input(&p, "reason", "Error contains", "text"),
        input(&p, "since", "Parked since (UTC)", "datetime-local"),
        input(&p, "until", "Parked before (UTC)", "datetime-local"),
        state.base
    );
    let _ = write!(
        body,
        "<p id=\"parked-total\"><b>{total}</b> parked event(s) match{}.</p>",
        if total as usize > rows.len() {
            format!(" (the oldest {} shown)", rows.len())
        } else {
            String::new()
        }
    );
    if state.actions && total > 0 {
        let fields = hidden(&p, PARKED_FIELDS);
        let _ = write!(
            body,
            "<p>{} {} <span class=\"muted\">(asks for confirmation with the count; at most {} per action)</span></p>",
            button(&state, "/parked/requeue", &fields, &format!("Requeue all {total} matching"), "", "requeue-all"),
            button(&state, "/parked/discard", &fields, &format!("Discard all {total} matching"), "danger", "discard-all"),
            state.cap
        );
    }
    body.push_str("<h2>By error</h2>");
    let grows: Vec<Vec<String>> = groups
        .iter()
        .map(|g| {
            vec![
                g.events.to_string(),
                format!("<code>{}</code>", esc(&g.fingerprint)),
                g.topics.to_string(),
                g.last_parked_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            ]
        })
        .collect();
    body.push_str(&table(
        "parked-groups",
        &[
            "Events",
            "Error (ids and numbers as #)",
            "Topics",
            "Last parked",
        ],
        &grows,
        "No parked events match.",
    ));
    body.push_str("<h2>Events</h2>");
    let erows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let id = r.event_id.to_string();
            let mut cells = vec![
                format!(
                    "<a href=\"{}/parked/{id}\" data-test=\"event-link\"><code>{id}</code></a>",
                    state.base
                ),
                esc(&r.topic),
                format!("<code>{}</code>", esc(&r.event_key)),
                esc(&r.event_type),
                r.attempts.to_string(),
                esc(&postal_shared::text::bounded(
                    r.last_error.as_deref().unwrap_or("-"),
                    300,
                )),
                r.parked_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            ];
            if state.actions {
                let f = format!("<input type=\"hidden\" name=\"id\" value=\"{id}\">");
                cells.push(format!(
                    "{} {}",
                    button(
                        &state,
                        "/parked/requeue",
                        &f,
                        "Requeue",
                        "plain",
                        "requeue-one"
                    ),
                    button(
                        &state,
                        "/parked/discard",
                        &f,
                        "Discard",
                        "danger",
                        "discard-one"
                    )
                ));
            }
            cells
        })
        .collect();
    let mut head = vec![
        "Event id",
        "Topic",
        "Key",
        "Type",
        "Attempts",
        "Error",
        "Parked at",
    ];
    if state.actions {
        head.push("");
    }
    body.push_str(&table(
        "parked-events",
        &head,
        &erows,
        "No parked events match.",
    ));
    Html(page(
        &state.base,
        "/parked",
        "Parked events",
        &body,
        true,
        "",
    ))
    .into_response()
}

pub(crate) async fn parked_one(Extract(state): Extract<State>, Path(id): Path<String>) -> Response {
    let id = match uuid(Some(&id), "event id") {
        Ok(Some(id)) => id,
        Ok(None) => return failed(&Error::Invalid("no event id".into())),
        Err(e) => return failed(&e),
    };
    let e = match parked::show(&state.pool, id, state.payload_cap).await {
        Ok(Some(e)) => e,
        Ok(None) => {
            return (
                StatusCode::NOT_FOUND,
                Html(page(
                    &state.base,
                    "/parked",
                    "Event not found",
                    &format!(
                    "<p>The outbox has no event {id} (published and deleted, or discarded).</p>"
                ),
                    false,
                    "",
                )),
            )
                .into_response()
        }
        Err(e) => return failed(&e),
    };
    let shown = e.payload.len();
    let total = e.payload_bytes as usize;
    let payload = format!(
        "<details id=\"payload\"{}><summary>Payload: {total} bytes{}</summary><pre>{}</pre></details>",
        if total <= 4096 { " open" } else { "" },
        if shown < total {
            format!(", the first {shown} shown")
        } else {
            String::new()
        },
        bytes(&e.payload)
    );
    let headers = serde_json::to_string_pretty(&e.headers).unwrap_or_default();
    let mut body = format!(
        "<dl class=\"detail\">\
         <dt>Event id</dt><dd><code>{}</code></dd>\
         <dt>Status</dt><dd id=\"event-status\">{}</dd>\
         <dt>Topic</dt><dd>{}</dd><dt>Key</dt><dd><code id=\"event-key\">{}</code></dd>\
         <dt>Type</dt><dd>{} (schema version {})</dd>\
         <dt>Content type</dt><dd>{}</dd>\
         <dt>Attempts</dt><dd>{}</dd><dt>Last error</dt><dd>{}</dd>\
         <dt>Enqueued</dt><dd>{}</dd><dt>{}</dt><dd>{}</dd>\
         <dt>Sequence</dt><dd>{}</dd></dl>\
         <h2>Headers</h2><pre id=\"headers\">{}</pre>{payload}",
        e.event_id,
        esc(&e.status),
        esc(&e.topic),
        esc(&e.event_key),
        esc(&e.event_type),
        e.schema_version,
        esc(&e.content_type),
        e.attempts,
        esc(e.last_error.as_deref().unwrap_or("-")),
        e.created_at.format("%Y-%m-%d %H:%M:%S%.3f UTC"),
        if e.status == "failed" {
            "Parked at"
        } else {
            "Available at"
        },
        e.available_at.format("%Y-%m-%d %H:%M:%S%.3f UTC"),
        e.seq,
        esc(&headers),
    );
    if state.actions && e.status == "failed" {
        let f = format!(
            "<input type=\"hidden\" name=\"id\" value=\"{}\">",
            e.event_id
        );
        let _ = write!(
            body,
            "<p>{} {}</p>",
            button(&state, "/parked/requeue", &f, "Requeue", "", "requeue-one"),
            button(
                &state,
                "/parked/discard",
                &f,
                "Discard",
                "danger",
                "discard-one"
            )
        );
    }
    Html(page(&state.base, "/parked", "Event", &body, true, "")).into_response()
}

pub(crate) async fn blocked(Extract(state): Extract<State>) -> Response {
    let keys = match parked::blocked_keys(&state.pool, 200).await {
        Ok(k) => k,
        Err(e) => return failed(&e),
    };
    let rows: Vec<Vec<String>> = keys
        .iter()
        .map(|k| {
            let mut cells = vec![
                esc(&k.topic),
                format!("<code>{}</code>", esc(&k.event_key)),
                format!(
                    "<a href=\"{}/parked/{}\"><code>{}</code></a>",
                    state.base, k.head_event_id, k.head_event_id
                ),
                esc(&postal_shared::text::bounded(k.head_error.as_deref().unwrap_or("-"), 200)),
                k.parked.to_string(),
                format!("<b data-test=\"waiting\">{}</b>", k.waiting),
                k.parked_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            ];
            if state.actions {
                let f = format!(
                    "<input type=\"hidden\" name=\"topic\" value=\"{}\"><input type=\"hidden\" name=\"key\" value=\"{}\">",
                    esc(&k.topic),
                    esc(&k.event_key)
                );
                cells.push(button(
                    &state,
                    "/blocked/release",
                    &f,
                    "Retry the head, then release the rest",
                    "",
                    "release",
                ));
            }
            cells
        })
        .collect();
    let mut head = vec![
        "Topic",
        "Key",
        "Head (first parked)",
        "Its error",
        "Parked",
        "Waiting behind",
        "Parked at",
    ];
    if state.actions {
        head.push("");
    }
    let body = format!(
        "<p class=\"muted\">A parked event holds back every later event of its key, so that \
         the key's order holds. Releasing a key requeues its parked events: the relay publishes \
         the head first, then the events that waited behind it, in order.</p>{}",
        table("blocked-keys", &head, &rows, "No key is held back.")
    );
    Html(page(
        &state.base,
        "/blocked",
        "Blocked keys",
        &body,
        true,
        "",
    ))
    .into_response()
}

pub(crate) async fn dead_letters(Extract(state): Extract<State>, Query(p): Pairs) -> Response {
    let filter = match dead_filter(&p) {
        Ok(f) => f,
        Err(e) => return failed(&e),
    };
    let (rows, total) = match tokio::try_join!(
        dead_letters::search(&state.pool, &filter, 200),
        dead_letters::count(&state.pool, &filter),
    ) {
        Ok(x) => x,
        Err(e) => return failed(&e),
    };
    let mut body = format!(
        "<form method=\"get\" class=\"filters\" action=\"{}/dead-letters\">{}{}{}{}{}\
         <label>Include replayed and resolved<input type=\"checkbox\" name=\"all\" value=\"1\"{}></label>\
         <button type=\"submit\">Search</button> <a href=\"{}/dead-letters\">clear</a></form>",
        state.base,
        input(&p, "consumer", "Consumer", "text"),
        input(&p, "topic", "Topic", "text"),
        input(&p, "event_id", "Event id", "text"),
        input(&p, "reason", "Reason", "text"),
        input(&p, "error", "Error contains", "text"),
        if filter.all { " checked" } else { "" },
        state.base
    );
    let _ = write!(
        body,
        "<p id=\"dead-total\"><b>{total}</b> dead letter(s) match.</p>"
    );
    if state.actions && total > 0 && !filter.all {
        let fields = hidden(&p, DEAD_FIELDS);
        if state.producer.is_some() {
            body.push_str(&button(
                &state,
                "/dead-letters/replay",
                &fields,
                &format!("Replay all {total} matching"),
                "",
                "replay-all",
            ));
            body.push(' ');
        }
        body.push_str(&button(
            &state,
            "/dead-letters/resolve",
            &fields,
            &format!("Mark all {total} matching resolved"),
            "plain",
            "resolve-all",
        ));
    }
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|d| {
            let state_s = if d.replayed {
                "replayed"
            } else if d.resolved {
                "resolved"
            } else {
                "open"
            };
            let mut cells = vec![
                format!(
                    "<a href=\"{}/dead-letters/{}\">{}</a>",
                    state.base, d.id, d.id
                ),
                esc(&d.consumer_name),
                format!("{} [{}] @{}", esc(&d.topic), d.partition, d.kafka_offset),
                d.event_id
                    .map(|e| format!("<code>{e}</code>"))
                    .unwrap_or_else(|| "–".into()),
                esc(&d.reason),
                esc(&postal_shared::text::bounded(&d.error, 300)),
                d.created_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                state_s.into(),
            ];
            if state.actions && state_s == "open" {
                let f = format!("<input type=\"hidden\" name=\"id\" value=\"{}\">", d.id);
                let mut b = String::new();
                if state.producer.is_some() {
                    b.push_str(&button(
                        &state,
                        "/dead-letters/replay",
                        &f,
                        "Replay",
                        "plain",
                        "replay-one",
                    ));
                    b.push(' ');
                }
                b.push_str(&button(
                    &state,
                    "/dead-letters/resolve",
                    &f,
                    "Resolve",
                    "plain",
                    "resolve-one",
                ));
                cells.push(b);
            } else if state.actions {
                cells.push(String::new());
            }
            cells
        })
        .collect();
    let mut head = vec![
        "Id", "Consumer", "From", "Event id", "Reason", "Error", "Recorded", "State",
    ];
    if state.actions {
        head.push("");
    }
    body.push_str(&table(
        "dead-letters",
        &head,
        &rows,
        "No dead letters match.",
    ));
    if state.actions && state.producer.is_none() {
        body.push_str("<p class=\"muted\">Replay needs the broker: start the dashboard with --bootstrap-servers.</p>");
    }
    Html(page(
        &state.base,
        "/dead-letters",
        "Dead letters",
        &body,
        true,
        "",
    ))
    .into_response()
}

pub(crate) async fn dead_letter(Extract(state): Extract<State>, Path(id): Path<i64>) -> Response {
    let d = match dead_letters::show(&state.pool, id).await {
        Ok(Some(d)) => d,
        Ok(None) => return failed(&Error::Invalid(format!("no dead letter {id}"))),
        Err(e) => return failed(&e),
    };
    let l = &d.listed;
    let mut headers = String::new();
    for (n, v) in d.header_names.iter().zip(&d.header_values) {
        let _ = writeln!(headers, "{} = {}", esc(n), bytes(v));
    }
    let payload = d.payload.as_deref().unwrap_or_default();
    let cap = state.payload_cap as usize;
    let body = format!(
        "<dl class=\"detail\"><dt>Id</dt><dd>{}</dd><dt>Consumer</dt><dd>{}</dd>\
         <dt>From</dt><dd>{} partition {} offset {}</dd><dt>Event id</dt><dd>{}</dd>\
         <dt>Reason</dt><dd>{} after {} attempt(s)</dd><dt>Error</dt><dd>{}</dd>\
         <dt>Key</dt><dd><code>{}</code></dd><dt>State</dt><dd>{}</dd></dl>\
         <h2>Headers</h2><pre>{}</pre>\
         <details id=\"payload\"{}><summary>Payload: {} bytes{}</summary><pre>{}</pre></details>",
        l.id,
        esc(&l.consumer_name),
        esc(&l.topic),
        l.partition,
        l.kafka_offset,
        l.event_id
            .map(|e| e.to_string())
            .unwrap_or_else(|| "–".into()),
        esc(&l.reason),
        l.attempts,
        esc(&l.error),
        d.record_key
            .as_deref()
            .map(bytes)
            .unwrap_or_else(|| "–".into()),
        if l.replayed {
            "replayed"
        } else if l.resolved {
            "resolved"
        } else {
            "open"
        },
        headers,
        if payload.len() <= 4096 { " open" } else { "" },
        payload.len(),
        if payload.len() > cap {
            format!(", the first {cap} shown")
        } else {
            String::new()
        },
        bytes(&payload[..payload.len().min(cap)]),
    );
    Html(page(
        &state.base,
        "/dead-letters",
        "Dead letter",
        &body,
        false,
        "",
    ))
    .into_response()
}

pub(crate) async fn lookup(Extract(state): Extract<State>, Query(p): Pairs) -> Response {
    let mut body = format!(
        "<form method=\"get\" class=\"filters\" action=\"{}/lookup\">{}{}\
         <button type=\"submit\">Look up</button></form>",
        state.base,
        input(&p, "consumer", "Consumer", "text"),
        input(&p, "event_id", "Event id", "text"),
    );
    if let (Some(consumer), Some(id)) = (get(&p, "consumer"), get(&p, "event_id")) {
        let id = match uuid(Some(id), "event id") {
            Ok(Some(id)) => id,
            Ok(None) => unreachable!("a value was given"),
            Err(e) => return failed(&e),
        };
        let a = match lookup::event(&state.pool, consumer, id).await {
            Ok(a) => a,
            Err(e) => return failed(&e),
        };
        let verdict = match (a.processed_at, a.horizon) {
            (Some(t), _) => format!(
                "<p class=\"notice ok\" id=\"verdict\">Yes: consumer {} committed event {id} at {}.</p>",
                esc(consumer),
                t.format("%Y-%m-%d %H:%M:%S%.3f UTC")
            ),
            (None, Some(h)) => format!(
                "<p class=\"notice bad\" id=\"verdict\">No dedup row: consumer {} has not processed event {id} since its dedup horizon {} (rows before it were deleted).</p>",
                esc(consumer),
                h.format("%Y-%m-%d %H:%M:%S UTC")
            ),
            (None, None) => format!(
                "<p class=\"notice bad\" id=\"verdict\">No: consumer {} has no dedup row for event {id}.</p>",
                esc(consumer)
            ),
        };
        body.push_str(&verdict);
        for (dl, c, reason, replayed, resolved) in &a.dead_letters {
            let _ = write!(
                body,
                "<p>Dead letter <a href=\"{}/dead-letters/{dl}\">{dl}</a> of {} ({}){}.</p>",
                state.base,
                esc(c),
                esc(reason),
                if *replayed {
                    ", replayed"
                } else if *resolved {
                    ", resolved"
                } else {
                    ""
                }
            );
        }
        if let Some(s) = &a.outbox_status {
            let _ = write!(
                body,
                "<p>This database's outbox has the event: {}.</p>",
                esc(s)
            );
        }
    }
    Html(page(
        &state.base,
        "/lookup",
        "Did a consumer process an event?",
        &body,
        false,
        "",
    ))
    .into_response()
}

pub(crate) async fn audit(Extract(state): Extract<State>) -> Response {
    let entries = match crate::audit::latest(&state.pool, 200).await {
        Ok(e) => e,
        Err(e) => return failed(&e),
    };
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            vec![
                e.at.format("%Y-%m-%d %H:%M:%S").to_string(),
                esc(&e.actor),
                esc(&e.action),
                format!(
                    "<code>{}</code>",
                    esc(&postal_shared::text::bounded(&e.target.to_string(), 400))
                ),
                e.affected.to_string(),
            ]
        })
        .collect();
    let body = table(
        "audit",
        &["When (UTC)", "Who", "Action", "On", "Affected"],
        &rows,
        "No actions yet.",
    );
    Html(page(&state.base, "/audit", "Audit trail", &body, true, "")).into_response()
}

pub(crate) async fn style() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("../../assets/style.css"),
    )
        .into_response()
}

pub(crate) async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("../../assets/app.js"),
    )
        .into_response()
}

pub(crate) async fn icon() -> Response {
    (
        [(header::CONTENT_TYPE, "image/svg+xml")],
        include_str!("../../assets/icon.svg"),
    )
        .into_response()
}
