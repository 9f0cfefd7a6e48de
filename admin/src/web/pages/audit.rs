//! The audit trail.

use axum::extract::State as Extract;
use axum::response::{Html, IntoResponse, Response};

use crate::web::form::failed;
use crate::web::html::{esc, page, table};
use crate::web::State;

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
                esc(e.via.as_deref().unwrap_or("-")),
                esc(e.db_role.as_deref().unwrap_or("-")),
                esc(&e.action),
                format!(
                    "<code>{}</code>",
                    esc(&postal_shared::text::bounded(&e.target.to_string(), 400))
                ),
                e.matched.map_or_else(|| "-".to_owned(), |m| m.to_string()),
                e.affected.to_string(),
                match &e.error {
                    Some(err) => format!("failed: {}", esc(err)),
                    None => e.outcome().to_owned(),
                },
            ]
        })
        .collect();
    let mut body = table(
        "audit",
        &[
            "When (UTC)",
            "Who",
            "Via",
            "Database role",
            "Action",
            "On",
            "Matched",
            "Affected",
            "Outcome",
        ],
        &rows,
        "No actions yet.",
    );
    body.push_str(
        "<p>A discard keeps the events it deleted whole, one row each, in \
         <code>postal.operator_audit_events</code> (by the audit row's id): \
         <code>postal audit show &lt;id&gt;</code> prints them (ids: <code>postal audit list</code>).</p>",
    );
    Html(page(&state.base, "/audit", "Audit trail", &body, true, "")).into_response()
}
