//! The schedule explorer (issue 45): Postal's real producer code — `enqueue`,
//! `enqueue_batch` and the SQL `postal.enqueue` in writer transactions of different lengths,
//! relays that claim and complete with leases, a lease takeover, a requeue of parked events,
//! scheduled events, failed publishes — runs in sessions whose statements pass through a
//! gate ([`gate`]) that releases one statement at a time, in an order the explorer chooses
//! ([`sched`]), against real PostgreSQL. After each schedule everything is drained and three
//! things are checked: nothing committed is lost (and nothing uncommitted published), the
//! first publications of each key (topic and key) come in sequence order, and no claim
//! completes for a relay that no longer owns its partitions.
//!
//! The relays are played by hand with `postal_producer::testing` (claim, complete, heartbeat)
//! and a simulated destination that publishes by appending to a log, fails as the scenario
//! says and holds back a key's later events after a failure, as a transport must; its
//! failures become row changes as the relay's verdict makes them. Time never passes by
//! itself: a lease runs out when the `clock` session says so, and events scheduled for later
//! (or retried later) come due when the drain moves the clock on.
//!
//! Explorations: every schedule of a small scenario up to a bound of preemptions
//! (`enumeration`: the review's writers and claim; `enumeration_takeover`: a lease that runs
//! out under an open claim), and seeded random schedules of random scenarios (`random`, and
//! the long run `long_random`, ignored).
//!
//! The WAL relay (issue 50, [`wal`]) is played the same way: it reads the slot's committed
//! transactions by SQL and publishes them with the WAL relay's own row take, lock, verdict
//! and marks under the slot's lease, confirming the slot only past what it finished
//! (`enumeration_wal`, `enumeration_wal_takeover`: a second WAL relay takes the slot over,
//! `enumeration_mixed`: a polling relay writes a failed row back beside the stream,
//! `random_wal` and `long_random_wal`: random scenarios with r1 on the slot and r2 taking
//! it over or claiming beside it).
//!
//! Replays are exact up to what PostgreSQL decides by itself: sessions that one commit wakes
//! together run concurrently (as in production), and which of two deadlocked writers is
//! aborted can vary.
//!
//! Settings (environment):
//! - `POSTAL_EXPLORER_SCHEDULES`: how many random schedules `random` runs (default 150;
//!   `long_random` 100,000);
//! - `POSTAL_EXPLORER_SEED`: the first schedule's seed (default: random); schedule `i` uses
//!   seed + i, which picks its scenario and its schedule. A failure prints its seed:
//!   `POSTAL_EXPLORER_SEED=<seed> POSTAL_EXPLORER_SCHEDULES=1` runs exactly that scenario and
//!   schedule again;
//! - `POSTAL_EXPLORER_PARALLEL`: random schedules on that many databases at once (default 1);
//! - `POSTAL_EXPLORER_KEEP_GOING`: the random run does not stop at the first failing
//!   schedule, and lists the seeds of all of them at the end;
//! - `POSTAL_EXPLORER_BOUND`: the preemption bound of the enumerations (defaults 2 and 1);
//! - `POSTAL_EXPLORER_ROUNDS`: the claims of `enumeration`'s relay (default 1);
//! - `POSTAL_EXPLORER_REPLAY`: a choice sequence as a failing enumeration prints it
//!   (`w1,r1,w2,…`): the enumeration then runs only that schedule.

mod gate;
mod sched;
mod wal;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use futures::future::BoxFuture;
use futures::FutureExt as _;
use postal_integration_tests::{fresh_postgres_db, unique, TestDb};
use postal_producer::testing::claim::{self, Failure};
use postal_producer::testing::lease;
use postal_producer::{enqueue, enqueue_batch, EventId, NewEvent, OutboundEvent, TopicFilter};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions as _, PgPool};
use uuid::Uuid;

use gate::Gate;
use sched::{ChoicePoint, Chooser, Engine, RandomChooser, Rng, Run};

/// The sessions, by index. Writers `w*`, relays `r*`, an operator (`ops`: requeues parked
/// events) and the passing of time (`clock`: a relay's lease runs out).
const NAMES: [&str; 7] = ["w1", "w2", "w3", "r1", "r2", "ops", "clock"];
const W1: usize = 0;
const R1: usize = 3;
const R2: usize = 4;
const OPS: usize = 5;
const CLOCK: usize = 6;

/// The relays' lease: long against a schedule (a schedule holds a claim open for as long as
/// the explorer wants). A lease runs out only when the `clock` session says so.
const LEASE: Duration = Duration::from_secs(600);
/// Attempts before the simulated relay parks an event (the relay's `max_attempts`).
const MAX_ATTEMPTS: i32 = 3;
const KEYS: [&str; 2] = ["k1", "k2"];

// ---------------------------------------------------------------------------------------
// Scenarios

/// When an event is to be delivered (`NewEvent::deliver_at`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Deliver {
    /// Not set.
    Now,
    /// The writer's clock when it enqueues: after its transaction began.
    JustNow,
    /// An hour ago.
    Past,
    /// In an hour (due only when the drain moves the clock on).
    Later,
}

/// What the relays' destination does with an event.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fail {
    None,
    /// Fails `times` times with an error that counts as an attempt, retried at once or (when
    /// `later`) in an hour.
    Transient {
        times: u32,
        later: bool,
    },
    /// Fails once for good: parked (until `ops` or the drain requeues it).
    Permanent,
    /// Not attempted the first `times` times (the Kafka transport's key fence after it
    /// replaced its producer: `FailureKind::HeldBack` as the key's first failure).
    Fenced {
        times: u32,
    },
}

#[derive(Clone, Debug)]
struct Ev {
    id: Uuid,
    topic: usize,
    key: &'static str,
    fail: Fail,
    deliver: Deliver,
}

/// A writer's statement besides its enqueues.
#[derive(Clone, Copy, Debug)]
enum Extra {
    /// `SELECT pg_sleep(0)`.
    Sleep,
    /// A row in a business table.
    Business,
}

/// One way of enqueueing.
#[derive(Clone, Debug)]
enum Op {
    /// `postal_producer::enqueue`.
    Rust(Ev),
    /// `postal_producer::enqueue_batch`.
    Batch(Vec<Ev>),
    /// The SQL function `postal.enqueue`.
    Sql(Ev),
    /// `enqueue` inside a savepoint that is rolled back: never committed.
    Undone(Ev),
}

#[derive(Clone, Debug)]
struct Writer {
    session: usize,
    before: Vec<Extra>,
    ops: Vec<Op>,
    after: Vec<Extra>,
    commit: bool,
}

#[derive(Clone, Debug)]
struct Relay {
    session: usize,
    id: Uuid,
    rounds: u32,
    /// Takes its partitions over during the schedule (heartbeats first), or (`wal`) the
    /// slot's lease once r1's ran out.
    takes_over: bool,
    /// Reads the slot and publishes with the WAL relay's code (`wal`) instead of claiming.
    wal: bool,
}

