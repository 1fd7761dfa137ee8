//! Pure code generation: keyed permutation of counters, check digits and the
//! string format of customer numbers. Nothing here does I/O.

pub mod check;
pub mod feistel;
pub mod format;

pub use check::{CheckScheme, UnknownCheckScheme};
pub use feistel::{DomainError, FeistelPermutation};
pub use format::{CodeError, CodeFormat, FormatError, PoolCodec};
