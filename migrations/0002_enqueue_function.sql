-- SQL-level enqueue, so services in any language can write to the outbox inside their own
-- transactions. Same rules as the Rust `enqueue`: validated envelope, per-key writer
-- serialisation (transaction-scoped advisory lock), and one relay wake-up per transaction.

-- A time-ordered UUID (version 7) for PostgreSQL versions without a built-in one.
CREATE FUNCTION postal.uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;

CREATE FUNCTION postal.enqueue_bytes(
    p_topic          text,
    p_key            text,
    p_event_type     text,
    p_content_type   text,
    p_payload        bytea,
    p_headers        jsonb       DEFAULT '{}'::jsonb,
    p_schema_version integer     DEFAULT 1,
    p_event_id       uuid        DEFAULT NULL,
    p_deliver_at     timestamptz DEFAULT NULL,
    p_occurred_at    timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id uuid := coalesce(p_event_id, postal.uuid_v7());
BEGIN
    IF p_topic IS NULL OR p_topic !~ '^[a-zA-Z0-9._-]{1,249}$' OR p_topic IN ('.', '..') THEN
        RAISE EXCEPTION 'postal.enqueue: invalid topic %', quote_nullable(p_topic) USING ERRCODE = '22023';
    END IF;
    IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 4096 THEN
        RAISE EXCEPTION 'postal.enqueue: the key must be 1 to 4096 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_event_type IS NULL OR p_event_type !~ '^[^[:space:][:cntrl:]]{1,255}$' THEN
        RAISE EXCEPTION 'postal.enqueue: invalid event type %', quote_nullable(p_event_type) USING ERRCODE = '22023';
    END IF;
    IF p_content_type IS NULL OR position('/' IN p_content_type) = 0 THEN
        RAISE EXCEPTION 'postal.enqueue: invalid content type %', quote_nullable(p_content_type) USING ERRCODE = '22023';
    END IF;
    IF p_payload IS NULL THEN
        RAISE EXCEPTION 'postal.enqueue: the payload must not be NULL' USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(coalesce(p_headers, '{}'::jsonb)) <> 'object' THEN
        RAISE EXCEPTION 'postal.enqueue: headers must be a JSON object of strings' USING ERRCODE = '22023';
    END IF;
    IF EXISTS (SELECT 1 FROM jsonb_each(coalesce(p_headers, '{}'::jsonb)) AS h(k, v)
               WHERE jsonb_typeof(h.v) <> 'string'
                  OR lower(h.k) IN ('ce_id', 'ce_type', 'ce_source', 'ce_time', 'ce_specversion',
                                    'ce_subject', 'ce_schemaversion', 'ce_postalseq', 'content-type')) THEN
        RAISE EXCEPTION 'postal.enqueue: header values must be strings and names must not be reserved'
            USING ERRCODE = '22023';
    END IF;

    PERFORM pg_advisory_xact_lock(1886352244, hashtext(p_key));
    INSERT INTO postal.outbox (event_id, topic, event_key, event_type, schema_version, occurred_at,
                               content_type, payload, headers, available_at, held)
    VALUES (v_id, p_topic, p_key, p_event_type, coalesce(p_schema_version, 1),
            coalesce(p_occurred_at, now()), p_content_type, p_payload, coalesce(p_headers, '{}'::jsonb),
            coalesce(p_deliver_at, now()), coalesce(p_deliver_at > now(), false));
    PERFORM pg_notify('postal_outbox', '');
    RETURN v_id;
END
$$;

CREATE FUNCTION postal.enqueue(
    p_topic          text,
    p_key            text,
    p_event_type     text,
    p_payload        jsonb,
    p_headers        jsonb       DEFAULT '{}'::jsonb,
    p_schema_version integer     DEFAULT 1,
    p_event_id       uuid        DEFAULT NULL,
    p_deliver_at     timestamptz DEFAULT NULL,
    p_occurred_at    timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    SELECT postal.enqueue_bytes(p_topic, p_key, p_event_type, 'application/json',
                                convert_to(p_payload::text, 'UTF8'), p_headers, p_schema_version,
                                p_event_id, p_deliver_at, p_occurred_at)
$$;
