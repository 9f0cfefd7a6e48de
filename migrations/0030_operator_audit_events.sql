-- A discard's deleted events, whole, one row per event, referencing the audit row of the
-- discard (`postal.operator_audit`). Before, a discard appended its events to that row's one
-- jsonb `removed` array: a discard of more than about 256 MiB of events failed there
-- (jsonb's limit of 268,435,455 bytes), and every event went through the client that
-- discarded (the CLI or the dashboard) on its way. A discard now moves each batch in one
-- statement inside the database (DELETE … RETURNING into INSERT), so no event's payload
-- leaves it; batches are bounded by count and by bytes.
--
-- `removed` stays, for the discards recorded before this migration (and by older binaries).
-- Append-only, like the audit; nothing in Postal deletes from it.
--
-- Additive: binaries from before this migration run on it unchanged (they write `removed`),
-- and `oldest_compatible` is unchanged.
CREATE TABLE postal.operator_audit_events (
    audit_id        bigint      NOT NULL REFERENCES postal.operator_audit (id),
    -- The event's `seq` in the outbox when it was discarded.
    seq             bigint      NOT NULL,
    event_id        uuid        NOT NULL,
    topic           text        NOT NULL,
    event_key       text        NOT NULL,
    event_type      text        NOT NULL,
    schema_version  integer     NOT NULL,
    occurred_at     timestamptz NOT NULL,
    content_type    text        NOT NULL,
    headers         jsonb       NOT NULL,
    attempts        integer     NOT NULL,
    last_error      text,
    payload         bytea       NOT NULL,
    PRIMARY KEY (audit_id, seq)
);

-- Readable (and writable) by the roles that read (and write) the audit trail: whoever was
-- granted SELECT or INSERT on `postal.operator_audit` gets the same on its events.
DO $$
DECLARE g record;
BEGIN
    FOR g IN
        SELECT DISTINCT grantee, privilege_type
        FROM information_schema.role_table_grants
        WHERE table_schema = 'postal' AND table_name = 'operator_audit'
          AND privilege_type IN ('SELECT', 'INSERT')
          AND grantee <> current_user
    LOOP
        EXECUTE format('GRANT %s ON postal.operator_audit_events TO %s', g.privilege_type,
            CASE WHEN g.grantee = 'PUBLIC' THEN 'PUBLIC' ELSE quote_ident(g.grantee) END);
    END LOOP;
END
$$;
