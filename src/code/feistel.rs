//! Keyed permutation of `[0, 10^d)` that turns a sequential counter into a
//! non-sequential customer number.
//!
//! # Construction
//! A balanced Feistel network on the smallest even bit width `2k` with
//! `2^(2k) >= 10^d`, split into two `k`-bit halves, with [`ROUNDS`] = 10 rounds.
//! Round `i` computes `(L, R) -> (R, L xor F_i(R))` where `F_i(R)` is the low `k`
//! bits of `AES-256_K(tag || d || i || R)` under the pool key `K`. Values that
//! land in `[10^d, 2^(2k))` are fed through the network again ("cycle-walking")
//! until they fall inside the domain; because `2^(2k) < 4 * 10^d`, fewer than
//! four passes are needed on average (about 1.07 for d = 9, 1.72 for d = 10).
//!
//! # Why this is safe
//! * AES under a secret key is a pseudorandom permutation, and on inputs that are
//!   never repeated within a round it is indistinguishable from a pseudorandom
//!   function (PRP/PRF switching lemma; the bound `q^2 / 2^129` is negligible
//!   for a domain of at most 2^60 points). Truncating to `k` bits keeps it a PRF.
//!   Distinct rounds and digit counts use distinct input blocks, so the rounds
//!   behave as independent keyed functions.
//! * With independent PRF round functions, Luby-Rackoff gives a PRP after 3
//!   rounds and a strong PRP after 4, but only up to about `2^(k/2)` queries,
//!   which is meaningless for halves of 10 to 30 bits. Patarin's analyses show
//!   that more rounds push the bound towards the information-theoretic `2^k`
//!   (`q << 2^k` from 6 rounds on), and 10 rounds is the margin NIST's FF1 uses
//!   on the same small domains. The published generic attacks on small-domain
//!   Feistel FPE (Bellare-Hoang-Tessaro 2016, Durak-Vaudenay 2017) need many
//!   tweaks or domains below 10^6; this construction has no tweak and
//!   [`FeistelPermutation::new`] refuses domains below 10^6 (`>= 2^20` points),
//!   the SP 800-38G Rev.1 minimum.
//! * Cycle-walking preserves bijectivity: the network is a permutation of
//!   `[0, 2^(2k))`, and following its cycle from an in-domain point until the
//!   next in-domain point is the induced permutation on `[0, 10^d)`. Walking
//!   backwards with the inverse network recovers the original point.
//!
//! # Limits
//! * This produces an *identifier*, not an *authenticator*. An observer who sees
//!   many codes learns nothing useful about neighbouring codes or about the
//!   issuance order, but a code is not a secret and proves nothing about its
//!   holder; never use possession of a code as authentication.
//! * The domain is small: anyone holding the key can enumerate all counters and
//!   their codes in seconds. The key protects the ordering, and only while it
//!   stays secret.
//! * The key (and the digit count) must never change for a pool once codes are
//!   issued: a different key is a different permutation, so every counter would
//!   map to a different code and new codes would collide with issued ones.

use std::ops::Range;

use aes::Aes256;
use aes::cipher::{BlockEncrypt, KeyInit, generic_array::GenericArray};

use crate::keys::PoolKey;

/// Number of Feistel rounds; part of the code mapping, so changing it re-maps every code.
pub(crate) const ROUNDS: u8 = 10;

/// Smallest supported digit count; 10^6 is the NIST SP 800-38G Rev.1 minimum FPE domain.
pub const MIN_DIGITS: u32 = 6;

/// Largest supported digit count; 10^18 is the largest power of ten whose Feistel width fits in a u64.
pub const MAX_DIGITS: u32 = 18;

/// Domain separation so round-function inputs cannot collide with any other
/// future use of the same pool key.
const ROUND_TAG: [u8; 8] = *b"CIFPFR01";

/// Lanes processed together in [`FeistelPermutation::permute_many`]; matches the
/// AES-NI backend's parallel block count so the AES pipeline stays full.
const LANES: usize = 8;

/// Errors from building or using a permutation outside its domain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DomainError {
    /// The digit count is outside `MIN_DIGITS..=MAX_DIGITS`.
    #[error("digit count {digits} is not supported: it must be between 6 and 18")]
    Digits {
        /// The rejected digit count.
        digits: u32,
    },
    /// The input is not below `10^digits`.
    #[error("value {value} is outside the domain [0, {domain_size})")]
    OutOfDomain {
        /// The rejected input.
        value: u64,
        /// `10^digits`.
        domain_size: u64,
    },
}

