-- Pausing and resuming (`postal pause`, `postal resume`; docs/operations.md, "Pausing").
--
-- One row per pause in force. `side` says who honours it:
-- - `relay`: relays of the relay group `group_name` (NULL: of every relay group) claim nothing
--   of `topic` (NULL: of any topic) while the row exists. The claim reads this table in a
--   statement it already runs (producer/src/claim.rs).
-- - `consumer`: consumers of the consumer group `group_name` apply nothing of `topic` (NULL:
--   of any topic); the processing transaction reads it where it advances the stored offset
--   (consumer/src/offsets.rs), so a batch that finds a pause rolls back whole.
--
-- Resuming deletes the row. Both are audited in `postal.operator_audit` (actions `pause`,
-- `resume`), in the transaction that writes this table.
--
-- Uniqueness treats NULL as "every": one pause per (side, group, topic). An expression index
-- rather than `UNIQUE NULLS NOT DISTINCT`, which needs PostgreSQL 15; group and topic names are
-- never empty (checked below), so '' stands for NULL without clashing.
--
-- Additive: binaries from before this migration neither read nor write it (a relay or consumer
-- that predates it does not honour pauses: upgrade every relay and consumer of a group before
-- relying on a pause of it).
CREATE TABLE postal.pauses (
    side       text        NOT NULL CHECK (side IN ('relay', 'consumer')),
    group_name text        CHECK (group_name <> ''),
    topic      text        CHECK (topic <> ''),
    paused_at  timestamptz NOT NULL DEFAULT now(),
    paused_by  text        NOT NULL,
    reason     text,
    CHECK (side = 'relay' OR group_name IS NOT NULL)
);
CREATE UNIQUE INDEX pauses_one_per_scope
    ON postal.pauses (side, coalesce(group_name, ''), coalesce(topic, ''));

-- Every relay claim and every consumer transaction reads this table. Readable by every role
-- (with USAGE on the schema, which relays and consumers have): a relay or consumer role granted
-- by an earlier `postal grant` keeps working after the upgrade instead of failing each claim or
-- transaction with "permission denied" until `postal grant` is run again. It holds no secret:
-- scopes, times, operator names and reasons.
GRANT SELECT ON postal.pauses TO PUBLIC;
