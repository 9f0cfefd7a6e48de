//! `#[idempotent]` rejects every signature other than the documented ones with an error pointing
//! at the offending part, and `?` on an error Postal cannot classify says how to classify it
//! (snapshots in `tests/ui/fail/*.stderr`, for the stable toolchain CI uses). The accepted
//! shapes are compiled by `macro_accepts.rs`; `tests/ui/pass` compiles and runs handlers that
//! use `?` on the errors Postal classifies.

#[test]
fn idempotent_macro_signatures() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
