//! No page left behind (issue 20, item 2): a runner ended by SIGTERM or
//! SIGINT deletes its pages on the memory servers; the pages of one killed
//! with SIGKILL stay, are listed as nobody's, and `pagefleet gc` frees
//! exactly those — never a live guest's.

use pagefleet_systest::*;
use pagefleet_testbed::Link;
use serde_json::Value;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// h2's regions as `pagefleet memserver regions --on h2 --json` lists them.
fn regions(l: &LabRun) -> Vec<Value> {
    let (ok, out, err) = l.pf(0, &["memserver", "regions", "--on", "h2", "--json"]);
    assert!(ok, "memserver regions: {err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    v[0]["regions"].as_array().cloned().unwrap_or_default()
}

/// Start a guest on h1 whose memory is mostly on h2; its region id.
fn start_paging(l: &LabRun, name: &str) -> String {
    let server = l.lab.hosts[1].addr.clone();
    start_paging_guest(l, name, &server, 0, &[]);
    let mut id = String::new();
    wait_for(&format!("{name}'s pages on h2"), 120, || {
        match l.guest(name) {
            Some((_, g)) if g.remote_pages > 8000 => {
                id = g.region_id.clone();
                true
            }
            _ => false,
        }
    });
    id
}

/// Store `n` 4000-byte items in the memcached-protocol server at `addr`.
fn store_items(addr: &str, n: usize) {
    use std::io::{BufRead, BufReader, Write};
    let t = Instant::now();
    let s = loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) => {
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "kv never listened: {e}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let s2 = s.try_clone().unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    s2.set_nodelay(true).unwrap();
    let value = vec![b'v'; 4000];
    let mut line = String::new();
    let mut req = Vec::new();
    for i in 0..n {
        // One write per request: no Nagle wait for a delayed ACK.
        req.clear();
        write!(req, "set k{i} 0 0 {}\r\n", value.len()).unwrap();
        req.extend_from_slice(&value);
        req.extend_from_slice(b"\r\n");
        w.write_all(&req).unwrap();
        line.clear();
        r.read_line(&mut line).unwrap();
        assert_eq!(line, "STORED\r\n", "item {i}");
    }
}

fn region<'a>(rs: &'a [Value], id: &str) -> Option<&'a Value> {
    rs.iter().find(|r| r["region"] == id)
}

