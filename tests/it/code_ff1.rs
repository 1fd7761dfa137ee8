//! FF1 pools: the whole 10^6 domain of a 6-digit pool is a bijection, and a pool's FF1 codes round-trip
//! through its codec and differ from the house Feistel construction's.

use cifpool::code::{CheckScheme, Cipher, CodeFormat, Ff1Permutation, PoolCodec};
use cifpool::keys::{MasterKey, PoolKey};

use crate::code_feistel::assert_bijection;

fn test_key() -> PoolKey {
    MasterKey::from_bytes(*b"0123456789abcdef0123456789abcdef").derive_pool_key("test", "k1")
}

#[test]
fn exhaustive_bijection_at_six_digits() {
    let perm = Ff1Permutation::new(&test_key(), b"individual", 6).unwrap();
    assert_eq!(perm.domain_size(), 1_000_000);
    assert_bijection(perm.domain_size(), |c| perm.try_permute(c).unwrap(), |v| perm.inverse(v));
}

#[test]
fn a_pools_ff1_codes_round_trip_and_differ_from_the_feistel_ones() {
    let format = CodeFormat::new("1", 9, CheckScheme::Damm).unwrap();
    let ff1 = PoolCodec::with_cipher(format.clone(), Cipher::Ff1, &test_key(), "individual").unwrap();
    let feistel = PoolCodec::with_cipher(format, Cipher::Feistel, &test_key(), "individual").unwrap();
    assert_eq!(ff1.capacity(), 1_000_000_000);
    let mut same = 0;
    for counter in (0..1_000_000_000).step_by(9_999_991) {
        let code = ff1.encode(counter);
        assert_eq!(code.len(), 11);
        assert_eq!(ff1.decode(&code), Ok(counter));
        same += usize::from(code == feistel.encode(counter));
    }
    assert_eq!(same, 0, "FF1 and the Feistel construction are different permutations");
}
