//! Key material: the service-wide master key and the per-pool keys derived from it (where the master key
//! comes from is configuration, `config::master_key`; this module depends on nothing else of the crate).
//!
//! This is the only module that reads or writes key files. Key bytes never leave it
//! except through [`MasterKey::to_hex`] (for `cifpool keygen` and the dev key file)
//! and through the crate-internal accessor the permutation uses to key AES.
//!
//! No key type implements `Display` or `Serialize`, and `Debug` is redacted,
//! so a key cannot end up in a log line or an API response by accident.

use std::fmt;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use hkdf::Hkdf;
use rand::TryRngCore;
use rand::rngs::OsRng;
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Length in bytes of both the master key and every pool key.
pub(crate) const KEY_LEN: usize = 32;

/// HKDF salt of pool keys; versioned so a future derivation scheme cannot collide with this one.
const POOL_KEY_SALT: &[u8] = b"cifpool/v1/pool-key";
/// HKDF salt of personal-data keys: another salt than the pools', so no pool key can equal one.
const PERSONAL_DATA_KEY_SALT: &[u8] = b"cifpool/v1/personal-data-key";

/// Errors from parsing or loading key material. Messages never contain key bytes.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The hex text (after trimming) was not exactly 64 characters.
    #[error("master key must be exactly 64 hex characters (32 bytes), found {found} characters")]
    HexLength {
        /// Number of characters found after trimming whitespace.
        found: usize,
    },
    /// The hex text had the right length but contained a non-hex character.
    #[error("master key contains a character that is not a hex digit (0-9, a-f, A-F)")]
    NotHex,
    /// The key file can be read (or changed) by others than this process's user and group.
    #[error(
        "key file {path} has mode {mode:04o}: {why}; run chmod 600 {path} (or 0440 with a group only this \
         service's user is in, as Kubernetes' fsGroup gives)",
        path = path.display()
    )]
    Exposed {
        /// The key file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// Which access is too wide.
        why: &'static str,
    },
    /// Reading or creating the key file failed.
    #[error("key file {path}: {source}")]
    Io {
        /// The key file involved.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },
}

/// Refuses a key file others could read: any access for "other", group write, or group read by a
/// group this process is not in. Group read by the process's own group is allowed, because that is how
/// Kubernetes hands a non-root container its secret (`fsGroup`, mode 0440, owner root).
fn check_file_access(path: &Path) -> Result<(), KeyError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|source| KeyError::Io { path: path.to_owned(), source })?;
    let mode = meta.mode() & 0o7777;
    let exposed = |why| Err(KeyError::Exposed { path: path.to_owned(), mode, why });
    if mode & 0o007 != 0 {
        return exposed("every user of the machine has access to it");
    }
    if mode & 0o020 != 0 {
        return exposed("its group may change it");
    }
    if mode & 0o040 != 0 && !process_in_group(meta.gid()) {
        return exposed("a group this service does not belong to may read it");
    }
    Ok(())
}

/// Whether `gid` is this process's effective group or one of its supplementary groups.
fn process_in_group(gid: u32) -> bool {
    // SAFETY: getegid cannot fail; getgroups writes at most `len` entries into a buffer of that size.
    if unsafe { libc::getegid() } == gid {
        return true;
    }
    let mut groups = vec![0 as libc::gid_t; 256];
    let n = unsafe { libc::getgroups(groups.len() as libc::c_int, groups.as_mut_ptr()) };
    n > 0 && groups[..n as usize].contains(&gid)
}

/// Overwrites key bytes in a way the optimiser may not elide, since the
/// buffer is dead right after and a plain write would be removed.
fn wipe(bytes: &mut [u8]) {
    for b in bytes.iter_mut() {
        // SAFETY: `b` is a valid, aligned, exclusive reference to a u8.
        unsafe { std::ptr::write_volatile(b, 0) };
    }
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
}

/// 32 bytes of key material: wiped when dropped, compared in constant time (so comparing keys leaks
/// nothing through timing). Every key type here wraps one, and prints as `Name([redacted])`
/// (`redacted_debug!`), the same with `{:#?}`.
#[derive(Clone)]
struct KeyBytes([u8; KEY_LEN]);

impl Drop for KeyBytes {
    fn drop(&mut self) {
        wipe(&mut self.0);
    }
}

impl PartialEq for KeyBytes {
    fn eq(&self, other: &Self) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl Eq for KeyBytes {}

/// `Debug` for a key type: its name and `[redacted]`, never a byte.
macro_rules! redacted_debug {
    ($($key:ident),*) => {$(
        impl fmt::Debug for $key {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(concat!(stringify!($key), "([redacted])"))
            }
        }
    )*};
}

redacted_debug!(MasterKey, PoolKey, PersonalDataKey);

/// The service-wide 32-byte secret from which every pool key is derived.
#[derive(Clone, PartialEq, Eq)]
pub struct MasterKey(KeyBytes);

impl MasterKey {
    /// Parses 64 hex characters (surrounding whitespace ignored); errors never echo the input.
    pub fn from_hex(text: &str) -> Result<MasterKey, KeyError> {
        let text = text.trim();
        // Count chars rather than bytes so a multi-byte character is reported sensibly.
        let found = text.chars().count();
        if found != 2 * KEY_LEN {
            return Err(KeyError::HexLength { found });
        }
        let mut bytes = [0u8; KEY_LEN];
        hex::decode_to_slice(text, &mut bytes).map_err(|_| KeyError::NotHex)?;
        Ok(MasterKey(KeyBytes(bytes)))
    }

    /// Wraps 32 raw bytes (e.g. the CLI's `--key-hex`, already decoded) as a master key.
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> MasterKey {
        MasterKey(KeyBytes(bytes))
    }

