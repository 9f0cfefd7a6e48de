#!/usr/bin/env bash
# Local stack without Docker: a PostgreSQL 15 cluster, an Apache Kafka 4.x broker (KRaft, from its
# Maven Central jars) and a RabbitMQ node, all on loopback, all kept in the project-local,
# git-ignored directory .stack/.
#
#   scripts/stack.sh up               start (harmless when already up); prints the env below
#   scripts/stack.sh down             stop exactly what `up` started (by pid)
#   scripts/stack.sh env              print DATABASE_URL, KAFKA_BOOTSTRAP_SERVERS, AMQP_URL
#   scripts/stack.sh status           say what runs
#   scripts/stack.sh restart-broker   kill -9 Kafka and start it again on the same data
#   scripts/stack.sh pg-up | kafka-up | kafka-down | kafka-kill [NODE…]   one service only
#   scripts/stack.sh pg-up --secure   a second PostgreSQL that takes only TLS connections with a
#                                     password (certificate from a local CA), in .stack/pg-secure
#                                     on POSTAL_PG_SECURE_PORT (PG port + 10); prints
#                                     POSTGRES_TLS_URL and POSTGRES_TLS_CA
#   … --secure                        Kafka as one node with a SASL_SSL listener (SCRAM-SHA-512,
#                                     certificates from a local CA made on first start) and
#                                     the standard authorizer with ACLs, in .stack/kafka-secure;
#                                     `--secure acl ARGS…` runs Kafka's AclCommand as its admin;
#                                     `--secure acl-repl` the same once per input line
#                                     (tab-separated ARGS) in one JVM
#   … --cluster 3                     Kafka as a 3-node KRaft cluster (every node broker and
#                                     controller; topics replicated 3 times, min.insync.replicas 2)
#                                     on POSTAL_KAFKA_CLUSTER_PORT (29092), 29094, 29096, data in
#                                     .stack/kafka-cluster; kafka-kill 2 kill -9s node 2 only
#   scripts/stack.sh pooler-up | pooler-down   the two PgBouncer instances only (below)
#   scripts/stack.sh ensure-tools     install PostgreSQL 15 / rabbitmq-server / pgbouncer / iproute2 / chromium (apt),
#                                     fetch Kafka's jars (Maven, scripts/kafka/pom.xml) and
#                                     playwright-core (npm ci in admin/browser) if missing
#   scripts/stack.sh browser          chromium and playwright-core only; prints their exports
#
# Ports: POSTAL_PG_PORT (default 15432), POSTAL_KAFKA_PORT (default 19092; its KRaft controller
# on POSTAL_KAFKA_CONTROLLER_PORT, default the next port), POSTAL_AMQP_PORT (default 25672; Erlang
# distribution on the next port). All below Linux's ephemeral range (32768+), so that no client
# socket can hold them while a server boots. POSTAL_NO_RABBITMQ=1 leaves RabbitMQ out.
# PgBouncer (Debian's 1.18, installed if missing; POSTAL_NO_PGBOUNCER=1 leaves it out): two
# instances in front of the stack's PostgreSQL, any database name passed through, trust auth,
# `ignore_startup_parameters = extra_float_digits`, 20 server connections per database and
# user — one in transaction mode on POSTAL_PGBOUNCER_PORT (default 16432, folder
# .stack/pgbouncer-transaction), one in session mode on the next port (16433,
# .stack/pgbouncer-session). `env` prints their URLs (POSTAL_PGBOUNCER_TRANSACTION_URL,
# POSTAL_PGBOUNCER_SESSION_URL) and the binary (POSTAL_PGBOUNCER_BIN), with which the suite's
# poolers:: tests start private instances of their own (docs/operations.md#poolers).
# POSTAL_STACK_HOST (127.0.0.1): the address PostgreSQL and Kafka listen on and advertise.
# Kafka: POSTAL_KAFKA_VERSION (4.4.0), POSTAL_KAFKA_HEAP (1g), POSTAL_KAFKA_LIB (jar folder,
# .stack/kafka-lib). Broker logs: .stack/kafka/logs (server.log; broker.log has warnings).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${POSTAL_STACK_DIR:-$ROOT/.stack}"
# The address every service listens on and advertises (tests that put the stack on a test
# host's network namespace pass that host's address).
HOST="${POSTAL_STACK_HOST:-127.0.0.1}"
PG_PORT="${POSTAL_PG_PORT:-15432}"
PG_SECURE_PORT="${POSTAL_PG_SECURE_PORT:-$((PG_PORT + 10))}"
KAFKA_PORT="${POSTAL_KAFKA_PORT:-19092}"
KAFKA_CONTROLLER_PORT="${POSTAL_KAFKA_CONTROLLER_PORT:-$((KAFKA_PORT + 1))}"
KAFKA_VERSION="${POSTAL_KAFKA_VERSION:-4.4.0}"
KAFKA_LIB="${POSTAL_KAFKA_LIB:-$ROOT/.stack/kafka-lib}"
KAFKA_HEAP="${POSTAL_KAFKA_HEAP:-1g}"
KAFKA_CLUSTER_PORT="${POSTAL_KAFKA_CLUSTER_PORT:-29092}"
NODES=0
SECURE=0
KAFKA_SECURE_PORT="${POSTAL_KAFKA_SECURE_PORT:-$((KAFKA_PORT + 10))}"
PG_BIN="${POSTAL_PG_BIN:-/usr/lib/postgresql/15/bin}"
AMQP_PORT="${POSTAL_AMQP_PORT:-25672}"
RABBITMQ_BIN="${POSTAL_RABBITMQ_BIN:-/usr/lib/rabbitmq/bin/rabbitmq-server}"
WITH_RABBITMQ=1
[ "${POSTAL_NO_RABBITMQ:-0}" = "1" ] && WITH_RABBITMQ=0
PGBOUNCER_BIN="${POSTAL_PGBOUNCER_BIN:-/usr/sbin/pgbouncer}"
PGBOUNCER_PORT="${POSTAL_PGBOUNCER_PORT:-16432}"
WITH_PGBOUNCER=1
[ "${POSTAL_NO_PGBOUNCER:-0}" = "1" ] && WITH_PGBOUNCER=0

