-- Jobs in flight per (tenant, class), for the tenant caps of a claim, counted with a snapshot of its own.
--
-- A claim whose tenant cap can bind takes its classes' claim locks (transaction-scoped advisory locks)
-- and then counts the jobs in flight, so that two claims of one class never both fill the same last
-- unit of a tenant's cap. The count must see every claim committed before the locks were granted, but
-- a statement's snapshot is taken when it starts, before it waits for the locks. A VOLATILE PL/pgSQL
-- function takes a new snapshot for each query it runs; called from the claim statement after the
-- locks (the statement passes it the lock count, so it cannot run first), it counts what the previous
-- holder of the locks committed. Lock, count and claim are then one statement, and the locks are held
-- until that statement's own commit, with no round trip to the client in between.
CREATE FUNCTION notification_jobs_in_flight(classes text[], caps int4[], locks_taken bigint)
RETURNS TABLE (tenant text, class text, inflight bigint, cap int4)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        SELECT b.tenant, b.class, count(*), max(c.n)
        FROM notification_jobs b
        JOIN unnest(classes, caps) AS c(class, n) ON c.class = b.class
        WHERE b.lease_expires_at IS NOT NULL AND b.status = 'sending'
        GROUP BY b.tenant, b.class;
END
$$;
