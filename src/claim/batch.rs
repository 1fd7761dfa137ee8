//! Batch transitions: rows nobody holds (waiting, finished, dead) move to another state or are
//! deleted, in bounded batches that skip rows another transaction has locked, so maintenance never
//! waits on the hot path and the hot path never waits on maintenance.

use super::ClaimTable;

/// Which unheld rows a batch transition picks.
#[derive(Debug, Clone, Copy)]
pub struct Pick<'a> {
    /// SQL literal(s) of the states the rows are in, e.g. `'dead'`.
    pub from: &'a str,
    /// Extra predicate (`TRUE` for none), may use `$2…`.
    pub filter: &'a str,
    /// `ORDER BY` list deciding which rows a batch takes first; `None` takes any (cheapest).
    pub order_by: Option<&'a str>,
}

impl ClaimTable {
    fn pick_cte(&self, pick: &Pick<'_>) -> String {
        let ClaimTable { table, state, .. } = *self;
        let keys = self.key.join(", ");
        let order = pick.order_by.map(|o| format!("ORDER BY {o} ")).unwrap_or_default();
        format!(
            "picked AS ( \
                SELECT {keys} FROM {table} \
                WHERE {state} IN ({from}) AND ({filter}) \
                {order}LIMIT $1 \
                FOR UPDATE SKIP LOCKED \
             )",
            from = pick.from,
            filter = pick.filter,
        )
    }

    /// Updates up to `$1` picked rows. `set` may use `t.` (the row) and `picked.position`, the row's
    /// 0-based rank in this batch by key (to spread the rows out, e.g. over time). Binds: `$1` batch
    /// limit (`int8`), then the caller's from `$2`.
    pub(crate) fn update_picked_sql(&self, pick: &Pick<'_>, set: &str, returning: &str) -> String {
        let table = self.table;
        let keys = self.key.join(", ");
        // Window functions cannot share a SELECT with FOR UPDATE: number the locked rows apart.
        format!(
            "WITH {picked}, numbered AS ( \
                SELECT {keys}, row_number() OVER (ORDER BY {keys}) - 1 AS position FROM picked \
             ) \
             UPDATE {table} AS t SET {set} \
             FROM numbered AS picked \
             WHERE ({tkeys}) = ({pkeys}) \
             RETURNING {returning}",
            picked = self.pick_cte(pick),
            tkeys = self.key_list("t"),
            pkeys = self.key_list("picked"),
        )
    }

    /// Locks up to `$1` picked rows for the caller's transaction and returns `columns` of each (`t.` is
    /// the row), in the pick's order: for a transition the caller computes row by row before it writes
    /// it in the same transaction. Binds: `$1` batch limit (`int8`), then the caller's from `$2`.
    pub(crate) fn lock_picked_sql(&self, pick: &Pick<'_>, columns: &str) -> String {
        let table = self.table;
        let order = pick.order_by.map(|o| format!(" ORDER BY {o}")).unwrap_or_default();
        format!(
            "WITH {picked} SELECT {columns} FROM {table} AS t JOIN picked USING ({keys}){order}",
            picked = self.pick_cte(pick),
            keys = self.key.join(", "),
        )
    }

    /// Deletes up to `$1` picked rows. Binds: `$1` batch limit (`int8`), then the caller's from `$2`.
    pub(crate) fn delete_picked_sql(&self, pick: &Pick<'_>) -> String {
        let table = self.table;
        format!(
            "WITH {picked} DELETE FROM {table} AS t USING picked WHERE ({tkeys}) = ({pkeys})",
            picked = self.pick_cte(pick),
            tkeys = self.key_list("t"),
            pkeys = self.key_list("picked"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claim::tests::T;

    #[test]
    fn batch_transitions_skip_locked_rows_and_number_the_batch() {
        let pick = Pick { from: "'dead'", filter: "tenant = $2", order_by: Some("id") };
        let update = T.update_picked_sql(&pick, "status = 'pending', n = picked.position", "t.id");
        for clause in ["WHERE status IN ('dead') AND (tenant = $2)", "ORDER BY id LIMIT $1", "FOR UPDATE SKIP LOCKED"] {
            assert!(update.contains(clause), "{clause} missing from {update}");
        }
        assert!(update.contains("row_number() OVER (ORDER BY id) - 1 AS position"), "{update}");
        let delete = T.delete_picked_sql(&Pick { order_by: None, ..pick });
        assert!(delete.contains("LIMIT $1 FOR UPDATE SKIP LOCKED"), "{delete}");
        assert!(delete.contains("DELETE FROM jobs AS t USING picked WHERE (t.id) = (picked.id)"), "{delete}");
    }
}
