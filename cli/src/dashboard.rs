//! `postal dashboard`: the operator dashboard, served until SIGINT/SIGTERM.

use crate::out::say;
use std::net::SocketAddr;

use anyhow::Context;
use clap::Args;
use sqlx::PgPool;

/// Dashboard settings. Every flag can also be given in the environment (named beside it).
#[derive(Args, Debug)]
pub struct DashboardArgs {
    /// Address to serve on. Anything but a loopback address needs --token.
    #[arg(
        long,
        env = "POSTAL_DASHBOARD_LISTEN",
        default_value = "127.0.0.1:9470"
    )]
    listen: SocketAddr,
    /// Token every request must carry (a bearer header, or entered once in the sign-in form).
    /// Pass it in the environment, not as a flag (flags show in process listings).
    #[arg(long, env = "POSTAL_DASHBOARD_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Enable the action buttons (requeue, discard, release, replay, resolve). Without it the
    /// dashboard is read-only.
    #[arg(long, env = "POSTAL_DASHBOARD_ALLOW_ACTIONS")]
    allow_actions: bool,
    /// At most this many events per action (a filter matching more is refused).
    #[arg(long, env = "POSTAL_DASHBOARD_ACTION_CAP", default_value_t = postal_admin::web::DEFAULT_ACTION_CAP)]
    action_cap: usize,
    /// Kafka bootstrap servers, for consumer lag and dead-letter replay (both off without).
    #[arg(long, env = "KAFKA_BOOTSTRAP_SERVERS")]
    bootstrap_servers: Option<String>,
}

pub async fn run(pool: PgPool, args: DashboardArgs) -> anyhow::Result<()> {
    let stop = postal_shared::stop_signal().context("listening for SIGINT and SIGTERM")?;
    let mut dashboard = postal_admin::web::Dashboard::new(pool)
        .actions(args.allow_actions)
        .action_cap(args.action_cap);
    if let Some(t) = args.token.as_deref().filter(|t| !t.is_empty()) {
        dashboard = dashboard.token(t);
    }
    if let Some(b) = &args.bootstrap_servers {
        dashboard = dashboard.kafka(crate::kafka_client::config(b));
    }
    let (addr, task) = postal_admin::web::serve(args.listen, dashboard).await?;
    say!(
        "postal dashboard on http://{addr}/ ({}{})",
        if args.allow_actions {
            "actions enabled"
        } else {
            "read-only"
        },
        if args.token.is_some() {
            ", token required"
        } else {
            ""
        }
    );
    stop.await;
    task.abort();
    Ok(())
}
