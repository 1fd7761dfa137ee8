//! NIST SP 800-38G FF1 over the decimal digits of a counter: the standard format-preserving
//! encryption, as a keyed permutation of `[0, 10^d)`.
//!
//! # Construction
//! FF1 with AES-256 and radix 10 (a 10-round Feistel on the digit string itself, so no cycle walk is
//! needed), keyed by the pool key and tweaked with the pool's name: two pools that were (wrongly)
//! given the same key still permute differently. The counter is written as exactly `d` decimal
//! digits with leading zeros, encrypted, and read back as a number.
//!
//! # Why written out here
//! This is FF1 as SP 800-38G §6.2 (encryption) and §6.3 (decryption) state it, for the one radix and
//! the digit counts pools use. With `d ≤ 18` both halves are numbers below `10^9`, so every `NUM` and
//! `STR` step of the standard is exact 64- and 128-bit integer arithmetic, and with `b ≤ 4` bytes the
//! round's `S` is the first 8 bytes of one AES block; the CBC-MAC of `P` and of the tweak's blocks is
//! the same in every round and is computed once per permutation. One code costs 10 AES block
//! encryptions. The general-radix implementation of the `fpe` crate (big-integer numeral strings)
//! took ~4 µs a code, which made the refill's encoding compete with Postgres for the CPU; the tests
//! check this code against that crate's output for random keys, tweaks, digit counts and counters,
//! and against NIST's AES-256 radix-10 samples.
//!
//! # Limits
//! As for the house construction ([`crate::code::feistel`]): an identifier, not an authenticator;
//! whoever holds the key can enumerate the domain; and the key, the digit count and the tweak (the
//! pool's name) are part of the mapping, so none may change once a pool has issued codes.

use std::sync::Arc;

use aes::Aes256;
use aes::cipher::{BlockEncrypt, KeyInit, generic_array::GenericArray};

use crate::code::feistel::{DomainError, MAX_DIGITS, MIN_DIGITS};
use crate::keys::PoolKey;

/// FF1's round count.
const ROUNDS: u8 = 10;

/// The radix: decimal digits.
const RADIX: u32 = 10;

/// A keyed bijection of `[0, 10^d)` by FF1-AES256 with radix 10.
#[derive(Clone)]
pub struct Ff1Permutation {
    rounds: Arc<RoundFunction>,
    digits: u32,
    domain: u64,
    /// `10^u` and `10^v`: the moduli of the even and odd rounds.
    left_modulus: u64,
    right_modulus: u64,
}

/// The PRF of FF1's rounds with what is the same in every round already absorbed: the AES key
/// schedule, the CBC-MAC state after `P` and every block of `Q` before its last, and the bytes of the
/// tweak and padding that open the last block.
struct RoundFunction {
    aes: Aes256,
    /// CBC-MAC state after `P || Q[..len(Q) - 16]`.
    chained: [u8; 16],
    /// The last block of `Q` without its round number and `NUM(B)` (zero in those bytes).
    last_block: [u8; 16],
    /// `b`: the bytes `NUM(B)` is written in, at the end of the last block.
    num_bytes: usize,
}

impl std::fmt::Debug for Ff1Permutation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The expanded AES key schedule is key material; keep it out of logs.
        f.debug_struct("Ff1Permutation").field("digits", &self.digits).finish_non_exhaustive()
    }
}

impl Ff1Permutation {
    /// The permutation of `[0, 10^digits)` under `key`, tweaked by `tweak` (a pool's name);
    /// `digits` must be in 6..=18.
    pub fn new(key: &PoolKey, tweak: &[u8], digits: u32) -> Result<Self, DomainError> {
        Self::from_key_bytes(key.as_bytes(), tweak, digits)
    }

    /// Like [`Ff1Permutation::new`] from raw AES-256 key bytes (the NIST sample vectors use their own keys).
    pub fn from_key_bytes(key: &[u8; 32], tweak: &[u8], digits: u32) -> Result<Self, DomainError> {
        if !(MIN_DIGITS..=MAX_DIGITS).contains(&digits) {
            return Err(DomainError::Digits { digits });
        }
        let left_digits = digits / 2;
        let right_digits = digits - left_digits;
        let right_modulus = 10u64.pow(right_digits);
        let rounds = RoundFunction::new(key, tweak, digits, left_digits, right_modulus);
        Ok(Ff1Permutation {
            rounds: Arc::new(rounds),
            digits,
            domain: 10u64.pow(digits),
            left_modulus: 10u64.pow(left_digits),
            right_modulus,
        })
    }

    /// The digit count `d`.
    pub fn digits(&self) -> u32 {
        self.digits
    }

    /// `10^d`, the number of points permuted.
    pub fn domain_size(&self) -> u64 {
        self.domain
    }

