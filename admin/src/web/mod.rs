//! The dashboard: server-rendered pages over the operator actions, as an axum [`Router`] to
//! mount in your own service ([`Dashboard::router`]) or served alone ([`serve`], which is what
//! `postal dashboard` runs). Assets are built in; nothing is fetched from elsewhere.
//!
//! Safe by default: read-only unless [`Dashboard::actions`] enables the buttons; mutating
//! requests are POSTs checked for a same-origin `Origin` and the form's CSRF token; every
//! action is recorded in `postal.operator_audit` and logged; responses carry a strict
//! Content-Security-Policy; nothing secret is rendered (the dashboard never shows a connection
//! string).
//!
//! ```no_run
//! # async fn run(pool: sqlx::PgPool) -> Result<(), postal_admin::Error> {
//! use postal_admin::web::Dashboard;
//!
//! // Mounted under /ops/postal in your own axum app, behind your own login:
//! let dashboard = Dashboard::new(pool)
//!     .base_path("/ops/postal")
//!     .authorize(|parts| {
//!         // Return who is asking (for the audit trail), or None to refuse.
//!         parts.headers.get("x-user").and_then(|v| v.to_str().ok()).map(str::to_owned)
//!     })
//!     .router()?;
//! let app: axum::Router = axum::Router::new().nest("/ops/postal", dashboard);
//! # drop(app); Ok(()) }
//! ```

mod actions;
mod assets;
mod form;
mod guard;
mod held;
mod html;
mod pages;
mod pauses;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::request::Parts;
use axum::routing::{get, post};
use axum::Router;
use sqlx::PgPool;

use crate::Error;

/// The embedding service's authentication: who is asking, or `None` to refuse.
type AuthHook = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// Who may use the dashboard.
#[derive(Clone)]
enum Auth {
    /// Nobody chose: only [`serve`] on a loopback address accepts this (as `Loopback`).
    Unset,
    /// Served on a loopback address without a token: requests must name a loopback host, so
    /// that a web page whose host name an attacker points at 127.0.0.1 (DNS rebinding) cannot
    /// read or act through it.
    Loopback,
    /// Anyone who can reach it (the embedding service authenticates upstream).
    Open,
    /// Requests carrying this token (bearer header, or the cookie the login form sets).
    Token(Arc<str>),
    /// The embedding service's hook: the actor's name, or `None` to refuse.
    Hook(AuthHook),
}

/// Default cap on how many events one action may change.
pub const DEFAULT_ACTION_CAP: usize = 1000;

/// The dashboard's settings (a builder), turned into a [`Router`] by [`Dashboard::router`].
#[derive(Clone)]
pub struct Dashboard {
    pool: PgPool,
    base: String,
    auth: Auth,
    actions: bool,
    cap: usize,
    payload_cap: i32,
    kafka: Option<rdkafka::ClientConfig>,
}

impl Dashboard {
    /// A read-only dashboard over `pool`'s Postal schema.
    pub fn new(pool: PgPool) -> Self {
        Dashboard {
            pool,
            base: String::new(),
            auth: Auth::Unset,
            actions: false,
            cap: DEFAULT_ACTION_CAP,
            payload_cap: 64 * 1024,
            kafka: None,
        }
    }

    /// The path the router is mounted under (default: the root), for the links it renders.
    pub fn base_path(mut self, base: &str) -> Self {
        self.base = base.trim_end_matches('/').to_owned();
        self
    }

    /// Enables the action buttons (requeue, discard, release, replay, resolve). Default off.
    pub fn actions(mut self, enabled: bool) -> Self {
        self.actions = enabled;
        self
    }

    /// At most this many events per action (default [`DEFAULT_ACTION_CAP`]): a filter that
    /// matches more is refused with the count.
    pub fn action_cap(mut self, cap: usize) -> Self {
        self.cap = cap.max(1);
        self
    }

    /// Requires this token: as `Authorization: Bearer <token>`, or entered once in the login
    /// form (kept in an HttpOnly, SameSite=Strict cookie).
    pub fn token(mut self, token: &str) -> Self {
        self.auth = Auth::Token(Arc::from(token));
        self
    }

    /// Asks `hook` about every request: it returns who is asking (recorded with each action),
    /// or `None` to refuse with 401.
    pub fn authorize(
        mut self,
        hook: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.auth = Auth::Hook(Arc::new(hook));
        self
    }

    /// Serves everyone who reaches it: for a router mounted behind authentication the
    /// embedding service already does.
    pub fn without_auth(mut self) -> Self {
        self.auth = Auth::Open;
        self
    }

