//! The `postal` command-line tool.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, Context};
use clap::{Args, Parser, Subcommand};
use postal_producer::parse_property;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::out::say;

/// The relay and consumers allocate a few small buffers per event from several threads; mimalloc
/// serves that with less contention than glibc's malloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod audit;
mod cleanup;
mod consumer;
mod dashboard;
mod dead_letters;
mod failed;
mod grant;
mod held;
mod ids;
mod kafka_client;
mod known;
mod out;
mod pause;
mod progress;
mod shown;
mod status;

/// Postal: effectively-once event delivery between services over PostgreSQL and Kafka.
#[derive(Parser, Debug)]
#[command(name = "postal", version, about, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    #[command(subcommand)]
    command: Command,
}

/// librdkafka properties for every Kafka client a command makes (the relay's producer, and the
/// clients of `status`, `consumer reset` and `dead-letters replay`): TLS, SASL, tuning.
#[derive(Args, Debug, Default, Clone)]
struct KafkaArgs {
    /// Extra librdkafka properties `key=value` (repeatable; several comma-separated, a comma
    /// splitting only before the next `name=`), e.g. `security.protocol=SASL_SSL`. Overrides
    /// Postal's producer defaults; values that break durability or per-key order (acks other
    /// than all, another partitioner, retries=0, more than 5 requests in flight, no
    /// idempotence with more than 1) are refused. Pass credentials in --kafka-file or the env,
    /// not as a flag (flags show in process listings).
    // Parsed in `relay`, not by clap: clap's error would quote the whole value.
    #[arg(
        long = "kafka",
        env = "POSTAL_KAFKA",
        hide_env_values = true,
        global = true
    )]
    kafka: Vec<String>,
    /// A file of librdkafka properties, one `key=value` per line (`#` comments), read at start,
    /// e.g. Kafka's `client.properties` with `sasl.password`. --kafka entries override it.
    #[arg(long = "kafka-file", env = "POSTAL_KAFKA_FILE", global = true)]
    kafka_file: Option<std::path::PathBuf>,
}

impl KafkaArgs {
    /// The properties: the file's, then `--kafka`'s over them.
    fn properties(&self) -> anyhow::Result<BTreeMap<String, String>> {
        let mut properties = BTreeMap::new();
        if let Some(path) = &self.kafka_file {
            properties
                .extend(postal_shared::secret::read_properties_file(path).map_err(|e| anyhow!(e))?);
        }
        for value in &self.kafka {
            properties.extend(
                postal_shared::secret::parse_properties(value)
                    .map_err(|e| anyhow!("--kafka (or POSTAL_KAFKA): {e}"))?,
            );
        }
        Ok(properties)
    }
}

#[derive(Args, Debug)]
struct DbArgs {
    /// PostgreSQL URL (the password is never logged).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// How long one-shot commands wait for the database before failing.
    #[arg(long, env = "POSTAL_CONNECT_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration, global = true)]
    connect_timeout: Duration,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create the `postal` schema and apply pending migrations (a no-op when up to date).
    Migrate {
        /// Also create the WAL relay's publication and logical replication slot (plugin
        /// `pgoutput`) with this name, if missing (docs/wal-relay.md): only when asked, since a
        /// slot keeps WAL until a WAL relay reads it.
        #[arg(long)]
        wal_slot: Option<String>,
        /// The publication created with `--wal-slot`.
        #[arg(long, default_value = "postal_outbox", requires = "wal_slot")]
        wal_publication: String,
    },
    /// Run the relay: publish committed outbox events to Kafka until SIGINT/SIGTERM.
    Relay(Box<RelayArgs>),
    /// Show the outbox backlog per topic, the oldest pending event, parked events, how far a
    /// long transaction holds the relay back, live relays, and consumers with their stored
    /// positions, lag (when the broker answers) and dead letters.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Kafka bootstrap servers, for consumer lag (skipped when unreachable).
        #[arg(long, env = "KAFKA_BOOTSTRAP_SERVERS")]
        bootstrap_servers: Option<String>,
    },
    /// Parked outbox events: list, show, requeue, discard.
    #[command(subcommand)]
    Failed(failed::FailedCommand),
    /// Consumer dead letters: list, show, replay, resolve.
    #[command(subcommand)]
    DeadLetters(dead_letters::DeadLetterCommand),
    /// Held keys of a consumer group (`FinalFailure::HoldKey`): list, release.
    #[command(subcommand)]
    Held(held::HeldCommand),
    /// Consumer positions stored in the database: reset.
    #[command(subcommand)]
    Consumer(consumer::ConsumerCommand),
    /// Run retention once: kept published outbox rows and/or expired dedup rows, in batches.
    Cleanup(cleanup::CleanupArgs),
    /// Grant roles the least privileges they need on Postal's tables: --app (enqueue only),
    /// --relay, --consumer. Run it as the schema's owner, again after `postal migrate`.
    Grant(grant::GrantArgs),
    /// The audit trail of operator actions (this CLI's and the dashboard's): list, show.
    #[command(subcommand)]
    Audit(audit::AuditCommand),
    /// Pause a topic or relay group at the relay, or a consumer group or one of its topics at
    /// the consumer (durable, audited); `list` the pauses in force.
    #[command(subcommand)]
    Pause(pause::PauseCommand),
    /// Lift a pause given with the same flags.
    #[command(subcommand)]
    Resume(pause::ResumeCommand),
    /// Serve the operator dashboard (overview, parked events, blocked keys, dead letters,
    /// dedup lookup, audit) until SIGINT/SIGTERM: read-only unless --allow-actions, on
    /// 127.0.0.1 unless given --listen and --token.
    Dashboard(dashboard::DashboardArgs),
}

