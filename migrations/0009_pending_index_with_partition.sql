-- no-transaction
-- The claim walks the pending rows in sequence order and keeps those of the key partitions its
-- claim loop owns. With the partition in the index, rows of other partitions outside the loop's
-- range are skipped inside the index instead of being fetched from the table one by one: with
-- several relays (or claim lanes) each claim would otherwise read every other loop's rows too.
--
-- Built CONCURRENTLY, outside a transaction: enqueue and claims go on while it builds (it reads
-- the whole outbox heap, not only the pending rows, twice). It waits for transactions already
-- writing the outbox (open claims) to end, without blocking anyone meanwhile. The old index
-- goes in migration 0016. (An earlier form of this migration built the index in a transaction
-- that blocked outbox writes and dropped the old index in it; the migrator accepts databases
-- where that form ran: `shared/src/migrate.rs`, `EARLIER_CHECKSUMS`.)
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_pending_seq_partition ON postal.outbox (seq, key_partition)
    WHERE status = 'pending';
