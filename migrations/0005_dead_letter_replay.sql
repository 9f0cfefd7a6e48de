-- Operator tools: when a dead letter was sent back to its topic by `postal dead-letters replay`.
ALTER TABLE postal.dead_letters ADD COLUMN replayed_at timestamptz;