/// Relay settings. Every flag can also be given as `POSTAL_<FLAG>` in the environment (the
/// connections as `KAFKA_BOOTSTRAP_SERVERS` and `AMQP_URL`).
#[derive(Args, Debug)]
struct RelayArgs {
    /// Kafka bootstrap servers (required when a topic goes to Kafka).
    #[arg(long, env = "KAFKA_BOOTSTRAP_SERVERS")]
    bootstrap_servers: Option<String>,
    /// CloudEvents `source` written on every record.
    #[arg(long, env = "POSTAL_SOURCE", default_value = "postal")]
    source: String,
    /// Rows claimed per statement.
    #[arg(long, env = "POSTAL_BATCH_SIZE", default_value_t = 2000)]
    batch_size: usize,
    /// Batches awaiting acknowledgement at once.
    #[arg(long, env = "POSTAL_MAX_IN_FLIGHT", default_value_t = 4)]
    max_in_flight: usize,
    /// Parallel claim loops of the relay group, each over its own share of the key partitions
    /// with an equal share of the in-flight batches; each of n live relays runs lanes/n of them
    /// (rounded up).
    #[arg(long, env = "POSTAL_LANES", default_value_t = 4)]
    lanes: usize,
    /// Claim lease: a crashed relay's rows are retried after this.
    #[arg(long, env = "POSTAL_LEASE", default_value = "60s", value_parser = humantime::parse_duration)]
    lease: Duration,
    /// Safety-net polling interval.
    #[arg(long, env = "POSTAL_POLL_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    poll_interval: Duration,
    /// Disable LISTEN/NOTIFY wake-ups (poll only).
    #[arg(long, env = "POSTAL_NO_LISTEN")]
    no_listen: bool,
    /// Attempts before an event is parked as failed (broker unavailability never counts).
    #[arg(long, env = "POSTAL_MAX_ATTEMPTS", default_value_t = 10)]
    max_attempts: i32,
    /// First retry backoff ceiling (doubles per attempt, full jitter).
    #[arg(long, env = "POSTAL_BACKOFF_BASE", default_value = "500ms", value_parser = humantime::parse_duration)]
    backoff_base: Duration,
    /// Largest retry backoff.
    #[arg(long, env = "POSTAL_BACKOFF_MAX", default_value = "5m", value_parser = humantime::parse_duration)]
    backoff_max: Duration,
    /// Keep published rows (status `published`) instead of deleting them.
    #[arg(long, env = "POSTAL_KEEP_PUBLISHED")]
    keep_published: bool,
    /// With --keep-published: delete published rows older than this (e.g. `14d`), in batches.
    #[arg(long, env = "POSTAL_RETENTION", value_parser = humantime::parse_duration, requires = "keep_published")]
    retention: Option<Duration>,
    /// History mode: keep published events this long (e.g. `3d`) in `postal.outbox_history`,
    /// partitioned by day; whole days are dropped once expired. Rows still leave the outbox.
    #[arg(long, env = "POSTAL_HISTORY", value_parser = humantime::parse_duration, conflicts_with = "keep_published")]
    history: Option<Duration>,
    /// Do not create missing topics: events for them wait (holding their keys, using no
    /// attempts) until an operator creates the topic; the relay logs which one.
    #[arg(long, env = "POSTAL_NO_CREATE_TOPICS")]
    no_create_topics: bool,
    /// Publish only to these topics (comma-separated names or `prefix*`; `*` for every
    /// topic), and create only those. Events for others are parked with the reason. Without
    /// it every topic is allowed except dead-letter topics (`*.dlq`), which only an exact
    /// entry allows.
    #[arg(long, env = "POSTAL_ALLOW_TOPICS", value_delimiter = ',')]
    allow_topics: Vec<String>,
    /// Partitions of topics the relay creates.
    #[arg(long, env = "POSTAL_TOPIC_PARTITIONS", default_value_t = 12)]
    topic_partitions: i32,
    /// Replication factor of topics the relay creates: -1 takes the broker's
    /// `default.replication.factor`.
    #[arg(
        long,
        env = "POSTAL_TOPIC_REPLICATION",
        default_value_t = -1,
        allow_negative_numbers = true
    )]
    topic_replication: i32,
    /// How long shutdown waits for a batch still being handed over, and then for in-flight
    /// acknowledgements (each).
    #[arg(long, env = "POSTAL_SHUTDOWN_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    shutdown_timeout: Duration,
    /// Apply migrations before starting (waiting while the database is unreachable or a
    /// lock is busy; an error waiting cannot fix, e.g. a modified migration, a refused login or
    /// a missing database, stops the relay).
    #[arg(long, env = "POSTAL_MIGRATE")]
    migrate: bool,
    /// Where the relay finds committed events: `poll` claims them from the outbox; `wal` reads
    /// them from a logical replication slot over DATABASE_URL (docs/wal-relay.md: a first
    /// slice; the user needs REPLICATION, and the slot and publication must exist).
    #[arg(long, env = "POSTAL_READ_FROM", value_enum, default_value_t = ReadFrom::Poll)]
    read_from: ReadFrom,
    /// With --read-from wal: the logical replication slot (plugin pgoutput).
    #[arg(long, env = "POSTAL_WAL_SLOT", default_value = "postal_relay")]
    wal_slot: String,
    /// With --read-from wal: the publication of `postal.outbox` inserts.
    #[arg(long, env = "POSTAL_WAL_PUBLICATION", default_value = "postal_outbox")]
    wal_publication: String,
    /// Serve Prometheus `/metrics`, `/healthz` and `/readyz` (database reachable) on this
    /// address, e.g. `0.0.0.0:9464`. Off when not given.
    #[arg(long, env = "POSTAL_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Relay group: relays split the key partitions among the live members of their group.
    /// Relays serving different topics of one outbox (--topics / --exclude-topics) need
    /// different groups.
    #[arg(long, env = "POSTAL_GROUP", default_value = "default")]
    group: String,
    /// Claim only these topics (comma-separated).
    #[arg(
        long,
        env = "POSTAL_TOPICS",
        value_delimiter = ',',
        conflicts_with = "exclude_topics"
    )]
    topics: Vec<String>,
    /// Claim every topic except these (comma-separated), e.g. the topics a service runs as
    /// in-process tasks with its own relay group.
    #[arg(long, env = "POSTAL_EXCLUDE_TOPICS", value_delimiter = ',')]
    exclude_topics: Vec<String>,
    /// Where topics no --route matches are published.
    #[arg(long, env = "POSTAL_DESTINATION", value_enum, default_value_t = Destination::Kafka)]
    destination: Destination,
    /// `TOPIC=DESTINATION` (repeatable; comma-separated in the env): publish this topic, or
    /// every topic starting with a prefix written as `prefix*`, to `kafka` or `rabbitmq`. First
    /// match wins.
    #[arg(long = "route", env = "POSTAL_ROUTE", value_delimiter = ',', value_parser = parse_route)]
    routes: Vec<(String, Destination)>,
    /// AMQP URI of RabbitMQ (needed when a topic goes there), e.g.
    /// `amqp://user:pass@host:5672/%2f`; `amqps://` for TLS.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    rabbitmq_url: Option<String>,
    /// `EVENT_TYPE=ROUTING_KEY` (repeatable; comma-separated in the env). Without a mapping,
    /// the event type is the routing key.
    #[arg(long = "rabbitmq-routing-key", env = "POSTAL_RABBITMQ_ROUTING_KEY", value_delimiter = ',', value_parser = parse_property)]
    rabbitmq_routing_keys: Vec<(String, String)>,
    /// Do not declare exchanges (each topic's durable topic exchange must exist; events for a
    /// missing one are parked with an error).
    #[arg(long, env = "POSTAL_RABBITMQ_NO_DECLARE")]
    rabbitmq_no_declare: bool,
    /// How long a RabbitMQ publish may wait for its confirm (must stay under half the lease).
    #[arg(long, env = "POSTAL_RABBITMQ_CONFIRM_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    rabbitmq_confirm_timeout: Duration,
    /// How long a batch waits for the RabbitMQ connection to open (TCP, TLS, AMQP handshake,
    /// channel), and how long declaring an exchange or closing may take, before the relay
    /// counts it as unavailable and retries. One attempt to connect runs at a time.
    #[arg(long, env = "POSTAL_RABBITMQ_CONNECT_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    rabbitmq_connect_timeout: Duration,
    /// Largest message body sent to RabbitMQ; bigger events are parked.
    #[arg(long, env = "POSTAL_RABBITMQ_MAX_MESSAGE_BYTES", default_value_t = 16 * 1024 * 1024)]
    rabbitmq_max_message_bytes: usize,
}

