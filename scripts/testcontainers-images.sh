#!/usr/bin/env bash
# Proves the testcontainers path on a machine without an image registry:
#   1. makes sure a Docker engine runs (installs Debian's docker.io and starts dockerd if needed);
#   2. builds two local images from a debootstrap'd Debian rootfs (no registry involved):
#        postal-local/postgres:15   PostgreSQL 15, trust auth, listening on 5432
#        postal-local/kafka:<ver>   Apache Kafka from the jars scripts/stack.sh fetched (the same
#                                   version the local stack runs), on Debian's OpenJDK 17
#   3. runs the integration suite's smoke test with DATABASE_URL / KAFKA_BOOTSTRAP_SERVERS unset,
#      so the harness starts both services through testcontainers.
#
#   scripts/testcontainers-images.sh [build|smoke|all]     (default: all)
#
# Exit codes: 0 ok; 3 the Docker engine cannot start here (said plainly); other: a real failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/.images"
PG_IMAGE="postal-local/postgres:15"
KAFKA_VERSION="${POSTAL_KAFKA_VERSION:-4.4.0}"
KAFKA_IMAGE="postal-local/kafka:$KAFKA_VERSION"
MIRROR="${POSTAL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

log() { echo "testcontainers-images: $*" >&2; }

ensure_engine() {
  if docker info >/dev/null 2>&1; then return 0; fi
  if ! command -v dockerd >/dev/null 2>&1; then
    log "installing docker.io"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null 2>&1 || {
      log "DOCKER ENGINE CANNOT START ON THIS MACHINE: apt-get install docker.io failed"; return 3; }
  fi
  mkdir -p "$WORK"
  log "starting dockerd (log: $WORK/dockerd.log)"
  (dockerd >"$WORK/dockerd.log" 2>&1 &)
  for _ in $(seq 1 120); do
    if docker info >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  log "DOCKER ENGINE CANNOT START ON THIS MACHINE; last dockerd log lines:"
  tail -5 "$WORK/dockerd.log" >&2 || true
  return 3
}

rootfs() {
  local fs="$WORK/rootfs"
  if [ -f "$fs/.complete-2" ]; then echo "$fs"; return; fi
  command -v debootstrap >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  rm -rf "$fs"; mkdir -p "$fs"
  log "debootstrap bookworm with postgresql-15 and openjdk-17-jre-headless (a few minutes)"
  debootstrap --variant=minbase --include=postgresql-15,openjdk-17-jre-headless bookworm "$fs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; return 1; }
  cat > "$fs/usr/local/bin/postal-postgres" <<'SH'
#!/bin/sh
# Entry point of postal-local/postgres: a throwaway cluster with trust auth on all interfaces.
set -e
PGDATA=/var/lib/postgresql/data
if [ ! -f "$PGDATA/PG_VERSION" ]; then
  mkdir -p "$PGDATA" && chown postgres:postgres "$PGDATA"
  su postgres -s /bin/sh -c "/usr/lib/postgresql/15/bin/initdb -D $PGDATA -U postgres --auth=trust -E UTF8 --locale=C.UTF-8" >/dev/null
  echo "host all all 0.0.0.0/0 trust" >> "$PGDATA/pg_hba.conf"
fi
exec su postgres -s /bin/sh -c "exec /usr/lib/postgresql/15/bin/postgres -D $PGDATA -c listen_addresses='*' -c max_connections=300"
SH
  chmod +x "$fs/usr/local/bin/postal-postgres"
  cat > "$fs/usr/local/bin/postal-kafka" <<'SH'
#!/bin/sh
# Entry point of postal-local/kafka: a throwaway single-node KRaft cluster listening on
# $KAFKA_PORT (default 9092) on all interfaces and advertising 127.0.0.1:$KAFKA_PORT (the
# harness maps the port 1:1), with the settings of scripts/stack.sh.
set -e
PORT="${KAFKA_PORT:-9092}"
D=/var/lib/kafka
mkdir -p "$D/data" "$D/logs"
cat > "$D/server.properties" <<CONF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:9093
listeners=PLAINTEXT://0.0.0.0:$PORT,CONTROLLER://127.0.0.1:9093
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$D/data
auto.create.topics.enable=false
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
CONF
CP="/opt/kafka/lib/*"
[ -f "$D/data/meta.properties" ] || java -Xmx256M -cp "$CP" kafka.tools.StorageTool format \
  -t "$(java -Xmx256M -cp "$CP" kafka.tools.StorageTool random-uuid)" -c "$D/server.properties" >/dev/null
exec java -Xms512m -Xmx512m -XX:+UseG1GC -Djava.awt.headless=true \
  -Dlog4j2.configurationFile=/opt/kafka/log4j2.properties -Dkafka.logs.dir="$D/logs" \
  -cp "$CP" kafka.Kafka "$D/server.properties"
SH
  chmod +x "$fs/usr/local/bin/postal-kafka"
  touch "$fs/.complete-2"
  echo "$fs"
}

