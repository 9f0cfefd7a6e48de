//! Text from the database made safe for an operator's terminal. Keys, headers, payloads and
//! errors come from whoever could write the outbox or produce to a topic: a control character
//! (an escape sequence that sets the window title, moves the cursor or writes a hyperlink), a
//! line break that fakes another line of output, or a bidirectional override that shows text
//! in another order than it is stored reaches the terminal only with `--raw`. Everything else
//! prints as it is, non-ASCII text included. JSON output follows the same rule
//! ([`postal_shared::text::unsafe_char`]), as JSON `\uXXXX` escapes: it stays valid JSON and
//! parses back to the stored text.

use std::borrow::Cow;

/// `s` with every control character and bidirectional control written as an escape (`\n`,
/// `\u{1b}`), unless `raw`.
pub fn shown(s: &str, raw: bool) -> Cow<'_, str> {
    if raw {
        return Cow::Borrowed(s);
    }
    postal_shared::text::escaped(s)
}

/// `value` as JSON for a terminal (one line, or indented when `pretty`): every unsafe
/// character in its strings written as a `\uXXXX` escape, not only those below U+0020 that JSON
/// escapes itself.
pub fn json<T: serde::Serialize + ?Sized>(value: &T, pretty: bool) -> serde_json::Result<String> {
    let text = if pretty {
        serde_json::to_string_pretty(value)?
    } else {
        serde_json::to_string(value)?
    };
    Ok(postal_shared::text::json_escaped(&text).into_owned())
}

/// Bytes as text for a terminal: UTF-8 (invalid sequences replaced), escaped unless `raw`.
pub fn shown_bytes(b: &[u8], raw: bool) -> String {
    shown(&String::from_utf8_lossy(b), raw).into_owned()
}

/// How many payload bytes `show` prints without `--full`.
pub const PAYLOAD_SHOWN: usize = 64 * 1024;

/// `b` cut to [`PAYLOAD_SHOWN`] bytes (unless `full`), never in the middle of a character.
pub fn cut(b: &[u8], full: bool) -> &[u8] {
    if full || b.len() <= PAYLOAD_SHOWN {
        return b;
    }
    whole_chars(&b[..PAYLOAD_SHOWN])
}

/// `b` without a UTF-8 character that a cut left incomplete at its end.
fn whole_chars(b: &[u8]) -> &[u8] {
    match std::str::from_utf8(b) {
        Err(e) if e.error_len().is_none() => &b[..e.valid_up_to()],
        _ => b,
    }
}

/// What follows a payload printed cut: how many of its `total` bytes were not shown and how
/// to see them; empty when `shown` is all of it.
pub fn cut_note(shown: usize, total: usize) -> String {
    if shown >= total {
        return String::new();
    }
    format!(
        " … [{} of its {total} bytes not shown; --full prints the whole payload]",
        total - shown
    )
}

/// An outbox payload of `total` bytes whose first bytes (all, or a cut of them) are `head`:
/// as text (escaped unless `raw`) with a note saying how many bytes were cut, or its size when
/// it is not UTF-8.
pub fn payload(head: &[u8], total: usize, raw: bool) -> String {
    let head = if head.len() < total {
        whole_chars(head)
    } else {
        head
    };
    match std::str::from_utf8(head) {
        Ok(text) => format!("{}{}", shown(text, raw), cut_note(head.len(), total)),
        Err(_) => format!("{total} bytes (binary)"),
    }
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

    /// Guarantee: a payload longer than [`PAYLOAD_SHOWN`] is printed cut, never in the middle
    /// of a character, with the number of bytes cut; a shorter one whole, with no note; a
    /// binary one as its size.
    #[test]
    fn long_payloads_are_cut_with_the_count_of_bytes_cut() {
        assert_eq!(payload(b"{}", 2, false), "{}");
        // 2 bytes each: a cut after an odd number of bytes splits one.
        let long = "é".repeat(PAYLOAD_SHOWN).into_bytes();
        assert_eq!(cut(&long, false).len(), PAYLOAD_SHOWN);
        assert_eq!(cut(&long, true).len(), long.len());
        let total = 1_500_000;
        let out = payload(&long[..PAYLOAD_SHOWN + 1], total, false);
        assert!(out.starts_with("éé"));
        assert_eq!(out.matches('é').count(), PAYLOAD_SHOWN / 2);
        let cut = total - PAYLOAD_SHOWN;
        assert!(
            out.ends_with(&format!(
                " … [{cut} of its {total} bytes not shown; --full prints the whole payload]"
            )),
            "{}",
            &out[out.len() - 100..]
        );
        assert_eq!(payload(b"\xff\xfe", 2, false), "2 bytes (binary)");
    }

    /// Guarantee: the CLI's text and JSON outputs escape the same characters — C0, DEL, C1
    /// (U+009B CSI) and bidirectional controls — and its JSON parses back to the stored text.
    #[test]
    fn text_and_json_output_escape_the_same_characters() {
        for c in [
            '\u{1b}', '\u{7f}', '\u{9b}', '\u{202e}', '\u{2067}', '\u{61c}',
        ] {
            let key = format!("order{c}[31m");
            assert!(!shown(&key, false).contains(c), "{c:?} in text");
            let row = serde_json::json!({ "event_key": key });
            for pretty in [false, true] {
                let out = json(&row, pretty).unwrap();
                assert!(!out.contains(c), "{c:?} in JSON {out:?}");
                let back: serde_json::Value = serde_json::from_str(&out).unwrap();
                assert_eq!(back["event_key"], key.as_str());
            }
        }
    }
}
