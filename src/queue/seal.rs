//! Personal data sealed before it reaches Postgres. A job's recipient and payload are encrypted by the
//! service at intake (one request or a batch's `COPY` alike) and opened by the worker after its claim,
//! so the table, its WAL, replicas and backups hold ciphertext only; the `recipient` column holds the
//! masked form support recognises a job by.
//!
//! The cipher is XChaCha20-Poly1305: its 192-bit nonces may be drawn at random for every row without a
//! limit on how many rows one key seals (a 96-bit random nonce, as AES-GCM has, would cap a key at about
//! four billion rows: under two days at 30,000 jobs a second). The key is derived from the master key and the
//! configured `security.personal_data_key_id`, which every sealed row names (`sealed_with`): a new id
//! starts a new key for new rows while rows sealed under earlier ids stay readable. The key id is the
//! associated data, so a row relabelled with another id fails to open instead of opening wrongly.
//!
//! Sealed form: `0x01 ‖ nonce (24) ‖ ciphertext ‖ tag (16)`, the plaintext being the recipient's
//! length (4 bytes, big-endian), the recipient and the payload's JSON text.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{Tag, XChaCha20Poly1305, XNonce};
use rand::RngCore;
use sqlx::PgPool;

use crate::keys::MasterKey;

/// First byte of every sealed value: the layout above.
const VERSION: u8 = 1;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;
const HEADER_LEN: usize = 1 + NONCE_LEN;

/// Why a sealed value could not be opened. Messages name the key id, never the data.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Shorter than a header and a tag, or of an unknown layout.
    #[error("sealed personal data of an unknown layout (version {0})")]
    Layout(u8),
    /// The tag does not match: another key than the one `key_id` derives, or a changed value.
    #[error("sealed personal data does not open under key id {0:?} (changed, or sealed under another master key)")]
    Forged(String),
    /// It opened, but what was inside is not a recipient and a JSON text.
    #[error("sealed personal data opened to something that is not a recipient and a payload")]
    Malformed,
}

/// A job's recipient and payload as they were enqueued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    /// Phone number, device token, …
    pub recipient: String,
    /// The payload's JSON text.
    pub payload: String,
}

/// What intake stores for one job's recipient and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored<'a> {
    /// Sealing is off: both in clear, in `recipient` and `payload`.
    Clear {
        /// The recipient as enqueued.
        recipient: &'a str,
        /// The payload's JSON text.
        payload: &'a str,
    },
    /// Both sealed into `sealed` (under the seal's [`Seal::key_id`], stored as `sealed_with`), the
    /// recipient masked in `recipient`, `payload` NULL.
    Sealed {
        /// The recipient as support sees it.
        masked: String,
        /// Recipient and payload, sealed.
        sealed: Vec<u8>,
    },
}

impl Stored<'_> {
    /// The `recipient` column.
    pub fn recipient(&self) -> &str {
        match self {
            Stored::Clear { recipient, .. } => recipient,
            Stored::Sealed { masked, .. } => masked,
        }
    }

    /// The `payload` column (JSON text), NULL when sealed.
    pub fn payload(&self) -> Option<&str> {
        match self {
            Stored::Clear { payload, .. } => Some(payload),
            Stored::Sealed { .. } => None,
        }
    }

    /// The `sealed` column, NULL in clear.
    pub fn sealed(&self) -> Option<&[u8]> {
        match self {
            Stored::Clear { .. } => None,
            Stored::Sealed { sealed, .. } => Some(sealed),
        }
    }
}

/// Seals and opens personal data for one instance: the current key id's cipher for new rows, and the
/// ciphers of earlier key ids as rows sealed under them are met.
pub struct Seal {
    master: MasterKey,
    key_id: String,
    current: Arc<XChaCha20Poly1305>,
    check_value: String,
    seal_new: bool,
    earlier: RwLock<HashMap<String, Arc<XChaCha20Poly1305>>>,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seal").field("key_id", &self.key_id).field("seal_new", &self.seal_new).finish_non_exhaustive()
    }
}

