//! How many jobs a group's next claim may take: `queue.claim_batch`, or more while claims are slow.
//!
//! A claim has a part that does not depend on how many jobs it takes: its index scan walks from the
//! front of the claim order to the first claimable job, and the capped claim's in-flight count reads
//! every job in flight. While the database cannot remove old row versions (a long transaction or a
//! replication slot holding back its cleanup horizon), that walk passes over the index entries of
//! every job claimed since, and grows with them: under a held snapshot claims of 256 jobs went from
//! 15–21 ms to 207–667 ms, and a group, whose claims run one at a time under their class's claim
//! lock, drained 0.4× what it did before the hold. (Both walks are bounded since: claims start at
//! their floors while a walk from the head is slow, [`crate::queue::floor`], and the in-flight count
//! reads the jobs claimed within the last two lease lengths. What is left still grows with the
//! hold.) A claim that took all it asked for, at least a batch, and still lasted over [`SLOW_CLAIM`]
//! is paying mostly for that walk; the next one may take
//! up to `queue.catch_up_batches` batches (as many as the group has free workers and its providers
//! have room), so one walk serves that many more jobs. The first claim that takes less than it asked for (the
//! backlog is gone, or a provider's room is what limits it) or is fast again goes back to the batch.
//!
//! Why the threshold: a full claim of 256 jobs lasted 30–41 ms on the development machine during a
//! drain, counting the wait for the other claim loop's turn; one past 100 ms is not the work its jobs
//! make. Taking more per claim costs a healthy queue nothing measurable either: drains with claims of
//! 512 or 1,024 jobs were no slower than with 256.

use std::time::Duration;

/// A full claim lasting at least this long makes the next one a catch-up claim.
pub const SLOW_CLAIM: Duration = Duration::from_millis(100);

/// How many jobs a group's claims take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimLimits {
    /// Jobs a claim takes normally (`queue.claim_batch`, at least 1).
    pub batch: usize,
    /// Batches a catch-up claim may take (`queue.catch_up_batches`, at least 1; 1 never catches up).
    pub catch_up: usize,
}

impl ClaimLimits {
    /// The limits of `claim_batch` and `catch_up_batches` (each at least 1).
    pub fn new(claim_batch: usize, catch_up_batches: usize) -> ClaimLimits {
        ClaimLimits { batch: claim_batch.max(1), catch_up: catch_up_batches.max(1) }
    }

    /// The most jobs the next claim may take, after one that asked for `asked` jobs, took `took` and
    /// lasted `lasted`.
    pub fn next(&self, asked: usize, took: usize, lasted: Duration) -> usize {
        let full = asked >= self.batch && took >= asked;
        if full && lasted >= SLOW_CLAIM { self.largest() } else { self.batch }
    }

    /// The most jobs any claim takes: what the group's pick sizes cover.
    pub fn largest(&self) -> usize {
        self.batch.saturating_mul(self.catch_up)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: Duration = Duration::from_millis(35);
    const SLOW: Duration = Duration::from_millis(300);

    #[test]
    fn a_slow_full_claim_lets_the_next_take_more_and_any_other_claim_goes_back_to_the_batch() {
        let limits = ClaimLimits::new(256, 4);
        assert_eq!(limits.next(256, 256, FAST), 256, "a healthy full claim");
        assert_eq!(limits.next(256, 256, SLOW), 1024, "slow and full: catch up");
        assert_eq!(limits.next(1024, 1024, SLOW), 1024, "still slow and full: still catching up");
        assert_eq!(limits.next(700, 700, SLOW), 1024, "all the free workers it had, slow");
        assert_eq!(limits.next(1024, 300, SLOW), 256, "took less than it asked: the backlog is gone");
        assert_eq!(limits.next(1024, 1024, FAST), 256, "fast again");
        assert_eq!(limits.next(100, 100, SLOW), 256, "a claim for a few free workers says nothing");
        assert_eq!(limits.next(256, 256, SLOW_CLAIM), 1024, "the threshold itself counts as slow");
        assert_eq!(limits.largest(), 1024);
    }

    #[test]
    fn one_catch_up_batch_never_catches_up() {
        let limits = ClaimLimits::new(1, 1);
        assert_eq!(limits.next(1, 1, SLOW), 1);
        assert_eq!(limits.largest(), 1);
        assert_eq!(ClaimLimits::new(0, 0), ClaimLimits { batch: 1, catch_up: 1 });
    }
}
