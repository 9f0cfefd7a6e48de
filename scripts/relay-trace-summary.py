#!/usr/bin/env python3
"""Summarises the relay's per-batch trace lines ("batch recorded": events, waited_ms (age of
the batch's oldest event when its claim started), claim_ms, send_ms,
ack_ms, total_ms) from a log captured with RUST_LOG=postal_producer::relay=trace.

    RUST_LOG="warn,postal_producer::relay=trace" ./target/release/postal-bench e2e ... > e2e.log 2>&1
    python3 scripts/relay-trace-summary.py e2e.log
"""
import re
import sys

FIELDS = ("events", "waited_ms", "claim_ms", "send_ms", "ack_ms", "total_ms")
rows = []
with open(sys.argv[1], errors="replace") as f:
    for line in f:
        if "batch recorded" not in line:
            continue
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        values = dict(re.findall(r"(\w+)=([0-9.]+)", line))
        rows.append({k: float(v) for k, v in values.items() if k in FIELDS})


def pct(values, p):
    values = sorted(values)
    return values[int(p * (len(values) - 1))]


print(f"{len(rows)} batches")
for k in FIELDS:
    v = [r[k] for r in rows if k in r]
    if v:
        print(f"{k:9} p50 {pct(v, .5):8.2f}  p90 {pct(v, .9):8.2f}  p99 {pct(v, .99):8.2f}  mean {sum(v) / len(v):8.2f}")
