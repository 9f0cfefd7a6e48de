//! `#[idempotent]` rejects every signature other than the documented ones with an error pointing
//! at the offending part, and `?` on an error Postal cannot classify says how to classify it
//! (snapshots in `tests/ui/fail/*.stderr`, for the stable toolchain CI uses). The accepted
//! shapes are compiled by `macro_accepts.rs`, and `?` on the errors Postal classifies by
//! `macro_question_mark.rs`: plain tests, so that trybuild only checks (no pass case makes it
//! build and link every dependency again in a project of its own).

#[test]
fn idempotent_macro_signatures() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
}
