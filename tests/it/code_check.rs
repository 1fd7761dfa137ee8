//! Error-detection guarantees of the check-digit schemes and the parser's error reporting.

use cifpool::code::{CheckScheme, CodeError, CodeFormat, FormatError, PoolCodec};
use cifpool::keys::MasterKey;
use serde::Deserialize;
use serde::de::IntoDeserializer;
use serde::de::value::{Error as DeError, StrDeserializer};

/// 2,000 realistic codes: what the service would actually issue for one pool.
fn sample_codes(check: CheckScheme) -> (PoolCodec, Vec<String>) {
    let key = MasterKey::from_bytes([42; 32]).derive_pool_key("check-test", "k1");
    let codec = PoolCodec::new(CodeFormat::new("73", 10, check).unwrap(), &key).unwrap();
    let codes = (0..2_000).map(|c| codec.encode(c * 7_919)).collect();
    (codec, codes)
}

fn substitutions(code: &str) -> impl Iterator<Item = String> + '_ {
    (0..code.len()).flat_map(move |i| {
        (b'0'..=b'9').filter(move |&d| d != code.as_bytes()[i]).map(move |d| {
            let mut b = code.as_bytes().to_vec();
            b[i] = d;
            String::from_utf8(b).unwrap()
        })
    })
}

/// Adjacent transpositions of distinct digits, with the swapped pair.
fn transpositions(code: &str) -> impl Iterator<Item = (String, [u8; 2])> + '_ {
    let b = code.as_bytes();
    (0..b.len() - 1).filter(move |&i| b[i] != b[i + 1]).map(move |i| {
        let mut t = b.to_vec();
        t.swap(i, i + 1);
        (String::from_utf8(t).unwrap(), [b[i], b[i + 1]])
    })
}

#[test]
fn damm_and_mod97_catch_all_single_errors_and_adjacent_transpositions() {
    for check in [CheckScheme::Damm, CheckScheme::Mod97] {
        let (codec, codes) = sample_codes(check);
        for code in &codes {
            assert!(check.verify(code));
            for bad in substitutions(code) {
                assert!(!check.verify(&bad), "{check}: {code} -> {bad} undetected");
                // With the prefix intact the parser blames the check digit.
                if bad.starts_with("73") {
                    assert_eq!(codec.decode(&bad), Err(CodeError::CheckDigit));
                }
            }
            for (bad, _) in transpositions(code) {
                assert!(!check.verify(&bad), "{check}: {code} -> {bad} undetected");
                assert!(codec.decode(&bad).is_err());
            }
        }
    }
}

#[test]
fn luhn_catches_substitutions_and_all_transpositions_but_09_90() {
    let (_, codes) = sample_codes(CheckScheme::Luhn);
    let mut missed_09 = 0;
    for code in &codes {
        for bad in substitutions(code) {
            assert!(!CheckScheme::Luhn.verify(&bad), "{code} -> {bad} undetected");
        }
        for (bad, pair) in transpositions(code) {
            if CheckScheme::Luhn.verify(&bad) {
                assert!(pair == *b"09" || pair == *b"90", "{code} -> {bad} undetected");
                missed_09 += 1;
            } else {
                assert!(pair != *b"09" && pair != *b"90", "{code} -> {bad} detected");
            }
        }
    }
    assert!(missed_09 > 0, "the sample should contain a 09/90 pair");
    // The documented blind spot, spelled out: 1090x and 1900x share a check digit.
    let a = format!("1090{}", CheckScheme::Luhn.compute("1090"));
    let b = format!("1900{}", &a[4..]);
    assert!(CheckScheme::Luhn.verify(&b));
}

#[test]
fn known_check_digits() {
    // Published examples: Damm's 572 -> 4, Luhn's 7992739871 -> 3, and the
    // ISO 7064 MOD 97-10 digits of IBAN GB82WEST12345698765432.
    assert_eq!(CheckScheme::Damm.compute("572"), "4");
    assert!(CheckScheme::Damm.verify("5724"));
    assert_eq!(CheckScheme::Luhn.compute("7992739871"), "3");
    assert!(CheckScheme::Luhn.verify("79927398713"));
    // IBAN GB82 WEST 1234 5698 7654 32: bank code and account, then the country
    // letters G=16 B=11 moved to the end, then the two check digits.
    assert_eq!(CheckScheme::Mod97.compute("32142829123456987654321611"), "82");
    assert!(CheckScheme::Mod97.verify("3214282912345698765432161182"));
    assert_eq!(CheckScheme::None.compute("123"), "");
    assert!(CheckScheme::None.verify("123"));
}

#[test]
fn mod97_whole_number_is_one_mod_97() {
    let (_, codes) = sample_codes(CheckScheme::Mod97);
    for code in codes {
        let r = code.bytes().fold(0u64, |r, b| (r * 10 + u64::from(b - b'0')) % 97);
        assert_eq!(r, 1, "{code}");
    }
    // Recompute-and-compare: "99" is congruent to "02" but is not the check value.
    let payload = (0..10_000u32).map(|n| n.to_string()).find(|p| CheckScheme::Mod97.compute(p) == "02").unwrap();
    assert!(!CheckScheme::Mod97.verify(&format!("{payload}99")));
}

