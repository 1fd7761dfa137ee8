-- The queue's numbers per class (waiting jobs, the longest wait, drain rate, dead letters), computed
-- by one instance at a time and read by all.
--
-- Counting the waiting jobs reads every one of them: ~60 ms at 200,000 waiting, more as the backlog
-- grows. Every instance used to count for itself every 2 s, so the database paid that once per
-- instance (sampled during a drain with two instances: the count was a tenth of the database's active
-- time). Now the instance whose refresh finds the stored numbers stale computes them under an
-- advisory lock and stores them here; the others read these rows. Times are stored as instants, not
-- ages, so a reader's ages are as of its own read.
CREATE TABLE queue_class_stats (
    class            text        PRIMARY KEY,
    -- Jobs waiting to be claimed (pending or retrying).
    pending          bigint      NOT NULL,
    -- When the longest-waiting due job became due (NULL: none is due).
    oldest_due_at    timestamptz,
    -- Jobs finished per second over the recent window.
    drain_per_s      double precision NOT NULL,
    -- Dead letters, and when the oldest of them died (NULL: none).
    dead             bigint      NOT NULL,
    oldest_dead_at   timestamptz,
    refreshed_at     timestamptz NOT NULL
);
