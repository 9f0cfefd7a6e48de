-- A replay's upper end. `postal consumer reset` moving a group's stored offset back sets
-- `replay_until` to the offset the group had reached: every record below it was processed
-- before (applied, deduplicated or dead-lettered). A record below it whose dedup row is gone
-- (deleted by dedup retention) is therefore skipped, never applied a second time; the check
-- uses offsets only, so no clock (the relay's record timestamps, the database's
-- `processed_at`) decides it. NULL: no replay in progress (or `--force-past-retention`, which
-- applies such records again on purpose).
ALTER TABLE postal.consumer_offsets
    ADD COLUMN replay_until bigint CHECK (replay_until >= 0);
