#!/usr/bin/env python3
"""tansu 0.6.0's answer to a fetch from inside a record batch (README, "tansu 0.6.0 faults").

Writes a batch of 100 records (offsets 0-99) and a batch of one (offset 100), then reads from
offset 50 with a plain client. Kafka returns the first batch (the client drops 0-49) and the
reader sees offsets 50-100; tansu answers with the next batch instead.

    python3 scripts/tansu-midbatch-fetch.py "$KAFKA_BOOTSTRAP_SERVERS"
"""
import sys
import uuid
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from kafka_readback import read_until_idle
bs = sys.argv[1]
topic = "mid-" + uuid.uuid4().hex
admin = AdminClient({"bootstrap.servers": bs}); admin.create_topics([NewTopic(topic, 1, 1)])[topic].result()
p = Producer({"bootstrap.servers": bs, "enable.idempotence": True, "linger.ms": 100})
for i in range(100): p.produce(topic, value=str(i))
p.flush(10)
p.produce(topic, value="100"); p.flush(10)   # a second batch
got = [m.offset() for m in read_until_idle(bs, topic, 50, "g" + topic)]
print("fetch from offset 50 delivered offsets", got[:5], "...", got[-3:], "count", len(got))
print("as Kafka would" if got == list(range(50, 101)) else "records 50-99 were not delivered as such: the fault")
