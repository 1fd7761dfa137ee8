//! Pure code generation: keyed permutations of counters (NIST FF1, or the house Feistel network), check digits and the
//! string format of customer numbers. Nothing here does I/O.

pub(crate) mod check;
pub(crate) mod cipher;
pub(crate) mod feistel;
pub(crate) mod ff1;
pub(crate) mod format;

pub use check::{CheckScheme, UnknownCheckScheme};
pub use cipher::{Cipher, Permutation};
pub use feistel::{DomainError, FeistelPermutation, MAX_DIGITS, MIN_DIGITS};
pub use ff1::Ff1Permutation;
pub use format::{CodeError, CodeFormat, FormatError, PoolCodec};
