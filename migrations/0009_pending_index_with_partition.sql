-- The claim walks the pending rows in sequence order and keeps those of the key partitions its
-- claim loop owns. With the partition in the index, rows of other partitions outside the loop's
-- range are skipped inside the index instead of being fetched from the table one by one: with
-- several relays (or claim lanes) each claim would otherwise read every other loop's rows too.
-- Built in the migration's transaction: it blocks writes to the outbox while it builds, which
-- takes as long as reading the pending rows once.
CREATE INDEX outbox_pending_seq_partition ON postal.outbox (seq, key_partition)
    WHERE status = 'pending';
DROP INDEX postal.outbox_pending_seq;
