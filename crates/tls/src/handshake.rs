//! The opening every pagefleet connection runs, defined once for both
//! protocols (the memory-server protocol, `pagefleet_proto::frame`, and the
//! migration stream, `pagefleet_migrate::wire`), which differ only in how
//! they frame the same four steps:
//!
//! 1. the server speaks first: WELCOME with a fresh nonce, the connection's
//!    id and what it says about TLS ([`TlsOffer`]);
//! 2. a client with an identity for this peer ([`crate::for_peer`]) sends
//!    STARTTLS, the server answers STARTTLS_OK, both run the TLS handshake
//!    and the server sends a new WELCOME (a new nonce) inside TLS; a client
//!    without one, facing a server that requires TLS, gives up, and a server
//!    that requires TLS refuses a plaintext HELLO ([`client_tls`],
//!    [`TlsOffer::for_peer`]);
//! 3. HELLO: the client's nonce and its proof of the cluster secret over
//!    both nonces and the id ([`Challenge::hello`]);
//! 4. the server checks it ([`Challenge::accept`]) and proves the secret
//!    back; the client checks that proof ([`Challenge::check_proof`]).
//!
//! Nothing past WELCOME is answered before the proof in step 4, and no MAC
//! or secret ever crosses the wire twice under one nonce pair. The blocking
//! sides run [`open_client`] and [`open_server`] over a protocol's
//! [`ClientWire`] / [`ServerWire`]; the memory server's gate, which serves
//! many openings on one thread without blocking, runs the same steps from
//! [`TlsOffer`] and [`Challenge`] as a state machine.

use crate::{for_peer, Identity, Stream, TlsError};
use pagefleet_proto::auth::{macs_equal, random_nonce, Secret};
use std::net::SocketAddr;

/// What a server's WELCOME says about TLS: the same two bits in both protocols.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TlsOffer {
    /// The server can switch this connection to TLS (it has an identity).
    pub offered: bool,
    /// The server takes nothing but STARTTLS from this client's address.
    pub required: bool,
}

impl TlsOffer {
    /// Bit for [`TlsOffer::offered`].
    pub const OFFERED: u8 = 1;
    /// Bit for [`TlsOffer::required`].
    pub const REQUIRED: u8 = 2;

    /// What a server whose identity is `id` offers a client at `peer`:
    /// TLS whenever it has an identity, required unless the peer is on
    /// loopback.
    pub fn for_peer(id: Option<&Identity>, peer: SocketAddr) -> TlsOffer {
        TlsOffer {
            offered: id.is_some(),
            required: for_peer(id, peer).is_some(),
        }
    }

    /// The wire bits.
    pub fn bits(self) -> u8 {
        (self.offered as u8 * Self::OFFERED) | (self.required as u8 * Self::REQUIRED)
    }

    /// From the wire bits (others are ignored: later versions may add some).
    pub fn from_bits(b: u8) -> TlsOffer {
        TlsOffer {
            offered: b & Self::OFFERED != 0,
            required: b & Self::REQUIRED != 0,
        }
    }
}

/// Why a client and a server cannot agree on TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TlsMismatch {
    /// The client speaks only TLS to this peer; the server has no identity.
    #[error("the server does not offer TLS, and this side speaks only TLS to peers not on loopback (give the server --tls-dir)")]
    NotOffered,
    /// The server takes only TLS from this client, which has no identity.
    #[error("the server takes only TLS from this address: give this side the cluster's certificates (--tls-dir or $PAGEFLEET_TLS_DIR)")]
    Required,
}

/// What a client does after WELCOME: `Some(identity)` = STARTTLS with it,
/// `None` = stay in plaintext. `id` is the client's identity for this peer
/// (already none on loopback: [`crate::for_peer`]).
pub fn client_tls(
    id: Option<&Identity>,
    offer: TlsOffer,
) -> Result<Option<&Identity>, TlsMismatch> {
    match id {
        Some(id) if offer.offered => Ok(Some(id)),
        Some(_) => Err(TlsMismatch::NotOffered),
        None if offer.required => Err(TlsMismatch::Required),
        None => Ok(None),
    }
}

/// One opening's challenge: the server's nonce and the connection id its
/// WELCOME carried (both protocols bind the proofs to them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// The server's nonce, fresh per WELCOME.
    pub server_nonce: [u8; 32],
    /// The id the proofs are bound to (the memory server's id; the
    /// migration stream's random connection id).
    pub id: u64,
}

