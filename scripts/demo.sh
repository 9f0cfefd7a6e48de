#!/usr/bin/env bash
# Postal's main job on a fresh machine: bring up PostgreSQL and Apache Kafka (scripts/stack.sh, no
# Docker needed), build `postal` and the demo's services (package postal-demo, demo/src/bin/),
# then run the relay, the order service, the billing service and the invoice recorder as separate
# processes and print a summary. Exits non-zero if any order was not applied exactly once.
#
# The stack starts in the background while cargo builds (their lines interleave: the stack's
# start with "stack:"). At the end the script says what still runs and how to stop it; on a
# terminal it offers to stop what it started.
#
#   DEMO_ORDERS / DEMO_RATE / DEMO_CUSTOMERS   tune the run (2000 orders, 200/s, 50 customers)
#   DEMO_STOP=1                                stop the stack at the end without asking (when
#                                              the demo started it)
#   DEMO_STOP=0                                leave it running without asking
#   POSTAL_PG_PORT, POSTAL_KAFKA_PORT, …       the stack's ports and folders (CONTRIBUTING.md,
#                                              "The stack's settings")
# Only PostgreSQL and Kafka: RabbitMQ and PgBouncer stay out unless POSTAL_NO_RABBITMQ=0 /
# POSTAL_NO_PGBOUNCER=0.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export POSTAL_NO_RABBITMQ="${POSTAL_NO_RABBITMQ:-1}" POSTAL_NO_PGBOUNCER="${POSTAL_NO_PGBOUNCER:-1}"
# The command that builds what the demo runs; the Dockerfile runs the same (a test compares them).
BUILD=(cargo build -p postal-cli -p postal-demo)
TARGET="${CARGO_TARGET_DIR:-target}"

started=$SECONDS
say() { echo "demo: $*" >&2; }
elapsed() { local s=$((SECONDS - started)); printf '%d min %02d s' $((s / 60)) $((s % 60)); }

# What runs before the demo (to say afterwards what it started).
running_before="$(bash scripts/stack.sh status | grep ': running' || true)"

say "1/3 starting PostgreSQL and Apache Kafka in the background (scripts/stack.sh up; lines 'stack: …')"
envfile="$(mktemp)"
trap 'rm -f "$envfile"' EXIT
bash scripts/stack.sh up >"$envfile" &
stack_pid=$!

say "2/3 building postal and the demo services meanwhile: ${BUILD[*]}"
if ! "${BUILD[@]}"; then
  wait "$stack_pid" || true
  say "the build failed (see above)"
  exit 1
fi
say "built ($(elapsed) so far); waiting for the stack"
wait "$stack_pid" || { say "the stack did not come up (see the 'stack:' lines above)"; exit 1; }
eval "$(cat "$envfile")"
export DATABASE_URL KAFKA_BOOTSTRAP_SERVERS
say "stack up ($(elapsed) so far): DATABASE_URL=$DATABASE_URL KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS"

say "3/3 running the demo: $TARGET/debug/demo"
rc=0
"$TARGET/debug/demo" || rc=$?
say "finished in $(elapsed) (exit status $rc)"

# What still runs, and how to stop it.
running_now="$(bash scripts/stack.sh status | grep ': running' || true)"
down="bash scripts/stack.sh down"
[ -n "${POSTAL_STACK_DIR:-}" ] && down="POSTAL_STACK_DIR=$POSTAL_STACK_DIR $down"
if [ -z "$running_now" ]; then
  exit "$rc"
fi
if [ -n "$running_before" ]; then
  say "still running, as before the demo (data in ${POSTAL_STACK_DIR:-.stack/}):"
  echo "$running_now" | sed 's/^/  /' >&2
  say "stop them with: $down"
  exit "$rc"
fi
say "still running, started by this demo (data in ${POSTAL_STACK_DIR:-.stack/}):"
echo "$running_now" | sed 's/^/  /' >&2
stop="${DEMO_STOP:-}"
if [ -z "$stop" ] && [ -t 0 ] && [ -t 2 ]; then
  read -r -p "demo: stop them now ($down)? [y/N] " answer || answer=""
  case "$answer" in [yY]*) stop=1 ;; *) stop=0 ;; esac
fi
if [ "$stop" = "1" ]; then
  bash scripts/stack.sh down
  say "stopped"
else
  say "stop them with: $down"
fi
exit "$rc"
