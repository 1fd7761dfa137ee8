//! The claiming contract shared by the CIF pools and the notification queue.
//!
//! A claimable table has a state column, a lease-expiry column and a fencing-token column. The
//! contract, in SQL this module writes so that no caller hand-rolls it:
//!
//! - **claim**: one statement picks up to `n` free rows `ORDER BY … LIMIT n FOR UPDATE SKIP LOCKED`
//!   (rows another transaction has locked are skipped, so claimers never wait on each other) and
//!   `UPDATE … RETURNING` marks them held, with a lease expiry and a fresh random token.
//! - **fenced finish**: every later write by the holder (confirm, release, extend, complete) carries
//!   `WHERE token = $1` and the held state. Zero rows affected means the lease was lost — swept and
//!   perhaps claimed by someone else — and the caller must not act as the owner ([`Fenced::LeaseLost`]).
//! - **sweep**: held rows whose lease has expired go back to a free state with their token wiped, in
//!   bounded batches that skip rows a live holder is touching right now.
//! - **batch transition** (`batch`): rows nobody holds (waiting, finished, dead) move to another state or are
//!   deleted, in bounded batches that skip rows another transaction has locked (a claim, a finish), so
//!   maintenance never waits on the hot path and the hot path never waits on maintenance.
//!
//! This module writes every `FOR UPDATE SKIP LOCKED` statement of the service; callers supply
//! predicates, orders and assignments.
//!
//! Indexing held rows: do not give the held state a partial index of its own (`WHERE state =
//! 'held'`). Every fenced statement tests that state, so such an index is a candidate for it, and when
//! the statistics say few rows are held (an ANALYZE taken at a quiet moment) the planner scans every
//! held row per fenced write instead of looking the row up by key. Index held rows by the lease
//! instead (`WHERE lease IS NOT NULL`): the sweep uses it, a fence never can. (Measured on the queue:
//! migration 5.)
//!
//! Tokens are random UUIDs (`gen_random_uuid()`), not a sequence: the CIF API hands them to clients as
//! reservation capabilities, and a guessable one would let a pod release another pod's hold. A claim
//! whose tokens never leave the service (the queue's) may draw one for all its rows
//! ([`TokenPer::Claim`]); a fenced write names the row's key with the token either way.
//!
//! Parameter numbering: a claim with its limit written in, [`ClaimTable::claim_at_most_sql`], binds
//! `$1` = lease seconds; one that picks more than it wants, [`ClaimTable::claim_picking_at_most_sql`],
//! `$1` = rows wanted and `$2` = lease seconds. (No claim binds its limit: see the first.) A fenced
//! statement binds `$1` = token; a sweep binds `$1` = batch limit. Caller predicates and assignments
//! use the numbers after those.

/// The limits a caller that claims a varying number of rows keeps one statement for: the powers of
/// two below its largest claim, then that claim itself. A claim of `n` runs the smallest at least `n`,
/// so it locks fewer than twice the rows it can take, and each statement keeps its plan for the
/// connection's life (why a limit is written in rather than bound: [`ClaimTable::claim_at_most_sql`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickSizes(Vec<usize>);

impl PickSizes {
    /// The sizes for claims of at most `most` rows (`most` 0 counts as 1).
    pub fn up_to(most: usize) -> PickSizes {
        let most = most.max(1);
        let mut sizes: Vec<usize> =
            std::iter::successors(Some(1_usize), |s| s.checked_mul(2)).take_while(|&s| s < most).collect();
        sizes.push(most);
        PickSizes(sizes)
    }

    /// Every size, smallest first.
    pub fn sizes(&self) -> &[usize] {
        &self.0
    }

    /// Where in [`PickSizes::sizes`] the claim of `n` rows is: the smallest size at least `n` (the
    /// largest when `n` is above them all, which a caller bounded by the `most` it was built with never
    /// asks).
    pub fn index_for(&self, n: usize) -> usize {
        self.0.iter().position(|&size| size >= n).unwrap_or(self.0.len() - 1)
    }
}