log() { echo "stack: $*" >&2; }
die() { echo "stack: error: $*" >&2; exit 1; }

# apt_install PACKAGE EXECUTABLE: installs the Debian package that provides EXECUTABLE, showing
# its progress (apt's download size and one line per package set up) on stderr.
apt_install() {
  local pkg="$1" exe="$2" t0=$SECONDS
  log "$exe missing: installing the Debian package $pkg (apt-get update, then apt-get install)"
  command -v apt-get >/dev/null || die "no $exe and no apt-get to install $pkg"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  log "  apt-get update done ($((SECONDS - t0)) s)"
  # policy-rc.d keeps the package from starting its own server.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o Dpkg::Progress-Fancy=0 "$pkg" 2>&1 \
    | awk '/^(Need to get|Setting up|E:)/ { print "stack:   apt: " $0; fflush() }' >&2 \
    || { rm -f /usr/sbin/policy-rc.d; die "apt-get install $pkg failed (see the apt lines above)"; }
  rm -f /usr/sbin/policy-rc.d
  [ -x "$exe" ] || die "$pkg installed but $exe is missing"
  log "  $pkg installed ($((SECONDS - t0)) s)"
}

ensure_postgres() {
  if [ -x "$PG_BIN/initdb" ]; then return; fi
  apt_install postgresql-15 "$PG_BIN/initdb"
}

# iproute2 (`ip netns`, `tc`): the network-partition tests make their own test hosts with it.
ensure_iproute() {
  if command -v ip >/dev/null && command -v tc >/dev/null; then return; fi
  apt_install iproute2 /usr/sbin/ip
}

# The broker's jars: scripts/kafka/pom.xml names them, Maven fetches them into $KAFKA_LIB once
# (later runs reuse them; POSTAL_KAFKA_LIB points at another folder of the same jars).
ensure_kafka() {
  command -v java >/dev/null || die "java is missing: Apache Kafka 4.x needs a JDK 17 or newer (apt-get install openjdk-17-jre-headless)"
  if [ -f "$KAFKA_LIB/.complete-$KAFKA_VERSION" ]; then return; fi
  command -v mvn >/dev/null || die "mvn is missing: Maven fetches Kafka's jars (apt-get install maven), or set POSTAL_KAFKA_LIB to a folder holding them"
  log "fetching Apache Kafka $KAFKA_VERSION jars into $KAFKA_LIB (about 55 MB from Maven Central; Maven's ~/.m2 keeps them for later clones):"
  local t0=$SECONDS
  rm -rf "$KAFKA_LIB.partial"
  # Progress: a count of the files Maven downloads (none when ~/.m2 has them; about 490 into an
  # empty one), every 100, and its errors; the rest of its output is left out.
  mvn -B -Dstyle.color=never -f "$ROOT/scripts/kafka/pom.xml" -Dkafka.version="$KAFKA_VERSION" \
    org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$KAFKA_LIB.partial" 2>&1 \
    | awk '/^\[ERROR\]/ { print "stack:   " $0; fflush(); next }
           /^\[INFO\] Downloaded from/ { n++; if (n % 100 == 0) { print "stack:   maven: " n " files downloaded"; fflush() } }
           END { print "stack:   maven: " n + 0 " files downloaded" }' >&2 \
    || die "Maven could not fetch Kafka's jars (is Maven Central reachable? see the output above)"
  log "  Kafka's jars: $(ls "$KAFKA_LIB.partial" | wc -l) files, $(du -sm "$KAFKA_LIB.partial" | cut -f1) MB ($((SECONDS - t0)) s)"
  rm -rf "$KAFKA_LIB"; mv "$KAFKA_LIB.partial" "$KAFKA_LIB"
  touch "$KAFKA_LIB/.complete-$KAFKA_VERSION"
}