/// A destination the relay publishes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Destination {
    /// Kafka (idempotent producer).
    Kafka,
    /// RabbitMQ (publisher confirms).
    Rabbitmq,
}

impl Destination {
    fn name(self) -> &'static str {
        match self {
            Destination::Kafka => "kafka",
            Destination::Rabbitmq => "rabbitmq",
        }
    }
}

/// The log filter without `POSTAL_LOG`. lapin logs each returned (unroutable) message and
/// each closed channel at WARN/ERROR with the whole message; the relay records and logs those
/// outcomes itself, in one line per event.
const DEFAULT_LOG: &str = "info,sqlx=warn,lapin=off";

fn parse_route(s: &str) -> Result<(String, Destination), String> {
    let (topic, dest) = s
        .split_once('=')
        .ok_or_else(|| format!("expected TOPIC=DESTINATION, got {s:?}"))?;
    let dest = <Destination as clap::ValueEnum>::from_str(dest.trim(), true)
        .map_err(|_| format!("unknown destination {dest:?} in {s:?} (kafka or rabbitmq)"))?;
    Ok((topic.trim().to_owned(), dest))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = postal_shared::init_logging(DEFAULT_LOG) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.kafka.properties() {
        Ok(p) => kafka_client::set(p),
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            return ExitCode::from(2);
        }
    }
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of standard output is gone (`postal status | head -1`): nothing to say.
        Err(e) if out::closed_stdout(&e) => ExitCode::from(out::CLOSED_STDOUT_STATUS),
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each said once: a cause whose text the line already
/// holds (sqlx repeats the database's message in its own) is left out. Escaped as everything
/// else the CLI prints ([`shown::shown`]): a database error may quote a stored value.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(text.as_str()) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    shown::shown(&line.replace('\n', " "), false).into_owned()
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate {
            wal_slot,
            wal_publication,
        } => {
            let pool = connect_now(&cli.db).await?;
            postal_shared::migrate(&pool)
                .await
                .context("applying migrations")?;
            say!("postal schema is up to date");
            if let Some(slot) = wal_slot {
                match postal_producer::wal::slot::create(&pool, &slot, &wal_publication)
                    .await
                    .context("creating the WAL relay's publication and slot")?
                {
                    Some(lsn) => say!(
                        "created publication {wal_publication} and slot {slot} (consistent point {lsn}): rows committed before it are not in the slot's stream; drain them with a polling relay first"
                    ),
                    None => say!("slot {slot} exists (publication {wal_publication} ensured)"),
                }
            }
            Ok(())
        }
        Command::Status {
            json,
            bootstrap_servers,
        } => {
            let pool = connect_migrated(&cli.db).await?;
            status::print(&pool, json, bootstrap_servers.as_deref()).await
        }
        Command::Failed(cmd) => failed::run(&connect_migrated(&cli.db).await?, cmd).await,
        Command::DeadLetters(cmd) => {
            dead_letters::run(&connect_migrated(&cli.db).await?, cmd).await
        }
        Command::Consumer(cmd) => consumer::run(&connect_migrated(&cli.db).await?, cmd).await,
        Command::Held(cmd) => held::run(&connect_migrated(&cli.db).await?, cmd).await,
        Command::Cleanup(args) => cleanup::run(&connect_migrated(&cli.db).await?, args).await,
        Command::Audit(cmd) => audit::run(&connect_migrated(&cli.db).await?, cmd).await,
        Command::Pause(cmd) => pause::pause(&connect_migrated(&cli.db).await?, cmd).await,
        Command::Resume(cmd) => pause::resume(&connect_migrated(&cli.db).await?, cmd).await,
        Command::Grant(args) => grant::run(&connect_migrated(&cli.db).await?, args).await,
        Command::Dashboard(args) => dashboard::run(connect_migrated(&cli.db).await?, args).await,
        Command::Relay(args) => relay(&cli.db, &cli.kafka, *args).await,
    }
}

