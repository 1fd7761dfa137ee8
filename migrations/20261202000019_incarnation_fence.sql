-- The database incarnation fence: which database the service issues from, and what it set aside when
-- that changed.
--
-- A restored dump, a point-in-time recovery, a promoted asynchronous standby or a copied database holds
-- the pools as they were at some earlier moment: their available codes and counters go back in time,
-- and codes handed out since then would be handed out again. The service records the identity of the
-- database it issues from (cluster, timeline, database and the pool tables) and compares it with the
-- live one on every new connection and periodically; when they differ, no code that might already
-- have been handed out is issued again (see cif/fence.rs).

-- What identifies this incarnation of the database: the cluster's system identifier (initdb; NULL when
-- the role may not read it), the WAL timeline (a promotion or a recovery to a point starts a new one),
-- this database's oid (a restore into a new database, a copy) and the pool tables' oids (a restore
-- with --clean into the same database re-creates them).
CREATE FUNCTION cif_database_identity() RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
DECLARE
    cluster text;
BEGIN
    BEGIN
        SELECT system_identifier::text INTO cluster FROM pg_control_system();
    EXCEPTION WHEN insufficient_privilege THEN
        cluster := NULL;
    END;
    RETURN jsonb_build_object(
        'cluster', cluster,
        'timeline', ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int,
        'database', (SELECT oid::int8 FROM pg_database WHERE datname = current_database()),
        'tables', jsonb_build_object(
            'cif_pools', to_regclass('cif_pools')::oid::int8,
            'cif_codes', to_regclass('cif_codes')::oid::int8,
            'cif_issued', to_regclass('cif_issued')::oid::int8));
END
$$;

-- The identity the service last issued from (one row; none before the first start).
CREATE TABLE cif_incarnation (
    only_row     boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    identity     jsonb       NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    -- The identity found when it changed and the service is configured to wait for an operator
    -- (database.on_incarnation_change = "halt"): issuance is refused while this is set.
    halted_for   jsonb,
    halted_at    timestamptz
);

-- Each change of identity that was acted on.
CREATE TABLE cif_fences (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    previous    jsonb       NOT NULL,
    current     jsonb       NOT NULL,
    -- 'fenced' (codes set aside, counters moved on) or 'accepted' (an operator said nothing was lost).
    outcome     text        NOT NULL CHECK (outcome IN ('fenced', 'accepted')),
    actor       text        NOT NULL,
    -- Per pool: codes set aside and the counters skipped.
    detail      jsonb       NOT NULL DEFAULT '{}'
);

-- Codes that were available or held when their pool was fenced: some may have been handed out in the
-- history the database lost, so none is ever issued. Kept for the audit.
CREATE TABLE cif_fenced_codes (
    fence_id     bigint      NOT NULL REFERENCES cif_fences (id),
    pool_id      smallint    NOT NULL,
    counter      bigint      NOT NULL,
    code         text        NOT NULL UNIQUE,
    state        text        NOT NULL,
    holder       text,
    PRIMARY KEY (pool_id, counter)
);
