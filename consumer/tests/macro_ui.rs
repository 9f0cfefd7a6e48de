//! `#[idempotent]` accepts the documented handler shapes and rejects every other signature with
//! an error pointing at the offending part (snapshots in `tests/ui/fail/*.stderr`, for the
//! toolchain in `rust-toolchain` / CI's stable).

#[test]
fn idempotent_macro_signatures() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
