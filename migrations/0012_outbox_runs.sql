-- The run number of a row checked out to a long-running transport (the task runner): one more
-- at every check-out, never reset (`postal failed requeue` resets `attempts`, not this), so it
-- strictly increases across a task's runs: the handler sees it as `Task::attempt`, and every
-- change the relay makes to a checked-out row requires the number it checked out (a fencing
-- token). Rows published to a broker keep 0.
ALTER TABLE postal.outbox ADD COLUMN runs integer NOT NULL DEFAULT 0;
