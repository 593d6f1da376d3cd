//! Cluster-secret authentication: an HMAC-SHA256 challenge/response in both
//! directions, so a client proves it holds the secret and the server proves
//! it too (a client never pages to an impostor). The secret never crosses the
//! wire.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::Write;
use std::path::{Path, PathBuf};

type HmacSha256 = Hmac<Sha256>;

/// Environment variable holding a literal secret (overrides any file).
pub const SECRET_ENV: &str = "PAGEFLEET_SECRET";
/// Environment variable naming the secret file.
pub const SECRET_FILE_ENV: &str = "PAGEFLEET_SECRET_FILE";
/// Secrets shorter than this are refused: they would be guessable.
pub const MIN_SECRET_LEN: usize = 16;

/// The cluster secret (never printed, never sent).
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes>)", self.0.len())
    }
}

/// Why the secret could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// No secret file.
    #[error(
        "no cluster secret at {path}: start pagefleetd once on this host (it creates one), \
         copy the cluster's secret file there, or point --secret-file / ${SECRET_FILE_ENV} at it"
    )]
    Missing {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The file could not be read.
    #[error("cannot read cluster secret {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file could not be created.
    #[error("cannot create cluster secret {path}: {source}")]
    Create {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The secret is too short to be safe.
    #[error("cluster secret {origin} is {len} bytes; use at least {MIN_SECRET_LEN} (e.g. `head -c32 /dev/urandom | xxd -p -c64`)")]
    TooShort {
        /// Where it came from.
        origin: String,
        /// Its length.
        len: usize,
    },
}

impl Secret {
    /// A secret from its bytes (surrounding whitespace trimmed); `origin` names it in errors.
    pub fn from_bytes(b: &[u8], origin: &str) -> Result<Secret, SecretError> {
        let t = trim(b);
        if t.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort {
                origin: origin.to_string(),
                len: t.len(),
            });
        }
        Ok(Secret(t.to_vec()))
    }

    /// A fresh random secret (64 hex characters).
    pub fn generate() -> Secret {
        Secret(Self::generate_hex().into_bytes())
    }

    /// 64 random hex characters, the form secret files take.
    pub fn generate_hex() -> String {
        let mut raw = [0u8; 32];
        getrandom::getrandom(&mut raw).expect("getrandom");
        hex(&raw)
    }

    /// Where the secret lives when nothing says otherwise:
    /// `$PAGEFLEET_SECRET_FILE`, else `/etc/pagefleet/secret` for root,
    /// else `~/.config/pagefleet/secret`.
    pub fn default_path() -> PathBuf {
        if let Some(p) = std::env::var_os(SECRET_FILE_ENV) {
            return PathBuf::from(p);
        }
        if crate::sys::is_root() {
            return PathBuf::from("/etc/pagefleet/secret");
        }
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."));
        home.join(".config/pagefleet/secret")
    }

    /// Resolve the secret a client should use: `$PAGEFLEET_SECRET`, else the
    /// given file, else the default file.
    pub fn resolve(file: Option<&Path>) -> Result<Secret, SecretError> {
        if let Some(v) = std::env::var_os(SECRET_ENV) {
            return Secret::from_bytes(v.as_encoded_bytes(), &format!("${SECRET_ENV}"));
        }
        let path = file
            .map(Path::to_path_buf)
            .unwrap_or_else(Secret::default_path);
        Secret::load(&path)
    }

    /// Read the secret file at `path`.
    pub fn load(path: &Path) -> Result<Secret, SecretError> {
        match std::fs::read(path) {
            Ok(b) => Secret::from_bytes(&b, &path.display().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(SecretError::Missing {
                path: path.to_path_buf(),
            }),
            Err(source) => Err(SecretError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// For the daemon: use the secret (env, file) or create the file with a
    /// fresh secret, mode 0600. Returns the secret and whether it was created.
    pub fn load_or_create(file: Option<&Path>) -> Result<(Secret, bool), SecretError> {
        if std::env::var_os(SECRET_ENV).is_some() {
            return Secret::resolve(None).map(|s| (s, false));
        }
        let path = file
            .map(Path::to_path_buf)
            .unwrap_or_else(Secret::default_path);
        match Secret::load(&path) {
            Ok(s) => Ok((s, false)),
            Err(SecretError::Missing { .. }) => {
                let s = Secret::generate();
                let create = |p: &Path| -> std::io::Result<()> {
                    if let Some(dir) = p.parent() {
                        std::fs::create_dir_all(dir)?;
                    }
                    use std::os::unix::fs::OpenOptionsExt;
                    let mut f = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(p)?;
                    f.write_all(&s.0)?;
                    f.write_all(b"\n")
                };
                match create(&path) {
                    Ok(()) => Ok((s, true)),
                    // Another daemon created it between our read and create: use theirs.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        Secret::load(&path).map(|s| (s, false))
                    }
                    Err(source) => Err(SecretError::Create { path, source }),
                }
            }
            Err(e) => Err(e),
        }
    }

    fn mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("hmac accepts any key length");
        m.update(label);
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// The client's proof: HMAC(secret, "pagefleet/1 client" | server_nonce | client_nonce | server_id).
    pub fn client_mac(
        &self,
        server_nonce: &[u8; 32],
        client_nonce: &[u8; 32],
        server_id: u64,
    ) -> [u8; 32] {
        self.mac(
            b"pagefleet/1 client",
            &[server_nonce, client_nonce, &server_id.to_le_bytes()],
        )
    }

    /// The server's proof: HMAC(secret, "pagefleet/1 server" | client_nonce | server_nonce | server_id).
    pub fn server_mac(
        &self,
        server_nonce: &[u8; 32],
        client_nonce: &[u8; 32],
        server_id: u64,
    ) -> [u8; 32] {
        self.mac(
            b"pagefleet/1 server",
            &[client_nonce, server_nonce, &server_id.to_le_bytes()],
        )
    }
}

impl Secret {
    /// The MAC of one signed HTTP request to a pagefleetd:
    /// HMAC(secret, "pagefleet/1 http" | method | path | time | nonce | SHA-256(body)),
    /// each part length-prefixed so no two requests share a message.
    pub fn http_mac(
        &self,
        method: &str,
        path: &str,
        unix_secs: u64,
        nonce: &[u8; 16],
        body: &[u8],
    ) -> [u8; 32] {
        use sha2::Digest;
        let body_hash: [u8; 32] = Sha256::digest(body).into();
        self.http_mac_hashed(method, path, unix_secs, nonce, &body_hash)
    }

    /// [`Secret::http_mac`] given the body's SHA-256 (a daemon checks the
    /// head's signature before it reads the body the head names).
    pub fn http_mac_hashed(
        &self,
        method: &str,
        path: &str,
        unix_secs: u64,
        nonce: &[u8; 16],
        body_hash: &[u8; 32],
    ) -> [u8; 32] {
        let m = method.as_bytes();
        let p = path.as_bytes();
        self.mac(
            b"pagefleet/1 http",
            &[
                &(m.len() as u32).to_le_bytes(),
                m,
                &(p.len() as u32).to_le_bytes(),
                p,
                &unix_secs.to_le_bytes(),
                nonce,
                body_hash,
            ],
        )
    }

    /// The bearer token that opens `GET /metrics` (and nothing else) on
    /// every pagefleetd of the cluster: HMAC(secret, "pagefleet/1 metrics
    /// scrape"). A Prometheus holds it instead of the secret; it cannot be
    /// turned back into the secret or into any other request's MAC (those
    /// have other labels).
    pub fn scrape_token(&self) -> [u8; 32] {
        self.mac(b"pagefleet/1 metrics scrape", &[])
    }

    /// The secret itself, for handing to a child process over a pipe
    /// (never on a command line or in the environment).
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

/// Constant-time comparison of two MACs.
pub fn macs_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// 32 random bytes from the OS.
pub fn random_nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    getrandom::getrandom(&mut n).expect("getrandom");
    n
}

/// A random u64 from the OS.
pub fn random_u64() -> u64 {
    let mut n = [0u8; 8];
    getrandom::getrandom(&mut n).expect("getrandom");
    u64::from_le_bytes(n)
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &b[start..end]
}

/// Lowercase hex of `b`: how secrets, nonces, MACs and session ids are
/// written wherever they are text.
pub fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(2 * b.len());
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn macs_differ_by_secret_and_direction() {
        let a = Secret::from_bytes(b"0123456789abcdef0123", "t").unwrap();
        let b = Secret::from_bytes(b"0123456789abcdef0124", "t").unwrap();
        let (sn, cn) = ([1u8; 32], [2u8; 32]);
        assert!(macs_equal(
            &a.client_mac(&sn, &cn, 7),
            &a.client_mac(&sn, &cn, 7)
        ));
        assert!(!macs_equal(
            &a.client_mac(&sn, &cn, 7),
            &b.client_mac(&sn, &cn, 7)
        ));
        assert!(!macs_equal(
            &a.client_mac(&sn, &cn, 7),
            &a.server_mac(&sn, &cn, 7)
        ));
        assert!(!macs_equal(
            &a.client_mac(&sn, &cn, 7),
            &a.client_mac(&sn, &cn, 8)
        ));
    }
    #[test]
    fn short_secret_refused() {
        assert!(matches!(
            Secret::from_bytes(b"  short \n", "t"),
            Err(SecretError::TooShort { len: 5, .. })
        ));
    }
}
