//! Text that came from outside (record headers, payload fragments, broker and handler errors)
//! made safe to log, store and print: control characters and bidirectional overrides written as
//! escapes, and the length bounded, so that one hostile field can neither forge log lines nor
//! turn into a 600 KB error column or dead-letter header.

use std::borrow::Cow;

/// How many bytes of an error Postal stores (`postal.outbox.last_error`,
/// `postal.dead_letters.error`, the `postal_dlq_error` header) and logs.
pub const MAX_ERROR_BYTES: usize = 2_000;

/// How many bytes of a single field (a header value, an id) an error quotes.
pub const MAX_QUOTED_BYTES: usize = 80;

/// Whether `c` must not reach a log line or a terminal as it is: control characters (escape
/// sequences, line breaks that fake another line) and bidirectional controls (text shown in
/// another order than it is stored).
pub fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

/// `s` with every unsafe character (see [`unsafe_char`]) written as an escape (`\n`,
/// `\u{1b}`); everything else, non-ASCII text included, as it is.
pub fn escaped(s: &str) -> Cow<'_, str> {
    if !s.chars().any(unsafe_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `s` escaped (see [`escaped`]) and cut to at most about `max` bytes on a character boundary,
/// with how much was left out: `abc… (1234 more bytes)`.
pub fn bounded(s: &str, max: usize) -> Cow<'_, str> {
    let e = escaped(s);
    if e.len() <= max {
        return e;
    }
    let mut cut = max;
    while !e.is_char_boundary(cut) {
        cut -= 1;
    }
    Cow::Owned(format!("{}… ({} more bytes)", &e[..cut], e.len() - cut))
}

/// An outside field (a topic, a key) for a log line: escaped, bounded to 200 bytes.
pub fn field(s: &str) -> Cow<'_, str> {
    bounded(s, 200)
}

/// An outside field quoted for an error message: escaped, bounded to [`MAX_QUOTED_BYTES`], in
/// double quotes.
pub fn quoted(s: &str) -> String {
    format!("\"{}\"", bounded(s, MAX_QUOTED_BYTES))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: escape sequences, line breaks and bidirectional overrides are written as
    /// escapes; ordinary and non-ASCII text is unchanged.
    #[test]
    fn controls_and_bidi_overrides_are_escaped() {
        assert_eq!(escaped("order-42 → Zürich"), "order-42 → Zürich");
        assert_eq!(
            escaped("k\u{1b}]0;pwned\u{7}\nfake line"),
            "k\\u{1b}]0;pwned\\u{7}\\nfake line"
        );
        assert_eq!(escaped("abc\u{202e}fed"), "abc\\u{202e}fed");
    }

    /// Guarantee: a huge field is cut to the bound on a character boundary and says how much
    /// was left out; a short one is kept whole.
    #[test]
    fn long_text_is_cut_on_a_character_boundary_with_the_rest_counted() {
        assert_eq!(bounded("short", 10), "short");
        let huge = "ü".repeat(300_000);
        let b = bounded(&huge, MAX_ERROR_BYTES);
        assert!(b.len() <= MAX_ERROR_BYTES + 40, "{}", b.len());
        assert!(b.ends_with(" more bytes)"), "{}", &b[b.len() - 40..]);
        let escapes = "\u{1b}".repeat(1_000);
        assert!(bounded(&escapes, 100).len() < 140);
        assert_eq!(quoted("a\nb"), "\"a\\nb\"");
    }
}
