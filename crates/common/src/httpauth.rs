//! Signed HTTP requests between pagefleet processes.
//!
//! Every request to a pagefleetd carries
//! `Authorization: PF1 t=<unix secs>,n=<32 hex nonce>,m=<64 hex MAC>[,b=<64 hex>]`,
//! the MAC being [`Secret::http_mac`] over method, path, time, nonce and
//! the body's SHA-256, which `b=` states when there is a body (without
//! `b=` the body must be empty). The daemon checks the head first
//! ([`Verifier::verify_head`]: MAC over the stated hash, time within
//! [`MAX_SKEW_SECS`] of its clock, nonce not seen within that window) and
//! only then reads the body, which must hash to what the head stated
//! ([`Admitted::check_body`]): a stranger never gets a body buffered. The
//! secret never crosses the wire.

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
    /// The body is not the one the signed head stated.
    #[error("the request body does not match the signed head's b= hash")]
    BodyMismatch,
}

/// The current Unix time in seconds.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

use pagefleet_proto::auth::hex;

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

/// The bearer token a Prometheus scrapes `GET /metrics` with, in hex
/// (`Authorization: Bearer TOKEN`; [`Secret::scrape_token`]).
pub fn scrape_token(secret: &Secret) -> String {
    hex(&secret.scrape_token())
}

/// The dashboard's login route. A login link (`pagefleet dashboard`)
/// carries, in its query, the signature of a `GET` of this path: signed
/// like any request, so it lives as long as a request's signature does
/// ([`MAX_SKEW_SECS`]) and opens a session once (its nonce is then seen).
pub const UI_LOGIN_PATH: &str = "/ui/login";

/// The query of a dashboard login link: `t=SECS&n=NONCE&m=MAC`, a
/// signature of `GET` [`UI_LOGIN_PATH`] made now.
pub fn ui_login_query(secret: &Secret) -> String {
    let full = pagefleet_proto::auth::random_nonce();
    let mut nonce = [0u8; 16];
    nonce.copy_from_slice(&full[..16]);
    let now = unix_now();
    let hash = empty_body_hash();
    let mac = secret.http_mac_hashed("GET", UI_LOGIN_PATH, now, &nonce, &hash);
    format!("t={now}&n={}&m={}", hex(&nonce), hex(&mac))
}

fn empty_body_hash() -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(b"").into()
}

/// The `Authorization` header value for one request.
pub fn sign(secret: &Secret, method: &str, path: &str, body: &[u8]) -> String {
    sign_at(secret, method, path, body, unix_now())
}

/// [`sign`] at a given time (tests use it for stale requests).
pub fn sign_at(secret: &Secret, method: &str, path: &str, body: &[u8], now: u64) -> String {
    use sha2::Digest;
    let full = pagefleet_proto::auth::random_nonce();
    let mut nonce = [0u8; 16];
    nonce.copy_from_slice(&full[..16]);
    let hash: [u8; 32] = sha2::Sha256::digest(body).into();
    let mac = secret.http_mac_hashed(method, path, now, &nonce, &hash);
    let mut h = format!("{SCHEME} t={now},n={},m={}", hex(&nonce), hex(&mac));
    if !body.is_empty() {
        h.push_str(",b=");
        h.push_str(&hex(&hash));
    }
    h
}

struct Parsed {
    t: u64,
    n: [u8; 16],
    m: [u8; 32],
    b: Option<[u8; 32]>,
}

fn parse(h: &str) -> Result<Parsed, AuthError> {
    let rest = h
        .strip_prefix(SCHEME)
        .and_then(|r| r.strip_prefix(' '))
        .ok_or(AuthError::Malformed)?;
    let (mut t, mut n, mut m, mut b) = (None, None, None, None);
    for kv in rest.split(',') {
        let slot_filled = match kv.trim().split_once('=') {
            Some(("t", v)) => t.replace(v.parse::<u64>().map_err(|_| AuthError::Malformed)?),
            Some(("n", v)) => n
                .replace(unhex::<16>(v).ok_or(AuthError::Malformed)?)
                .map(|_| 0),
            Some(("m", v)) => m
                .replace(unhex::<32>(v).ok_or(AuthError::Malformed)?)
                .map(|_| 0),
            Some(("b", v)) => b
                .replace(unhex::<32>(v).ok_or(AuthError::Malformed)?)
                .map(|_| 0),
            _ => return Err(AuthError::Malformed),
        };
        if slot_filled.is_some() {
            // A field given twice: which one was signed is anyone's guess.
            return Err(AuthError::Malformed);
        }
    }
    match (t, n, m) {
        (Some(t), Some(n), Some(m)) => Ok(Parsed { t, n, m, b }),
        _ => Err(AuthError::Malformed),
    }
}

