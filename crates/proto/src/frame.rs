//! Frame header, opcodes, limits and error codes.

use thiserror::Error;

/// First two bytes of every frame: ASCII "PF".
pub const MAGIC: [u8; 2] = *b"PF";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 1;
/// Size of one page on the wire and in the store.
pub use pagefleet_units::PAGE_SIZE;
/// Most pages one PUT or GET frame may carry (128 KiB of data).
pub const MAX_BATCH_PAGES: usize = 32;
/// Most page numbers one DELETE frame may list (list mode).
pub const MAX_DELETE_LIST: usize = 8192;
/// Header length in bytes.
pub use crate::framing::HEADER_LEN;
use crate::framing::{Framing, HeaderError, RawHeader};

/// The memory-server protocol's framing ([`crate::framing`]).
pub const FRAMING: Framing = Framing {
    magic: MAGIC,
    version: VERSION,
    max_body: MAX_BODY,
};
/// Largest body any frame may have; a header announcing more is rejected
/// before anything else is read (FRAME_TOO_LARGE).
pub const MAX_BODY: usize = 16 + MAX_BATCH_PAGES * 8 + MAX_BATCH_PAGES * PAGE_SIZE + 64 * 1024;
/// Page numbers must be below this (so that `page * PAGE_SIZE` fits in u64).
pub const MAX_PAGE: u64 = 1 << 52;
/// Longest client name in HELLO and error message text.
pub const MAX_NAME: usize = 64;
/// Longest error message carried (longer ones are cut).
pub const MAX_MESSAGE: usize = 1024;
/// Longest PING payload.
pub const MAX_PING: usize = 256;

/// Opcodes. Requests are 0x01..=0x7f; a reply carries the request's opcode
/// with the high bit set; 0x80 is the server's greeting and 0xff an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Client: authenticate (answers WELCOME).
    Hello = 0x01,
    /// Client: store pages.
    Put = 0x02,
    /// Client: read (or take) pages.
    Get = 0x03,
    /// Client: drop pages or a whole region.
    Delete = 0x04,
    /// Client: capacity, use and regions.
    Stat = 0x05,
    /// Client: a round trip.
    Ping = 0x06,
    /// Client: store pages by content: the server fills those whose keyed
    /// hash matches a page its host holds (sharing-aware migration).
    PutHashed = 0x07,
    /// Client, before HELLO: switch this connection to TLS (the server
    /// answers STARTTLS_OK, then the TLS handshake and a new WELCOME run).
    StartTls = 0x08,
    /// Client: copy pages of a region to another memory server (the
    /// server connects to it as a client and stores them there):
    /// re-replication without the data crossing the asking host.
    Push = 0x09,
    /// Server: greeting with its nonce.
    Welcome = 0x80,
    /// Server: authenticated; its proof and numbers.
    HelloOk = 0x81,
    /// Server: pages stored.
    PutOk = 0x82,
    /// Server: the pages asked for.
    GetOk = 0x83,
    /// Server: pages dropped.
    DeleteOk = 0x84,
    /// Server: its numbers.
    StatOk = 0x85,
    /// Server: the round trip.
    Pong = 0x86,
    /// Server: which pages of a PUT_HASHED it stored from its own host.
    PutHashedOk = 0x87,
    /// Server: the next bytes are the TLS handshake.
    StartTlsOk = 0x88,
    /// Server: the pages of a PUSH are stored on the other server.
    PushOk = 0x89,
    /// Server: the request failed.
    Error = 0xff,
}

