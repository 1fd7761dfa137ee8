-- Leaner indexes on notification_jobs, from `cifpool bench queue` (drain of 100,000 jobs, no-op
-- provider, 2 cores, fsync on).
--
-- 1. In-flight rows are indexed by "has a lease" instead of by status = 'sending'. Every fenced finish
--    (`… WHERE id = $2 AND status = 'sending' AND lease_token = $1`) implied the old index's predicate,
--    so the planner could, and after an ANALYZE taken while nothing was in flight did, scan the whole
--    in-flight index for each finish instead of looking the row up by its primary key: O(in flight)
--    per finish, and O(n²) for a batched finish (500 jobs: 110 ms instead of ~5 ms, auto_explain).
--    A fence never tests `lease_expires_at`, so this index cannot be chosen for it; the lease sweep
--    (`lease_expires_at < now()`) and the per-tenant in-flight caps still use it. A lease is set only
--    while a job is held (claim sets it, every way out clears it), so it marks the same rows.
-- 2. Idempotency keys are unique among keyed jobs only. Most jobs (bulk promo) carry no key, and a
--    non-partial index took a new entry on every claim and every finish (neither is a HOT update).
DROP INDEX notification_jobs_inflight;
CREATE INDEX notification_jobs_leased ON notification_jobs (lease_expires_at) WHERE lease_expires_at IS NOT NULL;

ALTER TABLE notification_jobs DROP CONSTRAINT notification_jobs_idempotency;
CREATE UNIQUE INDEX notification_jobs_idempotency ON notification_jobs (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- 3. The send result lives in the job row. A separate results table cost every sent job a second heap
--    insert, its primary-key entry and a foreign-key check (a FOR KEY SHARE lock on the job row just
--    updated). "Exactly one result per job" now holds by construction: the fenced finish that marks a
--    job sent is the only write of its result, and a lost lease makes it write nothing. The old table's
--    name remains as a view, so queries and runbooks that read it keep working.
ALTER TABLE notification_jobs ADD COLUMN provider text, ADD COLUMN provider_ref text;
UPDATE notification_jobs AS j SET provider = r.provider, provider_ref = r.provider_ref
    FROM notification_results AS r WHERE r.job_id = j.id;
DROP TABLE notification_results;
CREATE VIEW notification_results AS
    SELECT id AS job_id, provider, provider_ref, attempts AS attempt, finished_at AS sent_at
    FROM notification_jobs WHERE status = 'sent';