    /// The image of `counter`, which must be below [`Self::domain_size`].
    pub fn try_permute(&self, counter: u64) -> Result<u64, DomainError> {
        self.check(counter)?;
        // The d-digit string split after its first u digits: A is the high part, B the low.
        let (mut a, mut b) = (counter / self.right_modulus, counter % self.right_modulus);
        for round in 0..ROUNDS {
            let y = self.rounds.output(round, b);
            let c = ((u128::from(a) + u128::from(y)) % u128::from(self.modulus(round))) as u64;
            (a, b) = (b, c);
        }
        Ok(a * self.right_modulus + b)
    }

    /// The counter whose image is `value`, or `None` outside the domain.
    pub fn inverse(&self, value: u64) -> Option<u64> {
        self.check(value).ok()?;
        let (mut a, mut b) = (value / self.right_modulus, value % self.right_modulus);
        for round in (0..ROUNDS).rev() {
            let modulus = self.modulus(round);
            let y = self.rounds.output(round, a) % modulus;
            let c = (b + modulus - y) % modulus;
            (a, b) = (c, a);
        }
        Some(a * self.right_modulus + b)
    }

    /// `radix^m` of a round: even rounds produce a `u`-digit half, odd ones a `v`-digit half.
    fn modulus(&self, round: u8) -> u64 {
        if round.is_multiple_of(2) { self.left_modulus } else { self.right_modulus }
    }

    fn check(&self, value: u64) -> Result<(), DomainError> {
        if value < self.domain { Ok(()) } else { Err(DomainError::OutOfDomain { value, domain_size: self.domain }) }
    }
}

impl RoundFunction {
    fn new(key: &[u8; 32], tweak: &[u8], digits: u32, left_digits: u32, right_modulus: u64) -> RoundFunction {
        let aes = Aes256::new(GenericArray::from_slice(key));
        // b = ceil(ceil(v * log2(10)) / 8): the bytes of the largest v-digit number, 10^v - 1 (10^v is
        // never a power of two, so its bit length is that ceiling). With v <= 9 this is at most 4,
        // and d = 4 * ceil(b / 4) + 4 = 8: S is the first 8 bytes of R, no further blocks needed.
        let num_bytes = (u64::BITS - (right_modulus - 1).leading_zeros()).div_ceil(8) as usize;
        let tweak_len = u32::try_from(tweak.len()).expect("a pool name is shorter than 4 GiB");
        // P = [1]^1 || [2]^1 || [1]^1 || [radix]^3 || [10]^1 || [u mod 256]^1 || [n]^4 || [t]^4.
        let mut message = vec![1, 2, 1];
        message.extend_from_slice(&RADIX.to_be_bytes()[1..]);
        message.push(ROUNDS);
        message.push(left_digits as u8);
        message.extend_from_slice(&digits.to_be_bytes());
        message.extend_from_slice(&tweak_len.to_be_bytes());
        // Q = T || [0]^((-t-b-1) mod 16) || [i]^1 || [NUM(B)]^b, here with i and NUM(B) left zero.
        message.extend_from_slice(tweak);
        let padding = (16 - (tweak.len() + num_bytes + 1) % 16) % 16;
        message.resize(message.len() + padding + 1 + num_bytes, 0);
        debug_assert_eq!(message.len() % 16, 0);
        let (leading, last) = message.split_at(message.len() - 16);
        let mut chained = [0u8; 16];
        for block in leading.chunks_exact(16) {
            xor(&mut chained, block);
            aes.encrypt_block(GenericArray::from_mut_slice(&mut chained));
        }
        let mut last_block = [0u8; 16];
        last_block.copy_from_slice(last);
        RoundFunction { aes, chained, last_block, num_bytes }
    }

    /// `y = NUM(S)` of round `round` whose other half is `half`: the CBC-MAC's last step over
    /// `[round] || [half]^b`, its first 8 bytes read as a big-endian number.
    fn output(&self, round: u8, half: u64) -> u64 {
        let mut block = self.chained;
        xor(&mut block, &self.last_block);
        block[15 - self.num_bytes] ^= round;
        xor(&mut block[16 - self.num_bytes..], &half.to_be_bytes()[8 - self.num_bytes..]);
        self.aes.encrypt_block(GenericArray::from_mut_slice(&mut block));
        u64::from_be_bytes(block[..8].try_into().expect("8 bytes"))
    }
}

