//! Standard output that a reader may close early (`postal status | head -1`): every line goes
//! through [`say!`], which returns the write error instead of panicking as `println!` does, and
//! a command whose standard output was closed ends quietly (see [`closed_stdout`]).

/// `println!` that returns an error (with `?`) when standard output cannot be written.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)?
    }};
}
pub(crate) use say;

/// Whether `e` is, or was caused by, a write to a standard output whose reader is gone.
pub fn closed_stdout(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The exit status of a command whose standard output was closed: 141, what a shell reports
/// for a process that SIGPIPE ended (128 + 13), as `cat` or `grep` end in a pipe to `head`.
pub const CLOSED_STDOUT_STATUS: u8 = 141;
