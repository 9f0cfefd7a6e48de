//! The actions (POST): requeue, discard, release a key, replay, resolve. Each asks first: the
//! confirmation page shows how many events the action matches now (refusing more than the
//! cap), and the action runs only if the confirmed count still matches. Each is recorded in
//! the audit trail.

use std::fmt::Write as _;

use axum::extract::State as Extract;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::{Extension, Form};
use uuid::Uuid;

use super::form::{dead_filter, failed, get, parked_filter};
use super::guard::Actor;
use super::html::{esc, page};
use super::State;
use crate::{audit, dead_letters, parked, Error};

type Pairs = Form<Vec<(String, String)>>;

/// Refuses a POST without this dashboard's CSRF token, or with actions disabled.
fn refused(state: &State, p: &[(String, String)]) -> Option<Response> {
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

/// What a confirmation page asks.
struct Ask<'a> {
    /// The action's path.
    action: &'a str,
    title: &'a str,
    question: &'a str,
    /// How many it matches now.
    matched: usize,
    danger: bool,
    /// Shown above (escaped HTML), e.g. that the count changed.
    notice: String,
}

/// The page that asks to confirm: what, how many, and the same form again with the count.
fn confirm(state: &State, ask: Ask<'_>, p: &[(String, String)]) -> Response {
    let Ask {
        action,
        title,
        question,
        matched,
        danger,
        notice,
    } = ask;
    let back = if action.starts_with("/dead-letters") {
        "/dead-letters"
    } else if action.starts_with("/blocked") {
        "/blocked"
    } else {
        "/parked"
    };
    let mut fields = String::new();
    for (k, v) in p {
        if k == "csrf" || k == "confirm" || k == "expected" {
            continue;
        }
        let _ = write!(
            fields,
            "<input type=\"hidden\" name=\"{}\" value=\"{}\">",
            esc(k),
            esc(v)
        );
    }
    let body = format!(
        "<div class=\"confirm\" id=\"confirm\"><p>{}</p>\
         <p id=\"confirm-count\"><b>{matched}</b> will be affected (at most {} per action).</p>\
         <form method=\"post\" action=\"{}{action}\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
         <input type=\"hidden\" name=\"confirm\" value=\"yes\"><input type=\"hidden\" name=\"expected\" value=\"{matched}\">{fields}\
         <button type=\"submit\" class=\"{}\" data-test=\"confirm\">{}</button> \
         <a href=\"{}{}\" data-test=\"cancel\">Cancel</a></form></div>",
        esc(question),
        state.cap,
        state.base,
        state.csrf,
        if danger { "danger" } else { "" },
        esc(title),
        state.base,
        back,
    );
    Html(page(&state.base, "", title, &body, false, &notice)).into_response()
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
        if k == "csrf" || k == "confirm" || k == "expected" || v.trim().is_empty() {
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

/// The confirmed count, when the form carries one and it equals `matched`.
fn confirmed(p: &[(String, String)], matched: usize) -> Result<bool, String> {
    if get(p, "confirm") != Some("yes") {
        return Ok(false);
    }
    match get(p, "expected").and_then(|e| e.parse::<usize>().ok()) {
        Some(e) if e == matched => Ok(true),
        Some(e) => Err(format!(
            "The selection changed since you looked: {e} then, {matched} now. Confirm again."
        )),
        None => Ok(false),
    }
}

async fn parked_action(
    state: State,
    actor: Actor,
    p: Vec<(String, String)>,
    discard: bool,
) -> Response {
    if let Some(r) = refused(&state, &p) {
        return r;
    }
    let selection = match parked_selection(&p) {
        Ok(s) => s,
        Err(e) => return failed(&e),
    };
    let seqs = match parked::matched(&state.pool, &selection, Some(state.cap)).await {
        Ok(s) => s,
        Err(e @ Error::OverCap { .. }) => return over(&state, &e),
        Err(e) => return failed(&e),
    };
    let (verb, path) = if discard {
        ("discard", "/parked/discard")
    } else {
        ("requeue", "/parked/requeue")
    };
    match confirmed(&p, seqs.len()) {
        Ok(true) => {}
        Ok(false) | Err(_) => {
            let notice = match confirmed(&p, seqs.len()) {
                Err(m) => format!("<p class=\"notice bad\">{}</p>", esc(&m)),
                _ => String::new(),
            };
            let question = if discard {
                "Discard these parked events for good? The later events of their keys will flow; the discarded events are kept only in the audit trail."
            } else {
                "Requeue these parked events? The relay publishes them again, each ahead of the later events of its key."
            };
            let title = if discard { "Discard" } else { "Requeue" };
            let ask = Ask {
                action: path,
                title,
                question,
                matched: seqs.len(),
                danger: discard,
                notice,
            };
            return confirm(&state, ask, &p);
        }
    }
    let result = if discard {
        let mut removed = Vec::new();
        let n = parked::discard_seqs(&state.pool, &seqs, |batch| {
            removed.extend(batch);
            Ok(())
        })
        .await;
        match n {
            Ok(n) => {
                let removed = serde_json::to_value(&removed).unwrap_or_default();
                audit::record(&state.pool, &actor.0, verb, &target(&p), n, Some(&removed))
                    .await
                    .map(|_| n)
            }
            Err(e) => Err(e),
        }
    } else {
        match parked::requeue_seqs(&state.pool, &seqs, |_| {}).await {
            Ok(n) => audit::record(&state.pool, &actor.0, verb, &target(&p), n, None)
                .await
                .map(|_| n),
            Err(e) => Err(e),
        }
    };
    match result {
        Ok(n) if discard => done(&state, "/parked", "Discarded", &format!("Discarded {n} parked event(s); the later events of their keys flow.")),
        Ok(n) => done(&state, "/parked", "Requeued", &format!("Requeued {n} event(s); the relay publishes them with their original ids, in order.")),
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
    if let Some(r) = refused(&state, &p) {
        return r;
    }
    let (Some(topic), Some(key)) = (
        p.iter().find(|(k, _)| k == "topic").map(|(_, v)| v.clone()),
        p.iter().find(|(k, _)| k == "key").map(|(_, v)| v.clone()),
    ) else {
        return failed(&Error::Invalid("release needs a topic and a key".into()));
    };
    let filter = parked::Filter {
        topic: Some(topic.clone()),
        key: Some(key.clone()),
        ..Default::default()
    };
    let seqs = match parked::matched(
        &state.pool,
        &parked::Selection::Filter(filter),
        Some(state.cap),
    )
    .await
    {
        Ok(s) => s,
        Err(e @ Error::OverCap { .. }) => return over(&state, &e),
        Err(e) => return failed(&e),
    };
    match confirmed(&p, seqs.len()) {
        Ok(true) => {}
        other => {
            let notice = match other {
                Err(m) => format!("<p class=\"notice bad\">{}</p>", esc(&m)),
                _ => String::new(),
            };
            let question = format!("Requeue the parked events of key {key:?} on {topic:?}? The relay publishes the head first, then the events waiting behind it, in order.");
            let ask = Ask {
                action: "/blocked/release",
                title: "Release the key",
                question: &question,
                matched: seqs.len(),
                danger: false,
                notice,
            };
            return confirm(&state, ask, &p);
        }
    }
    match parked::requeue_seqs(&state.pool, &seqs, |_| {}).await {
        Ok(n) => {
            if let Err(e) =
                audit::record(&state.pool, &actor.0, "release-key", &target(&p), n, None).await
            {
                return failed(&e);
            }
            done(&state, "/blocked", "Released", &format!("Requeued {n} parked event(s) of the key; the relay publishes them, then the events behind them, in order."))
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
    if let Some(r) = refused(&state, &p) {
        return r;
    }
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
    let found = match dead_letters::matched(&state.pool, &ids, &filter, Some(state.cap)).await {
        Ok(f) => f,
        Err(e @ Error::OverCap { .. }) => return over(&state, &e),
        Err(e) => return failed(&e),
    };
    let (verb, path) = if replay {
        ("replay", "/dead-letters/replay")
    } else {
        ("resolve", "/dead-letters/resolve")
    };
    match confirmed(&p, found.len()) {
        Ok(true) => {}
        other => {
            let notice = match other {
                Err(m) => format!("<p class=\"notice bad\">{}</p>", esc(&m)),
                _ => String::new(),
            };
            let question = if replay {
                "Send these dead letters back to their topics? Each event goes through its consumer's handler once more — once."
            } else {
                "Mark these dead letters resolved? They stay recorded; their events are not processed again."
            };
            let title = if replay { "Replay" } else { "Resolve" };
            let ask = Ask {
                action: path,
                title,
                question,
                matched: found.len(),
                danger: false,
                notice,
            };
            return confirm(&state, ask, &p);
        }
    }
    let result = if replay {
        let Some(producer) = &state.producer else {
            return failed(&Error::Invalid(
                "replay needs the broker: start the dashboard with --bootstrap-servers".into(),
            ));
        };
        dead_letters::replay(&state.pool, producer, &found, |_| {}).await
    } else {
        dead_letters::resolve(&state.pool, &found, &actor.0).await
    };
    match result {
        Ok(n) => {
            if let Err(e) = audit::record(&state.pool, &actor.0, verb, &target(&p), n, None).await {
                return failed(&e);
            }
            let message = if replay {
                format!("Replayed {n} dead letter(s) to their topics.")
            } else {
                format!("Marked {n} dead letter(s) resolved.")
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