# The dashboard's browser tests: Debian's chromium, and playwright-core from npm (pinned in
# admin/browser/package-lock.json) to drive it.
ensure_browser() {
  local chromium="${CHROMIUM:-/usr/bin/chromium}"
  [ -x "$chromium" ] || apt_install chromium "$chromium"
  if [ ! -d "$ROOT/admin/browser/node_modules/playwright-core" ]; then
    command -v npm >/dev/null || die "npm is missing: the dashboard's browser tests need Node.js 20 and npm"
    log "installing playwright-core into admin/browser/node_modules (npm ci)"
    # Node trusts only its own CA list; the system's bundle (what apt, cargo and curl trust,
    # a TLS-intercepting proxy's CA included) is added unless the caller chose one.
    local system_ca=/etc/ssl/certs/ca-certificates.crt
    if [ -z "${NODE_EXTRA_CA_CERTS:-}" ] && [ -f "$system_ca" ]; then
      export NODE_EXTRA_CA_CERTS="$system_ca"
    fi
    npm ci --prefix "$ROOT/admin/browser" --no-audit --no-fund >&2 \
      || die "npm ci failed in admin/browser (is the npm registry reachable? see the output above)"
  fi
  echo "export CHROMIUM=$chromium POSTAL_REQUIRE_BROWSER=1"
}

ensure_pgbouncer() {
  if [ -x "$PGBOUNCER_BIN" ]; then return; fi
  apt_install pgbouncer "$PGBOUNCER_BIN"
}

# pgbouncer_dir MODE: the folder of the instance in pool mode MODE; pgbouncer_port MODE its port.
pgbouncer_dir() { echo "$STACK/pgbouncer-$1"; }
pgbouncer_port() { if [ "$1" = "transaction" ]; then echo "$PGBOUNCER_PORT"; else echo "$((PGBOUNCER_PORT + 1))"; fi; }

