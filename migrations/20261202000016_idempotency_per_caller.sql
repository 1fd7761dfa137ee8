-- An idempotency key belongs to the caller that sent it: the same key from another API key is another
-- request, as payment APIs scope keys per account. Before this, two channels that number their
-- applications alike shared one key space, and the second got the first one's hold (and its token).
ALTER TABLE cif_idempotency ADD COLUMN caller text NOT NULL DEFAULT '';

-- Keys recorded before: their caller is the actor of the reservation that recorded them (the last
-- `cif.reserved` event of the code), so a retry within the window still replays its own hold.
UPDATE cif_idempotency i
SET caller = r.actor
FROM (
    SELECT DISTINCT ON (cif) cif, actor
    FROM audit_events
    WHERE action = 'cif.reserved' AND cif IN (SELECT code FROM cif_idempotency)
    ORDER BY cif, id DESC
) r
WHERE r.cif = i.code;

ALTER TABLE cif_idempotency DROP CONSTRAINT cif_idempotency_pkey;
ALTER TABLE cif_idempotency ADD PRIMARY KEY (caller, idempotency_key);
ALTER TABLE cif_idempotency ALTER COLUMN caller DROP DEFAULT;
