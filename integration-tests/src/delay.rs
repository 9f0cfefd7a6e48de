//! A long link for kernels without `netem`: a TCP proxy that holds every chunk it relays for a
//! set time in each direction before passing it on, in order (added latency, no bandwidth
//! limit, no loss). It runs on a thread of its own, in the network namespace of a test host
//! ([`crate::hosts`]), listening on that host's loopback: a process on the host that connects
//! through it reaches the upstream over the host's own link, so cutting or slowing that link
//! still applies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A delaying proxy; stops (closing every connection through it) when dropped.
pub struct DelayProxy {
    /// Its port on the host's loopback (`127.0.0.1`).
    pub port: u16,
    delay_ms: Arc<AtomicU64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DelayProxy {
    /// Starts a proxy to `upstream` (`host:port`) in network namespace `netns` (a name under
    /// `/var/run/netns`), without delay until [`DelayProxy::set_delay`].
    pub fn start(netns: &str, upstream: &str) -> DelayProxy {
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (netns, upstream, delay) = (netns.to_owned(), upstream.to_owned(), delay_ms.clone());
        let thread = std::thread::spawn(move || {
            crate::hosts::enter_netns(&netns);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("proxy runtime");
            rt.block_on(async move {
                let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
                port_tx
                    .send(listener.local_addr().expect("proxy address").port())
                    .expect("report port");
                let mut conns = tokio::task::JoinSet::new();
                let mut stopped = stopped;
                loop {
                    tokio::select! {
                        _ = &mut stopped => break,
                        accepted = listener.accept() => {
                            let Ok((client, _)) = accepted else { break };
                            let (upstream, delay) = (upstream.clone(), delay.clone());
                            conns.spawn(async move {
                                let Ok(server) = TcpStream::connect(&upstream).await else {
                                    return;
                                };
                                let _ = client.set_nodelay(true);
                                let _ = server.set_nodelay(true);
                                let (cr, cw) = client.into_split();
                                let (sr, sw) = server.into_split();
                                tokio::join!(
                                    pump(cr, sw, delay.clone()),
                                    pump(sr, cw, delay)
                                );
                            });
                        }
                    }
                }
                conns.abort_all();
            });
        });
        let port = port_rx.recv().expect("the proxy started");
        DelayProxy {
            port,
            delay_ms,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Holds every chunk relayed from now on for `delay` in each direction.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Relays `from` to `to`, each chunk once it is `delay` old.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Arc<AtomicU64>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let due =
                tokio::time::Instant::now() + Duration::from_millis(delay.load(Ordering::Relaxed));
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let write = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}
