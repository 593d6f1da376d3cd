//! Every raw system call this crate makes, each behind a safe function
//! whose `SAFETY:` comment says why the call is sound; the rest of the
//! crate (and the crates above it, for the calls they share: signals,
//! process checks, mappings) uses these. The architecture test fails on a
//! `libc::` call outside a crate's `sys` module.

pub mod clock;
pub mod fds;
pub mod file;
pub mod heap;
pub mod mapping;
pub mod net;
pub mod poll;
pub mod process;
pub mod signal;
pub mod splice;
