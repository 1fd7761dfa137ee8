-- The capped claim's in-flight count also names the jobs it counted.
--
-- A capped claim statement takes its snapshot when it starts, then waits for the class's claim lock
-- while the previous holder claims and commits. The jobs that holder claimed are still pending in the
-- waiting statement's snapshot, and its pick walks them first (they head the claim order): it locked
-- the current version of each, found it no longer claimable, and skipped it, but kept the lock until
-- it committed. Measured in psql with one 256-job claim committed during the wait: the pick visited
-- 512 rows and wrote 512 lock records instead of 256, and a worker finishing one of those jobs waited
-- for the claim's commit (sampled during a drain: 199 of 1,589 samples of active backends were
-- finishes waiting on a claim's transaction). This function counts in flight with a snapshot taken after the locks, so
-- the jobs it counted are exactly those the previous holders claimed; the claim leaves them out of
-- its pick before locking anything.
DROP FUNCTION notification_jobs_in_flight(text[], int4[], bigint);
CREATE FUNCTION notification_jobs_in_flight(classes text[], caps int4[], locks_taken bigint)
RETURNS TABLE (tenant text, class text, inflight bigint, cap int4, ids int8[])
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        SELECT b.tenant, b.class, count(*), max(c.n), array_agg(b.id)
        FROM notification_jobs b
        JOIN unnest(classes, caps) AS c(class, n) ON c.class = b.class
        WHERE b.lease_expires_at IS NOT NULL AND b.status = 'sending'
        GROUP BY b.tenant, b.class;
END
$$;