/// A keyed bijection of `[0, 10^d)`; see the module documentation for the construction.
#[derive(Clone)]
pub struct FeistelPermutation {
    cipher: Aes256,
    digits: u32,
    half_bits: u32,
    half_mask: u64,
    domain: u64,
}

impl std::fmt::Debug for FeistelPermutation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The expanded AES key schedule is key material; keep it out of logs.
        f.debug_struct("FeistelPermutation")
            .field("digits", &self.digits)
            .field("half_bits", &self.half_bits)
            .finish_non_exhaustive()
    }
}

impl FeistelPermutation {
    /// Builds the permutation of `[0, 10^digits)` keyed by `key`; `digits` must be in 6..=18.
    pub fn new(key: &PoolKey, digits: u32) -> Result<Self, DomainError> {
        if !(MIN_DIGITS..=MAX_DIGITS).contains(&digits) {
            return Err(DomainError::Digits { digits });
        }
        let domain = 10u64.pow(digits);
        // Smallest k with 2^(2k) >= 10^d.
        let mut half_bits = 1;
        while (1u128 << (2 * half_bits)) < u128::from(domain) {
            half_bits += 1;
        }
        Ok(FeistelPermutation {
            cipher: Aes256::new(GenericArray::from_slice(key.as_bytes())),
            digits,
            half_bits,
            half_mask: (1u64 << half_bits) - 1,
            domain,
        })
    }

    /// The digit count `d` this permutation was built for.
    pub fn digits(&self) -> u32 {
        self.digits
    }

    /// `10^d`, the number of distinct codes.
    pub fn domain_size(&self) -> u64 {
        self.domain
    }

    /// Bits in each Feistel half (`k`); the network acts on `2k` bits.
    pub fn half_bits(&self) -> u32 {
        self.half_bits
    }

    /// Maps a counter to its permuted value; `counter` must be below [`Self::domain_size`].
    ///
    /// Never panics in release builds and never hangs: an out-of-domain counter
    /// (a caller bug, caught by `debug_assert!` in debug builds) is returned
    /// unchanged. Such a value is `>= 10^d`, so it can never collide with a
    /// genuine code, and a formatted code built from it is too long to parse.
    /// Use [`Self::try_permute`] when the bound is not already enforced.
    #[inline]
    pub fn permute(&self, counter: u64) -> u64 {
        debug_assert!(counter < self.domain, "counter {counter} outside [0, {})", self.domain);
        if counter >= self.domain {
            return counter;
        }
        self.permute_with_walks(counter).0
    }

    /// Checked [`Self::permute`]: errors instead of relying on the caller's bound.
    pub fn try_permute(&self, counter: u64) -> Result<u64, DomainError> {
        if counter >= self.domain {
            return Err(self.out_of_domain(counter));
        }
        Ok(self.permute_with_walks(counter).0)
    }

    /// Like [`Self::permute`], also returning how many passes through the network
    /// were needed (1 = no cycle-walking); used to report the mean walk count.
    /// Same precondition as `permute`; an out-of-domain counter yields `(counter, 0)`.
    pub fn permute_with_walks(&self, counter: u64) -> (u64, u32) {
        debug_assert!(counter < self.domain);
        if counter >= self.domain {
            // Walking from outside the domain might never re-enter it.
            return (counter, 0);
        }
        let mut x = counter;
        let mut walks = 0;
        loop {
            x = self.encrypt_once(x);
            walks += 1;
            if x < self.domain {
                return (x, walks);
            }
        }
    }

    /// Inverse of [`Self::permute`]; `None` if `value` is not below `10^d`.
    pub fn inverse(&self, value: u64) -> Option<u64> {
        if value >= self.domain {
            return None;
        }
        let mut x = value;
        loop {
            x = self.decrypt_once(x);
            if x < self.domain {
                return Some(x);
            }
        }
    }

