//! `make install` (issue 51, item 6) into a staging tree (`DESTDIR`), from
//! what `make build` built: the binaries, the VM shim where the runners look
//! for it, the systemd unit (`systemd-analyze verify` accepts it), the
//! sample config, the docs, the manual pages and the completions. Then the
//! installed pagefleetd starts from the installed config (its addresses
//! changed to loopback, as an operator changes them), tells systemd it is
//! ready, and the installed CLI reads its report.

use pagefleet_systest::*;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(cmd: &mut Command) -> (bool, String) {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

#[test]
fn make_install_stages_a_tree_whose_daemon_starts_and_whose_unit_verifies() {
    if !is_root() {
        eprintln!("skipped: systemd-analyze and the daemon's start need root (CI runs as root)");
        return;
    }
    let dest = tempdir("install");
    let d = dest.path().to_path_buf();
    let (ok, out) = run(Command::new("make")
        .arg("-C")
        .arg(repo())
        .arg("install")
        .arg(format!("DESTDIR={}", d.display()))
        .arg("PREFIX=/usr/local"));
    assert!(ok, "make install failed:\n{out}");
    let p = |rel: &str| d.join(rel.trim_start_matches('/'));
    for f in [
        "/usr/local/bin/pagefleet",
        "/usr/local/bin/pagefleetd",
        "/usr/local/bin/pagefleet-runner",
        "/usr/local/lib/pagefleet/libpagefleet_vmshim.so",
        "/usr/local/lib/systemd/system/pagefleetd.service",
        "/etc/pagefleet/pagefleetd.toml",
        "/usr/local/share/doc/pagefleet/README.md",
        "/usr/local/share/doc/pagefleet/docs/architecture.md",
        "/usr/local/share/man/man1/pagefleet.1",
        "/usr/local/share/man/man1/pagefleet-guest-start.1",
        "/usr/local/share/man/man8/pagefleetd.8",
        "/usr/local/share/bash-completion/completions/pagefleet",
        "/usr/local/share/zsh/vendor-completions/_pagefleet",
        "/usr/local/share/fish/vendor_completions.d/pagefleet.fish",
    ] {
        let m = std::fs::metadata(p(f)).unwrap_or_else(|e| panic!("{f} not installed: {e}\n{out}"));
        assert!(m.len() > 0, "{f} is empty");
    }
    let man8 = std::fs::read_to_string(p("/usr/local/share/man/man8/pagefleetd.8")).unwrap();
    assert!(man8.contains(".TH pagefleetd 8"), "{man8}");
    assert!(man8.contains("lend"), "the page documents the flags");
    let unit =
        std::fs::read_to_string(p("/usr/local/lib/systemd/system/pagefleetd.service")).unwrap();
    assert!(
        unit.contains(
            "ExecStart=/usr/local/bin/pagefleetd --config /etc/pagefleet/pagefleetd.toml"
        ),
        "{unit}"
    );
    assert!(unit.contains("Type=notify"), "{unit}");
    verify_unit(&unit, &d);

    // The installed daemon from the installed config, addresses on loopback.
    let conf = p("/etc/pagefleet/pagefleetd.toml");
    let text = std::fs::read_to_string(&conf).unwrap();
    let text = text
        .replace("0.0.0.0:7070", "127.0.0.1:0")
        .replace("0.0.0.0:7071", "127.0.0.1:0")
        .replace(
            "/etc/pagefleet/secret",
            &p("/etc/pagefleet/secret").display().to_string(),
        )
        .replace(
            "/run/pagefleet/guests",
            &d.join("guests").display().to_string(),
        )
        .replace(
            "/usr/local/bin/pagefleet",
            &p("/usr/local/bin/pagefleet").display().to_string(),
        )
        .replace("join = \"10.0.0.1:7071\"", "")
        .replace("lend = \"4GiB\"", "lend = \"16MiB\"")
        .replace("memory = \"16GiB\"", "memory = \"64MiB\"");
    std::fs::write(&conf, text).unwrap();
    let sock = d.join("notify.sock");
    let rx = UnixDatagram::bind(&sock).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut daemon = Child(
        Command::new(p("/usr/local/bin/pagefleetd"))
            .arg("--config")
            .arg(&conf)
            .env("NOTIFY_SOCKET", &sock)
            .env_remove("PAGEFLEET_SECRET")
            .env_remove("PAGEFLEET_SECRET_FILE")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(d.join("pagefleetd.log")).unwrap())
            .spawn()
            .expect("the installed pagefleetd"),
    );
    let mut lines = BufReader::new(daemon.0.stdout.take().unwrap()).lines();
    let mut http = None;
    for l in lines.by_ref().take(2) {
        let l = l.unwrap();
        if let Some(a) = l.strip_prefix("metrics ") {
            http = Some(a.to_string());
        }
    }
    let http = http.expect("the daemon printed its HTTP address");
    let mut buf = [0u8; 256];
    let n = rx.recv(&mut buf).expect("READY=1 within 60 s");
    assert!(String::from_utf8_lossy(&buf[..n])
        .lines()
        .any(|l| l == "READY=1"));
    let (ok, out) = run(Command::new(p("/usr/local/bin/pagefleet"))
        .args(["status", "--json", "--hosts", &http])
        .arg("--secret-file")
        .arg(p("/etc/pagefleet/secret")));
    assert!(ok, "the installed CLI against the installed daemon:\n{out}");
    assert!(
        out.contains("\"guest_memory\"") || out.contains("guest"),
        "{out}"
    );
}

