//! A cluster formed as the sample configuration forms one (issue 51): every
//! pagefleetd listens on 0.0.0.0 and is given one address, h1's API, as
//! `--join`; none lists the others. Every host's registry comes to know
//! all three, each publishes its lab address (not 0.0.0.0) for its memory
//! server and API, a guest pages to a memory server placement found that
//! way and migrates between hosts that only met through h1; h1 restarted
//! learns the others back as they announce themselves.

use pagefleet_systest::*;
use pagefleet_testbed::Link;

const MIB: u64 = 1 << 20;

#[test]
fn one_join_address_forms_the_cluster() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let mut l = lab_with(
        "join",
        3,
        Link::Gbit10,
        128 * MIB,
        &[256 * MIB, 256 * MIB, 0],
        |o| o.join = true,
    );
    let all_known = |l: &pagefleet_lab::LabRun, from: usize| {
        let s = l.status(from);
        s.len() == 3 && s.iter().all(|h| h.report.is_some())
    };
    for i in 0..3 {
        wait_for(&format!("h{} to know all three hosts", i + 1), 30, || {
            all_known(&l, i)
        });
    }
    // Each publishes the address others reach it at. (A registry lists
    // itself first, then its peers in the order it learned them.)
    let reports: Vec<_> = l.status(0).into_iter().filter_map(|e| e.report).collect();
    for h in &l.lab.hosts {
        let r = reports
            .iter()
            .find(|r| r.hostname == h.name)
            .unwrap_or_else(|| panic!("no report from {}", h.name));
        assert_eq!(
            r.memserver.as_deref(),
            Some(h.addr.as_str()),
            "{}'s memory server",
            h.name
        );
        assert_eq!(
            r.http.as_deref(),
            Some(h.http().as_str()),
            "{}'s API",
            h.name
        );
    }
    // A guest on h2 paging to h3's memory server, chosen by placement from
    // h2's registry; then moved to h1.
    let (ok, _, err) = l.pf(
        1,
        &[
            "guest",
            "start",
            "g1",
            "--on",
            "h2",
            "--size",
            "64MiB",
            "--budget",
            "16MiB",
            "--",
            "synthetic",
            "--prefill",
            "--rate",
            "1000",
            "--servers",
            &l.lab.hosts[2].addr,
        ],
    );
    assert!(ok, "guest start on h2: {err}");
    wait_for("g1 to page to h3", 60, || {
        l.guest("g1").is_some_and(|(_, g)| g.remote_pages > 0)
    });
    let (ok, _, err) = l.pf(1, &["migrate", "g1", "--to", "h1"]);
    assert!(ok, "migrate g1 from h2 to h1: {err}");
    assert_eq!(l.guest("g1").map(|(i, _)| i), Some(0), "g1 runs on h1");
    let (ok, _, err) = l.pf(0, &["guest", "stop", "g1"]);
    assert!(ok, "guest stop: {err}");
    // The join host restarted knows nobody; the others announce themselves.
    assert!(kill_in(&l, 0, "pagefleetd"), "no pagefleetd in h1");
    std::thread::sleep(std::time::Duration::from_millis(500));
    l.restart_daemon(0).expect("h1's pagefleetd again");
    wait_for("h1 to know the others again", 30, || all_known(&l, 0));
    assert!(all_known(&l, 2), "h3 kept its registry while h1 was away");
}