fn connect_options(db: &DbArgs) -> anyhow::Result<PgConnectOptions> {
    let url = db
        .database_url
        .as_deref()
        .ok_or_else(|| anyhow!("no database given: set DATABASE_URL or pass --database-url"))?;
    postal_shared::secret::database_url_options(url).map_err(|e| anyhow!(e))
}

/// Connects for a one-shot command: fails within the connect timeout with one line naming
/// the cause (a refused connection, a refused login, a missing database).
async fn connect_now(db: &DbArgs) -> anyhow::Result<PgPool> {
    use sqlx::Connection as _;
    let opts = connect_options(db)?;
    let target = format!("{}:{}", opts.get_host(), opts.get_port());
    // One connection first: a pool that cannot connect only says it timed out.
    let first = tokio::time::timeout(db.connect_timeout, sqlx::PgConnection::connect_with(&opts))
        .await
        .map_err(|_| {
            anyhow!(
                "cannot reach PostgreSQL at {target}: no answer within {}; check DATABASE_URL and that the server runs",
                humantime::format_duration(db.connect_timeout)
            )
        })?;
    if let Err(e) = first {
        if let Some(hint) = postal_shared::connect_hint(&e) {
            return Err(anyhow!(
                "PostgreSQL at {target}: {hint}; the connection failed with: {e}"
            ));
        }
        return Err(match e.as_database_error().and_then(|d| d.code()).as_deref() {
            Some("28P01" | "28000") => anyhow!(
                "PostgreSQL at {target} refused the login: {}; check the user and password in DATABASE_URL",
                e.as_database_error().map(|d| d.message().to_owned()).unwrap_or_default()
            ),
            Some("3D000") => anyhow!(
                "PostgreSQL at {target}: {}; check the database name in DATABASE_URL",
                e.as_database_error().map(|d| d.message().to_owned()).unwrap_or_default()
            ),
            _ => anyhow!(
                "cannot reach PostgreSQL at {target}: {}; check DATABASE_URL and that the server runs",
                e
            ),
        });
    }
    if let Ok(c) = first {
        c.close().await.ok();
    }
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(db.connect_timeout)
        .connect_with(opts)
        .await
        .map_err(|e| anyhow!("cannot reach PostgreSQL at {target}: {e}"))
}

