//! Check digits appended to a code so that typing mistakes are caught before a lookup.
//!
//! What each scheme catches, over the whole code including its check digits:
//! * **Damm** (default, 1 digit): every single-digit substitution and every
//!   transposition of two adjacent digits. It uses a weak totally
//!   anti-symmetric quasigroup of order 10, so no digit pair is a blind spot.
//! * **Luhn** (1 digit): every single-digit substitution and every adjacent
//!   transposition *except* `09 <-> 90` (doubling maps 0 and 9 to the same
//!   digit sum). Offered for compatibility with card-style numbers.
//! * **Mod97** (ISO 7064 MOD 97-10, 2 digits, as in IBAN): every single-digit
//!   substitution and every adjacent transposition, since 97 is prime and
//!   neither `d * 10^i` nor `9 * d * 10^i` (0 < |d| <= 9) is a multiple of 97;
//!   it also catches most other double errors. Costs one extra digit.
//! * **None**: catches nothing; for pools whose codes are never typed by people.
//!
//! None of them is a security measure: anyone can compute a valid check digit.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Damm's order-10 weak totally anti-symmetric quasigroup (the table from his 2004 thesis).
const DAMM_TABLE: [[u8; 10]; 10] = [
    [0, 3, 1, 7, 5, 9, 8, 6, 4, 2],
    [7, 0, 9, 2, 1, 5, 4, 8, 6, 3],
    [4, 2, 0, 6, 8, 7, 1, 3, 5, 9],
    [1, 7, 5, 0, 9, 8, 3, 4, 2, 6],
    [6, 1, 2, 3, 0, 4, 5, 9, 7, 8],
    [3, 6, 7, 4, 2, 0, 9, 5, 8, 1],
    [5, 8, 6, 9, 7, 2, 0, 1, 3, 4],
    [8, 9, 4, 5, 3, 6, 2, 0, 1, 7],
    [9, 4, 3, 8, 6, 1, 7, 2, 0, 5],
    [2, 5, 8, 1, 4, 3, 6, 7, 9, 0],
];

/// A check-digit algorithm; serialised as `damm`, `luhn`, `mod97` or `none`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckScheme {
    /// Damm algorithm, one digit; catches all single errors and adjacent transpositions.
    #[default]
    Damm,
    /// Luhn (mod 10), one digit; misses the `09 <-> 90` transposition.
    Luhn,
    /// ISO 7064 MOD 97-10, two digits.
    Mod97,
    /// No check digits.
    None,
}

/// Error parsing a [`CheckScheme`] name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown check scheme: expected one of damm, luhn, mod97, none")]
pub struct UnknownCheckScheme;

/// Digit value of an ASCII byte; non-digits are a caller bug, mapped into 0..10
/// only so that table lookups cannot panic.
#[inline]
fn digit(b: u8) -> u8 {
    debug_assert!(b.is_ascii_digit(), "check digits need ASCII digits");
    b.wrapping_sub(b'0') % 10
}

fn damm(digits: &[u8]) -> u8 {
    digits.iter().fold(0u8, |interim, &b| DAMM_TABLE[usize::from(interim)][usize::from(digit(b))])
}

/// Luhn sum of `digits`; `double_last` says whether the rightmost digit is in a
/// doubled position (true when computing, false when verifying a full code).
fn luhn_sum(digits: &[u8], double_last: bool) -> u32 {
    digits
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &b)| {
            let d = u32::from(digit(b));
            if (i % 2 == 0) == double_last {
                let dd = d * 2;
                if dd > 9 { dd - 9 } else { dd }
            } else {
                d
            }
        })
        .sum()
}

fn mod97(digits: &[u8]) -> u32 {
    digits.iter().fold(0u32, |r, &b| (r * 10 + u32::from(digit(b))) % 97)
}

impl CheckScheme {
    /// Every scheme, for tests and CLI help.
    pub const ALL: [CheckScheme; 4] = [CheckScheme::Damm, CheckScheme::Luhn, CheckScheme::Mod97, CheckScheme::None];

    /// Number of check digits appended: 1, 1, 2 or 0.
    pub fn width(self) -> usize {
        match self {
            CheckScheme::Damm | CheckScheme::Luhn => 1,
            CheckScheme::Mod97 => 2,
            CheckScheme::None => 0,
        }
    }

    /// The lower-case name used in config and serde.
    pub fn name(self) -> &'static str {
        match self {
            CheckScheme::Damm => "damm",
            CheckScheme::Luhn => "luhn",
            CheckScheme::Mod97 => "mod97",
            CheckScheme::None => "none",
        }
    }

    /// Check digits for `digits`, which must be ASCII `0-9` (not checked in release builds).
    pub fn compute(self, digits: &str) -> String {
        let mut out = String::with_capacity(self.width());
        self.push_check(digits.as_bytes(), &mut out);
        out
    }

    /// Appends the check digits for `digits` to `out`, avoiding an allocation when formatting.
    pub(crate) fn push_check(self, digits: &[u8], out: &mut String) {
        match self {
            CheckScheme::Damm => out.push(char::from(b'0' + damm(digits))),
            CheckScheme::Luhn => {
                let sum = luhn_sum(digits, true);
                // sum % 10 < 10, so the digit is in 0..=9.
                out.push(char::from(b'0' + ((10 - sum % 10) % 10) as u8));
            }
            CheckScheme::Mod97 => {
                // ISO 7064 MOD 97-10: c = 98 - (n * 100 mod 97), so (n * 100 + c) mod 97 == 1.
                let c = 98 - (mod97(digits) * 100) % 97;
                out.push(char::from(b'0' + (c / 10) as u8));
                out.push(char::from(b'0' + (c % 10) as u8));
            }
            CheckScheme::None => {}
        }
    }

    /// True if `code` (payload followed by its check digits) is all ASCII digits and its check digits match.
    pub fn verify(self, code: &str) -> bool {
        let bytes = code.as_bytes();
        if bytes.len() < self.width() || !bytes.iter().all(u8::is_ascii_digit) {
            return false;
        }
        let (payload, check) = bytes.split_at(bytes.len() - self.width());
        self.verify_split(payload, check)
    }

    /// Checks `check` against `payload`; both must already be known to be ASCII digits.
    pub(crate) fn verify_split(self, payload: &[u8], check: &[u8]) -> bool {
        match self {
            // Recompute and compare rather than using the "whole number mod 97 == 1"
            // shortcut, which would also accept "99" where "02" is expected.
            CheckScheme::Damm | CheckScheme::Luhn | CheckScheme::Mod97 => {
                let mut expected = String::with_capacity(2);
                self.push_check(payload, &mut expected);
                expected.as_bytes() == check
            }
            CheckScheme::None => check.is_empty(),
        }
    }
}

impl fmt::Display for CheckScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CheckScheme {
    type Err = UnknownCheckScheme;

    /// Accepts the serde names, ignoring ASCII case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CheckScheme::ALL.into_iter().find(|c| c.name().eq_ignore_ascii_case(s)).ok_or(UnknownCheckScheme)
    }
}
