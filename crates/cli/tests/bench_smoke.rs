//! The memory-server benchmark runs end to end (quick mode) and its JSON
//! carries every measurement and one goal per target. Whether the goals are
//! met is a matter for the full benchmark, not for a test on a noisy machine.

use std::process::Command;

#[test]
fn bench_memserver_quick_json_has_results_and_goals() {
    let out_dir =
        std::env::temp_dir().join(format!("pagefleet-bench-smoke-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args([
            "bench",
            "memserver",
            "--quick",
            "--json",
            "--dataset",
            "32MiB",
            "--out",
        ])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench memserver");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let tp = v["throughput"].as_array().unwrap();
    for sys in [
        "raw TCP",
        "raw mem",
        "pagefleet",
        "pagefleet TLS",
        "memcached",
    ] {
        assert!(tp.iter().any(|r| r["system"] == sys), "no {sys} rows");
    }
    let names: Vec<&str> = v["goals"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|g| g["name"].as_str())
        .collect();
    for op in ["page-out", "page-in"] {
        let want = format!("TLS {op} 128KiB 1 conn / plaintext");
        assert!(
            names.contains(&want.as_str()),
            "no goal {want:?}: {names:?}"
        );
    }
    for r in tp {
        let g = r["gbps"].as_f64().unwrap();
        assert!(g.is_finite() && g > 0.0, "bad throughput row {r}");
    }
    let lat = v["latency"].as_array().unwrap();
    assert!(lat.iter().all(|l| l["p50_us"].as_f64().unwrap() > 0.0));
    let goals = v["goals"].as_array().unwrap();
    assert!(goals.len() >= 4);
    for g in goals {
        for k in ["name", "value", "target", "unit", "met"] {
            assert!(!g[k].is_null(), "goal lacks {k}: {g}");
        }
        let met = g["met"].as_bool().unwrap();
        let (val, tgt) = (g["value"].as_f64().unwrap(), g["target"].as_f64().unwrap());
        assert_eq!(
            met,
            if g["cmp"] == ">=" {
                val >= tgt
            } else {
                val <= tgt
            },
            "goal verdict inconsistent: {g}"
        );
    }
    assert!(v["rss"]["stored_bytes"].as_u64().unwrap() == 1 << 30);
    assert!(
        stderr.contains("Goals (from this run)"),
        "table goes to stderr with --json"
    );
    if let Some(p) = v["plot"].as_str() {
        let png = std::fs::read(p).unwrap();
        assert_eq!(&png[1..4], b"PNG");
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// The paging benchmark runs end to end on a small guest (all-local and one
/// pagefleet configuration) and reports every goal with its measured value.
#[test]
fn bench_paging_quick_json_has_rows_faults_and_goals() {
    let out_dir = std::env::temp_dir().join(format!(
        "pagefleet-bench-paging-smoke-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args([
            "bench",
            "paging",
            "--quick",
            "--json",
            "--dataset",
            "64MiB",
            "--secs",
            "1",
            "--only",
            "50% default",
            "--out",
        ])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench paging");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(
        rows.len(),
        2,
        "all local and the default, one group measured in interleaved rounds: {rows:?}"
    );
    for r in rows {
        assert!(r["error"].is_null(), "config failed: {r}");
        assert!(r["ops_per_sec"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(
            r["rounds"].as_array().unwrap().len(),
            1,
            "--secs 1: one round: {r}"
        );
        assert_eq!(r["group"], rows[0]["group"], "{r}");
    }
    let pf = rows.iter().find(|r| r["cfg"]["kind"] == "Region").unwrap();
    assert!(
        pf["page_ins_per_sec"].as_f64().unwrap() > 0.0,
        "a 50% budget must page: {pf}"
    );
    let cpu = v["cpu"].as_array().unwrap();
    assert_eq!(
        cpu.len(),
        6,
        "floor and pagefleet: one thread, 16 threads, 16 with work between faults: {cpu:?}"
    );
    assert!(cpu.iter().all(|c| c["total_us"].as_f64().unwrap() > 0.0));
    assert!(cpu[2]["what"].as_str().unwrap().contains("16 threads"));
    assert!(cpu[4]["what"]
        .as_str()
        .unwrap()
        .contains("work between faults"));
    let faults = v["faults"].as_array().unwrap();
    assert_eq!(
        faults.len(),
        4,
        "raw uffd, raw TCP, the floor program, pagefleet: {faults:?}"
    );
    assert!(faults.iter().all(|f| f["p50_us"].as_f64().unwrap() > 0.0));
    assert!(faults[2]["what"].as_str().unwrap().starts_with("floor"));
    // The fault goal's floor bound, from the same batches.
    let bounds = v["floor_bounds"].as_array().unwrap();
    assert!(
        bounds.iter().any(
            |b| b["goal"].as_str().unwrap().starts_with("4KiB fault p50")
                && b["bound"].as_f64().unwrap() > 0.0
        ),
        "{bounds:?}"
    );
    for g in v["goals"].as_array().unwrap() {
        for k in ["name", "value", "target", "unit", "met"] {
            assert!(!g[k].is_null(), "goal lacks {k}: {g}");
        }
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// The migration benchmark runs end to end on a small guest (testbed, all
/// three destinations, idle and rewriting guests, the sort and kv
/// experiments) and lists every goal with its measured value.
#[test]
fn bench_migration_quick_json_has_rows_and_goals() {
    if !pagefleet_common::sys::process::is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let out_dir = std::env::temp_dir().join(format!(
        "pagefleet-bench-migration-smoke-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args([
            "bench",
            "migration",
            "--quick",
            "--json",
            "--dataset",
            "128MiB",
            "--out",
        ])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench migration");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let time = v["time"].as_array().unwrap();
    assert_eq!(time.len(), 6, "2 workloads x 3 destinations");
    for r in time {
        assert!(
            r["total_secs"].as_f64().unwrap() > 0.0 && r["downtime_ms"].as_f64().unwrap() > 0.0,
            "{r}"
        );
    }
    let sort = v["sort"].as_array().unwrap();
    assert_eq!(sort.len(), 4);
    assert!(
        sort.iter().all(|s| s["sorted"] == true),
        "a sort came out wrong: {sort:?}"
    );
    let kv = v["kv"].as_array().unwrap();
    assert_eq!(kv.len(), 3);
    for k in kv {
        assert_eq!(k["bad_values"], 0, "{k}");
        assert_eq!(k["misses"], 0, "{k}");
    }
    let goals = v["goals"].as_array().unwrap();
    assert!(goals.len() >= 10, "{goals:?}");
    assert_verdicts(goals);
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// The VM migration benchmark runs end to end on a small VM (every mode,
/// the writing workload): each run has figures, pagefleet's runs verify
/// (vmwork read no wrong value, checksums equal), and every goal's verdict
/// matches its value.
#[test]
fn bench_vm_migration_quick_json_has_rows_and_goals() {
    if !pagefleet_common::sys::process::is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let out_dir =
        std::env::temp_dir().join(format!("pagefleet-bench-vm-smoke-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args(["bench", "vm-migration", "--quick", "--json", "--out"])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench vm-migration");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 5, "one workload x 5 modes: {stderr}");
    for r in rows {
        assert!(r["error"].is_null(), "{r}");
        assert!(r["total_secs"].as_f64().unwrap() > 0.0, "{r}");
        if r["mode"].as_str().unwrap().starts_with("pagefleet") {
            assert_eq!(r["errors"], 0, "{r}");
            assert_eq!(r["checksums_equal"], true, "{r}");
            assert!(r["ops_after"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
    let goals = v["goals"].as_array().unwrap();
    assert!(goals.len() >= 6, "{goals:?}");
    assert_verdicts(goals);
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// The Debian VM's runs of the VM benchmark end to end (quick: 512 MiB,
/// QEMU multifd and pagefleet split + gather, memcached under the kv
/// clients): both rows complete, pagefleet's with no wrong or lost value,
/// no broken connection and the gather's checksums equal; every goal's
/// verdict matches its value.
#[test]
fn bench_vm_migration_debian_quick_json_has_rows_and_goals() {
    if !pagefleet_common::sys::process::is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let out_dir = std::env::temp_dir().join(format!(
        "pagefleet-bench-vmdeb-smoke-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args([
            "bench",
            "vm-migration",
            "--quick",
            "--guest",
            "debian",
            "--json",
            "--out",
        ])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench vm-migration --guest debian");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let rows = v["debian"].as_array().unwrap();
    // A multifd run whose VM died after the move is run once more.
    let retried = rows
        .iter()
        .any(|r| r["mode"] == "qemu-multifd" && r["attempt"] == 1 && r["ops_after"] == 0.0);
    assert_eq!(
        rows.len(),
        2 + retried as usize,
        "multifd and split at 512 MiB: {stderr}"
    );
    for r in rows {
        assert!(r["error"].is_null(), "{r}");
        assert!(r["total_secs"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["keys"].as_u64().unwrap() > 0, "{r}");
    }
    let pf = rows
        .iter()
        .find(|r| r["mode"] == "pagefleet-split")
        .expect("split row");
    assert_eq!(pf["wrong_values"], 0, "{pf}");
    assert_eq!(pf["lost_keys"], 0, "{pf}");
    assert_eq!(pf["reconnects"], 0, "{pf}");
    assert_eq!(pf["checksums_equal"], true, "{pf}");
    assert!(pf["ops_after"].as_f64().unwrap() > 0.0, "{pf}");
    // The split's report, and the floor under its transfer beside it.
    assert!(pf["split_report"]["rounds"].as_u64().unwrap() >= 1, "{pf}");
    assert!(pf["floor"]["secs"].as_f64().unwrap() > 0.0, "{pf}");
    assert_eq!(
        pf["floor"]["bytes"].as_u64(),
        Some(
            pf["split_report"]["bytes_main"].as_u64().unwrap()
                + pf["split_report"]["bytes_subs"][0].as_u64().unwrap_or(0)
        ),
        "{pf}"
    );
    let goals = v["goals"].as_array().unwrap();
    assert!(goals.len() >= 5, "{goals:?}");
    assert_verdicts(goals);
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// The sharing-aware migration benchmark runs end to end (quick: 128 MiB,
/// 0% and 50% shared, 10 Gbit): every run's checksums equal, the 50%
/// dedup run finds about half of the pages it asked about, and every
/// goal's verdict matches its value.
#[test]
fn bench_dedup_quick_json_has_rows_and_goals() {
    if !pagefleet_common::sys::process::is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let out_dir = std::env::temp_dir().join(format!(
        "pagefleet-bench-dedup-smoke-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args(["bench", "dedup", "--quick", "--json", "--out"])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench dedup");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "2 levels x plain/dedup: {stderr}");
    for r in rows {
        assert!(r["error"].is_null(), "{r}");
        assert_eq!(r["checksums_equal"], true, "{r}");
    }
    let half = rows
        .iter()
        .find(|r| r["mode"] == "dedup" && r["shared"].as_f64() == Some(0.5))
        .expect("the 50% dedup row");
    // Of the pages it asked about (the first window always asks; on a
    // fast link sending the rest may measure cheaper), about half were
    // held by the destination.
    let not_sent = half["pages_not_sent"].as_u64().unwrap();
    let asked = 32_768 - half["pages_sent_unasked"].as_u64().unwrap();
    assert!(asked >= 512, "the first window (2 MiB) asks: {half}");
    let found = not_sent as f64 / asked as f64;
    assert!(
        (0.4..=0.6).contains(&found),
        "{found} of the asked pages held: {half}"
    );
    assert!(!v["floors"].as_array().unwrap().is_empty(), "no floor run");
    // On 10 Gbit: a time goal per level and the checksums (bytes are a
    // goal only where the link is the bottleneck, 1 Gbit).
    let goals = v["goals"].as_array().unwrap();
    assert!(goals.len() >= 3, "{goals:?}");
    assert_verdicts(goals);
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// The block-device benchmark runs end to end (quick: the 2-server export
/// nbdkit's memory plugin, the two-hop peer and the floor, two block sizes,
/// both queue depths; the mirror drill).
#[test]
fn bench_blockdev_quick_json_has_rows_and_goals() {
    let out_dir = std::env::temp_dir().join(format!(
        "pagefleet-bench-blockdev-smoke-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args([
            "bench",
            "blockdev",
            "--quick",
            "--json",
            "--dataset",
            "32MiB",
            "--out",
        ])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench blockdev");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(
        rows.len(),
        32,
        "4 targets (pagefleet, nbdkit memory, the two-hop peer, the floor) x 2 patterns x 2 sizes x 2 depths"
    );
    for r in rows {
        assert!(r["error"].is_null(), "{r}");
        assert!(r["iops"].as_f64().unwrap() > 0.0, "{r}");
    }
    // The mirror drill ran, and no acknowledged write was lost.
    let d = &v["drill"];
    assert!(d["acknowledged"].as_u64().unwrap() > 0, "{d}");
    assert_eq!(d["lost"].as_u64(), Some(0), "{d}");
    let goals = v["goals"].as_array().unwrap();
    assert_eq!(
        goals.len(),
        14,
        "8 against the two-hop peer, 4 QD16, sequential, drill"
    );
    assert_verdicts(goals);
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// Each benchmark's --help lists its own flags and the common ones, never
/// another benchmark's.
#[test]
fn each_bench_help_lists_only_its_own_flags() {
    let own: &[(&str, &[&str])] = &[
        ("memserver", &["--dataset", "--reps", "--no-memcached"]),
        ("paging", &["--dataset", "--secs", "--only"]),
        (
            "migration",
            &["--dataset", "--links", "--only", "--kv-rounds"],
        ),
        (
            "blockdev",
            &[
                "--dataset",
                "--secs",
                "--rounds",
                "--vm",
                "--no-vm",
                "--patterns",
                "--block-sizes",
                "--depths",
            ],
        ),
        (
            "ksm",
            &[
                "--dataset",
                "--only",
                "--secs",
                "--pace",
                "--swap",
                "--fit",
                "--theta",
                "--rounds",
            ],
        ),
        ("ioqos", &["--secs", "--only", "--dataset"]),
        (
            "vm-migration",
            &[
                "--size",
                "--only",
                "--workloads",
                "--span",
                "--guest",
                "--sizes",
            ],
        ),
        ("registry", &["--hosts", "--guests"]),
        ("restart", &["--restarts", "--guest-mib"]),
    ];
    let common = [
        "--json",
        "--quick",
        "--out",
        "--secret-file",
        "--tls-dir",
        "--help",
    ];
    for (bench, flags) in own {
        let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
            .args(["bench", bench, "--help"])
            .output()
            .unwrap();
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout);
        let listed: Vec<&str> = help
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|w| w.starts_with("--"))
            .map(|w| w.trim_end_matches(','))
            .collect();
        for f in *flags {
            assert!(
                listed.contains(f),
                "bench {bench} --help lacks {f}:\n{help}"
            );
        }
        for f in &listed {
            assert!(
                flags.contains(f) || common.contains(f),
                "bench {bench} --help lists {f}, not its flag:\n{help}"
            );
        }
    }
}

/// Every goal's `met` agrees with its value, target and comparison (a goal
/// whose value could not be measured is not met).
fn assert_verdicts(goals: &[serde_json::Value]) {
    for g in goals {
        let (val, tgt) = (
            g["value"].as_f64().unwrap_or(f64::NAN),
            g["target"].as_f64().unwrap(),
        );
        let want = match g["cmp"].as_str() {
            Some(">=") => val >= tgt,
            Some("<=") => val <= tgt,
            // Not measured: never met.
            _ => false,
        };
        assert_eq!(
            g["met"].as_bool().unwrap(),
            want,
            "goal verdict inconsistent: {g}"
        );
    }
}

/// The registry benchmark runs end to end on a real etcd (quick: 100
/// simulated hosts): placements measured, writes counted, verdicts match.
#[test]
fn bench_registry_quick_json_has_figures_and_goals() {
    if std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: no etcd here (make deps installs etcd-server)");
        return;
    }
    let out_dir = std::env::temp_dir().join(format!(
        "pagefleet-bench-registry-smoke-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args(["bench", "registry", "--quick", "--json", "--out"])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench registry");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert_eq!(v["placement_ms"].as_array().unwrap().len(), 50, "{stderr}");
    assert!(v["writes_per_migration"].as_f64().unwrap() >= 2.0, "{v}");
    assert!(v["view_bytes"].as_u64().unwrap() > v["hosts_view_bytes"].as_u64().unwrap());
    let goals = v["goals"].as_array().unwrap();
    assert_eq!(goals.len(), 2, "{goals:?}");
    assert_verdicts(goals);
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// The scale benchmark's registry and lend sweeps run end to end (quick:
/// 100 and 1000 simulated hosts in a real etcd; a server lending 64 and 256
/// MiB, filled and drained with every page checked): every point has its
/// figures, and the verdicts match them.
#[test]
fn bench_scale_quick_json_has_curves_and_goals() {
    if std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: no etcd here (make deps installs etcd-server)");
        return;
    }
    let out_dir = std::env::temp_dir().join(format!(
        "pagefleet-bench-scale-smoke-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args([
            "bench",
            "scale",
            "--quick",
            "--sweeps",
            "registry,lend",
            "--json",
            "--out",
        ])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench scale");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let reg = v["registry"].as_array().unwrap();
    assert_eq!(reg.len(), 2, "{stderr}");
    for p in reg {
        assert!(p["error"].is_null(), "{p}");
        assert!(p["placement_p99_ms"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["mirror_bytes"].as_u64().unwrap() > 0, "{p}");
    }
    let lend = v["lend"].as_array().unwrap();
    assert_eq!(lend.len(), 2, "{stderr}");
    for p in lend {
        assert!(p["error"].is_null(), "{p}");
        assert!(p["page_in_gbps"].as_f64().unwrap() > 0.0, "{p}");
        assert!(
            p["rss_full"].as_u64().unwrap() >= p["lend_bytes"].as_u64().unwrap() / 2,
            "{p}"
        );
    }
    assert!(v["servers"].as_array().unwrap().is_empty());
    let goals = v["goals"].as_array().unwrap();
    // Two registry points, RSS and two throughputs of the lend sweep.
    assert_eq!(goals.len(), 5, "{goals:?}");
    assert_verdicts(goals);
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// The in-place restart benchmark runs end to end on a testbed (quick: one
/// restart, 64 MiB guests): every guest worked through it, the guest paging
/// to the restarted host fetched pages from it meanwhile, nothing was wrong
/// or lost, and the verdicts match the figures.
#[test]
fn bench_restart_quick_json_has_figures_and_goals() {
    if !pagefleet_common::sys::process::is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let out_dir = std::env::temp_dir().join(format!(
        "pagefleet-bench-restart-smoke-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args(["bench", "restart", "--quick", "--json", "--out"])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench restart");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let runs = v["restarts"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{stderr}");
    assert!(
        runs[0]["ops"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n.as_u64().unwrap() > 0),
        "{v}"
    );
    assert!(runs[0]["lent_guest_page_ins"].as_u64().unwrap() > 0, "{v}");
    assert!(runs[0]["pages_kept"].as_u64().unwrap() > 1000, "{v}");
    assert_eq!(
        (v["wrong_values"].as_u64(), v["guests_lost"].as_u64()),
        (Some(0), Some(0)),
        "{v}"
    );
    let goals = v["goals"].as_array().unwrap();
    assert_eq!(goals.len(), 3, "{goals:?}");
    assert_verdicts(goals);
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// `bench strangers --quick`: the strangers, the stalled TLS handshakes and
/// the flood did happen (the figures say they were there), signed clients and sessions were counted,
/// and the verdicts match the figures.
#[test]
fn bench_strangers_quick_json_has_figures_and_goals() {
    let out_dir = std::env::temp_dir().join(format!(
        "pagefleet-bench-strangers-smoke-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .args(["bench", "strangers", "--quick", "--json", "--out"])
        .arg(&out_dir)
        .output()
        .expect("run pagefleet bench strangers");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert!(v["stranger_connections"].as_u64().unwrap() >= 600, "{v}");
    assert!(v["signed_requests"].as_u64().unwrap() > 10, "{v}");
    assert!(v["flood_connections"].as_u64().unwrap() > 1000, "{v}");
    assert!(v["sessions"].as_u64().unwrap() > 10, "{v}");
    // The TLS phase: every stalled handshake was made, signed clients worked beside them.
    assert!(
        v["tls"]["stranger_connections"].as_u64().unwrap() >= 600,
        "{v}"
    );
    assert!(v["tls"]["signed_requests"].as_u64().unwrap() > 10, "{v}");
    let goals = v["goals"].as_array().unwrap();
    assert_eq!(goals.len(), 9, "{goals:?}");
    assert_verdicts(goals);
    let _ = std::fs::remove_dir_all(&out_dir);
}
