//! Key parsing, redaction, file handling and derivation.

use std::os::unix::fs::PermissionsExt;

use cifpool::keys::{KeyError, MasterKey, PoolKey};

const HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

fn key_bytes() -> [u8; 32] {
    std::array::from_fn(|i| i as u8)
}

#[test]
fn from_hex_accepts_64_hex_chars_with_whitespace() {
    let key = MasterKey::from_hex(HEX).unwrap();
    assert_eq!(key.to_hex(), HEX);
    assert_eq!(key, MasterKey::from_bytes(key_bytes()));
    assert_eq!(MasterKey::from_hex(&format!("  {HEX}\n")).unwrap(), key);
    assert_eq!(MasterKey::from_hex(&HEX.to_uppercase()).unwrap(), key);
}

#[test]
fn from_hex_errors_do_not_echo_the_input() {
    let secretish = "deadbeefcafebabe";
    let cases = [
        (secretish.to_string(), "found 16 characters"),
        (format!("{HEX}00"), "found 66 characters"),
        (String::new(), "found 0 characters"),
        (format!("{}zz", &HEX[..62]), "not a hex digit"),
        (format!("{}é", &HEX[..63]), "not a hex digit"),
    ];
    for (input, expected) in cases {
        let err = MasterKey::from_hex(&input).unwrap_err();
        let message = err.to_string();
        assert!(message.contains(expected), "{message}");
        assert!(!message.contains(secretish), "{message}");
        assert!(!message.contains(&HEX[..16]), "{message}");
        let debug = format!("{err:?}");
        assert!(!debug.contains(secretish) && !debug.contains(&HEX[..16]), "{debug}");
    }
    assert!(matches!(MasterKey::from_hex("abc"), Err(KeyError::HexLength { found: 3 })));
    assert!(matches!(MasterKey::from_hex(&format!("{}g", &HEX[..63])), Err(KeyError::NotHex)));
}

#[test]
fn debug_is_redacted() {
    let master = MasterKey::from_hex(HEX).unwrap();
    let pool = PoolKey::from_bytes(key_bytes());
    for text in [format!("{master:?}"), format!("{master:#?}")] {
        assert_eq!(text, "MasterKey([redacted])");
    }
    assert_eq!(format!("{pool:?}"), "PoolKey([redacted])");
    // No fragment of the key, in hex or as a decimal byte list, leaks.
    for text in [format!("{master:?}"), format!("{pool:?}")] {
        assert!(!text.contains("0001020304"));
        assert!(!text.contains("0, 1, 2"));
    }
}

#[test]
fn generated_keys_differ() {
    assert_ne!(MasterKey::generate(), MasterKey::generate());
    assert_eq!(MasterKey::generate().to_hex().len(), 64);
}

#[test]
fn derivation_is_deterministic_and_separates_inputs() {
    let master = MasterKey::from_hex(HEX).unwrap();
    let k = master.derive_pool_key("retail", "k1");
    assert_eq!(k, master.derive_pool_key("retail", "k1"));
    assert_ne!(k, master.derive_pool_key("retail", "k2"));
    assert_ne!(k, master.derive_pool_key("corporate", "k1"));
    // Length prefixes keep the (pool, key_id) boundary unambiguous.
    assert_ne!(master.derive_pool_key("ab", "c"), master.derive_pool_key("a", "bc"));
    assert_ne!(master.derive_pool_key("", "x"), master.derive_pool_key("x", ""));
    let other = MasterKey::from_bytes([0xff; 32]);
    assert_ne!(k, other.derive_pool_key("retail", "k1"));
    // The pool key is not the master key itself.
    assert_ne!(k, PoolKey::from_bytes(key_bytes()));
}

#[test]
fn generate_into_file_uses_mode_0600_and_never_overwrites() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("master.key");
    let key = MasterKey::generate_into_file(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{}\n", key.to_hex()));
    assert_eq!(MasterKey::load_file(&path).unwrap(), key);

    let err = MasterKey::generate_into_file(&path).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
    assert_eq!(MasterKey::load_file(&path).unwrap(), key, "file was overwritten");
}

#[test]
fn load_or_generate_dev_generates_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev.key");
    let (first, generated) = MasterKey::load_or_generate_dev(&path).unwrap();
    assert!(generated);
    let (second, generated) = MasterKey::load_or_generate_dev(&path).unwrap();
    assert!(!generated);
    assert_eq!(first, second);
}

#[test]
fn load_file_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.key");
    let err = MasterKey::load_file(&missing).unwrap_err();
    assert!(matches!(err, KeyError::Io { .. }));
    assert!(err.to_string().contains("absent.key"), "{err}");

    let bad = dir.path().join("bad.key");
    std::fs::write(&bad, "not a key at all\n").unwrap();
    std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o600)).unwrap();
    let err = MasterKey::load_file(&bad).unwrap_err();
    assert!(matches!(err, KeyError::HexLength { found: 16 }));
    assert!(!err.to_string().contains("not a key"), "{err}");

    // A corrupt dev key is an error, not a silent regeneration.
    assert!(MasterKey::load_or_generate_dev(&bad).is_err());
    assert_eq!(std::fs::read_to_string(&bad).unwrap(), "not a key at all\n");

    let err = MasterKey::load_or_generate_dev(dir.path().join("no/such/dir/k")).unwrap_err();
    assert!(matches!(err, KeyError::Io { .. }));
}

#[test]
fn a_key_file_others_can_read_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("master.key");
    let key = MasterKey::generate_into_file(&path).unwrap();
    let chmod = |mode| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    for (mode, why) in [(0o644, "every user"), (0o604, "every user"), (0o620, "may change it")] {
        chmod(mode);
        let err = MasterKey::load_file(&path).unwrap_err();
        assert!(matches!(err, KeyError::Exposed { .. }), "{mode:o}: {err}");
        let text = err.to_string();
        assert!(text.contains(why) && text.contains("chmod 600"), "{text}");
        assert!(!text.contains(&key.to_hex()), "never the key itself");
    }
    // Readable by this process's own group: how Kubernetes mounts a secret for a non-root user.
    chmod(0o440);
    assert_eq!(MasterKey::load_file(&path).unwrap(), key);
    chmod(0o600);
    assert_eq!(MasterKey::load_file(&path).unwrap(), key);
    // Group-readable by a group this process is not in (only root can hand the file to it).
    if unsafe { libc::geteuid() } == 0 {
        let foreign: u32 = 54_321;
        std::os::unix::fs::chown(&path, None, Some(foreign)).unwrap();
        chmod(0o640);
        let err = MasterKey::load_file(&path).unwrap_err();
        assert!(err.to_string().contains("does not belong to"), "{err}");
    }
}