mod batch;

pub use batch::Pick;

/// Describes a claimable table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClaimTable {
    /// Table name.
    pub table: &'static str,
    /// Primary key columns (joined on when updating the picked rows).
    pub key: &'static [&'static str],
    /// State column.
    pub state: &'static str,
    /// Fencing-token column (`uuid`).
    pub token: &'static str,
    /// Lease-expiry column (`timestamptz`).
    pub lease: &'static str,
}

/// The parts of a claim statement a caller chooses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClaimSpec<'a> {
    /// SQL literal(s) of the claimable state(s), e.g. `'available'` or `'pending', 'retrying'`.
    pub free: &'a str,
    /// SQL literal of the held state, e.g. `'reserved'`.
    pub held: &'a str,
    /// Extra predicate (`TRUE` for none), may use `$3…`.
    pub filter: &'a str,
    /// `ORDER BY` list, e.g. `counter` or `priority, id`.
    pub order_by: &'a str,
    /// Where the pick's scan starts and ends, in claim order (empty for one scan over `filter`): each
    /// a predicate (may use `$3…`) that, with `filter`, selects one contiguous run of the claim
    /// order, the runs in order, e.g. one priority each from the key its last claim began at. The
    /// pick reads the first until it has `LIMIT` rows, then the next. For a scan that should not
    /// start at the head of an index: under a held cleanup horizon every row claimed since stays in
    /// the claim index, ahead of the first claimable one.
    pub ranges: &'a [String],
    /// Extra assignments, e.g. `holder = $4` (empty for none). Columns refer to the updated row.
    pub set: &'a str,
    /// `RETURNING` list (columns of the updated row `t`).
    pub returning: &'a str,
    /// Extra columns of the picked rows for `gate` to read, e.g. `, tenant, class` (empty for none).
    pub carry: &'a str,
    /// CTEs run on the picked rows before any is claimed (empty for none), e.g. a per-tenant cap.
    /// They read `picked` and must define `admitted` with the key columns: only those rows are
    /// claimed; the others stay locked until the statement ends and are then left as they were.
    pub gate: &'a str,
    /// An SQL expression evaluated once per claim, which may read the gate's CTEs (empty for none):
    /// when set, every claimed row comes with it as the column `report`, and a claim that took no
    /// row returns one row whose claim columns are all NULL, so the caller learns it either way
    /// (e.g. why the gate stopped).
    pub report: &'a str,
    /// Whether each claimed row gets a fencing token of its own, or the rows of one claim share one
    /// drawn once per statement. A fenced write names the row's key with its token, so a shared
    /// token fences each row as well; a per-row token is for holds whose token is handed to a caller
    /// as the proof of its hold.
    pub token: TokenPer,
    /// Whether the claim's commit waits for its WAL to reach the disk.
    pub commit: Commit,
}

/// How many fencing tokens a claim draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenPer {
    /// One for every claimed row.
    Row,
    /// One for the whole claim, shared by its rows (a random draw costs the server a few µs a row).
    Claim,
}

/// When a claim's commit returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// After its WAL is flushed: a claim the caller has seen survives a crash.
    Flushed,
    /// Without waiting for the flush (`synchronous_commit = off` for this transaction only): a crash
    /// can lose the last claims, whose rows are then claimable again, as after an expired lease. For
    /// claims whose every outcome is written later by a flushed commit, which flushes the claim's WAL
    /// before its own; what the claim saves is the wait for the disk while it holds its rows (and any
    /// lock that orders claims).
    Unflushed,
}

/// What a fenced write found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The token was current and the write happened.
    Done,
    /// The token no longer owns the row: the lease was swept (and maybe re-claimed).
    LeaseLost,
}