    /// Draws a fresh key from the operating system's CSPRNG.
    ///
    /// # Panics
    /// If the OS random source fails; there is no safe fallback for key material.
    pub fn generate() -> MasterKey {
        let mut bytes = [0u8; KEY_LEN];
        OsRng.try_fill_bytes(&mut bytes).expect("operating system random source failed while generating a master key");
        MasterKey(KeyBytes(bytes))
    }

    /// Lower-case hex encoding; only for `cifpool keygen` and writing the dev key file.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0.0)
    }

    /// Reads a key file holding 64 hex characters (a trailing newline is fine).
    pub fn load_file(path: impl AsRef<Path>) -> Result<MasterKey, KeyError> {
        let path = path.as_ref();
        check_file_access(path)?;
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::Io { path: path.to_owned(), source })?;
        MasterKey::from_hex(&text)
    }

    /// Generates a key and writes it to a new file with mode 0600; never overwrites.
    ///
    /// Fails with `ErrorKind::AlreadyExists` if the file exists, because silently
    /// replacing a key would re-map every code already issued under it.
    pub fn generate_into_file(path: impl AsRef<Path>) -> io::Result<MasterKey> {
        let key = MasterKey::generate();
        let mut file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(path.as_ref())?;
        let mut line = key.to_hex().into_bytes();
        line.push(b'\n');
        let written = file.write_all(&line).and_then(|()| file.sync_all());
        // Best effort: the hex copy is key material too.
        wipe(&mut line);
        written?;
        Ok(key)
    }

    /// Loads the dev key file, creating it (mode 0600) if absent; `true` means it was just generated.
    ///
    /// Meant for local development only; production should use [`MasterKey::load_file`]
    /// so that a missing key is an error rather than a brand-new key.
    pub fn load_or_generate_dev(path: impl AsRef<Path>) -> Result<(MasterKey, bool), KeyError> {
        let path = path.as_ref();
        match MasterKey::generate_into_file(path) {
            Ok(key) => Ok((key, true)),
            // Also covers a concurrent process having created it between our checks.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => MasterKey::load_file(path).map(|k| (k, false)),
            Err(source) => Err(KeyError::Io { path: path.to_owned(), source }),
        }
    }

    /// Derives the key of one pool via HKDF-SHA256; distinct (pool, key_id) pairs give independent keys.
    ///
    /// The info string length-prefixes both fields, so ("ab", "c") and ("a", "bc")
    /// cannot collide.
    pub fn derive_pool_key(&self, pool_name: &str, key_id: &str) -> PoolKey {
        PoolKey(KeyBytes(self.expand(POOL_KEY_SALT, &[pool_name, key_id])))
    }

    /// Derives the key that seals notification jobs' recipients and payloads under `key_id` (see
    /// `crate::queue::seal`): each id gives an independent key, so a new id starts a new key while
    /// rows sealed under earlier ids stay readable by whoever holds this master key.
    pub(crate) fn derive_personal_data_key(&self, key_id: &str) -> PersonalDataKey {
        PersonalDataKey(KeyBytes(self.expand(PERSONAL_DATA_KEY_SALT, &[key_id])))
    }

    /// HKDF-SHA256 of this key with `salt`, the info being each part length-prefixed.
    fn expand(&self, salt: &[u8], parts: &[&str]) -> [u8; KEY_LEN] {
        let mut info = Vec::with_capacity(parts.iter().map(|p| 4 + p.len()).sum());
        for part in parts {
            // u32 lengths: names longer than 4 GiB are not a realistic input.
            info.extend_from_slice(&(part.len() as u32).to_be_bytes());
            info.extend_from_slice(part.as_bytes());
        }
        let hk = Hkdf::<Sha256>::new(Some(salt), &self.0.0);
        let mut okm = [0u8; KEY_LEN];
        hk.expand(&info, &mut okm).expect("32 bytes is far below HKDF-SHA256's 8160-byte output limit");
        okm
    }
}

/// HMAC-SHA256 of `label` under `key`, first 16 bytes in hex: tells whether two instances hold the
/// same key without revealing it.
fn check_value_of(key: &[u8; KEY_LEN], label: &[u8]) -> String {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(label);
    mac.finalize().into_bytes()[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The 32-byte key of one pool; it keys the AES round function of that pool's permutation.
#[derive(Clone, PartialEq, Eq)]
pub struct PoolKey(KeyBytes);

impl PoolKey {
    /// Wraps raw bytes; normally pool keys come from [`MasterKey::derive_pool_key`].
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> PoolKey {
        PoolKey(KeyBytes(bytes))
    }

    /// Raw key bytes, kept crate-private so only the permutation can read them.
    pub(crate) fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.0.0
    }

    /// A key check value: HMAC-SHA256 of a fixed label under this key, first 16 bytes in hex. Stored
    /// with the pool, it tells whether an instance holds the key the pool was created with (a different
    /// master key or `key_id` gives another value) without revealing the key; the label keeps it apart
    /// from the permutation's own use of the key (AES).
    pub(crate) fn check_value(&self) -> String {
        check_value_of(&self.0.0, b"cifpool pool key check v1")
    }
}

/// The 32-byte key that seals notification jobs' personal data under one `personal_data_key_id`.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct PersonalDataKey(KeyBytes);

impl PersonalDataKey {
    /// Raw key bytes, kept crate-private so only the sealing code can read them.
    pub(crate) fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.0.0
    }

    /// A key check value (as [`PoolKey::check_value`], under its own label): recorded with the key id
    /// the first time it is used, it lets an instance started with another master key be refused
    /// before it seals a row the others cannot open.
    pub(crate) fn check_value(&self) -> String {
        check_value_of(&self.0.0, b"cifpool personal data key check v1")
    }
}
