-- Personal data does not outlive its use: a job's payload and recipient are needed only to send it, so
-- the statement that finishes a job (sent, expired, canceled, discarded) erases the payload and masks
-- the recipient, unless the job's class keeps them for a stated time (disputes). Dead letters keep both
-- until someone retries or discards them: a retry needs them.

-- An erased payload is NULL (only a finished job's can be).
ALTER TABLE notification_jobs ALTER COLUMN payload DROP NOT NULL;

-- How long after it finishes this job's payload and recipient are kept: its class's
-- keep_personal_data when it was accepted (NULL: erased by the statement that finishes it).
ALTER TABLE notification_jobs ADD COLUMN keep_personal_data interval;

-- When a finished job's kept payload and recipient are to be erased (set by the finishing statement
-- from keep_personal_data; the sweep erases them and clears this).
ALTER TABLE notification_jobs ADD COLUMN personal_data_erase_at timestamptz;

-- Only rows still holding kept data: the sweep finds the due ones without reading the others.
CREATE INDEX notification_jobs_personal_data_erase ON notification_jobs (personal_data_erase_at)
    WHERE personal_data_erase_at IS NOT NULL;

-- What support needs to recognise a recipient without holding it: the last four characters of a
-- longer one, nothing of a short one. Idempotent (masking a masked value changes nothing). Not STRICT:
-- a strict function whose body is not (CASE) is called row by row instead of being inlined into the
-- finishing statements, which cost a fifth of the drain rate.
CREATE FUNCTION notification_masked(recipient text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE WHEN length(recipient) > 6
                THEN repeat('*', length(recipient) - 4) || right(recipient, 4)
                ELSE repeat('*', length(recipient)) END;

-- Jobs finished before this migration: nothing kept.
UPDATE notification_jobs SET payload = NULL, recipient = notification_masked(recipient)
WHERE status IN ('sent', 'expired', 'canceled', 'discarded');
