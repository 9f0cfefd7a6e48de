#!/usr/bin/env bash
# Runs every test: brings the local stack up (installing PostgreSQL 15 and RabbitMQ
# and fetching Apache Kafka's jars if missing; a second, SASL_SSL Kafka node for the security
# tests),
# runs the workspace's unit, integration and doc tests against it, then the testcontainers smoke
# step when a Docker engine can run here.
#
#   scripts/test.sh            all of it
#   POSTAL_SKIP_TESTCONTAINERS=1 scripts/test.sh   without the Docker step
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Each step's heading says how long the one before took (CI's log shows where the time goes).
# With CI_STEP_TIMES=<file>, each finished step's time is also appended there (.ci/run prints
# them with its stages' times at the end of its log).
step_t0=$SECONDS
step_name=""
record_step() {
  if [ -n "$step_name" ] && [ -n "${CI_STEP_TIMES:-}" ]; then
    echo "    $step_name: $((SECONDS - step_t0))s${1:-}" >> "$CI_STEP_TIMES"
  fi
}
step() {
  record_step
  echo; echo "=== (previous step: $((SECONDS - step_t0)) s) $* ==="; step_t0=$SECONDS
  step_name="$*"; step_name="${step_name:0:70}"
}
# The last step (or the one that failed) too.
trap 'rc=$?; [ "$rc" = 0 ] && record_step || record_step " (exit $rc)"' EXIT

step "local stack (PostgreSQL 15 + PgBouncer + Apache Kafka + RabbitMQ, no Docker)"
eval "$(bash scripts/stack.sh up)"
export DATABASE_URL KAFKA_BOOTSTRAP_SERVERS AMQP_URL
echo "DATABASE_URL=$DATABASE_URL KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS AMQP_URL=$AMQP_URL"
# PgBouncer (the stack installs Debian's 1.18): the poolers:: tests start instances of their
# own with this binary, and fail rather than skip without it.
export POSTAL_PGBOUNCER_BIN POSTAL_PGBOUNCER_TRANSACTION_URL POSTAL_PGBOUNCER_SESSION_URL POSTAL_REQUIRE_PGBOUNCER=1

step "a second Kafka node with SASL_SSL, SCRAM and ACLs, and a PostgreSQL that takes only TLS (the security tests)"
eval "$(bash scripts/stack.sh kafka-up --secure)"
eval "$(bash scripts/stack.sh pg-up --secure)"
export POSTGRES_TLS_URL POSTGRES_TLS_CA
export KAFKA_SASL_SSL_BOOTSTRAP KAFKA_SASL_SSL_CA KAFKA_SASL_SSL_RELAY_PASSWORD \
  KAFKA_SASL_SSL_CONSUMER_PASSWORD KAFKA_SASL_SSL_ADMIN_PASSWORD POSTAL_REQUIRE_SECURE=1
echo "KAFKA_SASL_SSL_BOOTSTRAP=$KAFKA_SASL_SSL_BOOTSTRAP"

step "the JVM interop jar (kafka-clients + the CloudEvents SDK, for the interop tests; scripts/interop-jar.sh)"
eval "$(bash scripts/interop-jar.sh)"
export POSTAL_INTEROP_JAR POSTAL_INTEROP_REQUIRE=1

step "chromium and playwright-core for the dashboard's browser tests (scripts/stack.sh browser)"
eval "$(bash scripts/stack.sh browser)"
export CHROMIUM POSTAL_REQUIRE_BROWSER

step "binaries the suite runs: postal, the fixture services (order_service, billing_service, …), the examples"
# The services are postal-demo's binaries (demo/src/bin/, which the demo runs too), the task
# worker and roundtrip postal-integration-tests' own (integration-tests/src/bin/),
# built with its tests anyway; the examples (examples/*.rs) are run by the suite's examples::.
cargo build -p postal-cli -p postal-demo -p postal-integration-tests --bins -p postal-examples --examples

step "the previous release's relay (for the upgrade-contract test; scripts/previous-release; after the current build, whose dependencies it reuses)"
eval "$(bash scripts/previous-release.sh)"
export POSTAL_PREVIOUS_BIN POSTAL_REQUIRE_PREVIOUS=1

step "workspace tests against the local stack (external-services mode; smoke:: among them)"
# Four at a time: most tests wait on the broker or the database, not on the two cores
# (POSTAL_TEST_THREADS to change it).
# The row_locks_* tests steer PostgreSQL's cluster-wide multixact counter to collide with a
# claim's transaction id: another test creating a multixact meanwhile (any two sessions
# share-locking one row) moves it. They run alone, in the step after this one (seen once:
# "first's multixact is claim E's xid (another multixact creator ran?)", 3,332,089 against
# 3,332,088, passing alone 2 of 2).
cargo test --workspace --all-targets --no-fail-fast -- --test-threads="${POSTAL_TEST_THREADS:-4}" \
  --skip chaos:: --skip netsplit:: --skip cluster:: --skip row_locks_

step "tests that steer the cluster-wide multixact counter, alone (row_locks_*)"
cargo test -p postal-integration-tests --test suite -- --test-threads=1 row_locks_

step "fault suites in two processes side by side: kill -9 and restarts (chaos); a 3-node Kafka cluster losing brokers (cluster, short), then network partitions between test hosts (netsplit)"
# POSTAL_CHAOS_SOAK=1 for the long chaos soak (200,000 orders, 60 kills each); the full
# cluster run is `-- --ignored cluster::`. Each test runs its own PostgreSQL and brokers
# (free ports), and test hosts take their addresses from the process id: the two processes
# share nothing but the cores (one after the other they took 913 s here, chaos 4 tests in
# about 300 s of it). Each one's output is printed whole after both end.
fault_suite() {
  local name="$1"; shift
  local rc=0
  cargo test -p postal-integration-tests --test suite -- --nocapture --test-threads=1 "$@" \
    > "target/fault-$name.log" 2>&1 || rc=$?
  echo "$rc" > "target/fault-$name.rc"
}
mkdir -p target
cargo test -q -p postal-integration-tests --test suite --no-run
fault_suite chaos chaos:: &
fault_suite cluster-netsplit cluster:: netsplit:: &
wait
fault_rc=0
for name in chaos cluster-netsplit; do
  echo "--- fault suite: $name (exit $(cat "target/fault-$name.rc")) ---"
  cat "target/fault-$name.log"
  [ "$(cat "target/fault-$name.rc")" = "0" ] || fault_rc=1
done
[ "$fault_rc" = "0" ]

step "doc tests"
cargo test --workspace --doc

if [ "${POSTAL_SKIP_TESTCONTAINERS:-0}" = "1" ]; then
  step "testcontainers smoke test: skipped (POSTAL_SKIP_TESTCONTAINERS=1)"
  exit 0
fi
step "testcontainers smoke test (local images, Docker engine)"
rc=0
bash scripts/testcontainers-images.sh all || rc=$?
if [ "$rc" = "3" ]; then
  echo "testcontainers smoke test NOT RUN: the Docker engine cannot start on this machine (see above)."
  exit 0
fi
exit "$rc"