/// [`connect_now`], for a command that works on Postal's tables: refuses, with one line saying
/// what to do, a database without Postal's schema or with one this binary cannot use.
async fn connect_migrated(db: &DbArgs) -> anyhow::Result<PgPool> {
    let pool = connect_now(db).await?;
    postal_shared::check_schema(&pool).await?;
    Ok(pool)
}

/// The URL with its password (user part or query parameter) replaced.
fn redact(url: &str) -> String {
    postal_shared::secret::redact_url(url)
}

/// The relay settings of `postal relay`'s flags and variables (clap reads both, with the names
/// and defaults of [`postal_producer::RelayConfig::with_vars`]; a test keeps them equal).
fn relay_config(args: &RelayArgs) -> postal_producer::RelayConfig {
    let topics = if !args.topics.is_empty() {
        postal_producer::TopicFilter::Only(args.topics.clone())
    } else if !args.exclude_topics.is_empty() {
        postal_producer::TopicFilter::Except(args.exclude_topics.clone())
    } else {
        postal_producer::TopicFilter::All
    };
    postal_producer::RelayConfig::default()
        .batch_size(args.batch_size)
        .max_in_flight_batches(args.max_in_flight)
        .lanes(args.lanes)
        .lease(args.lease)
        .poll_interval(args.poll_interval)
        .listen(!args.no_listen)
        .max_attempts(args.max_attempts)
        .backoff(postal_producer::Backoff {
            base: args.backoff_base,
            max: args.backoff_max,
        })
        .delete_on_publish(!args.keep_published)
        .retention(args.retention)
        .history(args.history)
        .shutdown_timeout(args.shutdown_timeout)
        .group(args.group.clone())
        .topics(topics)
}

