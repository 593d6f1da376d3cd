//! `pagefleet cert init/issue` write a CA and identities that load, in the
//! file names QEMU and libnbd read; init never overwrites a CA; bad input
//! is refused with a message that says what to do.

use std::process::Command;

fn pf(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args(args)
        .output()
        .expect("run pagefleet");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn cert_init_and_issue_write_identities_that_load() {
    let d = std::env::temp_dir().join(format!("pf-cert-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let (ca, out) = (d.join("ca"), d.join("h2"));
    let (ca_s, out_s) = (ca.to_str().unwrap(), out.to_str().unwrap());
    let (ok, said) = pf(&["cert", "init", "--ca-dir", ca_s]);
    assert!(ok, "{said}");
    let (ok, said) = pf(&["cert", "init", "--ca-dir", ca_s]);
    assert!(!ok && said.contains("already there"), "{said}");
    let (ok, said) = pf(&[
        "cert", "issue", "h2", "--ca-dir", ca_s, "--out", out_s, "--ip", "10.0.0.2",
    ]);
    assert!(ok, "{said}");
    for f in [
        "ca-cert.pem",
        "server-cert.pem",
        "server-key.pem",
        "client-cert.pem",
        "client-key.pem",
    ] {
        assert!(out.join(f).exists(), "no {f}");
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(out.join("server-key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "a key readable by others: {mode:o}");
    let id = pagefleet_tls::Identity::load(&out).expect("the identity loads");
    assert_eq!(id.name, "h2");
    // Bad input: a name that is not a DNS name, a CA that is not there.
    let (ok, said) = pf(&[
        "cert",
        "issue",
        "bad name!",
        "--ca-dir",
        ca_s,
        "--out",
        out_s,
    ]);
    assert!(!ok && said.contains("not a DNS name"), "{said}");
    let (ok, said) = pf(&[
        "cert",
        "issue",
        "h3",
        "--ca-dir",
        "/nonexistent",
        "--out",
        out_s,
    ]);
    assert!(!ok && said.contains("ca-key.pem"), "{said}");
    // The identity works as a CLI flag; a broken one is refused up front.
    let (ok, said) = pf(&["--tls-dir", "/nonexistent", "gc", "--dry-run"]);
    assert!(!ok && said.contains("--tls-dir"), "{said}");
    let _ = std::fs::remove_dir_all(&d);
}
