//! Reading the slot: committed transactions' outbox inserts, in commit order, gathered into
//! batches that end at a commit.

use std::time::Duration;

use futures::FutureExt;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent};

use super::pgoutput::{Change, Decoder};
use super::WalSource;
use crate::Error;

/// The outbox inserts of one or more whole committed transactions, in commit order.
#[derive(Debug, Default)]
pub(crate) struct Batch {
    /// The inserted rows' `seq`, in commit order (per key this is also `seq` order).
    pub seqs: Vec<i64>,
    /// The end LSN of the batch's last commit.
    pub end_lsn: u64,
    /// The ids (32-bit, as pgoutput's `Begin` gives them) of the transactions with outbox
    /// inserts: their rows are read only once these are visible ([`crate::wal::rows::visible`]).
    pub xids: Vec<u32>,
}

/// What the stream gave the relay.
#[derive(Debug)]
pub(crate) enum Read {
    /// Whole transactions, some of which may hold no outbox insert (`seqs` empty).
    Batch(Batch),
    /// A keepalive: the server sent everything up to here.
    KeepAlive(u64),
}

/// A replication session on the relay's slot.
pub(crate) struct Stream {
    client: ReplicationClient,
    decoder: Decoder,
    /// The transaction being received (its id and inserts), when a `Begin` came without its
    /// `Commit`.
    open: Option<(u32, Vec<i64>)>,
    /// The whole transactions received for the next batch, kept here so that [`Stream::next`]
    /// is cancel-safe.
    batch: Batch,
    committed: bool,
    /// The highest position confirmed ([`Stream::confirm`]), and how often it is reported.
    confirmed: u64,
    status_interval: Duration,
}

impl Stream {
    /// Starts streaming from the slot's confirmed position. The walsender ends the session
    /// when this relay stops answering for `silence` (`wal_sender_timeout`), and its socket
    /// drops a client that stops acknowledging data after as long (`tcp_user_timeout`): the
    /// walsender of a relay that is frozen or cut off does not keep the slot (a terminated
    /// walsender blocked writing to a silent peer would otherwise live until TCP gives up).
    pub(crate) async fn start(source: &WalSource, silence: Duration) -> Result<Stream, Error> {
        let ms = silence.as_millis().max(1);
        let config = replication_config(source)?.with_options(format!(
            "-c wal_sender_timeout={ms} -c tcp_user_timeout={ms}"
        ));
        let client = ReplicationClient::connect(config).await.map_err(|e| {
            Error::Wal(format!(
                "could not start streaming from slot {}: {e}",
                source.slot
            ))
        })?;
        Ok(Stream {
            client,
            decoder: Decoder::default(),
            open: None,
            batch: Batch::default(),
            committed: false,
            confirmed: 0,
            status_interval: source.status_interval,
        })
    }

    /// Reports `lsn` to the server as flushed: the slot's confirmed position advances to it.
    pub(crate) fn confirm(&mut self, lsn: u64) {
        self.confirmed = self.confirmed.max(lsn);
        self.client.update_applied_lsn(Lsn::from_u64(lsn));
    }

