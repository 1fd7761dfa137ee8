-- The queue's counts at scale. The statistics refresh counts every waiting job; it now also keeps the
-- per-state split the queue view shows, so `GET /admin/queue` and the console read one small table
-- instead of counting a million waiting jobs per request. `counting_s` is how long the last count
-- took: instances recount no sooner than forty times that, so counting costs at most about 2.5 % of
-- one core however large the queue grows.
ALTER TABLE queue_class_stats
    ADD COLUMN retrying bigint NOT NULL DEFAULT 0,
    ADD COLUMN scheduled bigint NOT NULL DEFAULT 0,
    ADD COLUMN counting_s double precision NOT NULL DEFAULT 0;

-- Dead letters in id order (the dead-letter list's order): without it, the list with no class or
-- tenant filter walked the primary key through every finished job to find the first dead one.
CREATE INDEX notification_jobs_dead_by_id ON notification_jobs (id) WHERE status = 'dead';
