//! `cifpool codes gen`, `codes inspect` and `keygen` as ops run them.

use std::io::Write;
use std::process::{Command, Output};

use crate::common::assert_cli_error;

const KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

fn cifpool(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cifpool"));
    for (k, _) in std::env::vars() {
        if k.starts_with("CIFPOOL_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(args).output().unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn gen_then_inspect_round_trips() {
    let flags = ["--digits", "10", "--prefix", "77", "--check", "mod97", "--key-hex", KEY, "--pool", "retail"];
    let codes = stdout(&cifpool(&[&["codes", "gen", "--start", "1000", "--count", "25"][..], &flags].concat()));
    let codes: Vec<&str> = codes.lines().collect();
    assert_eq!(codes.len(), 25);
    for (i, code) in codes.iter().enumerate() {
        assert_eq!(code.len(), 2 + 10 + 2, "{code}");
        assert!(code.starts_with("77"));
        let counter = stdout(&cifpool(&[&["codes", "inspect"][..], &flags, &[code]].concat()));
        assert_eq!(counter.trim(), (1000 + i).to_string());
    }
}

#[test]
fn inspect_explains_malformed_codes() {
    let flags = ["--digits", "9", "--prefix", "1", "--key-hex", KEY];
    let code = stdout(&cifpool(&[&["codes", "gen", "--count", "1"][..], &flags].concat())).trim().to_string();
    let mut typo = code.clone().into_bytes();
    typo[4] = if typo[4] == b'0' { b'1' } else { b'0' };
    let typo = String::from_utf8(typo).unwrap();
    for (bad, expect) in [
        (typo.as_str(), "check digit"),
        ("12345", "must be 11 characters"),
        ("1234567890x", "not a digit"),
        ("91234567890", "prefix 1"),
    ] {
        let out = cifpool(&[&["codes", "inspect"][..], &flags, &[bad]].concat());
        assert_cli_error(&out, expect);
    }
}

#[test]
fn gen_refuses_a_domain_overflow_and_bad_keys() {
    let out = cifpool(&["codes", "gen", "--digits", "6", "--key-hex", KEY, "--start", "999999", "--count", "2"]);
    assert_cli_error(&out, "exceed the domain of 1000000 codes");
    let out = cifpool(&["codes", "gen", "--digits", "6", "--key-hex", "abcd", "--count", "1"]);
    assert_cli_error(&out, "--key-hex: master key must be exactly 64 hex characters");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("abcd"), "never echoes key material: {err}");
    // 10^5 is below the smallest domain the permutation supports.
    let out = cifpool(&["codes", "gen", "--digits", "5", "--key-hex", KEY, "--count", "1"]);
    assert_cli_error(&out, "digit count 5 is not supported");
}

#[test]
fn pool_from_config_matches_explicit_flags() {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    write!(
        f,
        "[[pools]]\nname = \"sme\"\nprefix = \"4\"\ndigits = 8\ncheck = \"luhn\"\ncipher = \"feistel\"\nkey_id = \"2027\"\n\
         low_watermark = 10\n\
         batch_size = 10\nmax_batches_per_run = 1\nlease_ttl = \"1m\"\nrefill_schedule = \"*/15 * * * * *\"\n\
         reclaim_schedule = \"*/30 * * * * *\"\n"
    )
    .unwrap();
    let config = f.path().to_str().unwrap();
    let via_pool =
        stdout(&cifpool(&["--config", config, "codes", "gen", "--pool", "sme", "--key-hex", KEY, "--count", "5"]));
    let via_flags = stdout(&cifpool(&[
        "codes",
        "gen",
        "--pool",
        "sme",
        "--key-hex",
        KEY,
        "--digits",
        "8",
        "--prefix",
        "4",
        "--check",
        "luhn",
        "--key-id",
        "2027",
        "--count",
        "5",
    ]));
    assert_eq!(via_pool, via_flags);
    let other_key_id = stdout(&cifpool(&[
        "--config",
        config,
        "codes",
        "gen",
        "--pool",
        "sme",
        "--key-hex",
        KEY,
        "--key-id",
        "2028",
        "--count",
        "5",
    ]));
    assert_ne!(via_pool, other_key_id, "the key id re-keys the pool");
}

#[test]
fn ff1_codes_and_later_key_epochs_round_trip_through_gen_and_inspect() {
    let flags = ["--digits", "6", "--prefix", "9", "--key-hex", KEY, "--pool", "retail", "--cipher", "ff1"];
    let ff1 = stdout(&cifpool(&[&["codes", "gen", "--count", "20"][..], &flags].concat()));
    let feistel = stdout(&cifpool(&[&["codes", "gen", "--count", "20"][..], &flags[..8]].concat()));
    assert_ne!(ff1, feistel, "--cipher picks the permutation; without it, the Feistel one");
    for (counter, code) in ff1.lines().enumerate() {
        let out = stdout(&cifpool(&[&["codes", "inspect"][..], &flags, &[code]].concat()));
        assert_eq!(out.trim(), counter.to_string());
    }
    // A second key epoch from counter 10: counters 10.. come from key "r2", skipping any code the
    // first key made for counters 0..10, and inspect names the epoch.
    let epoch = [&flags[..], &["--epoch", "r2@10"]].concat();
    let rotated = stdout(&cifpool(&[&["codes", "gen", "--count", "20"][..], &epoch].concat()));
    let rotated: Vec<&str> = rotated.lines().collect();
    assert_eq!(rotated[..10], ff1.lines().take(10).collect::<Vec<_>>()[..], "epoch 0 keeps its codes");
    assert!(rotated[10..].iter().all(|c| !ff1.lines().take(10).any(|old| old == *c)));
    let out = cifpool(&[&["codes", "inspect"][..], &epoch, &[rotated[10]]].concat());
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "10");
    assert!(String::from_utf8_lossy(&out.stderr).contains("key epoch 1 (key_id r2)"));
}