#[derive(Clone, Debug)]
struct Scenario {
    writers: Vec<Writer>,
    relays: Vec<Relay>,
    /// Delete-on-claim (the default) or keep published rows.
    delete_on_claim: bool,
    /// `ops` requeues whatever is parked when it runs.
    requeue: bool,
    /// `clock` ends `r1`'s lease (and its heartbeat; a WAL r1's slot lease) during the
    /// schedule.
    expire_r1: bool,
}

impl Scenario {
    fn events(&self) -> impl Iterator<Item = &Ev> {
        self.writers.iter().flat_map(|w| {
            w.ops.iter().flat_map(|op| match op {
                Op::Rust(e) | Op::Sql(e) | Op::Undone(e) => std::slice::from_ref(e),
                Op::Batch(es) => es.as_slice(),
            })
        })
    }

    /// A compact description for failure reports.
    fn describe(&self) -> String {
        let ev = |e: &Ev| {
            let mut s = format!("{}{}", ["A", "B"][e.topic], e.key);
            if e.fail != Fail::None {
                s += &format!(" {:?}", e.fail);
            }
            if e.deliver != Deliver::Now {
                s += &format!(" deliver {:?}", e.deliver);
            }
            s
        };
        let mut out = String::new();
        for w in &self.writers {
            let ops: Vec<String> = w
                .ops
                .iter()
                .map(|op| match op {
                    Op::Rust(e) => format!("enqueue({})", ev(e)),
                    Op::Sql(e) => format!("postal.enqueue({})", ev(e)),
                    Op::Undone(e) => format!("savepoint enqueue({}) rolled back", ev(e)),
                    Op::Batch(es) => format!(
                        "enqueue_batch({})",
                        es.iter().map(ev).collect::<Vec<_>>().join(", ")
                    ),
                })
                .collect();
            out += &format!(
                "\n    {}: BEGIN {:?} {} {:?} {}",
                NAMES[w.session],
                w.before,
                ops.join("; "),
                w.after,
                if w.commit { "COMMIT" } else { "ROLLBACK" }
            );
        }
        for r in &self.relays {
            out += &format!(
                "\n    {}: {}{} {} rounds",
                NAMES[r.session],
                match (r.takes_over, r.wal) {
                    (true, false) => "2 heartbeats (takeover), ",
                    (true, true) => "takes the slot's lease over, ",
                    _ => "",
                },
                r.rounds,
                if r.wal {
                    "slot read and publish"
                } else {
                    "claim"
                }
            );
        }
        out += &format!(
            "\n    delete on claim: {}, ops requeues: {}, clock ends r1's lease: {}",
            self.delete_on_claim, self.requeue, self.expire_r1
        );
        out
    }
}

fn ev(rng: &mut Rng) -> Ev {
    let fail = match rng.below(100) {
        0..=9 => Fail::Transient {
            times: 1 + rng.below(2) as u32,
            later: rng.chance(1, 3),
        },
        10..=16 => Fail::Permanent,
        17..=24 => Fail::Fenced {
            times: 1 + rng.below(2) as u32,
        },
        _ => Fail::None,
    };
    let deliver = match rng.below(100) {
        0..=7 => Deliver::JustNow,
        8..=13 => Deliver::Past,
        14..=19 => Deliver::Later,
        _ => Deliver::Now,
    };
    Ev {
        id: Uuid::from_u64_pair(rng.next_u64() | 1, rng.next_u64()),
        topic: usize::from(rng.chance(1, 5)),
        key: KEYS[rng.below(KEYS.len())],
        fail,
        deliver,
    }
}

/// A random scenario: 2–3 writers on two keys (mostly one topic), 1–2 relays.
fn random_scenario(rng: &mut Rng) -> Scenario {
    let extras = |rng: &mut Rng| -> Vec<Extra> {
        (0..rng.below(2))
            .map(|_| *rng.pick(&[Extra::Sleep, Extra::Business]))
            .collect()
    };
    let writers = (0..2 + rng.below(2))
        .map(|w| Writer {
            session: W1 + w,
            before: extras(rng),
            ops: (0..1 + rng.below(2))
                .map(|_| match rng.below(100) {
                    0..=39 => Op::Rust(ev(rng)),
                    40..=64 => Op::Sql(ev(rng)),
                    65..=84 => Op::Batch(vec![ev(rng), ev(rng)]),
                    _ => Op::Undone(ev(rng)),
                })
                .collect(),
            after: extras(rng),
            commit: !rng.chance(1, 8),
        })
        .collect();
    let expire_r1 = rng.chance(1, 4);
    let mut relays = vec![Relay {
        session: R1,
        id: Uuid::from_u64_pair(1, rng.next_u64()),
        rounds: 2 + rng.below(2) as u32,
        takes_over: false,
        wal: false,
    }];
    if expire_r1 {
        relays.push(Relay {
            session: R2,
            id: Uuid::from_u64_pair(2, rng.next_u64()),
            rounds: 2,
            takes_over: true,
            wal: false,
        });
    }
    let mut s = Scenario {
        writers,
        relays,
        delete_on_claim: !rng.chance(1, 4),
        requeue: false,
        expire_r1,
    };
    let parks = s.events().any(|e| e.fail == Fail::Permanent);
    s.requeue = parks || rng.chance(1, 5);
    s
}

/// A random scenario of [`random_scenario`]'s with r1 a WAL relay: when its lease runs out,
/// r2 is a WAL relay that takes the slot over; else, half the time, r2 is a polling relay
/// beside it (a WAL relay's sweep, or polling relays taking over from a slot).
fn random_wal_scenario(rng: &mut Rng) -> Scenario {
    let mut s = random_scenario(rng);
    s.relays[0].wal = true;
    // A slot read is one statement: more of them, so that more reads come after commits.
    s.relays[0].rounds += 1 + rng.below(2) as u32;
    if s.expire_r1 {
        s.relays[1].wal = true;
    } else if rng.chance(1, 2) {
        s.relays.push(Relay {
            session: R2,
            id: Uuid::from_u64_pair(2, rng.next_u64()),
            rounds: 2,
            takes_over: false,
            wal: false,
        });
    }
    s
}

/// `scenario` with r1 a WAL relay, and r2 (if any) one too; r1 reads the slot once more (a
/// read is one statement, and one before the commits finds nothing).
fn on_the_slot(mut scenario: Scenario) -> Scenario {
    for r in &mut scenario.relays {
        r.wal = true;
    }
    scenario.relays[0].rounds += 1;
    scenario
}

/// A WAL relay and a polling relay on one key (issue 50, the mixed-mode reorder of seed
/// 4481965649440346300): two writers enqueue one event each for the same key, the first
/// failing once at the destination and retried at once; r2 claims (writing the failed row
/// back: inserted again, so that the slot gives it again), and r1 reads the slot twice.
fn mixed_scenario() -> Scenario {
    let mut s = review_scenario(1);
    if let Op::Rust(e) = &mut s.writers[0].ops[0] {
        e.fail = Fail::Transient {
            times: 1,
            later: false,
        };
    }
    s.relays = vec![
        Relay {
            session: R1,
            id: Uuid::from_u64_pair(1, 1),
            rounds: 2,
            takes_over: false,
            wal: true,
        },
        Relay {
            session: R2,
            id: Uuid::from_u64_pair(2, 2),
            rounds: 1,
            takes_over: false,
            wal: false,
        },
    ];
    s
}

