-- Identity and audit.
--
-- api_keys: every caller of /v1 and /admin presents `Authorization: Bearer cfp_…`. Only the SHA-256
-- digest of a key is stored; the key itself is shown once, at creation. A key is never deleted, only
-- revoked, so the name an audit row carries as its actor always resolves to one credential.
CREATE TABLE api_keys (
    name          text        PRIMARY KEY CHECK (length(name) BETWEEN 1 AND 64),
    digest        bytea       NOT NULL UNIQUE CHECK (length(digest) = 32),
    scopes        text[]      NOT NULL
                  CHECK (scopes <@ ARRAY['cif:reserve', 'cif:read', 'notify:send', 'notify:read', 'admin']
                         AND cardinality(scopes) > 0),
    -- NULL: a trusted internal service that may name any tenant; otherwise the only tenants it may
    -- enqueue for and read jobs of.
    tenants       text[]      CHECK (tenants IS NULL OR cardinality(tenants) > 0),
    created_at    timestamptz NOT NULL DEFAULT now(),
    created_by    text        NOT NULL,
    -- Written at most once a minute per key and pod (a hint for finding unused keys, not an audit).
    last_used_at  timestamptz,
    revoked_at    timestamptz
);

-- audit_events: append-only. Every CIF transition and every admin action, written by the statement
-- or transaction that makes the change, so a change cannot commit without its row. The service never
-- updates or deletes a row, and the triggers below refuse anyone who tries (archiving is done by an
-- operator as the table owner, with the triggers disabled; see docs/OPERATIONS.md).
CREATE TABLE audit_events (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- e.g. cif.reserved, cif.confirmed, pool.refilled, key.created.
    action        text        NOT NULL,
    -- The API key's name, `bootstrap` (security.admin_token) or `system` (schedules, sweeps).
    actor         text        NOT NULL,
    request_id    text,
    pool          text,
    cif           text,
    holder        text,
    customer_ref  text,
    -- Whatever else the action has to say (counters generated, a replay's filter and count, …).
    detail        jsonb
);
CREATE INDEX audit_events_cif ON audit_events (cif, id) WHERE cif IS NOT NULL;
CREATE INDEX audit_events_customer_ref ON audit_events (customer_ref, id) WHERE customer_ref IS NOT NULL;
CREATE INDEX audit_events_actor ON audit_events (actor, id);
-- Time-range queries and archiving by month; rows arrive in time order, so a BRIN index stays tiny.
CREATE INDEX audit_events_at ON audit_events USING brin (at);

CREATE FUNCTION audit_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_events is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END $$;
CREATE TRIGGER audit_events_no_update_or_delete BEFORE UPDATE OR DELETE ON audit_events
    FOR EACH ROW EXECUTE FUNCTION audit_events_append_only();
CREATE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events
    FOR EACH STATEMENT EXECUTE FUNCTION audit_events_append_only();
