-- The operations console (/console).
--
-- When refill and reclaim last ran on each pool, by any pod: a refill that took the pool's lock records
-- its end and the codes it added (0 when the pool was above its watermark); a reclaim records the holds
-- it returned. The console's Pools page reads them; nothing else depends on them.
ALTER TABLE cif_pools
    ADD COLUMN last_refill_at        timestamptz,
    ADD COLUMN last_refill_added     bigint,
    ADD COLUMN last_reclaim_at       timestamptz,
    ADD COLUMN last_reclaim_returned bigint;

-- console_sessions: one row per signed-in browser. The browser holds a random session token in an
-- HttpOnly cookie; only its SHA-256 digest is stored here, and the API key used to sign in is never
-- stored at all. A session acts as the key it signed in with (`key_name`), which must still be active
-- and hold the `admin` scope at every request; NULL means the bootstrap admin token, whose digest at
-- sign-in (`bootstrap_digest`) must still be the configured token's, so rotating it ends the session.
CREATE TABLE console_sessions (
    digest            bytea       PRIMARY KEY CHECK (length(digest) = 32),
    key_name          text        REFERENCES api_keys (name),
    bootstrap_digest  bytea       CHECK (length(bootstrap_digest) = 32),
    created_at        timestamptz NOT NULL DEFAULT now(),
    last_seen_at      timestamptz NOT NULL DEFAULT now(),
    expires_at        timestamptz NOT NULL,
    -- A one-line outcome of the last action, shown once on the next page (post/redirect/get).
    notice            text,
    CHECK ((key_name IS NULL) <> (bootstrap_digest IS NULL))
);
CREATE INDEX console_sessions_expires_at ON console_sessions (expires_at);
