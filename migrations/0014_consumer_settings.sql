-- What each consumer declares about itself, so that operator commands respect it. Written by the
-- consumer when it starts (and again every cleanup round until that succeeds).
--
-- `dedup_retention_ms`: how long the consumer keeps its dedup rows (`processed_events`); NULL
-- keeps them for good. `postal cleanup --dedup-retention` never deletes rows a consumer declares
-- it keeps (unless told to with `--ignore-declared`).
CREATE TABLE postal.consumer_settings (
    consumer_name      text        PRIMARY KEY CHECK (consumer_name <> ''),
    dedup_retention_ms bigint      CHECK (dedup_retention_ms > 0),
    updated_at         timestamptz NOT NULL DEFAULT now()
);
