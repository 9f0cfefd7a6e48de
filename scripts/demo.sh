#!/usr/bin/env bash
# Postal's main job on a fresh machine: bring the local stack up (PostgreSQL + Apache Kafka, no
# Docker needed), then run the relay, the order service, the billing service and the invoice recorder
# as separate processes and print a summary. Exits non-zero if any order was not applied
# exactly once. DEMO_ORDERS / DEMO_RATE / DEMO_CUSTOMERS tune the run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
eval "$(bash scripts/stack.sh up)"
export DATABASE_URL KAFKA_BOOTSTRAP_SERVERS
# The relay is `postal`; the services and the demo driver are fixtures of the integration suite
# (integration-tests/src/bin/).
cargo build -q -p postal-cli -p postal-integration-tests --bins
"${CARGO_TARGET_DIR:-target}/debug/demo"
