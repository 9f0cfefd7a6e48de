//! Blocked keys: what each parked head holds back.

use axum::extract::State as Extract;
use axum::response::{Html, IntoResponse, Response};

use crate::parked;
use crate::web::form::{button, failed};
use crate::web::html::{esc, page, table};
use crate::web::State;

pub(crate) async fn blocked(Extract(state): Extract<State>) -> Response {
    let keys = match parked::blocked_keys(&state.pool, 200).await {
        Ok(k) => k,
        Err(e) => return failed(&e),
    };
    let rows: Vec<Vec<String>> = keys
        .iter()
        .map(|k| {
            let topic = esc(&k.topic);
            let mut cells = vec![
                format!("<code>{}</code>", esc(&k.event_key)),
                topic,
                format!(
                    "<a href=\"{}/parked/{}\"><code>{}</code></a>",
                    state.base, k.head_event_id, k.head_event_id
                ),
                esc(&postal_shared::text::bounded(
                    k.head_error.as_deref().unwrap_or("-"),
                    200,
                )),
                k.parked.to_string(),
                format!("<b data-test=\"waiting\">{}</b>", k.waiting),
                k.parked_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            ];
            if state.actions {
                let f = format!(
                    "<input type=\"hidden\" name=\"head\" value=\"{}\">",
                    k.head_event_id
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
        "Key",
        "Topic",
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
        "<p class=\"muted\">A parked event holds back every later event of its key, on every \
         topic, so that the key's order holds. Releasing a key requeues its parked events: the relay publishes \
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