pgbouncer_pid() {
  local f; f="$(pgbouncer_dir "$1")/pgbouncer.pid"
  [ -f "$f" ] || return 1
  local pid; pid="$(cat "$f")"
  [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q "pgbouncer.*$(pgbouncer_dir "$1")/pgbouncer.ini" && echo "$pid"
}

# One instance: its own folder, config, log and pid file; run as the postgres user when this
# script runs as root (PgBouncer refuses root). The system's pgbouncer service is never used.
pgbouncer_up_one() {
  local mode="$1" d port
  d="$(pgbouncer_dir "$mode")"; port="$(pgbouncer_port "$mode")"
  mkdir -p "$d"
  if pid="$(pgbouncer_pid "$mode")"; then log "pgbouncer ($mode) already running (pid $pid) on $HOST:$port"; return; fi
  cat > "$d/pgbouncer.ini" <<CONF
; Written by scripts/stack.sh on each start; edit the script, not this file.
[databases]
* = host=$HOST port=$PG_PORT
[pgbouncer]
listen_addr = $HOST
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $d/userlist.txt
pool_mode = $mode
default_pool_size = 20
max_client_conn = 1000
ignore_startup_parameters = extra_float_digits
logfile = $d/pgbouncer.log
pidfile = $d/pgbouncer.pid
admin_users = postgres
CONF
  echo '"postgres" ""' > "$d/userlist.txt"
  if [ "$(id -u)" = "0" ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
    chown -R postgres "$d"; open_path_for_postgres "$d"
  fi
  log "starting pgbouncer ($mode pooling) on $HOST:$port"
  as_postgres "$PGBOUNCER_BIN" -d "$d/pgbouncer.ini" || { tail -5 "$d/pgbouncer.log" >&2; die "pgbouncer ($mode) did not start"; }
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/$HOST/$port") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  tail -5 "$d/pgbouncer.log" >&2; die "pgbouncer ($mode) did not open port $port"
}

pooler_up() { ensure_pgbouncer; pgbouncer_up_one transaction; pgbouncer_up_one session; }

pooler_down() {
  local mode pid
  for mode in transaction session; do
    if pid="$(pgbouncer_pid "$mode")"; then
      log "stopping pgbouncer ($mode, pid $pid)"
      kill -TERM "$pid"
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
  done
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
  if pg_running; then log "postgres already running on $HOST:$PG_PORT"; return; fi
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
  if [ "$HOST" != "127.0.0.1" ] && ! grep -q "^host all all 0.0.0.0/0 trust" "$STACK/pg/data/pg_hba.conf"; then
    echo "host all all 0.0.0.0/0 trust" >> "$STACK/pg/data/pg_hba.conf"
  fi
  log "starting postgres on $HOST:$PG_PORT"
  # The port and address on the command line win over the ones initdb wrote, so POSTAL_PG_PORT
  # and POSTAL_STACK_HOST also apply to an existing cluster; so does wal_level=logical (the WAL
  # relay's logical replication slots; tests drop the slots they create).
  as_postgres "$PG_BIN/pg_ctl" -D "$STACK/pg/data" -o "-p $PG_PORT -h $HOST -c wal_level=logical -c max_replication_slots=32 -c max_wal_senders=32" -l "$STACK/pg/postgres.log" -w -t 60 start >/dev/null \
    || { tail -20 "$STACK/pg/postgres.log" >&2; die "postgres did not start"; }
}

pg_down() {
  if pg_running; then
    log "stopping postgres"
    as_postgres "$PG_BIN/pg_ctl" -D "$STACK/pg/data" -m fast -w stop >/dev/null
  fi
  pg_secure_down
}

# The --secure PostgreSQL: a second cluster in $STACK/pg-secure on $PG_SECURE_PORT that takes
# only TLS connections with a password (hostssl, scram-sha-256), its certificate (for $HOST and
# localhost) from a local CA made on first start in $STACK/pg-secure/tls, the postgres
# superuser's password random (printed by `--secure pg-up`).
PGS="$STACK/pg-secure"
pg_secure_running() {
  [ -f "$PGS/data/postmaster.pid" ] && as_postgres "$PG_BIN/pg_ctl" -D "$PGS/data" status >/dev/null 2>&1
}

pg_secure_up() {
  ensure_postgres
  command -v openssl >/dev/null || apt_install openssl /usr/bin/openssl
  mkdir -p "$PGS/tls"
  if [ "$(id -u)" = "0" ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
    open_path_for_postgres "$PGS"
  fi
  local t="$PGS/tls"
  if [ ! -f "$t/server.crt" ]; then
    log "making a local CA and PostgreSQL's server certificate in $t"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=Postal PostgreSQL test CA" \
      -keyout "$t/ca.key" -out "$t/ca.pem" >/dev/null 2>&1 || die "openssl could not make the CA"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$HOST" -keyout "$t/server.key" -out "$t/server.csr" >/dev/null 2>&1
    printf 'subjectAltName=IP:%s,DNS:localhost\n' "$HOST" > "$t/san.ext"
    openssl x509 -req -in "$t/server.csr" -CA "$t/ca.pem" -CAkey "$t/ca.key" -CAcreateserial -days 3650 \
      -extfile "$t/san.ext" -out "$t/server.crt" >/dev/null 2>&1 || die "openssl could not sign the server certificate"
    openssl rand -hex 16 > "$t/password"
    chmod 600 "$t/ca.key" "$t/server.key" "$t/password"
  fi
  if [ "$(id -u)" = "0" ]; then chown -R postgres "$PGS"; chmod 644 "$t/ca.pem"; fi
  if pg_secure_running; then log "secure postgres already running on $HOST:$PG_SECURE_PORT"; return; fi
  if [ ! -f "$PGS/data/PG_VERSION" ]; then
    log "initdb $PGS/data"
    local pw="$PGS/initdb-password"
    cp "$t/password" "$pw"; [ "$(id -u)" = "0" ] && chown postgres "$pw"
    as_postgres "$PG_BIN/initdb" -D "$PGS/data" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
      --pwfile="$pw" -E UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$pw"
    cat >> "$PGS/data/postgresql.conf" <<CONF
listen_addresses = '$HOST'
port = $PG_SECURE_PORT
unix_socket_directories = '$PGS'
max_connections = 100
ssl = on
ssl_cert_file = '$t/server.crt'
ssl_key_file = '$t/server.key'
password_encryption = scram-sha-256
CONF
    # TLS and a password, or nothing (the local socket stays for the stack's own set-up).
    cat > "$PGS/data/pg_hba.conf" <<HBA
local all all trust
hostssl all all $HOST/32 scram-sha-256
hostnossl all all 0.0.0.0/0 reject
HBA
  fi
  log "starting secure postgres (TLS only) on $HOST:$PG_SECURE_PORT"
  # wal_level=logical: a WAL relay reads its slot over verified TLS (pg_security::).
  as_postgres "$PG_BIN/pg_ctl" -D "$PGS/data" -o "-p $PG_SECURE_PORT -h $HOST -c wal_level=logical -c max_replication_slots=8 -c max_wal_senders=8" -l "$PGS/postgres.log" -w -t 60 start >/dev/null \
    || { tail -20 "$PGS/postgres.log" >&2; die "secure postgres did not start"; }
}

pg_secure_down() {
  if pg_secure_running; then
    log "stopping secure postgres"
    as_postgres "$PG_BIN/pg_ctl" -D "$PGS/data" -m fast -w stop >/dev/null
  fi
}

# Kafka nodes. Single mode (the default): one combined broker and controller in $STACK/kafka on
# $KAFKA_PORT. Cluster mode (--cluster N): N combined nodes in $STACK/kafka-cluster/node-<i>,
# node i on $KAFKA_CLUSTER_PORT + 2(i-1) (controller on the next port), one cluster id for all.
# kafka_node I sets the globals the functions below use: KNODE, KDIR, KPORT, KCPORT.
kafka_node() {
  KNODE="$1"
  if [ "$SECURE" = "1" ]; then
    KDIR="$STACK/kafka-secure"; KPORT="$KAFKA_SECURE_PORT"; KCPORT=$((KPORT + 1))
  elif [ "$NODES" = "0" ]; then
    KDIR="$STACK/kafka"; KPORT="$KAFKA_PORT"; KCPORT="$KAFKA_CONTROLLER_PORT"
  else
    KDIR="$STACK/kafka-cluster/node-$KNODE"
    KPORT=$((KAFKA_CLUSTER_PORT + 2 * (KNODE - 1))); KCPORT=$((KPORT + 1))
  fi
}

# All nodes of the current mode.
kafka_nodes() { if [ "$NODES" = "0" ]; then echo 1; else seq 1 "$NODES"; fi; }

kafka_pid() {
  local f="$KDIR/kafka.pid"
  [ -f "$f" ] || return 1
  local pid; pid="$(cat "$f")"
  # Only a live process that is still our broker counts.
  [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q "kafka.Kafka $KDIR/server.properties" && echo "$pid"
}

# The secure node's local CA, its broker certificate (for $HOST and localhost) and SCRAM users'
# passwords (admin, relay, consumer), made once in $KDIR/tls. The passwords are random: tests
# read them from `--secure env`.
secure_material() {
  local t="$KDIR/tls"
  [ -f "$t/credentials" ] && return
  command -v openssl >/dev/null || apt_install openssl /usr/bin/openssl
  mkdir -p "$t"
  log "making a local CA and the SASL_SSL broker's certificate in $t"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=Postal test CA" \
    -keyout "$t/ca.key" -out "$t/ca.pem" >/dev/null 2>&1 || die "openssl could not make the CA"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$HOST" -keyout "$t/broker.key" -out "$t/broker.csr" >/dev/null 2>&1
  printf 'subjectAltName=IP:%s,DNS:localhost\n' "$HOST" > "$t/san.ext"
  openssl x509 -req -in "$t/broker.csr" -CA "$t/ca.pem" -CAkey "$t/ca.key" -CAcreateserial -days 3650 \
    -extfile "$t/san.ext" -out "$t/broker.crt" >/dev/null 2>&1 || die "openssl could not sign the broker certificate"
  # Kafka's PEM key store: the PKCS#8 key, then the certificate chain.
  { openssl pkcs8 -topk8 -nocrypt -in "$t/broker.key"; cat "$t/broker.crt" "$t/ca.pem"; } > "$t/broker.pem"
  {
    for u in admin relay consumer; do
      echo "$u=$(openssl rand -hex 16)"
    done
  } > "$t/credentials"
  chmod 600 "$t/credentials" "$t/ca.key" "$t/broker.key" "$t/broker.pem"
}

secret_of() { grep "^$1=" "$KDIR/tls/credentials" | cut -d= -f2; }

# Kafka's own tools as the secure node's admin (client properties in $KDIR/tls/admin.properties).
secure_admin_config() {
  cat > "$KDIR/tls/admin.properties" <<CONF
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$(secret_of admin)";
ssl.truststore.type=PEM
ssl.truststore.location=$KDIR/tls/ca.pem
CONF
  chmod 600 "$KDIR/tls/admin.properties"
}

secure_config() {
  secure_material
  secure_admin_config
  cat > "$KDIR/server.properties" <<CONF
# Written by scripts/stack.sh on each start; edit the script, not this file.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$KCPORT
listeners=SASL_SSL://$HOST:$KPORT,CONTROLLER://$HOST:$KCPORT
advertised.listeners=SASL_SSL://$HOST:$KPORT
inter.broker.listener.name=SASL_SSL
controller.listener.names=CONTROLLER
# The controller listener stays on plain text on this host; its principal (ANONYMOUS) is the
# node itself and must be a super user. Clients only reach the SASL_SSL listener.
listener.security.protocol.map=CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$(secret_of admin)";
ssl.keystore.type=PEM
ssl.keystore.location=$KDIR/tls/broker.pem
ssl.truststore.type=PEM
ssl.truststore.location=$KDIR/tls/ca.pem
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:admin;User:ANONYMOUS
allow.everyone.if.no.acl.found=false
log.dirs=$KDIR/data
auto.create.topics.enable=false
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
CONF
  chmod 600 "$KDIR/server.properties"
}

# server.properties of the current node, written on every start so that port settings apply to
# existing storage too.
kafka_config() {
  if [ "$SECURE" = "1" ]; then secure_config; return; fi
  local voters replication
  if [ "$NODES" = "0" ]; then
    voters="1@$HOST:$KCPORT"
    replication="# One node: internal topics cannot have more replicas than that.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1"
  else
    voters="$(for i in $(seq 1 "$NODES"); do printf '%s@%s:%s,' "$i" "$HOST" $((KAFKA_CLUSTER_PORT + 2 * (i - 1) + 1)); done)"
    voters="${voters%,}"
    replication="# A replicated cluster as in production: internal topics keep Kafka's defaults
# (3 replicas, 2 in sync); new topics get 3 replicas, and acks=all needs 2 of them in sync.
default.replication.factor=3
min.insync.replicas=2
unclean.leader.election.enable=false"
  fi
  cat > "$KDIR/server.properties" <<CONF
# Written by scripts/stack.sh on each start; edit the script, not this file.
process.roles=broker,controller
node.id=$KNODE
controller.quorum.voters=$voters
listeners=PLAINTEXT://$HOST:$KPORT,CONTROLLER://$HOST:$KCPORT
advertised.listeners=PLAINTEXT://$HOST:$KPORT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$KDIR/data
# As production clusters do: Postal (or an operator) creates topics, not the broker.
auto.create.topics.enable=false
$replication
# Tests and the demo start groups often; the default waits 3 s for more members first.
group.initial.rebalance.delay.ms=0
CONF
}

# Formats the current node's storage if needed, starts it in the background; does not wait.
kafka_start() {
  local d="$KDIR"
  mkdir -p "$d/logs" "$d/data" "$d/tmp"
  if pid="$(kafka_pid)"; then
    log "kafka node $KNODE already running (pid $pid) on $HOST:$KPORT"
    # Nothing to wait for (its log may have rolled over since its "started" line).
    echo running > "$d/start-offset"
    return
  fi
  kafka_config
  if [ ! -f "$d/data/meta.properties" ]; then
    local id idfile="$STACK/kafka-cluster/cluster-id"
    if [ "$NODES" != "0" ] && [ -f "$idfile" ]; then
      id="$(cat "$idfile")"
    else
      id="$(java -Xmx256M -cp "$KAFKA_LIB/*" kafka.tools.StorageTool random-uuid)"
      [ "$NODES" != "0" ] && echo "$id" > "$idfile"
    fi
    log "formatting Kafka storage $d/data (cluster id $id)"
    local scram=()
    if [ "$SECURE" = "1" ]; then
      for u in admin relay consumer; do scram+=(--add-scram "SCRAM-SHA-512=[name=$u,password=$(secret_of "$u")]"); done
    fi
    java -Xmx256M -cp "$KAFKA_LIB/*" kafka.tools.StorageTool format -t "$id" -c "$d/server.properties" "${scram[@]}" >>"$d/logs/format.log" 2>&1 \
      || { tail -5 "$d/logs/format.log" >&2; die "formatting Kafka storage failed"; }
  fi
  # Readiness is a "Kafka Server started" line written after this offset.
  local offset=0
  [ -f "$d/logs/server.log" ] && offset="$(stat -c %s "$d/logs/server.log")"
  echo "$offset" > "$d/start-offset"
  log "starting Apache Kafka $KAFKA_VERSION node $KNODE on $HOST:$KPORT (controller $KCPORT, heap $KAFKA_HEAP)"
  (
    cd "$d"
    # A private temp folder: a noexec /tmp would break the compression codecs' native libraries.
    exec java -Xms"$KAFKA_HEAP" -Xmx"$KAFKA_HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
      -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true \
      -Djava.io.tmpdir="$d/tmp" \
      -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties" -Dkafka.logs.dir="$d/logs" \
      -cp "$KAFKA_LIB/*" kafka.Kafka "$d/server.properties" >>"$d/logs/broker.log" 2>&1 </dev/null
  ) &
  echo $! > "$d/kafka.pid"
}

# Waits until the current node (started by kafka_start) says it has started.
kafka_wait() {
  local d="$KDIR" pid="" offset
  # The background subshell becomes the broker when it execs java: until then its command line
  # is still this script's.
  for _ in $(seq 1 50); do pid="$(kafka_pid)" && break; sleep 0.1; done
  [ -n "$pid" ] || die "kafka node $KNODE is not running (logs: $d/logs)"
  offset="$(cat "$d/start-offset" 2>/dev/null || echo 0)"
  [ "$offset" = running ] && return 0
  # A node with much data (thousands of test topics) loads its logs for minutes: wait while its
  # log grows, and give up after 120 s without a new line (or 15 minutes in all).
  local quiet=0 size=0 now total=0
  while [ "$quiet" -lt 1200 ] && [ "$total" -lt 9000 ]; do
    # log4j rolls server.log over at 50 MB, also at start-up: a log shorter than the offset is
    # a new file, read from its start.
    [ "$(stat -c %s "$d/logs/server.log" 2>/dev/null || echo 0)" -lt "$offset" ] && offset=0
    # grep reads a process substitution: in a pipe, its early exit would end tail with SIGPIPE,
    # which pipefail takes for a failure once the new part of the log is larger than a pipe's
    # buffer (a node loading thousands of topics).
    if [ -f "$d/logs/server.log" ] && grep -q "Kafka Server started" <(tail -c +"$((offset + 1))" "$d/logs/server.log"); then
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { tail -20 "$d/logs/broker.log" >&2; die "kafka node $KNODE exited during start-up (logs: $d/logs)"; }
    now="$(stat -c %s "$d/logs/server.log" 2>/dev/null || echo 0)"
    if [ "$now" != "$size" ]; then size="$now"; quiet=0; else quiet=$((quiet + 1)); fi
    total=$((total + 1))
    sleep 0.1
  done
  tail -20 "$d/logs/broker.log" >&2
  die "kafka node $KNODE did not start (no progress for 120 s, or 15 minutes in all; data: $(du -sh "$d/data" 2>/dev/null | cut -f1); logs: $d/logs); to start afresh: scripts/stack.sh down && rm -rf $d/data"
}

# Starts the given nodes (all by default) and waits for them: a cluster's nodes start together,
# since a node becomes ready only once a majority of controllers runs.
kafka_up() {
  ensure_kafka
  local nodes="${*:-$(kafka_nodes)}" i
  [ "$NODES" != "0" ] && mkdir -p "$STACK/kafka-cluster"
  for i in $nodes; do kafka_node "$i"; kafka_start; done
  for i in $nodes; do kafka_node "$i"; kafka_wait; done
}

# kafka_down SIG [NODE…]: SIGTERM, a clean shutdown; SIGKILL, as a crash (the data stays).
kafka_down() {
  local sig="${1:-TERM}"; shift || true
  local nodes="${*:-$(kafka_nodes)}" i pid
  for i in $nodes; do
    kafka_node "$i"
    if pid="$(kafka_pid)"; then
      log "stopping kafka node $i (pid $pid, SIG$sig)"
      kill -"$sig" "$pid"
      for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
      # Reap nothing: the broker is not our child; wait until its ports are free.
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$KDIR/kafka.pid"
  done
}

# Bootstrap servers of the current mode.
kafka_bootstrap() {
  local out="" i
  for i in $(kafka_nodes); do kafka_node "$i"; out="$out,$HOST:$KPORT"; done
  echo "${out#,}"
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

print_pg_secure_env() {
  echo "export POSTGRES_TLS_URL=postgres://postgres:$(cat "$PGS/tls/password")@$HOST:$PG_SECURE_PORT/postgres"
  echo "export POSTGRES_TLS_CA=$PGS/tls/ca.pem"
}

print_env() {
  if [ "$SECURE" = "1" ]; then
    kafka_node 1
    echo "export KAFKA_SASL_SSL_BOOTSTRAP=$HOST:$KPORT"
    echo "export KAFKA_SASL_SSL_CA=$KDIR/tls/ca.pem"
    echo "export KAFKA_SASL_SSL_RELAY_PASSWORD=$(secret_of relay)"
    echo "export KAFKA_SASL_SSL_CONSUMER_PASSWORD=$(secret_of consumer)"
    echo "export KAFKA_SASL_SSL_ADMIN_PASSWORD=$(secret_of admin)"
    return
  fi
  echo "export DATABASE_URL=postgres://postgres@$HOST:$PG_PORT/postgres"
  echo "export KAFKA_BOOTSTRAP_SERVERS=$(kafka_bootstrap)"
  if [ "$WITH_RABBITMQ" = "1" ]; then echo "export AMQP_URL=amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f"; fi
  if [ "$WITH_PGBOUNCER" = "1" ]; then
    echo "export POSTAL_PGBOUNCER_BIN=$PGBOUNCER_BIN"
    echo "export POSTAL_PGBOUNCER_TRANSACTION_URL=postgres://postgres@$HOST:$(pgbouncer_port transaction)/postgres"
    echo "export POSTAL_PGBOUNCER_SESSION_URL=postgres://postgres@$HOST:$(pgbouncer_port session)/postgres"
  fi
}

cmd="${1:-}"; shift || true
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --secure) SECURE=1; shift ;;
    --cluster) NODES="$2"; shift 2 ;;
    --cluster=*) NODES="${1#*=}"; shift ;;
    [0-9]*) ARGS+=("$1"); shift ;;
    *) if [ "$cmd" = "acl" ]; then ARGS+=("$1"); shift; else die "unknown argument $1"; fi ;;
  esac
done
case "$NODES" in 0|3|5) ;; *) die "--cluster takes 3 or 5 nodes (a KRaft quorum needs a majority)" ;; esac

case "$cmd" in
  up) pg_up; if [ "$WITH_PGBOUNCER" = "1" ]; then pooler_up; fi; kafka_up; if [ "$WITH_RABBITMQ" = "1" ]; then rabbit_up; fi; print_env ;;
  pooler-up) pooler_up; print_env ;;
  pooler-down) pooler_down ;;
  pg-up) if [ "$SECURE" = "1" ]; then pg_secure_up; print_pg_secure_env; else pg_up; print_env; fi ;;
  kafka-up) kafka_up "${ARGS[@]}"; print_env ;;
  kafka-down) kafka_down TERM "${ARGS[@]}" ;;
  kafka-kill) kafka_down KILL "${ARGS[@]}" ;;
  restart-broker) kafka_down KILL; kafka_up; print_env ;;
  down) rabbit_down; kafka_down TERM; (SECURE=1; kafka_down TERM); pooler_down; pg_down ;;
  env) print_env ;;
  acl)
    [ "$SECURE" = "1" ] || die "acl is for the --secure node"
    kafka_node 1
    java -Xmx256M -cp "$KAFKA_LIB/*" -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties" -Dkafka.logs.dir="$KDIR/logs" \
      org.apache.kafka.tools.AclCommand --bootstrap-server "$HOST:$KPORT" \
      --command-config "$KDIR/tls/admin.properties" "${ARGS[@]}" ;;
  acl-repl)
    # The same command in one JVM, once per input line (scripts/kafka/AclRepl.java says how).
    [ "$SECURE" = "1" ] || die "acl-repl is for the --secure node"
    kafka_node 1
    exec java -Xmx256M -cp "$KAFKA_LIB/*" -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties" -Dkafka.logs.dir="$KDIR/logs" \
      "$ROOT/scripts/kafka/AclRepl.java" --bootstrap-server "$HOST:$KPORT" \
      --command-config "$KDIR/tls/admin.properties" ;;
  ensure-tools) ensure_postgres; ensure_kafka; ensure_iproute; if [ "$WITH_RABBITMQ" = "1" ]; then ensure_rabbitmq; fi; if [ "$WITH_PGBOUNCER" = "1" ]; then ensure_pgbouncer; fi; ensure_browser >/dev/null ;;
  browser) ensure_browser ;;
  status)
    if pg_running; then echo "postgres: running on $HOST:$PG_PORT"; else echo "postgres: stopped"; fi
    for i in $(kafka_nodes); do
      kafka_node "$i"
      if pid="$(kafka_pid)"; then echo "kafka node $i: running (pid $pid) on $HOST:$KPORT"; else echo "kafka node $i: stopped"; fi
    done
    if pid="$(rabbit_pid)"; then echo "rabbitmq: running (pid $pid) on 127.0.0.1:$AMQP_PORT"; else echo "rabbitmq: stopped"; fi
    for m in transaction session; do
      if pid="$(pgbouncer_pid "$m")"; then echo "pgbouncer ($m): running (pid $pid) on $HOST:$(pgbouncer_port "$m")"; else echo "pgbouncer ($m): stopped"; fi
    done ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