/// The Kafka settings of `postal relay`'s flags and variables (as
/// [`postal_producer::KafkaConfig::with_vars`] reads them; a test keeps them equal).
fn kafka_config(
    args: &RelayArgs,
    client: &KafkaArgs,
    allowed: postal_producer::TopicAllowList,
) -> anyhow::Result<postal_producer::KafkaConfig> {
    let bootstrap = required_bootstrap(args.bootstrap_servers.as_deref())?;
    let mut kafka = postal_producer::KafkaConfig::new(bootstrap);
    kafka.source = args.source.clone();
    kafka.create_topics = !args.no_create_topics;
    kafka.topic_partitions = args.topic_partitions;
    kafka.topic_replication = args.topic_replication;
    kafka.allowed_topics = allowed;
    kafka.properties = client.properties()?;
    Ok(kafka)
}

/// Where `postal relay` finds committed events (`--read-from`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ReadFrom {
    /// Claim them from the outbox.
    Poll,
    /// Read them from a logical replication slot.
    Wal,
}

async fn relay(db: &DbArgs, client: &KafkaArgs, args: RelayArgs) -> anyhow::Result<()> {
    // Listened for from here on: SIGTERM while the relay still starts (its broker or database
    // unreachable, migrations waiting) is a graceful stop too, not the default kill.
    let stop = postal_shared::stop_signal().context("listening for SIGINT and SIGTERM")?;
    postal_shared::env::refuse_renamed(&|name: &str| std::env::var(name).ok())
        .map_err(|e| anyhow!(e))?;
    postal_shared::env::warn_unknown();
    let mut config = relay_config(&args);
    if args.read_from == ReadFrom::Wal {
        let url = db
            .database_url
            .clone()
            .ok_or_else(|| anyhow!("--read-from wal reads the slot over --database-url (DATABASE_URL), which is not set"))?;
        config = config.source(postal_producer::RelaySource::Wal(
            postal_producer::WalSource::new(url, &args.wal_slot, &args.wal_publication),
        ));
    }
    config.validate()?;
    // Checked before any client starts: a mistyped URL is one line, not a Kafka client's
    // connection errors first.
    connect_options(db)?;
    let allowed = if args.allow_topics.is_empty() {
        postal_producer::TopicAllowList::any()
    } else {
        postal_producer::TopicAllowList::only(args.allow_topics.iter().cloned())?
    };
    let used = |d: Destination| args.destination == d || args.routes.iter().any(|(_, r)| *r == d);
    let kafka = if used(Destination::Kafka) {
        let kafka = kafka_config(&args, client, allowed.clone())?;
        Some(postal_producer::KafkaTransport::new(kafka).context("kafka configuration")?)
    } else {
        None
    };
    let rabbit = if used(Destination::Rabbitmq) {
        let url = args.rabbitmq_url.clone().ok_or_else(|| {
            anyhow!("--rabbitmq-url (or AMQP_URL) is required when topics go to rabbitmq")
        })?;
        let mut cfg = postal_producer::RabbitConfig::new(url);
        cfg.source = args.source.clone();
        cfg.routing_keys = args.rabbitmq_routing_keys.iter().cloned().collect();
        cfg.declare_exchanges = !args.rabbitmq_no_declare;
        cfg.allowed_topics = allowed.clone();
        cfg.confirm_timeout = args.rabbitmq_confirm_timeout;
        cfg.connect_timeout = args.rabbitmq_connect_timeout;
        cfg.max_message_bytes = args.rabbitmq_max_message_bytes;
        Some(postal_producer::RabbitTransport::new(cfg).context("rabbitmq configuration")?)
    } else {
        None
    };
    if args.routes.is_empty() {
        match (kafka, rabbit) {
            (Some(k), _) => run_relay(db, args, config, k, stop).await,
            (_, Some(r)) => run_relay(db, args, config, r, stop).await,
            (None, None) => unreachable!("the fallback destination is always used"),
        }
    } else {
        let mut router = postal_producer::Router::new();
        if let Some(k) = kafka {
            router = router.destination(Destination::Kafka.name(), k);
        }
        if let Some(r) = rabbit {
            router = router.destination(Destination::Rabbitmq.name(), r);
        }
        for (pattern, dest) in &args.routes {
            router = router.route(pattern.clone(), dest.name())?;
        }
        router = router.fallback(args.destination.name())?;
        tracing::info!(?router, "publishing per topic");
        run_relay(db, args, config, router, stop).await
    }
}

