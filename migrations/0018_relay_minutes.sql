-- What each relay did, per minute and topic: the dashboard's publish, failure and lag charts.
--
-- A relay tallies its recorded outcomes in memory and writes its running totals here every
-- 5 s, on a connection of its own, never in a claim's transaction: publishing does not wait on
-- this table. Totals are written as they stand and a row only grows (`greatest`), so a write
-- retried after a lost answer counts nothing twice. A relay that dies loses at most its last
-- few seconds of counts (the events themselves are unaffected). Each relay writes only its
-- own rows (`relay_id`), so relays never wait on each other here. Rows older than a day are
-- deleted by the relays' housekeeping.
--
-- Additive: relays from before this migration do not write it (their publishing is not
-- charted), and `oldest_compatible` is unchanged.
CREATE TABLE postal.relay_minutes (
    minute      timestamptz      NOT NULL,
    relay_id    uuid             NOT NULL,
    topic       text             NOT NULL,
    -- Events recorded published (acknowledged by the destination).
    published   bigint           NOT NULL DEFAULT 0,
    -- Failed attempts rescheduled for a retry (including waits for an unreachable destination).
    retried     bigint           NOT NULL DEFAULT 0,
    -- Events parked as failed.
    parked      bigint           NOT NULL DEFAULT 0,
    -- End-to-end lag of the published events, from their enqueue (`created_at`) to their
    -- outcome being recorded: the sum and the largest, over `lag_events` of them.
    lag_events  bigint           NOT NULL DEFAULT 0,
    lag_ms_sum  double precision NOT NULL DEFAULT 0,
    lag_ms_max  double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, relay_id, topic)
);

-- Migration 0017 indexed the history by publish time for the publish chart, which now reads
-- the table above: the index only cost every history insert a write.
DROP INDEX IF EXISTS postal.outbox_history_published_at;