/// A request head whose signature checked out: the body it names is still
/// to be read and checked.
#[derive(Debug)]
pub struct Admitted {
    body_hash: Option<[u8; 32]>,
}

impl Admitted {
    /// The body was signed as empty (no `b=`): nothing should be read.
    pub fn expects_empty_body(&self) -> bool {
        self.body_hash.is_none()
    }

    /// The body read is the one the head was signed for.
    pub fn check_body(&self, body: &[u8]) -> Result<(), AuthError> {
        use sha2::Digest;
        match &self.body_hash {
            None if body.is_empty() => Ok(()),
            None => Err(AuthError::BodyMismatch),
            Some(want) => {
                let got: [u8; 32] = sha2::Sha256::digest(body).into();
                if macs_equal(&got, want) {
                    Ok(())
                } else {
                    Err(AuthError::BodyMismatch)
                }
            }
        }
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

    /// `header` is `Bearer` and this cluster's scrape token (compared in
    /// constant time): it opens `GET /metrics`, nothing else.
    pub fn is_scrape_token(&self, header: Option<&str>) -> bool {
        header
            .and_then(|h| h.strip_prefix("Bearer "))
            .and_then(|t| unhex::<32>(t.trim()))
            .is_some_and(|t| macs_equal(&t, &self.secret.scrape_token()))
    }

    /// Accept or refuse a dashboard login link's query (what
    /// [`ui_login_query`] made): a signature of `GET` [`UI_LOGIN_PATH`],
    /// checked like a request's, its nonce remembered (one login per link).
    pub fn verify_ui_login(&self, query: Option<&str>) -> Result<(), AuthError> {
        self.verify_ui_login_at(query, unix_now())
    }

    /// [`Verifier::verify_ui_login`] with the daemon's clock given.
    pub fn verify_ui_login_at(&self, query: Option<&str>, now: u64) -> Result<(), AuthError> {
        let q = query.ok_or(AuthError::Missing)?;
        let (mut t, mut n, mut m) = (None, None, None);
        for kv in q.split('&') {
            let (k, v) = kv.split_once('=').ok_or(AuthError::Malformed)?;
            // Digits and hex only: nothing that could add a field to the
            // header rebuilt below.
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(AuthError::Malformed);
            }
            let slot = match k {
                "t" => &mut t,
                "n" => &mut n,
                "m" => &mut m,
                _ => return Err(AuthError::Malformed),
            };
            if slot.replace(v).is_some() {
                return Err(AuthError::Malformed);
            }
        }
        let (Some(t), Some(n), Some(m)) = (t, n, m) else {
            return Err(AuthError::Malformed);
        };
        let h = format!("{SCHEME} t={t},n={n},m={m}");
        self.verify_head_at(Some(&h), "GET", UI_LOGIN_PATH, now)
            .map(|_| ())
    }

