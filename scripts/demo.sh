#!/usr/bin/env bash
# Postal's main job on a fresh machine: bring the local stack up (no Docker needed), apply the
# schema, and run a round trip through the outbox, the relay and Kafka.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
eval "$(bash scripts/stack.sh up)"
export DATABASE_URL KAFKA_BOOTSTRAP_SERVERS
cargo build -q -p postal-cli -p postal-examples
./target/debug/postal migrate
./target/debug/roundtrip