async fn run_relay<T: postal_producer::Transport>(
    db: &DbArgs,
    args: RelayArgs,
    config: postal_producer::RelayConfig,
    transport: T,
    mut stop: postal_shared::StopSignal,
) -> anyhow::Result<()> {
    let opts = connect_options(db)?;
    let url = db.database_url.as_deref().map(redact).unwrap_or_default();
    // Long-running: a lazy pool, so an unreachable database means retries, not an exit.
    let pool = PgPoolOptions::new()
        .max_connections(postal_producer::Relay::<T>::connections_wanted(&config))
        .acquire_timeout(Duration::from_secs(5))
        // No test query before every checkout (a round trip per claim): a broken connection
        // fails the claim instead, which the relay retries with backoff.
        .test_before_acquire(false)
        .connect_lazy_with(opts);
    if args.migrate {
        let mut attempt = 0u32;
        loop {
            // An attempt can wait long (for another migrator's lock, up to a minute; for a
            // concurrent index build): a stop ends it too. An interrupted attempt leaves nothing
            // half-done that the next one does not clean up (each migration is a transaction;
            // migration 9's index build drops the invalid index a broken build left).
            let attempted = tokio::select! {
                r = postal_shared::migrate(&pool) => r,
                () = &mut stop => {
                    tracing::info!("stopped before the relay started (a migration attempt was under way)");
                    return Ok(());
                }
            };
            match attempted {
                Ok(()) => break,
                // Waiting does not fix these (a modified migration, a refused login, a missing
                // database, missing rights): stop with the reason.
                Err(e) if !e.is_unavailable() && !worth_retrying(&e) => {
                    return Err(
                        anyhow::Error::new(e).context(format!("cannot apply migrations to {url}"))
                    )
                }
                Err(e) => {
                    attempt += 1;
                    let wait = Duration::from_secs(u64::from(attempt.min(30)));
                    tracing::warn!(database = %url, error = %e, retry_in_s = wait.as_secs(), "cannot apply migrations yet; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = &mut stop => {
                            tracing::info!("stopped before the relay started");
                            return Ok(());
                        }
                    }
                }
            }
        }
    }
    tracing::info!(database = %url, "starting relay");
    let relay = postal_producer::Relay::new(pool.clone(), transport, config)?;
    // Ready while the database answers and claims do not wait on it (a pooler without a
    // server connection for the relay answers the readiness query and holds the claims).
    let health = relay.health();
    let _ops = match args.metrics_addr {
        Some(addr) => {
            let ready_pool = pool.clone();
            let ready = move || {
                let (pool, health) = (ready_pool.clone(), health.clone());
                async move {
                    health.problem().is_none()
                        && sqlx::query("SELECT 1").execute(&pool).await.is_ok()
                }
            };
            Some(postal_ops::serve(addr, ready).await?)
        }
        None => None,
    };
    let stats = relay.run(stop).await?;
    tracing::info!(published = stats.published, parked = stats.parked, "bye");
    Ok(())
}

/// The Kafka bootstrap servers of a command that needs them: there is no default broker
/// (README's configuration table), so a missing one is a one-line error saying how to give it.
fn required_bootstrap(given: Option<&str>) -> anyhow::Result<String> {
    match given.map(str::trim) {
        Some(b) if !b.is_empty() => Ok(b.to_owned()),
        _ => Err(anyhow!(
            "no Kafka brokers given: set KAFKA_BOOTSTRAP_SERVERS or pass --bootstrap-servers host:port"
        )),
    }
}

