-- The outbox is a queue: rows are inserted, claimed and deleted within seconds, so almost every
-- row it ever held is dead. Until VACUUM removes them, the claim steps over the index entries of
-- deleted rows at the head of `outbox_pending_seq` (`postal-bench explain` measures it).
-- PostgreSQL's default waits for dead rows to reach 20 % of the table's last known size, which
-- after a large backlog means hundreds of thousands; vacuum the outbox after every 10,000 dead
-- rows instead. Per-table settings, so operators can still tune them with ALTER TABLE.
ALTER TABLE postal.outbox SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 10000
);
