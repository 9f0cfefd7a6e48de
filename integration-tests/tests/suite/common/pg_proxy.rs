//! A PostgreSQL wire-protocol proxy for the reviews of the relay's activity report
//! (`activity_off_publish_path`, `activity_totals`) and the randomized relay tests (`relay_random`):
//! it passes everything through, and on request delays every `BEGIN` (a slow database or
//! link), delays statements at random ([`Ctl::jitter`]: a database in another zone, a
//! pooler's queue, a starved CPU, between a transaction's `BEGIN` and its next statement
//! too), holds the next execution or the next `COMMIT` of the activity upsert (a write in
//! flight; a slow commit whose rows stay locked), or cuts the connection right after the
//! server committed that upsert, before its answer reaches the client (a connection lost at
//! commit).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use postal_integration_tests::TestDb;
use postal_producer::{OutboundEvent, PublishError, Transport};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// Acknowledges every event at once.
pub struct Acking;

impl Transport for Acking {
    type Acks = futures::future::Ready<Vec<Result<(), PublishError>>>;

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        futures::future::ready(vec![Ok(()); batch.len()])
    }
}

/// Random delays of the client's statements: each one (a simple query such as `BEGIN` or
/// `COMMIT`, or an extended-protocol execution, held at its `Bind`) is held, with probability
/// `chance`, for a uniformly drawn 1..=`max_ms` milliseconds before it goes to the server,
/// and now and then ([`Jitter::spikes`]) for longer (a pooler's queue, a stalled client).
/// Drawn from one seeded generator per proxy: the seed fixes the distribution, while which
/// statement gets which delay follows the order in which connections reach the proxy.
pub struct Jitter {
    rng: StdRng,
    chance: f64,
    max_ms: u64,
    spike_chance: f64,
    spike_max_ms: u64,
}

impl Jitter {
    pub fn new(seed: u64, chance: f64, max_ms: u64) -> Jitter {
        Jitter {
            rng: StdRng::seed_from_u64(seed),
            chance,
            max_ms: max_ms.max(1),
            spike_chance: 0.0,
            spike_max_ms: 1,
        }
    }

    /// With probability `chance`, a statement is held for up to `max_ms` instead.
    pub fn spikes(mut self, chance: f64, max_ms: u64) -> Jitter {
        self.spike_chance = chance;
        self.spike_max_ms = max_ms.max(1);
        self
    }

    fn draw(&mut self) -> Option<Duration> {
        let max = if self.rng.random_bool(self.spike_chance) {
            self.spike_max_ms
        } else if self.rng.random_bool(self.chance) {
            self.max_ms
        } else {
            return None;
        };
        Some(Duration::from_millis(self.rng.random_range(1..=max)))
    }
}

/// What the proxy does besides passing bytes on.
pub struct Ctl {
    /// Every `BEGIN` is held this long before it goes to the server (0: not at all).
    pub begin_delay_ms: AtomicU64,
    /// Random delays of every statement (`None`: none), on top of `begin_delay_ms`.
    pub jitter: Mutex<Option<Jitter>>,
    /// Hold the next execution of the activity upsert until `release` is set.
    pub hold_minutes: AtomicBool,
    /// Executions held so far.
    pub held: AtomicU64,
    pub release: tokio::sync::watch::Sender<bool>,
    /// Hold the next commit of the activity upsert (the server has executed it: its rows are
    /// locked) until `release` is set.
    pub hold_commit: AtomicBool,
    /// Cut the connection of the next commit of the activity upsert once the server answered
    /// it (the answer never reaches the client).
    pub cut_minutes_commit: AtomicBool,
    /// Cut the connection of the next commit of a transaction that executed a statement
    /// containing this text, once the server answered it (`None`: none).
    pub cut_commit_of: Mutex<Option<Vec<u8>>>,
    /// Connections cut so far.
    pub cuts: AtomicU64,
    /// Claim statements (`claim::claimed!`: `FOR UPDATE OF o SKIP LOCKED`) executed through
    /// the proxy so far (counted at their `Bind`).
    pub claim_execs: AtomicU64,
    /// Hold the claim statement execution with this index (0-based, `u64::MAX`: none) until
    /// `claim_release` is set: the claim has registered its transaction id and read its
    /// leases, and its claim statement has not reached the server (no snapshot yet).
    pub hold_claim_at: AtomicU64,
    /// Claim statements held so far.
    pub claims_held: AtomicU64,
    pub claim_release: tokio::sync::watch::Sender<bool>,
}