/// Migration errors that another attempt may not meet although the server is reachable:
/// serialization failures, deadlocks, lock and statement timeouts (another session held a
/// lock the migration needs).
fn worth_retrying(e: &postal_shared::Error) -> bool {
    // A pooler too busy for the session probe: the relay waits for it (`postal migrate`, a
    // one-shot command, stops with the line).
    if matches!(
        e,
        postal_shared::Error::LockBusy { .. } | postal_shared::Error::PoolingUnknown(_)
    ) {
        return true;
    }
    let code = e
        .database_error()
        .and_then(sqlx::Error::as_database_error)
        .and_then(|d| d.code())
        .unwrap_or_default();
    code.starts_with("40") || code == "55P03" || code == "57014"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relay_args(flags: &[&str]) -> (RelayArgs, KafkaArgs) {
        let argv = ["postal", "relay"].iter().chain(flags);
        let cli = Cli::try_parse_from(argv).expect("valid flags");
        match cli.command {
            Command::Relay(args) => (*args, cli.kafka),
            other => panic!("not a relay: {other:?}"),
        }
    }

    /// Guarantee: `postal relay` and the library's loaders (`RelayConfig::with_vars`,
    /// `KafkaConfig::with_vars`) read one vocabulary — the same defaults, and a flag sets what
    /// its variable sets — and every variable the CLI reads is in README's configuration table
    /// (`postal_shared::env::VARIABLES`).
    #[test]
    fn relay_flags_and_the_library_loaders_agree() {
        let env = |name: &str| std::env::var(name).ok();
        type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
        let cases: [Case; 3] = [
            (
                &["--bootstrap-servers=b:9092"],
                &[("KAFKA_BOOTSTRAP_SERVERS", "b:9092")],
            ),
            (
                &[
                    "--lease=30s",
                    "--poll-interval=250ms",
                    "--no-listen",
                    "--keep-published",
                    "--retention=7d",
                    "--topics=a,b",
                    "--group=g",
                    "--lanes=2",
                    "--batch-size=10",
                    "--max-in-flight=3",
                    "--max-attempts=4",
                    "--backoff-base=1s",
                    "--backoff-max=2m",
                    "--shutdown-timeout=3s",
                    "--source=svc",
                    "--no-create-topics",
                    "--topic-partitions=6",
                    "--topic-replication=3",
                    "--bootstrap-servers=k:9092",
                ],
                &[
                    ("POSTAL_LEASE", "30s"),
                    ("POSTAL_POLL_INTERVAL", "250ms"),
                    ("POSTAL_NO_LISTEN", "true"),
                    ("POSTAL_KEEP_PUBLISHED", "true"),
                    ("POSTAL_RETENTION", "7d"),
                    ("POSTAL_TOPICS", "a,b"),
                    ("POSTAL_GROUP", "g"),
                    ("POSTAL_LANES", "2"),
                    ("POSTAL_BATCH_SIZE", "10"),
                    ("POSTAL_MAX_IN_FLIGHT", "3"),
                    ("POSTAL_MAX_ATTEMPTS", "4"),
                    ("POSTAL_BACKOFF_BASE", "1s"),
                    ("POSTAL_BACKOFF_MAX", "2m"),
                    ("POSTAL_SHUTDOWN_TIMEOUT", "3s"),
                    ("POSTAL_SOURCE", "svc"),
                    ("POSTAL_NO_CREATE_TOPICS", "true"),
                    ("POSTAL_TOPIC_PARTITIONS", "6"),
                    ("POSTAL_TOPIC_REPLICATION", "3"),
                    ("KAFKA_BOOTSTRAP_SERVERS", "k:9092"),
                ],
            ),
            (
                &[
                    "--history=3d",
                    "--exclude-topics=reports",
                    "--bootstrap-servers=b:9092",
                ],
                &[
                    ("POSTAL_HISTORY", "3d"),
                    ("POSTAL_EXCLUDE_TOPICS", "reports"),
                    ("KAFKA_BOOTSTRAP_SERVERS", "b:9092"),
                ],
            ),
        ];
        for (flags, vars) in cases {
            let (args, client) = relay_args(flags);
            let lookup = |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
                    .or_else(|| env(name))
            };
            let from_cli = relay_config(&args);
            let from_library = postal_producer::RelayConfig::default()
                .with_vars(lookup)
                .expect("valid variables");
            assert_eq!(
                format!("{from_cli:?}"),
                format!("{from_library:?}"),
                "flags {flags:?}"
            );
            let kafka_cli =
                kafka_config(&args, &client, postal_producer::TopicAllowList::any()).unwrap();
            let kafka_library = postal_producer::KafkaConfig::new("127.0.0.1:9092")
                .with_vars(lookup)
                .unwrap();
            assert_eq!(
                format!("{kafka_cli:?}"),
                format!("{kafka_library:?}"),
                "flags {flags:?}"
            );
        }
        use clap::CommandFactory;
        let cmd = Cli::command();
        let mut read = Vec::new();
        for sub in cmd.get_subcommands() {
            for arg in sub.get_arguments().chain(cmd.get_arguments()) {
                if let Some(name) = arg.get_env() {
                    read.push(name.to_string_lossy().into_owned());
                }
            }
        }
        assert!(read.iter().any(|n| n == "POSTAL_LEASE"));
        for name in read {
            assert!(
                postal_shared::env::VARIABLES.iter().any(|v| v.name == name),
                "{name} is read by the CLI but missing from postal_shared::env::VARIABLES"
            );
        }
    }
}
