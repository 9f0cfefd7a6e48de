//! RabbitMQ for the suite: a private node per test (started from Debian's `rabbitmq-server`,
//! so it can be stopped and restarted), or the running broker named by `AMQP_URL`, and helpers
//! to read what arrived.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};

/// A free TCP port on loopback below Linux's ephemeral range (32768+): a node that takes
/// seconds to bind its port must not find it held by a client socket meanwhile (including a
/// readiness probe that connected to itself).
fn free_low_port() -> u16 {
    let start = (uuid::Uuid::now_v7().as_u128() % 10_000) as u16;
    (0..10_000u16)
        .map(|i| 20_000 + (start + i) % 10_000)
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free port between 20000 and 29999")
}

/// The `rabbitmq-server` start script (`POSTAL_RABBITMQ_BIN` overrides it).
pub fn rabbitmq_bin() -> PathBuf {
    std::env::var("POSTAL_RABBITMQ_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("/usr/lib/rabbitmq/bin/rabbitmq-server"))
}

/// A RabbitMQ node owned by one test, with its data in a fresh temporary directory (kept
/// across restarts, so durable exchanges, queues and persistent messages survive them).
pub struct PrivateRabbit {
    dir: PathBuf,
    name: String,
    port: u16,
    dist_port: u16,
    child: Option<Child>,
}

impl PrivateRabbit {
    /// Starts a node on a free port and waits until it accepts AMQP connections.
    pub async fn start() -> PrivateRabbit {
        let id = uuid::Uuid::now_v7().simple().to_string();
        let dir = std::env::temp_dir().join(format!("postal-rabbit-{id}"));
        std::fs::create_dir_all(&dir).expect("rabbit dir");
        std::fs::write(dir.join("enabled_plugins"), "[].\n").expect("plugins file");
        std::fs::write(dir.join("rabbitmq.conf"), "loopback_users = none\n").expect("conf");
        let mut r = PrivateRabbit {
            name: format!("postal-{}@localhost", &id[id.len() - 12..]),
            dir,
            port: free_low_port(),
            dist_port: free_low_port(),
            child: None,
        };
        r.restart().await;
        r
    }

    /// AMQP URI of this node.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// (Re)starts the node on the same port and data directory and waits until it answers.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "rabbitmq already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("rabbitmq.log"))
            .expect("log file");
        let d = |p: &str| self.dir.join(p);
        let child = Command::new(rabbitmq_bin())
            .env("HOME", &self.dir)
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d("mnesia"))
            .env("RABBITMQ_LOG_BASE", d("log"))
            .env("RABBITMQ_CONFIG_FILE", d("rabbitmq"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", d("pid"))
            .env("RABBITMQ_LOGS", "-")
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn rabbitmq-server (install it: apt-get install rabbitmq-server)");
        self.child = Some(child);
        wait_ready(&self.url(), Duration::from_secs(90))
            .await
            .expect("private rabbitmq ready");
    }

    /// Stops the node with SIGTERM (RabbitMQ shuts down cleanly) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    let _ = std::fs::remove_file(self.dir.join("pid"));
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            self.child = Some(child);
            self.kill();
        }
    }

    /// Kills the node with SIGKILL (the Erlang VM, through its pid file, and the start
    /// script) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
                let _ = Command::new("kill").arg("-KILL").arg(pid.trim()).status();
            }
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_file(self.dir.join("pid"));
        }
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        self.kill();
        if std::env::var_os("POSTAL_TEST_KEEP").is_some() {
            eprintln!("keeping rabbitmq directory {}", self.dir.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Either the broker named by `AMQP_URL`, or a private node for this test.
pub enum Rabbit {
    /// An already-running broker.
    External(String),
    /// A node this test started.
    Private(PrivateRabbit),
}

impl Rabbit {
    /// `AMQP_URL` when set, else a private node.
    pub async fn get() -> Rabbit {
        match std::env::var("AMQP_URL").ok().filter(|s| !s.is_empty()) {
            Some(url) => {
                wait_ready(&url, Duration::from_secs(30))
                    .await
                    .expect("AMQP_URL answers");
                Rabbit::External(url)
            }
            None => Rabbit::Private(PrivateRabbit::start().await),
        }
    }

    /// Its AMQP URI.
    pub fn url(&self) -> String {
        match self {
            Rabbit::External(u) => u.clone(),
            Rabbit::Private(p) => p.url(),
        }
    }
}

/// Waits until `url` accepts an AMQP connection.
pub async fn wait_ready(url: &str, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        match Connection::connect(url, ConnectionProperties::default()).await {
            Ok(c) => {
                let _ = c.close(200, "ready".into()).await;
                return Ok(());
            }
            Err(e) if Instant::now() > deadline => {
                return Err(format!("rabbitmq at {url} not ready: {e}"))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Declares the durable topic `exchange` (as the relay does) and a durable queue bound to it
/// with `binding`; returns the queue name.
pub async fn bind_queue(url: &str, exchange: &str, binding: &str) -> String {
    bind_queue_with(url, exchange, binding, FieldTable::default()).await
}

/// [`bind_queue`] with queue arguments (`x-max-length`, `x-overflow`, …).
pub async fn bind_queue_with(
    url: &str,
    exchange: &str,
    binding: &str,
    arguments: FieldTable,
) -> String {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare exchange");
    let queue = format!("{exchange}.q");
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        arguments,
    )
    .await
    .expect("declare queue");
    ch.queue_bind(
        queue.as_str().into(),
        exchange.into(),
        binding.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind queue");
    let _ = conn.close(200, "bound".into()).await;
    queue
}

/// One message read back.
#[derive(Clone, Debug)]
pub struct Message {
    /// AMQP `message-id`.
    pub message_id: Option<String>,
    /// AMQP `type`.
    pub kind: Option<String>,
    /// AMQP `content-type`.
    pub content_type: Option<String>,
    /// AMQP `delivery-mode` (2 = persistent).
    pub delivery_mode: Option<u8>,
    /// Routing key it was published with.
    pub routing_key: String,
    /// String-valued headers.
    pub headers: BTreeMap<String, String>,
    /// Body.
    pub body: Vec<u8>,
}

impl Message {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// Consumes `queue` until at least `min` messages arrived and none came for a moment, or
/// `timeout`; acknowledges what it read.
pub async fn read_all(url: &str, queue: &str, min: usize, timeout: Duration) -> Vec<Message> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "postal-test-reader".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    loop {
        let quiet = if out.len() >= min {
            Duration::from_millis(500)
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        let next = match tokio::time::timeout(quiet, consumer.next()).await {
            Ok(Some(Ok(d))) => d,
            _ => break,
        };
        let p = &next.properties;
        let mut headers = BTreeMap::new();
        if let Some(t) = p.headers() {
            for (k, v) in t.inner() {
                if let AMQPValue::LongString(s) = v {
                    headers.insert(
                        k.as_str().to_owned(),
                        String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    );
                }
            }
        }
        out.push(Message {
            message_id: p.message_id().as_ref().map(|s| s.as_str().to_owned()),
            kind: p.kind().as_ref().map(|s| s.as_str().to_owned()),
            content_type: p.content_type().as_ref().map(|s| s.as_str().to_owned()),
            delivery_mode: *p.delivery_mode(),
            routing_key: next.routing_key.as_str().to_owned(),
            headers,
            body: next.data.clone(),
        });
        next.ack(BasicAckOptions::default()).await.expect("ack");
        if Instant::now() > deadline {
            break;
        }
    }
    let _ = conn.close(200, "read".into()).await;
    out
}

impl PrivateRabbit {
    /// Runs `rabbitmqctl` against this node (its own cookie and name); returns its standard
    /// output, or panics with its standard error.
    pub fn ctl(&self, args: &[&str]) -> String {
        let cookie = std::fs::read_to_string(self.dir.join(".erlang.cookie")).expect("cookie");
        let ctl = rabbitmq_bin().with_file_name("rabbitmqctl");
        let out = Command::new(ctl)
            .env("HOME", &self.dir)
            .arg("--erlang-cookie")
            .arg(cookie.trim())
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .output()
            .expect("run rabbitmqctl");
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// How many client connections the node holds open.
    pub fn connection_count(&self) -> usize {
        self.ctl(&["list_connections", "--silent", "pid"])
            .lines()
            .filter(|l| !l.trim().is_empty())
            .count()
    }
}

/// Converts a delivery into a [`Message`].
fn message_of(d: &lapin::message::Delivery) -> Message {
    let p = &d.properties;
    let mut headers = BTreeMap::new();
    if let Some(t) = p.headers() {
        for (k, v) in t.inner() {
            if let AMQPValue::LongString(s) = v {
                headers.insert(
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(s.as_bytes()).into_owned(),
                );
            }
        }
    }
    Message {
        message_id: p.message_id().as_ref().map(|s| s.as_str().to_owned()),
        kind: p.kind().as_ref().map(|s| s.as_str().to_owned()),
        content_type: p.content_type().as_ref().map(|s| s.as_str().to_owned()),
        delivery_mode: *p.delivery_mode(),
        routing_key: d.routing_key.as_str().to_owned(),
        headers,
        body: d.data.clone(),
    }
}

/// A consumer reading a queue in the background, in delivery order, acknowledging each
/// message after `delay` (a slow consumer), one unacknowledged message at a time.
pub struct Reader {
    seen: std::sync::Arc<std::sync::Mutex<Vec<Message>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Reader {
    /// Starts consuming `queue`.
    pub async fn start(url: &str, queue: &str, delay: Duration) -> Reader {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("connect");
        let ch = conn.create_channel().await.expect("channel");
        ch.basic_qos(1, Default::default()).await.expect("qos");
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                "postal-test-reader".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn({
            let seen = seen.clone();
            async move {
                loop {
                    let next = tokio::select! {
                        _ = &mut stopped => break,
                        n = consumer.next() => n,
                    };
                    let Some(Ok(d)) = next else { break };
                    seen.lock().unwrap().push(message_of(&d));
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    let _ = d.ack(BasicAckOptions::default()).await;
                }
                let _ = conn.close(200, "read".into()).await;
            }
        });
        Reader {
            seen,
            stop: Some(stop),
            task,
        }
    }

    /// The distinct message ids read so far.
    pub fn distinct(&self) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter_map(|m| m.message_id.as_deref())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    }

    /// Stops and returns everything read, in delivery order.
    pub async fn stop(mut self) -> Vec<Message> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.task.await;
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

/// Per key (`ce_subject`), the first deliveries out of outbox order (`ce_postalseq`): how many
/// events were first delivered after a later event of their key.
pub fn first_delivery_inversions(messages: &[Message]) -> usize {
    let mut first: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    let mut inversions = 0;
    for m in messages {
        let id = m.message_id.clone().unwrap_or_default();
        if !first.insert(id) {
            continue;
        }
        let key = m.header("ce_subject").unwrap_or_default().to_owned();
        let seq: i64 = m.header("ce_postalseq").unwrap_or("0").parse().unwrap();
        match last.get(&key) {
            Some(&p) if p > seq => inversions += 1,
            _ => {
                last.insert(key, seq);
            }
        }
    }
    inversions
}

/// A TCP proxy in front of a broker that cuts every connection through it every `period`
/// (a flaky network, a broker that drops clients); connections are accepted again at once.
pub struct DroppingProxy {
    /// AMQP URI through the proxy.
    pub url: String,
    /// Connections cut so far.
    pub cuts: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl DroppingProxy {
    /// Starts a proxy to the broker of `url` (an `amqp://…@host:port/vhost` URI).
    pub async fn start(url: &str, period: Duration) -> DroppingProxy {
        let at = url.rfind('@').expect("user@host in url");
        let rest = &url[at + 1..];
        let slash = rest.find('/').unwrap_or(rest.len());
        let upstream = rest[..slash].to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let proxied = format!("{}127.0.0.1:{port}{}", &url[..at + 1], &rest[slash..]);
        let cuts = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let task = tokio::spawn({
            let cuts = cuts.clone();
            async move {
                let mut open: Vec<tokio::task::JoinHandle<()>> = Vec::new();
                let mut tick = tokio::time::interval(period);
                tick.tick().await;
                loop {
                    tokio::select! {
                        accepted = listener.accept() => {
                            let Ok((mut client, _)) = accepted else { break };
                            let upstream = upstream.clone();
                            open.push(tokio::spawn(async move {
                                if let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await {
                                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                                }
                            }));
                        }
                        _ = tick.tick() => {
                            for t in open.drain(..) {
                                if !t.is_finished() {
                                    cuts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                }
                                t.abort();
                            }
                        }
                    }
                }
            }
        });
        DroppingProxy {
            url: proxied,
            cuts,
            task,
        }
    }
}

impl Drop for DroppingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
