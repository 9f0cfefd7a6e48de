-- The upgrade contract, checked by every Postal binary when it starts
-- (`postal_shared::check_schema`; README, "Schema and upgrades").
--
-- `oldest_compatible`: the oldest migration a binary must know to run on this schema. A binary
-- that knows an older one only refuses to start, with one line saying to upgrade it. Additive
-- migrations (new tables, columns with defaults, functions older binaries do not call) leave it
-- as it is; a migration that older binaries would misuse raises it to its own number.
--
-- Binaries from before this migration do not read it. Migrations 0013-0015 are additive: a
-- relay or consumer that knows migration 0012 runs on this schema as it did.
CREATE TABLE postal.schema_contract (
    one               boolean PRIMARY KEY DEFAULT true CHECK (one),
    oldest_compatible bigint  NOT NULL
);

INSERT INTO postal.schema_contract (oldest_compatible) VALUES (12);
