//! The schedule explorer's gate: a PostgreSQL wire proxy that holds every session's next
//! statement until the explorer releases it, and reports what each connection is doing.
//!
//! A *statement* is a simple query (`Q`) or an extended-protocol group up to and including its
//! `Sync` (`S`) that executes something (`E`). Groups that execute nothing — sqlx's
//! `Parse`/`Describe`/`Sync` of a statement it has not prepared on this connection yet, the
//! lone `Sync` of its health check when a connection goes back to its pool — pass at once:
//! they change nothing in the database, and holding them would make the steps of a schedule
//! depend on what each connection happened to have prepared before. The start-up exchange
//! passes too.
//!
//! The proxy learns each connection's session from its `application_name`, its backend's pid
//! from `BackendKeyData`, when a statement completes from `ReadyForQuery`, and — for the
//! fence's `pg_terminate_backend` — which backend was told to end, so that the explorer can
//! wait until that backend's connection is closed before it chooses the next step.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

/// One statement sent to the server and not answered with `ReadyForQuery` yet.
#[derive(Clone, Debug)]
pub struct Flight {
    /// Whether it was held for the explorer (it executes something).
    pub gated: bool,
    /// The statement's text, shortened, for traces.
    pub label: String,
    /// `pg_terminate_backend(pid)` of this pid (the fence's termination statement).
    terminates: Option<i32>,
    /// The server answered with a row whose first column is `true`.
    true_row: bool,
}

/// A statement held at the gate.
struct Held {
    flight: Flight,
    release: oneshot::Sender<()>,
}

/// One client connection through the gate.
struct Conn {
    session: String,
    pid: Option<i32>,
    /// The start-up exchange ended (the server's first `ReadyForQuery`).
    ready: bool,
    held: Option<Held>,
    in_flight: std::collections::VecDeque<Flight>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    conns: BTreeMap<u64, Conn>,
    /// Sessions whose task is running (set by the explorer).
    running: HashMap<String, bool>,
    /// Backends told to terminate whose connection is still open.
    dying: Vec<i32>,
}

struct Shared {
    state: Mutex<State>,
    version: watch::Sender<u64>,
}

impl Shared {
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let r = f(&mut self.state.lock().expect("gate state"));
        self.version.send_modify(|v| *v += 1);
        r
    }
}

/// What the explorer sees of one connection.
#[derive(Clone, Debug)]
pub struct ConnView {
    pub id: u64,
    pub session: String,
    pub pid: Option<i32>,
    pub ready: bool,
    /// The label of the statement held at the gate, if any.
    pub held: Option<String>,
    /// Statements sent and not answered yet.
    pub in_flight: Vec<Flight>,
}

/// A snapshot of the gate.
#[derive(Clone, Debug, Default)]
pub struct View {
    pub conns: Vec<ConnView>,
    pub running: HashMap<String, bool>,
    pub dying: Vec<i32>,
}

/// The proxy and its controls.
#[derive(Clone)]
pub struct Gate {
    pub port: u16,
    shared: Arc<Shared>,
}

