//! Order statistics shared by the benchmark reports, the lab and the simulator.

/// Nearest-rank percentile `p` (0 < p ≤ 1) of `sorted` (ascending): the smallest sample with at
/// least `p` of the samples at or below it; `None` for no samples. `p = 0.5` is the lower median.
pub fn percentile<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), Some(50));
        assert_eq!(percentile(&v, 0.99), Some(99));
        assert_eq!(percentile(&v, 0.999), Some(100));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.5), Some(2.0), "lower median");
        assert_eq!(percentile(&[7], 0.01), Some(7));
        assert_eq!(percentile::<u64>(&[], 0.5), None);
    }
}
