#!/usr/bin/env python3
"""CPU per process group every 5 s while a benchmark runs: the Kafka broker, PostgreSQL's backends and
postal-bench, as % of one core, plus the machine's idle and steal share.

    ./target/release/postal-bench ... e2e ... > e2e.log 2>&1 &
    sleep 3; python3 scripts/cpu-windows.py 5      # five 5 s windows
"""
import os
import sys
import time

GROUPS = {
    "kafka": lambda c: "kafka.Kafka" in c,
    "postgres": lambda c: c.startswith("postgres:"),
    "bench": lambda c: "postal-bench" in c,
}


def ticks(match):
    """User + system clock ticks of every live process whose command line matches."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline").read()
            stat = open(f"/proc/{pid}/stat").read().split(")")[-1].split()
        except OSError:
            continue
        if match(cmd):
            total += int(stat[11]) + int(stat[12])
    return total


def machine():
    return [int(x) for x in open("/proc/stat").readline().split()[1:]]


windows = int(sys.argv[1]) if len(sys.argv) > 1 else 5
prev = {k: ticks(f) for k, f in GROUPS.items()}
prev_machine = machine()
for w in range(windows):
    time.sleep(5)
    cur = {k: ticks(f) for k, f in GROUPS.items()}
    cur_machine = machine()
    d = [b - a for a, b in zip(prev_machine, cur_machine)]
    # Ticks are 1/100 s: over 5 s, ticks / 5 is % of one core. A process that exits within the
    # window takes its ticks with it, so a group can read low (or negative) in its last window.
    parts = "  ".join(f"{k} {(cur[k] - prev[k]) / 5:.0f}%" for k in GROUPS)
    print(f"window {w}: {parts}  idle {100 * d[3] / sum(d):.0f}% steal {100 * d[7] / sum(d):.0f}%", flush=True)
    prev, prev_machine = cur, cur_machine
