-- The SQL enqueue (`postal.enqueue_bytes`, which `postal.enqueue` calls) refuses what the Rust
-- enqueue refuses, with the same one-line reasons after `postal.enqueue: `. It took: more than
-- 128 user headers (`MAX_USER_HEADERS`); an empty or reserved header name (`ce_traceparent`
-- and `ce_tracestate` were missing from its list), a name over 255 bytes, a CloudEvents
-- context attribute (`ce_dataschema`, …) or a `ce_<name>` whose name is not letters and
-- digits (`postal_shared::headers::user_header_problem`); an event type over 255 bytes (it
-- counted characters) or holding whitespace such as U+00A0; a payload over 16 MiB
-- (`MAX_PAYLOAD_BYTES`). The relay parked those rows (or consumers refused the record); rows
-- written before this migration still are. For a schema version below 1, a topic, a key, a
-- content type and the header sizes it refused the same values with reasons of its own.
-- Control and whitespace characters are named explicitly (Rust's `char::is_control` and
-- `is_whitespace`) instead of by `[[:cntrl:]]`/`[[:space:]]`, whose meaning follows the
-- database's locale.
--
-- The Rust side is the source of truth: the integration suite's `sql_enqueue_rules::sql_enqueue_*`
-- tests feed each case to both and compare the reasons.
--
-- Additive: binaries from before this migration run on it unchanged, and
-- `oldest_compatible` is unchanged.

-- A text as Rust shows it in a one-line reason: `p_debug` false, like
-- `postal_shared::headers::shown_name` (the first 64 characters, `char::escape_default`);
-- true, like `{:?}` of a `&str` without its quotes (control characters as `\u{..}`).
CREATE OR REPLACE FUNCTION postal.shown_text(p text, p_debug boolean) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_out text := '';
    v_c text;
    v_n integer;
    v_src text := CASE WHEN p_debug THEN coalesce(p, '') ELSE left(coalesce(p, ''), 64) END;