    /// Waits for the next commit (or keepalive), then takes every further whole transaction
    /// already received without waiting, up to about `max` inserts: a batch grows with the
    /// backlog and costs no wait when there is none. Cancel-safe: what was received is kept
    /// for the next call.
    pub(crate) async fn next(&mut self, max: usize) -> Result<Read, Error> {
        loop {
            let event = if self.committed && self.open.is_none() {
                if self.batch.seqs.len() >= max {
                    return Ok(Read::Batch(self.take()));
                }
                match self.client.recv().now_or_never() {
                    None => return Ok(Read::Batch(self.take())),
                    Some(event) => event,
                }
            } else {
                self.client.recv().await
            };
            let event = event
                .map_err(|e| Error::Wal(format!("replication stream failed: {e}")))?
                .ok_or_else(|| Error::Wal("replication stream ended".into()))?;
            match event {
                ReplicationEvent::Begin { xid, .. } => self.open = Some((xid, Vec::new())),
                ReplicationEvent::XLogData { data, .. } => {
                    if let Change::Outbox(seq) = self.decoder.decode(&data).map_err(Error::Wal)? {
                        self.open
                            .as_mut()
                            .ok_or_else(|| {
                                Error::Wal("an outbox insert outside a transaction".into())
                            })?
                            .1
                            .push(seq);
                    }
                }
                ReplicationEvent::Commit { end_lsn, .. } => {
                    let (xid, seqs) = self
                        .open
                        .take()
                        .ok_or_else(|| Error::Wal("a commit without its begin".into()))?;
                    if !seqs.is_empty() {
                        self.batch.xids.push(xid);
                    }
                    self.batch.seqs.extend(seqs);
                    self.batch.end_lsn = end_lsn.as_u64();
                    self.committed = true;
                }
                ReplicationEvent::KeepAlive { wal_end, .. } => {
                    if !self.committed && self.open.is_none() {
                        return Ok(Read::KeepAlive(wal_end.as_u64()));
                    }
                }
                ReplicationEvent::Message { .. } => {}
                ReplicationEvent::StoppedAt { .. } => {
                    return Err(Error::Wal("replication stream stopped".into()))
                }
            }
        }
    }

    /// The batch received so far, taken.
    fn take(&mut self) -> Batch {
        self.committed = false;
        std::mem::take(&mut self.batch)
    }

    /// Ends the session (the server keeps the slot's confirmed position).
    pub(crate) async fn stop(mut self) {
        let _ = self.client.shutdown().await;
    }

    /// Ends the session once the position confirmed last was reported to the server (the
    /// replication client reports it at most every `status_interval`, and does not report it
    /// when it ends): a graceful stop leaves the slot where the relay finished, not up to a
    /// status interval behind (a next holder would read those transactions again, and the
    /// slot would show lag). Waits at most a status interval and a little more.
    pub(crate) async fn stop_reported(self) {
        let metrics = self.client.metrics();
        let until = tokio::time::Instant::now() + self.status_interval + Duration::from_millis(250);
        while metrics.last_applied_lsn().as_u64() < self.confirmed
            && tokio::time::Instant::now() < until
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop().await;
    }
}

/// `%XX` escapes of a URL part decoded (a `+` stays a `+`, as libpq reads it).
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (b[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The replication session's settings from the source's connection URL
/// (`postgres://user:password@host:port/database?sslmode=…`).
pub(super) fn replication_config(source: &WalSource) -> Result<ReplicationConfig, Error> {
    use pgwire_replication::{SslMode, TlsConfig};
    let bad = |m: &str| Error::Config(format!("WAL source connection: {m}"));
    let url = url::Url::parse(&source.url).map_err(|_| bad("not a postgres:// URL"))?;
    if !matches!(url.scheme(), "postgres" | "postgresql") {
        return Err(bad("not a postgres:// URL"));
    }
    let user = decode(url.username());
    let password = url.password().map(decode).unwrap_or_default();
    let database = url.path().trim_start_matches('/');
    let database = if database.is_empty() {
        user.clone()
    } else {
        decode(database)
    };
    let host = url.host_str().unwrap_or("localhost").to_owned();
    // As libpq and the relay's own pool read the URL: `prefer` unless `sslmode` says
    // otherwise, the CA from `sslrootcert`, a client certificate from `sslcert` and `sslkey`.
    let mut tls = TlsConfig::disabled();
    tls.mode = SslMode::Prefer;
    let (mut cert, mut key) = (None, None);
    for (k, v) in url.query_pairs() {
        match k.as_ref() {
            "sslmode" => {
                tls.mode = match v.as_ref() {
                    "disable" => SslMode::Disable,
                    "allow" | "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    _ => return Err(bad("unknown sslmode")),
                }
            }
            "sslrootcert" => tls.ca_pem_path = Some(v.into_owned().into()),
            "sslcert" => cert = Some(std::path::PathBuf::from(v.into_owned())),
            "sslkey" => key = Some(std::path::PathBuf::from(v.into_owned())),
            _ => {}
        }
    }
    match (cert, key) {
        (Some(cert), Some(key)) => tls = tls.with_client_cert(cert, key),
        (None, None) => {}
        _ => return Err(bad("sslcert and sslkey go together")),
    }
    // A file the session cannot read fails every start the same way: said once, at start.
    for (name, path) in [
        ("sslrootcert", &tls.ca_pem_path),
        ("sslcert", &tls.client_cert_pem_path),
        ("sslkey", &tls.client_key_pem_path),
    ] {
        if let Some(path) = path {
            if let Err(e) = std::fs::File::open(path) {
                return Err(bad(&format!("{name} {}: {e}", path.display())));
            }
        }
    }
    // An IP address is checked against the certificate's IP names, as libpq does (the crate
    // refuses `verify-full` to an IP address unless it is named as the server's name).
    let host = match url.host() {
        Some(url::Host::Ipv4(ip)) => ip.to_string(),
        Some(url::Host::Ipv6(ip)) => ip.to_string(),
        _ => host,
    };
    if host.parse::<std::net::IpAddr>().is_ok() {
        tls.sni_hostname = Some(host.clone());
    }
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        database,
        source.slot.clone(),
        source.publication.clone(),
    )
    .with_port(url.port().unwrap_or(5432))
    .with_tls(tls)
    .with_status_interval(source.status_interval)
    .with_wakeup_interval(source.status_interval)
    .with_application_name("postal-wal-relay"))
}

