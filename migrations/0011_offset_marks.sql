-- Where each consumer group stood, sampled every 10 minutes by its running consumers (the
-- database's clock): a mark (next_offset N at marked_at T) says every record below N was
-- processed by T and every record from N on after it. `postal consumer reset` uses the first
-- mark well after a consumer's dedup horizon to tell which offsets may have lost their dedup
-- rows, without trusting record timestamps (the producers' clocks, which may run ahead).
CREATE TABLE postal.offset_marks (
    group_id    text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    next_offset bigint      NOT NULL,
    marked_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, partition, marked_at)
);
