//! `peak_rss <program> [args…]`: runs the program (stdin, stdout and stderr inherited), then
//! prints its peak resident set size in KiB on stderr as `peak_rss_kib=<n>` and exits with its
//! exit code. Its only child is the program, so the children's peak is the program's: the
//! suite measures the CLI's memory with it (a test process has many children).

fn main() {
    let mut args = std::env::args_os().skip(1);
    let program = args.next().expect("usage: peak_rss <program> [args…]");
    let status = std::process::Command::new(program)
        .args(args)
        .status()
        .expect("run the program");
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .expect("getrusage");
    eprintln!("peak_rss_kib={}", usage.max_rss());
    std::process::exit(status.code().unwrap_or(1));
}
