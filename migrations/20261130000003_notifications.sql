-- Notification queue.
--
-- One table for every class; worker groups differ only in which classes they claim and in which order
-- (see src/queue/policy.rs). Life of a job:
--   pending -> sending (claimed: lease + fencing token, attempts + 1)
--     -> sent                      (provider accepted; one row in notification_results)
--     -> failed-retrying           (transient error: run_after = now + backoff; worker freed at once)
--     -> dead                      (permanent error or attempts exhausted; dead-letter queue)
--     -> expired                   (past its deadline: never sent late)
--   sending whose lease expired (worker died) -> failed-retrying, claimable again.
--
-- Hot-table choices: status changes on every claim and finish, so those updates cannot be HOT while
-- status is in an index predicate; the claim index is therefore partial and small (only claimable
-- rows), finished rows leave it at once, and autovacuum runs on small absolute thresholds without
-- throttling, so the dead index entries a drained batch leaves behind do not slow the next claims.
CREATE TABLE notification_jobs (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    class             text        NOT NULL,
    priority          smallint    NOT NULL,
    tenant            text        NOT NULL,
    -- Weighted-fair position among the tenants of a class (see src/queue/enqueue.rs).
    fair_key          double precision NOT NULL,
    recipient         text        NOT NULL,
    payload           jsonb       NOT NULL,
    status            text        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'sending', 'sent', 'failed-retrying', 'dead', 'expired')),
    attempts          integer     NOT NULL DEFAULT 0,
    max_attempts      integer     NOT NULL,
    run_after         timestamptz NOT NULL DEFAULT now(),
    deadline          timestamptz,
    lease_token       uuid,
    lease_expires_at  timestamptz,
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    picked_at         timestamptz,
    finished_at       timestamptz,
    last_error        text,
    idempotency_key   text,
    CONSTRAINT notification_jobs_idempotency UNIQUE (tenant, idempotency_key)
) WITH (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 50000,
    autovacuum_vacuum_cost_delay = 0
);

-- Claim by priority (strategies priority, bulkhead, floor-borrow): matches ORDER BY priority, fair_key, id.
CREATE INDEX notification_jobs_claim_priority ON notification_jobs (priority, fair_key, id)
    WHERE status IN ('pending', 'failed-retrying');
-- Claim oldest first (strategy fifo); also serves the oldest-pending-age gauge per class.
CREATE INDEX notification_jobs_claim_fifo ON notification_jobs (id)
    WHERE status IN ('pending', 'failed-retrying');
-- In-flight jobs: lease sweep and per-tenant in-flight caps.
CREATE INDEX notification_jobs_inflight ON notification_jobs (lease_expires_at)
    WHERE status = 'sending';
-- Expiring overdue jobs that nobody claimed in time.
CREATE INDEX notification_jobs_deadline ON notification_jobs (deadline)
    WHERE deadline IS NOT NULL AND status IN ('pending', 'failed-retrying');
-- Dead-letter browsing and replay.
CREATE INDEX notification_jobs_dead ON notification_jobs (class, tenant, id) WHERE status = 'dead';

-- Exactly one result per job, written in the same transaction as the fenced finish: a second worker
-- that sent again after a lease expiry can never add a second row.
CREATE TABLE notification_results (
    job_id        bigint      PRIMARY KEY REFERENCES notification_jobs (id),
    provider      text        NOT NULL,
    provider_ref  text,
    attempt       integer     NOT NULL,
    sent_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Wake idle claimers when work arrives (payload: class), instead of making them poll fast.
CREATE FUNCTION notify_notification_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('cifpool_jobs', '');
    RETURN NULL;
END $$;
CREATE TRIGGER notification_jobs_notify AFTER INSERT ON notification_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION notify_notification_jobs();

-- Recent drain rate per class (intake backpressure) and retention of finished jobs.
CREATE INDEX notification_jobs_finished ON notification_jobs (class, finished_at) WHERE finished_at IS NOT NULL;

-- Weighted fair turns: each (priority, tenant) has a virtual clock; a job's fair_key is its tenant's
-- clock advanced by 1/weight, never behind the class's oldest waiting key. Claiming by
-- (priority, fair_key) then interleaves tenants however large one tenant's batch is.
CREATE TABLE notification_tenant_clock (
    priority  smallint         NOT NULL,
    tenant    text             NOT NULL,
    last_key  double precision NOT NULL,
    PRIMARY KEY (priority, tenant)
);
