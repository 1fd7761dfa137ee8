//! How a provider's budget is divided among the pods: the pure arithmetic of one pod's sync, apart
//! from the transaction that runs it, so its guarantees can be tested on their own.

/// Another pod's row of the provider's shares, as one sync reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Share {
    /// Units it recorded as its own (at least its sends in flight).
    pub held: u32,
    /// What it asked for at its last sync.
    pub want: u32,
}

/// What one sync may give this pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Portion {
    /// Its fair part: the water-filled split of the budget over every pod's want.
    pub fair: u32,
    /// The most it could have now: the budget less what the other pods hold.
    pub ceiling: u32,
    /// Its new share: the fair part, but never more than the ceiling.
    pub allowed: u32,
}

impl Portion {
    /// The share to record for a pod with `in_flight` sends: never less than they use, so units still
    /// in use are never handed to another pod.
    pub fn recorded(&self, in_flight: u32) -> u32 {
        self.allowed.max(in_flight)
    }
}

/// One pod's sync, the arithmetic alone: `budget` (the deployment's limit now, 0 while paused) is
/// water-filled over the others' wants and this pod's `want`, and what this pod is allowed is capped by
/// what the others hold. Run under the provider's row lock, so every sync sees the shares the earlier
/// ones recorded: since no sync lets the shares sum past the budget, and a pod sends only within its
/// share, the sends in flight across the deployment never exceed the budget.
pub(crate) fn divide(budget: u32, others: &[Share], want: u32) -> Portion {
    let wants: Vec<u32> = others.iter().map(|o| o.want).chain([want]).collect();
    let fair = *water_fill(budget, &wants).last().expect("this pod's want is in");
    let held: u32 = others.iter().fold(0u32, |sum, o| sum.saturating_add(o.held));
    let ceiling = budget.saturating_sub(held);
    Portion { fair, ceiling, allowed: fair.min(ceiling) }
}

/// Splits `budget` among `wants` (water-filling): everyone gets what they want if it all fits,
/// otherwise the smallest wants are met and the rest share equally; the indivisible remainder goes
/// to the largest wants (among equal wants, to the later ones).
pub(crate) fn water_fill(budget: u32, wants: &[u32]) -> Vec<u32> {
    let mut out = vec![0u32; wants.len()];
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (wants[i], i));
    let mut left = budget;
    for (n, &i) in order.iter().enumerate() {
        let remaining = (order.len() - n) as u32;
        let fair = left / remaining;
        out[i] = wants[i].min(fair);
        left -= out[i];
    }
    // Integer division leaves up to `remaining - 1` units: hand them to those still short.
    for &i in order.iter().rev() {
        if left == 0 {
            break;
        }
        let extra = (wants[i] - out[i]).min(left);
        out[i] += extra;
        left -= extra;
    }
    out
}

#[cfg(test)]
mod tests;
