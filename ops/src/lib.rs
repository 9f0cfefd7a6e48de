//! Operations endpoints for Postal processes: `GET /metrics` (Prometheus text format, every
//! metric recorded through the `metrics` facade — `postal_relay_*`, `postal_consumer_*`),
//! `GET /healthz` (liveness: the process serves requests) and `GET /readyz` (readiness: your
//! check, e.g. the database answers).
//!
//! ```no_run
//! # async fn run(pool: sqlx::PgPool) -> Result<(), postal_ops::Error> {
//! let ready = move || {
//!     let pool = pool.clone();
//!     async move { sqlx::query("SELECT 1").execute(&pool).await.is_ok() }
//! };
//! let server = postal_ops::serve("0.0.0.0:9464".parse().unwrap(), ready).await?;
//! // ... run the relay or consumer; `server` keeps serving until aborted.
//! # drop(server); Ok(()) }
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use futures::future::BoxFuture;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Errors starting the endpoints.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Another metrics recorder (not this crate's) is installed in this process.
    #[error("cannot install the Prometheus recorder: {0}")]
    Recorder(String),
}

type Ready = Arc<dyn Fn() -> BoxFuture<'static, bool> + Send + Sync>;

/// How long a readiness answer is reused: however many clients ask, the check (a query on the
/// service's own pool) runs at most about once per this interval.
pub const READY_CACHE: Duration = Duration::from_secs(1);

/// How long one readiness check may take before it counts as not ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone)]
struct AppState {
    metrics: PrometheusHandle,
    ready: Arc<Readiness>,
}

/// The readiness check behind `/readyz`, run by one request at a time and its answer reused
/// for [`READY_CACHE`]: concurrent requests wait for the running check and share its answer,
/// so a flood of requests cannot take the pool's connections.
struct Readiness {
    check: Ready,
    cache: Duration,
    last: tokio::sync::Mutex<Option<(Instant, bool)>>,
}

impl Readiness {
    fn new(check: Ready, cache: Duration) -> Self {
        Readiness {
            check,
            cache,
            last: tokio::sync::Mutex::new(None),
        }
    }

    async fn ready(&self) -> bool {
        let mut last = self.last.lock().await;
        if let Some((at, answer)) = *last {
            if at.elapsed() < self.cache {
                return answer;
            }
        }
        let answer = tokio::time::timeout(READY_TIMEOUT, (self.check)())
            .await
            .unwrap_or(false);
        *last = Some((Instant::now(), answer));
        answer
    }
}

/// The process's Prometheus recorder: installed by the first call, shared by the later ones (a
/// relay and a consumer in one process, each serving its own address: each endpoint renders
/// the process's metrics, told apart by their labels). Fails if another recorder was installed.
fn recorder() -> Result<PrometheusHandle, Error> {
    static HANDLE: std::sync::Mutex<Option<PrometheusHandle>> = std::sync::Mutex::new(None);
    let mut handle = HANDLE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = &*handle {
        return Ok(h.clone());
    }
    let installed = PrometheusBuilder::new()
        .set_buckets(&[
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ])
        .map_err(|e| Error::Recorder(e.to_string()))?
        .install_recorder()
        .map_err(|e| Error::Recorder(e.to_string()))?;
    *handle = Some(installed.clone());
    Ok(installed)
}

/// Installs the Prometheus recorder for this process (once: a later call in the same process
/// shares it, and each endpoint renders the process's metrics; an error if a recorder other
/// than this crate's was installed) and serves the endpoints on `addr` in a background task
/// (returned; abort it to stop). `ready` answers `/readyz`: one check at a
/// time, its answer reused for [`READY_CACHE`], a check over [`READY_TIMEOUT`] not ready.
pub async fn serve<F, Fut>(addr: SocketAddr, ready: F) -> Result<tokio::task::JoinHandle<()>, Error>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send + 'static,
{
    let metrics = recorder()?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let state = AppState {
        metrics: metrics.clone(),
        ready: Arc::new(Readiness::new(
            Arc::new(move || Box::pin(ready())),
            READY_CACHE,
        )),
    };
    let app = Router::new()
        .route("/metrics", get(render))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state);
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    // Keeps histograms and idle gauges in shape between scrapes.
    let upkeep = metrics.clone();
    Ok(tokio::spawn(async move {
        let upkeep = async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                upkeep.run_upkeep();
            }
        };
        tokio::select! {
            r = axum::serve(listener, app) => {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "ops endpoint stopped");
                }
            }
            _ = upkeep => {}
        }
    }))
}

