//! The DMPS block device over NBD, checked with clients nobody on this team
//! wrote: qemu-io / qemu-img (QEMU), nbdinfo / nbdcopy (libnbd), fio's nbd
//! engine with verification — plus a raw client for the error paths, and a
//! mirror that loses a memory server mid-run.

use pagefleet_systest::*;
use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};

struct Export {
    child: Child,
    uri: String,
    addr: String,
}

impl Drop for Export {
    fn drop(&mut self) {
        // SIGTERM: the export deletes its blocks and exits.
        let _ = pagefleet_common::sys::process::signal(self.child.id() as i32, libc::SIGTERM);
        let _ = self.child.wait();
    }
}

fn have(tool: &str) -> bool {
    pagefleet_lab::proc::which(tool).is_ok()
}

/// `pagefleet blockdev serve` over `servers`, a device of `size`, at `listen`.
fn serve_cmd(c: &Cluster, servers: &[String], size: &str, listen: &str) -> Command {
    let mut cmd = Command::new(bin("pagefleet"));
    cmd.arg("--secret-file").arg(&c.secret_file).args([
        "blockdev",
        "serve",
        "--servers",
        &servers.join(","),
        "--size",
        size,
        "--listen",
        listen,
    ]);
    cmd
}

fn export(c: &Cluster, servers: &[String], size: &str, extra: &[&str]) -> Export {
    let port = pagefleet_lab::proc::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let child = spawn_listening(
        serve_cmd(c, servers, size, &addr)
            .args(extra)
            .stderr(Stdio::inherit()),
    );
    Export {
        child,
        uri: format!("nbd://{addr}"),
        addr,
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed: {text}");
    text
}

fn random_file(dir: &std::path::Path, name: &str, bytes: usize, seed: u64) -> std::path::PathBuf {
    let mut x = seed | 1;
    let mut v = vec![0u8; bytes];
    for w in v.chunks_exact_mut(8) {
        w.copy_from_slice(&xorshift(&mut x).to_le_bytes());
    }
    let p = dir.join(name);
    std::fs::write(&p, v).unwrap();
    p
}

#[test]
fn qemu_and_libnbd_clients_write_and_read_back() {
    if !have("qemu-io") || !have("nbdcopy") {
        panic!("qemu-utils and libnbd-bin are needed (make deps installs them)");
    }
    let c = Cluster::start(2, "96MiB");
    let e = export(&c, &c.addrs(), "128MiB", &[]);
    // nbdinfo: size, block sizes, multi-conn.
    let info = run(Command::new("nbdinfo").arg(&e.uri));
    assert!(info.contains("export-size: 134217728"), "{info}");
    assert!(
        info.contains("can_multi_conn: true") && info.contains("block_size_minimum: 4096"),
        "{info}"
    );
    // qemu-io: patterns at both ends of the device (both servers), then read back.
    let out = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x5a 0 2M",
        "-c",
        "write -P 0xa5 120M 8M",
        "-c",
        "read -P 0x5a 0 2M",
        "-c",
        "read -P 0xa5 120M 8M",
        "-c",
        "read -P 0 64M 1M",
        &e.uri,
    ]));
    assert!(!out.contains("Pattern verification failed"), "{out}");
    // nbdcopy random data in (4 connections), out again, compare; qemu-img compare too.
    let dir = tempdir("nbd");
    let src = random_file(&dir, "src", 96 << 20, 7);
    run(Command::new("nbdcopy")
        .args(["--connections=4", "--requests=16"])
        .arg(&src)
        .arg(&e.uri));
    let back = dir.join("back");
    run(Command::new("nbdcopy").arg(&e.uri).arg(&back));
    let (a, b) = (std::fs::read(&src).unwrap(), std::fs::read(&back).unwrap());
    assert_eq!(b.len(), 128 << 20);
    assert!(a[..] == b[..a.len()], "data read back differs");
    // Past the copy: zeros, then qemu-io's 0xa5 pattern at 120 MiB.
    assert!(
        b[a.len()..120 << 20].iter().all(|x| *x == 0),
        "never-written blocks must read zeros"
    );
    assert!(
        b[120 << 20..].iter().all(|x| *x == 0xa5),
        "qemu-io's pattern is gone"
    );
    let full = dir.join("full");
    let mut f = a.clone();
    f.resize(120 << 20, 0);
    f.resize(128 << 20, 0xa5);
    std::fs::write(&full, f).unwrap();
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&full)
        .arg(&e.uri));
    // nbdsh (libnbd's Python shell): structured reads, zeroing, flush.
    // (nbdsh is `python3 -m nbd` with Debian's python3, which has the module.)
    if std::path::Path::new("/usr/bin/nbdsh").exists() {
        let script = "h.pwrite(b'\\x42' * 65536, 1 << 20); assert h.pread(65536, 1 << 20) == b'\\x42' * 65536; \
                      h.zero(65536, 1 << 20); assert h.pread(65536, 1 << 20) == bytes(65536); h.flush(); \
                      assert h.can_multi_conn() and h.get_size() == 128 << 20";
        run(Command::new("/usr/bin/python3").args(["-m", "nbd", "-u", &e.uri, "-c", script]));
    }
    // TRIM frees the blocks: they read as zeros.
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "discard 0 1M",
        "-c",
        "read -P 0 0 1M",
        &e.uri,
    ]));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fio_verifies_random_writes_through_its_nbd_engine() {
    if !have("fio") {
        panic!("fio is needed (make deps installs it)");
    }
    let c = Cluster::start(2, "64MiB");
    let e = export(
        &c,
        &c.addrs(),
        "96MiB",
        &["--layout", "stripe", "--stripe-unit", "64KiB"],
    );
    let out = run(Command::new("fio").args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri={}", e.uri),
        "--rw=randwrite",
        "--bs=4k,64k",
        "--bsrange=4k-128k",
        "--size=64M",
        "--iodepth=16",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        // No state file left behind in the working directory.
        "--verify_state_save=0",
        "--output-format=terse",
    ]));
    assert!(!out.to_lowercase().contains("verify: bad"), "{out}");
}

