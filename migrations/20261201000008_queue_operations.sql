-- Queue operations: canceled and discarded jobs, batches as things, pauses.

-- canceled: taken out of the queue before it was sent (one job, or every unsent job of a batch).
-- discarded: a dead letter an operator decided not to retry; kept with its history.
ALTER TABLE notification_jobs DROP CONSTRAINT notification_jobs_status_check;
ALTER TABLE notification_jobs ADD CONSTRAINT notification_jobs_status_check
    CHECK (status IN ('pending', 'sending', 'sent', 'failed-retrying', 'dead', 'expired', 'canceled', 'discarded'))
    NOT VALID;
ALTER TABLE notification_jobs VALIDATE CONSTRAINT notification_jobs_status_check;

-- The batch a job came in with. Not indexed (an index would take a new entry at every claim and finish of
-- every batch job): a batch's jobs are found by the id range its insert took, kept in notification_batches,
-- through the primary key.
ALTER TABLE notification_jobs ADD COLUMN batch_id bigint;

CREATE TABLE notification_batches (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    created_at    timestamptz NOT NULL DEFAULT now(),
    created_by    text        NOT NULL,
    -- Every job of the batch has an id in [first_job_id, last_job_id] (other inserts may interleave).
    first_job_id  bigint      NOT NULL,
    last_job_id   bigint      NOT NULL,
    jobs          bigint      NOT NULL,
    tenants       text[]      NOT NULL
);

-- A paused class is not claimed by any pod; a paused provider's classes are not claimed either. Intake
-- goes on accepting.
CREATE TABLE queue_pauses (
    kind       text        NOT NULL CHECK (kind IN ('class', 'provider')),
    name       text        NOT NULL,
    paused_at  timestamptz NOT NULL DEFAULT now(),
    paused_by  text        NOT NULL,
    PRIMARY KEY (kind, name)
);
