//! `#[idempotent]` rejects every signature other than the documented ones with an error pointing
//! at the offending part (snapshots in `tests/ui/fail/*.stderr`, for the stable toolchain CI
//! uses). The accepted shapes are compiled by `macro_accepts.rs`.

#[test]
fn idempotent_macro_signatures() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
}