/// `systemd-analyze verify` on `unit` as staged under `root`: every
/// directive known, every command there and executable. (Its `--root`
/// would also want the whole system's units in the staged tree, so the
/// unit is checked as a copy whose commands point into the tree.)
fn verify_unit(unit: &str, root: &Path) {
    let dir = tempdir("unit");
    let staged = unit
        .lines()
        .map(|l| match l.split_once('=') {
            Some((k @ ("ExecStart" | "ExecReload"), cmd)) if cmd.starts_with("/usr/") => {
                format!("{k}={}{cmd}", root.display())
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let path = dir.path().join("pagefleetd.service");
    std::fs::write(&path, staged).unwrap();
    let (ok, out) = run(Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&path));
    assert!(
        ok && !out.contains("pagefleetd.service"),
        "systemd-analyze verify:\n{out}"
    );
}

/// A child process killed (and reaped) on drop.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn make_deb_builds_a_package_that_unpacks_to_a_tree_systemd_accepts() {
    if !is_root() {
        eprintln!("skipped: needs root (CI runs as root)");
        return;
    }
    let (ok, out) = run(Command::new("make").arg("-C").arg(repo()).arg("deb"));
    assert!(ok, "make deb failed:\n{out}");
    let deb = std::fs::read_dir(repo().join("target"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("pagefleet_") && n.ends_with(".deb"))
        })
        .expect("target/pagefleet_VERSION_ARCH.deb");
    let (ok, info) = run(Command::new("dpkg-deb").arg("--info").arg(&deb));
    assert!(ok && info.contains("Package: pagefleet"), "{info}");
    let (ok, files) = run(Command::new("dpkg-deb").arg("--contents").arg(&deb));
    assert!(ok, "{files}");
    for f in [
        "./usr/bin/pagefleetd",
        "./usr/bin/pagefleet",
        "./usr/bin/pagefleet-runner",
        "./usr/lib/pagefleet/libpagefleet_vmshim.so",
        "./usr/lib/systemd/system/pagefleetd.service",
        "./etc/pagefleet/pagefleetd.toml",
        "./usr/share/man/man8/pagefleetd.8",
    ] {
        assert!(
            files.lines().any(|l| l.ends_with(f)),
            "{f} not in the package:\n{files}"
        );
    }
    assert!(
        files
            .lines()
            .filter(|l| l.contains("./usr/"))
            .all(|l| l.contains("root/root")),
        "files owned by root:\n{files}"
    );
    let root = tempdir("deb");
    let (ok, out) = run(Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(root.path()));
    assert!(ok, "{out}");
    let unit = root
        .path()
        .join("usr/lib/systemd/system/pagefleetd.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    assert!(text.contains("ExecStart=/usr/bin/pagefleetd "), "{text}");
    verify_unit(&text, root.path());
    let (ok, out) = run(Command::new(root.path().join("usr/bin/pagefleetd")).arg("--version"));
    assert!(ok && out.starts_with("pagefleetd "), "{out}");
}
