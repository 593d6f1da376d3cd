//! Native guests as real processes (`pagefleet run`) against real memory
//! servers, driven by clients nobody on this team wrote.

use pagefleet_systest::*;
use std::io::{BufRead, BufReader};
use std::process::Command;
use std::time::Duration;

/// The address a kv guest printed on its first line ("kv listening ADDR").
fn kv_listening(g: &mut GuestProc) -> String {
    let line = BufReader::new(g.child.stdout.take().unwrap())
        .lines()
        .next()
        .unwrap()
        .unwrap();
    line.strip_prefix("kv listening ")
        .expect("kv listening line")
        .to_string()
}

/// memccat prints a newline after each value.
fn value(out: &[u8]) -> &[u8] {
    out.strip_suffix(b"\n").unwrap_or(out)
}

#[test]
fn kv_guest_serves_real_memcached_clients_while_paging() {
    let c = Cluster::start(1, "256MiB");
    let dir = tempdir("kv");
    let mut g = GuestProc::start(
        &c,
        &[
            "kv",
            "--size",
            "64MiB",
            "--budget",
            "25%",
            "--listen",
            "127.0.0.1:0",
            "--duration",
            "0",
            "--threads",
            "1",
        ],
        &dir,
    );
    let addr = kv_listening(&mut g);
    let server = format!("--servers={addr}");
    // 120 values of 256 KiB = 30 MiB through a 16 MiB budget: constant paging.
    let files: Vec<std::path::PathBuf> = (0..120)
        .map(|i| {
            let p = dir.join(format!("obj{i}"));
            let mut data = vec![0u8; 256 * 1024];
            fill(i, 7, &mut data);
            std::fs::write(&p, &data).unwrap();
            p
        })
        .collect();
    let st = Command::new("memccp")
        .arg(&server)
        .args(&files)
        .status()
        .expect("memccp (libmemcached-tools) installed");
    assert!(st.success(), "memccp failed");
    for (i, f) in files.iter().enumerate() {
        let out = Command::new("memccat")
            .arg(&server)
            .arg(format!("obj{i}"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "memccat obj{i} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            value(&out.stdout) == std::fs::read(f).unwrap(),
            "obj{i} came back different"
        );
    }
    // Delete, then the key is gone.
    assert!(Command::new("memcrm")
        .arg(&server)
        .arg("obj3")
        .status()
        .unwrap()
        .success());
    let out = Command::new("memccat")
        .arg(&server)
        .arg("obj3")
        .output()
        .unwrap();
    assert!(
        !out.status.success() || out.stdout.is_empty(),
        "deleted key still readable"
    );
    // memcaslap: mixed get/set load with data verification, bounded in time.
    let out = Command::new("memcaslap")
        .args([
            &format!("-s{addr}"),
            "-t",
            "3s",
            "-T",
            "2",
            "-c",
            "16",
            "-X",
            "1024",
            "-v",
            "0.1",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "memcaslap failed: {text}");
    assert!(text.contains("TPS"), "memcaslap printed no result: {text}");
    // A verification failure shows up as a non-zero "verify_failed" count.
    if let Some(l) = text.lines().find(|l| l.contains("verify_failed")) {
        let n: u64 = l
            .split_whitespace()
            .last()
            .unwrap_or("0")
            .parse()
            .unwrap_or(0);
        assert_eq!(n, 0, "memcaslap found corrupted values: {l}");
    }
    // The earlier values are intact after the load — or evicted (memcaslap
    // writes more than the guest holds, and the oldest items go, whatever
    // their size, as memcached's slab reassignment lets them): never
    // different.
    let mut gone = 0;
    for i in [0usize, 50, 119] {
        let out = Command::new("memccat")
            .arg(&server)
            .arg(format!("obj{i}"))
            .output()
            .unwrap();
        if !out.status.success() || out.stdout.is_empty() {
            gone += 1;
            continue;
        }
        assert!(
            value(&out.stdout) == std::fs::read(&files[i]).unwrap(),
            "obj{i} corrupted after load"
        );
    }
    if gone > 0 {
        let out = Command::new("memcstat").arg(&server).output().unwrap();
        let stats = String::from_utf8_lossy(&out.stdout);
        let evictions: u64 = stats
            .lines()
            .find_map(|l| l.trim().strip_prefix("evictions: "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        assert!(
            evictions > 0,
            "{gone} values missing without an eviction: {stats}"
        );
    }
    let err = std::fs::read_to_string(&g.stderr_path).unwrap_or_default();
    assert!(err.contains("page-ins/s"), "progress lines expected: {err}");
    drop(g);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A synthetic guest paging (budget a quarter of 64 MiB) to the only
/// memory server of a fresh cluster, running for a while already.
fn paging_to_one_server(tag: &str) -> (Cluster, TempDir, GuestProc) {
    let c = Cluster::start(1, "256MiB");
    let dir = tempdir(tag);
    let mut g = GuestProc::start(
        &c,
        &[
            "synthetic",
            "--size",
            "64MiB",
            "--budget",
            "25%",
            "--dist",
            "uniform",
            "--prefill",
            "--duration",
            "60",
        ],
        &dir,
    );
    // Let it page out to the server before anything happens to the server.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        g.child.try_wait().unwrap().is_none(),
        "guest exited early: {}",
        std::fs::read_to_string(&g.stderr_path).unwrap()
    );
    (c, dir, g)
}

#[test]
fn killed_memory_server_fails_the_guest_loudly() {
    let (mut c, dir, mut g) = paging_to_one_server("killed");
    let addr = c.servers[0].addr.clone();
    c.servers[0].kill();
    let status = g
        .wait_exit(Duration::from_secs(30))
        .expect("guest kept running with its memory server gone");
    let err = std::fs::read_to_string(&g.stderr_path).unwrap();
    assert_eq!(status.code(), Some(75), "exit status; stderr: {err}");
    assert!(
        err.contains(&addr),
        "the error must name the server {addr}: {err}"
    );
    assert!(err.contains("cannot"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A memory server that dies and comes back empty at the same address is
/// told apart from the one that held the pages (its id changed): the
/// pager's reconnect refuses it, so the guest fails loudly naming it
/// instead of asking it for pages (which it would not have) or taking
/// their absence for zeros.
#[test]
fn memory_server_restarted_empty_is_not_taken_for_the_old_one() {
    let (mut c, dir, mut g) = paging_to_one_server("restarted");
    let addr = c.servers[0].addr.clone();
    c.servers[0].kill();
    // Back at once, empty, where the guest's pages were.
    let again = Server::start_bin_at(&bin("pagefleetd"), 256 << 20, &c.secret_file, &addr, &[])
        .expect("restart the memory server at its address");
    let status = g
        .wait_exit(Duration::from_secs(30))
        .expect("guest kept running on a server that lost its pages");
    let err = std::fs::read_to_string(&g.stderr_path).unwrap();
    assert_eq!(status.code(), Some(75), "exit status; stderr: {err}");
    assert!(err.contains(&addr), "the error must name {addr}: {err}");
    assert!(
        err.contains("restarted") || err.contains("lost"),
        "the error must say the server lost its pages: {err}"
    );
    drop(again);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sort_guest_sorts_through_a_small_budget() {
    let c = Cluster::start(2, "128MiB");
    let dir = tempdir("sort");
    let mut g = GuestProc::start(
        &c,
        &["sort", "--size", "48MiB", "--budget", "30%", "--json"],
        &dir,
    );
    let status = g
        .wait_exit(Duration::from_secs(120))
        .expect("sort finished");
    let err = std::fs::read_to_string(&g.stderr_path).unwrap();
    assert!(status.success(), "{err}");
    let mut out = String::new();
    std::io::Read::read_to_string(g.child.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert!(out.contains("\"sorted\":true"), "{out}");
    assert!(out.contains("\"page_outs\""), "{out}");
}

/// Unprivileged guests work: the runtime uses UFFD_USER_MODE_ONLY, which
/// vm.unprivileged_userfaultfd=0 requires. Runs as `nobody` via setpriv when
/// the test runs as root (as in CI); as non-root it runs as itself.
#[test]
fn unprivileged_guest_pages_to_a_server() {
    let c = Cluster::start(1, "64MiB");
    let dir = tempdir("nonroot");
    let secret = dir.join("secret");
    std::fs::copy(&c.secret_file, &secret).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = pagefleet_common::sys::process::is_root();
    let mut cmd = if root {
        let mut c = Command::new("setpriv");
        c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(bin("pagefleet"));
        c
    } else {
        Command::new(bin("pagefleet"))
    };
    let out = cmd
        .arg("--secret-file")
        .arg(&secret)
        .args([
            "run",
            "synthetic",
            "--size",
            "16MiB",
            "--budget",
            "25%",
            "--dist",
            "uniform",
            "--prefill",
            "--duration",
            "2",
            "--json",
        ])
        .arg("--servers")
        .arg(c.addrs().join(","))
        .output()
        .expect("run guest");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "unprivileged guest failed: {err}");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<&str> = text.split("\"page_outs\":").collect();
    assert!(v.len() > 1, "{text}");
    let page_outs: u64 = v[1]
        .split(|ch: char| !ch.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        page_outs > 0,
        "expected paging as an unprivileged user: {text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// One `STAT name value` of the kv guest's `stats`.
fn kv_stat(addr: &str, name: &str) -> u64 {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).expect("kv guest");
    s.write_all(b"stats\r\n").unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while r.read_line(&mut line).unwrap() > 0 && !line.starts_with("END") {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() == 3 && f[1] == name {
            return f[2].parse().unwrap();
        }
        line.clear();
    }
    panic!("no {name} in the kv guest's stats")
}

/// SIGUSR1 stops a running guest's sampling hand and SIGUSR2 restarts it
/// (how `bench paging` measures what sampling costs one guest).
#[test]
fn sigusr1_stops_and_sigusr2_restarts_the_sampling_hand() {
    use std::io::Write;
    let c = Cluster::start(1, "128MiB");
    let dir = tempdir("kvsample");
    let mut g = GuestProc::start(
        &c,
        &[
            "kv",
            "--size",
            "64MiB",
            "--budget",
            "100%",
            "--sample-budget",
            "1",
            "--listen",
            "127.0.0.1:0",
            "--duration",
            "0",
        ],
        &dir,
    );
    let addr = kv_listening(&mut g);
    // 16 MiB of values: resident chunks for the hand to visit.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    let value = vec![b'v'; 16 * 1024];
    let mut r = BufReader::new(s.try_clone().unwrap());
    for k in 0..1024 {
        // One write per request (three small ones wait out Nagle and the
        // peer's delayed ACK: 40 ms each).
        let mut req = format!("set k{k} 0 0 {}\r\n", value.len()).into_bytes();
        req.extend_from_slice(&value);
        req.extend_from_slice(b"\r\n");
        s.write_all(&req).unwrap();
        let mut ok = String::new();
        r.read_line(&mut ok).unwrap();
        assert_eq!(ok, "STORED\r\n");
    }
    let sampled = || kv_stat(&addr, "pf_sampled_chunks");
    let grows = |what: &str| {
        let (a, t) = (sampled(), std::time::Instant::now());
        while sampled() == a {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the hand stands {what}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    grows("from the start");
    let pid = g.child.id() as i32;
    let _ = pagefleet_common::sys::process::signal(pid, libc::SIGUSR1);
    std::thread::sleep(Duration::from_millis(500));
    let a = sampled();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(sampled(), a, "the hand moved after SIGUSR1");
    let _ = pagefleet_common::sys::process::signal(pid, libc::SIGUSR2);
    grows("after SIGUSR2");
    assert!(
        g.child.try_wait().unwrap().is_none(),
        "the guest died of a signal"
    );
}
