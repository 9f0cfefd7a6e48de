-- Relay groups: relays that serve different topics of one outbox (e.g. `postal relay` for the
-- broker topics and a service's embedded relay running task handlers) each split the key
-- partitions among the members of their own group.

ALTER TABLE postal.relay_instances ADD COLUMN relay_group text NOT NULL DEFAULT 'default';

ALTER TABLE postal.relay_partitions ADD COLUMN relay_group text NOT NULL DEFAULT 'default';
ALTER TABLE postal.relay_partitions DROP CONSTRAINT relay_partitions_pkey;
ALTER TABLE postal.relay_partitions ADD PRIMARY KEY (relay_group, key_partition);
