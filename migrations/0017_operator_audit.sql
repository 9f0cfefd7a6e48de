-- Operator tools (`postal dashboard`, `postal failed`, `postal dead-letters`).
--
-- Every action an operator takes through the dashboard: when, who, what, on how many, and for a
-- discard the discarded events themselves (their only copy left). Append-only; nothing in
-- Postal deletes from it.
CREATE TABLE postal.operator_audit (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    actor       text        NOT NULL,
    action      text        NOT NULL,
    -- What the action was given: ids or the filter, as JSON.
    target      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    affected    bigint      NOT NULL,
    -- Discard: the events deleted, whole (JSON array); else null.
    removed     jsonb
);
CREATE INDEX operator_audit_at ON postal.operator_audit (at);

-- A dead letter an operator looked at and settled without replaying it.
ALTER TABLE postal.dead_letters
    ADD COLUMN resolved_at timestamptz,
    ADD COLUMN resolved_by text;
-- The dead letters still open (neither replayed nor resolved), per consumer: the dashboard's
-- list and counts read only these.
CREATE INDEX dead_letters_open ON postal.dead_letters (consumer_name, id)
    WHERE replayed_at IS NULL AND resolved_at IS NULL;
-- Parked events in outbox order (the dashboard lists the oldest first: without it the planner
-- walks the primary key past every published row kept in the outbox).
CREATE INDEX outbox_failed_seq ON postal.outbox (seq) WHERE status = 'failed';
-- Parked events by when they were parked (`available_at` of a failed row), for the dashboard's
-- time filter and its parked-per-minute chart.
CREATE INDEX outbox_failed_at ON postal.outbox (available_at) WHERE status = 'failed';
-- The dashboard's publish chart reads the last hour of the history (history mode). Building it
-- holds back writes to the history (the relay's publishing, in history mode) while it runs.
CREATE INDEX outbox_history_published_at ON postal.outbox_history (published_at);
-- The dashboard's dead-letters-per-minute chart.
CREATE INDEX dead_letters_created_at ON postal.dead_letters (created_at);
