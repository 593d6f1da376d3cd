//! The cluster CA and the certificates it issues (`pagefleet cert init` /
//! `pagefleet cert issue`).
//!
//! An identity directory uses the file names QEMU's `tls-creds-x509` and
//! GnuTLS tools (nbdinfo's `tls-certificates=`) read, so the same directory
//! serves pagefleet and those clients: `ca-cert.pem`, `server-cert.pem`,
//! `server-key.pem`, `client-cert.pem`, `client-key.pem`. pagefleet issues one
//! key and certificate per identity, good for both roles (a host serves and
//! connects), so the server and client files hold the same certificate.
//! The CA directory holds `ca-cert.pem` and `ca-key.pem` (mode 0600).

use crate::TlsError;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The CA's certificate, in the CA and in every identity directory.
pub const CA_CERT: &str = "ca-cert.pem";
/// The CA's private key (CA directory only).
pub const CA_KEY: &str = "ca-key.pem";
/// This identity's certificate as a server.
pub const SERVER_CERT: &str = "server-cert.pem";
/// This identity's key as a server.
pub const SERVER_KEY: &str = "server-key.pem";
/// This identity's certificate as a client (the same certificate).
pub const CLIENT_CERT: &str = "client-cert.pem";
/// This identity's key as a client (the same key).
pub const CLIENT_KEY: &str = "client-key.pem";

/// A CA's subject: a fixed name tagged with its key's fingerprint, so two
/// clusters' CAs never share a name (a peer of another cluster is then
/// "unknown issuer", not a bad signature) and issuing rebuilds it from the key.
fn ca_name(key: &KeyPair) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(key.public_key_raw());
    let tag = pagefleet_proto::auth::hex(&d[..6]);
    format!("pagefleet cluster CA {tag}")
}

/// Create a cluster CA in `dir` (refuses to overwrite one).
pub fn init_ca(dir: &Path) -> Result<PathBuf, TlsError> {
    let cert_path = dir.join(CA_CERT);
    if cert_path.exists() || dir.join(CA_KEY).exists() {
        return Err(TlsError::Exists(cert_path));
    }
    std::fs::create_dir_all(dir).map_err(|e| TlsError::io(dir, e))?;
    let key = KeyPair::generate()?;
    let cert = ca_params(&key, 10)?.self_signed(&key)?;
    write_file(&dir.join(CA_KEY), key.serialize_pem().as_bytes(), 0o600)?;
    write_file(&cert_path, cert.pem().as_bytes(), 0o644)?;
    Ok(cert_path)
}

/// What a new certificate is for.
#[derive(Clone, Debug, Default)]
pub struct IssueRequest {
    /// Its common name (a host name, or a person's for a CLI identity).
    pub name: String,
    /// DNS names it may serve as (besides `name` and `localhost`).
    pub dns: Vec<String>,
    /// Addresses it may serve at (besides 127.0.0.1 and ::1).
    pub ips: Vec<IpAddr>,
    /// Years it stays valid.
    pub years: u16,
}

impl IssueRequest {
    /// A certificate for `name` (and localhost), valid for 5 years.
    pub fn named(name: &str) -> IssueRequest {
        IssueRequest {
            name: name.to_string(),
            years: 5,
            ..Default::default()
        }
    }
}

/// A whole small cluster under `dir`: a CA in `dir/ca` and one identity per
/// name in `dir/NAME` (their directories, in order). For tests, benchmarks
/// and labs on one machine.
pub fn cluster(dir: &Path, names: &[&str]) -> Result<Vec<PathBuf>, TlsError> {
    let ca = dir.join("ca");
    init_ca(&ca)?;
    names
        .iter()
        .map(|n| {
            let out = dir.join(n);
            issue(&ca, &IssueRequest::named(n), &out)?;
            Ok(out)
        })
        .collect()
}

