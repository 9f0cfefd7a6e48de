-- The batch seal (0040) leaves a mark in the session when it refuses.
--
-- A handler's `SET CONSTRAINTS ALL IMMEDIATE` runs the seal's check early, in a transaction that
-- is still the batch's; the runtime then runs that handler's records one per transaction,
-- unsealed. It told that case by the seal's message in the body's error, and a handler that
-- wraps its database errors (`anyhow`'s `.context`, an error type of its own) hides the message:
-- every event of a correct handler was dead-lettered. So the check, before it raises, takes a
-- session-level advisory lock (1936023916, "seal", with the backend's pid): unlike anything done
-- in the transaction, it outlives the rollback of the handler's savepoint. The runtime reads and
-- releases it after a body fails, in the batch's transaction (`postal_consumer`'s
-- `dedup::seal_refused`), and before the connection goes back to the pool.
--
-- Compatible: binaries from before this migration never read the mark, and release it with the
-- session; `oldest_compatible` is unchanged.
CREATE OR REPLACE FUNCTION postal.batch_commit_sealed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('postal.sealed', true) IS DISTINCT FROM 'on' THEN
        -- Taken once (session locks count their takes; one release must clear the mark).
        IF NOT EXISTS (
            SELECT 1 FROM pg_catalog.pg_locks
            WHERE locktype = 'advisory' AND pid = pg_backend_pid()
              AND classid = 1936023916 AND objid = pg_backend_pid() AND objsubid = 2
        ) THEN
            PERFORM pg_try_advisory_lock(1936023916, pg_backend_pid());
        END IF;
        RAISE EXCEPTION 'postal: a handler committed the transaction it was given (or ran SET CONSTRAINTS ALL IMMEDIATE); only the consumer commits it'
            USING ERRCODE = '2D000',
                  HINT = 'remove COMMIT and BEGIN from the handler''s SQL (a savepoint, tx.begin(), undoes part of its work); name its own constraints in SET CONSTRAINTS';
    END IF;
    RETURN NULL;
END
$$;