BEGIN
    FOREACH v_c IN ARRAY regexp_split_to_array(v_src, '') LOOP
        CONTINUE WHEN v_c = '';
        v_n := ascii(v_c);
        v_out := v_out || CASE
            WHEN v_c = E'\t' THEN '\t'
            WHEN v_c = E'\r' THEN '\r'
            WHEN v_c = E'\n' THEN '\n'
            WHEN v_c = '\' THEN '\\'
            WHEN v_c = '"' THEN '\"'
            WHEN v_c = '''' AND NOT p_debug THEN '\'''
            WHEN v_n BETWEEN 32 AND 126 THEN v_c
            -- {:?} escapes these too (not printable: separators, format characters).
            WHEN p_debug AND v_c ~ E'[\\xa0\\xad\\u1680\\u2000-\\u200f\\u2028-\\u202f\\u205f-\\u206f\\u3000\\ufeff]' THEN '\u{' || to_hex(v_n) || '}'
            WHEN p_debug AND v_n > 159 THEN v_c
            ELSE '\u{' || to_hex(v_n) || '}'
        END;
    END LOOP;
    RETURN v_out;
END
$$;

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
    v_ext text;
    v_size bigint;
    v_count bigint;
BEGIN
    -- As postal_shared::Topic and EventKey, in their order, with their reasons.
    IF p_topic IS NULL OR p_topic = '' THEN
        RAISE EXCEPTION 'postal.enqueue: invalid topic: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF octet_length(p_topic) > 249 THEN
        RAISE EXCEPTION 'postal.enqueue: invalid topic: % characters, at most 249 allowed',
            octet_length(p_topic) USING ERRCODE = '22023';
    END IF;
    IF p_topic IN ('.', '..') THEN
        RAISE EXCEPTION 'postal.enqueue: invalid topic: "%" is reserved', p_topic USING ERRCODE = '22023';
    END IF;
    v_name := substring(p_topic FROM '[^a-zA-Z0-9._-]');
    IF v_name IS NOT NULL THEN
        -- The character as Rust's {:?} of a char shows it.
        RAISE EXCEPTION 'postal.enqueue: invalid topic: "%" contains %; only [a-zA-Z0-9._-] are allowed',
            postal.shown_text(p_topic, true),
            CASE v_name WHEN '''' THEN '''\''''' WHEN '"' THEN '''"'''
                 ELSE '''' || postal.shown_text(v_name, true) || '''' END
            USING ERRCODE = '22023';
    END IF;
    IF p_key IS NULL OR p_key = '' THEN
        RAISE EXCEPTION 'postal.enqueue: invalid event key: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF octet_length(p_key) > 4096 THEN
        RAISE EXCEPTION 'postal.enqueue: invalid event key: % bytes, at most 4096 allowed',
            octet_length(p_key) USING ERRCODE = '22023';
    END IF;
    -- As postal_shared::EventType: 1 to 255 bytes (MAX_NAME_LEN), no whitespace or control
    -- characters (Rust's char::is_whitespace and is_control, named explicitly).
    IF p_event_type IS NULL OR p_event_type = '' THEN
        RAISE EXCEPTION 'postal.enqueue: invalid event type: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF octet_length(p_event_type) > 255 THEN
        RAISE EXCEPTION 'postal.enqueue: invalid event type: % bytes, at most 255 allowed',
            octet_length(p_event_type) USING ERRCODE = '22023';
    END IF;
    IF p_event_type ~ E'[\\x01-\\x20\\x7f-\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]' THEN
        RAISE EXCEPTION 'postal.enqueue: invalid event type: "%" contains whitespace or control characters',
            postal.shown_text(p_event_type, true) USING ERRCODE = '22023';
    END IF;
    -- As postal_shared::ContentType: 1 to 255 bytes (MAX_NAME_LEN), then a type/subtype
    -- without control characters (C0, DEL and C1, as char::is_control).
    IF p_content_type IS NULL OR octet_length(p_content_type) NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION 'postal.enqueue: invalid content type: must be 1–255 bytes' USING ERRCODE = '22023';
    END IF;
    IF position('/' IN p_content_type) = 0 OR p_content_type ~ E'[\\x01-\\x1f\\x7f-\\x9f]' THEN
        RAISE EXCEPTION 'postal.enqueue: invalid content type: "%" is not a MIME type of the form type/subtype',
            postal.shown_text(p_content_type, true) USING ERRCODE = '22023';
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
    -- postal_producer::MAX_PAYLOAD_BYTES, and postal_shared::SchemaVersion (1 or more).
    IF octet_length(p_payload) > 16777216 THEN
        RAISE EXCEPTION 'postal.enqueue: payload of % bytes exceeds the maximum of 16777216 bytes',
            octet_length(p_payload) USING ERRCODE = '22023';
    END IF;
    IF p_schema_version < 1 THEN
        RAISE EXCEPTION 'postal.enqueue: invalid schema version: % is below 1', p_schema_version
            USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(coalesce(p_headers, '{}'::jsonb)) <> 'object' THEN
        RAISE EXCEPTION 'postal.enqueue: headers must be a JSON object of strings' USING ERRCODE = '22023';
    END IF;

    -- Each name as NewEvent::with_header checks it, in name order (a BTreeMap's): empty or
    -- reserved (postal_shared::headers::RESERVED), then user_header_problem; names compared
    -- ignoring ASCII case only, as `eq_ignore_ascii_case`.
    FOR v_name IN SELECT h.k FROM jsonb_object_keys(coalesce(p_headers, '{}'::jsonb)) AS h(k)
                  ORDER BY h.k COLLATE "C" LOOP
        IF v_name = '' OR translate(v_name, 'ABCDEFGHIJKLMNOPQRSTUVWXYZ', 'abcdefghijklmnopqrstuvwxyz') IN ('ce_id', 'ce_type', 'ce_source', 'ce_time',
                'ce_specversion', 'ce_subject', 'ce_schemaversion', 'ce_postalseq',
                'ce_traceparent', 'ce_tracestate', 'content-type') THEN
            RAISE EXCEPTION 'postal.enqueue: header name "%" is reserved by Postal or empty',
                postal.shown_text(v_name, true) USING ERRCODE = '22023';
        END IF;
        IF octet_length(v_name) > 255 THEN
            RAISE EXCEPTION 'postal.enqueue: invalid headers: header name "%…" is longer than 255 bytes',
                postal.shown_text(v_name, false) USING ERRCODE = '22023';
        END IF;
        IF translate(left(v_name, 3), 'CE', 'ce') = 'ce_' THEN
            v_ext := substr(v_name, 4);
            IF translate(v_ext, 'ABCDEFGHIJKLMNOPQRSTUVWXYZ', 'abcdefghijklmnopqrstuvwxyz') IN ('id', 'source', 'specversion', 'type', 'datacontenttype',
                                'dataschema', 'subject', 'time') THEN
                RAISE EXCEPTION 'postal.enqueue: invalid headers: header "%" is a CloudEvents context attribute: CloudEvents consumers read it as the event''s own; use another name',
                    postal.shown_text(v_name, false) USING ERRCODE = '22023';
            END IF;
            IF v_ext !~ '^[A-Za-z0-9]+$' THEN
                RAISE EXCEPTION 'postal.enqueue: invalid headers: header "%" is a CloudEvents extension attribute (ce_<name>) whose name is not letters and digits: CloudEvents consumers refuse the record; rename it',
                    postal.shown_text(v_name, false) USING ERRCODE = '22023';
            END IF;
        END IF;
    END LOOP;
    IF EXISTS (SELECT 1 FROM jsonb_each(coalesce(p_headers, '{}'::jsonb)) AS h(k, v)
               WHERE jsonb_typeof(h.v) <> 'string') THEN
        RAISE EXCEPTION 'postal.enqueue: header values must be strings' USING ERRCODE = '22023';
    END IF;
    -- postal_producer::MAX_USER_HEADERS.
    SELECT count(*) INTO v_count FROM jsonb_object_keys(coalesce(p_headers, '{}'::jsonb));
    IF v_count > 128 THEN
        RAISE EXCEPTION 'postal.enqueue: invalid headers: at most 128 user headers (consumers refuse records with more than 256 headers by default)'
            USING ERRCODE = '22023';
    END IF;

    -- The same limits as the Rust enqueue (postal_shared::headers::MAX_HEADER_VALUE_BYTES and
    -- MAX_HEADERS_BYTES): a value AMQP could not carry in its one content-header frame would
    -- otherwise reach the relay, which parks it.
    SELECT h.k, octet_length(h.v #>> '{}') INTO v_name, v_size
    FROM jsonb_each(coalesce(p_headers, '{}'::jsonb)) AS h(k, v)
    WHERE octet_length(h.v #>> '{}') > 8192
    ORDER BY h.k COLLATE "C" LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'postal.enqueue: invalid headers: header "%" has a value of % bytes, more than the 8192 a header value may hold (put large data in the payload)',
            postal.shown_text(v_name, false), v_size USING ERRCODE = '22023';
    END IF;
    SELECT coalesce(sum(octet_length(h.k) + octet_length(h.v #>> '{}')), 0) INTO v_size
    FROM jsonb_each(coalesce(p_headers, '{}'::jsonb)) AS h(k, v);
    IF v_size > 65536 THEN
        RAISE EXCEPTION 'postal.enqueue: invalid headers: the headers hold % bytes (names and values), more than the 65536 an event''s headers may hold together (put large data in the payload)',
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
