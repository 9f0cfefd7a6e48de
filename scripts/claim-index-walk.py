#!/usr/bin/env python3
"""How many index entries the relay's claims walk per claimed row, with the claim transactions
committing synchronously or asynchronously.

Fills a fresh database's outbox with a backlog, then drains it the way the relay's lanes do:
each lane claims up to BATCH rows of its share of the key partitions in sequence order
(`outbox_pending_seq_partition`, FOR UPDATE SKIP LOCKED, deleted by tuple id in the claim),
holds its transaction open for PUBLISH_MS (the publish), commits, and claims again. It prints,
per commit mode, the entries the pending index returned to the claims per claimed row
(`pg_stat_get_tuples_returned`: 1 would be the live rows alone; every entry above that points
to a row an earlier claim deleted and no scan has marked dead yet) and the rows per second.

    source <(bash scripts/stack.sh env)
    python3 scripts/claim-index-walk.py [ROWS] [LANES] [PUBLISH_MS] [BATCH]   # 300000 4 20 2000

Run it from the repository root. Needs `pip install psycopg[binary]` and the `postal` binary
(`cargo build --release -p postal-cli`, or POSTAL_BIN) to create the schema.
"""
import os
import subprocess
import sys
import threading
import time
import uuid

import psycopg

ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
LANES = int(sys.argv[2]) if len(sys.argv) > 2 else 4
PUBLISH_MS = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
BATCH = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
SERVER = os.environ["DATABASE_URL"]
POSTAL = os.environ.get("POSTAL_BIN", "./target/release/postal")

# The claim's shape (see `claim::CLAIM_DELETE`), for one lane's contiguous partition range.
CLAIM = """
DELETE FROM postal.outbox d WHERE d.ctid = ANY(ARRAY(
    SELECT o.ctid FROM postal.outbox o
    WHERE o.status = 'pending' AND o.available_at <= now()
      AND o.key_partition BETWEEN %(lo)s AND %(hi)s
    ORDER BY o.seq, o.key_partition
    LIMIT %(limit)s
    FOR UPDATE OF o SKIP LOCKED))
RETURNING d.seq, d.payload
"""
# The relay's planner settings (`claim::PLAN_SETTINGS`) and the commit mode under test.
SETTINGS = """
SELECT set_config('enable_sort', 'off', true), set_config('enable_incremental_sort', 'off', true),
       set_config('enable_bitmapscan', 'off', true), set_config('enable_seqscan', 'off', true),
       set_config('plan_cache_mode', 'force_generic_plan', true),
       set_config('synchronous_commit', %(commit)s, true)
"""
RETURNED = "SELECT pg_stat_get_tuples_returned('postal.outbox_pending_seq_partition'::regclass)"


def with_db(url, name):
    """`url` with its database replaced by `name` (query parameters kept)."""
    rest, sep, query = url.partition("?")
    base, _, _ = rest.rpartition("/")
    return f"{base}/{name}{sep}{query}"


def drain(url, commit):
    setup = psycopg.connect(url, autocommit=True)
    setup.execute("DELETE FROM postal.outbox")
    setup.execute(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload) "
        "SELECT gen_random_uuid(), 'walk', 'key-' || (i %% 1000), 'walk.event', "
        "convert_to(repeat('x', 200), 'UTF8') FROM generate_series(1, %s) i",
        (ROWS,),
    )
    setup.execute("VACUUM ANALYZE postal.outbox")
    # This connection's counters reach the shared statistics at a transaction end at most once
    # a second (else after 10 s idle or at exit): wait, then touch them.
    time.sleep(1.2)
    setup.execute("SELECT 1")
    before = setup.execute(RETURNED).fetchone()[0]
    claimed = [0] * LANES

    def lane(i):
        lo, hi = i * 256 // LANES, (i + 1) * 256 // LANES - 1
        with psycopg.connect(url) as c:
            while True:
                c.execute(SETTINGS, {"commit": commit})
                rows = c.execute(CLAIM, {"lo": lo, "hi": hi, "limit": BATCH}, prepare=True).fetchall()
                if not rows:
                    c.commit()
                    return
                time.sleep(PUBLISH_MS / 1000)
                c.commit()
                claimed[i] += len(rows)

    started = time.monotonic()
    threads = [threading.Thread(target=lane, args=(i,)) for i in range(LANES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    # The lanes' connections are closed: their counters were reported when they exited.
    time.sleep(1.2)
    walked = setup.execute(RETURNED).fetchone()[0] - before
    setup.close()
    if sum(claimed) != ROWS:
        raise SystemExit(f"claimed {sum(claimed)} of {ROWS}")
    print(
        f"synchronous_commit {commit:>3}: {walked / ROWS:.2f} index entries per claimed row, "
        f"{ROWS / elapsed:,.0f} rows/s ({ROWS} rows, {LANES} lanes, batch {BATCH}, "
        f"{PUBLISH_MS:g} ms per publish)"
    )


def main():
    name = f"postal_walk_{uuid.uuid4().hex[:12]}"
    admin = psycopg.connect(SERVER, autocommit=True)
    admin.execute(f"CREATE DATABASE {name}")
    try:
        url = with_db(SERVER, name)
        subprocess.run([POSTAL, "--database-url", url, "migrate"], check=True,
                       stdout=subprocess.DEVNULL)
        for commit in ("on", "off", "on", "off"):
            drain(url, commit)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    main()