async fn render(State(s): State<AppState>) -> String {
    s.metrics.render()
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.ready.ready().await {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A loopback address with a port free a moment ago.
    fn free_addr() -> SocketAddr {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    }

    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        let status = out[9..12].parse().unwrap();
        (status, out)
    }

    /// `/metrics` exposes what the process recorded, `/healthz` answers, and `/readyz`
    /// follows the readiness check.
    #[tokio::test]
    async fn endpoints_serve_metrics_liveness_and_readiness() {
        let addr = free_addr();
        let ready = Arc::new(AtomicBool::new(false));
        let r = ready.clone();
        let server = serve(addr, move || {
            let r = r.clone();
            async move { r.load(Ordering::SeqCst) }
        })
        .await
        .unwrap();
        metrics::counter!("postal_relay_published_total").increment(3);
        let (status, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(body.contains("postal_relay_published_total 3"), "{body}");
        assert_eq!(get(addr, "/healthz").await.0, 200);
        assert_eq!(get(addr, "/readyz").await.0, 503);
        ready.store(true, Ordering::SeqCst);
        // The answer is reused for READY_CACHE: the change shows once it has passed.
        let changed = Instant::now();
        while get(addr, "/readyz").await.0 != 200 {
            assert!(
                changed.elapsed() < READY_CACHE * 3,
                "readiness never changed"
            );
            tokio::task::yield_now().await;
        }
        assert!(changed.elapsed() >= READY_CACHE / 2);
        server.abort();
    }

    /// Guarantee: a second service in the same process (a relay and a consumer, each with its
    /// own address) serves too: both render the process's metrics, each `/readyz` its own
    /// check (before, the second failed: "attempted to set a recorder after the metrics
    /// system was already initialized").
    #[tokio::test]
    async fn two_services_in_one_process_both_serve() {
        let (a, b) = (free_addr(), free_addr());
        let first = serve(a, || async { true }).await.unwrap();
        let second = serve(b, || async { false }).await.unwrap();
        metrics::counter!("postal_ops_two_services_total").increment(2);
        for at in [a, b] {
            let (status, body) = get(at, "/metrics").await;
            assert_eq!(status, 200);
            assert!(body.contains("postal_ops_two_services_total 2"), "{body}");
        }
        assert_eq!(get(a, "/readyz").await.0, 200);
        assert_eq!(get(b, "/readyz").await.0, 503);
        first.abort();
        second.abort();
    }

    /// Guarantee: a flood of readiness requests runs the check once per cache interval, one
    /// at a time, however many clients ask at once (before, 300 concurrent clients ran 300
    /// queries at once and held every connection of the service's pool).
    #[tokio::test]
    async fn concurrent_readiness_requests_share_one_check() {
        use std::sync::atomic::AtomicUsize;
        let runs = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (r, g, m) = (runs.clone(), running.clone(), most.clone());
        let readiness = Arc::new(Readiness::new(
            Arc::new(move || {
                let (r, g, m) = (r.clone(), g.clone(), m.clone());
                Box::pin(async move {
                    r.fetch_add(1, Ordering::SeqCst);
                    let now = g.fetch_add(1, Ordering::SeqCst) + 1;
                    m.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    g.fetch_sub(1, Ordering::SeqCst);
                    true
                })
            }),
            Duration::from_secs(60),
        ));
        let asks = (0..300).map(|_| {
            let readiness = readiness.clone();
            tokio::spawn(async move { readiness.ready().await })
        });
        for answer in futures::future::join_all(asks).await {
            assert!(answer.unwrap());
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(most.load(Ordering::SeqCst), 1);
    }

    /// Guarantee: a check that hangs answers "not ready" after READY_TIMEOUT instead of
    /// holding the request (and the next ones) for good.
    #[tokio::test(start_paused = true)]
    async fn a_hanging_check_is_not_ready_after_the_timeout() {
        let readiness = Readiness::new(
            Arc::new(|| Box::pin(futures::future::pending::<bool>())),
            READY_CACHE,
        );
        assert!(!readiness.ready().await);
    }
}
