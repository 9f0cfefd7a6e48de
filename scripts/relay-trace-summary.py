#!/usr/bin/env python3
"""Summarises the relay's per-batch trace lines ("batch recorded": events, waited_ms (age of
the batch's oldest event when its claim started), claim_ms, send_ms,
ack_ms, total_ms) from a log captured with RUST_LOG=postal_producer::relay=trace.

    RUST_LOG="warn,postal_producer::relay=trace" ./target/release/postal-bench e2e ... > e2e.log 2>&1
    python3 scripts/relay-trace-summary.py e2e.log
    python3 scripts/relay-trace-summary.py e2e.log --every 10   # also p50s per 10 s of the log

With --every N the batches are also grouped by the N-second window of their log timestamp, to
show whether a figure drifts during a run.
"""
import argparse
import re
from datetime import datetime

FIELDS = ("events", "waited_ms", "claim_ms", "send_ms", "ack_ms", "total_ms")
parser = argparse.ArgumentParser()
parser.add_argument("log")
parser.add_argument("--every", type=float, default=0, help="window in seconds (0: no timeline)")
args = parser.parse_args()

rows = []
with open(args.log, errors="replace") as f:
    for line in f:
        if "batch recorded" not in line:
            continue
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        at = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z", line)
        values = dict(re.findall(r"(\w+)=([0-9.]+)", line))
        row = {k: float(v) for k, v in values.items() if k in FIELDS}
        if at:
            row["at"] = datetime.fromisoformat(at.group(1)[:26]).timestamp()
        rows.append(row)


def pct(values, p):
    values = sorted(values)
    return values[int(p * (len(values) - 1))]


print(f"{len(rows)} batches")
for k in FIELDS:
    v = [r[k] for r in rows if k in r]
    if v:
        print(f"{k:9} p50 {pct(v, .5):8.2f}  p90 {pct(v, .9):8.2f}  p99 {pct(v, .99):8.2f}  mean {sum(v) / len(v):8.2f}")

if args.every > 0:
    timed = [r for r in rows if "at" in r]
    if timed:
        start = min(r["at"] for r in timed)
        windows = {}
        for r in timed:
            windows.setdefault(int((r["at"] - start) // args.every), []).append(r)
        print(f"p50 per {args.every:g} s window (from the first batch):")
        print("   from_s  batches  events  waited_ms  claim_ms  ack_ms")
        for w in sorted(windows):
            v = windows[w]
            p = lambda k: pct([r[k] for r in v if k in r] or [float("nan")], .5)
            print(f"{w * args.every:9.0f} {len(v):8d} {p('events'):7.0f} {p('waited_ms'):10.1f}"
                  f" {p('claim_ms'):9.1f} {p('ack_ms'):7.1f}")
