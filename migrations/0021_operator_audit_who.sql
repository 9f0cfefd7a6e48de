-- The audit trail records every operator action, from the dashboard and from the CLI
-- (`postal failed requeue/discard`, `postal dead-letters replay`) alike, through one code path
-- (`postal_admin::audit`). Who acted is now three things: `actor` (the dashboard's user, or the
-- OS user who ran the CLI), `via` (`dashboard` or `cli`) and `db_role` (the database role,
-- `current_user`, of the session that acted). `matched`: how many the action matched when it
-- started (`affected`: how many it changed; fewer when some were no longer parked or open).
--
-- A row is written before the action changes anything and is added to in the same
-- transaction as each batch it changes: a discarded event is in `removed` once its deletion
-- commits, never later.
--
-- Additive: dashboards from before this migration write rows without these columns (null).
ALTER TABLE postal.operator_audit
    ADD COLUMN via      text,
    ADD COLUMN db_role  text,
    ADD COLUMN matched  bigint;
