-- Partitions a consumer group stopped on because their log was replaced under it: the stored
-- next offset is above the partition's high watermark, which a partition's normal life never
-- produces (a topic deleted and re-created, the group moved to another Kafka cluster, or a log
-- truncated by an unclean leader election). The group's consumers apply nothing of the
-- topic while a row of it is here, and skip nothing; `postal consumer reset` on the topic
-- deletes its rows (the way on), `postal status` shows them.
--
-- Additive: consumers from before this migration neither write nor read it, and
-- `oldest_compatible` is unchanged.
CREATE TABLE postal.consumer_stops (
    group_id       text        NOT NULL CHECK (group_id <> ''),
    topic          text        NOT NULL CHECK (topic <> ''),
    partition      integer     NOT NULL CHECK (partition >= 0),
    -- What was seen: the stored next offset and the partition's watermarks.
    stored_offset  bigint      NOT NULL,
    low_watermark  bigint      NOT NULL,
    high_watermark bigint      NOT NULL,
    stopped_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, partition)
);