fn xor(into: &mut [u8], with: &[u8]) {
    for (a, b) in into.iter_mut().zip(with) {
        *a ^= b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key of NIST's FF1 samples 7 to 9 (AES-256).
    const NIST_KEY: [u8; 32] = [
        0x2B, 0x7E, 0x15, 0x16, 0x28, 0xAE, 0xD2, 0xA6, 0xAB, 0xF7, 0x15, 0x88, 0x09, 0xCF, 0x4F, 0x3C, 0xEF, 0x43,
        0x59, 0xD8, 0xD5, 0x80, 0xAA, 0x4F, 0x7F, 0x03, 0x6D, 0x6F, 0x04, 0xFC, 0x6A, 0x94,
    ];

    #[test]
    fn nist_samples_for_aes256_and_radix_10_pass() {
        // Sample 7: no tweak; sample 8: the tweak 39383736353433323130 ("9876543210").
        for (tweak, plain, cipher) in
            [(&b""[..], 123_456_789, 6_657_667_009), (&b"9876543210"[..], 123_456_789, 1_001_623_463)]
        {
            let ff1 = Ff1Permutation::from_key_bytes(&NIST_KEY, tweak, 10).unwrap();
            assert_eq!(ff1.try_permute(plain).unwrap(), cipher);
            assert_eq!(ff1.inverse(cipher), Some(plain));
        }
    }

    #[test]
    fn refuses_digit_counts_outside_the_supported_range_and_values_outside_the_domain() {
        assert_eq!(Ff1Permutation::from_key_bytes(&NIST_KEY, b"", 5).unwrap_err(), DomainError::Digits { digits: 5 });
        assert!(Ff1Permutation::from_key_bytes(&NIST_KEY, b"", 19).is_err());
        let ff1 = Ff1Permutation::from_key_bytes(&NIST_KEY, b"", 6).unwrap();
        assert!(ff1.try_permute(1_000_000).is_err());
        assert_eq!(ff1.inverse(1_000_000), None);
    }

    #[test]
    fn the_tweak_changes_the_permutation() {
        let a = Ff1Permutation::from_key_bytes(&NIST_KEY, b"individual", 9).unwrap();
        let b = Ff1Permutation::from_key_bytes(&NIST_KEY, b"business", 9).unwrap();
        let differ = (0..100).filter(|&c| a.try_permute(c).unwrap() != b.try_permute(c).unwrap()).count();
        assert!(differ > 95, "only {differ} of 100 counters map differently");
    }

    /// The `fpe` crate's general FF1 on the same key, tweak and digits.
    fn reference(key: &[u8; 32], tweak: &[u8], digits: u32, counter: u64) -> u64 {
        use fpe::ff1::{FF1, FlexibleNumeralString};
        let ff1 = FF1::<aes09::Aes256>::new(key, 10).unwrap();
        let numerals: Vec<u16> = (0..digits).rev().map(|i| ((counter / 10u64.pow(i)) % 10) as u16).collect();
        let out = ff1.encrypt(tweak, &FlexibleNumeralString::from(numerals)).unwrap();
        Vec::from(out).into_iter().fold(0u64, |v, n| v * 10 + u64::from(n))
    }

    proptest::proptest! {
        #[test]
        fn equals_the_fpe_crates_ff1_and_inverts(
            key in proptest::array::uniform32(proptest::num::u8::ANY),
            tweak in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
            digits in MIN_DIGITS..=MAX_DIGITS,
            seed in proptest::num::u64::ANY,
        ) {
            let ff1 = Ff1Permutation::from_key_bytes(&key, &tweak, digits).unwrap();
            let counter = seed % ff1.domain_size();
            let code = ff1.try_permute(counter).unwrap();
            proptest::prop_assert_eq!(code, reference(&key, &tweak, digits, counter));
            proptest::prop_assert_eq!(ff1.inverse(code), Some(counter));
        }
    }

    #[test]
    fn equals_the_fpe_crates_ff1_for_every_tweak_length_across_a_block() {
        // The tweak's length moves the round number and NUM(B) across block boundaries of Q.
        for len in 0..=33 {
            let tweak: Vec<u8> = (0..len as u8).collect();
            for digits in [6, 7, 12, 17, 18] {
                let ff1 = Ff1Permutation::from_key_bytes(&NIST_KEY, &tweak, digits).unwrap();
                for counter in [0, 1, 123_456, ff1.domain_size() - 1] {
                    assert_eq!(ff1.try_permute(counter).unwrap(), reference(&NIST_KEY, &tweak, digits, counter));
                }
            }
        }
    }

    #[test]
    fn eighteen_digits_round_trip_at_the_edges() {
        let ff1 = Ff1Permutation::from_key_bytes(&NIST_KEY, b"pool", 18).unwrap();
        for counter in [0, 1, 999_999_999_999_999_999] {
            let code = ff1.try_permute(counter).unwrap();
            assert!(code < 10u64.pow(18));
            assert_eq!(ff1.inverse(code), Some(counter));
        }
    }
}
