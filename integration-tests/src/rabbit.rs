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
