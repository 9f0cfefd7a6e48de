-- A key's pending events in sequence order: the claim reads each claimed row's nearest earlier
-- pending row of its topic and key with it, to notice one that it skipped because another
-- session row-locks it (producer/src/skipped.rs): the key's later events then wait for it.
--
-- Pending rows only (normally few: published rows are deleted or marked). Building it holds
-- back writes to postal.outbox while it runs, which takes as long as a scan of the table.
--
-- Additive: relays from before this migration do not read it, and `oldest_compatible` is
-- unchanged.
CREATE INDEX outbox_pending_key_seq ON postal.outbox (topic, event_key, seq)
    WHERE status = 'pending';
