//! Dead letters: the search, and one whole.

use std::fmt::Write as _;

use axum::extract::{Path, Query, State as Extract};
use axum::response::{Html, IntoResponse, Response};

use crate::web::form::{button, dead_filter, failed, hidden, input, Pairs, DEAD_FIELDS};
use crate::web::html::{bytes, esc, page, table};
use crate::web::State;
use crate::{dead_letters, Error};

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
