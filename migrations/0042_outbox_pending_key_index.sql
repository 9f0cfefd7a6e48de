-- A key's oldest pending row, found in one index probe: for the WAL relay's order.
--
-- The WAL relay publishes the rows its slot's stream gives it. A row the stream does not hold —
-- committed before the slot existed (or while an operator had dropped it), requeued by an
-- operator after it was parked, left pending by an earlier batch — is still pending, and a later
-- row of its key read from the stream must not be published before it. Per key, commit order is
-- `seq` order (`enqueue` serialises a key's writers), so the relay asks, for each row it takes,
-- for its key's oldest pending row before it (`producer/src/wal/rows.rs`, `older_column`): one
-- probe of this index. Rows are deleted (or marked) when published, so it stays as small as the
-- backlog.
--
-- Compatible: additive; `oldest_compatible` is unchanged.
CREATE INDEX outbox_key_pending_seq ON postal.outbox (hashtextextended(event_key, 0), seq)
    WHERE status = 'pending';