impl Opcode {
    /// The opcode of a byte, if known.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        use Opcode::*;
        Some(match v {
            0x01 => Hello,
            0x02 => Put,
            0x03 => Get,
            0x04 => Delete,
            0x05 => Stat,
            0x06 => Ping,
            0x07 => PutHashed,
            0x08 => StartTls,
            0x09 => Push,
            0x80 => Welcome,
            0x81 => HelloOk,
            0x82 => PutOk,
            0x83 => GetOk,
            0x84 => DeleteOk,
            0x85 => StatOk,
            0x86 => Pong,
            0x87 => PutHashedOk,
            0x88 => StartTlsOk,
            0x89 => PushOk,
            0xff => Error,
            _ => return None,
        })
    }
    /// Its name as the protocol document spells it.
    pub fn name(self) -> &'static str {
        use Opcode::*;
        match self {
            Hello => "hello",
            Put => "put",
            Get => "get",
            Delete => "delete",
            Stat => "stat",
            Ping => "ping",
            PutHashed => "put_hashed",
            StartTls => "starttls",
            Push => "push",
            Welcome => "welcome",
            HelloOk => "hello_ok",
            PutOk => "put_ok",
            GetOk => "get_ok",
            DeleteOk => "delete_ok",
            StatOk => "stat_ok",
            Pong => "pong",
            PutHashedOk => "put_hashed_ok",
            StartTlsOk => "starttls_ok",
            PushOk => "push_ok",
            Error => "error",
        }
    }
    /// The reply opcode for a request opcode.
    pub fn reply(self) -> Opcode {
        use Opcode::*;
        match self {
            Hello => HelloOk,
            Put => PutOk,
            Get => GetOk,
            Delete => DeleteOk,
            Stat => StatOk,
            Ping => Pong,
            PutHashed => PutHashedOk,
            StartTls => StartTlsOk,
            Push => PushOk,
            other => other,
        }
    }
}

/// A decoded frame header. The opcode is kept raw so that an unknown opcode
/// can be answered with UNKNOWN_OPCODE after its body has been skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The opcode byte (kept raw: an unknown one is answered after its body is skipped).
    pub opcode: u8,
    /// Body length, bytes.
    pub body_len: u32,
    /// Request id (replies echo it).
    pub id: u64,
}

impl Header {
    /// A header for a frame of `op` with a `body_len`-byte body.
    pub fn new(op: Opcode, body_len: usize, id: u64) -> Header {
        Header {
            opcode: op as u8,
            body_len: body_len as u32,
            id,
        }
    }
    /// The wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        FRAMING.encode(RawHeader {
            kind: self.opcode,
            body_len: self.body_len,
            word: self.id,
        })
    }
    /// Decode and validate a header: magic, version and body length.
    pub fn decode(b: &[u8]) -> Result<Header, WireError> {
        match FRAMING.decode(b) {
            Ok(r) => Ok(Header {
                opcode: r.kind,
                body_len: r.body_len,
                id: r.word,
            }),
            Err(HeaderError::Short) => Err(WireError::new(ErrorCode::Malformed, "short header")),
            Err(HeaderError::BadMagic(m)) => Err(WireError::new(
                ErrorCode::BadMagic,
                format!("bad magic {:02x}{:02x}, expected 5046 (\"PF\")", m[0], m[1]),
            )),
            Err(HeaderError::Version { got, word }) => Err(WireError::new(
                ErrorCode::UnsupportedVersion,
                format!("frame version {got} not supported; this peer speaks version {VERSION}"),
            )
            .with_id(word)),
            Err(HeaderError::TooLarge { len, word }) => Err(WireError::new(
                ErrorCode::FrameTooLarge,
                format!("body of {len} bytes exceeds the limit of {MAX_BODY}"),
            )
            .with_id(word)),
        }
    }
}

/// Error codes carried by ERROR frames. See docs/protocol.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// The frame does not start with the magic.
    BadMagic = 1,
    /// No common protocol version.
    UnsupportedVersion = 2,
    /// The body is over the limit.
    FrameTooLarge = 3,
    /// The body cannot be parsed.
    Malformed = 4,
    /// No such request.
    UnknownOpcode = 5,
    /// A request before HELLO.
    NotAuthenticated = 6,
    /// The HMAC proof is wrong.
    AuthFailed = 7,
    /// Not enough free slots (detail: free pages).
    OutOfCapacity = 8,
    /// A page is not stored (detail: the first missing).
    NotFound = 9,
    /// Flags or counts out of range.
    InvalidArgument = 10,
    /// Too many connections.
    Busy = 11,
    /// The server failed.
    Internal = 12,
    /// The client broke the protocol.
    ProtocolViolation = 13,
    /// This server takes only TLS from the client's address (STARTTLS first),
    /// or was asked for TLS it cannot give.
    TlsRequired = 14,
    /// A PUSH could not store its pages on the other server (detail: 0).
    PeerFailed = 15,
}

