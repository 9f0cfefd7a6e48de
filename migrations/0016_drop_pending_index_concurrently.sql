-- no-transaction
-- The old pending index, replaced by `outbox_pending_seq_partition` (migration 0009). Dropped
-- CONCURRENTLY: it waits for transactions using the outbox to end without blocking enqueue or
-- claims. A no-op where migration 0009 ran in its earlier form (which dropped it itself).
-- Additive for the upgrade contract: no binary reads this index by name.
DROP INDEX CONCURRENTLY IF EXISTS postal.outbox_pending_seq;
