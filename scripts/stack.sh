#!/usr/bin/env bash
# Local stack without Docker: a PostgreSQL 15 cluster, a tansu Kafka-protocol broker and a
# RabbitMQ node, all on loopback, all kept in the project-local, git-ignored directory .stack/.
#
#   scripts/stack.sh up [--storage memory|sqlite]   start (harmless when already up)
#   scripts/stack.sh down                           stop exactly what `up` started (by pid)
#   scripts/stack.sh env                            print DATABASE_URL, KAFKA_BOOTSTRAP_SERVERS, AMQP_URL
#   scripts/stack.sh status                         say what runs
#   scripts/stack.sh restart-broker [--storage …]   restart tansu only (memory storage starts empty)
#   scripts/stack.sh ensure-tools                   install PostgreSQL 15 / tansu / rabbitmq-server if missing
#
# Ports: POSTAL_PG_PORT (default 15432), POSTAL_KAFKA_PORT (default 19092), POSTAL_AMQP_PORT
# (default 25672; Erlang distribution on the next port). All below Linux's ephemeral range
# (32768+), so that no client socket can hold them while a server boots. POSTAL_NO_RABBITMQ=1 leaves RabbitMQ out.
# Storage: --storage or POSTAL_BROKER_STORAGE: memory (default; fast, for benchmarks) or
# sqlite (durable, .stack/tansu/tansu.db; survives kill -9 and restart).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${POSTAL_STACK_DIR:-$ROOT/.stack}"
PG_PORT="${POSTAL_PG_PORT:-15432}"
KAFKA_PORT="${POSTAL_KAFKA_PORT:-19092}"
STORAGE="${POSTAL_BROKER_STORAGE:-memory}"
TANSU_VERSION="${POSTAL_TANSU_VERSION:-0.6.0}"
PG_BIN="${POSTAL_PG_BIN:-/usr/lib/postgresql/15/bin}"
AMQP_PORT="${POSTAL_AMQP_PORT:-25672}"
RABBITMQ_BIN="${POSTAL_RABBITMQ_BIN:-/usr/lib/rabbitmq/bin/rabbitmq-server}"
WITH_RABBITMQ=1
[ "${POSTAL_NO_RABBITMQ:-0}" = "1" ] && WITH_RABBITMQ=0

log() { echo "stack: $*" >&2; }
die() { echo "stack: error: $*" >&2; exit 1; }

tansu_bin() {
  if [ -n "${POSTAL_TANSU_BIN:-}" ]; then echo "$POSTAL_TANSU_BIN"; return; fi
  if command -v tansu >/dev/null 2>&1; then command -v tansu; return; fi
  if [ -x "$HOME/.cargo/bin/tansu" ]; then echo "$HOME/.cargo/bin/tansu"; return; fi
  echo ""
}

# apt_install PACKAGE EXECUTABLE: installs the Debian package that provides EXECUTABLE.
apt_install() {
  local pkg="$1" exe="$2"
  log "$exe missing: installing the Debian package $pkg"
  command -v apt-get >/dev/null || die "no $exe and no apt-get to install $pkg"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  # policy-rc.d keeps the package from starting its own server.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null
  rm -f /usr/sbin/policy-rc.d
  [ -x "$exe" ] || die "$pkg installed but $exe is missing"
}

ensure_postgres() {
  if [ -x "$PG_BIN/initdb" ]; then return; fi
  apt_install postgresql-15 "$PG_BIN/initdb"
}

ensure_tansu() {
  if [ -n "$(tansu_bin)" ]; then return; fi
  log "tansu missing: cargo install tansu@$TANSU_VERSION (about 12 minutes on 2 cores, once per machine)"
  cargo install tansu --version "$TANSU_VERSION" --locked --features dynostore,libsql >&2 \
    || die "cargo install tansu failed"
}

ensure_rabbitmq() {
  if [ -x "$RABBITMQ_BIN" ]; then return; fi
  apt_install rabbitmq-server "$RABBITMQ_BIN"
}

