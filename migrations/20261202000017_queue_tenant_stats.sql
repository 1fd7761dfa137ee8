-- Intake backpressure judged per tenant: when a class is over its target wait, the tenants whose own
-- backlog causes it are refused and the others still admitted. The instance that counts the class
-- stores, beside the class's numbers, its tenants with waiting jobs (the 1,000 with the most) and how
-- many tenants have any.
ALTER TABLE queue_class_stats
    -- {"tenant": [waiting jobs, epoch seconds when its longest-waiting due job became due, or null]}
    ADD COLUMN tenants jsonb NOT NULL DEFAULT '{}',
    ADD COLUMN active_tenants bigint NOT NULL DEFAULT 0;
