//! What a provider said, made safe to keep: an error text goes into `last_error`, which the API, the
//! dead-letter listing and the logs show, so it must not carry the provider's URLs (they may embed
//! credentials or internal hosts), credentials a gateway echoed back, the recipient a gateway quoted
//! ("invalid number +8490…"), or an unbounded body.

use std::sync::LazyLock;

use regex::Regex;

/// Longest error text kept, in characters.
pub(crate) const MAX_ERROR_CHARS: usize = 500;

static URL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"(?i)\b[a-z][a-z0-9+.-]*://[^\s"'<>()]+"#).expect("static pattern"));
static AUTH_SCHEME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\b(bearer|basic|digest|token)\s+[A-Za-z0-9._~+/=-]{8,}").expect("static pattern")
});
static KEY_VALUE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r#"(?i)("?\b(?:password|passwd|pwd|secret|token|access_token|refresh_token|api[_-]?key|apikey|authorization|auth|signature|sig|key)"?\s*[:=]\s*)("[^"]*"|[^\s,;&"'}]+)"#,
    )
    .expect("static pattern")
});
static SECRET_LOOKING: LazyLock<Regex> = LazyLock::new(|| {
    // Long unbroken runs of key-like characters (API keys, JWTs, hex secrets) anywhere in the text.
    Regex::new(
        r"\b(?:cfp_[0-9a-f]{16,}|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9._-]+|[A-Fa-f0-9]{32,}|[A-Za-z0-9+/]{40,}={0,2})",
    )
    .expect("static pattern")
});

/// `text` without URLs and credentials, at most [`MAX_ERROR_CHARS`] characters.
pub(crate) fn scrub_error(text: &str) -> String {
    let text = URL.replace_all(text, "<url>");
    let text = AUTH_SCHEME.replace_all(&text, "$1 <redacted>");
    let text = KEY_VALUE.replace_all(&text, "${1}<redacted>");
    let text = SECRET_LOOKING.replace_all(&text, "<redacted>");
    let mut chars = text.chars();
    let kept: String = chars.by_ref().take(MAX_ERROR_CHARS).collect();
    if chars.next().is_some() { format!("{kept}…") } else { kept }
}

/// [`scrub_error`] of a job's error, with every quote of its `recipient` (also without a leading `+`, as
/// gateways often write numbers) masked as the finished job's recipient is.
pub(crate) fn scrub_job_error(text: &str, recipient: &str) -> String {
    let mut text = text.to_string();
    let bare = recipient.trim_start_matches('+');
    for quoted in [recipient, bare] {
        if quoted.chars().count() > 6 {
            text = text.replace(quoted, &crate::queue::privacy::masked(quoted));
        }
    }
    scrub_error(&text)
}

#[cfg(test)]
mod tests {
    use super::{scrub_error, scrub_job_error};

    #[test]
    fn a_quoted_recipient_is_masked() {
        assert_eq!(
            scrub_job_error("HTTP 422: invalid number 84901234567 (+84901234567)", "+84901234567"),
            "HTTP 422: invalid number *******4567 (********4567)"
        );
        assert_eq!(scrub_job_error("HTTP 422: bad recipient 12345", "12345"), "HTTP 422: bad recipient 12345");
    }

    #[test]
    fn urls_credentials_and_length_are_removed() {
        let got = scrub_error(
            "request failed: error sending request for url (https://user:pw@sms.internal:8443/send?key=abc): timed out",
        );
        assert_eq!(got, "request failed: error sending request for url (<url>): timed out");
        assert_eq!(
            scrub_error(
                r#"HTTP 401: {"error":"bad Authorization: Bearer sk_live_0123456789abcdef","api_key":"k-123"}"#
            ),
            r#"HTTP 401: {"error":"bad Authorization: <redacted> <redacted>","api_key":<redacted>}"#
        );
        assert_eq!(scrub_error("password=hunter2; token: abc.def"), "password=<redacted>; token: <redacted>");
        assert_eq!(scrub_error("echo cfp_0123456789abcdef0123456789abcdef"), "echo <redacted>");
        let long = scrub_error(&"word ".repeat(400));
        assert_eq!(long.chars().count(), super::MAX_ERROR_CHARS + 1, "500 characters and an ellipsis");
        assert_eq!(
            scrub_error("HTTP 503 Service Unavailable: injected failure"),
            "HTTP 503 Service Unavailable: injected failure"
        );
    }
}
