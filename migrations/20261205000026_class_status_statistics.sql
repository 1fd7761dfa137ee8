-- How many jobs of a class wait, as the planner sees it: the most common (class, status) pairs.
--
-- The claims and the stats round's check of the planner's estimate (src/queue/analyze.rs) filter on
-- both columns. Taken one at a time, the planner multiplies their shares, which is far off when one
-- class's jobs wait while another's have finished: 20,000 waiting promo jobs beside 200,000 sent
-- transactional ones were estimated at 1,872; with this, at 20,211. The check would otherwise find
-- the planner misled after every ANALYZE and analyze the table again every 30 s.
CREATE STATISTICS notification_jobs_class_status (mcv) ON class, status FROM notification_jobs;