/// The client's half of the proof: what HELLO carries in both protocols.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloProof {
    /// The client's nonce.
    pub client_nonce: [u8; 32],
    /// HMAC of the secret over both nonces and the id (client direction).
    pub mac: [u8; 32],
}

impl Challenge {
    /// A server's challenge with a fresh nonce.
    pub fn fresh(id: u64) -> Challenge {
        Challenge {
            server_nonce: random_nonce(),
            id,
        }
    }

    /// The same connection's challenge for a new WELCOME (after STARTTLS).
    pub fn renewed(self) -> Challenge {
        Challenge::fresh(self.id)
    }

    /// Client: the HELLO proof with a fresh client nonce.
    pub fn hello(&self, secret: &Secret) -> HelloProof {
        let client_nonce = random_nonce();
        HelloProof {
            client_nonce,
            mac: secret.client_mac(&self.server_nonce, &client_nonce, self.id),
        }
    }

    /// Server: the proof to send back if `h` proves the secret, else None.
    pub fn accept(&self, secret: &Secret, h: &HelloProof) -> Option<[u8; 32]> {
        let want = secret.client_mac(&self.server_nonce, &h.client_nonce, self.id);
        macs_equal(&want, &h.mac)
            .then(|| secret.server_mac(&self.server_nonce, &h.client_nonce, self.id))
    }

    /// Client: whether the server's `proof` answers `h` (it holds the secret).
    pub fn check_proof(&self, secret: &Secret, h: &HelloProof, proof: &[u8; 32]) -> bool {
        macs_equal(
            proof,
            &secret.server_mac(&self.server_nonce, &h.client_nonce, self.id),
        )
    }
}

/// A failed opening, in terms both protocols' errors are made from.
#[derive(Debug, thiserror::Error)]
pub enum OpeningError<E> {
    /// The protocol's own error (I/O, framing, the peer's ERROR).
    #[error(transparent)]
    Wire(E),
    /// The two sides cannot agree on TLS.
    #[error("{0}")]
    Mismatch(TlsMismatch),
    /// The TLS handshake failed.
    #[error("TLS: {0}")]
    Tls(String),
    /// A plaintext HELLO from a peer this server takes only TLS from.
    #[error("{peer} sent a plaintext HELLO; TLS is required from it")]
    PlaintextRefused {
        /// Who sent it.
        peer: SocketAddr,
    },
    /// STARTTLS to a server without an identity.
    #[error("STARTTLS, but this host has no TLS identity")]
    NoIdentity,
    /// The peer's proof of the cluster secret is wrong.
    #[error("authentication failed: the peer does not hold this cluster's secret")]
    Auth,
}

impl<E> From<TlsError> for OpeningError<E> {
    fn from(e: TlsError) -> Self {
        OpeningError::Tls(e.to_string())
    }
}

/// A protocol's client-side messages of the opening.
pub trait ClientWire {
    /// The protocol's error.
    type Error;
    /// The connection (to switch to TLS).
    fn stream(&mut self) -> &mut Stream;
    /// Read a WELCOME.
    fn welcome(&mut self) -> Result<(Challenge, TlsOffer), Self::Error>;
    /// Send STARTTLS and read STARTTLS_OK (nothing may follow it unread).
    fn start_tls(&mut self) -> Result<(), Self::Error>;
    /// Send HELLO and read the server's answer: its proof.
    fn hello(&mut self, h: &HelloProof) -> Result<[u8; 32], Self::Error>;
}

/// A client's opening: WELCOME, STARTTLS when this side's identity for the
/// peer says so (`id`, already filtered by [`crate::for_peer`]; the TLS
/// server name is `server_name`), HELLO, the server's proof checked.
/// Returns the challenge the session is bound to.
pub fn open_client<W: ClientWire>(
    w: &mut W,
    secret: &Secret,
    id: Option<&Identity>,
    server_name: &str,
) -> Result<Challenge, OpeningError<W::Error>> {
    let (mut ch, offer) = w.welcome().map_err(OpeningError::Wire)?;
    if let Some(id) = client_tls(id, offer).map_err(OpeningError::Mismatch)? {
        w.start_tls().map_err(OpeningError::Wire)?;
        let s = w.stream();
        s.start_tls_client(id, server_name)?;
        s.handshake()
            .map_err(|e| OpeningError::Tls(e.to_string()))?;
        (ch, _) = w.welcome().map_err(OpeningError::Wire)?;
    }
    let h = ch.hello(secret);
    let proof = w.hello(&h).map_err(OpeningError::Wire)?;
    if !ch.check_proof(secret, &h, &proof) {
        return Err(OpeningError::Auth);
    }
    Ok(ch)
}

