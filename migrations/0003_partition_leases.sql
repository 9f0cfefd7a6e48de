-- Per-key order with several relays: each of the 256 key partitions has one owner at a time.
-- A relay heartbeats its row in relay_instances; live relays split the partitions among
-- themselves and hold each through a lease that they renew while alive.

CREATE TABLE postal.relay_instances (
    relay_id      uuid        PRIMARY KEY,
    host          text        NOT NULL DEFAULT '',
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE postal.relay_partitions (
    key_partition smallint    PRIMARY KEY CHECK (key_partition BETWEEN 0 AND 255),
    owner         uuid,
    lease_until   timestamptz,
    acquired_at   timestamptz
);

INSERT INTO postal.relay_partitions (key_partition) SELECT generate_series(0, 255);