build() {
  if ! docker image inspect "$PG_IMAGE" >/dev/null 2>&1 || ! docker image inspect "$KAFKA_IMAGE" >/dev/null 2>&1; then
    local fs; fs="$(rootfs)"
    if ! docker image inspect "$PG_IMAGE" >/dev/null 2>&1; then
      log "importing $PG_IMAGE"
      tar -C "$fs" --exclude='./.complete*' -c . | docker import \
        --change 'ENTRYPOINT ["/usr/local/bin/postal-postgres"]' \
        --change 'EXPOSE 5432' - "$PG_IMAGE" >/dev/null
    fi
    if ! docker image inspect "$KAFKA_IMAGE" >/dev/null 2>&1; then
      # The same jars as the local stack (fetched by Maven on first use).
      POSTAL_NO_RABBITMQ=1 bash "$ROOT/scripts/stack.sh" ensure-tools >&2
      local lib="${POSTAL_KAFKA_LIB:-$ROOT/.stack/kafka-lib}"
      log "importing $KAFKA_IMAGE (jars from $lib)"
      mkdir -p "$fs/opt/kafka/lib"
      cp "$lib"/*.jar "$fs/opt/kafka/lib/"
      cp "$ROOT/scripts/kafka/log4j2.properties" "$fs/opt/kafka/log4j2.properties"
      tar -C "$fs" --exclude='./.complete*' -c . | docker import \
        --change 'ENTRYPOINT ["/usr/local/bin/postal-kafka"]' - "$KAFKA_IMAGE" >/dev/null
      rm -rf "$fs/opt/kafka"
    fi
  fi
  log "images ready: $PG_IMAGE $KAFKA_IMAGE"
}

smoke() {
  log "smoke test through testcontainers (DATABASE_URL and KAFKA_BOOTSTRAP_SERVERS unset)"
  local rc=0
  (cd "$ROOT" && env -u DATABASE_URL -u KAFKA_BOOTSTRAP_SERVERS \
    POSTAL_TEST_PG_IMAGE="$PG_IMAGE" POSTAL_TEST_KAFKA_IMAGE="$KAFKA_IMAGE" \
    POSTAL_EXPECT_MODE=testcontainers \
    cargo test -p postal-integration-tests --test suite -- --nocapture smoke) || rc=$?
  # The harness keeps its containers for the life of the test process; remove them now.
  docker ps -aq --filter label=postal-test=1 | xargs -r docker rm -f >/dev/null 2>&1 || true
  return $rc
}

case "${1:-all}" in
  rootfs) rootfs >/dev/null ;;
  build) ensure_engine || exit $?; build ;;
  smoke) ensure_engine || exit $?; smoke ;;
  all) ensure_engine || exit $?; build; smoke ;;
  *) sed -n '2,14p' "$0"; exit 2 ;;
esac
