//! The ids the CLI takes, parsed with one line saying what kind of id is expected and where
//! to find it (instead of the parser's own words, "invalid digit found in string").

use uuid::Uuid;

/// Text that looks like an event id, whole or in part: hex digits and dashes, some of each
/// kind a UUID has.
fn looks_like_event_id(s: &str) -> bool {
    let s = s.trim();
    s.len() >= 8
        && s.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
        && s.chars()
            .any(|c| (c.is_ascii_hexdigit() && !c.is_ascii_digit()) || c == '-')
}

/// A dead letter's id (`postal dead-letters show|replay|resolve`).
pub fn dead_letter(s: &str) -> Result<i64, String> {
    if let Ok(id) = s.trim().parse::<i64>() {
        return Ok(id);
    }
    let hint = if Uuid::parse_str(s.trim()).is_ok() {
        "; this is an event id: `postal dead-letters list --event <EVENT_ID>` finds its dead letters"
    } else if looks_like_event_id(s) {
        "; this looks like part of an event id: `postal dead-letters list --event <EVENT_ID>` takes it whole"
    } else {
        ""
    };
    Err(format!(
        "dead-letter ids are numbers (the first column of `postal dead-letters list`){hint}"
    ))
}

/// An event id given to `postal dead-letters list --event`.
pub fn event_id_of_dead_letter(s: &str) -> Result<Uuid, String> {
    Uuid::parse_str(s.trim()).map_err(|_| {
        "an event id is a whole UUID (`postal dead-letters list --json` shows each dead letter's)"
            .to_owned()
    })
}

/// A parked event's id (`postal failed show|requeue|discard`).
pub fn parked_event(s: &str) -> Result<Uuid, String> {
    if let Ok(id) = Uuid::parse_str(s.trim()) {
        return Ok(id);
    }
    let hint = if s.trim().parse::<i64>().is_ok() {
        "; numbers name dead letters (`postal dead-letters`) and audit entries (`postal audit`)"
    } else if looks_like_event_id(s) {
        "; this looks like part of one: give it whole"
    } else {
        ""
    };
    Err(format!(
        "parked events are named by their event id, a UUID from `postal failed list`{hint}"
    ))
}

/// An audit entry's id (`postal audit show`).
pub fn audit_entry(s: &str) -> Result<i64, String> {
    s.trim().parse::<i64>().map_err(|_| {
        "audit entry ids are numbers (the first column of `postal audit list`)".to_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: a wrong id says which kind of id is expected and where to find it, in one
    /// line, never the parser's own words. (Failed before: "invalid digit found in string",
    /// "invalid length: found 1", "invalid group count: expected 5, found 2".)
    #[test]
    fn wrong_ids_say_what_is_expected_and_where_to_find_it() {
        let event = "01a22a4f-5483-7000-8000-000000000001";
        let e = dead_letter(event).unwrap_err();
        assert!(
            e.contains("dead-letter ids are numbers") && e.contains("list --event"),
            "{e}"
        );
        let e = dead_letter("01a22a4f-5483").unwrap_err();
        assert!(e.contains("part of an event id"), "{e}");
        assert_eq!(dead_letter(" 7 "), Ok(7));
        let e = parked_event("1").unwrap_err();
        assert!(
            e.starts_with(
                "parked events are named by their event id, a UUID from `postal failed list`"
            ),
            "{e}"
        );
        assert!(e.contains("dead letters"), "{e}");
        let e = parked_event("01a22a4f-5483").unwrap_err();
        assert!(e.contains("part of one"), "{e}");
        assert!(parked_event(event).is_ok());
        let e = audit_entry("x").unwrap_err();
        assert!(e.contains("postal audit list"), "{e}");
        for e in [
            dead_letter("abc").unwrap_err(),
            parked_event("abc").unwrap_err(),
            audit_entry("abc").unwrap_err(),
            event_id_of_dead_letter("1").unwrap_err(),
        ] {
            assert!(!e.contains('\n') && !e.contains("invalid"), "{e}");
        }
    }
}
