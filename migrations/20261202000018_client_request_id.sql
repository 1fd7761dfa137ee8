-- The request id an audit row carries is the service's own (a fresh UUID per request), so no caller
-- can make its actions share an id with another's. What the caller sent as X-Request-Id is kept
-- beside it, for the caller's own correlation. Rows written before this hold whichever id the request
-- carried (the caller's if it sent an acceptable one), with no client id.
ALTER TABLE audit_events ADD COLUMN client_request_id text;
