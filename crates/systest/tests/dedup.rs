//! Sharing-aware migration on the testbed (paper 002): real daemons
//! keeping real content indexes of their guests' memory, real runners
//! filling pages from them. Every test compares region checksums.

use pagefleet_systest::*;
use pagefleet_testbed::Link;
use serde_json::Value;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// `pagefleet migrate --json ARGS` in h1: the report, or the error text.
fn migrate(l: &LabRun, args: &[&str]) -> Result<Value, String> {
    let mut a = vec!["migrate", "--json"];
    a.extend_from_slice(args);
    let (ok, out, err) = l.pf(0, &a);
    if ok {
        Ok(serde_json::from_str(&out).unwrap_or_else(|e| panic!("report: {e}: {out}")))
    } else {
        Err(err)
    }
}

/// Start a synthetic guest filled with seeded content, `shared` of it common.
fn start(l: &LabRun, name: &str, on: &str, size: &str, seed: &str, shared: &str, extra: &[&str]) {
    let mut a = vec![
        "guest",
        "start",
        name,
        "--on",
        on,
        "--size",
        size,
        "--",
        "synthetic",
        "--fill-seed",
        seed,
        "--fill-shared",
        shared,
    ];
    a.extend_from_slice(extra);
    let (ok, _, err) = l.pf(0, &a);
    assert!(ok, "guest start {name}: {err}");
}

