//! Test hosts: network namespaces joined by a bridge, so that a test can put processes on
//! separate "hosts" and cut or slow the link of one of them.
//!
//! Every address in use belongs to a namespace created here (`10.231.<n>.<i>/24`, `n` from the
//! test process's id). The bridge and the hosts' far veth ends live in a "switch" namespace of
//! their own, without addresses; nothing is added to the machine's own namespace, so nothing
//! outside the test's namespaces is ever a target, and every command works from whichever
//! namespace the calling thread is in. Everything is removed on drop (processes left in a
//! namespace are killed first), also when the test fails. Needs root and iproute2;
//! [`TestHosts::available`] says why not when it cannot run.

use std::process::Command;

/// One host: its namespace and address, and the root-side end of its link.
struct Host {
    name: String,
    netns: String,
    addr: String,
    link: String,
}

/// Namespaces on one bridge; removed on drop.
pub struct TestHosts {
    /// The namespace holding the bridge and the far ends of the hosts' links.
    switch: String,
    hosts: Vec<Host>,
}

/// The bridge's name inside the switch namespace.
const BRIDGE: &str = "br0";

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn must(args: &[&str]) {
    ip(args).unwrap_or_else(|e| panic!("{e}"));
}

impl TestHosts {
    /// `Err(why)` when this machine cannot make test hosts (not root, no iproute2, no
    /// namespaces).
    pub fn available() -> Result<(), String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("network namespaces need root".into());
        }
        ip(&["netns", "list"])
    }

    /// Creates one namespace per name, each with one address on a shared bridge.
    pub fn create(names: &[&str]) -> TestHosts {
        // Unique per set within the process too: tests running at once each have their own
        // (the addresses may repeat: each set is a bridge of its own).
        static SETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let set = SETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("{}{}", std::process::id() % 10_000, suffix(set));
        let subnet = 20 + std::process::id() % 200;
        let switch = format!("pn{id}-switch");
        must(&["netns", "add", &switch]);
        let mut hosts = TestHosts {
            switch: switch.clone(),
            hosts: Vec::new(),
        };
        must(&["-n", &switch, "link", "add", BRIDGE, "type", "bridge"]);
        must(&["-n", &switch, "link", "set", BRIDGE, "up"]);
        for (i, name) in names.iter().enumerate() {
            let netns = format!("pn{id}-{name}");
            let link = format!("v{i}");
            let addr = format!("10.231.{subnet}.{}", i + 1);
            must(&["netns", "add", &netns]);
            hosts.hosts.push(Host {
                name: name.to_string(),
                netns: netns.clone(),
                addr: addr.clone(),
                link: link.clone(),
            });
            must(&[
                "-n", &switch, "link", "add", &link, "type", "veth", "peer", "name", "eth0",
                "netns", &netns,
            ]);
            must(&["-n", &switch, "link", "set", &link, "master", BRIDGE, "up"]);
            must(&[
                "-n",
                &netns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ]);
            must(&["-n", &netns, "link", "set", "eth0", "up"]);
            must(&["-n", &netns, "link", "set", "lo", "up"]);
        }
        hosts
    }

    fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no test host {name}"))
    }

    /// The host's address.
    pub fn addr(&self, name: &str) -> &str {
        &self.host(name).addr
    }

    /// The host's network namespace.
    pub fn netns(&self, name: &str) -> &str {
        &self.host(name).netns
    }

    /// Cuts the host off: its link leaves the bridge, so its packets go nowhere (as with a
    /// pulled cable or a partition: no reset, no error, just silence).
    pub fn cut(&self, name: &str) {
        must(&[
            "-n",
            &self.switch,
            "link",
            "set",
            &self.host(name).link,
            "nomaster",
        ]);
    }

    /// Joins the host to the bridge again.
    pub fn heal(&self, name: &str) {
        must(&[
            "-n",
            &self.switch,
            "link",
            "set",
            &self.host(name).link,
            "master",
            BRIDGE,
        ]);
    }

    /// Limits the host's link to `rate` (e.g. `1mbit`) both ways, with a deep queue: a slow
    /// link whose latency grows with the traffic (a token bucket: this kernel has no netem).
    pub fn slow(&self, name: &str, rate: &str) {
        let h = self.host(name);
        let tbf = ["tbf", "rate", rate, "burst", "16kb", "latency", "2s"];
        let mut root = vec!["qdisc", "replace", "dev", &h.link, "root"];
        root.extend(tbf);
        tc(&self.switch, &root);
        let mut inner = vec!["qdisc", "replace", "dev", "eth0", "root"];
        inner.extend(tbf);
        tc(&h.netns, &inner);
    }

    /// Removes [`TestHosts::slow`]'s limit.
    pub fn fast(&self, name: &str) {
        let h = self.host(name);
        tc(&self.switch, &["qdisc", "del", "dev", &h.link, "root"]);
        tc(&h.netns, &["qdisc", "del", "dev", "eth0", "root"]);
    }

    /// Moves the calling thread into the host's network namespace: sockets it (and threads
    /// it starts afterwards, such as a current-thread runtime's or a Kafka client's) opens
    /// from then on are on that host. Use from a `current_thread` test.
    pub fn enter(&self, name: &str) {
        enter_netns(self.netns(name));
    }

    /// `program` to be run on the host (`ip netns exec`).
    pub fn command(&self, name: &str, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.netns(name), program]);
        c
    }
}

