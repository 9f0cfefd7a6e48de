//! Reading a page's query or an action's form, and writing form controls.

use std::fmt::Write as _;

use axum::extract::Query;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use chrono::{DateTime, NaiveDateTime, Utc};
use uuid::Uuid;

use super::html::esc;
use super::State;
use crate::{dead_letters, parked, Error};

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

/// Refuses a query or form any of whose values holds a NUL character (no stored text can:
/// PostgreSQL refused it as an encoding error, a 500), with a one-line 400.
pub(crate) fn refuse_nul(pairs: &[(String, String)]) -> Result<(), Error> {
    match pairs.iter().find(|(_, v)| v.contains('\0')) {
        Some((k, _)) => Err(Error::Invalid(format!(
            "{}: holds a NUL character, which no stored value can",
            postal_shared::text::bounded(k, 40)
        ))),
        None => Ok(()),
    }
}

/// The value of `name` in the query or form, empty ones as absent.
pub(crate) fn get<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, v)| k == name && !v.trim().is_empty())
        .map(|(_, v)| v.trim())
}

pub(crate) fn time(v: Option<&str>, name: &str) -> Result<Option<DateTime<Utc>>, Error> {
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

pub(crate) fn uuid(v: Option<&str>, name: &str) -> Result<Option<Uuid>, Error> {
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
    refuse_nul(p)?;
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
    refuse_nul(p)?;
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
///
/// Values travel hex-encoded (`hex:<name>`, read back by [`decoded`]): a key or topic may hold
/// any character, and HTML and form encoding would not carry every one back exactly (control
/// characters, line breaks), so an action could hit a lookalike.
pub(crate) fn hidden(pairs: &[(String, String)], names: &[&str]) -> String {
    let mut s = String::new();
    for n in names {
        if let Some(v) = get(pairs, n) {
            let _ = write!(
                s,
                "<input type=\"hidden\" name=\"hex:{n}\" value=\"{}\">",
                hex(v)
            );
        }
    }
    s
}

fn hex(v: &str) -> String {
    v.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(v: &str) -> Option<String> {
    if !v.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..v.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(v.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// A posted form with its `hex:<name>` fields decoded to `<name>` (one that does not decode is
/// dropped, so that it matches nothing rather than something else).
pub(crate) fn decoded(pairs: Vec<(String, String)>) -> Vec<(String, String)> {
    pairs
        .into_iter()
        .filter_map(|(k, v)| match k.strip_prefix("hex:") {
            Some(name) => unhex(&v).map(|v| (name.to_owned(), v)),
            None => Some((k, v)),
        })
        .collect()
}

pub(crate) const PARKED_FIELDS: &[&str] = &[
    "event_id",
    "topic",
    "key",
    "event_type",
    "reason",
    "since",
    "until",
];
pub(crate) const DEAD_FIELDS: &[&str] =
    &["consumer", "topic", "event_id", "reason", "error", "all"];

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

pub(crate) fn input(p: &[(String, String)], name: &str, label: &str, kind: &str) -> String {
    format!(
        "<label>{label}<input type=\"{kind}\" name=\"{name}\" value=\"{}\"></label>",
        esc(get(p, name).unwrap_or(""))
    )
}
