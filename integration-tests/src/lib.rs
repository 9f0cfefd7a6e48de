//! Test harness for Postal's integration suite.
//!
//! [`services`] returns the shared PostgreSQL server and Kafka-protocol broker of this test
//! process: the already-running ones named by `DATABASE_URL` and `KAFKA_BOOTSTRAP_SERVERS`, or
//! else a PostgreSQL and a broker container started once through testcontainers (images from
//! `POSTAL_TEST_PG_IMAGE` / `POSTAL_TEST_KAFKA_IMAGE`). Each test then takes its own fresh
//! database ([`Services::fresh_db`]) and unique topic and group names ([`unique`]). Tests that
//! kill or restart a server start a private one ([`private`]) in every mode.
//!
//! The process-level suites run the demo's services (`order_service`, `billing_service`,
//! `invoice_recorder`: package `postal-demo`, `demo/src/bin/`) and this package's own
//! binaries (`src/bin/`: `report_worker`, the task worker, and `roundtrip`, a smoke check of
//! the stack); [`service`] (re-exported from `postal-demo`) holds their start-up helpers.

pub mod delay;
pub mod hosts;
pub mod http;
pub mod kafka;
pub mod pgbouncer;
pub mod private;
pub mod rabbit;
pub mod raw_produce;
pub use postal_demo::service;
pub mod wait;

use std::sync::OnceLock;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Executor, PgPool};

/// How this process got its services.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `DATABASE_URL` and `KAFKA_BOOTSTRAP_SERVERS` named running services.
    External,
    /// testcontainers started a PostgreSQL and a broker container for this process.
    Testcontainers,
}

/// The shared servers of this test process.
#[derive(Clone, Debug)]
pub struct Services {
    /// URL of the server's maintenance database (used to create per-test databases).
    pub database_url: String,
    /// Kafka bootstrap servers.
    pub bootstrap: String,
    /// Where they came from.
    pub mode: Mode,
}

static SERVICES: OnceLock<Result<Services, String>> = OnceLock::new();

/// The shared services, started on first use. Panics with a one-line reason if they cannot be
/// reached or started within a bounded time.
pub async fn services() -> &'static Services {
    let r = tokio::task::spawn_blocking(|| SERVICES.get_or_init(init_services))
        .await
        .expect("service start-up thread");
    match r {
        Ok(s) => s,
        Err(e) => panic!("test services unavailable: {e}"),
    }
}

/// A fresh, migrated database for a test that needs PostgreSQL only: on the server named by
/// `DATABASE_URL` when set (no broker needed), else on the shared services.
pub async fn fresh_postgres_db() -> TestDb {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => {
            init_tracing();
            if let Err(e) = wait::ready_postgres(&url, Duration::from_secs(60)).await {
                panic!("PostgreSQL unavailable: {e}");
            }
            let db = create_db(&url).await;
            postal_shared::migrate(&db.pool)
                .await
                .expect("migrate test database");
            db
        }
        _ => services().await.fresh_db().await,
    }
}

fn init_services() -> Result<Services, String> {
    init_tracing();
    let db = std::env::var("DATABASE_URL").ok().filter(|s| !s.is_empty());
    let kafka = std::env::var("KAFKA_BOOTSTRAP_SERVERS")
        .ok()
        .filter(|s| !s.is_empty());
    let services =
        match (db, kafka) {
            (Some(database_url), Some(bootstrap)) => Services {
                database_url,
                bootstrap,
                mode: Mode::External,
            },
            (None, None) => containers::start()?,
            _ => return Err(
                "set both DATABASE_URL and KAFKA_BOOTSTRAP_SERVERS, or neither (testcontainers)"
                    .into(),
            ),
        };
    // Both must answer within a bounded time.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        wait::ready_postgres(&services.database_url, Duration::from_secs(60)).await?;
        kafka::wait_ready(&services.bootstrap, Duration::from_secs(60)).await?;
        if services.mode == Mode::Testcontainers {
            // A broker container just started: wait until it takes writes, not only answers.
            kafka::wait_writable(&services.bootstrap, Duration::from_secs(120)).await?;
        }
        Ok::<(), String>(())
    })?;
    tracing::info!(mode = ?services.mode, bootstrap = %services.bootstrap, "test services ready");
    Ok(services)
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("POSTAL_TEST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,lapin=error")),
        )
        .with_test_writer()
        .try_init();
}