#[test]
fn mirror_survives_a_memory_server_killed_mid_run() {
    if !have("nbdcopy") {
        panic!("libnbd-bin is needed (make deps installs it)");
    }
    let mut c = Cluster::start(3, "64MiB");
    let e = export(&c, &c.addrs(), "64MiB", &["--mirror"]);
    let dir = tempdir("mirror");
    let src = random_file(&dir, "src", 64 << 20, 11);
    run(Command::new("nbdcopy").arg(&src).arg(&e.uri));
    // One server dies; every block still reads back from its other copy,
    // and writes go on to the surviving copies.
    c.servers[1].kill();
    let back = dir.join("back");
    run(Command::new("nbdcopy").arg(&e.uri).arg(&back));
    assert!(
        std::fs::read(&src).unwrap() == std::fs::read(&back).unwrap(),
        "mirror lost data with one server down"
    );
    let out = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x77 8M 4M",
        "-c",
        "read -P 0x77 8M 4M",
        &e.uri,
    ]));
    assert!(!out.contains("failed"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A raw client: errors for bad requests, the connection survives them; a
/// bad magic ends that connection only.
#[test]
fn bad_requests_get_protocol_errors_and_do_not_crash_the_server() {
    let c = Cluster::start(1, "16MiB");
    let e = export(&c, &c.addrs(), "8MiB", &[]);
    use pagefleet_lab::nbd::{go_body, option, option_reply, request, simple_reply};
    let mut s = pagefleet_lab::nbd::greet(&e.addr, std::time::Duration::from_secs(5)).unwrap();
    let reply = |s: &mut std::net::TcpStream| option_reply(s).unwrap();
    // An unknown option is refused, the haggling goes on.
    option(&mut s, 99, b"xyz").unwrap();
    assert_eq!(
        reply(&mut s).0,
        (1 << 31) + 1,
        "unknown option: NBD_REP_ERR_UNSUP"
    );
    // GO for an unknown export name.
    option(&mut s, 7, &go_body("nope")).unwrap();
    assert_eq!(
        reply(&mut s).0,
        (1 << 31) + 6,
        "unknown export: NBD_REP_ERR_UNKNOWN"
    );
    // GO for the default export, asking for block sizes.
    option(&mut s, 7, &go_body("")).unwrap();
    loop {
        let (ty, _) = reply(&mut s);
        if ty == 1 {
            break;
        }
        assert_eq!(ty, 3, "INFO replies then ACK");
    }
    let req = |s: &mut std::net::TcpStream, ty: u16, handle: u64, off: u64, len: u32| {
        s.write_all(&request(ty, handle, off, len)).unwrap();
    };
    let simple = |s: &mut std::net::TcpStream| simple_reply(s).unwrap();
    req(&mut s, 0, 1, 100, 4096); // unaligned
    assert_eq!(simple(&mut s), (22, 1));
    req(&mut s, 0, 2, 8 << 20, 4096); // past the end
    assert_eq!(simple(&mut s), (22, 2));
    req(&mut s, 4, 3, (8 << 20) - 4096, 8192); // trim past the end
    assert_eq!(simple(&mut s), (28, 3));
    req(&mut s, 99, 4, 0, 0); // unknown command
    assert_eq!(simple(&mut s), (22, 4));
    req(&mut s, 0, 5, 4096, 4096); // and a good read still works
    assert_eq!(simple(&mut s), (0, 5));
    let mut data = vec![1u8; 4096];
    s.read_exact(&mut data).unwrap();
    assert!(data.iter().all(|b| *b == 0));
    // Garbage instead of a request ends this connection...
    s.write_all(&[0xde; 28]).unwrap();
    let mut one = [0u8; 1];
    assert!(
        matches!(s.read(&mut one), Ok(0) | Err(_)),
        "the server should hang up on a bad magic"
    );
    // ...but not the server.
    let info = run(Command::new("nbdinfo").arg(&e.uri));
    assert!(info.contains("export-size: 8388608"), "{info}");
}

/// DMPS's use: swap for a guest with little memory. A QEMU (TCG) guest with
/// 128 MiB runs the "Sequential" test over 256 MiB — write it all, read
/// every value back — swapping to the export; then the same against a swap
/// disk image on local disk. Kernel and initramfs come from Debian packages
/// (crates/systest/guest/build.sh; `make test` builds them).
#[test]
fn a_small_guest_swaps_to_the_export_and_gets_every_value_back() {
    if !have("qemu-system-x86_64") {
        panic!("qemu-system-x86 is needed (make deps installs it)");
    }
    let guest = bin("pagefleet")
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("guest");
    if !guest.join("initrd.gz").exists() {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("guest/build.sh");
        run(Command::new(script).arg(&guest));
    }
    let boot = |drive: &str| -> (String, f64) {
        let t = std::time::Instant::now();
        let out = Command::new("timeout")
            .args([
                "600",
                "qemu-system-x86_64",
                "-accel",
                "tcg",
                "-m",
                "128",
                "-nographic",
                "-no-reboot",
            ])
            .arg("-kernel")
            .arg(guest.join("vmlinuz"))
            .arg("-initrd")
            .arg(guest.join("initrd.gz"))
            .args([
                "-append",
                "console=ttyS0 quiet memtest_mb=256 panic=-1",
                "-drive",
                drive,
            ])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            t.elapsed().as_secs_f64(),
        )
    };
    let check = |what: &str, out: &str| {
        assert!(out.contains("MEMTEST OK 256 MiB"), "{what}: {out}");
        let used: u64 = out
            .lines()
            .find_map(|l| {
                l.split("swap used ")
                    .nth(1)
                    .and_then(|x| x.split_whitespace().next())
                    .and_then(|x| x.parse().ok())
            })
            .unwrap_or(0);
        assert!(
            used >= 64,
            "{what}: the guest barely swapped ({used} MiB): {out}"
        );
    };
    let c = Cluster::start(2, "320MiB");
    let e = export(&c, &c.addrs(), "512MiB", &[]);
    let (out, secs) = boot(&format!("file={},format=raw,if=virtio", e.uri));
    check("swap on the DMPS export", &out);
    eprintln!("swap on the export: {secs:.1} s");
    let dir = tempdir("swapdisk");
    let img = dir.join("swap.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(512 << 20)
        .unwrap();
    let (out, secs) = boot(&format!("file={},format=raw,if=virtio", img.display()));
    check("swap on a local disk image", &out);
    eprintln!("swap on a local disk image: {secs:.1} s");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The export is out of strangers' reach: never on a network address, a
/// unix socket only its owner may open; too big a device says what fits.
#[test]
fn the_export_listens_only_where_strangers_cannot_reach() {
    let c = Cluster::start(2, "16MiB");
    let serve = |listen: &str, size: &str, extra: &[&str]| {
        serve_cmd(&c, &c.addrs(), size, listen)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = serve("0.0.0.0:0", "4MiB", &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loopback") && err.contains("0.0.0.0"), "{err}");
    // Too big for the servers, mirrored: bytes, and the largest size that fits.
    let out = serve("127.0.0.1:0", "24MiB", &["--mirror"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("24.00 MiB") && err.contains("16.00 MiB") && err.contains("--mirror"),
        "{err}"
    );
    // A unix socket is the owner's alone.
    let dir = tempdir("nbdsock");
    let sock = dir.join("nbd.sock");
    let mut child = spawn_listening(&mut serve_cmd(
        &c,
        &c.addrs(),
        "4MiB",
        &format!("unix:{}", sock.display()),
    ));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
}

/// NBD STARTTLS with real clients: QEMU (tls-creds-x509) and libnbd
/// (nbds://, tls-certificates) read the directory `pagefleet cert issue`
/// writes and talk TLS to the export; a client holding a certificate
/// another CA signed is refused; a plaintext client on loopback is still
/// served.
#[test]
fn qemu_and_libnbd_speak_tls_to_the_export_and_strangers_are_refused() {
    if !have("qemu-img") || !have("nbdinfo") {
        eprintln!("skipped: needs qemu-img and nbdinfo (make deps installs them)");
        return;
    }
    let c = Cluster::start(2, "32MiB");
    let dir = tempdir("nbdtls");
    let ids = pagefleet_tls::certs::cluster(&dir.join("ours"), &["export", "client"]).unwrap();
    let (server, client) = (ids[0].clone(), ids[1].clone());
    // Another cluster's certificate.
    let stranger =
        pagefleet_tls::certs::cluster(&dir.join("theirs"), &["stranger"]).unwrap()[0].clone();
    let e = export(
        &c,
        &c.addrs(),
        "16MiB",
        &["--tls-dir", server.to_str().unwrap()],
    );
    let (host, port) = e.addr.split_once(':').unwrap();

    // libnbd: nbds:// insists on TLS.
    let tls_uri =
        |d: &std::path::Path| format!("nbds://{}/?tls-certificates={}", e.addr, d.display());
    let info = run(Command::new("nbdinfo").arg(tls_uri(&client)));
    assert!(info.contains("16777216"), "{info}");
    let out = Command::new("nbdinfo")
        .arg(tls_uri(&stranger))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a stranger's certificate was accepted"
    );

    // QEMU writes a pattern over TLS and reads it back.
    let obj =
        |d: &std::path::Path| format!("tls-creds-x509,id=tls0,dir={},endpoint=client", d.display());
    let opts = format!("driver=nbd,host={host},port={port},tls-creds=tls0");
    run(Command::new("qemu-io")
        .args(["--object", &obj(&client), "--image-opts", &opts])
        .args(["-c", "write -P 0x5a 0 1M"]));
    let got = run(Command::new("qemu-io")
        .args(["--object", &obj(&client), "--image-opts", &opts])
        .args(["-c", "read -P 0x5a 0 1M"]));
    assert!(got.contains("read 1048576/1048576"), "{got}");
    let img = run(Command::new("qemu-img").args([
        "info",
        "--object",
        &obj(&client),
        "--image-opts",
        &opts,
    ]));
    assert!(img.contains("16 MiB"), "{img}");
    let out = Command::new("qemu-img")
        .args(["info", "--object", &obj(&stranger), "--image-opts", &opts])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "QEMU with a stranger's certificate got in"
    );

    // Plaintext from loopback is still served.
    let info = run(Command::new("nbdinfo").arg(&e.uri));
    assert!(info.contains("16777216"), "{info}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The promise the mirror makes: a write is acknowledged only after both
/// copies stored it. A client keeps 32 writes in flight over a mirrored
/// device while one of its memory servers is killed with SIGKILL; every
/// write that was acknowledged reads back, from before the kill and after.
#[test]
fn every_acknowledged_write_survives_a_mirror_server_killed_under_load() {
    const SLOTS: u64 = 512; // 32 MiB
    let mut c = Cluster::start(3, "64MiB");
    let e = export(&c, &c.addrs(), "32MiB", &["--mirror"]);
    let victim = &mut c.servers[1];
    let d = pagefleet_lab::nbd::mirror_drill(&e.addr, SLOTS, || victim.kill())
        .expect("the drill ran to its end");
    assert_eq!(d.writes, SLOTS);
    assert!(
        d.acknowledged > SLOTS / 2,
        "the mirror should go on writing with one server down ({} of {SLOTS} acknowledged)",
        d.acknowledged
    );
    assert_eq!(
        (d.lost, d.read_errors),
        (0, 0),
        "every acknowledged write reads back on a fresh connection: {d:?}"
    );
}

/// A client that sends reads and takes none of their replies holds up
/// nobody else: its replies wait in its own backlog, while another client
/// of the same memory server writes and reads back.
#[test]
fn a_client_that_reads_no_replies_holds_up_no_other_client() {
    use pagefleet_lab::nbd::{connect, request, simple_reply, CMD_READ, CMD_WRITE};
    let c = Cluster::start(1, "96MiB");
    let e = export(&c, &c.addrs(), "64MiB", &[]);
    let t = std::time::Duration::from_secs(10);
    // 16 MiB of data, so reads go to the memory server (holes would not).
    let mut a = connect(&e.addr, "", t).unwrap();
    let mib = vec![0x5au8; 1 << 20];
    for i in 0..16u64 {
        let mut b = request(CMD_WRITE, i, i << 20, 1 << 20);
        b.extend_from_slice(&mib);
        a.write_all(&b).unwrap();
        assert_eq!(simple_reply(&mut a).unwrap(), (0, i));
    }
    // 48 reads of 1 MiB, none of whose replies is read: far more than the
    // sockets between the export and this client hold.
    for i in 0..48u64 {
        a.write_all(&request(CMD_READ, 100 + i, (i % 16) << 20, 1 << 20))
            .unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    // Another client, same device, same memory server: served at once.
    let mut b = connect(&e.addr, "", t).unwrap();
    let page = vec![0xc3u8; 4096];
    let mut w = request(CMD_WRITE, 1, 40 << 20, 4096);
    w.extend_from_slice(&page);
    b.write_all(&w).unwrap();
    assert_eq!(
        simple_reply(&mut b).expect("the write's reply, in time"),
        (0, 1)
    );
    for (h, off) in [(2u64, 40u64 << 20), (3, 3 << 20)] {
        b.write_all(&request(CMD_READ, h, off, 4096)).unwrap();
        assert_eq!(
            simple_reply(&mut b).expect("the read's reply, in time"),
            (0, h)
        );
        let mut got = vec![0u8; 4096];
        b.read_exact(&mut got).unwrap();
        let want = if h == 2 { 0xc3 } else { 0x5a };
        assert!(got.iter().all(|x| *x == want), "read {h} came back wrong");
    }
    // The stalled client's replies are all there when it reads them.
    for _ in 0..48 {
        let (err, h) = simple_reply(&mut a).unwrap();
        assert_eq!(err, 0, "read {h}");
        let mut got = vec![0u8; 1 << 20];
        a.read_exact(&mut got).unwrap();
        assert!(got == mib, "read {h} came back wrong");
    }
}

/// Several exports from one server, each its own device; LIST names them;
/// block status and structured reads see never-written blocks as holes.
#[test]
fn several_exports_holes_and_block_status() {
    if !have("nbdinfo") || !have("qemu-img") {
        panic!("libnbd-bin and qemu-utils are needed (make deps installs them)");
    }
    let c = Cluster::start(2, "64MiB");
    let port = pagefleet_lab::proc::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut cmd = Command::new(bin("pagefleet"));
    cmd.arg("--secret-file").arg(&c.secret_file).args([
        "blockdev",
        "serve",
        "--servers",
        &c.addrs().join(","),
        "--export",
        "swap=48MiB",
        "--export",
        "scratch=32MiB",
        "--listen",
        &addr,
    ]);
    let child = spawn_listening(cmd.stderr(Stdio::inherit()));
    let _e = Export {
        child,
        uri: format!("nbd://{addr}"),
        addr: addr.clone(),
    };
    let list = run(Command::new("nbdinfo").args(["--list", &format!("nbd://{addr}")]));
    assert!(list.contains("swap") && list.contains("scratch"), "{list}");
    let (swap, scratch) = (
        format!("nbd://{addr}/swap"),
        format!("nbd://{addr}/scratch"),
    );
    assert!(run(Command::new("nbdinfo").arg(&swap)).contains("export-size: 50331648"));
    assert!(run(Command::new("nbdinfo").arg(&scratch)).contains("export-size: 33554432"));
    let out = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x33 4M 1M",
        "-c",
        "read -P 0x33 4M 1M",
        &scratch,
    ]));
    assert!(!out.contains("failed"), "{out}");
    // The other export is untouched.
    let out = run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0 4M 1M", &swap]));
    assert!(!out.contains("failed"), "{out}");
    // Block status: data only where written.
    let map = run(Command::new("nbdinfo").args(["--map", &scratch]));
    let data: Vec<&str> = map.lines().filter(|l| l.contains("data")).collect();
    assert!(
        data.len() == 1 && data[0].split_whitespace().next() == Some("4194304"),
        "nbdinfo --map: {map}"
    );
    let qmap = run(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw", &scratch]));
    assert!(
        qmap.contains("\"start\": 4194304, \"length\": 1048576") && qmap.contains("\"data\": true"),
        "qemu-img map: {qmap}"
    );
    // nbdcopy with 4 connections from one export to the other, and back
    // out of it into a file: what one export's connections wrote, all of
    // them see (multi-conn), and the other export holds a copy.
    run(Command::new("nbdcopy").args(["--connections=4", "--requests=16", &scratch, &swap]));
    let out = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0x33 4M 1M",
        "-c",
        "read -P 0 0 4M",
        "-c",
        "read -P 0 5M 43M",
        &swap,
    ]));
    assert!(
        !out.contains("failed") && !out.contains("Pattern verification"),
        "{out}"
    );
    let dir = std::env::temp_dir().join(format!("pf-bd-exports-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let back = dir.join("swap.img");
    run(Command::new("nbdcopy")
        .args(["--connections=4", &swap])
        .arg(&back));
    let img = std::fs::read(&back).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(img.len(), 48 << 20);
    assert!(img[4 << 20..5 << 20].iter().all(|b| *b == 0x33));
    assert!(img[..4 << 20]
        .iter()
        .chain(&img[5 << 20..])
        .all(|b| *b == 0));
    // An unknown export is refused by name.
    let bad = Command::new("nbdinfo")
        .arg(format!("nbd://{addr}/nope"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
}