/// The schedule of the review in its smallest form: two writers enqueue one event each for
/// the same key, and one relay claims `rounds` times (the drain claims what is left).
fn review_scenario(rounds: u32) -> Scenario {
    let writer = |session: usize, n: u64| Writer {
        session,
        before: vec![],
        ops: vec![Op::Rust(Ev {
            id: Uuid::from_u64_pair(0x0190_0000_0000_7000, n),
            topic: 0,
            key: "k1",
            fail: Fail::None,
            deliver: Deliver::Now,
        })],
        after: vec![],
        commit: true,
    };
    Scenario {
        writers: vec![writer(W1, 1), writer(W1 + 1, 2)],
        relays: vec![Relay {
            session: R1,
            id: Uuid::from_u64_pair(1, 1),
            rounds,
            takes_over: false,
            wal: false,
        }],
        delete_on_claim: true,
        requeue: false,
        expire_r1: false,
    }
}

/// A lease that runs out under an open claim: a writer enqueues two events of a key in one
/// batch (the second fails once at the destination and is retried at once), r1 claims once,
/// the clock ends r1's lease, and r2 takes the partitions over (terminating r1's claim if it
/// is still open) and claims once; the drain claims what is left.
fn takeover_scenario() -> Scenario {
    let ev = |n: u64, fail: Fail| Ev {
        id: Uuid::from_u64_pair(0x0190_0000_0000_7000, n),
        topic: 0,
        key: "k1",
        fail,
        deliver: Deliver::Now,
    };
    Scenario {
        writers: vec![Writer {
            session: W1,
            before: vec![],
            ops: vec![Op::Batch(vec![
                ev(1, Fail::None),
                ev(
                    2,
                    Fail::Transient {
                        times: 1,
                        later: false,
                    },
                ),
            ])],
            after: vec![],
            commit: true,
        }],
        relays: vec![
            Relay {
                session: R1,
                id: Uuid::from_u64_pair(1, 1),
                rounds: 1,
                takes_over: false,
                wal: false,
            },
            Relay {
                session: R2,
                id: Uuid::from_u64_pair(2, 2),
                rounds: 1,
                takes_over: true,
                wal: false,
            },
        ],
        delete_on_claim: true,
        requeue: false,
        expire_r1: true,
    }
}

// ---------------------------------------------------------------------------------------
// What happened

#[derive(Debug)]
struct Published {
    seq: i64,
    id: Uuid,
    topic: String,
    key: String,
    by: &'static str,
}

#[derive(Default, Debug)]
struct Log {
    /// Events of committed writer transactions.
    committed: Vec<(Uuid, String, String)>,
    /// Publications the destination accepted, in order.
    published: Vec<Published>,
    /// Failures the destination returned so far, per event.
    failed: HashMap<Uuid, u32>,
    /// What the sessions saw (errors, lost leases).
    notes: Vec<String>,
    violations: Vec<String>,
    /// How often each situation came up (the exploration's coverage).
    seen: std::collections::BTreeMap<&'static str, u64>,
}

impl Log {
    fn saw(&mut self, what: &'static str) {
        *self.seen.entry(what).or_default() += 1;
    }
}

type Shared = Arc<Mutex<Log>>;

fn note(log: &Shared, what: &'static str, s: String) {
    let mut l = log.lock().unwrap();
    l.saw(what);
    l.notes.push(s);
}

/// The explorer's fixture: a database, the gate, one pool of one connection per session
/// through the gate.
struct Harness {
    /// The slot and publication of WAL scenarios (dropped before the database).
    slot: Option<crate::wal_relay::Slot>,
    _db: TestDb,
    direct: PgPool,
    engine: Engine,
    pools: Vec<PgPool>,
    topics: [String; 2],
}