/// A fresh, migrated database for one test.
pub struct TestDb {
    /// Pool on the test's database.
    pub pool: PgPool,
    /// URL of the test's database.
    pub url: String,
    /// Database name.
    pub name: String,
    admin_url: String,
}

impl TestDb {
    /// A pool of its own on the test's database, as a separate process would have. Code run
    /// on it and then killed in-process takes only its own connections down with it (close the
    /// pool after the kill), never the test's.
    pub async fn process_pool(&self) -> PgPool {
        self.pool_of(8).await
    }

    /// A new pool of at most `size` connections on the test's database.
    pub async fn pool_of(&self, size: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(20))
            .connect(&self.url)
            .await
            .expect("connect to test database")
    }
}

impl Drop for TestDb {
    /// Drops the test's database when the test passed (tests create one each, and a dev
    /// server would otherwise fill its disk); keeps it, and says so, when the test failed or
    /// `POSTAL_TEST_KEEP` is set.
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("POSTAL_TEST_KEEP").is_some() {
            eprintln!("keeping test database {}", self.name);
            return;
        }
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        // Drop runs inside the test's runtime: do the async work on a thread of its own.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let opts: PgConnectOptions = admin_url.parse()?;
                let mut admin = opts.connect().await?;
                admin
                    .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                    .await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            })
            .map_err(|e| e.to_string())
        })
        .join();
        if let Ok(Err(e)) = dropped {
            eprintln!("could not drop test database {}: {e}", self.name);
        }
    }
}

impl Services {
    /// Creates a new database with a unique name, applies Postal's migrations and returns it.
    pub async fn fresh_db(&self) -> TestDb {
        let db = self.empty_db().await;
        postal_shared::migrate(&db.pool)
            .await
            .expect("migrate test database");
        db
    }

    /// Creates a new database with a unique name, without Postal's schema.
    pub async fn empty_db(&self) -> TestDb {
        create_db(&self.database_url).await
    }
}

/// Creates a uniquely named database on the server of `admin_url` and returns a pool on it.
pub async fn create_db(admin_url: &str) -> TestDb {
    let name = format!("postal_t_{}", uuid::Uuid::now_v7().simple());
    let admin_opts: PgConnectOptions = admin_url.parse().expect("valid DATABASE_URL");
    let mut admin = admin_opts.connect().await.expect("connect to test server");
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .expect("create test database");
    let opts = admin_opts.database(&name);
    let url = opts.to_url_lossy().to_string();
    let pool = PgPoolOptions::new()
        .max_connections(20)
        .acquire_timeout(Duration::from_secs(20))
        .connect_with(opts)
        .await
        .expect("connect to test database");
    TestDb {
        pool,
        url,
        name,
        admin_url: admin_url.to_owned(),
    }
}

/// A unique name with a readable prefix, for topics, groups and consumer names.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::now_v7().simple())
}

/// A free TCP port on loopback for a server the tests start (bound and released), outside the
/// kernel's ephemeral range: a broker or database restarted on its port must find it free, and
/// a port from that range could meanwhile have become the local end of some client connection
/// (their reconnects after a restart pick from it). Ports are not handed out twice by one process.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    let (low, high) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| {
            let mut it = r.split_whitespace().map(|p| p.parse::<u32>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32_768, 60_999));
    // Below the range if there is room there, else above it (else anywhere, as before).
    let (from, to) = if low >= 21_000 {
        (20_000, low)
    } else if high <= 64_535 {
        (high + 1, 65_536)
    } else {
        (1_024, 65_536)
    };
    let span = to - from;
    // Where this process starts in the range: scattered (process ids run in sequence), so
    // that test processes running side by side rarely meet.
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(0x9E37_79B1) ^ nanos) % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let port = (from + NEXT.fetch_add(1, Ordering::Relaxed) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {from}..{to}")
}

mod containers {
    use std::sync::mpsc;

    use testcontainers::core::{ContainerPort, WaitFor};
    use testcontainers::runners::AsyncRunner;
    use testcontainers::{GenericImage, ImageExt};

    use super::{free_port, Mode, Services};

