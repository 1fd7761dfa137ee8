//! NIST SP 800-38G FF1 over the decimal digits of a counter: the standard format-preserving
//! encryption, as a keyed permutation of `[0, 10^d)`.
//!
//! # Construction
//! FF1 with AES-256 and radix 10 (a 10-round Feistel on the digit string itself, so no cycle walk is
//! needed), keyed by the pool key and tweaked with the pool's name: two pools that were (wrongly)
//! given the same key still permute differently. The counter is written as exactly `d` decimal
//! digits with leading zeros, encrypted, and read back as a number. The FF1 implementation is the
//! `fpe` crate's; the NIST sample vectors for AES-256 and radix 10 pass through this wrapper (see
//! its tests).
//!
//! # Limits
//! As for the house construction ([`crate::code::feistel`]): an identifier, not an authenticator;
//! whoever holds the key can enumerate the domain; and the key, the digit count and the tweak (the
//! pool's name) are part of the mapping, so none may change once a pool has issued codes. FF1 costs
//! a few microseconds a code, which does not matter here: codes are made by the refill, far ahead of
//! demand.

use std::sync::Arc;

use aes09::Aes256;
use fpe::ff1::{FF1, FlexibleNumeralString};

use crate::code::feistel::{DomainError, MAX_DIGITS, MIN_DIGITS};
use crate::keys::PoolKey;

/// A keyed bijection of `[0, 10^d)` by FF1-AES256 with radix 10.
#[derive(Clone)]
pub struct Ff1Permutation {
    cipher: Arc<FF1<Aes256>>,
    tweak: Arc<[u8]>,
    digits: u32,
    domain: u64,
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
        let cipher = FF1::<Aes256>::new(key, 10).expect("10 is a valid FF1 radix");
        Ok(Ff1Permutation { cipher: Arc::new(cipher), tweak: tweak.into(), digits, domain: 10u64.pow(digits) })
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
        let digits = self.numerals(counter);
        let out = self.cipher.encrypt(&self.tweak, &digits).expect("d decimal digits are a valid FF1 input");
        Ok(Self::value(out))
    }

    /// The counter whose image is `value`, or `None` outside the domain.
    pub fn inverse(&self, value: u64) -> Option<u64> {
        self.check(value).ok()?;
        let digits = self.numerals(value);
        let out = self.cipher.decrypt(&self.tweak, &digits).expect("d decimal digits are a valid FF1 input");
        Some(Self::value(out))
    }

    fn check(&self, value: u64) -> Result<(), DomainError> {
        if value < self.domain { Ok(()) } else { Err(DomainError::OutOfDomain { value, domain_size: self.domain }) }
    }

    /// `value` as exactly `d` decimal numerals, most significant first (as FF1 reads them).
    fn numerals(&self, mut value: u64) -> FlexibleNumeralString {
        let mut numerals = vec![0u16; self.digits as usize];
        for slot in numerals.iter_mut().rev() {
            *slot = (value % 10) as u16;
            value /= 10;
        }
        FlexibleNumeralString::from(numerals)
    }

    fn value(numerals: FlexibleNumeralString) -> u64 {
        Vec::from(numerals).into_iter().fold(0u64, |v, n| v * 10 + u64::from(n))
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