impl Harness {
    /// A harness; with `wal`, with a slot and publication for WAL relays.
    async fn new(wal: bool) -> Harness {
        let db = fresh_postgres_db().await;
        sqlx::query("CREATE TABLE explorer_business (id bigserial PRIMARY KEY, note text)")
            .execute(&db.pool)
            .await
            .unwrap();
        // Commits need not wait for their WAL flush: visibility and locks are the same, and the
        // explorer runs hundreds of thousands of them.
        sqlx::query(&format!(
            "ALTER DATABASE {} SET synchronous_commit = off",
            db.name
        ))
        .execute(&db.pool)
        .await
        .unwrap();
        // A deadlock between writers (keys locked in opposite orders) is broken quickly, so
        // that the schedule goes on (a superuser's setting; else PostgreSQL's default).
        let superuser: bool =
            sqlx::query_scalar("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        let opts: PgConnectOptions = db.url.parse().unwrap();
        let gate = Gate::start(format!("{}:{}", opts.get_host(), opts.get_port())).await;
        let mut pools = Vec::new();
        for name in NAMES {
            let mut o = opts
                .clone()
                .host("127.0.0.1")
                .port(gate.port)
                .ssl_mode(PgSslMode::Disable)
                .application_name(name)
                // A statement held at the gate is not slow.
                .disable_statement_logging();
            if superuser {
                o = o.options([("deadlock_timeout", "100ms")]);
            }
            pools.push(
                PgPoolOptions::new()
                    .max_connections(1)
                    .min_connections(0)
                    .test_before_acquire(false)
                    .idle_timeout(None)
                    .max_lifetime(None)
                    .acquire_timeout(Duration::from_secs(120))
                    .connect_with(o)
                    .await
                    .unwrap(),
            );
        }
        // The test's own pool was opened before the setting: a pool of its own for the
        // explorer's direct statements.
        let direct = db.pool_of(4).await;
        let engine = Engine {
            gate,
            monitor: direct.clone(),
            names: NAMES.to_vec(),
            atomic: Vec::new(),
        };
        let slot = if wal {
            Some(crate::wal_relay::Slot::create(&db).await)
        } else {
            None
        };
        Harness {
            slot,
            _db: db,
            direct,
            engine,
            pools,
            topics: [unique("xa"), unique("xb")],
        }
    }

    /// Runs `scenario` as one schedule chosen by `chooser`, drains the outbox and checks.
    /// Returns the run and the violations found.
    async fn schedule(&self, scenario: &Scenario, chooser: &mut dyn Chooser) -> (Run, Log) {
        let direct = &self.direct;
        // A fresh state: an empty outbox, and r1 holding every partition (as its heartbeat
        // leaves them; a relay that takes over starts without a lease).
        let r1 = &scenario.relays[0];
        // The polling relays' partitions: the first polling relay's (a WAL r1 has none).
        let owner = scenario
            .relays
            .iter()
            .find(|r| !r.wal)
            .map_or(r1.id, |r| r.id);
        sqlx::raw_sql(&format!(
            "DELETE FROM postal.outbox;
             DELETE FROM explorer_business;
             DELETE FROM postal.relay_instances;
             INSERT INTO postal.relay_instances (relay_id) VALUES ('{0}');
             UPDATE postal.relay_partitions
                SET owner = '{0}', lease_until = now() + interval '1 hour', acquired_at = now();",
            owner
        ))
        .execute(direct)
        .await
        .unwrap();
        // WAL relays: the slot past everything before this schedule, its lease r1's.
        let mut r1_lease = None;
        let slot = self.slot_names();
        if let Some(names) = slot.as_ref().filter(|_| r1.wal) {
            sqlx::query(
                "WITH gone AS (DELETE FROM postal.wal_slot_leases RETURNING 1)
                 SELECT pg_replication_slot_advance($1, pg_current_wal_flush_lsn())",
            )
            .bind(&names.slot)
            .execute(direct)
            .await
            .unwrap();
            r1_lease = Some(
                postal_producer::testing::wal::take_lease(direct, &names.slot, r1.id, LEASE)
                    .await
                    .unwrap()
                    .expect("r1 takes the free slot lease"),
            );
        }
        let log: Shared = Default::default();
        let fails: Arc<HashMap<Uuid, Fail>> =
            Arc::new(scenario.events().map(|e| (e.id, e.fail)).collect());
        let mut tasks: Vec<(usize, BoxFuture<'static, ()>)> = Vec::new();
        for w in &scenario.writers {
            let (pool, w, log, topics) = (
                self.pools[w.session].clone(),
                w.clone(),
                log.clone(),
                self.topics.clone(),
            );
            tasks.push((w.session, writer(pool, w, topics, log).boxed()));
        }
        // A WAL relay's retries: at once, or within an hour when the scenario retries later.
        let later = scenario
            .events()
            .any(|e| matches!(e.fail, Fail::Transient { later: true, .. }));
        for r in &scenario.relays {
            if r.wal {
                let name = NAMES[r.session];
                let relay = wal::SimWal {
                    pool: self.pools[r.session].clone(),
                    id: r.id,
                    name,
                    slot: slot.clone().expect("a WAL scenario's harness has a slot"),
                    config: wal::config(scenario.delete_on_claim, later),
                    destination: wal::Destination {
                        name,
                        fails: fails.clone(),
                        log: log.clone(),
                        drain: false,
                    },
                    log: log.clone(),
                    lease: if r.takes_over { None } else { r1_lease.take() },
                    received: 0,
                    carried: Vec::new(),
                };
                tasks.push((r.session, relay.run(r.rounds, r.takes_over).boxed()));
                continue;
            }
            let relay = SimRelay {
                pool: self.pools[r.session].clone(),
                monitor: direct.clone(),
                id: r.id,
                name: NAMES[r.session],
                delete_on_claim: scenario.delete_on_claim,
                fails: fails.clone(),
                log: log.clone(),
            };
            let r = r.clone();
            tasks.push((
                r.session,
                async move {
                    relay.run(r.rounds, r.takes_over).await;
                }
                .boxed(),
            ));
        }
        if scenario.requeue {
            let (pool, log) = (self.pools[OPS].clone(), log.clone());
            tasks.push((OPS, requeue(pool, log).boxed()));
        }
        if scenario.expire_r1 && r1.wal {
            let (pool, id) = (self.pools[CLOCK].clone(), r1.id);
            tasks.push((
                CLOCK,
                async move {
                    sqlx::query(
                        "UPDATE postal.wal_slot_leases SET lease_until = now() - interval '1 hour'
                         WHERE holder = $1",
                    )
                    .bind(id)
                    .execute(&pool)
                    .await
                    .unwrap();
                }
                .boxed(),
            ));
        } else if scenario.expire_r1 {
            let (pool, id) = (self.pools[CLOCK].clone(), r1.id);
            tasks.push((
                CLOCK,
                async move {
                    sqlx::query(
                        "WITH l AS (UPDATE postal.relay_partitions
                                    SET lease_until = now() - interval '1 hour'
                                    WHERE owner = $1 RETURNING 1)
                         UPDATE postal.relay_instances
                         SET heartbeat_at = now() - interval '1 day' WHERE relay_id = $1",
                    )
                    .bind(id)
                    .execute(&pool)
                    .await
                    .unwrap();
                }
                .boxed(),
            ));
        }
        let run = self.engine.run(tasks, chooser).await;
        self.drain(scenario, &fails, &log).await;
        let mut log = Arc::try_unwrap(log)
            .map(|m| m.into_inner().unwrap())
            .unwrap_or_else(|a| std::mem::take(&mut *a.lock().unwrap()));
        check(&mut log);
        (run, log)
    }

    /// Publishes everything left: a fresh relay takes every partition, the clock moves on a
    /// day, parked events are requeued, and claims run until the outbox is empty.
    /// The slot's names, on a harness with a slot.
    fn slot_names(&self) -> Option<wal::SlotNames> {
        self.slot.as_ref().map(|s| wal::SlotNames {
            slot: s.source.slot.clone(),
            publication: s.source.publication.clone(),
        })
    }

    async fn drain(&self, scenario: &Scenario, fails: &Arc<HashMap<Uuid, Fail>>, log: &Shared) {
        let delete_on_claim = scenario.delete_on_claim;
        let direct = &self.direct;
        let id = Uuid::now_v7();
        sqlx::raw_sql(&format!(
            "DELETE FROM postal.relay_instances;
             INSERT INTO postal.relay_instances (relay_id) VALUES ('{0}');
             UPDATE postal.relay_partitions
                SET owner = '{0}', lease_until = now() + interval '1 hour', acquired_at = now();",
            id
        ))
        .execute(direct)
        .await
        .unwrap();
        let relay = SimRelay {
            pool: direct.clone(),
            monitor: direct.clone(),
            id,
            name: "drain",
            delete_on_claim,
            fails: fails.clone(),
            log: log.clone(),
        };
        // After a WAL schedule, a WAL relay reads what is left in the slot, beside the
        // polling drain (as a WAL relay's sweep runs beside its stream).
        let mut wal_drain = match self.slot_names() {
            Some(slot) if scenario.relays.iter().any(|r| r.wal) => {
                sqlx::query(
                    "UPDATE postal.wal_slot_leases SET lease_until = now() - interval '1 hour'",
                )
                .execute(direct)
                .await
                .unwrap();
                let lease =
                    postal_producer::testing::wal::take_lease(direct, &slot.slot, id, LEASE)
                        .await
                        .unwrap()
                        .expect("the drain takes the slot's lease");
                Some(wal::SimWal {
                    pool: direct.clone(),
                    id,
                    name: "drain",
                    slot,
                    config: wal::config(delete_on_claim, false),
                    destination: wal::Destination {
                        name: "drain",
                        fails: fails.clone(),
                        log: log.clone(),
                        drain: true,
                    },
                    log: log.clone(),
                    lease: Some(lease),
                    received: 0,
                    carried: Vec::new(),
                })
            }
            _ => None,
        };
        for _ in 0..20 {
            // The clock moves on two days (what waits for a time is due), and what is left
            // is counted (the update's snapshot is the count's).
            let (pending, parked): (i64, Option<Vec<i64>>) = sqlx::query_as(
                "WITH later AS (UPDATE postal.outbox
                                SET available_at = available_at - interval '2 days'
                                WHERE status = 'pending' AND available_at > now()
                                RETURNING 1)
                 SELECT count(*) FILTER (WHERE status = 'pending'),
                        array_agg(seq ORDER BY seq) FILTER (WHERE status = 'failed')
                 FROM postal.outbox WHERE status IN ('pending', 'failed')",
            )
            .fetch_one(direct)
            .await
            .unwrap();
            let parked = parked.unwrap_or_default();
            if pending == 0 && parked.is_empty() {
                return;
            }
            if !parked.is_empty() {
                postal_admin::parked::requeue_seqs(
                    direct,
                    &postal_admin::audit::Operator::cli("test"),
                    &serde_json::Value::Null,
                    &parked,
                    |_| {},
                )
                .await
                .unwrap();
            }
            if let Some(w) = &mut wal_drain {
                w.round(true).await;
            }
            relay.round(true).await;
        }
        let left: Vec<(i64, String, String, bool)> = sqlx::query_as(
            "SELECT seq, event_key, status, held FROM postal.outbox
             WHERE status IN ('pending', 'failed') ORDER BY seq",
        )
        .fetch_all(direct)
        .await
        .unwrap();
        log.lock()
            .unwrap()
            .violations
            .push(format!("stuck: the drain could not publish {left:?}"));
    }
}