impl ErrorCode {
    /// Every code.
    pub const ALL: [ErrorCode; 15] = [
        ErrorCode::BadMagic,
        ErrorCode::UnsupportedVersion,
        ErrorCode::FrameTooLarge,
        ErrorCode::Malformed,
        ErrorCode::UnknownOpcode,
        ErrorCode::NotAuthenticated,
        ErrorCode::AuthFailed,
        ErrorCode::OutOfCapacity,
        ErrorCode::NotFound,
        ErrorCode::InvalidArgument,
        ErrorCode::Busy,
        ErrorCode::Internal,
        ErrorCode::ProtocolViolation,
        ErrorCode::TlsRequired,
        ErrorCode::PeerFailed,
    ];
    /// The error code of a number, if known.
    pub fn from_u16(v: u16) -> Option<ErrorCode> {
        ErrorCode::ALL.iter().copied().find(|c| *c as u16 == v)
    }
    /// Its name as the protocol document spells it.
    pub fn name(self) -> &'static str {
        use ErrorCode::*;
        match self {
            BadMagic => "BAD_MAGIC",
            UnsupportedVersion => "UNSUPPORTED_VERSION",
            FrameTooLarge => "FRAME_TOO_LARGE",
            Malformed => "MALFORMED",
            UnknownOpcode => "UNKNOWN_OPCODE",
            NotAuthenticated => "NOT_AUTHENTICATED",
            AuthFailed => "AUTH_FAILED",
            OutOfCapacity => "OUT_OF_CAPACITY",
            NotFound => "NOT_FOUND",
            InvalidArgument => "INVALID_ARGUMENT",
            Busy => "BUSY",
            Internal => "INTERNAL",
            ProtocolViolation => "PROTOCOL_VIOLATION",
            TlsRequired => "TLS_REQUIRED",
            PeerFailed => "PEER_FAILED",
        }
    }
    /// Fatal errors close the connection after the ERROR frame is sent: the
    /// byte stream can no longer be trusted, or the peer is not allowed in.
    pub fn is_fatal(self) -> bool {
        !matches!(
            self,
            ErrorCode::OutOfCapacity
                | ErrorCode::NotFound
                | ErrorCode::InvalidArgument
                | ErrorCode::UnknownOpcode
                | ErrorCode::PeerFailed
        )
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A protocol-level error: what goes into an ERROR frame.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{code}: {message}")]
pub struct WireError {
    /// What kind of error.
    pub code: ErrorCode,
    /// For a person.
    pub message: String,
    /// Request id the error answers (0 when it answers no parsed request).
    pub id: u64,
    /// Code-specific detail: free pages for OUT_OF_CAPACITY, first missing
    /// page for NOT_FOUND, 0 otherwise.
    pub detail: u64,
}

impl WireError {
    /// An error (the message cut to MAX_MESSAGE).
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WireError {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE {
            let mut cut = MAX_MESSAGE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        WireError {
            code,
            message,
            id: 0,
            detail: 0,
        }
    }
    /// The same error answering request `id`.
    pub fn with_id(mut self, id: u64) -> WireError {
        self.id = id;
        self
    }
    /// The same error with its code-specific detail.
    pub fn with_detail(mut self, detail: u64) -> WireError {
        self.detail = detail;
        self
    }
    /// A MALFORMED error.
    pub fn malformed(message: impl Into<String>) -> WireError {
        WireError::new(ErrorCode::Malformed, message)
    }
}