impl Gate {
    /// Starts a gate in front of the PostgreSQL server at `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Gate {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            version: watch::channel(0).0,
        });
        let sh = shared.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (sh, upstream) = (sh.clone(), upstream.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let id = sh.with(|s| {
                        s.next_id += 1;
                        s.next_id
                    });
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        _ = to_server(id, cr, sw, sh.clone()) => {}
                        _ = to_client(id, sr, cw, sh.clone()) => {}
                    }
                    sh.with(|s| {
                        if let Some(c) = s.conns.remove(&id) {
                            if let Some(pid) = c.pid {
                                s.dying.retain(|p| *p != pid);
                            }
                        }
                    });
                });
            }
        });
        Gate { port, shared }
    }

    /// A receiver that sees every change of the gate's state.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.shared.version.subscribe()
    }

    pub fn view(&self) -> View {
        let s = self.shared.state.lock().expect("gate state");
        View {
            conns: s
                .conns
                .iter()
                .map(|(id, c)| ConnView {
                    id: *id,
                    session: c.session.clone(),
                    pid: c.pid,
                    ready: c.ready,
                    held: c.held.as_ref().map(|h| h.flight.label.clone()),
                    in_flight: c.in_flight.iter().cloned().collect(),
                })
                .collect(),
            running: s.running.clone(),
            dying: s.dying.clone(),
        }
    }

    /// Marks `session`'s task running or finished.
    pub fn set_running(&self, session: &str, running: bool) {
        self.shared.with(|s| {
            s.running.insert(session.to_owned(), running);
        });
    }

    /// Sends the statement held on connection `id` to the server. Returns its label.
    pub fn release(&self, id: u64) -> Option<String> {
        self.shared.with(|s| {
            let c = s.conns.get_mut(&id)?;
            let held = c.held.take()?;
            let label = held.flight.label.clone();
            c.in_flight.push_back(held.flight);
            let _ = held.release.send(());
            Some(label)
        })
    }
}

/// `b` up to its first NUL, and what follows that NUL.
fn cstr(b: &[u8]) -> (&[u8], &[u8]) {
    let i = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    (&b[..i], &b[(i + 1).min(b.len())..])
}

fn be_i16(b: &[u8]) -> Option<i16> {
    Some(i16::from_be_bytes(b.get(..2)?.try_into().ok()?))
}

fn be_i32(b: &[u8]) -> Option<i32> {
    Some(i32::from_be_bytes(b.get(..4)?.try_into().ok()?))
}

/// A statement's text on one line, shortened.
fn label(sql: &str) -> String {
    let one: String = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() > 70 {
        format!("{}…", one.chars().take(70).collect::<String>())
    } else {
        one
    }
}

/// The `n`th (0-based) parameter of a `Bind` body as an `int4` in binary format.
fn bind_int4(body: &[u8], n: usize) -> Option<i32> {
    let (_portal, rest) = cstr(body);
    let (_statement, rest) = cstr(rest);
    let formats = be_i16(rest)? as usize;
    let mut rest = rest.get(2 + 2 * formats..)?;
    let params = be_i16(rest)? as usize;
    rest = rest.get(2..)?;
    for i in 0..params {
        let len = be_i32(rest)?;
        rest = rest.get(4..)?;
        if len < 0 {
            continue;
        }
        let v = rest.get(..len as usize)?;
        if i == n {
            return if len == 4 { be_i32(v) } else { None };
        }
        rest = rest.get(len as usize..)?;
    }
    None
}

