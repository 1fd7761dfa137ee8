//! Where a worker group's claims start each priority's run while a full walk from the head is slow.
//!
//! A claim by priority reads the claim index (`priority, fair_key, id`) from the head of each priority.
//! Normally the head is the first claimable job: a claimed job's entry is marked dead by the next scan
//! that passes it, and vacuum removes it. While the database's cleanup horizon is held back (an open
//! snapshot, a stuck replication slot), neither can happen, so every job claimed since stays in the
//! index ahead of the first claimable one, and every claim walks them all, visiting a heap row for each:
//! under `bench horizon` the busy group's claims grew from 10 ms to half a second, and from two minutes
//! into the hold the drain fell behind the load.
//!
//! So each group keeps, per priority, the fair key of the first job its last claim took (its *floor*):
//! nothing below it was claimable then, and claims moving forward leave behind only what they took.
//! While a claim from the head lasts [`WALK_NOTICED`] or more, and the group has taken at least
//! [`WALK_JOBS`] jobs since its last claim from the head that did not (there is that much to walk:
//! a slow claim after a few jobs is slow for another reason, a cold connection or a busy machine),
//! the next claims start each run at its floor instead ([`crate::queue::store::claim_sql`] reads the
//! runs' starts from `$8`), and a claim from the head comes again once [`HEAD_EVERY`] times the last
//! one's duration has passed, so the full walks take about a tenth of the claiming time and what
//! floors pass over waits at most that long. What they pass over: a job that became claimable below a
//! floor since — a retry or an expired lease coming due, a tenant's job its cap held back, a job
//! another pod keyed below it. Every claim that lasts less goes back to starting from the head, so on
//! a healthy database the order is exactly the claim index's. Claims that start at floors are counted
//! in `cifpool_queue_claims_from_floors_total`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A claim from the head lasting at least this long makes the next claims start at their floors. A
/// healthy full claim (256 jobs, the wait for the other claim loop's turn included) lasted 7–15 ms on
/// the development machine, 30–41 ms on one 2.5 times slower.
pub const WALK_NOTICED: Duration = Duration::from_millis(50);

/// After a slow claim from the head, the next comes once this many times its duration has passed.
pub const HEAD_EVERY: u32 = 10;

/// Jobs a group must have taken since its last fast claim from the head before its claims start at
/// their floors: their entries are what a walk from the head reads (about 70 ns each when cached).
pub const WALK_JOBS: usize = 10_000;

/// A group's floors and when it last claimed from the head.
#[derive(Debug, Default)]
pub struct ClaimFloors {
    /// Per priority, the fair key of the first job the last claim that took any of it took.
    floors: BTreeMap<i16, f64>,
    /// When the last claim from the head started, and how long it lasted.
    last_head: Option<(Instant, Duration)>,
    /// Jobs taken since the last claim from the head that lasted less than [`WALK_NOTICED`].
    taken_since_fast: usize,
}

/// Where the next claim starts.
#[derive(Debug, Clone, PartialEq)]
pub enum Start {
    /// At the head of every priority.
    Head,
    /// Each priority at its key here (at its head where it has none).
    Floors(BTreeMap<i16, f64>),
}

impl ClaimFloors {
    /// Where a claim starting at `now` starts.
    pub fn start(&self, now: Instant) -> Start {
        match self.last_head {
            Some((at, lasted))
                if lasted >= WALK_NOTICED && self.taken_since_fast >= WALK_JOBS && now < at + lasted * HEAD_EVERY =>
            {
                Start::Floors(self.floors.clone())
            }
            _ => Start::Head,
        }
    }

