-- The SQL enqueue refuses what the Rust enqueue cannot express or refuses: an `occurred_at`
-- or `deliver_at` of 'infinity', '-infinity' or past the year 262,000 (PostgreSQL stores them;
-- the relay's time type cannot hold them, and decoding one stopped the relay's claim), and a
-- content type over 255 bytes or with control characters (the Rust `ContentType` refuses
-- both; RabbitMQ parked the long ones and Kafka carried control characters in a header).
-- Rows written around the function are parked by the relay with the reason.
--
-- Additive: binaries from before this migration run on it unchanged, and
-- `oldest_compatible` is unchanged.

CREATE OR REPLACE FUNCTION postal.enqueue_bytes(
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
    v_name text;
    v_size bigint;
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
    IF p_content_type IS NULL OR position('/' IN p_content_type) = 0
       OR octet_length(p_content_type) > 255 OR p_content_type ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION 'postal.enqueue: invalid content type % (a type/subtype of at most 255 bytes, no control characters)',
            quote_nullable(left(regexp_replace(p_content_type, '[[:cntrl:]]', '?', 'g'), 64)) USING ERRCODE = '22023';
    END IF;
    IF p_occurred_at IS NOT NULL AND NOT (p_occurred_at > '-infinity' AND p_occurred_at < '262000-01-01') THEN
        RAISE EXCEPTION 'postal.enqueue: occurred_at % lies outside the times Postal carries', p_occurred_at USING ERRCODE = '22023';
    END IF;
    IF p_deliver_at IS NOT NULL AND NOT (p_deliver_at > '-infinity' AND p_deliver_at < '262000-01-01') THEN
        RAISE EXCEPTION 'postal.enqueue: deliver_at % lies outside the times Postal carries', p_deliver_at USING ERRCODE = '22023';
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

    -- The same limits as the Rust enqueue (postal_shared::headers::MAX_HEADER_VALUE_BYTES and
    -- MAX_HEADERS_BYTES): a value AMQP could not carry in its one content-header frame would
    -- otherwise reach the relay, which parks it.
    SELECT h.k, octet_length(h.v #>> '{}') INTO v_name, v_size
    FROM jsonb_each(coalesce(p_headers, '{}'::jsonb)) AS h(k, v)
    WHERE octet_length(h.v #>> '{}') > 8192
    ORDER BY h.k LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'postal.enqueue: header "%" has a value of % bytes, more than the 8192 a header value may hold (put large data in the payload)',
            left(regexp_replace(v_name, '[[:cntrl:]]', '?', 'g'), 64), v_size USING ERRCODE = '22023';
    END IF;
    SELECT coalesce(sum(octet_length(h.k) + octet_length(h.v #>> '{}')), 0) INTO v_size
    FROM jsonb_each(coalesce(p_headers, '{}'::jsonb)) AS h(k, v);
    IF v_size > 65536 THEN
        RAISE EXCEPTION 'postal.enqueue: the headers hold % bytes (names and values), more than the 65536 an event''s headers may hold together (put large data in the payload)',
            v_size USING ERRCODE = '22023';
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

