-- The dedup retention horizon per consumer (dedup scope): every dedup row deleted by retention
-- was processed at or before `horizon`, and retention never deletes a row processed after it
-- (the cleanup records the horizon first, then deletes only rows at or before it). A replay of
-- records produced after the horizon is therefore deduplicated; `postal consumer reset` refuses
-- to move a group back to records older than it. No row: nothing was ever deleted.
CREATE TABLE postal.dedup_horizon (
    consumer_name text        PRIMARY KEY CHECK (consumer_name <> ''),
    horizon       timestamptz NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
