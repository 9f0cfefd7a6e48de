//! A task outbox (seed 003): a service that records report requests and generates the reports
//! in-process, through Postal's relay running a task handler instead of publishing.
//!
//! Each request commits a `report_requests` row and a `report.requested` task on topic
//! `reports` in one transaction. The embedded relay (group `reports`, claiming topic `reports`
//! only, so `postal relay --exclude-topics reports` can serve the rest of the outbox) runs the
//! handler: it "generates" the report (sleeps `REPORT_MS`) and stores it keyed by the task's
//! event id, so a re-run after a crash stores nothing twice. Failures retry with backoff and
//! are parked after `POSTAL_MAX_ATTEMPTS`; a killed worker's tasks run again after the lease.
//!
//! ```text
//! DATABASE_URL=postgres://… REPORTS=20 cargo run -p postal-integration-tests --bin report_worker
//! ```
//! Environment: `DATABASE_URL` (required), `REPORTS` (requests to enqueue at start, default
//! 20; 0 = none), `REPORT_MS` (work per report, default 200), `POSTAL_LEASE` (default `10s`) and the other relay variables,
//! `EXIT_WHEN_DONE` (`1`: stop once no task is left; else SIGINT/SIGTERM stops it).

use std::time::Duration;

use postal_integration_tests::service::{connect, env_or, env_required, init_tracing};
use postal_producer::{
    enqueue, NewEvent, Relay, RelayConfig, State, Task, TaskConfig, TaskError, TaskTransport,
    TopicFilter,
};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Serialize, Deserialize)]
struct ReportRequested {
    request_id: i64,
    customer: String,
}

async fn request_reports(pool: &PgPool, n: i64) -> anyhow::Result<()> {
    for i in 0..n {
        let customer = format!("customer-{}", i % 5);
        let mut tx = pool.begin().await?;
        let request_id: i64 =
            sqlx::query_scalar("INSERT INTO report_requests (customer) VALUES ($1) RETURNING id")
                .bind(&customer)
                .fetch_one(&mut *tx)
                .await?;
        let task = ReportRequested {
            request_id,
            customer: customer.clone(),
        };
        enqueue(
            &mut tx,
            NewEvent::json("reports", customer.as_str(), "report.requested", &task)?,
        )
        .await?;
        tx.commit().await?;
    }
    tracing::info!(requests = n, "report requests recorded");
    Ok(())
}

/// What the report handler needs: the task runner's state.
#[derive(Clone)]
struct Reports {
    pool: PgPool,
    /// How long generating one report takes.
    work: Duration,
}

async fn generate(State(reports): State<Reports>, task: Task) -> Result<(), TaskError> {
    let req: ReportRequested = task.json()?;
    tokio::time::sleep(reports.work).await;
    let body = format!(
        "report for {} (request {}), attempt {}",
        req.customer, req.request_id, task.attempt
    );
    // The event id is the idempotency key: a re-run after a crash stores nothing twice.
    sqlx::query(
        "INSERT INTO reports (event_id, request_id, body) VALUES ($1, $2, $3)
         ON CONFLICT (event_id) DO NOTHING",
    )
    .bind(task.id.as_uuid())
    .bind(req.request_id)
    .bind(body)
    .execute(&reports.pool)
    .await
    .map_err(|e| {
        if postal_shared::database_unavailable(&e) {
            TaskError::retryable(e)
        } else {
            TaskError::permanent(e)
        }
    })?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing("info");
    let pool = connect(
        &env_required("DATABASE_URL")?,
        "CREATE TABLE IF NOT EXISTS report_requests (id bigserial PRIMARY KEY, customer text NOT NULL);
         CREATE TABLE IF NOT EXISTS reports (
             event_id uuid PRIMARY KEY, request_id bigint NOT NULL, body text NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now());",
    )
    .await?;
    request_reports(&pool, env_or("REPORTS", 20)?).await?;

    let work = Duration::from_millis(env_or("REPORT_MS", 200)?);
    let tasks = TaskTransport::new(TaskConfig::default())
        .state(Reports {
            pool: pool.clone(),
            work,
        })
        .on("report.requested", generate);
    // This service's defaults, then the relay variables of the environment (POSTAL_LEASE, …).
    let config = RelayConfig::default()
        .group("reports".into())
        .topics(TopicFilter::Only(vec!["reports".into()]))
        .lease(Duration::from_secs(10))
        .with_env()?;
    let relay = Relay::new(pool.clone(), tasks, config)?;
    let exit_when_done = env_or("EXIT_WHEN_DONE", 0)? == 1;
    let signal = postal_shared::stop_signal()?;
    let done_pool = pool.clone();
    let stop = async move {
        if exit_when_done {
            loop {
                let left: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM postal.outbox WHERE topic = 'reports' AND status = 'pending'",
                )
                .fetch_one(&done_pool)
                .await
                .unwrap_or(1);
                if left == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        } else {
            signal.await;
        }
    };
    let stats = relay.run(stop).await?;
    let reports: i64 = sqlx::query_scalar("SELECT count(*) FROM reports")
        .fetch_one(&pool)
        .await?;
    tracing::info!(
        ran = stats.published,
        parked = stats.parked,
        reports,
        "report worker stopped"
    );
    Ok(())
}
