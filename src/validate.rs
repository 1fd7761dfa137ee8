//! Checks on free text and job payloads before they reach Postgres: what `text` and `jsonb` cannot
//! hold (NUL, a lone surrogate), or what they would keep but no reader could load back (a number past
//! a 64-bit float), must be a 422 naming the field, not a 500 or a job no worker can read.

/// A label-like field: 1 to `max` characters, no control characters.
pub fn text(field: &str, value: &str, max: usize) -> Result<(), String> {
    let chars = value.chars().count();
    if chars == 0 || chars > max {
        return Err(format!("{field} must be 1 to {max} characters, got {chars}"));
    }
    if value.chars().any(char::is_control) {
        return Err(format!("{field} must not contain control characters"));
    }
    Ok(())
}

/// Longest tenant name or idempotency key (of a job, or in an API key's tenant list).
pub(crate) const MAX_LABEL: usize = 128;

/// Largest payload of one job, in bytes of its JSON text, whether enqueued alone or in a batch: a
/// claim loads up to four times `claim_batch` payloads at once (see [`crate::queue::catch_up`]), so one
/// job must not be able to fill a pod's memory.
pub(crate) const MAX_PAYLOAD_BYTES: usize = 64 * 1024;
/// Deepest nesting of arrays and objects in a payload.
pub(crate) const MAX_PAYLOAD_DEPTH: usize = 32;

/// A job payload given as its JSON text: accepted only if Postgres' `jsonb` stores it and gives back a
/// document the workers (and a provider's JSON reader) can read as it was meant. So: at most
/// [`MAX_PAYLOAD_BYTES`], nested at most [`MAX_PAYLOAD_DEPTH`] deep, every number within a 64-bit
/// float's range (`1e400` is valid JSON that `jsonb` keeps but no JSON reader of the workers can
/// load), no lone UTF-16 surrogate escape (`"\ud800"`: `jsonb` refuses it) and no NUL in any string
/// or key. The text is checked in one pass without building the document.
pub(crate) fn json_text(field: &str, text: &str) -> Result<(), String> {
    if text.len() > MAX_PAYLOAD_BYTES {
        return Err(format!("{field} is {} bytes; at most {MAX_PAYLOAD_BYTES} are accepted", text.len()));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let mut problem = None;
    let checked = serde::de::DeserializeSeed::deserialize(Readable { depth: 0, problem: &mut problem }, &mut de)
        .and_then(|()| de.end());
    match (problem, checked) {
        (Some(problem), _) => Err(format!("{field} {problem}")),
        (None, Ok(())) => Ok(()),
        (None, Err(e)) if e.to_string().contains("number out of range") => {
            Err(format!("{field} has a number outside the range of a 64-bit float ({e})"))
        }
        // serde_json names a lone surrogate (`"\ud800"`, which `jsonb` refuses) by the escape it
        // expected next.
        (None, Err(e)) if e.to_string().contains("hex escape") || e.to_string().contains("surrogate") => {
            Err(format!("{field} has a lone UTF-16 surrogate or a broken \\u escape ({e})"))
        }
        (None, Err(e)) => Err(format!("{field} is not JSON that can be stored and read back: {e}")),
    }
}

/// Walks a JSON document as the deserializer reads it, noting the first thing [`json_text`] refuses.
struct Readable<'p> {
    depth: usize,
    problem: &'p mut Option<String>,
}

impl Readable<'_> {
    fn refuse<E: serde::de::Error>(&mut self, problem: String) -> E {
        let error = E::custom(&problem);
        *self.problem = Some(problem);
        error
    }

    fn string<E: serde::de::Error>(&mut self, s: &str) -> Result<(), E> {
        if s.contains('\0') { Err(self.refuse("must not contain NUL characters".into())) } else { Ok(()) }
    }

    fn nested<E: serde::de::Error>(&mut self) -> Result<Readable<'_>, E> {
        if self.depth >= MAX_PAYLOAD_DEPTH {
            return Err(self.refuse(format!("is nested more than {MAX_PAYLOAD_DEPTH} deep")));
        }
        Ok(Readable { depth: self.depth + 1, problem: self.problem })
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Readable<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Readable<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E: serde::de::Error>(mut self, v: f64) -> Result<(), E> {
        if v.is_finite() { Ok(()) } else { Err(self.refuse("has a number outside the range of a 64-bit float".into())) }
    }

    fn visit_str<E: serde::de::Error>(mut self, v: &str) -> Result<(), E> {
        self.string(v)
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(self.nested()?)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            self.string(&key)?;
            map.next_value_seed(self.nested()?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_characters_not_bytes_and_refuses_nul() {
        assert!(text("ref", &"é".repeat(200), 200).is_ok());
        assert!(text("ref", &"é".repeat(201), 200).is_err());
        assert!(text("ref", "", 10).is_err());
        assert!(text("ref", "a\0b", 10).unwrap_err().contains("control"));
        assert!(json_text("payload", r#"{"a": ["x\u0000"]}"#).is_err());
        // An escaped backslash followed by "u0000" is text, not a NUL.
        assert!(json_text("payload", r#"{"a": "\\u0000"}"#).is_ok());
        assert!(json_text("payload", r#"{"a": 1}"#).is_ok());
    }

    #[test]
    fn a_payload_must_come_back_from_jsonb_as_it_went_in() {
        for ok in [r#"{"n": 1.5e300, "s": "\ud83d\ude00", "a": [1, -2, null, true]}"#, "null", r#""x""#] {
            assert_eq!(json_text("payload", ok), Ok(()), "{ok}");
        }
        let refused = [
            (r#"{"n": 1e400}"#, "range"),
            (r#"[-1e309]"#, "range"),
            (r#"{"s": "\ud800"}"#, "surrogate"),
            (r#"{"\udc00": 1}"#, "surrogate"),
            (r#"{"a": "x\u0000"}"#, "NUL"),
            (r#"{"a\u0000": 1}"#, "NUL"),
            ("{\"a\": 1", "JSON"),
        ];
        for (text, why) in refused {
            let error = json_text("payload", text).unwrap_err();
            assert!(error.starts_with("payload ") && error.contains(why), "{text}: {error}");
        }
        let deep = format!("{}1{}", "[".repeat(MAX_PAYLOAD_DEPTH), "]".repeat(MAX_PAYLOAD_DEPTH));
        assert_eq!(json_text("payload", &deep), Ok(()));
        let deeper = format!("[{deep}]");
        assert!(json_text("payload", &deeper).unwrap_err().contains("nested"), "one level too deep");
        let big = format!(r#""{}""#, "x".repeat(MAX_PAYLOAD_BYTES));
        assert!(json_text("payload", &big).unwrap_err().contains("bytes"));
    }
}
