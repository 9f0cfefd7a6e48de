-- The batch seal (0040) counts its refusals in the session.
--
-- A handler's `SET CONSTRAINTS ALL IMMEDIATE` runs the seal's check early, in a transaction that
-- is still the batch's. The runtime used to tell that case by the seal's message in the body's
-- error, and missed it twice: a handler that wraps its database errors (`anyhow`'s `.context`)
-- hides the message, and a handler that catches the failure in a savepoint of its own and takes
-- another branch ("constraint check failed: reject the order") returns no error at all — so in
-- throughput mode it rejected every event that one record per transaction applies.
--
-- So the check, before it raises, takes a number from a sequence: unlike anything done in the
-- transaction, `nextval` outlives the rollback of the handler's savepoint, and `currval` is the
-- session's own. The runtime reads `postal.batch_seal_refusals()` when it opens a batch's session
-- and again in the statement that seals the batch for its commit (and after a failed body): a
-- different number means the seal refused in this session meanwhile, and the batch runs again one
-- record per transaction, unsealed, as `max_batch` 1 does. No statement of its own: both reads ride
-- on statements the batch runs anyway.
--
-- Both functions run as their owner (SECURITY DEFINER), so the consumer's role needs no privilege
-- on the sequence; `postal grant --consumer` grants EXECUTE on the reader for a database whose
-- functions are not executable by PUBLIC.
--
-- Compatible: binaries from before this migration never read the count; `oldest_compatible` is
-- unchanged.
CREATE SEQUENCE postal.batch_seal_refusals;

-- Counts a refusal (called by the seal's check only when it refuses).
CREATE FUNCTION postal.batch_seal_refused() RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM nextval('postal.batch_seal_refusals');
END
$$;

-- The number of this session's last refusal. A session with none yet (a new one, or one whose
-- numbers `DISCARD SEQUENCES` / `DISCARD ALL` forgot) takes a number now, unlike any read before
-- in it: a handler that discards them after a refusal cannot make the count look unchanged. In a
-- read-only transaction (a DBA's read-only window, where a batch writes nothing) 0.
CREATE FUNCTION postal.batch_seal_refusals() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN currval('postal.batch_seal_refusals');
EXCEPTION WHEN object_not_in_prerequisite_state THEN
    -- 55000: currval before any nextval in this session.
    IF current_setting('transaction_read_only') = 'on' THEN
        RETURN 0;
    END IF;
    RETURN nextval('postal.batch_seal_refusals');
END
$$;

CREATE OR REPLACE FUNCTION postal.batch_commit_sealed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('postal.sealed', true) IS DISTINCT FROM 'on' THEN
        PERFORM postal.batch_seal_refused();
        RAISE EXCEPTION 'postal: a handler committed the transaction it was given (or ran SET CONSTRAINTS ALL IMMEDIATE); only the consumer commits it'
            USING ERRCODE = '2D000',
                  HINT = 'remove COMMIT and BEGIN from the handler''s SQL (a savepoint, tx.begin(), undoes part of its work); name its own constraints in SET CONSTRAINTS';
    END IF;
    RETURN NULL;
END
$$;
