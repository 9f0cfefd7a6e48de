//! Parked events: the search with its error groups, and one event whole.

use std::fmt::Write as _;

use axum::extract::{Path, Query, State as Extract};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use crate::web::form::{button, failed, hidden, input, parked_filter, uuid, Pairs, PARKED_FIELDS};
use crate::web::html::{bytes, esc, page, table};
use crate::web::State;
use crate::{parked, Error};

pub(crate) async fn parked(Extract(state): Extract<State>, Query(p): Pairs) -> Response {
    let filter = match parked_filter(&p) {
        Ok(f) => f,
        Err(e) => return failed(&e),
    };
    let (rows, parked::Groups { groups, total, .. }) = match tokio::try_join!(
        parked::search(&state.pool, &filter, 200),
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
