//! Which keyed permutation a pool's codes come from: NIST FF1 (the default for new pools) or the
//! house Feistel construction (pools created before FF1 was offered keep it). Pinned with the pool:
//! another cipher is another mapping from counters to codes.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::code::feistel::{DomainError, FeistelPermutation};
use crate::code::ff1::Ff1Permutation;
use crate::keys::PoolKey;

/// A pool's cipher, as the configuration, the database (`cif_pools.cipher`) and the command line name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Cipher {
    /// NIST SP 800-38G FF1 with AES-256, radix 10, tweaked with the pool's name ([`crate::code::ff1`]).
    Ff1,
    /// The house AES-256 Feistel network with cycle walking ([`crate::code::feistel`]).
    Feistel,
}

impl Cipher {
    /// The name stored and configured: `ff1` or `feistel`.
    pub const fn name(self) -> &'static str {
        match self {
            Cipher::Ff1 => "ff1",
            Cipher::Feistel => "feistel",
        }
    }
}

impl fmt::Display for Cipher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Cipher {
    type Err = String;

    fn from_str(s: &str) -> Result<Cipher, String> {
        match s {
            "ff1" => Ok(Cipher::Ff1),
            "feistel" => Ok(Cipher::Feistel),
            other => Err(format!("unknown cipher {other:?}: expected \"ff1\" or \"feistel\"")),
        }
    }
}

/// One pool's keyed bijection of `[0, 10^d)`, whichever cipher makes it.
#[derive(Debug, Clone)]
pub enum Permutation {
    /// FF1 under the pool key, tweaked with the pool's name.
    Ff1(Ff1Permutation),
    /// The house Feistel network under the pool key (boxed: its AES key schedule is large, FF1's is
    /// behind a shared pointer already).
    Feistel(Box<FeistelPermutation>),
}

impl Permutation {
    /// `cipher`'s permutation of `[0, 10^digits)` for pool `pool_name` under `key`.
    pub fn new(cipher: Cipher, key: &PoolKey, pool_name: &str, digits: u32) -> Result<Permutation, DomainError> {
        Ok(match cipher {
            Cipher::Ff1 => Permutation::Ff1(Ff1Permutation::new(key, pool_name.as_bytes(), digits)?),
            Cipher::Feistel => Permutation::Feistel(Box::new(FeistelPermutation::new(key, digits)?)),
        })
    }

    /// Which cipher this is.
    pub fn cipher(&self) -> Cipher {
        match self {
            Permutation::Ff1(_) => Cipher::Ff1,
            Permutation::Feistel(_) => Cipher::Feistel,
        }
    }

    /// `10^d`.
    pub fn domain_size(&self) -> u64 {
        match self {
            Permutation::Ff1(p) => p.domain_size(),
            Permutation::Feistel(p) => p.domain_size(),
        }
    }

    /// The image of `counter`, or an error when it is not below [`Self::domain_size`].
    pub fn try_permute(&self, counter: u64) -> Result<u64, DomainError> {
        match self {
            Permutation::Ff1(p) => p.try_permute(counter),
            Permutation::Feistel(p) => p.try_permute(counter),
        }
    }

    /// The counter whose image is `value`; `None` when `value` is not below [`Self::domain_size`].
    pub fn inverse(&self, value: u64) -> Option<u64> {
        match self {
            Permutation::Ff1(p) => p.inverse(value),
            Permutation::Feistel(p) => p.inverse(value),
        }
    }
}
