//! Signed HTTP requests between pagefleet processes.
//!
//! Every request to a pagefleetd carries
//! `Authorization: PF1 t=<unix secs>,n=<32 hex nonce>,m=<64 hex MAC>`, the
//! MAC being [`Secret::http_mac`] over method, path, time, nonce and the
//! body's hash. The daemon refuses a request whose MAC is wrong (a stranger,
//! or a changed body or path), whose time is more than [`MAX_SKEW_SECS`]
//! away from its clock, or whose nonce it has already seen within that
//! window (a replay). The secret never crosses the wire.

use pagefleet_proto::auth::{macs_equal, Secret};
use std::collections::HashMap;
use std::sync::Mutex;

/// The authorization scheme's name.
pub const SCHEME: &str = "PF1";
/// How far a request's time may be from the daemon's clock.
pub const MAX_SKEW_SECS: u64 = 60;
/// Most nonces remembered at once; beyond that, signed requests are refused
/// with [`AuthError::Busy`] until old ones expire (a bound on the memory a
/// flood of valid requests can take).
pub const MAX_NONCES: usize = 1 << 16;

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization` header.
    #[error("authentication required: sign the request with the cluster secret (the pagefleet CLI does)")]
    Missing,
    /// A header not in the `PF1 t=..,n=..,m=..` form.
    #[error("malformed Authorization header: expected `{SCHEME} t=SECS,n=NONCE,m=MAC`")]
    Malformed,
    /// The request's time is too far from the daemon's clock.
    #[error("request time is {0} s away from this host's clock (at most {MAX_SKEW_SECS} s): check the clocks, or it is a replay")]
    Stale(u64),
    /// The MAC does not match: another secret, or a changed request.
    #[error("bad signature: not signed with this cluster's secret")]
    BadMac,
    /// The nonce was used before.
    #[error("replayed request (nonce already seen)")]
    Replayed,
    /// Too many requests within the replay window.
    #[error("too many requests within {MAX_SKEW_SECS} s; try again later")]
    Busy,
}

/// The current Unix time in seconds.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// The `Authorization` header value for one request.
pub fn sign(secret: &Secret, method: &str, path: &str, body: &[u8]) -> String {
    sign_at(secret, method, path, body, unix_now())
}

/// [`sign`] at a given time (tests use it for stale requests).
pub fn sign_at(secret: &Secret, method: &str, path: &str, body: &[u8], now: u64) -> String {
    let full = pagefleet_proto::auth::random_nonce();
    let mut nonce = [0u8; 16];
    nonce.copy_from_slice(&full[..16]);
    let mac = secret.http_mac(method, path, now, &nonce, body);
    format!("{SCHEME} t={now},n={},m={}", hex(&nonce), hex(&mac))
}

struct Parsed {
    t: u64,
    n: [u8; 16],
    m: [u8; 32],
}

fn parse(h: &str) -> Result<Parsed, AuthError> {
    let rest = h
        .strip_prefix(SCHEME)
        .and_then(|r| r.strip_prefix(' '))
        .ok_or(AuthError::Malformed)?;
    let (mut t, mut n, mut m) = (None, None, None);
    for kv in rest.split(',') {
        match kv.trim().split_once('=') {
            Some(("t", v)) => t = v.parse::<u64>().ok(),
            Some(("n", v)) => n = unhex::<16>(v),
            Some(("m", v)) => m = unhex::<32>(v),
            _ => return Err(AuthError::Malformed),
        }
    }
    match (t, n, m) {
        (Some(t), Some(n), Some(m)) => Ok(Parsed { t, n, m }),
        _ => Err(AuthError::Malformed),
    }
}

/// Checks signed requests against the cluster secret, remembering recent
/// nonces to refuse replays.
pub struct Verifier {
    secret: Secret,
    seen: Mutex<HashMap<[u8; 16], u64>>,
}

impl Verifier {
    /// A verifier for requests signed with `secret`.
    pub fn new(secret: Secret) -> Verifier {
        Verifier {
            secret,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// Accept or refuse one request. The MAC is checked before the nonce is
    /// remembered, so a stranger cannot fill the replay cache.
    pub fn verify(
        &self,
        header: Option<&str>,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Result<(), AuthError> {
        self.verify_at(header, method, path, body, unix_now())
    }

    /// [`Verifier::verify`] with the daemon's clock given.
    pub fn verify_at(
        &self,
        header: Option<&str>,
        method: &str,
        path: &str,
        body: &[u8],
        now: u64,
    ) -> Result<(), AuthError> {
        let p = parse(header.ok_or(AuthError::Missing)?)?;
        let expect = self.secret.http_mac(method, path, p.t, &p.n, body);
        if !macs_equal(&expect, &p.m) {
            return Err(AuthError::BadMac);
        }
        let skew = now.abs_diff(p.t);
        if skew > MAX_SKEW_SECS {
            return Err(AuthError::Stale(skew));
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.len() >= MAX_NONCES {
            seen.retain(|_, t| now.abs_diff(*t) <= MAX_SKEW_SECS);
            if seen.len() >= MAX_NONCES {
                return Err(AuthError::Busy);
            }
        }
        if seen.insert(p.n, p.t).is_some() {
            return Err(AuthError::Replayed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(b: &[u8]) -> Secret {
        Secret::from_bytes(b, "test").unwrap()
    }

    #[test]
    fn a_signed_request_passes_once() {
        let s = secret(b"0123456789abcdef0123");
        let v = Verifier::new(s.clone());
        let h = sign(&s, "POST", "/guests", b"{}");
        assert_eq!(v.verify(Some(&h), "POST", "/guests", b"{}"), Ok(()));
        assert_eq!(
            v.verify(Some(&h), "POST", "/guests", b"{}"),
            Err(AuthError::Replayed)
        );
    }

    #[test]
    fn strangers_and_changed_requests_are_refused() {
        let s = secret(b"0123456789abcdef0123");
        let other = secret(b"0123456789abcdef0124");
        let v = Verifier::new(s.clone());
        assert_eq!(v.verify(None, "GET", "/host", b""), Err(AuthError::Missing));
        assert_eq!(
            v.verify(Some("Bearer x"), "GET", "/host", b""),
            Err(AuthError::Malformed)
        );
        let h = sign(&other, "GET", "/host", b"");
        assert_eq!(
            v.verify(Some(&h), "GET", "/host", b""),
            Err(AuthError::BadMac)
        );
        let h = sign(&s, "POST", "/guests", b"{\"a\":1}");
        assert_eq!(
            v.verify(Some(&h), "POST", "/guests", b"{\"a\":2}"),
            Err(AuthError::BadMac)
        );
        assert_eq!(
            v.verify(Some(&h), "POST", "/incoming", b"{\"a\":1}"),
            Err(AuthError::BadMac)
        );
        assert_eq!(
            v.verify(Some(&h), "GET", "/guests", b"{\"a\":1}"),
            Err(AuthError::BadMac)
        );
    }

    #[test]
    fn old_and_future_requests_are_refused() {
        let s = secret(b"0123456789abcdef0123");
        let v = Verifier::new(s.clone());
        let now = unix_now();
        let h = sign_at(&s, "GET", "/host", b"", now - 600);
        assert_eq!(
            v.verify_at(Some(&h), "GET", "/host", b"", now),
            Err(AuthError::Stale(600))
        );
        let h = sign_at(&s, "GET", "/host", b"", now + 120);
        assert!(matches!(
            v.verify_at(Some(&h), "GET", "/host", b"", now),
            Err(AuthError::Stale(_))
        ));
    }
}
