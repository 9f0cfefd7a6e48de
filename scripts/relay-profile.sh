#!/usr/bin/env bash
# Profiles Postal's relay while it drains a backlog: `perf record` of `postal-bench relay
# --relay-only` (one instance, one round), cut to the drain (the seconds in which librdkafka's
# broker thread is busy), then the top symbols of the bench process and the kernel's page
# zeroing and page faults on their own lines.
#
#   source <(bash scripts/stack.sh env); bash scripts/stack.sh restart-broker
#   bash scripts/relay-profile.sh [EVENTS] [TOP]       # defaults 300000 and 25
#   BENCH=/path/to/postal-bench bash scripts/relay-profile.sh   # another build
#
# Needs `perf` and the local stack (DATABASE_URL, KAFKA_BOOTSTRAP_SERVERS).
set -euo pipefail
cd "$(dirname "$0")/.."
events="${1:-300000}"
top="${2:-25}"
bench="${BENCH:-./target/release/postal-bench}"
: "${DATABASE_URL:?source <(bash scripts/stack.sh env) first}"
: "${KAFKA_BOOTSTRAP_SERVERS:?source <(bash scripts/stack.sh env) first}"
command -v perf >/dev/null || { echo "relay-profile: perf is not installed" >&2; exit 1; }
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
data="$dir/perf.data"
if ! perf record -q -F 1999 -g -o "$data" -- "$bench" --database-url "$DATABASE_URL" \
  --bootstrap "$KAFKA_BOOTSTRAP_SERVERS" relay --relay-only --instances 1 --repeat 1 \
  --events "$events" >"$dir/bench.log" 2>&1; then
  echo "relay-profile: the benchmark failed:" >&2
  tail -n 5 "$dir/bench.log" >&2
  exit 1
fi
grep -A1 '^(a) Postal' "$dir/bench.log"
# The drain: from the first to the end of the last quarter-second in which the broker thread had
# > 40 samples (perf's clock counts seconds since boot: printed with fixed decimals).
perf script -i "$data" -F comm,time >"$dir/samples" 2>/dev/null
window="$(awk '
  /rdk:broker/ { t = $NF; sub(":", "", t); b = sprintf("%.2f", int(t * 4) / 4); n[b]++ }
  END { for (b in n) if (n[b] > 40) print b }' "$dir/samples" | sort -n |
  awk 'NR == 1 { first = $1 } { last = $1 } END { if (NR) printf "%s,%.2f", first, last + 0.25 }')"
[ -n "$window" ] || { echo "relay-profile: no drain found in the profile" >&2; exit 1; }
echo "drain window (perf clock): $window; samples of the bench process in it:"
report() {
  perf report -i "$data" --time "$window" --no-children --sort sym --stdio -g none "$@" \
    2>/dev/null | grep -v '^#' | grep -v '^$'
}
report | head -n "$top" || true   # head closes the pipe early
echo "page zeroing and faults:"
report | grep -E 'clear_page|exc_page_fault' || echo "    (none sampled)"