impl Fenced {
    /// Interprets `rows_affected()` of a fenced statement.
    pub(crate) fn from_rows(rows: u64) -> Fenced {
        if rows == 0 { Fenced::LeaseLost } else { Fenced::Done }
    }
}

impl ClaimTable {
    fn key_list(&self, alias: &str) -> String {
        self.key.iter().map(|k| format!("{alias}.{k}")).collect::<Vec<_>>().join(", ")
    }

    /// The claim of at most `most` rows, with the limit written into the statement. Binds: `$1` lease
    /// seconds (`float8`), then the caller's from `$2`.
    ///
    /// Why a statement of its own: Postgres reuses a prepared statement's plan only when the generic
    /// plan looks no dearer than a fresh one, and a generic plan must guess a limit bound as a
    /// parameter (a tenth of the rows), which makes it join the picked rows by hashing the whole table.
    /// So a claim whose limit is a parameter is planned anew at every execution, which for a claim of
    /// a few rows costs about as much as running it. With the limit written in, the generic plan is
    /// the fresh one and the server plans it once per connection.
    pub fn claim_at_most_sql(&self, spec: &ClaimSpec<'_>, most: usize) -> String {
        self.claim_with(spec, &most.to_string(), "$1")
    }

    /// The claim that picks (and locks) at most `most` rows, with that limit written in, and takes as
    /// many as the caller's gate admits: for callers that want a varying number of rows and keep one
    /// statement per size, so that each is planned once per connection (see
    /// [`ClaimTable::claim_at_most_sql`]). Binds: `$1` the rows wanted (`int8`), which `spec.gate`
    /// must read and admit no more than (the statement does not cap at it otherwise), `$2` lease
    /// seconds (`float8`), then the caller's. Picked rows the gate leaves out stay locked until the
    /// statement ends and are then left as they were.
    pub fn claim_picking_at_most_sql(&self, spec: &ClaimSpec<'_>, most: usize) -> String {
        assert!(!spec.gate.trim().is_empty(), "a claim that picks more than it wants needs a gate that admits $1");
        self.claim_with(spec, &most.to_string(), "$2")
    }

    fn claim_with(&self, spec: &ClaimSpec<'_>, limit: &str, lease_seconds: &str) -> String {
        let ClaimTable { table, state, token, lease, .. } = *self;
        let keys = self.key.join(", ");
        let extra_set = if spec.set.trim().is_empty() { String::new() } else { format!(", {}", spec.set) };
        let (gate, source) = if spec.gate.trim().is_empty() {
            (String::new(), "picked")
        } else {
            (format!(", {}", spec.gate), "admitted")
        };
        let new_token = match spec.token {
            TokenPer::Row => "gen_random_uuid()",
            // An uncorrelated sub-select is evaluated once per statement.
            TokenPer::Claim => "(SELECT gen_random_uuid())",
        };
        // A transaction-local setting, read by the commit that ends this statement; evaluated once,
        // before the first row is written (a claim that writes nothing has no commit to flush).
        let commit = match spec.commit {
            Commit::Flushed => "",
            Commit::Unflushed => " AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'",
        };
        let update = format!(
            "UPDATE {table} AS t \
             SET {state} = {held}, {token} = {new_token}, \
                 {lease} = now() + {lease_seconds}::float8 * interval '1 second'{extra_set} \
             FROM {source} \
             WHERE ({tkeys}) = ({skeys}){commit} \
             RETURNING {returning}",
            held = spec.held,
            returning = spec.returning,
            tkeys = self.key_list("t"),
            skeys = self.key_list(source),
        );
        // With a report, the update becomes a CTE and the outer join keeps one row when it took none.
        let body = if spec.report.trim().is_empty() {
            update
        } else {
            format!(
                ", claimed AS ({update}) \
                 SELECT claimed.*, ({report}) AS report FROM (VALUES (1)) AS one LEFT JOIN claimed ON true",
                report = spec.report
            )
        };
        let pick = |range: &str| {
            format!(
                "SELECT {keys}{carry} FROM {table} \
                 WHERE {state} IN ({free}) AND ({filter}){range} \
                 ORDER BY {order_by} \
                 LIMIT {limit} \
                 FOR UPDATE SKIP LOCKED",
                carry = spec.carry,
                free = spec.free,
                filter = spec.filter,
                order_by = spec.order_by,
            )
        };
        // One scan per range, read one after another (an `Append` runs its branches in order, and the
        // outer `LIMIT` stops it, so a later range is not even started once an earlier one filled it).
        let picked = if spec.ranges.is_empty() {
            pick("")
        } else {
            let runs: Vec<String> = spec
                .ranges
                .iter()
                .enumerate()
                .map(|(i, range)| format!("SELECT * FROM ({}) AS run{i}", pick(&format!(" AND ({range})"))))
                .collect();
            format!("{} LIMIT {limit}", runs.join(" UNION ALL "))
        };
        format!("WITH picked AS ( {picked} ){gate} {body}")
    }