/// Client to server: groups the client's messages into statements and holds those that
/// execute something until the explorer releases them.
async fn to_server(
    id: u64,
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    sh: Arc<Shared>,
) -> std::io::Result<()> {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut started = false;
    // Prepared statements of this connection, by name.
    let mut statements: HashMap<Vec<u8>, String> = HashMap::new();
    let mut group: Vec<u8> = Vec::new();
    let mut executes = false;
    let mut sql = String::new();
    let mut terminates: Option<i32> = None;
    loop {
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
            if !started {
                // The start-up message (protocol 3.0): its parameters name the session. The
                // sessions connect without TLS, so no SSLRequest comes first.
                if msg.len() >= 8 && be_i32(&msg[4..]) == Some(196_608) {
                    started = true;
                    let mut rest = &msg[8..];
                    let mut session = String::new();
                    while !rest.is_empty() && rest[0] != 0 {
                        let (k, r) = cstr(rest);
                        let (v, r) = cstr(r);
                        if k == b"application_name" {
                            session = String::from_utf8_lossy(v).into_owned();
                        }
                        rest = r;
                    }
                    sh.with(|s| {
                        s.conns.insert(
                            id,
                            Conn {
                                session,
                                pid: None,
                                ready: false,
                                held: None,
                                in_flight: Default::default(),
                            },
                        );
                    });
                }
                to.write_all(&msg).await?;
                continue;
            }
            let body = &msg[5..];
            match msg[0] {
                b'P' => {
                    let (name, rest) = cstr(body);
                    let (text, _) = cstr(rest);
                    statements.insert(name.to_vec(), String::from_utf8_lossy(text).into_owned());
                }
                b'B' => {
                    let (_portal, rest) = cstr(body);
                    let (statement, _) = cstr(rest);
                    if let Some(text) = statements.get(statement) {
                        sql = text.clone();
                        // The fence's termination binds the backend's pid as `$4`.
                        if sql.contains("pg_terminate_backend") {
                            terminates = bind_int4(body, 3);
                        }
                    }
                }
                b'E' => executes = true,
                b'Q' => {
                    executes = true;
                    sql = String::from_utf8_lossy(cstr(body).0).into_owned();
                }
                _ => {}
            }
            group.extend_from_slice(&msg);
            match msg[0] {
                b'S' | b'Q' => {
                    let flight = Flight {
                        gated: executes,
                        label: if executes {
                            label(&sql)
                        } else {
                            "(prepare/sync)".into()
                        },
                        terminates: terminates.take(),
                        true_row: false,
                    };
                    let wait = sh.with(|s| {
                        let c = s.conns.get_mut(&id)?;
                        if flight.gated {
                            let (tx, rx) = oneshot::channel();
                            c.held = Some(Held {
                                flight,
                                release: tx,
                            });
                            Some(rx)
                        } else {
                            c.in_flight.push_back(flight);
                            None
                        }
                    });
                    if let Some(rx) = wait {
                        if rx.await.is_err() {
                            return Ok(());
                        }
                    }
                    to.write_all(&group).await?;
                    group.clear();
                    executes = false;
                    sql.clear();
                }
                b'X' => {
                    to.write_all(&group).await?;
                    return Ok(());
                }
                _ => {}
            }
        }
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Server to client: passes everything on, after noting the backend's pid, errors, the
/// termination statement's answer and each `ReadyForQuery`.
async fn to_client(
    id: u64,
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    sh: Arc<Shared>,
) -> std::io::Result<()> {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut at = 0;
        while buf.len() >= at + 5 {
            let total = 1 + u32::from_be_bytes(buf[at + 1..at + 5].try_into().unwrap()) as usize;
            if buf.len() < at + total {
                break;
            }
            let (kind, body) = (buf[at], &buf[at + 5..at + total]);
            match kind {
                b'K' => {
                    let pid = be_i32(body);
                    sh.with(|s| {
                        if let Some(c) = s.conns.get_mut(&id) {
                            c.pid = pid;
                        }
                    });
                }
                b'D' => {
                    // One column of one byte, `1`: `pg_terminate_backend` answered true.
                    let yes = be_i16(body) == Some(1)
                        && be_i32(&body[2..]) == Some(1)
                        && body.get(6) == Some(&1);
                    if yes {
                        sh.with(|s| {
                            if let Some(f) =
                                s.conns.get_mut(&id).and_then(|c| c.in_flight.front_mut())
                            {
                                f.true_row = true;
                            }
                        });
                    }
                }
                b'Z' => sh.with(|s| {
                    let Some(c) = s.conns.get_mut(&id) else {
                        return;
                    };
                    if !c.ready {
                        c.ready = true;
                        return;
                    }
                    if let Some(f) = c.in_flight.pop_front() {
                        if let (Some(pid), true) = (f.terminates, f.true_row) {
                            let open = s.conns.values().any(|c| c.pid == Some(pid));
                            if open {
                                s.dying.push(pid);
                            }
                        }
                    }
                }),
                _ => {}
            }
            at += total;
        }
        buf.drain(..at);
        to.write_all(&chunk[..n]).await?;
    }
}
