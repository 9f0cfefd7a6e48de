-- Rows checked out to a long-running transport (the task runner).
--
-- `runs`: the row's run number, one more at every check-out and never reset (`postal failed
-- requeue` resets `attempts`, not this), so it strictly increases across a task's runs: the
-- handler sees it as `Task::attempt`, and every change the relay makes to a checked-out row
-- requires the number it checked out (a fencing token).
--
-- `running`: the row is checked out and its run has no recorded outcome yet. A check-out that
-- finds it still set knows the previous run was cut off (the relay died, or lost its run
-- lease) and counts that run as a failed attempt.
--
-- Rows published to a broker keep 0 and false.
ALTER TABLE postal.outbox
    ADD COLUMN runs integer NOT NULL DEFAULT 0,
    ADD COLUMN running boolean NOT NULL DEFAULT false;
