//! Bijectivity and round-trip properties of the keyed permutation and the codec.

use cifpool::code::{CheckScheme, CodeFormat, DomainError, FeistelPermutation, PoolCodec};
use cifpool::code::{MAX_DIGITS, MIN_DIGITS};
use cifpool::keys::{MasterKey, PoolKey};
use proptest::prelude::*;

fn test_key() -> PoolKey {
    MasterKey::from_bytes(*b"0123456789abcdef0123456789abcdef").derive_pool_key("test", "k1")
}

/// Checks that `permute` maps every point of `[0, n)` to a distinct point of it, and `inverse` undoes it.
pub(crate) fn assert_bijection(n: u64, permute: impl Fn(u64) -> u64, inverse: impl Fn(u64) -> Option<u64>) {
    let mut seen = vec![false; n as usize];
    for counter in 0..n {
        let v = permute(counter);
        assert!(v < n, "permute({counter}) = {v} is out of the domain");
        assert!(!seen[v as usize], "collision at permute({counter}) = {v}");
        seen[v as usize] = true;
        assert_eq!(inverse(v), Some(counter), "inverse failed for {counter}");
    }
    assert!(seen.iter().all(|&s| s));
}

#[test]
fn exhaustive_bijection_at_six_digits() {
    let perm = FeistelPermutation::new(&test_key(), 6).unwrap();
    assert_eq!(perm.domain_size(), 1_000_000);
    assert_bijection(perm.domain_size(), |c| perm.permute(c), |v| perm.inverse(v));
}

#[test]
fn permute_many_matches_permute() {
    for digits in [6, 10, 18] {
        let perm = FeistelPermutation::new(&test_key(), digits).unwrap();
        let end = perm.domain_size();
        for range in [0..1000, end - 37..end, 5..5, 3..4] {
            let mut out = Vec::new();
            perm.permute_many(range.clone(), &mut out);
            let expected: Vec<u64> = range.map(|c| perm.permute(c)).collect();
            assert_eq!(out, expected, "digits {digits}");
        }
    }
}

#[test]
fn digit_bounds_are_enforced() {
    let key = test_key();
    for digits in [0, 1, 5, 19, 20, u32::MAX] {
        let err = FeistelPermutation::new(&key, digits).unwrap_err();
        assert_eq!(err, DomainError::Digits { digits });
        assert!(err.to_string().contains("between 6 and 18"), "{err}");
    }
    for digits in MIN_DIGITS..=MAX_DIGITS {
        let perm = FeistelPermutation::new(&key, digits).unwrap();
        assert_eq!(perm.domain_size(), 10u64.pow(digits));
        // Smallest even width that covers the domain.
        let width = 2 * perm.half_bits();
        assert!(1u128 << width >= u128::from(perm.domain_size()));
        assert!(1u128 << (width - 2) < u128::from(perm.domain_size()));
    }
}

#[test]
fn out_of_domain_inputs_are_rejected() {
    let perm = FeistelPermutation::new(&test_key(), 6).unwrap();
    assert_eq!(perm.try_permute(1_000_000), Err(DomainError::OutOfDomain { value: 1_000_000, domain_size: 1_000_000 }));
    assert_eq!(perm.inverse(1_000_000), None);
    assert_eq!(perm.inverse(u64::MAX), None);
    assert!(perm.try_permute(999_999).is_ok());
}

#[test]
fn walk_counts_are_plausible() {
    // Expected mean passes is 2^(2k) / 10^d; d = 10 (34 bits) is the worst case, about 1.72.
    let perm = FeistelPermutation::new(&test_key(), 10).unwrap();
    let total: u64 = (0..20_000).map(|c| u64::from(perm.permute_with_walks(c).1)).sum();
    let mean = total as f64 / 20_000.0;
    assert!((1.6..1.85).contains(&mean), "mean walks {mean}");
}

#[test]
fn pools_and_key_ids_give_different_permutations() {
    let master = MasterKey::from_bytes([7; 32]);
    let keys = [
        master.derive_pool_key("retail", "k1"),
        master.derive_pool_key("corporate", "k1"),
        master.derive_pool_key("retail", "k2"),
        master.derive_pool_key("ab", "c"),
        master.derive_pool_key("a", "bc"),
    ];
    let outputs: Vec<Vec<u64>> = keys
        .iter()
        .map(|k| {
            let p = FeistelPermutation::new(k, 10).unwrap();
            (0..64).map(|c| p.permute(c)).collect()
        })
        .collect();
    for i in 0..outputs.len() {
        for j in i + 1..outputs.len() {
            assert_ne!(outputs[i], outputs[j], "keys {i} and {j} collide");
        }
    }
    // The digit count is part of the round input too: the 9-digit and 10-digit
    // permutations under one key are unrelated, not truncations of each other.
    let p9 = FeistelPermutation::new(&keys[0], 9).unwrap();
    let p10 = FeistelPermutation::new(&keys[0], 10).unwrap();
    let a: Vec<u64> = (0..64).map(|c| p9.permute(c)).collect();
    let b: Vec<u64> = (0..64).map(|c| p10.permute(c) % 1_000_000_000).collect();
    assert_ne!(a, b);
}

#[test]
fn debug_output_hides_the_key_schedule() {
    let perm = FeistelPermutation::new(&test_key(), 9).unwrap();
    let text = format!("{perm:?}");
    assert!(text.starts_with("FeistelPermutation"), "{text}");
    assert!(!text.contains("cipher"), "{text}");
}

fn scheme() -> impl Strategy<Value = CheckScheme> {
    prop::sample::select(CheckScheme::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn inverse_undoes_permute(digits in MIN_DIGITS..=MAX_DIGITS, raw in any::<u64>(), key in any::<[u8; 32]>()) {
        let perm = FeistelPermutation::new(&PoolKey::from_bytes(key), digits).unwrap();
        let counter = raw % perm.domain_size();
        let v = perm.permute(counter);
        prop_assert!(v < perm.domain_size());
        prop_assert_eq!(perm.try_permute(counter), Ok(v));
        prop_assert_eq!(perm.inverse(v), Some(counter));
    }

    #[test]
    fn codec_round_trips(
        digits in MIN_DIGITS..=MAX_DIGITS,
        prefix in "[0-9]{0,6}",
        check in scheme(),
        raw in any::<u64>(),
    ) {
        let format = CodeFormat::new(prefix.clone(), digits, check).unwrap();
        let codec = PoolCodec::new(format, &test_key()).unwrap();
        let counter = raw % codec.capacity();
        let code = codec.encode(counter);
        prop_assert_eq!(code.len(), codec.format().total_len());
        prop_assert!(code.starts_with(&prefix));
        prop_assert!(code.bytes().all(|b| b.is_ascii_digit()));
        prop_assert_eq!(codec.try_encode(counter), Ok(code.clone()));
        prop_assert_eq!(codec.decode(&code), Ok(counter));
        prop_assert!(check.verify(&code));
    }
}
