//! Text from the database made safe for an operator's terminal. Keys, headers, payloads and
//! errors come from whoever could write the outbox or produce to a topic: a control character
//! (an escape sequence that sets the window title, moves the cursor or writes a hyperlink), a
//! line break that fakes another line of output, or a bidirectional override that shows text
//! in another order than it is stored reaches the terminal only with `--raw`. Everything else
//! prints as it is, non-ASCII text included; JSON output is escaped by JSON itself.

use std::borrow::Cow;

/// Whether `c` must not reach a terminal as it is.
fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

/// `s` with every control character and bidirectional control written as an escape (`\n`,
/// `\u{1b}`), unless `raw`.
pub fn shown(s: &str, raw: bool) -> Cow<'_, str> {
    if raw || !s.chars().any(unsafe_char) {
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

/// Bytes as text for a terminal: UTF-8 (invalid sequences replaced), escaped unless `raw`.
pub fn shown_bytes(b: &[u8], raw: bool) -> String {
    shown(&String::from_utf8_lossy(b), raw).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: escape sequences, line breaks and bidirectional overrides are written as
    /// escapes; ordinary and non-ASCII text is unchanged; `raw` passes everything.
    #[test]
    fn controls_and_bidi_overrides_are_escaped() {
        assert_eq!(shown("order-42 → Zürich", false), "order-42 → Zürich");
        assert_eq!(
            shown("k\u{1b}]0;pwned\u{7}\nfake line", false),
            "k\\u{1b}]0;pwned\\u{7}\\nfake line"
        );
        assert_eq!(shown("abc\u{202e}fed", false), "abc\\u{202e}fed");
        assert_eq!(shown("k\u{1b}[2J", true), "k\u{1b}[2J");
        assert_eq!(shown_bytes(b"\xff\x1b", false), "\u{fffd}\\u{1b}");
    }
}