    /// Kafka client settings (at least `bootstrap.servers`), for consumer lag on the overview
    /// and for replaying dead letters. Without them both are unavailable. Replays go through
    /// a producer made as the relay's ([`postal_shared::kafka_producer::replay_config`]: Java's
    /// partitioner, idempotent, `acks=all`) with these settings but the consumer-only ones; a
    /// setting that would break durability or per-key order makes the dashboard an error.
    pub fn kafka(mut self, config: rdkafka::ClientConfig) -> Self {
        self.kafka = Some(config);
        self
    }

    /// The router. Refused without a choice of authentication ([`Dashboard::token`],
    /// [`Dashboard::authorize`] or [`Dashboard::without_auth`]).
    pub fn router(self) -> Result<Router, Error> {
        if matches!(self.auth, Auth::Unset) {
            return Err(Error::Invalid(
                "an embedded dashboard needs .token(), .authorize() or .without_auth()".into(),
            ));
        }
        self.build()
    }

    fn build(self) -> Result<Router, Error> {
        fn client<T: rdkafka::config::FromClientConfig>(
            config: &rdkafka::ClientConfig,
        ) -> Result<Arc<T>, Error> {
            config.create().map(Arc::new).map_err(|e| {
                let e = postal_shared::secret::kafka_error_without_value(e);
                Error::Kafka(format!("Kafka settings: {e}"))
            })
        }
        // The replay producer is the relay's (Java's partitioner, idempotent, acks=all), with
        // the given settings.
        let producer = match &self.kafka {
            Some(c) => {
                let bootstrap = c.get("bootstrap.servers").unwrap_or_default();
                let config =
                    postal_shared::kafka_producer::replay_config(bootstrap, c.config_map())
                        .map_err(|e| Error::Kafka(format!("Kafka settings: {e}")))?;
                Some(client(&config)?)
            }
            None => None,
        };
        let watermarks = self.kafka.as_ref().map(client).transpose()?;
        let csrf: String = {
            use rand::Rng as _;
            let mut rng = rand::rng();
            (0..32)
                .map(|_| format!("{:02x}", rng.random::<u8>()))
                .collect()
        };
        let state = State(Arc::new(Inner {
            pool: self.pool,
            base: self.base,
            auth: self.auth,
            actions: self.actions,
            cap: self.cap,
            payload_cap: self.payload_cap,
            csrf,
            producer,
            watermarks,
        }));
        Ok(Router::new()
            .route("/", get(pages::overview))
            .route("/parked", get(pages::parked))
            .route("/parked/{id}", get(pages::parked_one))
            .route("/blocked", get(pages::blocked))
            .route("/held", get(held::list))
            .route("/dead-letters", get(pages::dead_letters))
            .route("/dead-letters/{id}", get(pages::dead_letter))
            .route("/lookup", get(pages::lookup))
            .route("/audit", get(pages::audit))
            .route("/pauses", get(pauses::list))
            .route("/login", get(guard::login_form).post(guard::login))
            .route("/assets/style.css", get(assets::style))
            .route("/assets/app.js", get(assets::script))
            .route("/assets/icon.svg", get(assets::icon))
            .route("/parked/requeue", post(actions::requeue))
            .route("/parked/discard", post(actions::discard))
            .route("/blocked/release", post(actions::release))
            .route("/held/release", post(held::release))
            .route("/dead-letters/replay", post(actions::replay))
            .route("/dead-letters/resolve", post(actions::resolve))
            .route("/pauses/pause", post(pauses::pause))
            .route("/pauses/resume", post(pauses::resume))
            .layer(axum::middleware::from_fn_with_state(
                state.clone(),
                guard::guard,
            ))
            .with_state(state))
    }
}

/// The handlers' shared state.
#[derive(Clone)]
pub(crate) struct State(Arc<Inner>);

pub(crate) struct Inner {
    pool: PgPool,
    base: String,
    auth: Auth,
    actions: bool,
    cap: usize,
    payload_cap: i32,
    csrf: String,
    producer: Option<Arc<rdkafka::producer::FutureProducer>>,
    watermarks: Option<Arc<rdkafka::consumer::BaseConsumer>>,
}

impl std::ops::Deref for State {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

/// Serves `dashboard` on `addr` until the task is aborted (what `postal dashboard` runs).
/// Without a token or hook it serves only on a loopback address: any other address is refused
/// with [`Error::Unprotected`], before binding.
pub async fn serve(
    addr: SocketAddr,
    dashboard: Dashboard,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), Error> {
    let mut dashboard = dashboard;
    if matches!(dashboard.auth, Auth::Unset | Auth::Open) {
        if !addr.ip().is_loopback() {
            return Err(Error::Unprotected(addr));
        }
        dashboard.auth = Auth::Loopback;
    }
    let router = dashboard.build()?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| Error::Bind { addr, source })?;
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "dashboard server stopped");
        }
    });
    Ok((local, task))
}

/// How long the overview waits for the broker's watermarks before showing lag as unknown.
pub(crate) const LAG_BUDGET: Duration = Duration::from_secs(2);
