-- A consumer's batch transaction can only be committed by the consumer runtime.
--
-- Throughput mode runs several handler bodies in one transaction and writes the batch's dedup
-- rows before the first body. A body whose SQL ran `COMMIT` (a script written for psql, `COMMIT
-- AND CHAIN`) would commit those rows with the effects of the bodies so far: the batch's later
-- events would then count as duplicates and never be applied. So every dedup row the batch
-- writes (the runtime marks its transaction with `SET LOCAL postal.batch = 'open'`) queues a
-- deferred check, run at commit: unless the runtime sealed the transaction just before its own
-- `COMMIT` (`set_config('postal.sealed', 'on', true)`), the commit fails and nothing of the
-- batch is kept. The body sees the error below from its `COMMIT`; the runtime runs the batch
-- again with a savepoint around each body, finds that body, and retries it or dead-letters it
-- with that reason.
--
-- `SET CONSTRAINTS ALL IMMEDIATE` in a handler runs these checks early, in a transaction that is
-- still the batch's: the runtime tells that from a commit (the transaction's id is unchanged)
-- and runs that handler's records one per transaction, unsealed, as `max_batch` 1 does.
--
-- Other writers of `processed_events` (`postal_consumer::dedup::record` in an application's
-- own transaction, releases, replays) do not set `postal.batch`: no check is queued for them.
--
-- Compatible: binaries from before this migration never set `postal.batch`;
-- `oldest_compatible` is unchanged.
CREATE FUNCTION postal.batch_commit_sealed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('postal.sealed', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'postal: a handler committed the transaction it was given (or ran SET CONSTRAINTS ALL IMMEDIATE); only the consumer commits it'
            USING ERRCODE = '2D000',
                  HINT = 'remove COMMIT and BEGIN from the handler''s SQL (a savepoint, tx.begin(), undoes part of its work); name its own constraints in SET CONSTRAINTS';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER processed_events_batch_sealed
    AFTER INSERT ON postal.processed_events
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (current_setting('postal.batch', true) = 'open')
    EXECUTE FUNCTION postal.batch_commit_sealed();