impl Seal {
    /// Seals new rows under `key_id` (derived from `master`), or, with `seal_new` off, stores them in
    /// clear (rows sealed before are opened either way).
    pub fn new(master: &MasterKey, key_id: &str, seal_new: bool) -> Seal {
        let key = master.derive_personal_data_key(key_id);
        Seal {
            master: master.clone(),
            key_id: key_id.to_string(),
            current: Arc::new(XChaCha20Poly1305::new(key.as_bytes().into())),
            check_value: key.check_value(),
            seal_new,
            earlier: RwLock::default(),
        }
    }

    /// The seal of `[security]`: its `personal_data_key_id` and `seal_personal_data`.
    pub(crate) fn from_settings(master: &MasterKey, security: &crate::config::SecuritySettings) -> Seal {
        Seal::new(master, &security.personal_data_key_id, security.seal_personal_data)
    }

    /// The key id new rows are sealed under.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The columns intake writes for `recipient` and `payload` (JSON text).
    pub fn store<'a>(&self, recipient: &'a str, payload: &'a str) -> Stored<'a> {
        if !self.seal_new {
            return Stored::Clear { recipient, payload };
        }
        Stored::Sealed { masked: crate::queue::privacy::masked(recipient), sealed: self.seal(recipient, payload) }
    }