    fn split_image(spec: &str) -> (String, String) {
        match spec.rsplit_once(':') {
            Some((name, tag)) if !tag.contains('/') => (name.to_owned(), tag.to_owned()),
            _ => (spec.to_owned(), "latest".to_owned()),
        }
    }

    /// Starts one PostgreSQL and one broker container on a dedicated thread that keeps its
    /// runtime (and so the containers) alive for the life of the test process.
    pub(super) fn start() -> Result<Services, String> {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("testcontainers".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                };
                rt.block_on(async move {
                    match start_containers().await {
                        Ok((services, keep)) => {
                            let _ = tx.send(Ok(services));
                            // Keep the containers (and this runtime) for the process lifetime.
                            let _keep = keep;
                            std::future::pending::<()>().await;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                });
            })
            .map_err(|e| e.to_string())?;
        rx.recv_timeout(std::time::Duration::from_secs(180))
            .map_err(|_| "testcontainers did not start the services within 180s".to_owned())?
    }

    type Keep = (
        testcontainers::ContainerAsync<GenericImage>,
        testcontainers::ContainerAsync<GenericImage>,
    );

    async fn start_containers() -> Result<(Services, Keep), String> {
        let pg_spec =
            std::env::var("POSTAL_TEST_PG_IMAGE").unwrap_or_else(|_| "postgres:16".into());
        let kafka_spec = std::env::var("POSTAL_TEST_KAFKA_IMAGE")
            .unwrap_or_else(|_| "apache/kafka:4.4.0".into());

        let (name, tag) = split_image(&pg_spec);
        let pg = GenericImage::new(name, tag)
            .with_exposed_port(ContainerPort::Tcp(5432))
            .with_wait_for(WaitFor::message_on_stderr(
                "database system is ready to accept connections",
            ))
            .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
            .with_label("postal-test", "1")
            .start()
            .await
            .map_err(|e| format!("starting PostgreSQL container {pg_spec}: {e}"))?;
        let pg_port = pg
            .get_host_port_ipv4(5432)
            .await
            .map_err(|e| format!("PostgreSQL container port: {e}"))?;

        // The broker advertises 127.0.0.1:<port>, so the container port is mapped 1:1.
        let port = free_port();
        let (name, tag) = split_image(&kafka_spec);
        let image = GenericImage::new(name.clone(), tag)
            .with_exposed_port(ContainerPort::Tcp(port))
            .with_wait_for(WaitFor::Nothing);
        let request = if name.starts_with("postal-local/kafka") {
            // Built by scripts/testcontainers-images.sh from the local stack's jars.
            image
                .with_env_var("KAFKA_PORT", port.to_string())
                .with_mapped_port(port, ContainerPort::Tcp(port))
        } else {
            // apache/kafka in KRaft mode.
            image
                .with_env_var("KAFKA_NODE_ID", "1")
                .with_env_var("KAFKA_PROCESS_ROLES", "broker,controller")
                .with_env_var(
                    "KAFKA_LISTENERS",
                    format!("PLAINTEXT://:{port},CONTROLLER://:9093"),
                )
                .with_env_var(
                    "KAFKA_ADVERTISED_LISTENERS",
                    format!("PLAINTEXT://127.0.0.1:{port}"),
                )
                .with_env_var("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
                .with_env_var(
                    "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP",
                    "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                )
                .with_env_var("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9093")
                .with_env_var("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "1")
                .with_env_var("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
                .with_env_var("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
                .with_env_var(
                    "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR",
                    "1",
                )
                .with_env_var("KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR", "1")
                .with_env_var("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
                .with_env_var("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
                .with_mapped_port(port, ContainerPort::Tcp(port))
        };
        let broker = request
            .with_label("postal-test", "1")
            .start()
            .await
            .map_err(|e| format!("starting broker container {kafka_spec}: {e}"))?;

        let services = Services {
            database_url: format!("postgres://postgres@127.0.0.1:{pg_port}/postgres"),
            bootstrap: format!("127.0.0.1:{port}"),
            mode: Mode::Testcontainers,
        };
        Ok((services, (pg, broker)))
    }
}

/// A child process killed (and reaped) when dropped: a test that fails while its child runs
/// does not leave it behind.
pub struct KillOnDrop(pub std::process::Child);

impl KillOnDrop {
    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
