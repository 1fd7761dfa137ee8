-- scheduled: a job enqueued for later (run_at, deferred intake, a paced dead-letter replay). It is not
-- claimable: the stager moves due ones to pending and gives them their fair keys then. Kept out of the
-- claim indexes, a job waiting for tomorrow is never walked over by a claim (measured: with 500,000 of
-- them ahead, one claim took 176 ms) and never anchors another tenant's fair turns.
ALTER TABLE notification_jobs DROP CONSTRAINT notification_jobs_status_check;
ALTER TABLE notification_jobs ADD CONSTRAINT notification_jobs_status_check
    CHECK (status IN ('scheduled', 'pending', 'sending', 'sent', 'failed-retrying', 'dead', 'expired', 'canceled',
                      'discarded'))
    NOT VALID;
ALTER TABLE notification_jobs VALIDATE CONSTRAINT notification_jobs_status_check;

-- What the stager reads: the due scheduled jobs, earliest first.
CREATE INDEX notification_jobs_scheduled ON notification_jobs (run_after, id) WHERE status = 'scheduled';

-- Jobs already waiting for a later run_after (deferred by intake, replayed at a pace) become scheduled.
UPDATE notification_jobs SET status = 'scheduled' WHERE status = 'pending' AND run_after > now();
