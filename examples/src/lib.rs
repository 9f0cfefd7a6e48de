//! Postal's examples live next to this crate as cargo examples, one idea each
//! (`examples/<name>.rs`; `cargo run -p postal-examples --example <name>`). This library holds
//! nothing but README.md's quickstart, compiled as a doctest so that it cannot rot.

/// README.md's Rust blocks, compiled as doctests (`cargo test -p postal-examples --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
mod readme {}
