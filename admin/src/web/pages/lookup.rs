//! The dedup lookup: did consumer X process event Y?

use std::fmt::Write as _;

use axum::extract::{Query, State as Extract};
use axum::response::{Html, IntoResponse, Response};

use crate::lookup;
use crate::web::form::{failed, get, input, refuse_nul, uuid, Pairs};
use crate::web::html::{esc, page};
use crate::web::State;

pub(crate) async fn lookup(Extract(state): Extract<State>, Query(p): Pairs) -> Response {
    let mut body = format!(
        "<form method=\"get\" class=\"filters\" action=\"{}/lookup\">{}{}\
         <button type=\"submit\">Look up</button></form>",
        state.base,
        input(&p, "consumer", "Consumer", "text"),
        input(&p, "event_id", "Event id", "text"),
    );
    if let Err(e) = refuse_nul(&p) {
        return failed(&e);
    }
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
