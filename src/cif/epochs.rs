//! Key epochs: the keys a pool has used, in order, and which counters each one turned into codes.
//!
//! A pool starts in epoch 0 under the key of its configured `key_id`. An operator who fears that key
//! is known outside starts a new epoch (`cifpool pools rotate-key`): from the pool's next counter on,
//! codes come from the new key. Counters stay one sequence across epochs (a row is still identified
//! by pool and counter): epoch `i` owns the counters from its `first_counter` up to the next
//! epoch's.
//!
//! Two keys are two unrelated permutations of the same code space, so the new key will sooner or later
//! turn one of its counters into a code an earlier epoch already made. Such a counter is skipped: no
//! code is made for it. Whether a code belongs to an earlier epoch needs no lookup: decrypt it under
//! that epoch's key, and it is that epoch's if the counter lands in that epoch's range (every counter
//! there was generated, or skipped for an even earlier epoch). The unique indexes on `code` remain
//! the backstop. The same rule reads a code back ([`KeyEpochs::locate`]): the oldest epoch that
//! claims it made it. Skipping costs code space in proportion to what earlier epochs used (after a
//! rotation at 10% of the domain, about one new counter in ten is skipped).

use crate::code::format::{CodeError, PoolCodec};

/// One key of a pool and the counters it encodes.
#[derive(Debug, Clone)]
pub struct KeyEpoch {
    /// 0 for the pool's configured key, then 1, 2, … for each rotation.
    pub number: i16,
    /// The label the key was derived with (epoch 0: the configured `key_id`).
    pub key_id: String,
    /// The first counter encoded under this key.
    pub first_counter: u64,
    /// The pool's format with this key's permutation.
    pub codec: PoolCodec,
}

/// The epochs of one pool, oldest first (never empty: epoch 0 is always there).
#[derive(Debug, Clone)]
pub struct KeyEpochs {
    epochs: Vec<KeyEpoch>,
}

/// Where a well-formed code comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Located {
    /// The epoch whose key made it.
    pub epoch: i16,
    /// Its counter.
    pub counter: u64,
}

impl KeyEpochs {
    /// The epochs `epochs`, which must start with epoch 0 at counter 0 and go up in both number and
    /// first counter.
    pub fn new(epochs: Vec<KeyEpoch>) -> KeyEpochs {
        assert!(epochs.first().is_some_and(|e| e.number == 0 && e.first_counter == 0), "epoch 0 starts at counter 0");
        assert!(
            epochs.windows(2).all(|w| w[1].number == w[0].number + 1 && w[1].first_counter >= w[0].first_counter),
            "epochs go up one at a time"
        );
        KeyEpochs { epochs }
    }

    /// The epoch new counters are encoded under.
    pub fn current(&self) -> &KeyEpoch {
        self.epochs.last().expect("never empty")
    }

    /// Every epoch, oldest first.
    pub fn all(&self) -> &[KeyEpoch] {
        &self.epochs
    }

    /// The code of `counter` under the epoch that owns it, or `None` when that code is an earlier
    /// epoch's (the counter is skipped). `counter` must be below the pool's capacity.
    pub fn encode(&self, counter: u64) -> Option<String> {
        let owner = self.epochs.iter().rposition(|e| e.first_counter <= counter).expect("epoch 0 starts at 0");
        let codec = &self.epochs[owner].codec;
        let value = codec.permutation().try_permute(counter).ok()?;
        if self.epochs[..owner].iter().enumerate().any(|(i, _)| self.claims(i, value).is_some()) {
            return None;
        }
        Some(codec.format().format(value))
    }

    /// The epoch and counter `code` was made from; `Ok(None)` for a well-formed code that no epoch
    /// makes (a counter of the current epoch it skips, or one it owns but has not reached yet are told
    /// apart by the caller's lookup, not here).
    pub fn locate(&self, code: &str) -> Result<Option<Located>, CodeError> {
        let value = self.epochs[0].codec.format().parse(code)?;
        Ok((0..self.epochs.len())
            .find_map(|i| self.claims(i, value).map(|counter| Located { epoch: self.epochs[i].number, counter })))
    }

    /// The counter epoch `i` turns into the permuted value `value`, if that counter is in its range.
    fn claims(&self, i: usize, value: u64) -> Option<u64> {
        let counter = self.epochs[i].codec.permutation().inverse(value)?;
        let end = self.epochs.get(i + 1).map_or(u64::MAX, |next| next.first_counter);
        (self.epochs[i].first_counter..end).contains(&counter).then_some(counter)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::code::{CheckScheme, Cipher, CodeFormat};
    use crate::keys::PoolKey;

    fn epoch(number: i16, first_counter: u64, cipher: Cipher) -> KeyEpoch {
        let format = CodeFormat::new("7", 6, CheckScheme::Damm).unwrap();
        let key = PoolKey::from_bytes([number as u8 + 1; 32]);
        KeyEpoch {
            number,
            key_id: format!("k{number}"),
            first_counter,
            codec: PoolCodec::with_cipher(format, cipher, &key, "pool").unwrap(),
        }
    }

    #[test]
    fn a_single_epoch_encodes_as_its_codec_and_locates_every_code() {
        let keys = KeyEpochs::new(vec![epoch(0, 0, Cipher::Feistel)]);
        for counter in [0, 1, 999_999] {
            let code = keys.encode(counter).unwrap();
            assert_eq!(code, keys.current().codec.encode(counter));
            assert_eq!(keys.locate(&code).unwrap(), Some(Located { epoch: 0, counter }));
        }
    }

    /// Three epochs over the whole 10^6 domain of a 6-digit pool: 300,000 counters under the first
    /// key, 300,000 under the second, the rest under the third. The later keys meet codes of the
    /// earlier ones often (30% of the space is the first epoch's when the second starts); each such
    /// counter is skipped, no code is made twice, and every code made is located at its epoch and
    /// counter. (The rule does not depend on the cipher; FF1 pools go through it in the integration
    /// tests, where a whole domain would be slow.)
    #[test]
    fn rotated_keys_skip_the_codes_of_earlier_epochs_and_never_repeat_one() {
        {
            let cipher = Cipher::Feistel;
            let keys = KeyEpochs::new(vec![epoch(0, 0, cipher), epoch(1, 300_000, cipher), epoch(2, 600_000, cipher)]);
            let mut seen = HashSet::with_capacity(1_000_000);
            let mut skipped = [0u64; 3];
            for counter in 0..1_000_000u64 {
                let owner = if counter < 300_000 {
                    0
                } else if counter < 600_000 {
                    1
                } else {
                    2
                };
                match keys.encode(counter) {
                    Some(code) => {
                        assert_eq!(keys.locate(&code).unwrap(), Some(Located { epoch: owner, counter }));
                        assert!(seen.insert(code), "{cipher}: a code made twice");
                    }
                    None => skipped[owner as usize] += 1,
                }
            }
            assert_eq!(skipped[0], 0, "{cipher}: the first epoch has nothing to skip");
            // About 30% of the second epoch's counters meet the first's codes; the first two epochs
            // claim 1 - 0.7 * 0.7 = 51% of the space, so about 204,000 of the third's 400,000 meet one.
            assert!((85_000..95_000).contains(&skipped[1]), "{cipher}: {skipped:?}");
            assert!((195_000..215_000).contains(&skipped[2]), "{cipher}: {skipped:?}");
            assert_eq!(seen.len() as u64 + skipped.iter().sum::<u64>(), 1_000_000);
        }
    }
}
