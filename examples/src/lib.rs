//! Postal's examples live next to this crate as cargo examples, one idea each
//! (`examples/<name>.rs`; `cargo run -p postal-examples --example <name>`). This library holds
//! nothing but the Rust code blocks of README.md and docs/, compiled as doctests so that they
//! cannot rot: a block that names an API by a path a user of the facade does not have, or by
//! a signature it no longer has, fails `cargo test -p postal-examples --doc`. Other blocks are
//! marked with their language (`sh`, `toml`, `text`, …) and are not compiled.

/// README.md's Rust blocks.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
mod readme {}

/// docs/relay.md's Rust blocks.
#[cfg(doctest)]
#[doc = include_str!("../../docs/relay.md")]
mod relay_md {}

/// docs/consumer.md's Rust blocks.
#[cfg(doctest)]
#[doc = include_str!("../../docs/consumer.md")]
mod consumer_md {}

/// docs/dashboard.md's Rust blocks.
#[cfg(doctest)]
#[doc = include_str!("../../docs/dashboard.md")]
mod dashboard_md {}

/// The other documents have no Rust blocks today; included so that one added later is compiled.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guarantees.md")]
#[doc = include_str!("../../docs/operations.md")]
#[doc = include_str!("../../docs/security.md")]
#[doc = include_str!("../../docs/interop.md")]
#[doc = include_str!("../../CONTRIBUTING.md")]
#[doc = include_str!("../../BENCHMARKS.md")]
mod other_docs {}
