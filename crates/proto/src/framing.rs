//! The framing both of pagefleet's protocols share: the memory-server
//! protocol (`PF`, [`crate::frame`]) and the migration stream (`PM`,
//! `pagefleet_migrate::wire`) put the same 16-byte header before every
//! frame — a 2-byte magic, a version byte, a kind byte, the body's length
//! (u32) and a 64-bit word (the request id, or a kind's argument), all
//! little-endian. Each protocol is a [`Framing`] (its magic, version and
//! largest body) and maps a [`HeaderError`] to its own error type; the
//! bytes are encoded and checked here once.

/// Header bytes.
pub const HEADER_LEN: usize = 16;

/// One protocol's framing.
#[derive(Clone, Copy, Debug)]
pub struct Framing {
    /// The first two bytes of every header.
    pub magic: [u8; 2],
    /// The version this side speaks.
    pub version: u8,
    /// The largest body a header may announce.
    pub max_body: usize,
}

/// A header as the bytes say, checked for magic, version and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawHeader {
    /// The kind (opcode) byte, unchecked: each protocol knows its kinds.
    pub kind: u8,
    /// Body bytes.
    pub body_len: u32,
    /// The request id or the kind's argument.
    pub word: u64,
}

/// Why a header was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderError {
    /// Fewer than [`HEADER_LEN`] bytes.
    Short,
    /// Another protocol (or none).
    BadMagic([u8; 2]),
    /// Another version of this protocol; `word` as sent.
    Version {
        /// The version byte.
        got: u8,
        /// The header's word.
        word: u64,
    },
    /// A body larger than the framing allows; `word` as sent.
    TooLarge {
        /// The announced length.
        len: u32,
        /// The header's word.
        word: u64,
    },
}

impl Framing {
    /// The wire form of `h`.
    pub fn encode(&self, h: RawHeader) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&self.magic);
        b[2] = self.version;
        b[3] = h.kind;
        b[4..8].copy_from_slice(&h.body_len.to_le_bytes());
        b[8..16].copy_from_slice(&h.word.to_le_bytes());
        b
    }

    /// Parse and check a header: magic, version, body length (in that
    /// order: a peer speaking another protocol hears that first).
    pub fn decode(&self, b: &[u8]) -> Result<RawHeader, HeaderError> {
        let Some(b) = b.get(..HEADER_LEN) else {
            return Err(HeaderError::Short);
        };
        if b[0..2] != self.magic {
            return Err(HeaderError::BadMagic([b[0], b[1]]));
        }
        let word = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        if b[2] != self.version {
            return Err(HeaderError::Version { got: b[2], word });
        }
        let body_len = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        if body_len as usize > self.max_body {
            return Err(HeaderError::TooLarge {
                len: body_len,
                word,
            });
        }
        Ok(RawHeader {
            kind: b[3],
            body_len,
            word,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const F: Framing = Framing {
        magic: *b"XY",
        version: 3,
        max_body: 1000,
    };

    proptest! {
        /// What is encoded decodes to itself; any bytes decode to a
        /// header within the limits or to an error, never a panic.
        #[test]
        fn round_trip_and_no_panic(kind: u8, len in 0u32..=1000, word: u64, junk in prop::collection::vec(any::<u8>(), 0..40)) {
            let h = RawHeader { kind, body_len: len, word };
            prop_assert_eq!(F.decode(&F.encode(h)), Ok(h));
            if let Ok(r) = F.decode(&junk) {
                prop_assert!(r.body_len as usize <= F.max_body);
            }
        }
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let mut b = F.encode(RawHeader {
            kind: 1,
            body_len: 5,
            word: 9,
        });
        assert_eq!(F.decode(&b[..15]), Err(HeaderError::Short));
        b[2] = 4;
        assert_eq!(F.decode(&b), Err(HeaderError::Version { got: 4, word: 9 }));
        b[2] = 3;
        b[4..8].copy_from_slice(&1001u32.to_le_bytes());
        assert_eq!(
            F.decode(&b),
            Err(HeaderError::TooLarge { len: 1001, word: 9 })
        );
        b[0] = b'P';
        assert_eq!(F.decode(&b), Err(HeaderError::BadMagic([b'P', b'Y'])));
    }
}
