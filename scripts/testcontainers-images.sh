#!/usr/bin/env bash
# Proves the testcontainers path on a machine without an image registry:
#   1. makes sure a Docker engine runs (installs Debian's docker.io and starts dockerd if needed);
#   2. builds two local images from a debootstrap'd Debian rootfs (no registry involved):
#        postal-local/postgres:15   PostgreSQL 15, trust auth, listening on 5432
#        postal-local/tansu:<ver>   the tansu broker binary of this machine
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
TANSU_VERSION="${POSTAL_TANSU_VERSION:-0.6.0}"
TANSU_IMAGE="postal-local/tansu:$TANSU_VERSION"
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
  if [ -f "$fs/.complete" ]; then echo "$fs"; return; fi
  command -v debootstrap >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  rm -rf "$fs"; mkdir -p "$fs"
  log "debootstrap bookworm with postgresql-15 (about 1.5 minutes)"
  debootstrap --variant=minbase --include=postgresql-15 bookworm "$fs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
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
  touch "$fs/.complete"
  echo "$fs"
}

build() {
  if ! docker image inspect "$PG_IMAGE" >/dev/null 2>&1 || ! docker image inspect "$TANSU_IMAGE" >/dev/null 2>&1; then
    local fs; fs="$(rootfs)"
    local tansu; tansu="$(bash "$ROOT/scripts/stack.sh" ensure-tools >&2; command -v tansu || echo "$HOME/.cargo/bin/tansu")"
    if ! docker image inspect "$PG_IMAGE" >/dev/null 2>&1; then
      log "importing $PG_IMAGE"
      tar -C "$fs" --exclude=./.complete -c . | docker import \
        --change 'ENTRYPOINT ["/usr/local/bin/postal-postgres"]' \
        --change 'EXPOSE 5432' - "$PG_IMAGE" >/dev/null
    fi
    if ! docker image inspect "$TANSU_IMAGE" >/dev/null 2>&1; then
      log "importing $TANSU_IMAGE (binary $tansu)"
      install -D -m 0755 "$tansu" "$fs/usr/local/bin/tansu"
      mkdir -p "$fs/var/lib/tansu"
      tar -C "$fs" --exclude=./.complete -c . | docker import \
        --change 'ENTRYPOINT ["/usr/local/bin/tansu"]' \
        --change 'WORKDIR /var/lib/tansu' - "$TANSU_IMAGE" >/dev/null
      rm -f "$fs/usr/local/bin/tansu"
    fi
  fi
  log "images ready: $PG_IMAGE $TANSU_IMAGE"
}

smoke() {
  log "smoke test through testcontainers (DATABASE_URL and KAFKA_BOOTSTRAP_SERVERS unset)"
  local rc=0
  (cd "$ROOT" && env -u DATABASE_URL -u KAFKA_BOOTSTRAP_SERVERS \
    POSTAL_TEST_PG_IMAGE="$PG_IMAGE" POSTAL_TEST_KAFKA_IMAGE="$TANSU_IMAGE" \
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
