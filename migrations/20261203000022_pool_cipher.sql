-- The keyed permutation a pool's codes come from, pinned like its format: 'ff1' (NIST SP 800-38G FF1)
-- or 'feistel' (the construction every pool used before FF1 was offered, so existing pools keep it).
ALTER TABLE cif_pools
    ADD COLUMN cipher text NOT NULL DEFAULT 'feistel' CHECK (cipher IN ('feistel', 'ff1'));
