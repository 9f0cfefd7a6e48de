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
cargo build -q -p postal-cli -p postal-examples
./target/debug/demo
