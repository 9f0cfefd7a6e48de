"""Shared by the scripts that read a topic back with a plain client (confluent-kafka)."""
import time
from confluent_kafka import Consumer, TopicPartition


def read_until_idle(bootstrap, topic, offset, group, idle_s=4):
    """Messages of partition 0 of `topic` from `offset`, until none came for `idle_s` seconds."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    c.assign([TopicPartition(topic, 0, offset)])
    got = []
    idle = time.time()
    while time.time() - idle < idle_s:
        m = c.poll(0.5)
        if m is None or m.error():
            continue
        got.append(m)
        idle = time.time()
    c.close()
    return got
