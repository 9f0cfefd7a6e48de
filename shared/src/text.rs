//! Text that came from outside (record headers, payload fragments, broker and handler errors)
//! made safe to log, store and print: control characters and bidirectional overrides written as
//! escapes, and the length bounded, so that one hostile field can neither forge log lines nor
//! turn into a 600 KB error column or dead-letter header.

use std::borrow::Cow;
use std::fmt::Write as _;

/// How many bytes of an error Postal stores (`postal.outbox.last_error`,
/// `postal.dead_letters.error`, the `postal_dlq_error` header) and logs.
pub const MAX_ERROR_BYTES: usize = 2_000;

/// How many bytes of a single field (a header value, an id) an error quotes.
pub const MAX_QUOTED_BYTES: usize = 80;

/// Whether `c` must not reach a log line or a terminal as it is: control characters — C0
/// (U+0000–U+001F: escape sequences, line breaks that fake another line), DEL (U+007F) and C1
/// (U+0080–U+009F: U+009B is a one-character CSI that many terminals obey) — and bidirectional
/// controls (U+202A–U+202E, U+2066–U+2069, U+200E/F, U+061C: text shown in another order than
/// it is stored). The one rule for everything Postal prints for people, JSON included (see
/// [`json_escaped`]).
pub fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{061c}'
        )
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

/// JSON text (as `serde_json` writes it) with every unsafe character (see [`unsafe_char`])
/// inside its strings written as a JSON `\uXXXX` escape: the same rule as [`escaped`], and the
/// text stays valid JSON that parses back to the same values. `serde_json` escapes only
/// U+0000–U+001F; DEL, C1 and bidirectional controls it writes as they are. Outside strings
/// JSON holds only ASCII punctuation, literals and whitespace, so an unsafe character other
/// than that whitespace is always inside a string.
pub fn json_escaped(json: &str) -> Cow<'_, str> {
    let in_string = |c: char| unsafe_char(c) && !matches!(c, ' ' | '\t' | '\n' | '\r');
    if !json.chars().any(in_string) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if in_string(c) {
            // Every unsafe character is in the Basic Multilingual Plane: one `\uXXXX`.
            let _ = write!(out, "\\u{:04x}", c as u32);
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

/// `s` as PostgreSQL `text` can hold it: a NUL, which `text` refuses (the whole statement
/// fails), written as the escape `\u{0}`; everything else as it is. For fields of a record
/// stored for people to read (a dead letter's or held record's `event_type`) whose exact bytes
/// are kept elsewhere (the record's headers, `bytea`).
pub fn storable(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\\u{0}"))
    } else {
        Cow::Borrowed(s)
    }
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

    /// Guarantee: a NUL, which PostgreSQL `text` refuses, is stored as its escape; other text
    /// (control characters included) is unchanged.
    #[test]
    fn storable_text_holds_no_nul() {
        assert_eq!(storable("en\0try"), "en\\u{0}try");
        assert_eq!(storable("order\n→"), "order\n→");
        assert!(matches!(storable("plain"), Cow::Borrowed(_)));
    }

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

    /// Guarantee: each class of unsafe character — C0, DEL, C1 (U+009B, a one-character CSI),
    /// bidirectional controls (U+202A–U+202E, U+2066–U+2069, U+200E/F, U+061C) — is escaped
    /// in text, and in JSON as a `\uXXXX` escape that parses back to the same string; the
    /// JSON's own layout (newlines, indentation) and non-ASCII text are kept.
    #[test]
    fn every_class_of_unsafe_character_is_escaped_in_text_and_json() {
        let classes: [(&str, &[char]); 4] = [
            (
                "C0",
                &['\u{0}', '\u{7}', '\u{1b}', '\n', '\r', '\t', '\u{1f}'],
            ),
            ("DEL", &['\u{7f}']),
            ("C1", &['\u{80}', '\u{85}', '\u{9b}', '\u{9d}', '\u{9f}']),
            (
                "bidi",
                &[
                    '\u{202a}', '\u{202b}', '\u{202c}', '\u{202d}', '\u{202e}', '\u{2066}',
                    '\u{2067}', '\u{2068}', '\u{2069}', '\u{200e}', '\u{200f}', '\u{061c}',
                ],
            ),
        ];
        for (class, chars) in classes {
            for &c in chars {
                let s = format!("Zürich{c}2J");
                let text = escaped(&s);
                assert!(!text.contains(c), "{class} {c:?} in text {text:?}");
                assert!(
                    text.contains(&format!("\\u{{{:x}}}", c as u32)) || c.is_ascii(),
                    "{class} {c:?}: {text:?}"
                );
                let value = serde_json::json!({ "key": s, "list": [s] });
                for json in [
                    serde_json::to_string(&value).unwrap(),
                    serde_json::to_string_pretty(&value).unwrap(),
                ] {
                    let safe = json_escaped(&json);
                    let layout = |ch: char| matches!(ch, '\n' | ' ');
                    assert!(
                        !safe.chars().any(|ch| unsafe_char(ch) && !layout(ch)),
                        "{class} {c:?} in JSON {safe:?}"
                    );
                    assert!(safe.contains("Zürich"), "{safe}");
                    let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
                    assert_eq!(back, value, "{class} {c:?} does not round-trip");
                }
            }
        }
        assert_eq!(json_escaped("{\"a\":\"\u{9b}\"}"), "{\"a\":\"\\u009b\"}");
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
