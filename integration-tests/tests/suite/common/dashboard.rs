//! Helpers of the dashboard scenarios: a dashboard served on a free loopback port, an
//! operator's clicks on it, and parked events to act on.

use std::net::SocketAddr;

use postal_admin::web::{serve, Dashboard};
use postal_integration_tests::http::{form, form_fields, pairs, request, Answer};
use postal_producer::{enqueue_batch, NewEvent};
use sqlx::PgPool;

/// Serves `dashboard` on a free loopback port.
pub async fn start(dashboard: Dashboard) -> SocketAddr {
    let (addr, _task) = serve("127.0.0.1:0".parse().unwrap(), dashboard)
        .await
        .expect("dashboard serves");
    addr
}

/// Posts the form `fields` to `path`, from the dashboard's own origin.
pub async fn post(addr: SocketAddr, path: &str, fields: &[(&str, &str)]) -> Answer {
    let origin = format!("http://{addr}");
    request(addr, "POST", path, &[("Origin", &origin)], &form(fields)).await
}

/// Clicks an action button: posts `fields`, then confirms on the page that asks (its own form,
/// as a browser would submit it). Returns the confirmation page and the result.
pub async fn click_and_confirm(
    addr: SocketAddr,
    path: &str,
    fields: &[(&str, &str)],
) -> (Answer, Answer) {
    let ask = post(addr, path, fields).await;
    assert_eq!(ask.status, 200, "{}", ask.body);
    let confirm = form_fields(&ask.body, "confirm", 0);
    let done = post(addr, path, &pairs(&confirm)).await;
    (ask, done)
}

/// Enqueues `events` and parks every one of them with `error`, as the relay would.
/// In one transaction, so that a running relay never sees them pending.
pub async fn park(pool: &PgPool, events: Vec<NewEvent>, error: &str) -> Vec<uuid::Uuid> {
    let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.id().as_uuid()).collect();
    let mut tx = pool.begin().await.unwrap();
    enqueue_batch(&mut tx, events).await.unwrap();
    sqlx::query(
        "UPDATE postal.outbox SET status = 'failed', held = true, attempts = 3, last_error = $2,
                available_at = now() WHERE event_id = ANY($1)",
    )
    .bind(&ids)
    .bind(error)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    ids
}

/// The outbox status of event `id` (`None`: no longer in the outbox).
pub async fn status(pool: &PgPool, id: uuid::Uuid) -> Option<String> {
    sqlx::query_scalar("SELECT status FROM postal.outbox WHERE event_id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await
        .unwrap()
}
