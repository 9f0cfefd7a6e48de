//! The actions (POST): requeue, discard, release a key, replay, resolve. Each asks first: the
//! confirmation page shows how many events the action matches now (refusing more than the
//! cap) and carries exactly those (their sequence numbers or dead-letter ids); confirming acts
//! on those of them still parked (or open), never on events parked since. Each is recorded in
//! the audit trail.

use std::fmt::Write as _;

use axum::extract::State as Extract;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::{Extension, Form};
use uuid::Uuid;

use super::form::{dead_filter, decoded, failed, get, parked_filter};
use super::guard::Actor;
use super::html::{esc, page};
use super::State;
use crate::{audit, dead_letters, parked, Error};

type Pairs = Form<Vec<(String, String)>>;

/// Refuses a POST without this dashboard's CSRF token, or with actions disabled.
pub(super) fn refused(state: &State, p: &[(String, String)]) -> Option<Response> {
    if !state.actions {
        return Some((
            StatusCode::FORBIDDEN,
            Html("<!doctype html><p>Actions are disabled: this dashboard is read-only (start it with --allow-actions).</p>".to_owned()),
        )
            .into_response());
    }
    if get(p, "csrf") != Some(state.csrf.as_str()) {
        tracing::warn!("dashboard refused a POST without its CSRF token");
        return Some((
            StatusCode::FORBIDDEN,
            Html("<!doctype html><p>Refused: the form's CSRF token is missing or stale; reload the page.</p>".to_owned()),
        )
            .into_response());
    }
    None
}

/// The field a confirmation carries its rows in (sequence numbers, or dead-letter ids).
const CONFIRMED: &str = "confirmed";

/// Fields of the first request that are not carried into the confirmation.
const NOT_CARRIED: &[&str] = &["csrf", "confirm", CONFIRMED];

/// What a confirmation page asks.
struct Ask<'a> {
    /// The action's path.
    action: &'a str,
    title: &'a str,
    question: &'a str,
    /// The rows it matches now (what confirming acts on).
    rows: &'a [i64],
    danger: bool,
}

/// How many of the rows a confirmation lists (all are counted and carried).
const PREVIEW: usize = 20;

/// The first [`PREVIEW`] rows a confirmation acts on, as a table: parked events (by sequence
/// number) or dead letters (by id).
async fn preview(state: &State, dead: bool, rows: &[i64]) -> Result<String, Error> {
    let first = &rows[..rows.len().min(PREVIEW)];
    let table = if dead {
        let found = dead_letters::by_ids(&state.pool, first, PREVIEW as i64).await?;
        let cells: Vec<Vec<String>> = found
            .iter()
            .map(|d| {
                vec![
                    d.id.to_string(),
                    esc(&d.consumer_name),
                    esc(&d.topic),
                    d.event_id
                        .map_or_else(|| "–".to_owned(), |e| format!("<code>{e}</code>")),
                    esc(&d.reason),
                    esc(&postal_shared::text::bounded(&d.error, 120)),
                ]
            })
            .collect();
        super::html::table(
            "confirm-list",
            &["Id", "Consumer", "Topic", "Event", "Reason", "Error"],
            &cells,
            "None of them is open any more.",
        )
    } else {
        let found = parked::by_seqs(&state.pool, first).await?;
        let cells: Vec<Vec<String>> = found
            .iter()
            .map(|e| {
                vec![
                    format!("<code>{}</code>", e.event_id),
                    esc(&e.topic),
                    esc(&e.event_key),
                    esc(&e.event_type),
                    esc(&postal_shared::text::bounded(
                        e.last_error.as_deref().unwrap_or("–"),
                        120,
                    )),
                ]
            })
            .collect();
        super::html::table(
            "confirm-list",
            &["Event", "Topic", "Key", "Type", "Why parked"],
            &cells,
            "None of them is parked any more.",
        )
    };
    let more = if rows.len() > first.len() {
        format!(
            "<p class=\"muted\" id=\"confirm-more\">The first {} of {}, in order; the others are acted on too.</p>",
            first.len(),
            rows.len()
        )
    } else {
        String::new()
    };
    Ok(format!("{table}{more}"))
}

