-- History maintenance that cannot wedge (issue: a default partition already holding a row of
-- the day made `CREATE TABLE … PARTITION OF` fail with "updated partition constraint for
-- default partition would be violated", for that day and every later one).
--
-- The partition of a day is now made as a plain table, the day's rows are moved into it out of
-- the default partition, and it is attached: all in the caller's transaction, which bounds its
-- waits with `lock_timeout` and makes one day per transaction (see
-- `producer/src/retention.rs`). Returns whether it created the partition, and how many rows it
-- moved.
DROP FUNCTION postal.history_partition_ensure(date);

CREATE FUNCTION postal.history_partition_ensure(p_day date, OUT created boolean, OUT moved bigint)
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
    -- attach would then fail): relays' archive inserts into it wait for this transaction.
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
