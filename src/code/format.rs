//! The textual form of a code: `prefix || zero-padded permuted value || check digits`.
//!
//! The check digits cover the prefix as well as the value, so a typo anywhere in
//! the code is caught. Parsing reports the first problem found, in the order
//! length, non-digit, prefix, check digit, so that the message points at the
//! most basic mistake.

use std::fmt::Write as _;

use crate::code::check::CheckScheme;
use crate::code::cipher::{Cipher, Permutation};
use crate::code::feistel::{DomainError, FeistelPermutation, MAX_DIGITS, MIN_DIGITS};
use crate::keys::PoolKey;

/// Longest allowed prefix, so that prefix + 18 digits + 2 check digits stays at most 26 characters.
pub(crate) const MAX_PREFIX_LEN: usize = 6;

/// Errors in a [`CodeFormat`] definition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The prefix has more than [`MAX_PREFIX_LEN`] characters.
    #[error("prefix must be at most 6 digits long, found {found} characters")]
    PrefixTooLong {
        /// Characters in the rejected prefix.
        found: usize,
    },
    /// The prefix contains something other than ASCII `0-9`.
    #[error("prefix must contain only the digits 0-9")]
    PrefixNotDigits,
    /// The digit count is outside 6..=18.
    #[error("digit count {digits} is not supported: it must be between 6 and 18")]
    Digits {
        /// The rejected digit count.
        digits: u32,
    },
}

/// Why a code string was rejected; the `Display` text is meant for API error details.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodeError {
    /// Wrong number of characters.
    #[error("code must be {expected} characters long, but has {found}")]
    Length {
        /// Characters a code of this pool has.
        expected: usize,
        /// Characters in the rejected input.
        found: usize,
    },
    /// A character other than `0-9`; `position` is 1-based, as a person counts.
    #[error("code must contain only the digits 0-9, but character {position} is not a digit")]
    NonDigit {
        /// 1-based character position of the first non-digit.
        position: usize,
    },
    /// The code does not start with this pool's prefix.
    #[error("code must start with the prefix {expected}")]
    Prefix {
        /// The pool's prefix.
        expected: String,
    },
    /// The check digits do not match: most likely a typo.
    #[error("check digit mismatch: the code contains a typo or is not a valid code")]
    CheckDigit,
}

/// How a pool renders codes: prefix, digit count and check scheme; validated on construction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeFormat {
    prefix: String,
    digits: u32,
    check: CheckScheme,
}

impl CodeFormat {
    /// Validates the prefix (0-6 ASCII digits) and digit count (6-18).
    pub fn new(prefix: impl Into<String>, digits: u32, check: CheckScheme) -> Result<Self, FormatError> {
        let prefix = prefix.into();
        let found = prefix.chars().count();
        if found > MAX_PREFIX_LEN {
            return Err(FormatError::PrefixTooLong { found });
        }
        if !prefix.bytes().all(|b| b.is_ascii_digit()) {
            return Err(FormatError::PrefixNotDigits);
        }
        if !(MIN_DIGITS..=MAX_DIGITS).contains(&digits) {
            return Err(FormatError::Digits { digits });
        }
        Ok(CodeFormat { prefix, digits, check })
    }

    /// The fixed leading digits (possibly empty).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Number of permuted digits between prefix and check digits.
    pub fn digits(&self) -> u32 {
        self.digits
    }

    /// The check-digit scheme.
    pub fn check(&self) -> CheckScheme {
        self.check
    }

    /// Length in characters of every code in this format.
    pub fn total_len(&self) -> usize {
        self.prefix.len() + self.digits as usize + self.check.width()
    }