    /// Appends `permute(c)` for every `c` in `counters` to `out`, several lanes at a
    /// time so AES-NI can pipeline; same results as calling [`Self::permute`] in a loop.
    pub fn permute_many(&self, counters: Range<u64>, out: &mut Vec<u64>) {
        out.reserve(usize::try_from(counters.end.saturating_sub(counters.start)).unwrap_or(0));
        let mut next = counters.start;
        while next < counters.end {
            let n = usize::try_from((counters.end - next).min(LANES as u64)).unwrap_or(LANES);
            let mut lanes = [0u64; LANES];
            for (i, lane) in lanes.iter_mut().take(n).enumerate() {
                *lane = next + i as u64;
            }
            self.permute_lanes(&mut lanes[..n]);
            out.extend_from_slice(&lanes[..n]);
            next += n as u64;
        }
    }

    /// Batched permute of up to `LANES` values in place.
    fn permute_lanes(&self, values: &mut [u64]) {
        // Indices (into `values`) still needing a pass through the network.
        let mut pending = [0usize; LANES];
        let mut n_pending = 0;
        for (i, v) in values.iter().enumerate() {
            debug_assert!(*v < self.domain);
            // Out-of-domain inputs stay unchanged, as in `permute`.
            if *v < self.domain {
                pending[n_pending] = i;
                n_pending += 1;
            }
        }
        let mut blocks = [aes::Block::default(); LANES];
        let mut left = [0u64; LANES];
        let mut right = [0u64; LANES];
        while n_pending > 0 {
            for j in 0..n_pending {
                let x = values[pending[j]];
                left[j] = x >> self.half_bits;
                right[j] = x & self.half_mask;
            }
            for round in 0..ROUNDS {
                for j in 0..n_pending {
                    self.fill_block(&mut blocks[j], round, right[j]);
                }
                self.cipher.encrypt_blocks(&mut blocks[..n_pending]);
                for j in 0..n_pending {
                    let f = self.block_output(&blocks[j]);
                    let new_right = left[j] ^ f;
                    left[j] = right[j];
                    right[j] = new_right;
                }
            }
            let mut still = 0;
            for j in 0..n_pending {
                let x = (left[j] << self.half_bits) | right[j];
                values[pending[j]] = x;
                if x >= self.domain {
                    pending[still] = pending[j];
                    still += 1;
                }
            }
            n_pending = still;
        }
    }

    fn out_of_domain(&self, value: u64) -> DomainError {
        DomainError::OutOfDomain { value, domain_size: self.domain }
    }

    /// One pass of the network over `2k` bits.
    #[inline]
    fn encrypt_once(&self, x: u64) -> u64 {
        let mut left = x >> self.half_bits;
        let mut right = x & self.half_mask;
        for round in 0..ROUNDS {
            let new_right = left ^ self.round_function(round, right);
            left = right;
            right = new_right;
        }
        (left << self.half_bits) | right
    }

    /// One inverse pass: undo the rounds in reverse order.
    #[inline]
    fn decrypt_once(&self, y: u64) -> u64 {
        let mut left = y >> self.half_bits;
        let mut right = y & self.half_mask;
        for round in (0..ROUNDS).rev() {
            let prev_left = right ^ self.round_function(round, left);
            right = left;
            left = prev_left;
        }
        (left << self.half_bits) | right
    }

    #[inline]
    fn round_function(&self, round: u8, half: u64) -> u64 {
        let mut block = aes::Block::default();
        self.fill_block(&mut block, round, half);
        self.cipher.encrypt_block(&mut block);
        self.block_output(&block)
    }

    /// Block layout: tag (8) | digits (1) | round (1) | zero (2) | half, big-endian (4).
    /// Every field is fixed-width, so distinct (d, round, half) give distinct blocks.
    #[inline]
    fn fill_block(&self, block: &mut aes::Block, round: u8, half: u64) {
        block[..8].copy_from_slice(&ROUND_TAG);
        // digits <= 18 and half < 2^30 (k <= 30), so these casts are lossless.
        block[8] = self.digits as u8;
        block[9] = round;
        block[10] = 0;
        block[11] = 0;
        block[12..].copy_from_slice(&(half as u32).to_be_bytes());
    }

    /// Low `k` bits of the AES output, read as a big-endian 128-bit number.
    #[inline]
    fn block_output(&self, block: &aes::Block) -> u64 {
        let tail: [u8; 8] = block[8..].try_into().unwrap_or([0; 8]);
        u64::from_be_bytes(tail) & self.half_mask
    }
}
