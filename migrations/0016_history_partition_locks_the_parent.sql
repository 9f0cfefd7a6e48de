-- History partition creation beside live archive inserts. Migration 0013's function locked only
-- the default partition: an archive insert that had already routed its row there waited on
-- that lock and, once the day's partition was attached, failed with "new row for relation
-- outbox_history_default violates partition constraint" (for a relay: a failed batch record,
-- and the batch published again). It now locks the parent too, so inserts wait before routing
-- their row and land in the new partition after the attach. Readers are not blocked.
-- Additive for the upgrade contract (the same function, same signature).
CREATE OR REPLACE FUNCTION postal.history_partition_ensure(p_day date, OUT created boolean, OUT moved bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_name text := 'outbox_history_' || to_char(p_day, 'YYYYMMDD');
    v_from timestamptz := p_day::timestamp AT TIME ZONE 'UTC';
    v_to   timestamptz := (p_day + 1)::timestamp AT TIME ZONE 'UTC';
BEGIN
    created := false;
    moved := 0;
    IF to_regclass('postal.' || v_name) IS NOT NULL THEN
        RETURN;
    END IF;
    -- No row of the day may reach the default partition between the move and the attach (the
    -- attach would then fail): relays' archive inserts wait for this transaction, at the
    -- parent, before they route their row (the parent first, then the partition: the order
    -- inserts lock them in).
    LOCK TABLE ONLY postal.outbox_history IN SHARE ROW EXCLUSIVE MODE;
    LOCK TABLE postal.outbox_history_default IN SHARE ROW EXCLUSIVE MODE;
    EXECUTE format(
        'CREATE TABLE postal.%I (LIKE postal.outbox_history INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
        v_name);
    EXECUTE format(
        'WITH m AS (DELETE FROM postal.outbox_history_default
                    WHERE published_at >= %L AND published_at < %L RETURNING *)
         INSERT INTO postal.%I SELECT * FROM m',
        v_from, v_to, v_name);
    GET DIAGNOSTICS moved = ROW_COUNT;
    -- The attach checks the new table against the range without a scan of its own.
    EXECUTE format(
        'ALTER TABLE postal.%I ADD CONSTRAINT %I CHECK (published_at IS NOT NULL AND published_at >= %L AND published_at < %L)',
        v_name, v_name || '_range', v_from, v_to);
    EXECUTE format(
        'ALTER TABLE postal.outbox_history ATTACH PARTITION postal.%I FOR VALUES FROM (%L) TO (%L)',
        v_name, v_from, v_to);
    EXECUTE format('ALTER TABLE postal.%I DROP CONSTRAINT %I', v_name, v_name || '_range');
    created := true;
END
$$;
