-- Postal's core tables. Everything lives in the `postal` schema (created by the migrator before
-- this file runs, together with sqlx's bookkeeping table `postal._sqlx_migrations`).

-- The transactional outbox. One row per event, written in the producer's own transaction.
CREATE TABLE postal.outbox (
    -- Outbox sequence: the order in which events were enqueued. Per key, enqueue() serialises
    -- writers with a transaction-scoped advisory lock, so per key this is also commit order.
    seq             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid        NOT NULL CHECK (event_id <> '00000000-0000-0000-0000-000000000000'),
    topic           text        NOT NULL CHECK (topic <> ''),
    event_key       text        NOT NULL,
    event_type      text        NOT NULL CHECK (event_type <> ''),
    schema_version  integer     NOT NULL DEFAULT 1 CHECK (schema_version > 0),
    occurred_at     timestamptz NOT NULL DEFAULT now(),
    content_type    text        NOT NULL DEFAULT 'application/json',
    payload         bytea       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(headers) = 'object'),
    -- Hash partition of the key (0..255): the unit of ownership when several relays run.
    key_partition   smallint    NOT NULL GENERATED ALWAYS AS ((hashtext(event_key) & 255)::smallint) STORED,
    -- 'pending' → (published | deleted), or 'failed' (parked, holds back later events of its key).
    status          text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'published', 'failed')),
    -- Earliest time the relay may publish: the requested delivery time, later the retry backoff.
    available_at    timestamptz NOT NULL DEFAULT now(),
    -- True while this row must hold back later events of its key although it is not being
    -- published right now: parked, waiting for a retry, or scheduled for later delivery.
    held            boolean     NOT NULL DEFAULT false,
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    CONSTRAINT outbox_event_id_unique UNIQUE (event_id)
);

-- The claim reads pending rows in sequence order; the partial index keeps its cost independent
-- of how many published rows are retained.
CREATE INDEX outbox_pending_seq ON postal.outbox (seq) WHERE status = 'pending';
-- Lookup of rows that hold back their key (tiny in normal operation).
CREATE INDEX outbox_held_key_seq ON postal.outbox (event_key, seq) WHERE held;
-- Parked events, for the operator tools.
CREATE INDEX outbox_failed ON postal.outbox (topic, seq) WHERE status = 'failed';
-- Retention of published rows when they are kept.
CREATE INDEX outbox_published_at ON postal.outbox (published_at) WHERE status = 'published';

-- Consumer-side deduplication: one row per (consumer, event) whose effects were committed.
CREATE TABLE postal.processed_events (
    consumer_name   text        NOT NULL CHECK (consumer_name <> ''),
    event_id        uuid        NOT NULL,
    processed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, event_id)
);
CREATE INDEX processed_events_processed_at ON postal.processed_events (processed_at);