    /// A fenced update of one held row. Binds: `$1` token (`uuid`), then the caller's `key_where` and
    /// `set` parameters. `set` should also clear the token/lease when the write ends the hold.
    pub(crate) fn fenced_update_sql(&self, held: &str, key_where: &str, set: &str, returning: Option<&str>) -> String {
        let ClaimTable { table, state, token, .. } = *self;
        let returning = returning.map(|r| format!(" RETURNING {r}")).unwrap_or_default();
        format!("UPDATE {table} SET {set} WHERE {key_where} AND {state} = {held} AND {token} = $1{returning}")
    }

    /// The fenced update of many held rows in one statement (batched finishes). `rows` is a `FROM`
    /// item aliased `f` that has the key columns and a `token` column; each row is updated only if it
    /// is held with exactly that token, so the rows returned are the ones whose fence held. `set` and
    /// `returning` may use `t.` (the row) and `f.` (its input).
    pub(crate) fn fenced_update_many_sql(&self, held: &str, rows: &str, set: &str, returning: &str) -> String {
        let ClaimTable { table, state, token, .. } = *self;
        format!(
            "UPDATE {table} AS t SET {set} FROM {rows} \
             WHERE ({tkeys}) = ({fkeys}) AND t.{state} = {held} AND t.{token} = f.token \
             RETURNING {returning}",
            tkeys = self.key_list("t"),
            fkeys = self.key_list("f"),
        )
    }

    /// A fenced delete of one held row (a finish that moves the row elsewhere, e.g. a confirmed code).
    /// Binds: `$1` token, then the caller's.
    pub(crate) fn fenced_delete_sql(&self, held: &str, key_where: &str, returning: &str) -> String {
        let ClaimTable { table, state, token, .. } = *self;
        format!("DELETE FROM {table} WHERE {key_where} AND {state} = {held} AND {token} = $1 RETURNING {returning}")
    }

    /// Extends a current lease. Binds: `$1` token, `$2` lease seconds from now (`float8`), then the
    /// caller's `key_where` parameters from `$3`. Returns `returning` (the new expiry among them).
    pub(crate) fn extend_sql(&self, held: &str, key_where: &str, returning: &str) -> String {
        let lease = self.lease;
        self.fenced_update_sql(
            held,
            key_where,
            &format!("{lease} = now() + $2::float8 * interval '1 second'"),
            Some(returning),
        )
    }

