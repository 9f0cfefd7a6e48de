//! Text from the database made safe for an operator's terminal. Keys, headers, payloads and
//! errors come from whoever could write the outbox or produce to a topic: a control character
//! (an escape sequence that sets the window title, moves the cursor or writes a hyperlink), a
//! line break that fakes another line of output, or a bidirectional override that shows text
//! in another order than it is stored reaches the terminal only with `--raw`. Everything else
//! prints as it is, non-ASCII text included; JSON output is escaped by JSON itself.

use std::borrow::Cow;

/// `s` with every control character and bidirectional control written as an escape (`\n`,
/// `\u{1b}`), unless `raw`.
pub fn shown(s: &str, raw: bool) -> Cow<'_, str> {
    if raw {
        return Cow::Borrowed(s);
    }
    postal_shared::text::escaped(s)
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
