-- Optional history of published events in daily partitions (seed 001: drop whole days instead
-- of deleting rows). With the relay's history mode (`postal relay --history <retention>`), each
-- published row is deleted from the outbox as usual and written here in the same transaction;
-- partitions are created a day ahead and dropped once their day is older than the retention —
-- a metadata-only DROP TABLE, no DELETE, no vacuum. The outbox itself stays small either way.
CREATE TABLE postal.outbox_history (
    seq             bigint      NOT NULL,
    event_id        uuid        NOT NULL,
    topic           text        NOT NULL,
    event_key       text        NOT NULL,
    event_type      text        NOT NULL,
    schema_version  integer     NOT NULL,
    occurred_at     timestamptz NOT NULL,
    content_type    text        NOT NULL,
    payload         bytea       NOT NULL,
    headers         jsonb       NOT NULL,
    attempts        integer     NOT NULL,
    created_at      timestamptz NOT NULL,
    published_at    timestamptz NOT NULL
) PARTITION BY RANGE (published_at);

-- Rows whose day has no partition yet (only if creating it failed) land here instead of failing
-- the relay; retention deletes them in batches.
CREATE TABLE postal.outbox_history_default PARTITION OF postal.outbox_history DEFAULT;

CREATE INDEX outbox_history_event_id ON postal.outbox_history (event_id);

-- Creates the partition for the UTC day `p_day` (`postal.outbox_history_YYYYMMDD`) if missing.
CREATE FUNCTION postal.history_partition_ensure(p_day date) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_name text := 'outbox_history_' || to_char(p_day, 'YYYYMMDD');
BEGIN
    IF to_regclass('postal.' || v_name) IS NULL THEN
        EXECUTE format(
            'CREATE TABLE IF NOT EXISTS postal.%I PARTITION OF postal.outbox_history
             FOR VALUES FROM (%L) TO (%L)',
            v_name,
            (p_day::timestamp AT TIME ZONE 'UTC'),
            ((p_day + 1)::timestamp AT TIME ZONE 'UTC'));
    END IF;
END
$$;

-- Drops the daily partitions whose whole day lies before `p_before`; returns their names.
CREATE FUNCTION postal.history_drop_before(p_before timestamptz) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    v_name text;
BEGIN
    FOR v_name IN
        SELECT c.relname FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'postal.outbox_history'::regclass
          AND c.relname ~ '^outbox_history_[0-9]{8}$'
          AND (to_date(substr(c.relname, 16), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC' <= p_before
        ORDER BY c.relname
    LOOP
        EXECUTE format('DROP TABLE postal.%I', v_name);
        RETURN NEXT v_name;
    END LOOP;
END
$$;
