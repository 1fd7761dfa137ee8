//! Pure code generation: keyed permutations of counters (NIST FF1, or the house Feistel network), check digits and the
//! string format of customer numbers. Nothing here does I/O.

pub mod check;
pub mod cipher;
pub mod feistel;
pub mod ff1;
pub mod format;

pub use check::{CheckScheme, UnknownCheckScheme};
pub use cipher::{Cipher, Permutation};
pub use feistel::{DomainError, FeistelPermutation};
pub use ff1::Ff1Permutation;
pub use format::{CodeError, CodeFormat, FormatError, PoolCodec};