    /// Renders a permuted value, which must be below `10^digits`.
    ///
    /// A larger value (a caller bug, `debug_assert!`ed) is rendered in full rather
    /// than truncated, so it comes out too long and can never equal a valid code.
    pub fn format(&self, value: u64) -> String {
        debug_assert!(u128::from(value) < 10u128.pow(self.digits), "value has more than {} digits", self.digits);
        // Prefix (<= 6) + digits (<= 18) fit in 24 bytes; building the body on the
        // stack lets the check digits be computed over it without a second buffer.
        let mut body = [b'0'; MAX_PREFIX_LEN + MAX_DIGITS as usize];
        let prefix_len = self.prefix.len();
        let body_len = prefix_len + self.digits as usize;
        body[..prefix_len].copy_from_slice(self.prefix.as_bytes());
        let mut rest = value;
        for slot in body[prefix_len..body_len].iter_mut().rev() {
            *slot = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
        let mut out = String::with_capacity(self.total_len());
        if rest != 0 {
            // Out-of-range value: render it whole; the length makes it unparseable.
            out.push_str(&self.prefix);
            let _ = write!(out, "{value}");
            let full = out.clone().into_bytes();
            self.check.push_check(&full, &mut out);
            return out;
        }
        let body = &body[..body_len];
        // body holds only ASCII digits.
        out.extend(body.iter().map(|&b| char::from(b)));
        self.check.push_check(body, &mut out);
        out
    }

    /// Validates `code` and returns the permuted value it carries (not the counter).
    pub fn parse(&self, code: &str) -> Result<u64, CodeError> {
        let expected = self.total_len();
        let found = code.chars().count();
        if found != expected {
            return Err(CodeError::Length { expected, found });
        }
        if let Some(i) = code.chars().position(|c| !c.is_ascii_digit()) {
            return Err(CodeError::NonDigit { position: i + 1 });
        }
        // All ASCII from here on, so byte offsets are character offsets.
        let bytes = code.as_bytes();
        if !bytes.starts_with(self.prefix.as_bytes()) {
            return Err(CodeError::Prefix { expected: self.prefix.clone() });
        }
        let (body, check) = bytes.split_at(expected - self.check.width());
        if !self.check.verify_split(body, check) {
            return Err(CodeError::CheckDigit);
        }
        // At most 18 digits, so this cannot overflow a u64.
        Ok(body[self.prefix.len()..].iter().fold(0u64, |v, &b| v * 10 + u64::from(b - b'0')))
    }
}

/// A pool's format together with its keyed permutation: counter <-> code string.
#[derive(Debug, Clone)]
pub struct PoolCodec {
    format: CodeFormat,
    perm: Permutation,
}

impl PoolCodec {
    /// The house Feistel permutation for `format.digits()` under `key` (the cipher of pools created
    /// before FF1 was offered, and of `codes gen --key-hex` without `--cipher`).
    pub fn new(format: CodeFormat, key: &PoolKey) -> Result<Self, DomainError> {
        let perm = Permutation::Feistel(Box::new(FeistelPermutation::new(key, format.digits())?));
        Ok(PoolCodec { format, perm })
    }

    /// `cipher`'s permutation for pool `pool_name` with `format`, under `key`.
    pub fn with_cipher(
        format: CodeFormat,
        cipher: Cipher,
        key: &PoolKey,
        pool_name: &str,
    ) -> Result<Self, DomainError> {
        let perm = Permutation::new(cipher, key, pool_name, format.digits())?;
        Ok(PoolCodec { format, perm })
    }

    /// The code format.
    pub fn format(&self) -> &CodeFormat {
        &self.format
    }

    /// The keyed permutation.
    pub fn permutation(&self) -> &Permutation {
        &self.perm
    }

    /// Number of distinct codes (`10^digits`), i.e. the pool's capacity.
    pub fn capacity(&self) -> u64 {
        self.perm.domain_size()
    }

    /// The code for `counter`, which must be below [`Self::capacity`] (a counter beyond it is
    /// formatted unpermuted: too long to be anyone's code, and refused by [`Self::decode`]).
    pub fn encode(&self, counter: u64) -> String {
        debug_assert!(counter < self.capacity(), "counter {counter} outside the domain");
        self.format.format(self.perm.try_permute(counter).unwrap_or(counter))
    }

    /// Checked [`Self::encode`] for callers that have not enforced the capacity bound.
    pub fn try_encode(&self, counter: u64) -> Result<String, DomainError> {
        Ok(self.format.format(self.perm.try_permute(counter)?))
    }

    /// Validates `code` and returns the counter it was issued for.
    pub fn decode(&self, code: &str) -> Result<u64, CodeError> {
        let value = self.format.parse(code)?;
        // parse yields exactly `digits` digits, so value < 10^digits and inverse succeeds.
        Ok(self.perm.inverse(value).unwrap_or(value))
    }
}