/// A TCP proxy in front of PostgreSQL that reads the client's protocol messages.
pub struct PgProxy {
    pub port: u16,
    pub ctl: Arc<Ctl>,
}

impl PgProxy {
    pub async fn start(upstream: String) -> PgProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let ctl = Arc::new(Ctl {
            begin_delay_ms: AtomicU64::new(0),
            jitter: Mutex::new(None),
            hold_minutes: AtomicBool::new(false),
            held: AtomicU64::new(0),
            release: tokio::sync::watch::channel(false).0,
            hold_commit: AtomicBool::new(false),
            cut_minutes_commit: AtomicBool::new(false),
            cut_commit_of: Mutex::new(None),
            cuts: AtomicU64::new(0),
            claim_execs: AtomicU64::new(0),
            hold_claim_at: AtomicU64::new(u64::MAX),
            claims_held: AtomicU64::new(0),
            claim_release: tokio::sync::watch::channel(false).0,
        });
        let c = ctl.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (ctl, upstream) = (c.clone(), upstream.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let cut = Arc::new(AtomicBool::new(false));
                    // Either side ending ends the connection (both sockets close).
                    tokio::select! {
                        _ = to_server(cr, sw, ctl.clone(), cut.clone()) => {}
                        _ = to_client(sr, cw, ctl, cut) => {}
                    }
                });
            }
        });
        PgProxy { port, ctl }
    }
}

