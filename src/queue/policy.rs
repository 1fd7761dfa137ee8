//! Scheduling policy: which worker group may take which class of message, and in which order.
//!
//! This is the one piece of scheduling logic in cifpool. The real worker groups turn it into their
//! claim SQL ([`ClaimOrder::sql_order_by`], the classes of [`GroupPolicy::classes`]); the lab runs
//! those real groups; the simulator orders its in-memory queue with [`GroupPolicy::compare`] and
//! filters with [`GroupPolicy::takes`]. Both orders come from one list of columns
//! ([`ClaimOrder::columns`]), so a change here changes all three together.
//!
//! The four strategies are presets over the same two knobs (classes, order):
//!
//! | strategy | groups |
//! |---|---|
//! | `fifo` | one group, every class, `ORDER BY id` |
//! | `priority` (A) | one group, every class, `ORDER BY priority, …` |
//! | `bulkhead` (B) | a reserved group taking only the urgent classes; the rest never take them |
//! | `floor-borrow` (C) | a reserved urgent-only floor; the rest take every class by priority |

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

/// Order in which a group claims eligible jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ClaimOrder {
    /// Oldest first, whatever the class: the baseline that buries OTPs behind a promo batch.
    Fifo,
    /// Lowest priority number first; within a priority, tenants take weighted turns (`fair_key`),
    /// then oldest first.
    Priority,
}

/// A strategy preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// One FIFO group.
    Fifo,
    /// A: one group claiming by priority.
    Priority,
    /// B: reserved urgent-only group + a group that never takes urgent classes.
    Bulkhead,
    /// C: reserved urgent-only floor + a shared group taking everything by priority.
    FloorBorrow,
}

/// A column of the claim order; every column sorts ascending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderColumn {
    /// Class priority, 0 = most urgent.
    Priority,
    /// Weighted-fair position among tenants of the same priority.
    FairKey,
    /// Insertion order.
    Id,
}

impl OrderColumn {
    /// The column's name in `notification_jobs`.
    pub fn sql(self) -> &'static str {
        match self {
            OrderColumn::Priority => "priority",
            OrderColumn::FairKey => "fair_key",
            OrderColumn::Id => "id",
        }
    }

    /// Orders two jobs by this column as Postgres orders the column ascending. For the `float8`
    /// fair key that means `-0 = 0` and NaN after every number (and equal to itself), which is not
    /// `f64::total_cmp`.
    pub fn compare(self, a: &JobKey, b: &JobKey) -> Ordering {
        match self {
            OrderColumn::Priority => a.priority.cmp(&b.priority),
            OrderColumn::Id => a.id.cmp(&b.id),
            OrderColumn::FairKey => match (a.fair_key.is_nan(), b.fair_key.is_nan()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => a.fair_key.partial_cmp(&b.fair_key).expect("neither is NaN"),
            },
        }
    }
}

impl ClaimOrder {
    /// The columns this order sorts by, most significant first. Ending in `id` makes it total.
    pub fn columns(self) -> &'static [OrderColumn] {
        match self {
            ClaimOrder::Fifo => &[OrderColumn::Id],
            ClaimOrder::Priority => &[OrderColumn::Priority, OrderColumn::FairKey, OrderColumn::Id],
        }
    }

    /// The order as an SQL `ORDER BY` list (matching the claim index, `priority, fair_key, id`).
    pub fn sql_order_by(self) -> String {
        self.columns().iter().map(|c| c.sql()).collect::<Vec<_>>().join(", ")
    }

    /// The same order applied to two jobs in memory.
    pub fn compare(self, a: &JobKey, b: &JobKey) -> Ordering {
        self.columns().iter().map(|c| c.compare(a, b)).find(|o| o.is_ne()).unwrap_or(Ordering::Equal)
    }
}

impl Strategy {
    /// All four, from the baseline to the recommended one.
    pub const ALL: [Strategy; 4] = [Strategy::Fifo, Strategy::Priority, Strategy::Bulkhead, Strategy::FloorBorrow];

