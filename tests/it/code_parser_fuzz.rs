//! Property-based fuzzing of the code parser (`CodeFormat::parse`, `PoolCodec::decode`).
//!
//! For random formats (prefix of 0-6 digits, 6..=18 scrambled digits, every check scheme) and hostile
//! inputs (arbitrary Unicode, digit strings of any length, valid codes with one character changed,
//! inserted, removed or swapped), the parser must never panic and must accept exactly the strings that
//! `encode` produces:
//!
//! * `Ok(counter)` implies `counter < capacity` and `encode(counter) == input`;
//! * `Err(e)` is the first problem in the documented order (length, non-digit, prefix, check digit), and
//!   a `CheckDigit` rejection is right: the counter the body would decode to does not encode to the input.
//!
//! `parse` (the permuted value, no permutation) is held to the same oracle.
//!
//! The oracle below only uses the permutation and `encode`, never the check-digit code it judges.

use cifpool::code::{CheckScheme, CodeError, CodeFormat, PoolCodec};
use cifpool::keys::MasterKey;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// Fixed master key of this test (any 64 hex digits would do).
const MASTER_KEY_HEX: &str = "f022c0de5eed0000111122223333444455556666777788889999aaaabbbbcccc";

fn codec(prefix: &str, digits: u32, check: CheckScheme) -> PoolCodec {
    let key = MasterKey::from_hex(MASTER_KEY_HEX).unwrap().derive_pool_key("fuzz", "k1");
    PoolCodec::new(CodeFormat::new(prefix, digits, check).unwrap(), &key).unwrap()
}

/// A random valid format: (prefix, digits, check).
fn format_strategy() -> impl Strategy<Value = (String, u32, CheckScheme)> {
    ("[0-9]{0,6}", 6u32..=18, prop::sample::select(CheckScheme::ALL.to_vec()))
}

/// Characters that look like digits (or are close to them) but are not ASCII `0-9`, plus separators.
const TRICKY: &[char] = &[
    '/', ':', ' ', '-', '+', '.', '\0', '\n', 'O', 'l', '٣', '۵', '५', '０', '５', '９', '𝟘', '𝟗', '²', '½', 'Ⅻ',
    '\u{200B}', '\u{FEFF}', '\u{0301}', 'é', '€', '🦀',
];

fn tricky_char() -> impl Strategy<Value = char> {
    prop_oneof![
        3 => prop::char::range('0', '9'),
        2 => prop::sample::select(TRICKY),
        1 => any::<char>(),
    ]
}

/// Mostly-digit strings of any length, sprinkled with look-alikes and arbitrary Unicode.
fn noisy_string(max_len: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(tricky_char(), 0..=max_len).prop_map(String::from_iter)
}

/// How to spoil a valid code.
#[derive(Debug, Clone)]
enum Mutation {
    /// Replace the character at `index % len` with `with`.
    Replace(usize, char),
    /// Insert `with` before position `index % (len + 1)`.
    Insert(usize, char),
    /// Remove the character at `index % len`.
    Remove(usize),
    /// Swap the characters at `index % (len - 1)` and the next one.
    Swap(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), tricky_char()).prop_map(|(i, c)| Mutation::Replace(i, c)),
        1 => (any::<usize>(), tricky_char()).prop_map(|(i, c)| Mutation::Insert(i, c)),
        1 => any::<usize>().prop_map(Mutation::Remove),
        1 => any::<usize>().prop_map(Mutation::Swap),
    ]
}

fn apply(code: &str, m: &Mutation) -> String {
    let mut chars: Vec<char> = code.chars().collect();
    let n = chars.len();
    match *m {
        Mutation::Replace(i, c) => chars[i % n] = c,
        Mutation::Insert(i, c) => chars.insert(i % (n + 1), c),
        Mutation::Remove(i) => {
            chars.remove(i % n);
        }
        Mutation::Swap(i) => chars.swap(i % (n - 1), i % (n - 1) + 1),
    }
    chars.into_iter().collect()
}

/// A counter biased towards the ends of the domain.
fn counter_in(capacity: u64, raw: u64, pick: u8) -> u64 {
    match pick % 4 {
        0 => raw % capacity.min(1_000),
        1 => capacity - 1 - raw % capacity.min(1_000),
        _ => raw % capacity,
    }
}

