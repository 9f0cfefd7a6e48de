//! The graceful-stop signal every long-running Postal process listens for.

use std::future::Future;
use std::pin::Pin;

/// A future that resolves on SIGINT or SIGTERM (elsewhere than Unix: Ctrl-C).
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

/// SIGINT or SIGTERM, listened for from this call on (on Unix; elsewhere Ctrl-C from the first
/// poll): a process that creates it before it connects stops cleanly even when told to while
/// it still waits for its database at start-up. Kubernetes stops a pod with SIGTERM; a
/// terminal with SIGINT (Ctrl-C). Both mean the same: finish what is in flight, then exit.
pub fn stop_signal() -> std::io::Result<StopSignal> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(Box::pin(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }))
    }
    #[cfg(not(unix))]
    {
        Ok(Box::pin(async {
            let _ = tokio::signal::ctrl_c().await;
        }))
    }
}
