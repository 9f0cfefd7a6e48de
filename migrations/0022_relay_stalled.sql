-- What holds a relay up, as its claim watchdog last found it (producer/src/relay/stall.rs):
-- one line while its claims wait on the database, NULL while it makes progress. Shown by
-- `postal status`. Additive: older binaries neither read nor write it.
ALTER TABLE postal.relay_instances ADD COLUMN stalled text;