/// Issue a key and certificate signed by the CA in `ca_dir` into the identity
/// directory `out` (created; existing certificate files are replaced, which
/// is how a host is re-issued).
pub fn issue(ca_dir: &Path, req: &IssueRequest, out: &Path) -> Result<(), TlsError> {
    if req.name.is_empty() {
        return Err(TlsError::BadName("a certificate needs a name".into()));
    }
    let ca_key_pem = read_file(&ca_dir.join(CA_KEY))?;
    let ca_cert_pem = read_file(&ca_dir.join(CA_CERT))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem)?;
    // The issuer is the CA's name and key; rebuilding its certificate from
    // them signs exactly as the stored one would.
    let ca = ca_params(&ca_key, 10)?.self_signed(&ca_key)?;

    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, req.name.clone());
    dn.push(DnType::OrganizationName, "pagefleet");
    p.distinguished_name = dn;
    let mut dns = vec![req.name.clone(), "localhost".to_string()];
    dns.extend(req.dns.iter().cloned());
    dns.dedup();
    for d in dns {
        // A name that is an address goes in as one.
        if let Ok(ip) = d.parse::<IpAddr>() {
            p.subject_alt_names.push(SanType::IpAddress(ip));
            continue;
        }
        let bad = || {
            TlsError::BadName(format!(
                "{d:?} is not a DNS name (letters, digits and '-' in dot-separated labels)"
            ))
        };
        if !is_dns_name(&d) {
            return Err(bad());
        }
        let n = d.clone().try_into().map_err(|_| bad())?;
        p.subject_alt_names.push(SanType::DnsName(n));
    }
    let mut ips: Vec<IpAddr> = vec!["127.0.0.1".parse().unwrap(), "::1".parse().unwrap()];
    ips.extend(req.ips.iter().copied());
    ips.dedup();
    p.subject_alt_names
        .extend(ips.into_iter().map(SanType::IpAddress));
    // GnuTLS (QEMU) checks these when the extension is critical, as rcgen makes it.
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    p.is_ca = IsCa::ExplicitNoCa;
    p.use_authority_key_identifier_extension = true;
    p.serial_number = Some(random_serial());
    set_validity(&mut p, req.years.max(1));
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, &ca, &ca_key)?;

    std::fs::create_dir_all(out).map_err(|e| TlsError::io(out, e))?;
    write_file(&out.join(CA_CERT), ca_cert_pem.as_bytes(), 0o644)?;
    for (c, k) in [(SERVER_CERT, SERVER_KEY), (CLIENT_CERT, CLIENT_KEY)] {
        write_file(&out.join(k), key.serialize_pem().as_bytes(), 0o600)?;
        write_file(&out.join(c), cert.pem().as_bytes(), 0o644)?;
    }
    Ok(())
}

/// A host name peers may dial: dot-separated labels of letters, digits
/// and inner hyphens, each at most 63 bytes, 253 in all.
fn is_dns_name(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

fn ca_params(key: &KeyPair, years: u16) -> Result<CertificateParams, TlsError> {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, ca_name(key));
    dn.push(DnType::OrganizationName, "pagefleet");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    // Fixed validity so the rebuilt issuer matches (only name and key matter
    // for signing, but keep the rebuilt one plausible).
    set_validity(&mut p, years);
    Ok(p)
}

/// Valid from the start of last year for `years` years after this one.
fn set_validity(p: &mut CertificateParams, years: u16) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Civil year of `now`, good to a day (all we need for whole-year bounds).
    let year = 1970 + (now / 31_556_952) as i32;
    p.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    p.not_after = rcgen::date_time_ymd(year + years as i32, 12, 31);
}

fn random_serial() -> SerialNumber {
    let mut b = [0u8; 16];
    getrandom::getrandom(&mut b).expect("getrandom");
    b[0] &= 0x7f; // positive
    SerialNumber::from_slice(&b)
}

pub(crate) fn read_file(p: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(p).map_err(|e| TlsError::io(p, e))
}

fn write_file(p: &Path, data: &[u8], mode: u32) -> Result<(), TlsError> {
    // Write beside it and rename: a crash never leaves half a key.
    let tmp = p.with_extension("pem.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(|e| TlsError::io(&tmp, e))?;
    f.write_all(data)
        .and_then(|_| f.sync_all())
        .map_err(|e| TlsError::io(&tmp, e))?;
    std::fs::rename(&tmp, p).map_err(|e| TlsError::io(p, e))
}