/// The page that asks to confirm: what, how many, the first of them, and a form carrying
/// exactly those rows (and the first request's fields, for the audit trail).
async fn confirm(state: &State, ask: Ask<'_>, p: &[(String, String)]) -> Response {
    let Ask {
        action,
        title,
        question,
        rows,
        danger,
    } = ask;
    let back = if action.starts_with("/dead-letters") {
        "/dead-letters"
    } else if action.starts_with("/blocked") {
        "/blocked"
    } else {
        "/parked"
    };
    let names: Vec<&str> = p
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| !NOT_CARRIED.contains(k))
        .collect();
    let mut fields = super::form::hidden(p, &names);
    let listed = match preview(state, back == "/dead-letters", rows).await {
        Ok(l) => l,
        Err(e) => return failed(&e),
    };
    let list: Vec<String> = rows.iter().map(i64::to_string).collect();
    let _ = write!(
        fields,
        "<input type=\"hidden\" name=\"{CONFIRMED}\" value=\"{}\">",
        list.join(",")
    );
    let body = format!(
        "<div class=\"confirm\" id=\"confirm\"><p>{}</p>\
         <p id=\"confirm-count\"><b>{}</b> will be affected (at most {} per action).</p>{listed}\
         <form method=\"post\" action=\"{}{action}\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
         <input type=\"hidden\" name=\"confirm\" value=\"yes\">{fields}\
         <button type=\"submit\" class=\"{}\" data-test=\"confirm\">{}</button> \
         <a href=\"{}{}\" data-test=\"cancel\">Cancel</a></form></div>",
        esc(question),
        rows.len(),
        state.cap,
        state.base,
        state.csrf,
        if danger { "danger" } else { "" },
        esc(title),
        state.base,
        back,
    );
    Html(page(&state.base, "", title, &body, false, "")).into_response()
}

/// The rows a confirmed request carries; `None` when it is not a confirmation. More than the
/// cap (a forged list): refused.
fn carried(state: &State, p: &[(String, String)]) -> Result<Option<Vec<i64>>, Error> {
    if get(p, "confirm") != Some("yes") {
        return Ok(None);
    }
    let Some(list) = p.iter().find(|(k, _)| k == CONFIRMED).map(|(_, v)| v) else {
        return Ok(None);
    };
    let rows = list
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.trim().parse::<i64>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| Error::Invalid("the confirmation's list is not a list of numbers".into()))?;
    if rows.len() > state.cap {
        return Err(Error::OverCap {
            matched: rows.len(),
            cap: state.cap,
        });
    }
    Ok(Some(rows))
}

/// " (N of the M confirmed were no longer …)" when some were not acted on.
fn left_out(done: u64, confirmed: usize, what: &str) -> String {
    if (done as usize) < confirmed {
        format!(
            " ({} of the {confirmed} confirmed were no longer {what})",
            confirmed - done as usize
        )
    } else {
        String::new()
    }
}

fn done(state: &State, back: &str, title: &str, message: &str) -> Response {
    let body = format!(
        "<p class=\"notice ok\" id=\"result\">{}</p><p><a href=\"{}{back}\" data-test=\"back\">Back</a></p>",
        esc(message),
        state.base
    );
    Html(page(&state.base, "", title, &body, false, "")).into_response()
}

fn over(state: &State, e: &Error) -> Response {
    let body = format!(
        "<p class=\"notice bad\" id=\"result\">{}</p>",
        esc(&e.to_string())
    );
    (
        StatusCode::BAD_REQUEST,
        Html(page(&state.base, "", "Refused", &body, false, "")),
    )
        .into_response()
}

