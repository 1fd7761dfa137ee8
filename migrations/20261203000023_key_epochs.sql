-- Key rotation within a pool. Epoch 0 is the pool's configured key (cif_pools.key_id / key_check);
-- each rotation adds an epoch here whose key encodes the counters from first_counter on, up to the
-- next epoch's. The key material is never stored: each key is derived again from the master key and
-- key_id, and key_check tells whether an instance derives the same one.
ALTER TABLE cif_pools
    ADD COLUMN key_epoch smallint NOT NULL DEFAULT 0 CHECK (key_epoch >= 0);

CREATE TABLE cif_key_epochs (
    pool_id        smallint    NOT NULL REFERENCES cif_pools (id),
    epoch          smallint    NOT NULL CHECK (epoch >= 1),
    key_id         text        NOT NULL,
    key_check      text        NOT NULL,
    first_counter  bigint      NOT NULL CHECK (first_counter >= 0),
    started_at     timestamptz NOT NULL DEFAULT now(),
    started_by     text        NOT NULL,
    PRIMARY KEY (pool_id, epoch),
    UNIQUE (pool_id, key_id)
);
