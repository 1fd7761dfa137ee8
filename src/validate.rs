//! Checks on free text before it reaches Postgres, whose `text` and `jsonb` cannot hold NUL: such input
//! must be a 422 naming the field, not a 500 from the database.

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

/// A JSON document given as its text: no string or key anywhere contains NUL. A NUL can only be
/// written `\u0000` in JSON, so the text is parsed only when that sequence appears in it.
pub fn json_text(field: &str, text: &str) -> Result<(), String> {
    if !text.contains("\\u0000") {
        return Ok(());
    }
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("{field} is not valid JSON: {e}"))?;
    json(field, &value)
}

/// A JSON document: no string or key anywhere contains NUL.
pub fn json(field: &str, value: &serde_json::Value) -> Result<(), String> {
    fn has_nul(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(items) => items.iter().any(has_nul),
            serde_json::Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
            _ => false,
        }
    }
    if has_nul(value) { Err(format!("{field} must not contain NUL characters")) } else { Ok(()) }
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
        assert!(json("payload", &serde_json::json!({"a": ["x\u{0}"]})).is_err());
        assert!(json("payload", &serde_json::json!({"a": ["ok"]})).is_ok());
        assert!(json_text("payload", r#"{"a": ["x\u0000"]}"#).is_err());
        // An escaped backslash followed by "u0000" is text, not a NUL.
        assert!(json_text("payload", r#"{"a": "\\u0000"}"#).is_ok());
        assert!(json_text("payload", r#"{"a": 1}"#).is_ok());
    }
}
