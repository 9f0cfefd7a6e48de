#!/usr/bin/env bash
# What the claim's check for rows another session locks costs (producer/src/skipped.rs):
# the claim statement of 9b8cf9f (one index scan, FOR UPDATE SKIP LOCKED inside it) against
# the current form (candidates read in sequence order, then locked by tuple id, then the
# passed rows of other sessions), both copied here, prepared and run with a generic plan and
# the relay's planner settings as the relay runs its claim, on a
# fresh database with 50,000 pending rows over 1,000 keys. Each run claims 2,000 rows and
# rolls back; the two forms alternate; prints the median of 15 runs of each, in ms.
#
#     source <(bash scripts/stack.sh env)
#     POSTAL_BIN=target/debug/postal bash scripts/claim-lock-check-cost.sh
set -euo pipefail
: "${DATABASE_URL:?source <(bash scripts/stack.sh env) first}"
BIN=${POSTAL_BIN:-target/debug/postal}
DB=claim_lock_check_cost
BASE=${DATABASE_URL%/*}
psql "$DATABASE_URL" -qc "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
D=$BASE/$DB
DATABASE_URL=$D "$BIN" migrate >/dev/null
psql "$D" -qc "SELECT count(postal.enqueue('t', 'k' || (i % 1000), 'e', '{\"a\":1}'::jsonb)) FROM generate_series(1, 50000) i" >/dev/null
psql "$D" -qc "VACUUM ANALYZE postal.outbox"
P="SELECT set_config('enable_sort', 'off', true), set_config('enable_incremental_sort', 'off', true), set_config('enable_bitmapscan', 'off', true), set_config('enable_seqscan', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true)"
COND="o.status = 'pending' AND (NOT o.held OR o.available_at <= now()) AND o.key_partition BETWEEN 0 AND 255 AND (NOT EXISTS (SELECT 1 FROM postal.outbox h WHERE h.held) OR NOT EXISTS (SELECT 1 FROM postal.outbox b WHERE b.held AND b.event_key = o.event_key AND b.seq < o.seq AND b.topic = o.topic AND (b.status = 'failed' OR b.available_at > now())))"
RET="d.seq, d.event_id, d.topic, d.event_key, d.event_type, d.schema_version, d.occurred_at, d.content_type, d.payload, d.headers, d.attempts, d.created_at, d.last_error"
OLD="DELETE FROM postal.outbox d WHERE d.ctid = ANY(ARRAY(SELECT o.ctid FROM postal.outbox o WHERE $COND ORDER BY o.seq, o.key_partition LIMIT \$1 FOR UPDATE OF o SKIP LOCKED)) RETURNING $RET"
NEW="WITH c AS MATERIALIZED (SELECT o.ctid, o.seq FROM postal.outbox o WHERE $COND ORDER BY o.seq, o.key_partition LIMIT \$1 + \$2),
l AS MATERIALIZED (SELECT o.ctid, c.seq FROM c JOIN postal.outbox o ON o.ctid = c.ctid LIMIT \$1 FOR UPDATE OF o SKIP LOCKED),
s AS MATERIALIZED (SELECT o.seq, o.topic, o.event_key, o.xmax::text::int8 AS xmax FROM c JOIN postal.outbox o ON o.ctid = c.ctid WHERE c.seq < (SELECT max(l.seq) FROM l) AND (SELECT count(*) FROM l) < (SELECT count(*) FROM c WHERE c.seq <= (SELECT max(l.seq) FROM l)) AND c.seq NOT IN (SELECT l.seq FROM l) AND NOT (o.xmax::text::int8 = ANY(\$3::int8[]) AND c.seq IN (SELECT unnest(\$4::int8[]))))
DELETE FROM postal.outbox d WHERE d.ctid = ANY(ARRAY(SELECT l.ctid FROM l)) RETURNING $RET, CASE WHEN (d.topic, d.event_key) IN (SELECT s.topic, s.event_key FROM s) THEN (SELECT array_agg(s.seq ORDER BY s.seq) || array_agg(s.xmax ORDER BY s.seq) FROM s WHERE s.topic = d.topic AND s.event_key = d.event_key) END AS skipped, (SELECT count(*) FROM s) AS passed"
# Prepared and run with a generic plan, as the relay runs its claim.
( printf 'PREPARE new(int8, int8, int8[], int8[]) AS %s;\nPREPARE old(int8) AS %s;\n' "$NEW" "$OLD"
  echo '\timing on'; for _ in $(seq 1 15); do
    printf 'BEGIN;\n%s;\n%s;\nROLLBACK;\nBEGIN;\n%s;\n%s;\nROLLBACK;\n' "$P" "EXECUTE new(2000, 0, '{}', '{}')" "$P" "EXECUTE old(2000)"
  done ) | psql "$D" -o /dev/null 2>&1 | awk '/^Time/ {print $2}' | paste - - - - - - - - \
  | python3 -c "
import statistics, sys
rows = [l.split() for l in sys.stdin if l.strip()]
new = statistics.median(float(r[2]) for r in rows)
old = statistics.median(float(r[6]) for r in rows)
print(f'claim of 2,000 rows, median of {len(rows)} runs: with the check {new:.1f} ms, before it {old:.1f} ms ({new / old:.2f}x)')"
[ -n "${KEEP:-}" ] || psql "$BASE/postgres" -qc "DROP DATABASE $DB"
