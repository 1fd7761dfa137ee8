//! What an API key may do. Each route needs exactly one scope; a key holds any set of them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One permission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Scope {
    /// Reserve, confirm, release and extend CIF codes.
    #[serde(rename = "cif:reserve")]
    CifReserve,
    /// Look up a code (`GET /v1/cif/{cif}`) and read pool depth (`GET /v1/pools`).
    #[serde(rename = "cif:read")]
    CifRead,
    /// Enqueue notifications, one or a batch.
    #[serde(rename = "notify:send")]
    NotifySend,
    /// Read a notification's status.
    #[serde(rename = "notify:read")]
    NotifyRead,
    /// Everything under `/admin`: refill, reclaim, dead letters, keys, the audit trail.
    #[serde(rename = "admin")]
    Admin,
}

impl Scope {
    /// Every scope (what the development key gets).
    pub const ALL: [Scope; 5] = [Scope::CifReserve, Scope::CifRead, Scope::NotifySend, Scope::NotifyRead, Scope::Admin];

    /// The name used in the API, the database and error messages, e.g. `cif:reserve`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Scope::CifReserve => "cif:reserve",
            Scope::CifRead => "cif:read",
            Scope::NotifySend => "notify:send",
            Scope::NotifyRead => "notify:read",
            Scope::Admin => "admin",
        }
    }

    /// Parses a scope name.
    pub fn parse(text: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.as_str() == text)
    }

    const fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A set of scopes, one bit each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScopeSet(u8);

impl ScopeSet {
    /// Whether `scope` is in the set.
    pub fn contains(self, scope: Scope) -> bool {
        self.0 & scope.bit() != 0
    }

    /// The scopes in the set, in [`Scope::ALL`] order.
    pub fn to_vec(self) -> Vec<Scope> {
        Scope::ALL.into_iter().filter(|s| self.contains(*s)).collect()
    }
}

impl FromIterator<Scope> for ScopeSet {
    fn from_iter<I: IntoIterator<Item = Scope>>(iter: I) -> Self {
        ScopeSet(iter.into_iter().fold(0, |bits, s| bits | s.bit()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sets_hold_what_was_put_in() {
        for s in Scope::ALL {
            assert_eq!(Scope::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        assert_eq!(Scope::parse("cif:write"), None);
        let set: ScopeSet = [Scope::CifRead, Scope::Admin].into_iter().collect();
        assert!(set.contains(Scope::Admin) && set.contains(Scope::CifRead) && !set.contains(Scope::CifReserve));
        assert_eq!(set.to_vec(), [Scope::CifRead, Scope::Admin]);
    }
}
