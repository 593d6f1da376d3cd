//! An identity: this process's certificate and key plus the cluster CA, as
//! rustls server and client configurations. Both sides prove themselves:
//! a server asks every client for a certificate the cluster CA signed, and
//! a client checks the server's against the name it dialled.

use crate::certs::{read_file, CA_CERT, SERVER_CERT, SERVER_KEY};
use crate::TlsError;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A loaded identity directory (see [`crate::certs`] for its files).
pub struct Identity {
    /// Where it was loaded from.
    pub dir: PathBuf,
    /// The certificate's common name (shown in logs).
    pub name: String,
    pub(crate) server: Arc<ServerConfig>,
    pub(crate) client: Arc<ClientConfig>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("dir", &self.dir)
            .field("name", &self.name)
            .finish()
    }
}

/// ring's suites with AES-128-GCM first: as safe for cluster traffic and
/// about a third cheaper per byte than AES-256 (fewer rounds), which is
/// what page traffic over TLS is bound by.
fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    let rank = |s: &rustls::SupportedCipherSuite| match s.suite() {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
        rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 => 1,
        _ => 2,
    };
    p.cipher_suites.sort_by_key(rank);
    Arc::new(p)
}

impl Identity {
    /// The rustls server configuration (clients must present a certificate
    /// the cluster CA signed), for servers on other I/O stacks (tokio).
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    /// The rustls client configuration (presents this identity).
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }

    /// Load `dir`: `ca-cert.pem`, `server-cert.pem`, `server-key.pem`.
    pub fn load(dir: &Path) -> Result<Identity, TlsError> {
        let ca_pem = read_file(&dir.join(CA_CERT))?;
        let cert_pem = read_file(&dir.join(SERVER_CERT))?;
        let key_pem = read_file(&dir.join(SERVER_KEY))?;
        let bad = |file: &str, what: String| TlsError::BadFile {
            path: dir.join(file),
            what,
        };
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            let c = c.map_err(|e| bad(CA_CERT, e.to_string()))?;
            roots
                .add(c)
                .map_err(|e| bad(CA_CERT, format!("not a CA certificate: {e}")))?;
        }
        if roots.is_empty() {
            return Err(bad(CA_CERT, "holds no certificate".into()));
        }
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| bad(SERVER_CERT, e.to_string()))?;
        if chain.is_empty() {
            return Err(bad(SERVER_CERT, "holds no certificate".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| bad(SERVER_KEY, e.to_string()))?;
        let roots = Arc::new(roots);
        let p = provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), p.clone())
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let mut server = ServerConfig::builder_with_provider(p.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())?;
        // Connections are long-lived and few: no resumption tickets (they
        // would only be bytes a peer has to read after the handshake).
        server.send_tls13_tickets = 0;
        let client = ClientConfig::builder_with_provider(p)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain.clone(), key)?;
        Ok(Identity {
            dir: dir.to_path_buf(),
            name: common_name(&chain[0]).unwrap_or_else(|| "?".into()),
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

/// The subject's common name, found by its OID in the DER (enough for logs).
pub(crate) fn common_name(c: &CertificateDer<'_>) -> Option<String> {
    // OID 2.5.4.3, then a string tag and a short length. The first match is
    // the issuer's CN; the subject's is the last.
    let d = c.as_ref();
    let oid = [0x06, 0x03, 0x55, 0x04, 0x03];
    let mut found = None;
    let mut i = 0;
    while i + oid.len() + 2 <= d.len() {
        if d[i..i + oid.len()] == oid {
            let len = d[i + oid.len() + 1] as usize;
            let s = i + oid.len() + 2;
            if len < 0x80 && s + len <= d.len() {
                found = std::str::from_utf8(&d[s..s + len]).ok().map(str::to_string);
            }
        }
        i += 1;
    }
    found
}
