-- Consumer side: offsets stored beside the effects, and dead letters.

-- The next offset to consume per (group, topic, partition), written in the same transaction
-- as the dedup rows and the handler's effects. `epoch` fences a previous owner: a consumer
-- that is assigned the partition bumps it, and every processing transaction advances the
-- offset only while the epoch it read at assignment is still current.
CREATE TABLE postal.consumer_offsets (
    group_id    text        NOT NULL CHECK (group_id <> ''),
    topic       text        NOT NULL CHECK (topic <> ''),
    partition   integer     NOT NULL CHECK (partition >= 0),
    next_offset bigint               CHECK (next_offset >= 0),
    epoch       bigint      NOT NULL DEFAULT 1,
    owner       text,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, partition)
);

-- Records a consumer gave up on, written in the same transaction as the offset advance past
-- them, then published to `<topic>.dlq` (published_at set once the broker acknowledged).
CREATE TABLE postal.dead_letters (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_name  text        NOT NULL CHECK (consumer_name <> ''),
    group_id       text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    kafka_offset   bigint      NOT NULL,
    event_id       uuid,
    event_type     text,
    record_key     bytea,
    payload        bytea,
    header_names   text[]      NOT NULL DEFAULT '{}',
    header_values  bytea[]     NOT NULL DEFAULT '{}',
    reason         text        NOT NULL CHECK (reason IN ('permanent', 'undecodable',
                       'missing_event_id', 'unknown_type', 'panic', 'retries_exhausted')),
    error          text        NOT NULL,
    attempts       integer     NOT NULL DEFAULT 0,
    dlq_topic      text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz,
    CHECK (cardinality(header_names) = cardinality(header_values))
);
CREATE INDEX dead_letters_unpublished ON postal.dead_letters (consumer_name, id)
    WHERE published_at IS NULL;
CREATE INDEX dead_letters_event ON postal.dead_letters (event_id);
