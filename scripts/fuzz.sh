#!/usr/bin/env bash
# Fuzzes the consumer's record decode path (fuzz/fuzz_targets/decode.rs) for a bounded time:
#   bash scripts/fuzz.sh [SECONDS]     (default 60)
#   bash scripts/fuzz.sh --build       only build the target (CI does it in the background)
# Installs cargo-fuzz when missing. cargo-fuzz asks rustc for flags only nightly accepts;
# RUSTC_BOOTSTRAP=1 lets the stable toolchain here take them (no sanitizer: libFuzzer's
# coverage-guided search and Rust's own panics and bounds checks). A crash leaves its input in
# fuzz/artifacts/decode/ and the command that replays it in the output; the run fails.
#
# The target and its dependencies (librdkafka, sqlx, rustls among them) are built unoptimized
# (--dev): the release build took 8 min of CI's two cores before the first input. Unoptimized,
# fewer inputs run a second (FUZZ_RELEASE=1 for long runs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz 0.13.2"
  cargo install -q cargo-fuzz --version 0.13.2 --locked
fi
profile=--dev
[ "${FUZZ_RELEASE:-0}" = "1" ] && profile=--release
if [ "${1:-}" = "--build" ]; then
  RUSTC_BOOTSTRAP=1 cargo fuzz build decode "$profile" --sanitizer none
  exit 0
fi
seconds="${1:-60}"
# The regression cases (issue 31's hostile records) through the same entry point first.
cargo test -q -p postal-consumer --features fuzzing --lib fuzzing
RUSTC_BOOTSTRAP=1 cargo fuzz run decode "$profile" --sanitizer none -- \
  -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 2>&1 |
  grep -vE '^(#[0-9]+\s|INFO: |"[^"]*" # Uses: |###### )|^\s+NEW_FUNC' ||
  { echo "fuzz: the decode target failed (see above; the input is in fuzz/artifacts/decode/)"; exit 1; }
