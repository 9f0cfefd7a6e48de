//! Held keys of consumer groups (`FinalFailure::HoldKey`): the list (`GET /held`), and
//! releasing one (`POST /held/release`) through [`crate::held::release`], as `postal held
//! release` does: it asks first, listing the key's first held events and their count, then
//! marks the key for its partition's owner to apply, recorded in the audit trail with the
//! dashboard user.

use std::fmt::Write as _;

use axum::extract::State as Extract;
use axum::response::{Html, IntoResponse, Response};
use axum::{Extension, Form};

use super::form::{decoded, failed, get, hidden};
use super::guard::Actor;
use super::html::{esc, page, table};
use super::State;
use crate::held::{self, HeldKey};
use crate::{audit, Error};

type Pairs = Form<Vec<(String, String)>>;

/// The fields a release carries (hex-encoded, as every carried value is: kept exactly).
const FIELDS: &[&str] = &["group", "topic", "key", "skip_head"];

/// A key's first held events, head first (`offset:event_id:event_type` each).
fn first_events(k: &HeldKey) -> String {
    k.first
        .iter()
        .map(|f| format!("<code>{}</code>", esc(f)))
        .collect::<Vec<_>>()
        .join("<br>")
}

fn release_form(state: &State, group: &str, k: &HeldKey, skip_head: bool) -> String {
    let mut pairs = vec![
        ("group".to_owned(), group.to_owned()),
        ("topic".to_owned(), k.topic.clone()),
        ("key".to_owned(), k.key.clone()),
    ];
    if skip_head {
        pairs.push(("skip_head".to_owned(), "yes".to_owned()));
    }
    format!(
        "<form method=\"post\" action=\"{}/held/release\" class=\"inline\">\
         <input type=\"hidden\" name=\"csrf\" value=\"{}\">{}\
         <button type=\"submit\" data-test=\"{}\"{}>{}</button></form>",
        state.base,
        state.csrf,
        hidden(&pairs, FIELDS),
        if skip_head {
            "skip-head"
        } else {
            "release-held"
        },
        if skip_head { " class=\"danger\"" } else { "" },
        if skip_head {
            "Dead-letter the head, then release the rest"
        } else {
            "Retry the head, then release the rest"
        },
    )
}

pub(crate) async fn list(Extract(state): Extract<State>) -> Response {
    let groups = match held::groups(&state.pool).await {
        Ok(g) => g,
        Err(e) => return failed(&e),
    };
    let mut rows: Vec<Vec<String>> = Vec::new();
    for group in &groups {
        let keys = match held::list(&state.pool, group).await {
            Ok(k) => k,
            Err(e) => return failed(&e),
        };
        for k in &keys {
            // A key that is not UTF-8 cannot be named through the form (its bytes would not
            // survive): the CLI releases it.
            let named = std::str::from_utf8(&k.key_bytes).is_ok();
            let mut cells = vec![
                esc(group),
                esc(&k.topic),
                k.partition.to_string(),
                format!("<code>{}</code>", esc(&k.key)),
                format!(
                    "{}: {}",
                    esc(&k.reason),
                    esc(&postal_shared::text::bounded(&k.error, 200))
                ),
                k.attempts.to_string(),
                k.held_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                k.due_at
                    .map_or_else(|| "–".into(), |d| d.format("%Y-%m-%d %H:%M:%S").to_string()),
                format!("<b data-test=\"held-count\">{}</b>", k.count),
                k.bytes.to_string(),
                first_events(k),
            ];
            if state.actions {
                cells.push(match (&k.release, named) {
                    (Some(r), _) => {
                        format!("{} asked; its partition's consumer applies it", esc(r))
                    }
                    (None, true) => format!(
                        "{} {}",
                        release_form(&state, group, k, false),
                        release_form(&state, group, k, true)
                    ),
                    (None, false) => {
                        "not UTF-8: release it with <code>postal held release</code>".into()
                    }
                });
            }
            rows.push(cells);
        }
    }
    let mut head = vec![
        "Group",
        "Topic",
        "Partition",
        "Key",
        "Why (reason: error)",
        "Attempts",
        "Held since (UTC)",
        "Next retry (UTC)",
        "Held records",
        "Bytes",
        "First held (offset:event:type)",
    ];
    if state.actions {
        head.push("");
    }
    let body = format!(
        "<p class=\"muted\">A consumer with <code>FinalFailure::HoldKey</code> stores an event \
         that failed for good and every later record of its key on the partition, and applies \
         none of them until the key is released: the head retried (or dead-lettered), then the \
         rest in offset order. Other keys flow.</p>{}",
        table("held-keys", &head, &rows, "No key is held.")
    );
    Html(page(&state.base, "/held", "Held keys", &body, true, "")).into_response()
}