/// The first set of a process has no suffix (its names as before), later ones `-1`, `-2`, …
fn suffix(set: u32) -> String {
    if set == 0 {
        String::new()
    } else {
        format!("-{set}")
    }
}

/// Moves the calling thread into network namespace `netns` (a name under `/var/run/netns`).
pub fn enter_netns(netns: &str) {
    let path = format!("/var/run/netns/{netns}");
    let f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("setns {path}: {e}"));
}

fn tc(netns: &str, args: &[&str]) {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "tc"])
        .args(args)
        .output()
        .expect("run tc");
    assert!(
        out.status.success(),
        "tc {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

impl Drop for TestHosts {
    fn drop(&mut self) {
        for h in &self.hosts {
            // Whatever still runs on the host (a service the test did not stop) goes with it.
            if let Ok(out) = Command::new("ip")
                .args(["netns", "pids", &h.netns])
                .output()
            {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-9", pid]).status();
                }
            }
            let _ = ip(&["netns", "del", &h.netns]);
        }
        // Deleting a namespace deletes its interfaces, the bridge and veth ends with it.
        let _ = ip(&["netns", "del", &self.switch]);
    }
}

/// A TCP forwarder from 127.0.0.1 of the caller's network namespace into a test host: each
/// connection accepted on [`Forwarder::port`] is relayed to `target` over a socket opened in
/// the host's namespace, so that a client here talks to a server on the bridge as if it ran
/// on that host, and [`TestHosts::cut`] of the host leaves the server facing silence. Stops
/// (its connections dropped) when dropped.
pub struct Forwarder {
    /// The port on 127.0.0.1.
    pub port: u16,
    accept: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    /// Starts forwarding to `target` from host namespace `netns`.
    pub async fn start(netns: &str, target: std::net::SocketAddr) -> Forwarder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("forwarder listens");
        let port = listener.local_addr().expect("its address").port();
        let netns = netns.to_owned();
        let accept = tokio::spawn(async move {
            let mut relays = tokio::task::JoinSet::new();
            while let Ok((mut client, _)) = listener.accept().await {
                // A thread of its own enters the namespace (and ends there): the socket it
                // opens stays in that namespace.
                let ns = netns.clone();
                let opened = std::thread::spawn(move || {
                    enter_netns(&ns);
                    let s = std::net::TcpStream::connect(target)?;
                    s.set_nonblocking(true)?;
                    Ok::<_, std::io::Error>(s)
                })
                .join()
                .expect("connect thread");
                let Ok(server) = opened.and_then(tokio::net::TcpStream::from_std) else {
                    continue;
                };
                let mut server = server;
                relays.spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
            }
        });
        Forwarder { port, accept }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
