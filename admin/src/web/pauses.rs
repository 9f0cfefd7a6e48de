//! Pauses: the list of pauses in force (`GET /pauses`), and pausing and resuming
//! (`POST /pauses/pause`, `POST /pauses/resume`) through [`crate::pauses`], as `postal pause`
//! and `postal resume` do: each asks first (what it pauses or resumes, in words), then acts,
//! recorded in the audit trail with the dashboard user.

use std::time::Duration;

use axum::extract::State as Extract;
use axum::response::{Html, IntoResponse, Response};
use axum::{Extension, Form};

use super::form::{decoded, failed, get, hidden};
use super::guard::Actor;
use super::html::{esc, page, table};
use super::State;
use crate::pauses::{self, Scope};
use crate::{audit, Error};

type Pairs = Form<Vec<(String, String)>>;

/// How long a pause from the dashboard waits for the work in flight.
const WAIT: Duration = Duration::from_secs(60);

/// The scope a form names: `side` (`relay` or `consumer`), `group` (a relay pause without one
/// covers every relay group), `topic` (none: every topic of the group).
fn scope(p: &[(String, String)]) -> Result<Scope, Error> {
    let (group, topic) = (get(p, "group"), get(p, "topic"));
    match get(p, "side") {
        Some("relay") => Scope::relay(group, topic),
        Some("consumer") => Scope::consumer(
            group.ok_or_else(|| Error::Invalid("a consumer pause needs its group".into()))?,
            topic,
        ),
        _ => Err(Error::Invalid("side must be relay or consumer".into())),
    }
}

fn form(state: &State, action: &str, fields: &str, button: &str, test: &str) -> String {
    format!(
        "<form method=\"post\" action=\"{}{action}\" class=\"inline\">\
         <input type=\"hidden\" name=\"csrf\" value=\"{}\">{fields}\
         <button type=\"submit\" data-test=\"{test}\">{}</button></form>",
        state.base,
        state.csrf,
        esc(button)
    )
}

pub(crate) async fn list(Extract(state): Extract<State>) -> Response {
    let all = match pauses::list(&state.pool).await {
        Ok(a) => a,
        Err(e) => return failed(&e),
    };
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|p| {
            // Hex-encoded as every carried value is (`form::hidden`): a name is kept exactly.
            let mut pairs = vec![("side".to_owned(), p.side.clone())];
            for (name, v) in [("group", &p.group_name), ("topic", &p.topic)] {
                if let Some(v) = v {
                    pairs.push((name.to_owned(), v.clone()));
                }
            }
            let fields = hidden(&pairs, &["side", "group", "topic"]);
            vec![
                esc(&p.side),
                esc(p.group_name.as_deref().unwrap_or("(every relay group)")),
                esc(p.topic.as_deref().unwrap_or("(every topic)")),
                p.paused_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                esc(&p.paused_by),
                esc(p.reason.as_deref().unwrap_or("-")),
                if state.actions {
                    form(&state, "/pauses/resume", &fields, "Resume", "resume")
                } else {
                    String::new()
                },
            ]
        })
        .collect();
    let mut body = table(
        "pauses",
        &["Side", "Group", "Topic", "Since (UTC)", "By", "Reason", ""],
        &rows,
        "Nothing is paused.",
    );
    if state.actions {
        body.push_str(&format!(
            "<h2>Pause</h2><form method=\"post\" action=\"{}/pauses/pause\" id=\"pause-form\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <label>Side <select name=\"side\"><option value=\"relay\">relay (stop publishing)</option>\
             <option value=\"consumer\">consumer (stop applying)</option></select></label> \
             <label>Group <input name=\"group\" placeholder=\"relay: every group\"></label> \
             <label>Topic <input name=\"topic\" placeholder=\"every topic\"></label> \
             <label>Reason <input name=\"reason\"></label> \
             <button type=\"submit\" data-test=\"pause\">Pause…</button></form>",
            state.base, state.csrf
        ));
    }
    Html(page(&state.base, "/pauses", "Pauses", &body, false, "")).into_response()
}