/// What a client sent after WELCOME.
pub enum ClientStep {
    /// STARTTLS.
    StartTls,
    /// HELLO with its proof.
    Hello(HelloProof),
}

/// A protocol's server-side messages of the opening.
pub trait ServerWire {
    /// The protocol's error.
    type Error;
    /// The connection (to switch to TLS) and its peer.
    fn stream(&mut self) -> &mut Stream;
    /// Send WELCOME.
    fn welcome(&mut self, ch: &Challenge, offer: TlsOffer) -> Result<(), Self::Error>;
    /// Read the client's next opening message.
    fn next(&mut self) -> Result<ClientStep, Self::Error>;
    /// Send STARTTLS_OK.
    fn start_tls_ok(&mut self) -> Result<(), Self::Error>;
    /// Send the proof (the opening succeeded).
    fn proof(&mut self, ch: &Challenge, proof: &[u8; 32]) -> Result<(), Self::Error>;
    /// Tell the client why it is refused (best effort, before closing).
    fn refuse(&mut self, why: &OpeningError<Self::Error>);
}

/// A server's opening with the client at `peer`, as a process whose
/// identity is `id`: WELCOME, STARTTLS if the client asks (refused without
/// an identity), a plaintext HELLO refused when TLS is required from the
/// peer, the client's proof checked and answered. Returns the challenge.
pub fn open_server<W: ServerWire>(
    w: &mut W,
    secret: &Secret,
    id: Option<&Identity>,
    peer: SocketAddr,
    conn_id: u64,
) -> Result<Challenge, OpeningError<W::Error>> {
    let offer = TlsOffer::for_peer(id, peer);
    let mut ch = Challenge::fresh(conn_id);
    w.welcome(&ch, offer).map_err(OpeningError::Wire)?;
    let mut step = w.next().map_err(OpeningError::Wire)?;
    if let ClientStep::StartTls = step {
        let Some(id) = id else {
            return Err(refuse(w, OpeningError::NoIdentity));
        };
        w.start_tls_ok().map_err(OpeningError::Wire)?;
        let s = w.stream();
        s.start_tls_server(id)?;
        s.handshake()
            .map_err(|e| OpeningError::Tls(format!("{peer}: {e}")))?;
        ch = ch.renewed();
        w.welcome(&ch, TlsOffer::default())
            .map_err(OpeningError::Wire)?;
        step = w.next().map_err(OpeningError::Wire)?;
    } else if offer.required {
        return Err(refuse(w, OpeningError::PlaintextRefused { peer }));
    }
    let ClientStep::Hello(h) = step else {
        return Err(OpeningError::Tls("STARTTLS twice".into()));
    };
    match ch.accept(secret, &h) {
        Some(p) => {
            w.proof(&ch, &p).map_err(OpeningError::Wire)?;
            Ok(ch)
        }
        None => Err(refuse(w, OpeningError::Auth)),
    }
}

fn refuse<W: ServerWire>(w: &mut W, e: OpeningError<W::Error>) -> OpeningError<W::Error> {
    w.refuse(&e);
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offer_bits_roundtrip() {
        for offered in [false, true] {
            for required in [false, true] {
                let o = TlsOffer { offered, required };
                assert_eq!(TlsOffer::from_bits(o.bits()), o);
            }
        }
        assert_eq!(TlsOffer::from_bits(0xfc), TlsOffer::default());
    }

    #[test]
    fn proofs_bind_secret_nonces_and_id() {
        let s = Secret::generate();
        let other = Secret::generate();
        let ch = Challenge::fresh(7);
        let h = ch.hello(&s);
        let p = ch.accept(&s, &h).expect("the right secret is accepted");
        assert!(ch.check_proof(&s, &h, &p));
        assert!(ch.accept(&other, &h).is_none(), "a wrong secret is refused");
        assert!(!ch.check_proof(&other, &h, &p));
        // The same HELLO under another WELCOME (a replay) is refused.
        assert!(ch.renewed().accept(&s, &h).is_none());
        let other_id = Challenge { id: 8, ..ch };
        assert!(other_id.accept(&s, &h).is_none());
    }
}
