//! The schedule explorer's engine: runs one schedule of a scenario's sessions, releasing one
//! statement at a time through the [`Gate`] in the order a [`Chooser`] picks.
//!
//! Before every choice the engine waits until the system is *settled*: every session's task
//! has either sent its next statement (held at the gate), or finished, or has a statement at
//! the server that is blocked on a lock held by another session of the scenario (PostgreSQL's
//! `pg_blocking_pids`, read on a direct connection); no statement is executing, no task is
//! between two statements, and no backend that the fence told to terminate is still
//! connected. The choosable sessions are those with a statement held at the gate and none at
//! the server. A schedule ends when no session can be chosen and none is blocked; when every
//! unfinished session is blocked, the engine waits for PostgreSQL's deadlock detector to
//! break the cycle (bounded: a hang is a failure that names the sessions).

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use sqlx::PgPool;

use super::gate::{Gate, View};

/// A deterministic pseudo-random source (SplitMix64): seeds replay on any `rand` version.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5851_F42D_4C95_7F2D)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `true` with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next_u64() % den < num
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Picks the next session among the choosable ones (indices into the scenario's sessions, in
/// increasing order). `last` is the session that ran the previous step.
pub trait Chooser {
    fn choose(&mut self, options: &[usize], last: Option<usize>) -> usize;
}

/// Random choices from a seed, in one of two ways (the seed picks): uniformly among the
/// choosable sessions, or by priorities (PCT, Burckhardt et al. 2010): each session gets a
/// random priority, the choosable session with the highest runs, and at a few random steps the
/// session that just ran drops to the lowest priority. Uniform choices interleave finely;
/// priorities run sessions in long stretches with a few well-placed switches, which is what
/// an order that needs a session to stop at one precise point and the others to run to their
/// end (the review's schedule) needs.
pub struct RandomChooser {
    rng: Rng,
    /// `None`: uniform.
    priorities: Option<Vec<u64>>,
    /// Steps after which the session that ran drops to the lowest priority.
    changes: Vec<usize>,
    step: usize,
}

impl RandomChooser {
    pub fn new(seed: u64, sessions: usize) -> RandomChooser {
        let mut rng = Rng::new(seed);
        let (priorities, changes) = if rng.chance(1, 2) {
            (None, Vec::new())
        } else {
            let p = (0..sessions).map(|_| rng.next_u64() >> 1).collect();
            let c = (0..1 + rng.below(3)).map(|_| rng.below(40)).collect();
            (Some(p), c)
        };
        RandomChooser {
            rng,
            priorities,
            changes,
            step: 0,
        }
    }
}

impl Chooser for RandomChooser {
    fn choose(&mut self, options: &[usize], last: Option<usize>) -> usize {
        let step = self.step;
        self.step += 1;
        let Some(p) = self.priorities.as_mut() else {
            return *self.rng.pick(options);
        };
        if let Some(l) = last.filter(|_| self.changes.contains(&(step.wrapping_sub(1)))) {
            let lowest = p.iter().copied().min().unwrap_or(0);
            p[l] = lowest.saturating_sub(1);
        }
        *options.iter().max_by_key(|s| p[**s]).expect("an option")
    }
}

/// One choice point of a schedule: what could run, and what ran.
#[derive(Clone, Debug)]
pub struct ChoicePoint {
    pub options: Vec<usize>,
    pub chosen: usize,
    /// The session of the previous step was still choosable and another one was chosen.
    pub preempted: bool,
}

/// A step that ran: its session and statement.
#[derive(Clone, Debug)]
pub struct Step {
    pub session: usize,
    pub label: String,
}

/// What one schedule did.
#[derive(Debug, Default)]
pub struct Run {
    pub choices: Vec<ChoicePoint>,
    pub steps: Vec<Step>,
    /// Times the engine waited for PostgreSQL to break a deadlock among the sessions.
    pub deadlock_waits: u32,
    /// Time spent waiting for settled states.
    pub settling: Duration,
}

impl Run {
    /// The sequence of sessions chosen, by name: the schedule in a form that can be read and
    /// replayed (`POSTAL_EXPLORER_REPLAY`).
    pub fn choice_string(&self, names: &[&str]) -> String {
        self.choices
            .iter()
            .map(|c| names[c.chosen])
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The steps, one per line, for a failure report.
    pub fn describe(&self, names: &[&str]) -> String {
        self.steps
            .iter()
            .enumerate()
            .map(|(i, s)| format!("    {i:>3} {:<6} {}", names[s.session], s.label))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The engine: the gate, a direct connection for `pg_blocking_pids`, the sessions' names.
pub struct Engine {
    pub gate: Gate,
    pub monitor: PgPool,
    pub names: Vec<&'static str>,
    /// Statements (label prefixes) that open an atomic block: once a session ran one, it
    /// alone runs until its `COMMIT` or `ROLLBACK` (unless it waits for a lock). Coarser steps
    /// for an enumeration, where the statements inside the block do not race with anything
    /// of interest.
    pub atomic: Vec<&'static str>,
}

/// The settled state before a choice.
struct Settled {
    /// Sessions with a statement held at the gate, and the connection that holds it.
    choosable: Vec<(usize, u64)>,
    /// Sessions with a statement blocked on a lock.
    blocked: Vec<usize>,
}

/// How long a settled state may take to come (a statement that runs that long is a hang).
const SETTLE_LIMIT: Duration = Duration::from_secs(60);

impl Engine {
    fn session_of(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| *n == name)
    }

    /// Runs `tasks` (one per session, by index) as one schedule chosen by `chooser`.
    pub async fn run(
        &self,
        tasks: Vec<(usize, BoxFuture<'static, ()>)>,
        chooser: &mut dyn Chooser,
    ) -> Run {
        let mut handles = Vec::new();
        for (s, task) in tasks {
            let name = self.names[s];
            self.gate.set_running(name, true);
            // Marks the session finished however the task ends (a panic is re-raised below).
            let done = Finished(self.gate.clone(), name);
            handles.push(tokio::spawn(async move {
                let _done = done;
                task.await
            }));
        }
        let mut run = Run::default();
        let mut last: Option<usize> = None;
        let mut blocked_since: Option<Instant> = None;
        // The session inside an atomic block, if any.
        let mut inside: Option<usize> = None;
        loop {
            let t = Instant::now();
            let settled = self.settle().await;
            run.settling += t.elapsed();
            // A step whose statement waits for a lock says so in the trace.
            if let Some(step) = run.steps.last_mut() {
                if settled.blocked.contains(&step.session) && !step.label.starts_with('[') {
                    step.label.insert_str(0, "[waits for a lock] ");
                }
            }
            if settled.choosable.is_empty() {
                if settled.blocked.is_empty() {
                    // Nothing held, nothing blocked, no task between statements: done.
                    break;
                }
                // Every unfinished session is blocked: a deadlock that PostgreSQL's detector
                // breaks (within the sessions' `deadlock_timeout`), else a hang.
                let since = *blocked_since.get_or_insert_with(Instant::now);
                assert!(
                    since.elapsed() < SETTLE_LIMIT,
                    "every unfinished session of the schedule waits for a lock for {SETTLE_LIMIT:?}: {}",
                    describe_view(&self.gate.view())
                );
                run.deadlock_waits += 1;
                self.wait_for_change(Duration::from_millis(50)).await;
                continue;
            }
            blocked_since = None;
            let mut options: Vec<usize> = settled.choosable.iter().map(|c| c.0).collect();
            if let Some(s) = inside.filter(|s| options.contains(s)) {
                options = vec![s];
            }
            let chosen = chooser.choose(&options, last);
            assert!(
                options.contains(&chosen),
                "the chooser picked a session that cannot run"
            );
            let conn = settled
                .choosable
                .iter()
                .find(|c| c.0 == chosen)
                .expect("chosen")
                .1;
            let preempted = last.is_some_and(|l| l != chosen && options.contains(&l));
            run.choices.push(ChoicePoint {
                options,
                chosen,
                preempted,
            });
            let label = self.gate.release(conn).expect("a held statement");
            if self.atomic.iter().any(|a| label.starts_with(a)) {
                inside = Some(chosen);
            } else if inside == Some(chosen) && (label == "COMMIT" || label == "ROLLBACK") {
                inside = None;
            }
            run.steps.push(Step {
                session: chosen,
                label,
            });
            last = Some(chosen);
        }
        for h in handles {
            if let Err(e) = h.await {
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }
        run
    }

    async fn wait_for_change(&self, limit: Duration) {
        let mut changes = self.gate.changes();
        changes.borrow_and_update();
        let _ = tokio::time::timeout(limit, changes.changed()).await;
    }

    /// Waits until the sessions are settled (see the module's documentation).
    async fn settle(&self) -> Settled {
        let started = Instant::now();
        let mut changes = self.gate.changes();
        // Whether the last look found statements at the server and waited a moment for them.
        let mut waited_for_flights = false;
        loop {
            changes.borrow_and_update();
            let view = self.gate.view();
            let mut unsettled = !view.dying.is_empty();
            let mut flying: Vec<(usize, i32)> = Vec::new();
            let mut choosable: Vec<(usize, u64)> = Vec::new();
            for s in 0..self.names.len() {
                let conns: Vec<_> = view
                    .conns
                    .iter()
                    .filter(|c| self.session_of(&c.session) == Some(s))
                    .collect();
                let mut busy = false;
                for c in &conns {
                    if !c.ready || (!c.in_flight.is_empty() && c.pid.is_none()) {
                        unsettled = true;
                        busy = true;
                    } else if !c.in_flight.is_empty() {
                        flying.push((s, c.pid.expect("pid")));
                        busy = true;
                    }
                }
                let held = conns.iter().find(|c| c.held.is_some());
                let running = view.running.get(self.names[s]).copied().unwrap_or(false);
                if busy {
                    continue;
                }
                match held {
                    Some(c) => choosable.push((s, c.id)),
                    // Between two statements (or connecting): not settled yet.
                    None if running => unsettled = true,
                    None => {}
                }
            }
            if started.elapsed() > SETTLE_LIMIT {
                panic!(
                    "the explorer's sessions did not settle within {SETTLE_LIMIT:?} (a hang): {}",
                    describe_view(&view)
                );
            }
            if unsettled {
                let _ = tokio::time::timeout(Duration::from_millis(20), changes.changed()).await;
                continue;
            }
            if !flying.is_empty() {
                if !waited_for_flights {
                    // Most statements answer within a millisecond: wait for that first.
                    waited_for_flights = true;
                    let _ = tokio::time::timeout(Duration::from_millis(2), changes.changed()).await;
                    continue;
                }
                let ours: Vec<i32> = view.conns.iter().filter_map(|c| c.pid).collect();
                let pids: Vec<i32> = flying.iter().map(|f| f.1).collect();
                let blocked: Vec<i32> = sqlx::query_scalar(
                    "SELECT p FROM unnest($1::int4[]) AS p WHERE pg_blocking_pids(p) && $2::int4[]",
                )
                .bind(&pids)
                .bind(&ours)
                .fetch_all(&self.monitor)
                .await
                .expect("pg_blocking_pids");
                if blocked.len() < pids.len() {
                    let _ = tokio::time::timeout(Duration::from_millis(1), changes.changed()).await;
                    continue;
                }
                // Every statement at the server waits for a lock that another session holds.
                // (None can be woken meanwhile: no statement runs.) The view must not have
                // changed since it was read.
                if changes.has_changed().unwrap_or(true) {
                    continue;
                }
                return Settled {
                    choosable,
                    blocked: flying.iter().map(|f| f.0).collect(),
                };
            }
            return Settled {
                choosable,
                blocked: Vec::new(),
            };
        }
    }
}

/// Marks a session's task finished when dropped.
struct Finished(Gate, &'static str);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.set_running(self.1, false);
    }
}

fn describe_view(view: &View) -> String {
    view.conns
        .iter()
        .map(|c| {
            format!(
                "\n  {} (pid {:?}, ready {}): held {:?}, at the server {:?}",
                c.session,
                c.pid,
                c.ready,
                c.held,
                c.in_flight.iter().map(|f| &f.label).collect::<Vec<_>>()
            )
        })
        .collect::<String>()
        + &format!("\n  running: {:?}, dying: {:?}", view.running, view.dying)
}