#[test]
fn keygen_prints_fresh_256_bit_keys() {
    let a = stdout(&cifpool(&["keygen"]));
    let b = stdout(&cifpool(&["keygen"]));
    assert_eq!(a.trim().len(), 64);
    assert!(a.trim().chars().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, b);
    // It reads no configuration: the bare image (CIFPOOL_CONFIG naming a file that is not there) runs it.
    let bare = Command::new(env!("CARGO_BIN_EXE_cifpool"))
        .arg("keygen")
        .env("CIFPOOL_CONFIG", "/nonexistent/cifpool.toml")
        .output()
        .unwrap();
    assert_eq!(stdout(&bare).trim().len(), 64);
}

#[test]
fn the_key_can_come_from_standard_input_instead_of_the_command_line() {
    let flags = ["--digits", "9", "--prefix", "1", "--start", "7", "--count", "3"];
    let by_flag = stdout(&cifpool(&[&["codes", "gen", "--key-hex", KEY][..], &flags].concat()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_cifpool"))
        .args([&["codes", "gen", "--key-stdin"][..], &flags].concat())
        .env_remove("CIFPOOL_MASTER_KEY")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(format!("{KEY}\n").as_bytes()).unwrap();
    let by_stdin = stdout(&child.wait_with_output().unwrap());
    assert_eq!(by_stdin, by_flag);
    let help = String::from_utf8(cifpool(&["codes", "gen", "--help"]).stdout).unwrap();
    assert!(help.contains("--key-stdin") && help.contains("CIFPOOL_MASTER_KEY"), "{help}");
    let both = cifpool(&[&["codes", "gen", "--key-stdin", "--key-hex", KEY][..], &flags].concat());
    // One key source at a time: a usage error from the argument parser (exit 2).
    assert_eq!(both.status.code(), Some(2), "{}", String::from_utf8_lossy(&both.stderr));
    assert!(String::from_utf8_lossy(&both.stderr).contains("cannot be used with"));
}
