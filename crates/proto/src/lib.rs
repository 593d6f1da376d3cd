//! The pagefleet memory-server wire protocol (version 1).
//!
//! Every frame is a 16-byte header followed by `body_len` bytes of body; all
//! integers are little-endian. The full specification, with every frame and
//! error code, is `docs/protocol.md`; this crate is its reference codec and is
//! shared by the server (`pagefleet-memserver`) and the client
//! (`pagefleet-client`), so both sides parse frames with the same code.

pub mod auth;
pub mod frame;
pub mod framing;
pub mod io;
pub mod msg;
pub mod sys;

pub use frame::*;
pub use msg::*;