/// The parked events a requeue or discard form names: `id` fields, or else its filter.
fn parked_selection(p: &[(String, String)]) -> Result<parked::Selection, Error> {
    let ids: Vec<&str> = p
        .iter()
        .filter(|(k, _)| k == "id")
        .map(|(_, v)| v.as_str())
        .collect();
    if ids.is_empty() {
        return Ok(parked::Selection::Filter(parked_filter(p)?));
    }
    ids.iter()
        .map(|s| {
            Uuid::parse_str(s.trim()).map_err(|_| {
                Error::Invalid(format!(
                    "{:?} is not an event id",
                    postal_shared::text::bounded(s, 60)
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(parked::Selection::Ids)
}

fn target(p: &[(String, String)]) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (k, v) in p {
        if NOT_CARRIED.contains(&k.as_str()) || v.trim().is_empty() {
            continue;
        }
        match m.get_mut(k) {
            Some(serde_json::Value::Array(a)) => a.push(v.clone().into()),
            Some(old) => *old = serde_json::Value::Array(vec![old.clone(), v.clone().into()]),
            None => {
                m.insert(k.clone(), v.clone().into());
            }
        }
    }
    serde_json::Value::Object(m)
}

async fn parked_action(
    state: State,
    actor: Actor,
    p: Vec<(String, String)>,
    discard: bool,
) -> Response {
    let p = decoded(p);
    if let Some(r) = refused(&state, &p) {
        return r;
    }
    let path = if discard {
        "/parked/discard"
    } else {
        "/parked/requeue"
    };
    let seqs = match carried(&state, &p) {
        Ok(Some(seqs)) => seqs,
        Ok(None) => {
            let selection = match parked_selection(&p) {
                Ok(s) => s,
                Err(e) => return failed(&e),
            };
            let seqs = match parked::matched(&state.pool, &selection, Some(state.cap)).await {
                Ok(s) => s,
                Err(e @ Error::OverCap { .. }) => return over(&state, &e),
                Err(e) => return failed(&e),
            };
            let question = if discard {
                "Discard these parked events for good? The later events of their keys will flow; the discarded events are kept only in the audit trail."
            } else {
                "Requeue these parked events? The relay publishes them again, each ahead of the later events of its key."
            };
            let ask = Ask {
                action: path,
                title: if discard { "Discard" } else { "Requeue" },
                question,
                rows: &seqs,
                danger: discard,
            };
            return confirm(&state, ask, &p).await;
        }
        Err(e @ Error::OverCap { .. }) => return over(&state, &e),
        Err(e) => return failed(&e),
    };
    let by = audit::Operator::dashboard(&actor.0);
    let result = if discard {
        parked::discard_seqs(&state.pool, &by, &target(&p), &seqs, |_| Ok(())).await
    } else {
        parked::requeue_seqs(&state.pool, &by, &target(&p), &seqs, |_| {}).await
    };
    let rest = |n| left_out(n, seqs.len(), "parked");
    match result {
        Ok(n) if discard => done(
            &state,
            "/parked",
            "Discarded",
            &format!(
                "Discarded {n} parked event(s); the later events of their keys flow.{}",
                rest(n)
            ),
        ),
        Ok(n) => done(
            &state,
            "/parked",
            "Requeued",
            &format!(
                "Requeued {n} event(s); the relay publishes them with their original ids, in order.{}",
                rest(n)
            ),
        ),
        Err(e) => failed(&e),
    }
}

pub(crate) async fn requeue(
    Extract(state): Extract<State>,
    Extension(actor): Extension<Actor>,
    Form(p): Pairs,
) -> Response {
    parked_action(state, actor, p, false).await
}

pub(crate) async fn discard(
    Extract(state): Extract<State>,
    Extension(actor): Extension<Actor>,
    Form(p): Pairs,
) -> Response {
    parked_action(state, actor, p, true).await
}

pub(crate) async fn release(
    Extract(state): Extract<State>,
    Extension(actor): Extension<Actor>,
    Form(p): Pairs,
) -> Response {
    let p = decoded(p);
    if let Some(r) = refused(&state, &p) {
        return r;
    }
    let seqs = match carried(&state, &p) {
        Ok(Some(seqs)) => seqs,
        Ok(None) => {
            let head = match get(&p, "head").map(Uuid::parse_str) {
                Some(Ok(h)) => h,
                _ => return failed(&Error::Invalid("release needs the head's event id".into())),
            };
            let (key, seqs) = match parked::key_of_head(&state.pool, head, Some(state.cap)).await {
                Ok(Some(found)) => found,
                Ok(None) => (String::new(), Vec::new()),
                Err(e @ Error::OverCap { .. }) => return over(&state, &e),
                Err(e) => return failed(&e),
            };
            let question = format!(
                "Requeue the parked events of key {key:?} (its head: event {head})? The relay publishes the head first, then the events waiting behind it, in order."
            );
            let ask = Ask {
                action: "/blocked/release",
                title: "Release the key",
                question: &question,
                rows: &seqs,
                danger: false,
            };
            return confirm(&state, ask, &p).await;
        }
        Err(e @ Error::OverCap { .. }) => return over(&state, &e),
        Err(e) => return failed(&e),
    };
    let by = audit::Operator::dashboard(&actor.0);
    match parked::release_seqs(&state.pool, &by, &target(&p), &seqs).await {
        Ok(n) => {
            done(
                &state,
                "/blocked",
                "Released",
                &format!(
                    "Requeued {n} parked event(s) of the key; the relay publishes them, then the events behind them, in order.{}",
                    left_out(n, seqs.len(), "parked")
                ),
            )
        }
        Err(e) => failed(&e),
    }
}

async fn dead_action(
    state: State,
    actor: Actor,
    p: Vec<(String, String)>,
    replay: bool,
) -> Response {
    let p = decoded(p);
    if let Some(r) = refused(&state, &p) {
        return r;
    }
    let path = if replay {
        "/dead-letters/replay"
    } else {
        "/dead-letters/resolve"
    };
    let found = match carried(&state, &p) {
        Ok(Some(ids)) => ids,
        Ok(None) => {
            let ids: Result<Vec<i64>, _> = p
                .iter()
                .filter(|(k, _)| k == "id")
                .map(|(_, v)| v.trim().parse::<i64>())
                .collect();
            let Ok(ids) = ids else {
                return failed(&Error::Invalid("a dead letter id is not a number".into()));
            };
            let filter = match dead_filter(&p) {
                Ok(f) => f,
                Err(e) => return failed(&e),
            };
            let found =
                match dead_letters::matched(&state.pool, &ids, &filter, Some(state.cap)).await {
                    Ok(f) => f,
                    Err(e @ Error::OverCap { .. }) => return over(&state, &e),
                    Err(e) => return failed(&e),
                };
            let question = if replay {
                "Send these dead letters back to their topics? Each event goes through its consumer's handler once more — once."
            } else {
                "Mark these dead letters resolved? They stay recorded; their events are not processed again."
            };
            let ask = Ask {
                action: path,
                title: if replay { "Replay" } else { "Resolve" },
                question,
                rows: &found,
                danger: false,
            };
            return confirm(&state, ask, &p).await;
        }
        Err(e @ Error::OverCap { .. }) => return over(&state, &e),
        Err(e) => return failed(&e),
    };
    let by = audit::Operator::dashboard(&actor.0);
    let result = if replay {
        let Some(producer) = &state.producer else {
            return failed(&Error::Invalid(
                "replay needs the broker: start the dashboard with --bootstrap-servers".into(),
            ));
        };
        dead_letters::replay(&state.pool, producer, &by, &target(&p), &found, |_| {}).await
    } else {
        dead_letters::resolve(&state.pool, &by, &target(&p), &found).await
    };
    match result {
        Ok(n) => {
            let rest = left_out(n, found.len(), "open");
            let message = if replay {
                format!("Replayed {n} dead letter(s) to their topics.{rest}")
            } else {
                format!("Marked {n} dead letter(s) resolved.{rest}")
            };
            done(
                &state,
                "/dead-letters",
                if replay { "Replayed" } else { "Resolved" },
                &message,
            )
        }
        Err(e) => failed(&e),
    }
}

pub(crate) async fn replay(
    Extract(state): Extract<State>,
    Extension(actor): Extension<Actor>,
    Form(p): Pairs,
) -> Response {
    dead_action(state, actor, p, true).await
}

pub(crate) async fn resolve(
    Extract(state): Extract<State>,
    Extension(actor): Extension<Actor>,
    Form(p): Pairs,
) -> Response {
    dead_action(state, actor, p, false).await
}