/// Wait until guest `name` has written all its `pages`.
fn wait_filled(l: &LabRun, name: &str, pages: u64) {
    let t = Instant::now();
    loop {
        if l.guest(name)
            .is_some_and(|(_, g)| g.ready && g.pages.as_ref().map_or(0, |p| p.local) + 32 >= pages)
        {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{name} never filled its memory"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Wait until host `h`'s content index holds at least `pages` contents.
fn wait_indexed(l: &LabRun, h: usize, pages: u64) -> pagefleet_api::DedupIndexReport {
    let t = Instant::now();
    loop {
        if let Some(d) = l.host_report(h).and_then(|r| r.dedup) {
            if d.pages_indexed >= pages {
                return d;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "h{} never indexed {pages} pages: {:?}",
            h + 1,
            l.host_report(h).and_then(|r| r.dedup)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn stop(l: &LabRun, name: &str) {
    let (ok, _, err) = l.pf(0, &["guest", "stop", name]);
    assert!(ok, "guest stop {name}: {err}");
    let t = Instant::now();
    while l.guest(name).is_some() {
        assert!(t.elapsed() < Duration::from_secs(30), "{name} did not stop");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn pages_the_destination_holds_are_not_sent_and_every_byte_arrives() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let l = lab("dedup", 2, Link::Gbit10, 64 * MIB, &[256 * MIB, 256 * MIB]);
    let pages = 64 * MIB / 4096;
    // h2 runs a guest holding the common content, and keeps rewriting a
    // fifth of it: the index's hints go stale and must be caught on use.
    let writes = |span, rate| {
        [
            "--rate",
            rate,
            "--write-frac",
            "1",
            "--span",
            span,
            "--dist",
            "uniform",
        ]
    };
    start(&l, "base", "h2", "64MiB", "1", "1", &writes("0.2", "1000"));
    wait_filled(&l, "base", pages);
    let ix = wait_indexed(&l, 1, pages * 9 / 10);
    assert!(
        ix.bytes_per_page > 0.0 && ix.bytes_per_page < 200.0,
        "{ix:?}"
    );

    // Half of m1's pages have the common content; it writes a tenth of
    // its memory while it moves.
    start(&l, "m1", "h1", "64MiB", "7", "0.5", &writes("0.1", "20000"));
    wait_filled(&l, "m1", pages);
    // Asking about every page (on this 10 Gbit link sending may measure
    // faster; what is tested here is the asking).
    let r =
        migrate(&l, &["m1", "--to", "h2", "--verify", "--dedup-always"]).expect("dedup migration");
    assert_eq!(
        r["checksum_source"], r["checksum_dest"],
        "region differs: {r}"
    );
    assert!(r["checksum_source"].is_string(), "{r}");
    let d = &r["dedup_main"];
    let not_sent = d["pages_not_sent"].as_u64().expect("dedup report");
    assert!(
        not_sent > pages * 7 / 20 && not_sent < pages * 3 / 5,
        "about half the pages should not be sent: {r}"
    );
    // Plain migration sends 64 MiB and the last round's pages again.
    assert!(
        r["bytes_main"].as_u64().unwrap() < 48 * MIB,
        "about half of 64 MiB, the last round and hashes should go: {r}"
    );
    assert!(
        d["stale_hints"].as_u64().unwrap() > 0,
        "base's writes make some hints stale: {r}"
    );
    let ix = l.host_report(1).and_then(|r| r.dedup).unwrap();
    eprintln!("h2's index after the migration: {ix:?}");
    assert!(ix.lookups > 0 && ix.hits > 0, "{ix:?}");
    stop(&l, "m1");

    // Nothing in common: it stops hashing (probes, or sends unasked where
    // that measured cheaper), sends everything, and is still right.
    start(&l, "m2", "h1", "64MiB", "9", "0", &["--rate", "0"]);
    wait_filled(&l, "m2", pages);
    let r = migrate(&l, &["m2", "--to", "h2", "--verify"]).expect("migration");
    assert_eq!(
        r["checksum_source"], r["checksum_dest"],
        "region differs: {r}"
    );
    let d = &r["dedup_main"];
    assert_eq!(d["pages_not_sent"], 0, "{r}");
    assert!(
        d["probe_batches"].as_u64().unwrap() > 0 || d["pages_sent_unasked"].as_u64().unwrap() > 0,
        "{r}"
    );
    assert!(
        d["pages_hashed"].as_u64().unwrap() < pages / 4,
        "a migration that finds nothing should mostly probe: {r}"
    );
    // Left to choose, it measured both ways of sending (a window each).
    assert!(
        d["ask_us_per_page"].as_f64().is_some_and(|u| u > 0.0)
            && d["send_us_per_page"].as_f64().is_some_and(|u| u > 0.0),
        "{r}"
    );
    stop(&l, "m2");

    // Asked not to: every page goes as data.
    start(&l, "m3", "h1", "64MiB", "7", "1", &["--rate", "0"]);
    wait_filled(&l, "m3", pages);
    let r = migrate(&l, &["m3", "--to", "h2", "--verify", "--no-dedup"]).expect("migration");
    assert_eq!(
        r["checksum_source"], r["checksum_dest"],
        "region differs: {r}"
    );
    assert!(r["dedup_main"].is_null(), "{r}");
    assert!(r["bytes_main"].as_u64().unwrap() >= 64 * MIB, "{r}");
}

#[test]
fn a_split_guest_gathered_onto_a_host_holding_its_content_is_whole() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    // h1 runs a guest with the common content; h2 has room for half of
    // m1; h3 only lends.
    let l = lab(
        "dgath",
        3,
        Link::Gbit10,
        128 * MIB,
        &[256 * MIB, 48 * MIB, 0],
    );
    let pages = 64 * MIB / 4096;
    start(&l, "base", "h1", "64MiB", "1", "1", &["--rate", "0"]);
    wait_filled(&l, "base", pages);
    start(&l, "m1", "h1", "64MiB", "7", "0.5", &["--rate", "0"]);
    wait_filled(&l, "m1", pages);
    let r = migrate(&l, &["m1", "--to", "h2", "--sub", "h3", "--verify"]).expect("split");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "split: {r}");
    assert!(r["pages_subs"][0].as_u64().unwrap() > 0, "{r}");
    wait_indexed(&l, 0, pages * 9 / 10);
    // Back to h1, whole: the main host's pages come by hash where h1 holds
    // them (the gather path copies them under the pullers' lock), the
    // sub-host's are pulled.
    let (ok, out, err) = l.pf(0, &["gather", "m1", "--to", "h1", "--verify", "--json"]);
    assert!(ok, "gather: {err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["checksum_source"], r["checksum_dest"], "gather: {r}");
    assert!(r["pages_pulled"].as_u64().unwrap() > 0, "{r}");
    assert!(
        r["dedup_main"]["pages_not_sent"].as_u64().unwrap() > 0,
        "h1 holds half of the main host's pages: {r}"
    );
}

#[test]
fn a_destination_killed_while_filling_leaves_the_source_running_and_a_retry_whole() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    // 1 Gbit: round 1 of 128 MiB with half of it shared takes about half a second.
    let l = lab("dabt", 2, Link::Gbit1, 64 * MIB, &[256 * MIB, 512 * MIB]);
    let pages = 128 * MIB / 4096;
    start(&l, "base", "h2", "128MiB", "1", "1", &["--rate", "0"]);
    wait_filled(&l, "base", pages);
    wait_indexed(&l, 1, pages * 9 / 10);
    let writes = ["--rate", "5000", "--write-frac", "1", "--dist", "uniform"];
    start(&l, "m1", "h1", "128MiB", "7", "0.5", &writes);
    wait_filled(&l, "m1", pages);
    let ctl = l.control(0, "m1");
    let phase = || {
        guest_status(&ctl)
            .and_then(|g| g.migration)
            .map(|m| m.phase)
            .unwrap_or_default()
    };
    let mut m = l.lab.exec(0, bin("pagefleet"));
    m.args(["migrate", "m1", "--to", "h2", "--dedup-always"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut m = m.spawn().unwrap();
    let t = Instant::now();
    while !phase().starts_with("round 1") {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "never reached round 1"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(150));
    // Kill the incoming runner (its filler with it) mid-round.
    assert!(
        kill_in(&l, 1, "runner-incoming"),
        "no incoming runner on h2"
    );
    assert!(
        !m.wait().unwrap().success(),
        "a migration to a dead runner succeeded"
    );
    let (on, g) = l.guest("m1").expect("m1 still listed");
    assert_eq!(on, 0, "m1 must run on h1 after the abort: {g:?}");
    // A retry goes through whole, filling from h2 as before.
    let r = migrate(&l, &["m1", "--to", "h2", "--verify", "--dedup-always"]).expect("retry");
    assert_eq!(
        r["checksum_source"], r["checksum_dest"],
        "region differs: {r}"
    );
    assert!(
        r["dedup_main"]["pages_not_sent"].as_u64().unwrap() > pages / 4,
        "{r}"
    );
}

/// Wait until host `h`'s index holds only its memory server's store (its
/// guests gone) with at least `pages` contents.
fn wait_store_indexed(l: &LabRun, h: usize, pages: u64) {
    let t = Instant::now();
    loop {
        let d = l.host_report(h).and_then(|r| r.dedup);
        if d.as_ref()
            .is_some_and(|d| d.sources == 1 && d.pages_indexed >= pages)
        {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "h{} never indexed its store alone ({pages} pages): {d:?}",
            h + 1
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn a_sub_host_stores_pages_its_host_holds_from_its_guests_and_its_store() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    // h1: the source. h2, h4: main hosts with room for half a guest.
    // h3: the sub-host; it runs a guest holding the common content.
    let l = lab(
        "dsub",
        4,
        Link::Gbit10,
        160 * MIB,
        &[256 * MIB, 40 * MIB, 80 * MIB, 40 * MIB],
    );
    let pages = 64 * MIB / 4096;
    start(&l, "base", "h3", "64MiB", "1", "1", &["--rate", "0"]);
    wait_filled(&l, "base", pages);
    wait_indexed(&l, 2, pages * 9 / 10);
    // Nothing in common: after two frames without a hit the source only
    // probes (one page a frame hashed, the rest PUT at once).
    start(&l, "m0", "h1", "64MiB", "9", "0", &["--rate", "0"]);
    wait_filled(&l, "m0", pages);
    let r = migrate(&l, &["m0", "--to", "h2", "--sub", "h3", "--verify"]).expect("split");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "split: {r}");
    let d = &r["dedup_subs"][0];
    assert_eq!(d["pages_not_sent"], 0, "{r}");
    assert!(
        d["probe_batches"].as_u64().unwrap() > 0
            && d["pages_hashed"].as_u64().unwrap() < r["pages_subs"][0].as_u64().unwrap() / 4,
        "a sub-host that holds nothing should mostly be probed: {r}"
    );
    stop(&l, "m0");
    start(&l, "m1", "h1", "64MiB", "7", "0.5", &["--rate", "0"]);
    wait_filled(&l, "m1", pages);
    let r = migrate(&l, &["m1", "--to", "h2", "--sub", "h3", "--verify"]).expect("split");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "split: {r}");
    let sub_pages = r["pages_subs"][0].as_u64().unwrap();
    let d = &r["dedup_subs"][0];
    let found = d["pages_not_sent"]
        .as_u64()
        .expect("a sub-host dedup report");
    eprintln!("m1 to h2 + h3: {sub_pages} pages to h3, {found} stored from h3's guest");
    assert!(sub_pages > pages / 4, "half of m1 goes to h3: {r}");
    // Half of m1's pages hold the common content h3's guest has.
    assert!(
        found > sub_pages / 4 && found < sub_pages * 3 / 4,
        "about half of the sub-host's pages are stored from base's memory: {r}"
    );
    assert!(
        r["bytes_subs"][0].as_u64().unwrap() < (sub_pages - found / 2) * 4096,
        "the pages h3 held were not sent: {r}"
    );

    // With base gone, h3 holds m1's pages in its store only. m2 has the
    // same content as m1: its sub-host pages come out of h3's store.
    stop(&l, "base");
    wait_store_indexed(&l, 2, sub_pages * 9 / 10);
    start(&l, "m2", "h1", "64MiB", "7", "0.5", &["--rate", "0"]);
    wait_filled(&l, "m2", pages);
    let r = migrate(&l, &["m2", "--to", "h4", "--sub", "h3", "--verify"]).expect("split");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "split: {r}");
    let sub2 = r["pages_subs"][0].as_u64().unwrap();
    let found2 = r["dedup_subs"][0]["pages_not_sent"].as_u64().unwrap();
    eprintln!("m2 to h4 + h3: {sub2} pages to h3, {found2} stored from h3's store");
    assert!(
        found2 > sub2 / 4,
        "m2's sub-host pages are in h3's store (m1's): {r}"
    );
    let ix = l.host_report(2).and_then(|r| r.dedup).unwrap();
    assert!(
        ix.hits >= found + found2,
        "h3's index answered them: {ix:?}"
    );

    // h3 as the main host of a third twin: its incoming runner gets the
    // store's pages inline from the daemon's lookup service.
    start(&l, "m3", "h1", "64MiB", "7", "0.5", &["--rate", "0"]);
    wait_filled(&l, "m3", pages);
    let r = migrate(&l, &["m3", "--to", "h3", "--verify", "--dedup-always"]).expect("migration");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    let found3 = r["dedup_main"]["pages_not_sent"].as_u64().unwrap();
    eprintln!("m3 to h3: {found3} pages filled from h3's store");
    assert!(
        found3 >= sub_pages * 9 / 10,
        "m3's pages that m1 and m2 left in h3's store are not sent: {r}"
    );
}

/// The host's scanner reads a guest's memfd from outside the guest: a page
/// the kernel swapped out must stay in swap (reading it would swap it in,
/// charged to the guest's memory cgroup, and a guest at its limit is then
/// OOM-killed). Real swap, a real memory cgroup holding the thread that
/// fills the memfd, the real scanner.
#[test]
fn the_scanner_hashes_pages_in_memory_and_leaves_swapped_ones_in_swap() {
    use pagefleet_dedup::scan::{find_memfd, HostIndex};
    use pagefleet_dedup::{ContentKey, SourceId, PAGE};
    const PAGES: usize = 2048;
    let _swap = pagefleet_lab::system::Swap::file(64 * MIB).expect("a swap file");
    // 2 MiB of memory for 8 MiB of guest pages: most go to swap as written.
    // (1 MiB left dd itself too little room: it was OOM-killed now and then
    // before its first page went to swap.)
    let cg = pagefleet_lab::system::MemCgroup::new(2 * MIB).expect("a memory cgroup");
    let f = std::fs::File::from(
        pagefleet_common::sys::mapping::memfd(
            c"pagefleet-scan-swap-test",
            (PAGES * PAGE) as u64,
            0,
        )
        .expect("memfd_create"),
    );
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // The guest: a process in the cgroup (memory is charged to a thread
    // group, not a thread) writing the memfd, so its pages are charged
    // there.
    let script = format!(
        "echo $$ > {} && exec dd if=/dev/urandom of=/proc/{}/fd/{fd} bs={PAGE} count={PAGES} conv=notrunc status=none",
        cg.path.join("cgroup.procs").display(),
        std::process::id()
    );
    let st = std::process::Command::new("sh")
        .args(["-c", &script])
        .status()
        .unwrap();
    assert!(st.success(), "filling the memfd from the cgroup: {st}");
    let stat = |k: &str| -> u64 {
        std::fs::read_to_string(cg.path.join("memory.stat"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{k} in memory.stat"))
    };
    let swapped = stat("swap") / PAGE as u64;
    assert!(
        swapped >= (PAGES / 2) as u64,
        "the cgroup swapped only {swapped} of {PAGES} pages"
    );
    let charged_before = stat("pgpgin");
    let at = find_memfd(std::process::id()).expect("our memfd through /proc");
    let key = ContentKey::from_secret(&pagefleet_proto::auth::Secret::generate());
    let hi = HostIndex::new(key, 1 << 16);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let hashed = hi
        .scan(SourceId(std::process::id()), at, 1.0, &stop)
        .unwrap();
    assert_eq!(
        stat("pgpgin"),
        charged_before,
        "the scan brought pages into the guest's cgroup"
    );
    assert_eq!(
        stat("swap") / PAGE as u64,
        swapped,
        "the scan swapped pages in"
    );
    assert!(
        hashed > 0 && hashed <= PAGES as u64 - swapped,
        "hashed {hashed} pages with {swapped} of {PAGES} in swap"
    );
}
