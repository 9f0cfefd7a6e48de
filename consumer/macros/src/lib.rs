//! Procedural macros of Postal. Use them through `postal-consumer`.
