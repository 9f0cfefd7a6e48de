//! The pages (GET): overview, parked events, blocked keys, dead letters, dedup lookup, audit.

mod audit;
mod blocked;
mod dead_letters;
mod lookup;
mod overview;
mod parked;

pub(crate) use audit::audit;
pub(crate) use blocked::blocked;
pub(crate) use dead_letters::{dead_letter, dead_letters};
pub(crate) use lookup::lookup;
pub(crate) use overview::overview;
pub(crate) use parked::{parked, parked_one};
