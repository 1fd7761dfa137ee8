-- The W3C trace context (`traceparent`) of the request that enqueued a job, when traces are exported:
-- the send span continues that trace, so one trace shows a message from the API call to the gateway.
-- Nullable and without a default: adding it rewrites nothing.
ALTER TABLE notification_jobs ADD COLUMN traceparent text;