#[cfg(test)]
mod tests {
    use super::replication_config;
    use crate::wal::WalSource;
    use pgwire_replication::SslMode;

    fn config(url: &str) -> pgwire_replication::ReplicationConfig {
        replication_config(&WalSource::new(url, "s", "p")).expect(url)
    }

    /// Guarantee: the replication session reads the URL's TLS settings as libpq and the
    /// relay's pool do: `prefer` by default, the CA from `sslrootcert`, a client certificate
    /// from `sslcert` and `sslkey` (both or neither), and an IP address verified against the
    /// certificate's IP names.
    #[test]
    fn the_replication_session_reads_the_url_s_tls_settings() {
        let pem = std::env::temp_dir().join(format!("postal-wal-tls-{}.pem", std::process::id()));
        std::fs::write(&pem, "not read here").unwrap();
        let pem_s = pem.display().to_string();
        let c = config("postgres://u:p@db.example:5433/app");
        assert_eq!(
            (c.tls.mode, c.port, c.database.as_str()),
            (SslMode::Prefer, 5433, "app")
        );
        let c = config(&format!(
            "postgres://u@10.0.0.7/app?sslmode=verify-full&sslrootcert={pem_s}"
        ));
        assert_eq!(c.tls.mode, SslMode::VerifyFull);
        assert_eq!(c.tls.ca_pem_path.as_deref(), Some(pem.as_path()));
        assert_eq!(c.tls.sni_hostname.as_deref(), Some("10.0.0.7"));
        let c = config(&format!(
            "postgres://u@db.example/app?sslmode=require&sslcert={pem_s}&sslkey={pem_s}"
        ));
        assert!(c.tls.is_mtls() && c.tls.sni_hostname.is_none());
        let refused = |url: &str| {
            replication_config(&WalSource::new(url, "s", "p"))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert!(refused(&format!("postgres://u@h/a?sslcert={pem_s}")).contains("go together"));
        assert!(refused("postgres://u@h/a?sslmode=bogus").contains("unknown sslmode"));
        let missing =
            refused("postgres://u@h/a?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem");
        assert!(
            missing.contains("sslrootcert /nonexistent/ca.pem"),
            "{missing}"
        );
        assert_eq!(missing.lines().count(), 1);
        let _ = std::fs::remove_file(&pem);
    }
}