    /// Records a claim that started at `at` from `start`, lasted `lasted`, took `taken` jobs and the
    /// first of each priority at the keys in `starts` (a claim from the head may lower a floor: it saw
    /// every claimable job).
    pub fn record(&mut self, start: &Start, at: Instant, lasted: Duration, taken: usize, starts: &BTreeMap<i16, f64>) {
        if *start == Start::Head {
            self.last_head = Some((at, lasted));
            if lasted < WALK_NOTICED {
                self.taken_since_fast = 0;
            }
        }
        self.taken_since_fast = self.taken_since_fast.saturating_add(taken);
        for (&priority, &key) in starts {
            // A key that is not a number would hide every job of its priority (NaN sorts last).
            if key.is_finite() {
                self.floors.insert(priority, key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: Duration = Duration::from_millis(12);
    const SLOW: Duration = Duration::from_millis(300);

    fn took(keys: &[(i16, f64)]) -> BTreeMap<i16, f64> {
        keys.iter().copied().collect()
    }

    /// Floors after enough jobs taken for a walk to matter, the last claim from the head at `t0`
    /// lasting `lasted` and taking its first jobs at `keys`.
    fn walked(t0: Instant, lasted: Duration, keys: &[(i16, f64)]) -> ClaimFloors {
        let mut floors = ClaimFloors::default();
        floors.record(&Start::Head, t0, FAST, WALK_JOBS, &BTreeMap::new());
        floors.record(&Start::Head, t0, lasted, 250, &took(keys));
        floors
    }

    #[test]
    fn claims_start_at_the_head_until_a_claim_from_it_is_slow_after_many_jobs() {
        let t0 = Instant::now();
        let mut floors = ClaimFloors::default();
        assert_eq!(floors.start(t0), Start::Head, "no claim yet");
        floors.record(&Start::Head, t0, SLOW, 250, &took(&[(2, 10.0)]));
        assert_eq!(floors.start(t0 + FAST), Start::Head, "slow after a few jobs: not the walk");
        floors.record(&Start::Head, t0, SLOW, WALK_JOBS, &took(&[(2, 20.0)]));
        assert_eq!(floors.start(t0 + FAST), Start::Floors(took(&[(2, 20.0)])), "slow after many");
        floors.record(&Start::Head, t0, FAST, 250, &took(&[(2, 30.0)]));
        assert_eq!(floors.start(t0 + FAST), Start::Head, "a fast walk costs nothing worth skipping");
        floors.record(&Start::Head, t0, SLOW, 250, &took(&[(2, 40.0)]));
        assert_eq!(floors.start(t0 + FAST), Start::Head, "and the jobs are counted again from it");
        let floors = walked(t0, WALK_NOTICED, &[(2, 50.0)]);
        assert_eq!(floors.start(t0 + FAST), Start::Floors(took(&[(2, 50.0)])), "the threshold counts");
    }

    #[test]
    fn after_a_slow_claim_from_the_head_the_next_comes_after_ten_times_its_duration() {
        let t0 = Instant::now();
        let mut floors = walked(t0, SLOW, &[(0, 1.0), (2, 100.0)]);
        let at_floors = floors.start(t0 + SLOW);
        assert_eq!(at_floors, Start::Floors(took(&[(0, 1.0), (2, 100.0)])));
        // Claims from the floors move them forward, priority by priority; one that took nothing of a
        // priority leaves its floor.
        floors.record(&at_floors, t0 + SLOW, FAST, 256, &took(&[(2, 356.0)]));
        let next = t0 + SLOW * HEAD_EVERY - Duration::from_millis(1);
        assert_eq!(floors.start(next), Start::Floors(took(&[(0, 1.0), (2, 356.0)])));
        assert_eq!(floors.start(t0 + SLOW * HEAD_EVERY), Start::Head, "the full walk comes back");
        // It sees every claimable job, so it may lower a floor (a retry that came due behind it).
        floors.record(&Start::Head, t0 + SLOW * HEAD_EVERY, SLOW, 1, &took(&[(2, 50.0)]));
        assert_eq!(floors.start(t0 + SLOW * HEAD_EVERY + FAST), Start::Floors(took(&[(0, 1.0), (2, 50.0)])));
    }

    #[test]
    fn a_key_that_is_not_a_number_is_not_a_floor() {
        let t0 = Instant::now();
        let floors = walked(t0, SLOW, &[(1, f64::NAN), (2, f64::INFINITY), (3, 7.0)]);
        assert_eq!(floors.start(t0), Start::Floors(took(&[(3, 7.0)])));
    }
}
