-- The in-flight count of a capped claim runs under the class's claim lock, and as a PL/pgSQL query
-- its plan is kept for the connection's life. A plan made while the table was small, or while its
-- statistics said so, kept a sequential scan as the table grew: every capped claim then read the whole
-- table, and a burst of promo jobs after a quiet spell saw its claims go from 15 ms to about 190 ms
-- over a minute, until autovacuum's ANALYZE had them replanned. The lease index holds exactly the rows
-- the count reads, so the count is never planned as a table scan.
ALTER FUNCTION notification_jobs_in_flight(text[], int4[], bigint) SET enable_seqscan = off;