#[test]
fn no_page_is_left_behind_by_a_stopped_signalled_or_killed_runner() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let l = lab("gc", 2, Link::Gbit10, 256 * MIB, &[256 * MIB, 0]);

    // SIGTERM: the runner ends its guest and deletes its pages.
    let g1 = start_paging(&l, "g1");
    let rs = regions(&l);
    let r = region(&rs, &g1).expect("g1's region on h2");
    assert_eq!(r["guest_live"], true, "{r}");
    assert!(
        r["sessions"].as_u64().unwrap() >= 1,
        "g1's pager is connected: {r}"
    );
    assert!(
        r["owner"].as_str().unwrap().contains("g1"),
        "the owner names the guest: {r}"
    );
    assert!(signal_in(&l, 0, "--name=g1", libc::SIGTERM), "no runner g1");
    wait_for("g1 to end", 30, || l.guest("g1").is_none());
    wait_for("g1's pages to go", 30, || {
        region(&regions(&l), &g1).is_none()
    });

    // SIGKILL: nothing runs to delete them; gc does, and only them.
    let g2 = start_paging(&l, "g2");
    let g3 = start_paging(&l, "g3");
    assert!(kill_in(&l, 0, "--name=g2"), "no runner g2");
    wait_for("g2 to be gone", 30, || l.guest("g2").is_none());
    // It did not vanish: a failed record, with how it ended, in `status`,
    // `guest status`, the API and the metrics.
    let rec = l
        .status(0)
        .into_iter()
        .flat_map(|h| h.guests.into_iter().flatten())
        .find(|g| g.name == "g2")
        .expect("g2 stays listed after its runner was killed");
    assert_eq!(rec.state, pagefleet_api::GuestState::Failed, "{rec:?}");
    let f = rec.failure.clone().expect("a failed guest says why");
    assert_eq!(f.exit, "killed by signal 9 (SIGKILL)", "{f:?}");
    assert!(f.at_unix > 0 && f.log.ends_with("g2.log"), "{f:?}");
    assert_eq!(rec.region_id, g2, "the record keeps what it last reported");
    let (ok, out, err) = l.pf(0, &["guest", "status", "g2"]);
    assert!(
        ok && out.contains("failed") && out.contains("SIGKILL"),
        "{out}{err}"
    );
    let (ok, out, _) = l.pf(0, &["status"]);
    assert!(ok && out.contains("failed"), "{out}");
    let metrics = l.get_text(0, "/metrics").unwrap();
    assert!(
        metrics.contains("pagefleet_guest_failures_total 1")
            && metrics.contains("pagefleet_guests{state=\"failed\"} 1"),
        "{metrics}"
    );
    // A failed guest cannot be migrated; a running one cannot be `rm`ed.
    let (ok, _, err) = l.pf(0, &["migrate", "g2"]);
    assert!(!ok && err.contains("failed"), "{err}");
    wait_for("g2's connections to close", 30, || {
        region(&regions(&l), &g2).is_some_and(|r| r["sessions"] == 0)
    });
    let rs = regions(&l);
    let orphan = region(&rs, &g2).expect("g2's pages stay after SIGKILL");
    assert_eq!(orphan["guest_live"], false, "{orphan}");
    let pages = orphan["pages"].as_u64().unwrap();
    let live_pages = region(&rs, &g3).unwrap()["pages"].as_u64().unwrap();

    // A live guest's region cannot be dropped by hand.
    let (ok, _, err) = l.pf(0, &["memserver", "drop", &g3, "--on", "h2"]);
    assert!(!ok && err.contains("running guest"), "{err}");

    // Within the grace period nothing goes; a dry run frees nothing.
    let gc = |args: &[&str]| -> Value {
        let mut a = vec!["gc", "--json"];
        a.extend_from_slice(args);
        let (ok, out, err) = l.pf(0, &a);
        assert!(ok, "gc: {err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        // Every lending host reports; h2 holds the pages.
        let h2 = l.lab.hosts[1].addr.as_str();
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x["report"].clone())
            .find(|r| r["server"] == h2)
            .unwrap_or_else(|| panic!("no report from h2: {v}"))
    };
    let r = gc(&["--grace", "3600"]);
    assert_eq!(r["pages_freed"], 0, "{r}");
    let r = gc(&["--grace", "0", "--dry-run"]);
    assert_eq!(r["pages_freed"], pages, "{r}");
    assert!(
        region(&regions(&l), &g2).is_some(),
        "a dry run frees nothing"
    );
    let r = gc(&["--grace", "0"]);
    assert_eq!(r["freed"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(r["freed"][0]["region"], g2.as_str(), "{r}");
    assert_eq!(r["pages_freed"], pages, "{r}");
    let rs = regions(&l);
    assert!(region(&rs, &g2).is_none(), "g2's pages are freed");
    // (g3 may still be paging out the end of its prefill.)
    assert!(
        region(&rs, &g3).unwrap()["pages"].as_u64().unwrap() >= live_pages,
        "g3's pages are untouched: {rs:?}"
    );
    let (ok, _, err) = l.pf(0, &["guest", "rm", "g3"]);
    assert!(!ok && err.contains("is running"), "{err}");
    let (ok, _, err) = l.pf(0, &["guest", "stop", "g3"]);
    assert!(ok, "g3 still runs and stops cleanly: {err}");
    wait_for("g3's pages to go", 30, || regions(&l).is_empty());
    // A stopped guest leaves no record; the failed one's goes with `guest rm`.
    let names = |l: &LabRun| -> Vec<String> {
        l.status(0)
            .into_iter()
            .flat_map(|h| h.guests.into_iter().flatten())
            .map(|g| g.name)
            .collect()
    };
    assert_eq!(names(&l), vec!["g2".to_string()]);
    let (ok, _, err) = l.pf(0, &["guest", "rm", "g2"]);
    assert!(ok, "guest rm: {err}");
    assert!(names(&l).is_empty(), "{:?}", names(&l));
}

#[test]
fn an_interrupted_local_run_deletes_its_pages() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let l = lab("gcrun", 2, Link::Gbit10, 256 * MIB, &[256 * MIB, 0]);
    let server = l.lab.hosts[1].addr.clone();
    let secret = l.lab.secret_file.to_string_lossy().into_owned();
    // kv serving until killed (the case that used to ignore both signals),
    // and a synthetic run that cannot stop between two accesses.
    for (workload, sig) in [("kv", libc::SIGINT), ("synthetic", libc::SIGTERM)] {
        let mut cmd = l.lab.exec(0, bin("pagefleet"));
        cmd.args([
            "run",
            workload,
            "--size",
            "64MiB",
            "--budget",
            "16MiB",
            "--servers",
            &server,
            "--secret-file",
            &secret,
        ]);
        if workload == "kv" {
            cmd.args(["--listen", "127.0.0.1:11311", "--duration", "0"]);
        } else {
            cmd.args(["--prefill", "--rate", "0", "--duration", "120"]);
        }
        let mut child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        if workload == "kv" {
            // 30 MiB of items: most of them page out to h2.
            l.lab
                .spawn_in(0, || store_items("127.0.0.1:11311", 7500))
                .join()
                .unwrap()
                .unwrap();
        }
        wait_for(&format!("{workload}'s pages on h2"), 60, || {
            regions(&l)
                .iter()
                .any(|r| r["pages"].as_u64().unwrap_or(0) > 1000)
        });
        eprintln!(
            "{workload}: pages on h2 after {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let _ = pagefleet_common::sys::process::signal(child.id() as i32, sig);
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "pagefleet run {workload} ignored signal {sig}"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        eprintln!("pagefleet run {workload}: {status} after signal {sig}");
        assert!(
            regions(&l).is_empty(),
            "pagefleet run {workload} left pages on h2 after signal {sig}"
        );
    }
}

#[test]
fn a_source_crashed_mid_migration_leaves_pages_gc_collects_exactly() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    // h1: source; h2: main host with room for half; h3: sub-host (lends).
    let l = lab(
        "gcsrc",
        3,
        Link::Gbit1,
        256 * MIB,
        &[512 * MIB, 48 * MIB, 0],
    );
    // A live guest paging to h3: its pages must survive the collection.
    let server = l.lab.hosts[2].addr.clone();
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "keep",
            "--on",
            "h1",
            "--size",
            "32MiB",
            "--budget",
            "8MiB",
            "--",
            "synthetic",
            "--servers",
            &server,
            "--prefill",
            "--rate",
            "0",
        ],
    );
    assert!(ok, "guest start keep: {err}");
    // The guest that will be migrated: 128 MiB at 1 Gbit, over a second.
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "m1",
            "--on",
            "h1",
            "--size",
            "128MiB",
            "--",
            "synthetic",
            "--prefill",
            "--rate",
            "0",
        ],
    );
    assert!(ok, "guest start m1: {err}");
    wait_for("m1 to fill", 60, || {
        l.guest("m1")
            .is_some_and(|(_, g)| g.pages.as_ref().map_or(0, |p| p.local) >= 32000)
    });
    let h3_regions = |l: &LabRun| -> Vec<Value> {
        let (ok, out, err) = l.pf(0, &["memserver", "regions", "--on", "h3", "--json"]);
        assert!(ok, "memserver regions: {err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        v[0]["regions"].as_array().cloned().unwrap_or_default()
    };
    wait_for("keep's pages on h3", 60, || !h3_regions(&l).is_empty());
    let before = h3_regions(&l);
    let mut m = l.lab.exec(0, bin("pagefleet"));
    m.args(["migrate", "m1", "--to", "h2", "--sub", "h3"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut m = m.spawn().unwrap();
    // Crash the source runner once h3 holds some of m1's pages.
    wait_for("m1's pages arriving on h3", 60, || {
        h3_regions(&l).len() > before.len()
    });
    assert!(kill_in(&l, 0, "--name=m1"), "no runner m1");
    let _ = m.wait();
    wait_for("m1 gone from the registry", 60, || l.guest("m1").is_none());
    let rs = h3_regions(&l);
    let orphans: Vec<&Value> = rs.iter().filter(|r| r["guest_live"] == false).collect();
    assert_eq!(
        orphans.len(),
        1,
        "m1's region is the one orphan on h3: {rs:?}"
    );
    let orphan = orphans[0]["region"].as_str().unwrap().to_string();
    wait_for("the migration's connections to close", 60, || {
        h3_regions(&l)
            .iter()
            .any(|r| r["region"] == orphan.as_str() && r["sessions"] == 0)
    });
    let (ok, out, err) = l.pf(0, &["gc", "--grace", "0", "--json"]);
    assert!(ok, "gc: {err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let freed: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|h| h["report"]["freed"].as_array().cloned().unwrap_or_default())
        .map(|f| f["region"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        freed,
        std::slice::from_ref(&orphan),
        "gc freed exactly m1's orphaned region: {v}"
    );
    let after = h3_regions(&l);
    assert_eq!(after.len(), before.len(), "keep's region stays: {after:?}");
    assert!(after.iter().all(|r| r["guest_live"] == true), "{after:?}");
}

/// A child process killed (SIGKILL) and reaped on drop, even when the test fails.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `qemu-io -f raw -c CMD... URI` inside lab host `h`: (success, output).
fn qemu_io(l: &LabRun, h: usize, uri: &str, cmds: &[&str]) -> (bool, String) {
    let mut c = l.lab.exec(h, "qemu-io");
    c.args(["-f", "raw"]);
    for x in cmds {
        c.args(["-c", x]);
    }
    let out = c.arg(uri).output().expect("qemu-io");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // qemu-io exits 0 even when a pattern check fails: read its words too.
    let ok = out.status.success()
        && !text.contains("Pattern verification failed")
        && !text.contains("failed:");
    (ok, text)
}

#[test]
fn an_export_without_a_client_keeps_its_blocks_and_a_lost_block_is_an_io_error() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    if pagefleet_lab::proc::which("qemu-io").is_err() {
        panic!("qemu-utils is needed (make deps installs it)");
    }
    // Each daemon collects orphans itself every 2 s (grace 2 s); the
    // device spans both hosts' memory servers (12 MiB each, 16 MiB device).
    let l = lab_with("gcbd", 2, Link::Unshaped, 12 * MIB, &[], |o| {
        o.daemon_args = vec!["--gc-grace".into(), "2".into()];
    });
    let servers = format!("{},{}", l.lab.hosts[0].addr, l.lab.hosts[1].addr);
    let mut cmd = l.lab.exec(0, bin("pagefleet"));
    cmd.args([
        "blockdev",
        "serve",
        "--servers",
        &servers,
        "--size",
        "16MiB",
        "--listen",
        "127.0.0.1:10809",
    ]);
    let export = Killed(spawn_listening(&mut cmd));
    let uri = "nbd://127.0.0.1:10809";
    let (ok, out) = qemu_io(&l, 0, uri, &["write -P 0xab 0 8M", "write -P 0xcd 12M 4M"]);
    assert!(ok, "writes: {out}");

    // No client now. The device's region on h2 is still held by the export.
    let rs = regions(&l);
    assert_eq!(rs.len(), 1, "one region on h2: {rs:?}");
    let r = &rs[0];
    assert!(
        r["sessions"].as_u64().unwrap() >= 1,
        "the export holds its region with no NBD client: {r}"
    );
    assert!(
        r["owner"].as_str().unwrap().starts_with("blockdev/"),
        "the owner names the export: {r}"
    );
    let id = r["region"].as_str().unwrap().to_string();
    let pages = r["pages"].as_u64().unwrap();
    assert!(pages > 0, "{r}");

    // Past the grace: on-demand gc and two rounds of each daemon's own
    // collection keep every block.
    std::thread::sleep(Duration::from_secs(3));
    let (ok, out, err) = l.pf(0, &["gc", "--grace", "1", "--json"]);
    assert!(ok, "gc: {err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    for h in v.as_array().unwrap() {
        assert_eq!(
            h["report"]["pages_freed"], 0,
            "gc took the export's blocks: {v}"
        );
    }
    std::thread::sleep(Duration::from_secs(5));
    let rs = regions(&l);
    assert_eq!(
        region(&rs, &id).map(|r| r["pages"].clone()),
        Some(pages.into()),
        "the daemon's own collection took blocks: {rs:?}"
    );
    let (ok, out) = qemu_io(
        &l,
        0,
        uri,
        &[
            "read -P 0xab 0 8M",
            "read -P 0 8M 4M",
            "read -P 0xcd 12M 4M",
        ],
    );
    assert!(ok, "every block reads back after gc: {out}");

    // Blocks that were written and are gone (freed by hand here) read as
    // an I/O error, never as zeros; blocks still held still read.
    let (ok, _, err) = l.pf(0, &["memserver", "drop", &id, "--on", "h2"]);
    assert!(ok, "memserver drop: {err}");
    let (ok, out) = qemu_io(&l, 0, uri, &["read -P 0xcd 12M 4M"]);
    assert!(!ok, "a lost block must not read back: {out}");
    assert!(
        out.contains("Input/output error"),
        "a lost block is an I/O error: {out}"
    );
    let (ok, out) = qemu_io(&l, 0, uri, &["read -P 0xab 0 8M"]);
    assert!(ok, "blocks on h1 still read: {out}");

    // The export gone (killed: nothing deletes its blocks), its region on
    // h1 is an orphan and the daemon's collection frees it.
    drop(export);
    let (ok, out, err) = l.pf(0, &["memserver", "regions", "--on", "h1", "--json"]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["regions"].as_array().map(|a| a.len()), Some(1), "{v}");
    wait_for(
        "h1's daemon to collect the dead export's blocks",
        30,
        || {
            let (_, out, _) = l.pf(0, &["memserver", "regions", "--on", "h1", "--json"]);
            serde_json::from_str::<Value>(&out)
                .ok()
                .and_then(|v| v[0]["regions"].as_array().map(|a| a.is_empty()))
                .unwrap_or(false)
        },
    );
}