/// `b` up to its first NUL, and what follows that NUL.
fn cstr(b: &[u8]) -> (&[u8], &[u8]) {
    let i = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    (&b[..i], &b[(i + 1).min(b.len())..])
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Client to server, message by message.
async fn to_server(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    ctl: Arc<Ctl>,
    cut: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut started = false;
    // Prepared statements (by name) that are the activity upsert.
    let mut minutes: HashSet<Vec<u8>> = HashSet::new();
    // Prepared statements (by name) that are claim statements.
    let mut claims: HashSet<Vec<u8>> = HashSet::new();
    let mut in_minutes_tx = false;
    // Prepared statements (by name) containing `ctl.cut_commit_of`, and whether the open
    // transaction executed one.
    let mut marked: HashSet<Vec<u8>> = HashSet::new();
    let mut in_marked_tx = false;
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        loop {
            let total = if started {
                if buf.len() < 5 {
                    break;
                }
                1 + u32::from_be_bytes(buf[1..5].try_into().unwrap()) as usize
            } else {
                if buf.len() < 4 {
                    break;
                }
                u32::from_be_bytes(buf[0..4].try_into().unwrap()) as usize
            };
            if buf.len() < total {
                break;
            }
            let msg: Vec<u8> = buf.drain(..total).collect();
            if started && matches!(msg[0], b'Q' | b'B') {
                let delay = ctl.jitter.lock().unwrap().as_mut().and_then(Jitter::draw);
                if let Some(d) = delay {
                    tokio::time::sleep(d).await;
                }
            }
            if !started {
                // The startup message (protocol 3.0); the pool connects without TLS.
                if msg.len() >= 8 && u32::from_be_bytes(msg[4..8].try_into().unwrap()) == 196_608 {
                    started = true;
                }
            } else {
                let body = &msg[5..];
                match msg[0] {
                    b'Q' => {
                        let (sql, _) = cstr(body);
                        let sql = String::from_utf8_lossy(sql);
                        let sql = sql.trim();
                        if sql.eq_ignore_ascii_case("BEGIN") {
                            let d = ctl.begin_delay_ms.load(Ordering::SeqCst);
                            if d > 0 {
                                tokio::time::sleep(Duration::from_millis(d)).await;
                            }
                        } else if sql.eq_ignore_ascii_case("COMMIT") && in_marked_tx {
                            in_marked_tx = false;
                            if ctl.cut_commit_of.lock().unwrap().take().is_some() {
                                cut.store(true, Ordering::SeqCst);
                            }
                        } else if sql.eq_ignore_ascii_case("COMMIT") && in_minutes_tx {
                            in_minutes_tx = false;
                            if ctl.hold_commit.swap(false, Ordering::SeqCst) {
                                ctl.held.fetch_add(1, Ordering::SeqCst);
                                let mut released = ctl.release.subscribe();
                                let _ = released.wait_for(|r| *r).await;
                            }
                            if ctl.cut_minutes_commit.swap(false, Ordering::SeqCst) {
                                cut.store(true, Ordering::SeqCst);
                            }
                        } else if sql.eq_ignore_ascii_case("ROLLBACK") {
                            in_minutes_tx = false;
                            in_marked_tx = false;
                        }
                    }
                    b'P' => {
                        let (name, rest) = cstr(body);
                        let (sql, _) = cstr(rest);
                        if contains(sql, b"INSERT INTO postal.relay_minutes") {
                            minutes.insert(name.to_vec());
                        } else {
                            minutes.remove(name);
                        }
                        let mark = ctl.cut_commit_of.lock().unwrap().clone();
                        if mark.is_some_and(|m| contains(sql, &m)) {
                            marked.insert(name.to_vec());
                        } else {
                            marked.remove(name);
                        }
                        if contains(sql, b"FOR UPDATE OF o SKIP LOCKED") {
                            claims.insert(name.to_vec());
                        } else {
                            claims.remove(name);
                        }
                    }
                    b'B' => {
                        let (_portal, rest) = cstr(body);
                        let (statement, _) = cstr(rest);
                        if claims.contains(statement) {
                            let n = ctl.claim_execs.fetch_add(1, Ordering::SeqCst);
                            if n == ctl.hold_claim_at.load(Ordering::SeqCst) {
                                ctl.claims_held.fetch_add(1, Ordering::SeqCst);
                                let mut released = ctl.claim_release.subscribe();
                                let _ = released.wait_for(|r| *r).await;
                            }
                        }
                        if marked.contains(statement) {
                            in_marked_tx = true;
                        }
                        if minutes.contains(statement) {
                            in_minutes_tx = true;
                            if ctl.hold_minutes.swap(false, Ordering::SeqCst) {
                                ctl.held.fetch_add(1, Ordering::SeqCst);
                                let mut released = ctl.release.subscribe();
                                let _ = released.wait_for(|r| *r).await;
                            }
                        }
                    }
                    _ => {}
                }
            }
            to.write_all(&msg).await?;
        }
    }
}

/// Server to client; once `cut` is set, the server's next answer ends the connection instead.
async fn to_client(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    ctl: Arc<Ctl>,
    cut: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        if cut.load(Ordering::SeqCst) {
            ctl.cuts.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
        to.write_all(&chunk[..n]).await?;
    }
}

/// A pool of at most `size` connections on the test's database, through the proxy.
pub async fn pool_through(db: &TestDb, proxy: &PgProxy, size: u32) -> PgPool {
    let opts: PgConnectOptions = db.url.parse().unwrap();
    let opts = opts
        .host("127.0.0.1")
        .port(proxy.port)
        .ssl_mode(PgSslMode::Disable);
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(20))
        .connect_with(opts)
        .await
        .unwrap()
}

/// The proxy for the test database's server.
pub async fn proxy_for(db: &TestDb) -> PgProxy {
    let opts: PgConnectOptions = db.url.parse().unwrap();
    PgProxy::start(format!("{}:{}", opts.get_host(), opts.get_port())).await
}
