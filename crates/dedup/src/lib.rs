//! Sharing-aware migration (paper 002): a page whose content the
//! destination already holds is not sent; its hash is.
//!
//! This crate owns the two pieces every host shares: the keyed page hash
//! ([`ContentKey`], [`PageHash`]) and a host's content index
//! ([`ContentIndex`]) of the pages it could supply locally. Who feeds the
//! index and who asks it is the daemon's and the migration's business
//! (`docs/dedup.md`).

#![warn(missing_docs)]

mod hash;
mod index;
mod local;
pub mod lookup;
pub mod resident;
pub mod scan;
mod sys;

pub use hash::{ContentKey, PageHash, PAGE};
pub use index::{ContentIndex, Filter, IndexStats, Location, SourceId};
pub use local::ReadSlot;