/// The page that asks first: what the action does, in words, and a form carrying the scope.
fn ask(
    state: &State,
    action: &str,
    title: &str,
    question: &str,
    p: &[(String, String)],
) -> Response {
    let fields = hidden(p, &["side", "group", "topic", "reason"]);
    let body = format!(
        "<div class=\"confirm\" id=\"confirm\"><p>{}</p>\
         <form method=\"post\" action=\"{}{action}\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
         <input type=\"hidden\" name=\"confirm\" value=\"yes\">{fields}\
         <button type=\"submit\" class=\"danger\" data-test=\"confirm\">{}</button> \
         <a href=\"{}/pauses\" data-test=\"cancel\">Cancel</a></form></div>",
        esc(question),
        state.base,
        state.csrf,
        esc(title),
        state.base,
    );
    Html(page(&state.base, "", title, &body, false, "")).into_response()
}

fn done(state: &State, title: &str, message: &str) -> Response {
    let body = format!(
        "<p class=\"notice ok\" id=\"result\">{}</p><p><a href=\"{}/pauses\" data-test=\"back\">Back</a></p>",
        esc(message),
        state.base
    );
    Html(page(&state.base, "", title, &body, false, "")).into_response()
}

pub(crate) async fn pause(
    Extract(state): Extract<State>,
    Extension(actor): Extension<Actor>,
    Form(p): Pairs,
) -> Response {
    let p = decoded(p);
    if let Some(r) = super::actions::refused(&state, &p) {
        return r;
    }
    let scope = match scope(&p) {
        Ok(s) => s,
        Err(e) => return failed(&e),
    };
    if get(&p, "confirm") != Some("yes") {
        let question =
            format!(
            "Pause {}? Nothing of it is {} until it is resumed; the work in flight finishes first.",
            scope.describe(),
            if scope.side() == pauses::Side::Relay { "published" } else { "applied" }
        );
        return ask(&state, "/pauses/pause", "Pause", &question, &p);
    }
    let by = audit::Operator::dashboard(&actor.0);
    let result = async {
        let mut tx = postal_shared::cancel_safe::begin(&state.pool).await?;
        let new = pauses::pause(&mut tx, &by, &scope, get(&p, "reason"), WAIT).await?;
        tx.commit().await?;
        if scope.side() == pauses::Side::Relay {
            pauses::wait_for_relay_claims(&state.pool, &scope, WAIT).await?;
        }
        Ok::<_, Error>(new)
    }
    .await;
    match result {
        Ok(true) => done(
            &state,
            "Paused",
            &format!(
                "Paused {}; the work in flight has finished.",
                scope.describe()
            ),
        ),
        Ok(false) => done(
            &state,
            "Paused",
            &format!("{} was paused already.", scope.describe()),
        ),
        Err(e) => failed(&e),
    }
}

pub(crate) async fn resume(
    Extract(state): Extract<State>,
    Extension(actor): Extension<Actor>,
    Form(p): Pairs,
) -> Response {
    let p = decoded(p);
    if let Some(r) = super::actions::refused(&state, &p) {
        return r;
    }
    let scope = match scope(&p) {
        Ok(s) => s,
        Err(e) => return failed(&e),
    };
    if get(&p, "confirm") != Some("yes") {
        let question = format!(
            "Resume {}? It goes on from where it stopped.",
            scope.describe()
        );
        return ask(&state, "/pauses/resume", "Resume", &question, &p);
    }
    let by = audit::Operator::dashboard(&actor.0);
    let result = async {
        let mut tx = postal_shared::cancel_safe::begin(&state.pool).await?;
        let lifted = pauses::resume(&mut tx, &by, &scope).await?;
        tx.commit().await?;
        Ok::<_, Error>(lifted)
    }
    .await;
    match result {
        Ok(true) => done(&state, "Resumed", &format!("Resumed {}.", scope.describe())),
        Ok(false) => done(
            &state,
            "Resumed",
            &format!("{} was not paused.", scope.describe()),
        ),
        Err(e) => failed(&e),
    }
}