    /// Returns up to `$1` held rows whose lease has expired to `free_state`, wiping the token.
    /// `set` adds assignments (e.g. a retry time); `filter` narrows the sweep (may use `$2…`).
    /// `carry` lists columns of the row as it was before the sweep (e.g. `holder`, which `set` may
    /// wipe), which `returning` may then read as `expired.<column>`; empty for none.
    pub(crate) fn sweep_sql(
        &self,
        held: &str,
        free_state: &str,
        filter: &str,
        set: &str,
        carry: &str,
        returning: &str,
    ) -> String {
        let ClaimTable { table, state, token, lease, .. } = *self;
        let keys = self.key.join(", ");
        let carried = if carry.trim().is_empty() { String::new() } else { format!(", {carry}") };
        let extra_set = if set.trim().is_empty() { String::new() } else { format!(", {set}") };
        format!(
            "WITH expired AS ( \
                SELECT {keys}{carried} FROM {table} \
                WHERE {state} = {held} AND {lease} < now() AND ({filter}) \
                ORDER BY {lease} \
                LIMIT $1 \
                FOR UPDATE SKIP LOCKED \
             ) \
             UPDATE {table} AS t \
             SET {state} = {free_state}, {token} = NULL, {lease} = NULL{extra_set} \
             FROM expired \
             WHERE ({tkeys}) = ({ekeys}) \
             RETURNING {returning}",
            tkeys = self.key_list("t"),
            ekeys = self.key_list("expired"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table the statement tests of this module and its submodules build on.
    pub(super) const T: ClaimTable =
        ClaimTable { table: "jobs", key: &["id"], state: "status", token: "token", lease: "lease_expires_at" };

    #[test]
    fn pick_sizes_double_up_to_the_largest_and_a_claim_locks_under_twice_what_it_wants() {
        assert_eq!(PickSizes::up_to(256).sizes(), [1, 2, 4, 8, 16, 32, 64, 128, 256]);
        assert_eq!(PickSizes::up_to(100).sizes(), [1, 2, 4, 8, 16, 32, 64, 100]);
        assert_eq!(PickSizes::up_to(1).sizes(), [1]);
        assert_eq!(PickSizes::up_to(0).sizes(), [1]);
        let sizes = PickSizes::up_to(100);
        for n in 1..=100 {
            let size = sizes.sizes()[sizes.index_for(n)];
            assert!(size >= n && size < 2 * n || size == 1, "{n} -> {size}");
        }
        assert_eq!(sizes.sizes()[sizes.index_for(65)], 100);
        assert_eq!(sizes.index_for(500), sizes.sizes().len() - 1);
        assert_eq!(sizes.index_for(0), 0);
    }

    #[test]
    fn claim_statement_has_the_contract_clauses() {
        let sql = T.claim_with(
            &ClaimSpec {
                free: "'pending'",
                held: "'sending'",
                filter: "priority BETWEEN $3 AND $4",
                order_by: "priority, id",
                ranges: &[],
                set: "attempts = t.attempts + 1",
                returning: "t.id, t.token",
                carry: "",
                gate: "",
                report: "",
                token: TokenPer::Row,
                commit: Commit::Flushed,
            },
            "$1",
            "$2",
        );
        for clause in
            ["FOR UPDATE SKIP LOCKED", "LIMIT $1", "gen_random_uuid()", "ORDER BY priority, id", "(t.id) = (picked.id)"]
        {
            assert!(sql.contains(clause), "{clause} missing from {sql}");
        }
        assert!(!sql.contains("synchronous_commit"), "{sql}");
    }

    #[test]
    fn a_claim_may_share_one_token_among_its_rows_and_commit_without_waiting_for_the_flush() {
        let spec = ClaimSpec { token: TokenPer::Claim, commit: Commit::Unflushed, ..by_id("TRUE", "") };
        let sql = T.claim_at_most_sql(&spec, 8);
        assert!(sql.contains("token = (SELECT gen_random_uuid())"), "{sql}");
        assert!(
            sql.contains(
                "WHERE (t.id) = (picked.id) AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'"
            ),
            "{sql}"
        );
        let per_row = T.claim_at_most_sql(&by_id("TRUE", ""), 8);
        assert!(per_row.contains("token = gen_random_uuid()") && !per_row.contains("set_config"), "{per_row}");
    }

    /// A claim of pending jobs in id order returning their ids, with `filter` and `gate`.
    fn by_id<'a>(filter: &'a str, gate: &'a str) -> ClaimSpec<'a> {
        ClaimSpec {
            free: "'pending'",
            held: "'sending'",
            filter,
            order_by: "id",
            ranges: &[],
            set: "",
            returning: "t.id",
            carry: "",
            gate,
            report: "",
            token: TokenPer::Row,
            commit: Commit::Flushed,
        }
    }

    #[test]
    fn a_claim_of_at_most_n_writes_its_limit_and_binds_the_lease_first() {
        let spec = by_id("priority = $2", "");
        let eight = T.claim_at_most_sql(&spec, 8);
        assert!(eight.contains("ORDER BY id LIMIT 8 FOR UPDATE SKIP LOCKED"), "{eight}");
        assert!(eight.contains("lease_expires_at = now() + $1::float8 * interval '1 second'"), "{eight}");
        assert!(!eight.contains("$1 ") && !eight.contains("$2::float8"), "{eight}");
        // Apart from the limit and the lease's parameter, the same statement as the claim with a bound limit.
        let bound = T.claim_with(&spec, "$1", "$2").replace("LIMIT $1", "LIMIT 8").replace("$2::float8", "$1::float8");
        assert_eq!(eight, bound);
    }

    #[test]
    fn a_claim_picking_at_most_n_writes_its_limit_and_keeps_the_wanted_count_and_lease_bound() {
        let spec = by_id("priority = $3", "admitted AS (SELECT id FROM picked ORDER BY id LIMIT $1)");
        let sixteen = T.claim_picking_at_most_sql(&spec, 16);
        assert!(sixteen.contains("ORDER BY id LIMIT 16 FOR UPDATE SKIP LOCKED"), "{sixteen}");
        assert!(sixteen.contains("FROM admitted WHERE (t.id) = (admitted.id)"), "{sixteen}");
        // Apart from the limit, the same statement as the claim with a bound limit.
        assert_eq!(sixteen, T.claim_with(&spec, "$1", "$2").replace("LIMIT $1 FOR UPDATE", "LIMIT 16 FOR UPDATE"));
    }

    #[test]
    fn a_claim_over_ranges_reads_them_in_order_each_with_the_filter_and_limit() {
        let ranges = ["priority = 0 AND id >= $3".to_string(), "priority = 1".to_string()];
        let sql = T.claim_at_most_sql(&ClaimSpec { ranges: &ranges, ..by_id("tenant = $4", "") }, 8);
        let run = |i: usize, range: &str| {
            format!(
                "SELECT * FROM (SELECT id FROM jobs WHERE status IN ('pending') AND (tenant = $4) AND ({range}) \
                 ORDER BY id LIMIT 8 FOR UPDATE SKIP LOCKED) AS run{i}"
            )
        };
        let picked = format!("WITH picked AS ( {} UNION ALL {} LIMIT 8 )", run(0, &ranges[0]), run(1, &ranges[1]));
        assert!(sql.starts_with(&picked), "{sql}");
    }

    #[test]
    #[should_panic(expected = "needs a gate")]
    fn a_claim_picking_more_than_it_wants_refuses_to_be_built_without_a_gate() {
        T.claim_picking_at_most_sql(&by_id("TRUE", ""), 4);
    }

    #[test]
    fn fenced_statements_check_token_and_state() {
        let sql = T.fenced_update_sql("'sending'", "id = $2", "status = 'sent'", None);
        assert!(sql.ends_with("WHERE id = $2 AND status = 'sending' AND token = $1"), "{sql}");
        let many = T.fenced_update_many_sql("'sending'", "unnest($1, $2) AS f(id, token)", "status = 'sent'", "t.id");
        assert!(many.contains("WHERE (t.id) = (f.id) AND t.status = 'sending' AND t.token = f.token"), "{many}");
        assert_eq!(Fenced::from_rows(0), Fenced::LeaseLost);
        assert_eq!(Fenced::from_rows(1), Fenced::Done);
    }
}
