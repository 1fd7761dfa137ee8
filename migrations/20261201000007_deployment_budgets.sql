-- Budgets that hold for the whole deployment rather than per pod (see src/queue/budget.rs).
--
-- provider_budgets: one row per provider. limit_now is the deployment's adaptive concurrency limit
-- (between min_concurrency and max_concurrency; cut by 30 % on overload at most once a second, grown
-- back additively but never faster than the whole range in 10 s); paused_until holds a provider's
-- Retry-After; tokens is the token bucket of rate_per_second (capacity: one second's worth).
CREATE TABLE provider_budgets (
    provider         text        PRIMARY KEY,
    max_concurrency  integer     NOT NULL CHECK (max_concurrency >= 1),
    min_concurrency  integer     NOT NULL CHECK (min_concurrency >= 1),
    rate_per_second  double precision CHECK (rate_per_second > 0),
    limit_now        double precision NOT NULL,
    last_cut_at      timestamptz,
    grown_at         timestamptz NOT NULL DEFAULT now(),
    paused_until     timestamptz,
    tokens           double precision,
    tokens_at        timestamptz NOT NULL DEFAULT now()
);

-- provider_shares: the part of a provider's budget one pod (member: a random id per process start) may
-- use, under a lease renewed at every sync. A dead pod's row expires with its lease and its share goes
-- to the others. The sum of live shares never exceeds the budget: a pod raises its share only while
-- holding the provider's budget row lock, against the shares recorded at that moment.
CREATE TABLE provider_shares (
    provider          text        NOT NULL,
    member            uuid        NOT NULL,
    share             integer     NOT NULL CHECK (share >= 0),
    want              integer     NOT NULL CHECK (want >= 0),
    lease_expires_at  timestamptz NOT NULL,
    PRIMARY KEY (provider, member)
);