/// What `decode(input)` must return, computed without the check-digit code: `Ok(counter)` exactly
/// when some counter encodes to `input`, otherwise the first problem in the documented order.
fn expected_decode(codec: &PoolCodec, input: &str) -> Result<u64, CodeError> {
    let format = codec.format();
    let expected = format.total_len();
    let found = input.chars().count();
    if found != expected {
        return Err(CodeError::Length { expected, found });
    }
    if let Some(i) = input.chars().position(|c| !c.is_ascii_digit()) {
        return Err(CodeError::NonDigit { position: i + 1 });
    }
    if !input.starts_with(format.prefix()) {
        return Err(CodeError::Prefix { expected: format.prefix().to_string() });
    }
    let body = &input[format.prefix().len()..expected - format.check().width()];
    let value: u64 = body.parse().unwrap();
    // The body has exactly `digits` digits, so it lies in the domain and has a preimage.
    let counter = codec.permutation().inverse(value).expect("a body of `digits` digits is in the domain");
    if codec.encode(counter) == input { Ok(counter) } else { Err(CodeError::CheckDigit) }
}

/// Runs both parsers on `input` and checks them against the oracle.
fn check_input(codec: &PoolCodec, input: &str) -> Result<(), TestCaseError> {
    let want = expected_decode(codec, input);
    let got = codec.decode(input);
    prop_assert_eq!(&got, &want, "decode({:?}) with format {:?}", input, codec.format());
    if let Ok(counter) = got {
        prop_assert!(counter < codec.capacity(), "decoded counter {} out of domain", counter);
        prop_assert_eq!(codec.encode(counter), input);
    }
    // `parse` returns the permuted value instead of the counter, with the same errors.
    let parsed = codec.format().parse(input);
    match (&parsed, &want) {
        (Ok(value), Ok(counter)) => {
            prop_assert_eq!(codec.permutation().try_permute(*counter), Ok(*value));
            prop_assert_eq!(codec.format().format(*value), input);
        }
        (Err(a), Err(b)) => prop_assert_eq!(a, b),
        _ => prop_assert!(false, "parse({:?}) = {:?} but decode oracle = {:?}", input, parsed, want),
    }
    // The error text goes into API details as is.
    if let Err(e) = &parsed {
        prop_assert!(!e.to_string().is_empty());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, failure_persistence: None, ..ProptestConfig::default() })]

    /// Arbitrary Unicode strings, mostly garbage.
    #[test]
    fn arbitrary_unicode_never_panics((prefix, digits, check) in format_strategy(), input in any::<String>()) {
        check_input(&codec(&prefix, digits, check), &input)?;
    }

    /// Digit look-alikes and digits, of any length up to twice a code's.
    #[test]
    fn noisy_strings((prefix, digits, check) in format_strategy(), input in noisy_string(52)) {
        check_input(&codec(&prefix, digits, check), &input)?;
    }

    /// Pure ASCII digit strings of random length, and of exactly the code's length (with and without the
    /// prefix): the latter reach the check-digit test, and with `none` they are all valid codes.
    #[test]
    fn digit_strings(
        (prefix, digits, check) in format_strategy(),
        any_len in "[0-9]{0,30}",
        body in "[0-9]{26}",
        keep_prefix in any::<bool>(),
    ) {
        let codec = codec(&prefix, digits, check);
        check_input(&codec, &any_len)?;
        let len = codec.format().total_len();
        let exact = if keep_prefix { format!("{prefix}{}", &body[..len - prefix.len()]) } else { body[..len].to_string() };
        check_input(&codec, &exact)?;
    }

    /// Valid codes round-trip, including both ends of the domain.
    #[test]
    fn valid_codes_round_trip((prefix, digits, check) in format_strategy(), raw in any::<u64>(), pick in any::<u8>()) {
        let codec = codec(&prefix, digits, check);
        let counter = counter_in(codec.capacity(), raw, pick);
        let code = codec.encode(counter);
        prop_assert_eq!(code.len(), codec.format().total_len());
        prop_assert_eq!(codec.decode(&code), Ok(counter));
        check_input(&codec, &code)?;
    }

    /// Valid codes with one character replaced, inserted, removed, or two neighbours swapped.
    #[test]
    fn near_valid_codes(
        (prefix, digits, check) in format_strategy(),
        raw in any::<u64>(),
        pick in any::<u8>(),
        mutations in prop::collection::vec(mutation(), 1..=2),
    ) {
        let codec = codec(&prefix, digits, check);
        let code = codec.encode(counter_in(codec.capacity(), raw, pick));
        let mut spoiled = code.clone();
        for m in &mutations {
            spoiled = apply(&spoiled, m);
        }
        check_input(&codec, &spoiled)?;
        // One replaced digit is always caught by a check scheme (it is only ever a valid code under `none`).
        if let [Mutation::Replace(_, c)] = mutations.as_slice()
            && c.is_ascii_digit()
            && spoiled != code
            && check != CheckScheme::None
        {
            prop_assert!(codec.decode(&spoiled).is_err(), "{} -> {} accepted", code, spoiled);
        }
    }
}
