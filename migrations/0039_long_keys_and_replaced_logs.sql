-- Every key Postal accepts fits every index it is in; a replaced log's held records are kept. A btree index row holds at most about
-- 2,700 bytes, and keys were indexed whole: an outbox key over that (enqueue allows 4,096
-- bytes) could never be parked or scheduled, as its `held` row could not be indexed (the relay
-- sent it again and again), and a consumer could never hold a Kafka key over that (Kafka keys
-- have no limit of their own): the hold failed and its partition stopped.
--
-- Keys are now looked up by a hash in these indexes, and compared whole as before:
-- * `outbox_held_key_seq`: the rows holding back their key, by (hashtextextended(key), seq);
--   the claim and the WAL relay ask it with the hash and the key.
-- * `held_keys` and `held_records`: by `key_hash`, the SHA-256 of the key, a column the
--   database computes; the primary key, the foreign key and `held_records_by_key` use it.
--
-- Compatible: binaries from before this migration write the same columns and their queries
-- (by the whole key) give the same answers; `oldest_compatible` is unchanged.
DROP INDEX postal.outbox_held_key_seq;
CREATE INDEX outbox_held_key_seq ON postal.outbox (hashtextextended(event_key, 0), seq) WHERE held;

ALTER TABLE postal.held_records
    DROP CONSTRAINT held_records_group_id_topic_partition_record_key_fkey;
DROP INDEX postal.held_records_by_key;
ALTER TABLE postal.held_keys
    ADD COLUMN key_hash bytea GENERATED ALWAYS AS (sha256(record_key)) STORED;
ALTER TABLE postal.held_records
    ADD COLUMN key_hash bytea GENERATED ALWAYS AS (sha256(record_key)) STORED;
ALTER TABLE postal.held_keys
    DROP CONSTRAINT held_keys_pkey,
    ADD PRIMARY KEY (group_id, topic, partition, key_hash);
ALTER TABLE postal.held_records
    ADD FOREIGN KEY (group_id, topic, partition, key_hash)
        REFERENCES postal.held_keys (group_id, topic, partition, key_hash);
CREATE INDEX held_records_by_key
    ON postal.held_records (group_id, topic, partition, key_hash, kafka_offset);

-- `postal consumer reset` of a replaced log (a topic deleted and re-created) makes the old
-- log's held records dead letters with this reason: events never applied, whose offsets the
-- new log reuses. They go to the dead-letter topic the holding consumer named when it held
-- the key (`held_keys.dlq_topic`, its `dlq_suffix`; NULL in rows held before: the topic's
-- latest dead letters' topic, else `<topic>.dlq`).
ALTER TABLE postal.held_keys ADD COLUMN dlq_topic text;
ALTER TABLE postal.dead_letters DROP CONSTRAINT dead_letters_reason_check;
ALTER TABLE postal.dead_letters ADD CONSTRAINT dead_letters_reason_check CHECK (reason IN
    ('permanent', 'undecodable', 'missing_event_id', 'unknown_type', 'panic',
     'retries_exhausted', 'log_replaced'));
