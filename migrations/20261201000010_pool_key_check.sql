-- A pool's key check value: HMAC-SHA256 of a fixed label under the pool's key (first 16 bytes, hex). Set
-- when the pool row is created, together with its format, and pinned from then on: an instance with
-- another master key or key_id refuses to start, and a refill advances the counter only while the row
-- still holds the format and key check of the instance running it. Rows created before this column are
-- filled by the first instance that starts (after its stored-code check).
ALTER TABLE cif_pools ADD COLUMN key_check text;