    /// Kebab-case name (`floor-borrow`).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Fifo => "fifo",
            Strategy::Priority => "priority",
            Strategy::Bulkhead => "bulkhead",
            Strategy::FloorBorrow => "floor-borrow",
        }
    }

    /// The worker groups of this strategy for `workers` workers of which `reserved` serve only
    /// `urgent` classes (ignored by `fifo` and `priority`), over the classes `all`.
    pub fn groups(self, workers: usize, reserved: usize, urgent: &[String], all: &[String]) -> Vec<GroupPolicy> {
        let reserved = reserved.min(workers);
        let non_urgent: Vec<String> = all.iter().filter(|c| !urgent.contains(c)).cloned().collect();
        let group = |name: &str, size: usize, classes: Vec<String>, order: ClaimOrder| GroupPolicy {
            name: name.to_string(),
            size,
            classes,
            order,
        };
        match self {
            Strategy::Fifo => vec![group("shared", workers, all.to_vec(), ClaimOrder::Fifo)],
            Strategy::Priority => vec![group("shared", workers, all.to_vec(), ClaimOrder::Priority)],
            Strategy::Bulkhead => vec![
                group("reserved", reserved, urgent.to_vec(), ClaimOrder::Priority),
                group("bulk", workers - reserved, non_urgent, ClaimOrder::Priority),
            ],
            Strategy::FloorBorrow => vec![
                group("floor", reserved, urgent.to_vec(), ClaimOrder::Priority),
                group("shared", workers - reserved, all.to_vec(), ClaimOrder::Priority),
            ],
        }
    }
}

/// One worker group's policy (`[[queue.groups]]`; a misspelt key is refused, not ignored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupPolicy {
    /// Group name (metrics label).
    pub name: String,
    /// Concurrent workers.
    pub size: usize,
    /// Classes this group may claim.
    pub classes: Vec<String>,
    /// Claim order.
    pub order: ClaimOrder,
}

/// What the policy needs to know about a waiting job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobKey {
    /// Insertion order.
    pub id: i64,
    /// 0 = most urgent.
    pub priority: i16,
    /// Weighted-fair position among tenants of the same class.
    pub fair_key: f64,
}

impl GroupPolicy {
    /// Whether this group may claim `class`.
    pub fn takes(&self, class: &str) -> bool {
        self.classes.iter().any(|c| c == class)
    }

    /// Which of two eligible jobs this group claims first (`Less`: `a`), by its [`ClaimOrder`].
    pub fn compare(&self, a: &JobKey, b: &JobKey) -> Ordering {
        self.order.compare(a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classes() -> (Vec<String>, Vec<String>) {
        (vec!["otp".into()], vec!["otp".into(), "transactional".into(), "promo".into()])
    }

    #[test]
    fn bulkhead_keeps_urgent_and_bulk_apart() {
        let (urgent, all) = classes();
        let g = Strategy::Bulkhead.groups(20, 6, &urgent, &all);
        assert_eq!((g[0].size, g[1].size), (6, 14));
        assert!(g[0].takes("otp") && !g[0].takes("promo"));
        assert!(!g[1].takes("otp") && g[1].takes("promo"));
    }

    #[test]
    fn floor_borrow_shared_group_takes_everything_by_priority() {
        let (urgent, all) = classes();
        let g = Strategy::FloorBorrow.groups(20, 6, &urgent, &all);
        assert!(g[1].takes("otp") && g[1].takes("promo"));
        let promo_old = JobKey { id: 1, priority: 2, fair_key: 0.0 };
        let otp_new = JobKey { id: 500_001, priority: 0, fair_key: 9.0 };
        assert!(g[1].compare(&otp_new, &promo_old).is_lt());
        let fifo = &Strategy::Fifo.groups(20, 6, &urgent, &all)[0];
        assert!(fifo.compare(&promo_old, &otp_new).is_lt(), "FIFO serves the older promo first");
        assert_eq!(ClaimOrder::Priority.sql_order_by(), "priority, fair_key, id");
        assert_eq!(ClaimOrder::Fifo.sql_order_by(), "id");
    }
}