pub(crate) async fn release(
    Extract(state): Extract<State>,
    Extension(actor): Extension<Actor>,
    Form(p): Pairs,
) -> Response {
    let p = decoded(p);
    if let Some(r) = super::actions::refused(&state, &p) {
        return r;
    }
    let (Some(group), Some(topic), Some(key)) =
        (get(&p, "group"), get(&p, "topic"), get(&p, "key"))
    else {
        return failed(&Error::Invalid(
            "a release names the group, the topic and the key".into(),
        ));
    };
    let skip_head = get(&p, "skip_head") == Some("yes");
    if get(&p, "confirm") != Some("yes") {
        let keys = match held::find(&state.pool, group, topic, key.as_bytes()).await {
            Ok(k) => k,
            Err(e) => return failed(&e),
        };
        let count: i64 = keys.iter().map(|k| k.count).sum();
        let mut listed = String::new();
        for k in &keys {
            let _ = write!(
                listed,
                "<li>partition {}: {}</li>",
                k.partition,
                first_events(k)
            );
        }
        let question = format!(
            "{} key {} of group {} on topic {}? {}",
            if skip_head {
                "Dead-letter the head of"
            } else {
                "Retry the head of"
            },
            postal_shared::text::quoted(key),
            postal_shared::text::quoted(group),
            postal_shared::text::quoted(topic),
            if skip_head {
                "Its head becomes a dead letter; the rest are applied in order."
            } else {
                "Its head goes through the handler again; if it succeeds, the rest are applied in order."
            }
        );
        let title = if skip_head {
            "Skip the head"
        } else {
            "Release"
        };
        let body = format!(
            "<div class=\"confirm\" id=\"confirm\"><p>{}</p>\
             <p id=\"confirm-count\"><b>{count}</b> held record(s) (the head first); the first of them:</p>\
             <ul id=\"confirm-list\">{listed}</ul>\
             <form method=\"post\" action=\"{}/held/release\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <input type=\"hidden\" name=\"confirm\" value=\"yes\">{}\
             <button type=\"submit\" class=\"danger\" data-test=\"confirm\">{}</button> \
             <a href=\"{}/held\" data-test=\"cancel\">Cancel</a></form></div>",
            esc(&question),
            state.base,
            state.csrf,
            hidden(&p, FIELDS),
            esc(title),
            state.base,
        );
        return Html(page(&state.base, "", title, &body, false, "")).into_response();
    }
    let by = audit::Operator::dashboard(&actor.0);
    match held::release(&state.pool, &by, group, topic, key.as_bytes(), skip_head).await {
        Ok(keys) => {
            let count: i64 = keys.iter().map(|k| k.count).sum();
            let body =
                format!(
                "<p class=\"notice ok\" id=\"result\">Release asked for {count} held record(s) of \
                 the key; the consumer that owns its partition applies it (the head {}, then the \
                 rest in order).</p><p><a href=\"{}/held\" data-test=\"back\">Back</a></p>",
                if skip_head { "dead-lettered" } else { "retried" },
                state.base
            );
            Html(page(&state.base, "", "Release asked", &body, false, "")).into_response()
        }
        Err(e) => failed(&e),
    }
}