# initdb refuses to run as root, so the cluster belongs to the postgres user, who must be able to
# reach the data directory: give every ancestor the search (x) bit for others if it lacks it.
open_path_for_postgres() {
  local d="$1"
  while [ "$d" != "/" ]; do
    if [ "$(stat -c %A "$d" | cut -c10)" != "x" ] && [ "$(stat -c %A "$d" | cut -c10)" != "t" ]; then
      chmod o+x "$d"
    fi
    d="$(dirname "$d")"
  done
}

as_postgres() {
  if [ "$(id -u)" = "0" ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

pg_running() {
  [ -f "$STACK/pg/data/postmaster.pid" ] && as_postgres "$PG_BIN/pg_ctl" -D "$STACK/pg/data" status >/dev/null 2>&1
}

pg_up() {
  ensure_postgres
  mkdir -p "$STACK/pg"
  if [ "$(id -u)" = "0" ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
    chown postgres "$STACK/pg"
    open_path_for_postgres "$STACK/pg"
  fi
  if pg_running; then log "postgres already running on 127.0.0.1:$PG_PORT"; return; fi
  if [ ! -f "$STACK/pg/data/PG_VERSION" ]; then
    log "initdb $STACK/pg/data"
    as_postgres "$PG_BIN/initdb" -D "$STACK/pg/data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >/dev/null
    cat >> "$STACK/pg/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$STACK/pg'
max_connections = 300
shared_buffers = 256MB
max_wal_size = 2GB
# postal-bench e2e measures order commit -> ledger commit from commit timestamps
track_commit_timestamp = on
CONF
  fi
  log "starting postgres on 127.0.0.1:$PG_PORT"
  # The port on the command line wins over the one initdb wrote, so POSTAL_PG_PORT also
  # applies to an existing cluster.
  as_postgres "$PG_BIN/pg_ctl" -D "$STACK/pg/data" -o "-p $PG_PORT" -l "$STACK/pg/postgres.log" -w -t 60 start >/dev/null \
    || { tail -20 "$STACK/pg/postgres.log" >&2; die "postgres did not start"; }
}

pg_down() {
  if pg_running; then
    log "stopping postgres"
    as_postgres "$PG_BIN/pg_ctl" -D "$STACK/pg/data" -m fast -w stop >/dev/null
  fi
}

tansu_pid() {
  local f="$STACK/tansu/tansu.pid"
  [ -f "$f" ] || return 1
  local pid; pid="$(cat "$f")"
  # Only a live process that is still our tansu counts.
  [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q tansu && echo "$pid"
}

wait_port() {
  local port="$1" secs="$2"
  for _ in $(seq 1 $((secs * 10))); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  return 1
}

tansu_up() {
  ensure_tansu
  mkdir -p "$STACK/tansu"
  if pid="$(tansu_pid)"; then log "tansu already running (pid $pid) on 127.0.0.1:$KAFKA_PORT"; return; fi
  local engine
  case "$STORAGE" in
    memory) engine="memory://tansu/" ;;
    sqlite) engine="sqlite://tansu.db" ;;
    *) die "unknown storage '$STORAGE' (memory or sqlite)" ;;
  esac
  log "starting tansu on 127.0.0.1:$KAFKA_PORT (storage $STORAGE)"
  (
    cd "$STACK/tansu"
    exec "$(tansu_bin)" broker \
      --kafka-cluster-id postal \
      --kafka-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
      --kafka-advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
      --storage-engine "$engine" \
      ${POSTAL_TANSU_ARGS:-} >>"$STACK/tansu/tansu.log" 2>&1
  ) &
  echo $! > "$STACK/tansu/tansu.pid"
  echo "$STORAGE" > "$STACK/tansu/storage"
  wait_port "$KAFKA_PORT" 30 || { tail -20 "$STACK/tansu/tansu.log" >&2; die "tansu did not open port $KAFKA_PORT"; }
}

tansu_down() {
  if pid="$(tansu_pid)"; then
    log "stopping tansu (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$STACK/tansu/tansu.pid"
}

rabbit_pid() {
  local f="$STACK/rabbitmq/wrapper.pid"
  [ -f "$f" ] || return 1
  local pid; pid="$(cat "$f")"
  [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q rabbitmq-server && echo "$pid"
}

# A private node: its own name, ports, cookie ($HOME) and data directory under .stack/rabbitmq.
rabbit_up() {
  ensure_rabbitmq
  local d="$STACK/rabbitmq"
  mkdir -p "$d"
  if pid="$(rabbit_pid)"; then log "rabbitmq already running (pid $pid) on 127.0.0.1:$AMQP_PORT"; return; fi
  echo "[]." > "$d/enabled_plugins"
  echo "loopback_users = none" > "$d/rabbitmq.conf"
  log "starting rabbitmq on 127.0.0.1:$AMQP_PORT"
  (
    export HOME="$d" RABBITMQ_NODENAME="postal-stack-$AMQP_PORT@localhost" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
      RABBITMQ_NODE_PORT="$AMQP_PORT" RABBITMQ_DIST_PORT="$((AMQP_PORT + 1))" \
      RABBITMQ_MNESIA_BASE="$d/mnesia" RABBITMQ_LOG_BASE="$d/log" RABBITMQ_CONFIG_FILE="$d/rabbitmq" \
      RABBITMQ_ENABLED_PLUGINS_FILE="$d/enabled_plugins" RABBITMQ_PID_FILE="$d/beam.pid" RABBITMQ_LOGS=-
    exec "$RABBITMQ_BIN" >>"$d/rabbitmq.log" 2>&1 </dev/null
  ) &
  local pid=$!
  echo "$pid" > "$d/wrapper.pid"
  for _ in $(seq 1 900); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$AMQP_PORT") 2>/dev/null; then return 0; fi
    kill -0 "$pid" 2>/dev/null || { tail -20 "$d/rabbitmq.log" >&2; die "rabbitmq exited during start-up (log: $d/rabbitmq.log)"; }
    sleep 0.1
  done
  tail -20 "$d/rabbitmq.log" >&2; die "rabbitmq did not open port $AMQP_PORT"
}

rabbit_down() {
  if pid="$(rabbit_pid)"; then
    log "stopping rabbitmq (pid $pid)"
    # The start script stops the node cleanly on SIGTERM.
    kill -TERM "$pid"
    for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      [ -f "$STACK/rabbitmq/beam.pid" ] && kill -KILL "$(cat "$STACK/rabbitmq/beam.pid")" 2>/dev/null || true
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$STACK/rabbitmq/wrapper.pid"
}

print_env() {
  echo "export DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres"
  echo "export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$KAFKA_PORT"
  if [ "$WITH_RABBITMQ" = "1" ]; then echo "export AMQP_URL=amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f"; fi
}

cmd="${1:-}"; shift || true
while [ $# -gt 0 ]; do
  case "$1" in
    --storage) STORAGE="$2"; shift 2 ;;
    --storage=*) STORAGE="${1#*=}"; shift ;;
    *) die "unknown argument $1" ;;
  esac
done

case "$cmd" in
  up) pg_up; tansu_up; if [ "$WITH_RABBITMQ" = "1" ]; then rabbit_up; fi; print_env ;;
  pg-up) pg_up; print_env ;;
  restart-broker) tansu_down; tansu_up; print_env ;;
  down) rabbit_down; tansu_down; pg_down ;;
  env) print_env ;;
  ensure-tools) ensure_postgres; ensure_tansu; if [ "$WITH_RABBITMQ" = "1" ]; then ensure_rabbitmq; fi ;;
  status)
    if pg_running; then echo "postgres: running on 127.0.0.1:$PG_PORT"; else echo "postgres: stopped"; fi
    if pid="$(tansu_pid)"; then echo "tansu: running (pid $pid, storage $(cat "$STACK/tansu/storage" 2>/dev/null)) on 127.0.0.1:$KAFKA_PORT"; else echo "tansu: stopped"; fi
    if pid="$(rabbit_pid)"; then echo "rabbitmq: running (pid $pid) on 127.0.0.1:$AMQP_PORT"; else echo "rabbitmq: stopped"; fi ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