#[test]
fn verify_rejects_non_digits_and_short_input() {
    for check in CheckScheme::ALL {
        assert!(!check.verify("12a4"), "{check}");
        assert!(!check.verify("１２３"), "{check}");
    }
    assert!(!CheckScheme::Mod97.verify("5"));
    assert!(!CheckScheme::Damm.verify(""));
}

#[test]
fn scheme_names_round_trip() {
    let expected = [("damm", 1), ("luhn", 1), ("mod97", 2), ("none", 0)];
    for (scheme, (name, width)) in CheckScheme::ALL.into_iter().zip(expected) {
        assert_eq!(scheme.to_string(), name);
        assert_eq!(scheme.width(), width);
        assert_eq!(name.parse::<CheckScheme>(), Ok(scheme));
        assert_eq!(name.to_uppercase().parse::<CheckScheme>(), Ok(scheme));
        let de: StrDeserializer<'_, DeError> = name.into_deserializer();
        assert_eq!(CheckScheme::deserialize(de), Ok(scheme));
    }
    assert_eq!(CheckScheme::default(), CheckScheme::Damm);
    let err = "crc32".parse::<CheckScheme>().unwrap_err();
    assert_eq!(err.to_string(), "unknown check scheme: expected one of damm, luhn, mod97, none");
    let de: StrDeserializer<'_, DeError> = "Damm".into_deserializer();
    assert!(CheckScheme::deserialize(de).is_err(), "serde names are lower-case only");
}

#[test]
fn format_layout() {
    let f = CodeFormat::new("42", 8, CheckScheme::Mod97).unwrap();
    assert_eq!(f.total_len(), 12);
    let code = f.format(123);
    assert_eq!(&code[..10], "4200000123");
    assert_eq!(&code[10..], CheckScheme::Mod97.compute("4200000123"));
    assert_eq!(f.parse(&code), Ok(123));
    let bare = CodeFormat::new("", 6, CheckScheme::None).unwrap();
    assert_eq!(bare.format(0), "000000");
    assert_eq!(bare.format(999_999), "999999");
    assert_eq!(bare.parse("000042"), Ok(42));
}

#[test]
fn format_definition_errors() {
    let cases = [
        (
            CodeFormat::new("1234567", 10, CheckScheme::Damm),
            FormatError::PrefixTooLong { found: 7 },
            "prefix must be at most 6 digits long, found 7 characters",
        ),
        (
            CodeFormat::new("12a", 10, CheckScheme::Damm),
            FormatError::PrefixNotDigits,
            "prefix must contain only the digits 0-9",
        ),
        (
            CodeFormat::new("٣", 10, CheckScheme::Damm),
            FormatError::PrefixNotDigits,
            "prefix must contain only the digits 0-9",
        ),
        (
            CodeFormat::new("1", 5, CheckScheme::Damm),
            FormatError::Digits { digits: 5 },
            "digit count 5 is not supported: it must be between 6 and 18",
        ),
        (
            CodeFormat::new("1", 19, CheckScheme::Damm),
            FormatError::Digits { digits: 19 },
            "digit count 19 is not supported: it must be between 6 and 18",
        ),
    ];
    for (result, err, message) in cases {
        assert_eq!(result, Err(err.clone()));
        assert_eq!(err.to_string(), message);
    }
    assert!(CodeFormat::new("123456", 18, CheckScheme::Mod97).is_ok());
}

#[test]
fn parser_errors_and_messages() {
    let f = CodeFormat::new("42", 8, CheckScheme::Damm).unwrap();
    let good = f.format(12_345_678);
    assert_eq!(good, format!("4212345678{}", CheckScheme::Damm.compute("4212345678")));

    let cases: Vec<(String, CodeError, &str)> = vec![
        (
            "421234567".into(),
            CodeError::Length { expected: 11, found: 9 },
            "code must be 11 characters long, but has 9",
        ),
        (
            format!("{good}0"),
            CodeError::Length { expected: 11, found: 12 },
            "code must be 11 characters long, but has 12",
        ),
        (String::new(), CodeError::Length { expected: 11, found: 0 }, "code must be 11 characters long, but has 0"),
        (
            // Length counts characters, not bytes.
            "42123456é8".to_string() + &good[10..],
            CodeError::NonDigit { position: 9 },
            "code must contain only the digits 0-9, but character 9 is not a digit",
        ),
        (
            "42-2345678".to_string() + &good[10..],
            CodeError::NonDigit { position: 3 },
            "code must contain only the digits 0-9, but character 3 is not a digit",
        ),
        (
            " 4212345678".into(),
            CodeError::NonDigit { position: 1 },
            "code must contain only the digits 0-9, but character 1 is not a digit",
        ),
        (
            "43".to_string() + &good[2..],
            CodeError::Prefix { expected: "42".into() },
            "code must start with the prefix 42",
        ),
        (
            good[..10].to_string() + if good.ends_with('0') { "1" } else { "0" },
            CodeError::CheckDigit,
            "check digit mismatch: the code contains a typo or is not a valid code",
        ),
    ];
    for (input, err, message) in cases {
        assert_eq!(f.parse(&input), Err(err.clone()), "input {input:?}");
        assert_eq!(err.to_string(), message);
    }
    assert_eq!(f.parse(&good), Ok(12_345_678));
}
