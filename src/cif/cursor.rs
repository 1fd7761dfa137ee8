//! Where this instance's reservations of a pool start looking for an available code.
//!
//! A reservation takes the lowest available counter, and leaves the index entry of the code it took
//! behind it. Normally that entry is gone within moments: the next scan that finds it dead to every
//! transaction marks it so, and later scans skip it. While a long transaction or a replication slot
//! holds the database's cleanup horizon back, no entry can be marked, and a scan from the lowest
//! counter reads past every code reserved since the horizon stopped: each reservation gets slower the
//! longer the hold lasts. So each instance starts its scan at the counter it last took. A code below
//! it that becomes available again (a release, a reclaim) is found when a scan from there comes back
//! empty, or at the next rewind, at most [`REWIND_EVERY`] later; until then it waits in the pool,
//! counted as available like any other.

use std::sync::atomic::{AtomicI64, Ordering};

/// The longest a code that became available again below an instance's cursor waits to be seen.
pub(crate) const REWIND_EVERY_MS: i64 = 30_000;

/// The counter from which one instance's reservations of one pool scan.
#[derive(Debug, Default)]
pub(crate) struct ReserveCursor {
    /// The lowest counter the next scan considers.
    from: AtomicI64,
    /// Unix millis of the last rewind to counter 0.
    rewound_at_ms: AtomicI64,
}

impl ReserveCursor {
    /// Where the next scan starts: counter 0 when [`REWIND_EVERY_MS`] has passed since the last rewind
    /// (this call then counts as one), else the counter last taken.
    pub(crate) fn floor(&self, now_ms: i64) -> i64 {
        let then = self.rewound_at_ms.load(Ordering::Relaxed);
        if now_ms - then >= REWIND_EVERY_MS
            && self.rewound_at_ms.compare_exchange(then, now_ms, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            self.from.store(0, Ordering::Relaxed);
            return 0;
        }
        self.from.load(Ordering::Relaxed)
    }

    /// A scan took `counter`: later scans start there.
    pub(crate) fn took(&self, counter: i64) {
        self.from.fetch_max(counter, Ordering::Relaxed);
    }

    /// A scan from `floor` found nothing: starts again from counter 0. Whether a scan from 0 can find
    /// more than the one that came back empty (false when that one already started at 0).
    pub(crate) fn rewind(&self, floor: i64) -> bool {
        if floor == 0 {
            return false;
        }
        self.from.store(0, Ordering::Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_start_at_the_last_counter_taken_and_rewind_on_schedule() {
        let cursor = ReserveCursor::default();
        let t0 = 1_000_000;
        assert_eq!(cursor.floor(t0), 0, "the first scan is a rewind");
        cursor.took(41);
        cursor.took(17);
        assert_eq!(cursor.floor(t0 + 1), 41, "the highest counter taken, whatever the order");
        assert_eq!(cursor.floor(t0 + REWIND_EVERY_MS - 1), 41);
        assert_eq!(cursor.floor(t0 + REWIND_EVERY_MS), 0, "rewound after REWIND_EVERY_MS");
        assert_eq!(cursor.floor(t0 + REWIND_EVERY_MS + 1), 0, "and stays at 0 until a code is taken");
        cursor.took(5);
        assert_eq!(cursor.floor(t0 + REWIND_EVERY_MS + 2), 5);
    }

    #[test]
    fn an_empty_scan_from_above_zero_rewinds_and_asks_for_another() {
        let cursor = ReserveCursor::default();
        let now = 0;
        cursor.floor(now);
        cursor.took(900);
        let floor = cursor.floor(now + 1);
        assert!(cursor.rewind(floor), "a scan from 900 missed what lies below");
        assert_eq!(cursor.floor(now + 2), 0);
        assert!(!cursor.rewind(0), "a scan from 0 that found nothing is the answer");
    }
}