    /// Accept or refuse one whole request: [`Verifier::verify_head`], then
    /// [`Admitted::check_body`].
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
        self.verify_head_at(header, method, path, now)?
            .check_body(body)
    }

    /// Accept or refuse a request by its head alone, before its body is
    /// read. The MAC is checked before the nonce is remembered, so a
    /// stranger cannot fill the replay cache; a replayed head with another
    /// body fails both the nonce and the body check.
    pub fn verify_head(
        &self,
        header: Option<&str>,
        method: &str,
        path: &str,
    ) -> Result<Admitted, AuthError> {
        self.verify_head_at(header, method, path, unix_now())
    }

    /// [`Verifier::verify_head`] with the daemon's clock given.
    pub fn verify_head_at(
        &self,
        header: Option<&str>,
        method: &str,
        path: &str,
        now: u64,
    ) -> Result<Admitted, AuthError> {
        use sha2::Digest;
        let p = parse(header.ok_or(AuthError::Missing)?)?;
        let hash = p.b.unwrap_or_else(|| sha2::Sha256::digest(b"").into());
        let expect = self.secret.http_mac_hashed(method, path, p.t, &p.n, &hash);
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
        Ok(Admitted { body_hash: p.b })
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
            Err(AuthError::BodyMismatch)
        );
        let h = sign(&s, "POST", "/guests", b"{\"a\":1}");
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
    fn the_head_is_checked_before_the_body_and_the_body_after() {
        let s = secret(b"0123456789abcdef0123");
        let v = Verifier::new(s.clone());
        let body = br#"{"size":1}"#;
        let h = sign(&s, "POST", "/guests", body);
        assert!(h.contains(",b="), "{h}");
        let a = v.verify_head(Some(&h), "POST", "/guests").unwrap();
        assert!(!a.expects_empty_body());
        assert_eq!(a.check_body(b"{}"), Err(AuthError::BodyMismatch));
        assert_eq!(a.check_body(body), Ok(()));
        // Without b= the body must be empty.
        let h = sign(&s, "GET", "/host", b"");
        assert!(!h.contains(",b="), "{h}");
        let a = v.verify_head(Some(&h), "GET", "/host").unwrap();
        assert!(a.expects_empty_body());
        assert_eq!(a.check_body(b"x"), Err(AuthError::BodyMismatch));
        // A b= the MAC did not cover, or one dropped, fails the MAC.
        let h = sign(&s, "POST", "/guests", body);
        let cut = h.split(",b=").next().unwrap();
        assert_eq!(
            v.verify_head(Some(cut), "POST", "/guests").unwrap_err(),
            AuthError::BadMac
        );
        let twice = format!("{h},b={}", "0".repeat(64));
        assert_eq!(
            v.verify_head(Some(&twice), "POST", "/guests").unwrap_err(),
            AuthError::Malformed
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

    #[test]
    fn a_login_link_opens_once_within_its_lifetime_and_only_for_its_cluster() {
        let s = secret(b"0123456789abcdef0123");
        let other = secret(b"0123456789abcdef0124");
        let v = Verifier::new(s.clone());
        let q = ui_login_query(&s);
        assert_eq!(v.verify_ui_login(Some(&q)), Ok(()));
        assert_eq!(
            v.verify_ui_login(Some(&q)),
            Err(AuthError::Replayed),
            "one login per link"
        );
        assert_eq!(
            v.verify_ui_login(Some(&ui_login_query(&other))),
            Err(AuthError::BadMac)
        );
        assert_eq!(v.verify_ui_login(None), Err(AuthError::Missing));
        // Expired: past the replay window.
        let q = ui_login_query(&s);
        assert!(matches!(
            v.verify_ui_login_at(Some(&q), unix_now() + MAX_SKEW_SECS + 5),
            Err(AuthError::Stale(_))
        ));
        // Tampered with, or with a field smuggled in: refused.
        let q = ui_login_query(&s);
        let t: u64 = q[2..q.find('&').unwrap()].parse().unwrap();
        let later = q.replacen(&format!("t={t}"), &format!("t={}", t + 30), 1);
        assert_eq!(v.verify_ui_login(Some(&later)), Err(AuthError::BadMac));
        for bad in [
            format!("{q}&t=1"),
            format!("{q}&x=1"),
            format!("{q},b=00"),
            "t=1".to_string(),
        ] {
            assert_eq!(
                v.verify_ui_login(Some(&bad)),
                Err(AuthError::Malformed),
                "{bad}"
            );
        }
        // A signed request is not a login link for another path.
        let h = sign(&s, "GET", "/host", b"");
        let p = parse(&h).unwrap();
        let q = format!("t={}&n={}&m={}", p.t, hex(&p.n), hex(&p.m));
        assert_eq!(v.verify_ui_login(Some(&q)), Err(AuthError::BadMac));
    }

    #[test]
    fn the_scrape_token_opens_only_for_its_cluster() {
        let s = Secret::from_bytes(b"0123456789abcdef0123", "test").unwrap();
        let other = Secret::from_bytes(b"another-cluster-secret!", "test").unwrap();
        let v = Verifier::new(s.clone());
        let t = scrape_token(&s);
        assert_eq!(t.len(), 64);
        assert!(v.is_scrape_token(Some(format!("Bearer {t}").as_str())));
        assert!(!v.is_scrape_token(Some(format!("Bearer {}", scrape_token(&other)).as_str())));
        assert!(!v.is_scrape_token(Some(t.as_str())));
        assert!(!v.is_scrape_token(Some("Bearer 00")));
        assert!(!v.is_scrape_token(None));
        // Not the secret, not a request's MAC.
        assert!(!t.contains(&hex(s.expose())));
    }
}
