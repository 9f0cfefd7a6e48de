#!/usr/bin/env python3
"""Reads partition 0 of every topic whose name starts with a prefix from the beginning and
reports records, distinct `ce_id` headers, duplicated ids (first offset, duplicate offset) and
offset gaps: whether a topic holds each event exactly once.

    python3 scripts/topic-scan.py "$KAFKA_BOOTSTRAP_SERVERS" bench-e2e
"""
import sys
from confluent_kafka.admin import AdminClient
from kafka_readback import read_until_idle
bs = sys.argv[1]
admin = AdminClient({"bootstrap.servers": bs})
topics = [t for t in admin.list_topics(timeout=10).topics if t.startswith(sys.argv[2])]
for topic in topics:
    recs = []
    for m in read_until_idle(bs, topic, 0, "scan-" + topic):
        h = dict(m.headers() or [])
        recs.append((m.offset(), h.get("ce_id", b"").decode(), h.get("postal_seq", h.get("ce_postalseq", b"")).decode() if h else ""))
    ids = [r[1] for r in recs]
    seen = {}
    dups = []
    for off, i, s in recs:
        if i in seen: dups.append((seen[i], off, s))
        else: seen[i] = off
    offs = [r[0] for r in recs]
    gaps = [(a, b) for a, b in zip(offs, offs[1:]) if b != a + 1]
    print(topic, "records", len(recs), "unique", len(seen), "dups (first offset, dup offset, seq)", dups[:12], "offset gaps", gaps[:10])