// ---------------------------------------------------------------------------------------
// The sessions

fn new_event(e: &Ev, topics: &[String; 2]) -> NewEvent {
    let mut n = NewEvent::json(
        topics[e.topic].as_str(),
        e.key,
        "e",
        &serde_json::json!({ "id": e.id }),
    )
    .unwrap()
    .with_id(EventId::from_uuid(e.id).unwrap());
    if let Some(at) = deliver_at(e.deliver) {
        n = n.deliver_at(at);
    }
    n
}

fn deliver_at(d: Deliver) -> Option<chrono::DateTime<Utc>> {
    match d {
        Deliver::Now => None,
        Deliver::JustNow => Some(Utc::now()),
        Deliver::Past => Some(Utc::now() - chrono::Duration::hours(1)),
        Deliver::Later => Some(Utc::now() + chrono::Duration::hours(1)),
    }
}

/// A writer's transaction. Its events count as committed once `COMMIT` returned.
async fn writer(pool: PgPool, w: Writer, topics: [String; 2], log: Shared) {
    let name = NAMES[w.session];
    let mut tx = pool.begin().await.unwrap();
    let mut written: Vec<&Ev> = Vec::new();
    let result: Result<(), String> = async {
        for x in &w.before {
            extra(&mut tx, *x).await?;
        }
        for op in &w.ops {
            match op {
                Op::Rust(e) => {
                    enqueue(&mut tx, new_event(e, &topics))
                        .await
                        .map_err(|e| e.to_string())?;
                    written.push(e);
                }
                Op::Batch(es) => {
                    enqueue_batch(&mut tx, es.iter().map(|e| new_event(e, &topics)).collect())
                        .await
                        .map_err(|e| e.to_string())?;
                    written.extend(es);
                }
                Op::Sql(e) => {
                    sqlx::query(
                        "SELECT postal.enqueue($1, $2, 'e', $3::jsonb, '{}'::jsonb, 1, $4::uuid,
                                               $5::timestamptz)",
                    )
                    .bind(&topics[e.topic])
                    .bind(e.key)
                    .bind(serde_json::json!({ "id": e.id }))
                    .bind(e.id)
                    .bind(deliver_at(e.deliver))
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| e.to_string())?;
                    written.push(e);
                }
                Op::Undone(e) => {
                    sqlx::query("SAVEPOINT undone")
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                    enqueue(&mut tx, new_event(e, &topics))
                        .await
                        .map_err(|e| e.to_string())?;
                    sqlx::query("ROLLBACK TO SAVEPOINT undone")
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        for x in &w.after {
            extra(&mut tx, *x).await?;
        }
        Ok(())
    }
    .await;
    match result {
        Ok(()) if w.commit => match tx.commit().await {
            Ok(()) => {
                let mut l = log.lock().unwrap();
                for e in written {
                    l.committed
                        .push((e.id, topics[e.topic].clone(), e.key.to_owned()));
                }
            }
            Err(e) => note(
                &log,
                "writer: commit failed",
                format!("{name}: COMMIT failed: {e}"),
            ),
        },
        Ok(()) => {
            log.lock().unwrap().saw("writer: rolled back");
            tx.rollback().await.unwrap()
        }
        Err(e) => {
            // A deadlock with another writer (keys locked in opposite orders): rolled back.
            note(
                &log,
                "writer: rolled back after an error",
                format!("{name}: rolled back after {e}"),
            );
            tx.rollback().await.unwrap();
        }
    }
}

async fn extra(tx: &mut sqlx::PgConnection, x: Extra) -> Result<(), String> {
    match x {
        Extra::Sleep => sqlx::query("SELECT pg_sleep(0)").execute(&mut *tx).await,
        Extra::Business => {
            sqlx::query("INSERT INTO explorer_business (note) VALUES ('order')")
                .execute(&mut *tx)
                .await
        }
    }
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// The operator: twice, requeues whatever is parked (as `postal failed requeue` does).
async fn requeue(pool: PgPool, log: Shared) {
    for _ in 0..2 {
        let parked: Vec<i64> = sqlx::query_scalar(
            "SELECT seq FROM postal.outbox WHERE status = 'failed' ORDER BY seq",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let n = postal_admin::parked::requeue_seqs(
            &pool,
            &postal_admin::audit::Operator::cli("test"),
            &serde_json::Value::Null,
            &parked,
            |_| {},
        )
        .await
        .unwrap();
        if n > 0 {
            note(
                &log,
                "ops: requeued parked events",
                format!("ops: requeued {n}"),
            );
        }
    }
}

/// A relay played by hand: Postal's claim and completion, and a simulated destination.
struct SimRelay {
    pool: PgPool,
    monitor: PgPool,
    id: Uuid,
    name: &'static str,
    delete_on_claim: bool,
    fails: Arc<HashMap<Uuid, Fail>>,
    log: Shared,
}

impl SimRelay {
    async fn run(&self, rounds: u32, takes_over: bool) {
        if takes_over {
            // The first heartbeat finds r1's claim (if one is open) holding the partitions
            // and terminates it; the second takes them.
            let mut held = Vec::new();
            for _ in 0..2 {
                match lease::heartbeat(
                    &self.pool,
                    lease::DEFAULT_GROUP,
                    self.id,
                    "",
                    LEASE,
                    &held,
                    true,
                )
                .await
                {
                    Ok(l) => held = l.held,
                    Err(e) => note(
                        &self.log,
                        "relay: heartbeat failed",
                        format!("{}: heartbeat failed: {e}", self.name),
                    ),
                }
            }
            note(
                &self.log,
                if held.is_empty() {
                    "relay: takeover found the partitions leased"
                } else {
                    "relay: took the partitions over"
                },
                format!("{}: holds {} partitions", self.name, held.len()),
            );
        }
        for _ in 0..rounds {
            self.round(false).await;
        }
    }

    /// One claim, its publication and its completion.
    async fn round(&self, drain: bool) {
        let claimed = claim::claim(
            &self.pool,
            self.id,
            &claim::all_partitions(),
            100,
            LEASE,
            self.delete_on_claim,
            &TopicFilter::All,
        )
        .await;
        let mut c = match claimed {
            Ok(Some(c)) => c,
            Ok(None) => {
                if !drain {
                    self.log.lock().unwrap().saw("relay: claim found nothing");
                }
                return;
            }
            Err(e) => {
                note(
                    &self.log,
                    "relay: claim failed",
                    format!("{}: claim failed: {e}", self.name),
                );
                return;
            }
        };
        let batch = c.take_events();
        let (published, failures) = self.send(&batch, drain);
        match c.complete(&batch, &published, &failures).await {
            Ok(()) => {
                // The claim committed: the relay must still own the partitions of its rows
                // (nothing else runs until this session's next statement).
                let keys: Vec<&str> = batch.iter().map(|e| e.key.as_str()).collect();
                let owned: bool = sqlx::query_scalar(
                    "SELECT coalesce(bool_and(owner IS NOT DISTINCT FROM $1), true)
                     FROM postal.relay_partitions
                     WHERE relay_group = 'default'
                       AND key_partition IN (SELECT (hashtext(k) & 255)::int2
                                             FROM unnest($2::text[]) AS k)",
                )
                .bind(self.id)
                .bind(&keys)
                .fetch_one(&self.monitor)
                .await
                .unwrap();
                if !owned {
                    self.log.lock().unwrap().violations.push(format!(
                        "{} completed a claim of seqs {:?} after it lost the lease of their partitions",
                        self.name,
                        batch.iter().map(|e| e.seq).collect::<Vec<_>>()
                    ));
                }
            }
            Err(postal_producer::Error::LeaseLost { partitions }) => note(
                &self.log,
                "relay: complete refused, lease lost",
                format!(
                    "{}: lease lost ({} partitions)",
                    self.name,
                    partitions.len()
                ),
            ),
            Err(e) => note(
                &self.log,
                "relay: complete failed (connection ended)",
                format!("{}: complete failed: {e}", self.name),
            ),
        }
    }

    /// The destination: accepts or fails each event (as the scenario says), and holds back
    /// the later events of a key (topic and key) after one of its events failed, as a
    /// transport must; the failures become the relay's row changes as its verdict makes them.
    fn send(&self, batch: &[OutboundEvent], drain: bool) -> (Vec<i64>, Vec<Failure>) {
        let mut log = self.log.lock().unwrap();
        let mut published = Vec::new();
        let mut failures = Vec::new();
        let mut blocked: HashSet<(&str, &str)> = HashSet::new();
        for e in batch {
            let scope = (e.topic.as_str(), e.key.as_str());
            let id = e.id.as_uuid();
            let failure = |counts: bool, park: bool, hold: bool, retry_in: Duration| Failure {
                seq: e.seq,
                counts,
                park,
                hold,
                retry_in,
                reason: Some("explorer".into()),
            };
            if blocked.contains(&scope) {
                // `FailureKind::HeldBack` behind an earlier failure of its key.
                log.saw("destination: held back behind its key's failure");
                failures.push(Failure {
                    reason: None,
                    ..failure(false, false, false, Duration::ZERO)
                });
                continue;
            }
            let before = log.failed.get(&id).copied().unwrap_or(0);
            let fail = if drain {
                None
            } else {
                match self.fails.get(&id).copied().unwrap_or(Fail::None) {
                    Fail::Transient { times, later } if before < times => {
                        let park = e.attempts + 1 >= MAX_ATTEMPTS;
                        let retry = if park || !later {
                            Duration::ZERO
                        } else {
                            Duration::from_secs(3600)
                        };
                        Some(failure(true, park, true, retry))
                    }
                    Fail::Permanent if before < 1 => {
                        Some(failure(true, true, true, Duration::ZERO))
                    }
                    Fail::Fenced { times } if before < times => Some(Failure {
                        reason: None,
                        ..failure(false, false, false, Duration::ZERO)
                    }),
                    _ => None,
                }
            };
            match fail {
                Some(f) => {
                    log.saw(match (f.park, f.hold) {
                        (true, _) => "destination: failed, parked",
                        (false, true) => "destination: failed, retried later",
                        (false, false) => "destination: key fence (held back first)",
                    });
                    *log.failed.entry(id).or_default() += 1;
                    blocked.insert(scope);
                    failures.push(f);
                }
                None => {
                    if !drain {
                        log.saw(if self.name == "r2" {
                            "r2 published (by claim)"
                        } else {
                            "r1 published"
                        });
                    }
                    published.push(e.seq);
                    log.published.push(Published {
                        seq: e.seq,
                        id,
                        topic: e.topic.clone(),
                        key: e.key.clone(),
                        by: self.name,
                    });
                }
            }
        }
        (published, failures)
    }
}

// ---------------------------------------------------------------------------------------
// The checks

/// Nothing lost, nothing uncommitted published, each key's first publications in sequence
/// order.
fn check(log: &mut Log) {
    let published: HashSet<Uuid> = log.published.iter().map(|p| p.id).collect();
    let committed: HashSet<Uuid> = log.committed.iter().map(|c| c.0).collect();
    for (id, topic, key) in &log.committed {
        if !published.contains(id) {
            log.violations.push(format!(
                "lost: committed event {id} ({topic}/{key}) was never published"
            ));
        }
    }
    for p in &log.published {
        if !committed.contains(&p.id) {
            log.violations.push(format!(
                "published an event that was never committed: seq {} ({}/{})",
                p.seq, p.topic, p.key
            ));
        }
    }
    let mut seen: HashSet<Uuid> = HashSet::new();
    let mut last: HashMap<(&str, &str), (i64, &str)> = HashMap::new();
    let mut broken = Vec::new();
    for p in &log.published {
        if !seen.insert(p.id) {
            continue;
        }
        let scope = (p.topic.as_str(), p.key.as_str());
        if let Some((before, by)) = last.get(&scope) {
            if *before > p.seq {
                broken.push(format!(
                    "order: key {}/{}: seq {} (by {}) was first published before seq {} (by {})",
                    p.topic, p.key, before, by, p.seq, p.by
                ));
            }
        }
        last.insert(scope, (p.seq, p.by));
    }
    log.violations.extend(broken);
}

fn report(scenario: &Scenario, run: &Run, log: &Log) -> String {
    let published: Vec<String> = log
        .published
        .iter()
        .map(|p| {
            format!(
                "{}:{}/{}#{}",
                p.by,
                if p.topic.starts_with("xa") { "A" } else { "B" },
                p.key,
                p.seq
            )
        })
        .collect();
    format!(
        "violations:\n    {}\n  scenario:{}\n  schedule ({} steps):\n{}\n  published: {}\n  notes: {:?}",
        log.violations.join("\n    "),
        scenario.describe(),
        run.steps.len(),
        run.describe(&NAMES),
        published.join(" "),
        log.notes
    )
}

// ---------------------------------------------------------------------------------------
// Enumeration

/// Replays a prefix of choices, then continues without preempting: the session that ran the
/// previous step again if it can, else the first that can.
struct PrefixChooser {
    prefix: Vec<usize>,
    at: usize,
}

/// The options of a choice point in the order the enumeration tries them: the previous
/// step's session first (no preemption), then the others in session order.
fn canonical(options: &[usize], last: Option<usize>) -> Vec<usize> {
    let mut o: Vec<usize> = Vec::with_capacity(options.len());
    if let Some(l) = last.filter(|l| options.contains(l)) {
        o.push(l);
    }
    o.extend(options.iter().copied().filter(|s| Some(*s) != last));
    o
}

impl Chooser for PrefixChooser {
    fn choose(&mut self, options: &[usize], last: Option<usize>) -> usize {
        let i = self.at;
        self.at += 1;
        match self.prefix.get(i) {
            Some(s) if options.contains(s) => *s,
            _ => canonical(options, last)[0],
        }
    }
}

/// The next schedule of a depth-first enumeration of every schedule with at most `bound`
/// preemptions, after the one that made `choices`: the deepest choice point with an option
/// not tried yet, within the bound.
fn next_prefix(choices: &[ChoicePoint], bound: u32) -> Option<Vec<usize>> {
    for i in (0..choices.len()).rev() {
        let c = &choices[i];
        let before = choices[..i].iter().filter(|c| c.preempted).count() as u32;
        let last = i.checked_sub(1).map(|j| choices[j].chosen);
        let order = canonical(&c.options, last);
        let at = order.iter().position(|s| *s == c.chosen)?;
        for alt in &order[at + 1..] {
            let preempts = last.is_some_and(|l| l != *alt && c.options.contains(&l));
            if before + u32::from(preempts) <= bound {
                let mut p: Vec<usize> = choices[..i].iter().map(|c| c.chosen).collect();
                p.push(*alt);
                return Some(p);
            }
        }
    }
    None
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Enumerates every schedule of `scenario` with at most `POSTAL_EXPLORER_BOUND` (else
/// `default_bound`) preemptions, depth first; panics with the choice sequence of the first
/// that breaks a guarantee. `POSTAL_EXPLORER_REPLAY` runs only the schedule it names.
async fn enumerate(test: &str, scenario: Scenario, default_bound: u32, atomic: Vec<&'static str>) {
    let mut h = Harness::new(scenario.relays.iter().any(|r| r.wal)).await;
    h.engine.atomic = atomic;
    let bound = env_u64("POSTAL_EXPLORER_BOUND").map_or(default_bound, |b| b as u32);
    let replay: Option<Vec<usize>> = std::env::var("POSTAL_EXPLORER_REPLAY").ok().map(|r| {
        r.split(',')
            .map(|n| {
                NAMES
                    .iter()
                    .position(|x| *x == n.trim())
                    .expect("a session name")
            })
            .collect()
    });
    let started = Instant::now();
    let mut prefix = replay.clone().unwrap_or_default();
    let mut count = 0u64;
    let mut seen: std::collections::BTreeMap<&'static str, u64> = Default::default();
    loop {
        count += 1;
        let mut chooser = PrefixChooser {
            prefix: prefix.clone(),
            at: 0,
        };
        let (run, log) = h.schedule(&scenario, &mut chooser).await;
        for (k, v) in &log.seen {
            *seen.entry(k).or_default() += v;
        }
        if !log.violations.is_empty() {
            panic!(
                "schedule {count} of the enumeration (preemption bound {bound}) broke a guarantee after {:.1} s\n  \
                 replay: POSTAL_EXPLORER_REPLAY={} cargo test -p postal-integration-tests --test suite -- {test} --exact\n  {}",
                started.elapsed().as_secs_f64(),
                run.choice_string(&NAMES),
                report(&scenario, &run, &log)
            );
        }
        if replay.is_some() {
            break;
        }
        if count.is_multiple_of(500) {
            eprintln!(
                "{test}: {count} schedules, {:.1}/s",
                count as f64 / started.elapsed().as_secs_f64()
            );
        }
        match next_prefix(&run.choices, bound) {
            Some(p) => prefix = p,
            None => break,
        }
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "{test}: {count} schedules (preemption bound {bound}) in {secs:.1} s, {:.1} schedules/s\n  seen: {seen:?}",
        count as f64 / secs
    );
}

/// Guarantee: for the review's scenario — two writers that enqueue one event each for the
/// same key, in transactions that may overlap, and a relay that claims (the drain claims what
/// is left) — every schedule with at most two preemptions publishes both events, the key's
/// first publications in sequence order, whatever the order of the writers' and the claim's
/// `BEGIN`s, enqueues, commits and claim statements. (Before the fix, schedule 101 of this
/// enumeration broke the order.)
#[tokio::test]
async fn enumeration() {
    let rounds = env_u64("POSTAL_EXPLORER_ROUNDS").unwrap_or(1) as u32;
    enumerate(
        "explorer::enumeration",
        review_scenario(rounds),
        2,
        Vec::new(),
    )
    .await;
}

/// Guarantee: when a relay's lease runs out while its claim is open and a second relay takes
/// its partitions over (terminating that claim), every schedule with at most one preemption
/// publishes every event, the key's first publications in sequence order (a failed publish
/// holding the key across the takeover), and no claim completes for the relay that lost the
/// partitions.
#[tokio::test]
async fn enumeration_takeover() {
    // A heartbeat's statements after its `BEGIN` run as one step, and so do the writer's
    // enqueue and commit: where they fall against the claims and the clock is what matters
    // here (the writers' own races are `enumeration`'s).
    enumerate(
        "explorer::enumeration_takeover",
        takeover_scenario(),
        1,
        vec!["INSERT INTO postal.relay_instances", "WITH key_locks"],
    )
    .await;
}

/// Totals of a random exploration.
#[derive(Default)]
struct Totals {
    schedules: u64,
    steps: u64,
    settling: Duration,
    deadlocks: u64,
    seen: std::collections::BTreeMap<&'static str, u64>,
    /// Seeds of schedules that broke a guarantee (`POSTAL_EXPLORER_KEEP_GOING`), with the
    /// first violation and the schedule's report.
    failed: Vec<(u64, u64, String, String)>,
}

/// Runs `POSTAL_EXPLORER_SCHEDULES` (else `default_schedules`) seeded random schedules of
/// random scenarios, schedule `i` with seed `POSTAL_EXPLORER_SEED + i`, on
/// `POSTAL_EXPLORER_PARALLEL` (default 1) databases at once. Panics with the seed of the first
/// schedule that breaks a guarantee; with `POSTAL_EXPLORER_KEEP_GOING` set, runs them all and
/// reports every failing seed.
async fn random_schedules(test: &'static str, default_schedules: u64, wal: bool) {
    let schedules = env_u64("POSTAL_EXPLORER_SCHEDULES").unwrap_or(default_schedules);
    let first = env_u64("POSTAL_EXPLORER_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 % 1_000_000_000_000)
            .unwrap_or(1)
    });
    let parallel = env_u64("POSTAL_EXPLORER_PARALLEL").unwrap_or(1).max(1);
    let keep_going = std::env::var_os("POSTAL_EXPLORER_KEEP_GOING").is_some();
    let started = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let totals: Arc<Mutex<Totals>> = Default::default();
    let workers = (0..parallel).map(|_| {
        let (next, totals) = (next.clone(), totals.clone());
        async move {
            let h = Harness::new(wal).await;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= schedules {
                    break;
                }
                let seed = first.wrapping_add(i);
                let mut rng = Rng::new(seed);
                let scenario = if wal {
                    random_wal_scenario(&mut rng)
                } else {
                    random_scenario(&mut rng)
                };
                let mut chooser = RandomChooser::new(seed.rotate_left(17), NAMES.len());
                let (run, log) = h.schedule(&scenario, &mut chooser).await;
                let mut t = totals.lock().unwrap();
                t.schedules += 1;
                t.steps += run.steps.len() as u64;
                t.settling += run.settling;
                t.deadlocks += u64::from(run.deadlock_waits > 0);
                for (k, v) in &log.seen {
                    *t.seen.entry(k).or_default() += v;
                }
                if !log.violations.is_empty() {
                    let report = format!(
                        "schedule {} (seed {seed}) broke a guarantee after {:.1} s\n  \
                         replay: POSTAL_EXPLORER_SEED={seed} POSTAL_EXPLORER_SCHEDULES=1 cargo test -p postal-integration-tests --test suite -- {test} --exact\n  {}",
                        i + 1,
                        started.elapsed().as_secs_f64(),
                        report(&scenario, &run, &log)
                    );
                    if !keep_going {
                        panic!("{report}");
                    }
                    eprintln!("explorer: seed {seed}: {}", log.violations[0]);
                    t.failed
                        .push((i + 1, seed, log.violations[0].clone(), report));
                }
                if t.schedules.is_multiple_of(1000) {
                    eprintln!(
                        "explorer: {} schedules, {:.1}/s",
                        t.schedules,
                        t.schedules as f64 / started.elapsed().as_secs_f64()
                    );
                }
            }
        }
    });
    futures::future::join_all(workers).await;
    let secs = started.elapsed().as_secs_f64();
    let t = totals.lock().unwrap();
    eprintln!(
        "{test}: {} schedules from seed {first} on {parallel} database(s) in {secs:.1} s ({:.1} schedules/s, {:.1} steps each, {:.1} s waiting for settled states per database, {} with a deadlock between writers)\n  seen: {:?}",
        t.schedules,
        t.schedules as f64 / secs,
        t.steps as f64 / t.schedules.max(1) as f64,
        t.settling.as_secs_f64() / parallel as f64,
        t.deadlocks,
        t.seen
    );
    if let Some((i, seed, _, report)) = t.failed.iter().min_by_key(|f| f.0) {
        panic!(
            "{} of {} schedules broke a guarantee (seeds {:?}); the first, schedule {i} (seed {seed}):\n{report}",
            t.failed.len(),
            t.schedules,
            t.failed.iter().map(|f| f.1).collect::<Vec<_>>()
        );
    }
}

/// Guarantee: under seeded random schedules of random small scenarios — 2–3 writers with
/// `enqueue`, `enqueue_batch`, `postal.enqueue` and rolled-back savepoints in transactions
/// with other statements before and after, some rolled back; scheduled events; one relay, or
/// two with a lease that runs out and a takeover; failed publishes that hold their key, the
/// transport's key fence, parking and an operator's requeue; delete-on-claim and
/// keep-published claims — nothing committed is lost, nothing uncommitted is published, each
/// key's (topic and key) first publications come in sequence order, and no claim completes
/// for a relay that lost its partitions. (`POSTAL_EXPLORER_SCHEDULES`, default 150.)
#[tokio::test]
async fn random() {
    random_schedules("explorer::random", 150, false).await;
}

/// Guarantee: as `random`, over 100,000 schedules (the long run; `--ignored`).
#[tokio::test]
#[ignore = "long run: 100,000 schedules (POSTAL_EXPLORER_SCHEDULES)"]
async fn long_random() {
    random_schedules("explorer::long_random", 100_000, false).await;
}

/// Guarantee (issue 50, the WAL relay): for the review's scenario with r1 a WAL relay — two
/// writers that enqueue one event each for the same key, in transactions that may overlap,
/// and a relay that reads the slot's committed transactions and publishes them with the WAL
/// relay's row take, lock and marks (the drain reads and claims what is left) — every
/// schedule with at most two preemptions publishes both events, the key's first publications
/// in sequence order, whatever the order of the writers' statements and the relay's slot
/// reads, takes, marks and confirmations.
#[tokio::test]
async fn enumeration_wal() {
    let rounds = env_u64("POSTAL_EXPLORER_ROUNDS").unwrap_or(1) as u32;
    enumerate(
        "explorer::enumeration_wal",
        on_the_slot(review_scenario(rounds)),
        2,
        Vec::new(),
    )
    .await;
}

/// Guarantee (issue 50): when a WAL relay's slot lease runs out while it publishes (its
/// second event failing once and written back) and a second WAL relay takes the slot over
/// and reads it from the confirmed position, every schedule with at most one preemption
/// publishes every event, the key's first publications in sequence order, whether the first
/// relay's marks commit before the takeover or are refused after it.
#[tokio::test]
async fn enumeration_wal_takeover() {
    enumerate(
        "explorer::enumeration_wal_takeover",
        on_the_slot(takeover_scenario()),
        1,
        vec!["WITH key_locks"],
    )
    .await;
}

/// Guarantee (issue 50): as `random`, with r1 a WAL relay, and r2 a WAL relay that takes the
/// slot over when r1's lease runs out, or else (half the time) a polling relay claiming
/// beside it: nothing committed is lost, nothing uncommitted is published, and each key's
/// first publications come in sequence order, across the stream, the polling claims and the
/// takeover. (`POSTAL_EXPLORER_SCHEDULES`, default 150.)
#[tokio::test]
async fn random_wal() {
    random_schedules("explorer::random_wal", 150, true).await;
}

/// Guarantee: as `random_wal`, over 100,000 schedules (the long run; `--ignored`).
#[tokio::test]
#[ignore = "long run: 100,000 schedules (POSTAL_EXPLORER_SCHEDULES)"]
async fn long_random_wal() {
    random_schedules("explorer::long_random_wal", 100_000, true).await;
}

/// Guarantee (issue 50): with a WAL relay and a polling relay on one key — the first event
/// failing once under the polling relay's claim, which writes it back (the slot gives it
/// again), the WAL relay reading the slot twice — every schedule with at most one preemption
/// publishes both events, the key's first publications in sequence order.
#[tokio::test]
async fn enumeration_mixed() {
    enumerate(
        "explorer::enumeration_mixed",
        mixed_scenario(),
        env_u64("POSTAL_EXPLORER_BOUND").map_or(1, |b| b as u32),
        Vec::new(),
    )
    .await;
}
