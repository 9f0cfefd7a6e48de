-- Held keys (issue 48): a consumer configured to hold a failing event's key
-- (`FinalFailure::HoldKey`) stores the event that failed for good, and every later record of
-- its key on the partition, here instead of dead-lettering it and moving on. Each row is
-- written in the transaction that moves the stored offset past its record
-- (`postal.consumer_offsets`), so the stored offset never runs ahead of what is applied or
-- held. Nothing of a held key is applied until it is released: by an operator (`postal held
-- release`, which sets `release` here, audited) or by the consumer's retry policy
-- (`due_at`). The partition's owner applies the released records, in offset order, each in
-- its own transaction with its dedup row, its effects and the deletion of its row here.

-- One row per held key of a partition: why its head (its held record of lowest offset) failed.
CREATE TABLE postal.held_keys (
    group_id      text        NOT NULL CHECK (group_id <> ''),
    topic         text        NOT NULL CHECK (topic <> ''),
    partition     integer     NOT NULL CHECK (partition >= 0),
    record_key    bytea       NOT NULL,
    -- The offset of the head: the event that failed. Records of the key below it (copies
    -- delivered again after a `postal consumer reset`) are held too, but are not the head.
    head_offset   bigint      NOT NULL,
    consumer_name text        NOT NULL,
    reason        text        NOT NULL,
    error         text        NOT NULL,
    -- Handler runs of the head so far (across releases).
    attempts      integer     NOT NULL DEFAULT 0,
    held_at       timestamptz NOT NULL DEFAULT now(),
    -- The retry policy's next automatic retry of the head (NULL: only an operator releases).
    due_at        timestamptz,
    -- An operator's release, not yet applied by the partition's owner: `retry` (the head,
    -- then the rest in order) or `skip` (dead-letter the head, then the rest).
    release       text        CHECK (release IN ('retry', 'skip')),
    released_by   text,
    PRIMARY KEY (group_id, topic, partition, record_key)
);

-- The held records, whole: enough to apply (or dead-letter) each later exactly as if it had
-- just been read from the partition.
CREATE TABLE postal.held_records (
    group_id        text        NOT NULL,
    topic           text        NOT NULL,
    partition       integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    record_key      bytea       NOT NULL,
    event_id        uuid        NOT NULL,
    event_type      text        NOT NULL,
    payload         bytea,
    header_names    text[]      NOT NULL DEFAULT '{}',
    header_values   bytea[]     NOT NULL DEFAULT '{}',
    kafka_timestamp timestamptz,
    -- What this row counts against the group's bound (`postal.held_bytes`).
    bytes           bigint      NOT NULL CHECK (bytes > 0),
    held_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, partition, kafka_offset),
    FOREIGN KEY (group_id, topic, partition, record_key)
        REFERENCES postal.held_keys (group_id, topic, partition, record_key),
    CHECK (cardinality(header_names) = cardinality(header_values))
);
CREATE INDEX held_records_by_key
    ON postal.held_records (group_id, topic, partition, record_key, kafka_offset);

-- Bytes held per group, kept in the transactions that hold and release records: a hold
-- that would take the group past the consumer's bound (`held_bytes_limit`) rolls back and
-- the partition waits (nothing dropped).
CREATE TABLE postal.held_bytes (
    group_id text   PRIMARY KEY,
    bytes    bigint NOT NULL DEFAULT 0 CHECK (bytes >= 0)
);
