-- One WAL relay per replication slot (issue 50, docs/wal-relay.md "One reader per slot").
-- A WAL relay streams from its slot only while it holds the slot's lease: `holder` until
-- `lease_until`, renewed while it runs. A standby takes an expired (or free) lease by raising
-- `token`, then ends the old holder's walsender. The relay's marking transaction locks this
-- row (FOR SHARE) and commits only while `token` is still the one it took, so a relay that lost
-- the lease (frozen, partitioned) cannot mark or confirm anything afterwards.
--
-- Additive: binaries from before this migration never read it, and `oldest_compatible` is
-- unchanged.
CREATE TABLE postal.wal_slot_leases (
    slot_name    text        PRIMARY KEY,
    holder       uuid,
    host         text        NOT NULL DEFAULT '',
    -- Raised at every change of holder: the fencing token.
    token        bigint      NOT NULL DEFAULT 0,
    lease_until  timestamptz,
    acquired_at  timestamptz
);
