-- The capped claim's in-flight count reads only the leases that may still be held: those not expired
-- for longer than `expired_for` (the service passes its lease length).
--
-- The count read every entry of the lease index. While the cleanup horizon is held back (an open
-- snapshot, a stuck replication slot), that index keeps an entry for every job claimed since, each
-- pointing at a row version that is no longer current: under `bench horizon` the count went from
-- about a millisecond to 30-45 ms a claim within 90 s of the hold, and every capped claim of a class
-- waits for the one before it. Bounded below, it reads only the jobs claimed within the last two lease
-- lengths, however long the horizon is held.
--
-- What it no longer counts: a lease expired for longer than a lease length and still not swept (the
-- sweep returns expired leases every few seconds). Its holder has not extended it for that long, so it
-- is gone or cut off from the database, and it can no longer finish the job once the sweep has run;
-- the job is counted again when it is claimed again. A job the sweep has returned was never counted.
--
-- The function takes no lock count and returns no ids any more: the claim takes its locks in an earlier
-- statement of its transaction, so its snapshot already sees the claims settled before it. The
-- previous function stays for pods of the previous release during a rolling deploy.
CREATE FUNCTION notification_jobs_in_flight(classes text[], caps int4[], expired_for interval)
RETURNS TABLE (tenant text, class text, inflight bigint, cap int4)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        SELECT b.tenant, b.class, count(*), max(c.n)
        FROM notification_jobs b
        JOIN unnest(classes, caps) AS c(class, n) ON c.class = b.class
        WHERE b.lease_expires_at > now() - expired_for AND b.status = 'sending'
        GROUP BY b.tenant, b.class;
END
$$;
