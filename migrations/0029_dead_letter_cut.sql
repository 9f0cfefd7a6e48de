-- What a dead letter's copy on its `.dlq` topic left out (`value`, `value,headers`,
-- `value,headers,key`; NULL: the copy is whole, or not published yet), as its
-- `postal_dlq_cut` header says. A cut copy does not hold the record: the row here is its only
-- whole copy, so dead-letter retention (`dead_letter_retention`, `postal cleanup
-- --dead-letter-retention`) keeps such a row until it is replayed or resolved, as it keeps a
-- dead letter not published yet.
--
-- Additive: binaries from before this migration run on it unchanged (they neither write the
-- column nor keep cut rows), and `oldest_compatible` is unchanged.

ALTER TABLE postal.dead_letters ADD COLUMN dlq_cut text;
