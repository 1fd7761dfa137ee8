-- Personal data sealed before it reaches Postgres: the service encrypts a job's recipient and payload
-- at intake and the worker opens them after its claim, so this table, its WAL, replicas and backups
-- hold ciphertext only. A sealed job keeps `payload` NULL and its masked recipient in `recipient`
-- (what support recognises it by); jobs stored before, or with sealing turned off, keep both in clear
-- and are sent as they are.

-- Recipient and payload, sealed (XChaCha20-Poly1305; layout in the service's queue::seal module).
-- Erased with the payload when the job finishes.
ALTER TABLE notification_jobs ADD COLUMN sealed bytea;

-- The personal-data key id `sealed` was sealed under: the key is derived from the master key and this
-- id, so a new id (security.personal_data_key_id) starts a new key and earlier rows stay readable.
ALTER TABLE notification_jobs ADD COLUMN sealed_with text;

-- Every personal-data key id ever used, with a check value of its key (an HMAC of a fixed label under
-- it; reveals nothing of the key). An instance whose master key gives another check value for its key
-- id is refused at start, before it seals a row the other instances could not open.
CREATE TABLE personal_data_keys (
    key_id      text PRIMARY KEY CHECK (length(key_id) BETWEEN 1 AND 64),
    check_value text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