    /// `recipient` and `payload` sealed under the current key id, with a fresh random nonce.
    pub fn seal(&self, recipient: &str, payload: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + 4 + recipient.len() + payload.len() + TAG_LEN);
        out.push(VERSION);
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&(recipient.len() as u32).to_be_bytes());
        out.extend_from_slice(recipient.as_bytes());
        out.extend_from_slice(payload.as_bytes());
        let tag = self
            .current
            .encrypt_in_place_detached(XNonce::from_slice(&nonce), self.key_id.as_bytes(), &mut out[HEADER_LEN..])
            .expect("XChaCha20-Poly1305 seals any message shorter than 256 GiB");
        out.extend_from_slice(&tag);
        out
    }

    /// Opens a value sealed under `key_id` (this instance's or an earlier one).
    pub fn open(&self, key_id: &str, sealed: &[u8]) -> Result<Opened, OpenError> {
        let Some((&version, rest)) = sealed.split_first() else { return Err(OpenError::Layout(0)) };
        if version != VERSION || rest.len() < NONCE_LEN + TAG_LEN {
            return Err(OpenError::Layout(version));
        }
        let (nonce, rest) = rest.split_at(NONCE_LEN);
        let (body, tag) = rest.split_at(rest.len() - TAG_LEN);
        let mut plain = body.to_vec();
        self.cipher(key_id)
            .decrypt_in_place_detached(XNonce::from_slice(nonce), key_id.as_bytes(), &mut plain, Tag::from_slice(tag))
            .map_err(|_| OpenError::Forged(key_id.to_string()))?;
        let (len, rest) = plain.split_first_chunk::<4>().ok_or(OpenError::Malformed)?;
        let len = u32::from_be_bytes(*len) as usize;
        if len > rest.len() {
            return Err(OpenError::Malformed);
        }
        let (recipient, payload) = rest.split_at(len);
        Ok(Opened {
            recipient: String::from_utf8(recipient.to_vec()).map_err(|_| OpenError::Malformed)?,
            payload: String::from_utf8(payload.to_vec()).map_err(|_| OpenError::Malformed)?,
        })
    }

    fn cipher(&self, key_id: &str) -> Arc<XChaCha20Poly1305> {
        if key_id == self.key_id {
            return self.current.clone();
        }
        if let Some(found) = self.earlier.read().expect("seal cache lock").get(key_id) {
            return found.clone();
        }
        let key = self.master.derive_personal_data_key(key_id);
        let cipher = Arc::new(XChaCha20Poly1305::new(key.as_bytes().into()));
        self.earlier.write().expect("seal cache lock").insert(key_id.to_string(), cipher.clone());
        cipher
    }

    /// Records this instance's key id with its check value the first time any instance uses it, and
    /// refuses to go on when it was recorded under another master key: rows this instance sealed
    /// could not be opened by the others, nor theirs by it.
    pub async fn register(&self, db: &PgPool) -> anyhow::Result<()> {
        let recorded: String = sqlx::query_scalar(
            "WITH new AS (INSERT INTO personal_data_keys (key_id, check_value) VALUES ($1, $2) \
                          ON CONFLICT (key_id) DO NOTHING RETURNING check_value) \
             SELECT check_value FROM new UNION ALL SELECT check_value FROM personal_data_keys WHERE key_id = $1 \
             LIMIT 1",
        )
        .bind(&self.key_id)
        .bind(&self.check_value)
        .fetch_one(db)
        .await?;
        anyhow::ensure!(
            recorded == self.check_value,
            "security.personal_data_key_id {:?} was first used with another master key (its check value \
             differs): is CIFPOOL_MASTER_KEY / security.master_key_file the key the other instances use?",
            self.key_id
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{OpenError, Seal};
    use crate::keys::MasterKey;

    fn seal(key_id: &str) -> Seal {
        Seal::new(&MasterKey::from_bytes([7; 32]), key_id, true)
    }

    #[test]
    fn what_is_sealed_opens_to_the_same_recipient_and_payload() {
        let s = seal("k1");
        for (recipient, payload) in [("+84901234567", r#"{"code":"918273"}"#), ("", "null"), ("dévice-ü", "[]")] {
            let sealed = s.seal(recipient, payload);
            assert_eq!(sealed.len(), 1 + 24 + 4 + recipient.len() + payload.len() + 16);
            let opened = s.open("k1", &sealed).unwrap();
            assert_eq!((opened.recipient.as_str(), opened.payload.as_str()), (recipient, payload));
        }
    }

    #[test]
    fn the_same_data_seals_differently_each_time_and_shows_nothing_of_itself() {
        let s = seal("k1");
        let (a, b) = (s.seal("+84901234567", r#"{"code":"918273"}"#), s.seal("+84901234567", r#"{"code":"918273"}"#));
        assert_ne!(a, b);
        for sealed in [&a, &b] {
            assert!(!sealed.windows(6).any(|w| w == b"918273" || w == b"901234"));
        }
    }

    #[test]
    fn rows_of_an_earlier_key_id_open_after_a_rotation_and_a_relabelled_row_does_not() {
        let master = MasterKey::from_bytes([7; 32]);
        let old = Seal::new(&master, "2026-01", true).seal("+84901234567", "{}");
        let rotated = Seal::new(&master, "2026-12", true);
        assert_eq!(rotated.open("2026-01", &old).unwrap().recipient, "+84901234567");
        assert!(matches!(rotated.open("2026-12", &old), Err(OpenError::Forged(_))));
        let other_master = Seal::new(&MasterKey::from_bytes([8; 32]), "2026-01", true);
        assert!(matches!(other_master.open("2026-01", &old), Err(OpenError::Forged(_))));
    }

    #[test]
    fn a_changed_or_cut_value_is_refused() {
        let s = seal("k1");
        let sealed = s.seal("+84901234567", r#"{"code":"918273"}"#);
        for i in [0, 1, 30, sealed.len() - 1] {
            let mut changed = sealed.clone();
            changed[i] ^= 1;
            assert!(s.open("k1", &changed).is_err(), "byte {i} flipped");
        }
        assert!(s.open("k1", &sealed[..20]).is_err());
        assert!(s.open("k1", &[]).is_err());
    }

    #[test]
    fn with_sealing_off_intake_stores_the_data_in_clear() {
        let s = Seal::new(&MasterKey::from_bytes([7; 32]), "k1", false);
        let stored = s.store("+84901234567", "{}");
        assert_eq!((stored.recipient(), stored.payload(), stored.sealed()), ("+84901234567", Some("{}"), None));
        let sealing = seal("k1");
        let stored = sealing.store("+84901234567", "{}");
        assert_eq!((stored.recipient(), stored.payload(), stored.sealed().is_some()), ("********4567", None, true));
    }
}
