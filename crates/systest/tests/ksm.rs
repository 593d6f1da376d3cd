//! The KSM controller against the real /sys/kernel/mm/ksm with real
//! mergeable processes: saved memory rises under pressure, KSM is stopped
//! without pressure, the host's settings come back on exit, ksmtuned's
//! algorithm stops KSM on a roomy host, enrolment of running processes and
//! cgroups, and clear errors for bad input. KSM is host-wide: these tests
//! run one at a time and put the host's settings back even on failure.

use pagefleet_ksm::sysfs::{self, Settings};
use pagefleet_systest::{bin, wait_for};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Holds the lock, checks nobody else drives KSM, restores the host's settings on drop.
struct Host {
    saved: Option<Settings>,
    _g: std::sync::MutexGuard<'static, ()>,
}

fn host() -> Option<Host> {
    if !pagefleet_systest::is_root() || sysfs::available().is_err() {
        eprintln!("skipped: needs root and a kernel with KSM");
        return None;
    }
    let g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let others = Command::new("pgrep")
        .args(["-x", "ksmtuned"])
        .output()
        .unwrap();
    assert!(
        others.stdout.is_empty(),
        "a ksmtuned daemon is running ({}): it would change KSM under the test; stop it",
        String::from_utf8_lossy(&others.stdout).trim()
    );
    Some(Host {
        saved: Some(Settings::save().unwrap()),
        _g: g,
    })
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(s) = self.saved.take() {
            s.restore().unwrap();
        }
    }
}

/// A process holding `mib` MiB of private memory whose pages (distinct from
/// each other) are the same in every such process; enrolled with `run --merge`
/// unless `enrolled` is false. It prints "ready", then a line per request on stdin.
struct Holder {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

const HOLDER: &str = r#"
import sys
n = int(sys.argv[1]) * 256
buf = bytearray(b"".join(i.to_bytes(8, "little") * 512 for i in range(n)))
print("ready", flush=True)
for line in sys.stdin:
    # Proves the process still works: sum of one word per page.
    print(sum(buf[p * 4096] for p in range(n)) % 1000003, flush=True)
"#;

impl Holder {
    fn start(mib: usize, enrolled: bool) -> Holder {
        Holder::start_in(mib, enrolled, None)
    }

    /// Started in the memory cgroup `cgroup` (its pages charged there from
    /// the first).
    fn start_in(mib: usize, enrolled: bool, cgroup: Option<&std::path::Path>) -> Holder {
        let mut c = if let Some(cg) = cgroup {
            assert!(enrolled);
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(format!(
                    "echo $$ > {} && exec \"$0\" \"$@\"",
                    cg.join("cgroup.procs").display()
                ))
                .arg(bin("pagefleet"))
                .args(["run", "--merge", "--", "/usr/bin/python3", "-c", HOLDER])
                .arg(mib.to_string());
            c
        } else if enrolled {
            let mut c = Command::new(bin("pagefleet"));
            c.args([
                "run",
                "--merge",
                "--",
                "/usr/bin/python3",
                "-c",
                HOLDER,
                &mib.to_string(),
            ]);
            c
        } else {
            let mut c = Command::new("/usr/bin/python3");
            c.args(["-c", HOLDER, &mib.to_string()]);
            c
        };
        let mut child = c
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut l = String::new();
        out.read_line(&mut l).unwrap();
        assert_eq!(l.trim(), "ready");
        Holder { child, out }
    }
    fn pid(&self) -> u32 {
        self.child.id()
    }
    /// Ask for the checksum (the process is alive and its memory intact).
    fn check(&mut self) -> String {
        self.child
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"x\n")
            .unwrap();
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        l.trim().to_string()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Memory of these holders that KSM has merged (their `ksm_stat`; the
/// host-wide counters also hold pages of processes that are gone until
/// ksmd's next pass drops them).
fn merged_bytes(holders: &[Holder]) -> u64 {
    holders
        .iter()
        .map(|h| {
            std::fs::read_to_string(format!("/proc/{}/ksm_stat", h.pid()))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("ksm_merging_pages "))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
                * 4096
        })
        .sum()
}

/// `pagefleet ksm run ARGS` as a child; SIGTERM on drop (it restores settings then).
struct Controller(Child);
impl Controller {
    fn start(args: &[&str]) -> Controller {
        Controller(
            Command::new(bin("pagefleet"))
                .arg("ksm")
                .arg("run")
                .args(args)
                .env("PAGEFLEET_LOG", "info")
                .spawn()
                .unwrap(),
        )
    }
    fn stop(&mut self) -> std::process::ExitStatus {
        let _ = pagefleet_common::sys::process::signal(self.0.id() as i32, libc::SIGTERM);
        let t = Instant::now();
        loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                return s;
            }
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "the controller did not exit on SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
impl Drop for Controller {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            self.stop();
        }
    }
}

/// Pre-state with distinctive values, to see exactly what comes back.
fn distinctive(run: u64) {
    sysfs::write("run", "0").unwrap();
    sysfs::write("pages_to_scan", "123").unwrap();
    sysfs::write("sleep_millisecs", "37").unwrap();
    sysfs::write("run", &run.to_string()).unwrap();
}

fn status_json(state: &std::path::Path) -> serde_json::Value {
    let out = Command::new(bin("pagefleet"))
        .args(["ksm", "status", "--json", "--window", "0.2", "--state"])
        .arg(state)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ksm status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn adaptive_merges_under_pressure_and_puts_settings_back() {
    let Some(_h) = host() else { return };
    distinctive(0);
    let mut holders: Vec<Holder> = (0..3).map(|_| Holder::start(32, true)).collect();
    let sums: Vec<String> = holders.iter_mut().map(|h| h.check()).collect();
    let dir = pagefleet_systest::tempdir("ksm");
    let state = dir.join("ksm.json");
    // Every host is "under pressure" below 100% available.
    let mut c = Controller::start(&[
        "--pressure-below",
        "100%",
        "--state",
        state.to_str().unwrap(),
    ]);
    // Three identical 32 MiB processes: two copies (64 MiB) can go; 48 MiB
    // saved is 72 MiB of theirs merged. Counted per process: the host-wide
    // counters still hold the pages of processes an earlier test merged
    // until ksmd's next pass drops them.
    wait_for("KSM to save 48 MiB", 60, || {
        merged_bytes(&holders) >= 72 << 20
    });
    let st = status_json(&state);
    assert_eq!(st["run"], 1);
    assert!(st["saved_mib"].as_f64().unwrap() >= 48.0, "{st}");
    assert_eq!(st["controller"]["policy"], "adaptive", "{st}");
    assert!(st["controller"]["pressure"].as_bool().unwrap());
    // The merged processes still work and see their own data.
    let after: Vec<String> = holders.iter_mut().map(|h| h.check()).collect();
    assert_eq!(sums, after);
    let s = c.stop();
    assert!(s.success(), "controller exit: {s}");
    assert_eq!(
        sysfs::read_u64("pages_to_scan").unwrap(),
        123,
        "pages_to_scan put back"
    );
    assert_eq!(
        sysfs::read_u64("sleep_millisecs").unwrap(),
        37,
        "sleep_millisecs put back"
    );
    assert_eq!(sysfs::read_u64("run").unwrap(), 0, "run put back");
    assert!(!state.exists(), "the state file is removed on exit");
    assert!(status_json(&state)["controller"].is_null());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn no_pressure_stops_ksm_and_keep_settings_leaves_it() {
    let Some(_h) = host() else { return };
    // KSM running before; the host has plenty of memory (the threshold is 1%).
    distinctive(1);
    let _holders: Vec<Holder> = (0..2).map(|_| Holder::start(8, true)).collect();
    let dir = pagefleet_systest::tempdir("ksm");
    let state = dir.join("ksm.json");
    let mut c = Controller::start(&[
        "--pressure-below",
        "1%",
        "--state",
        state.to_str().unwrap(),
        "--keep-settings",
    ]);
    wait_for("the controller to stop KSM", 20, || {
        sysfs::read_u64("run").unwrap() == 0
    });
    wait_for("the state file", 10, || state.exists());
    let st = status_json(&state);
    assert_eq!(st["controller"]["phase"], "off", "{st}");
    assert!(!st["controller"]["pressure"].as_bool().unwrap());
    assert!(c.stop().success());
    // --keep-settings: KSM stays off.
    assert_eq!(sysfs::read_u64("run").unwrap(), 0);
    // Without it, run=1 comes back.
    distinctive(1);
    let mut c = Controller::start(&["--pressure-below", "1%", "--state", state.to_str().unwrap()]);
    wait_for("the controller to stop KSM", 20, || {
        sysfs::read_u64("run").unwrap() == 0
    });
    assert!(c.stop().success());
    assert_eq!(sysfs::read_u64("run").unwrap(), 1, "run=1 put back");
    assert_eq!(sysfs::read_u64("pages_to_scan").unwrap(), 123);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ksmtuned_mode_stops_ksm_on_a_roomy_host_and_ends_with_duration() {
    let Some(_h) = host() else { return };
    let m = sysfs::Memory::read().unwrap();
    if m.free_kb < m.total_kb / 4 {
        eprintln!("skipped: this host is under memory pressure (ksmtuned would boost, not stop)");
        return;
    }
    distinctive(1);
    // 60 s x 0.05 = 3 s per adjust; --duration ends it by itself.
    let t = Instant::now();
    let mut c = Controller::start(&[
        "--mode",
        "ksmtuned",
        "--interval-scale",
        "0.05",
        "--duration",
        "8",
        "--keep-settings",
    ]);
    wait_for("ksmtuned's first adjust to stop KSM", 20, || {
        sysfs::read_u64("run").unwrap() == 0
    });
    assert!(
        t.elapsed() >= Duration::from_millis(2900),
        "ksmtuned sleeps one interval before adjusting"
    );
    let t2 = Instant::now();
    loop {
        if let Some(s) = c.0.try_wait().unwrap() {
            assert!(s.success());
            break;
        }
        assert!(
            t2.elapsed() < Duration::from_secs(20),
            "--duration did not end the controller"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn enroll_running_processes_and_cgroups() {
    let Some(_h) = host() else { return };
    let mut a = Holder::start(4, false);
    let before = a.check();
    assert!(!pagefleet_ksm::enroll::is_enrolled(a.pid()).unwrap());
    let out = Command::new(bin("pagefleet"))
        .args(["ksm", "enroll", &a.pid().to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(pagefleet_ksm::enroll::is_enrolled(a.pid()).unwrap());
    // It carries on where it was (blocked reading stdin) with its memory intact.
    assert_eq!(a.check(), before);
    // A cgroup: every process in it.
    let cg = std::path::PathBuf::from(format!(
        "/sys/fs/cgroup/pids/pagefleet-ksm-test-{}",
        std::process::id()
    ));
    let cg = if std::path::Path::new("/sys/fs/cgroup/pids").exists() {
        cg
    } else {
        std::path::PathBuf::from(format!(
            "/sys/fs/cgroup/pagefleet-ksm-test-{}",
            std::process::id()
        ))
    };
    std::fs::create_dir_all(&cg).unwrap();
    struct Rm(std::path::PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _rm = Rm(cg.clone());
    let mut b = Holder::start(4, false);
    let mut c = Holder::start(4, false);
    for h in [&b, &c] {
        std::fs::write(cg.join("cgroup.procs"), h.pid().to_string()).unwrap();
    }
    let out = Command::new(bin("pagefleet"))
        .args(["ksm", "enroll"])
        .arg(&cg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("2 processes enrolled"));
    for h in [&mut b, &mut c] {
        assert!(pagefleet_ksm::enroll::is_enrolled(h.pid()).unwrap());
        assert_eq!(h.check(), before);
    }
    drop(b);
    drop(c);
    // `run --merge -- CMD` enrols the command (kept across exec).
    let out = Command::new(bin("pagefleet"))
        .args([
            "run",
            "--merge",
            "--",
            "grep",
            "ksm_merge_any",
            "/proc/self/ksm_stat",
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "ksm_merge_any: yes"
    );
}

#[test]
fn bad_input_gets_clear_errors() {
    let Some(_h) = host() else { return };
    let pf = |args: &[&str]| {
        let o = Command::new(bin("pagefleet")).args(args).output().unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let cases: &[(&[&str], &str)] = &[
        (&["ksm", "run", "--mode", "turbo"], "unknown --mode turbo"),
        (
            &["ksm", "run", "--cpu-budget", "0"],
            "--cpu-budget must be above 0",
        ),
        (&["ksm", "run", "--cpu-budget", "lots"], "percentage"),
        (
            &["ksm", "run", "--mode", "ksmtuned", "--interval-scale=-1"],
            "--interval-scale must be positive",
        ),
        (&["ksm", "run", "--tick", "0"], "--tick"),
        (&["ksm", "enroll", "4000000"], "no such process"),
        (&["ksm", "enroll", "/nonexistent/group"], "is not a cgroup"),
        (&["ksm", "status", "--window=-1"], "--window"),
        (&["run", "--merge"], "name a workload"),
        (
            &["run", "--merge", "--", "/nonexistent/cmd"],
            "cannot run /nonexistent/cmd",
        ),
    ];
    for (args, want) in cases {
        let (ok, err) = pf(args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: expected {want:?} in {err:?}");
    }
    // Nothing was changed by the failed runs.
    let now = Settings::save().unwrap();
    let was = _h.saved.as_ref().unwrap();
    assert_eq!(
        (now.run, now.pages_to_scan, now.sleep_millisecs),
        (was.run, was.pages_to_scan, was.sleep_millisecs)
    );
}

#[test]
fn pagefleetd_runs_the_controller_as_a_service() {
    let Some(_h) = host() else { return };
    distinctive(1);
    let dir = pagefleet_systest::tempdir("ksmd");
    let secret = dir.join("secret");
    let mut d = Command::new(bin("pagefleetd"))
        .args([
            "--ksm",
            "adaptive",
            "--ksm-cpu-budget",
            "5%",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--secret-file",
        ])
        .arg(&secret)
        .spawn()
        .unwrap();
    // No memory pressure on this host: the service stops KSM...
    wait_for("pagefleetd's controller to stop KSM", 20, || {
        sysfs::read_u64("run").unwrap() == 0
    });
    let st = status_json(std::path::Path::new(pagefleet_ksm::control::DEFAULT_STATE));
    assert_eq!(st["controller"]["policy"], "adaptive", "{st}");
    // ...and SIGTERM ends the daemon with the host's settings back.
    let _ = pagefleet_common::sys::process::signal(d.id() as i32, libc::SIGTERM);
    let t = Instant::now();
    let s = loop {
        if let Some(s) = d.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(15) {
            let _ = d.kill();
            panic!("pagefleetd did not exit on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(s.success(), "pagefleetd exit: {s}");
    assert_eq!(
        (
            sysfs::read_u64("run").unwrap(),
            sysfs::read_u64("pages_to_scan").unwrap()
        ),
        (1, 123)
    );
    // A bad mode is a startup error.
    let o = Command::new(bin("pagefleetd"))
        .args([
            "--ksm",
            "turbo",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--secret-file",
        ])
        .arg(&secret)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("unknown --mode turbo"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `bench ksm --quick` for real: kv tenants in a memory cgroup too small for
/// them unmerged, a swap file, KSM off vs the adaptive controller. Merging
/// must save memory, paging must have happened without it, and the swap
/// file, the cgroup and the host's KSM settings must be gone / back after.
#[test]
fn bench_ksm_quick_pages_merges_and_cleans_up() {
    let Some(_h) = host() else { return };
    let before = Settings::save().unwrap();
    let dir = pagefleet_systest::tempdir("ksm-bench");
    let o = Command::new(bin("pagefleet"))
        .args([
            "bench",
            "ksm",
            "--quick",
            "--json",
            "--secs",
            "25",
            "--only",
            "off,adaptive",
            "--out",
        ])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // What this bench would leave is named by its pid (other runs' are not
    // this test's business: the lab sweeps those of dead runs).
    let pid = o.id();
    let o = o.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "bench ksm failed: {err}");
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    let cs = r["configs"].as_array().unwrap();
    assert_eq!(cs.len(), 2, "{err}");
    for c in cs {
        assert!(c["error"].is_null(), "{}: {}", c["name"], c["error"]);
        assert!(c["throughput"].as_f64().unwrap() > 100.0, "{}", c["name"]);
        assert!(!c["samples"].as_array().unwrap().is_empty());
    }
    let off = &cs[0];
    let ad = &cs[1];
    assert_eq!(off["name"], "KSM off");
    assert!(off["final_saved_mib"].as_f64().unwrap() < 1.0);
    // Without merging the tenants overflow their cgroup (90% of what they
    // use, in quick mode) into swap — or, on some runs, only into reclaimed
    // file pages (their code and page cache: 0.02 MiB swapped in one clean
    // run). How often they fault varies with the host's load (3.8/s to 90/s
    // between runs here), so it is reported, not checked; that merging
    // saves memory under the same limit is.
    eprintln!(
        "KSM off: {:.1} major faults/s, {:.1} MiB swapped",
        off["majflt_per_s"].as_f64().unwrap(),
        off["final_swap_mib"].as_f64().unwrap()
    );
    let saved = ad["final_saved_mib"].as_f64().unwrap();
    assert!(saved > 20.0, "adaptive saved only {saved} MiB: {err}");
    let goals = r["goals"].as_array().unwrap();
    for which in ["median", "worst run"] {
        let name = format!("adaptive saves memory ({which})");
        assert!(
            goals
                .iter()
                .any(|g| g["name"] == name.as_str() && g["met"] == true),
            "{goals:?}"
        );
    }
    assert!(r["limit_mib"].as_u64().unwrap() > 0);
    // Nothing left behind.
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    assert!(
        !swaps.contains(&format!("pagefleet-bench-swap-{pid}")),
        "{swaps}"
    );
    let left: Vec<_> = std::fs::read_dir("/sys/fs/cgroup/memory")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("pagefleet-bench-{pid}-"))
        })
        .collect();
    assert!(left.is_empty(), "memory cgroups left: {left:?}");
    let after = Settings::save().unwrap();
    assert_eq!(format!("{after:?}"), format!("{before:?}"));
    assert!(dir.join("ksm.json").exists());
    let _ = std::fs::remove_dir_all(dir);
}

/// The stall `pagefleet bench ksm` met (51 MiB saved where ksmtuned saved
/// 456): tenants largely swapped out when the controller starts, pages
/// swapped back in as the clients touch them. Scanning slower than that
/// churn stalls at an equilibrium (the kernel's default constant rate saves
/// next to nothing here); the adaptive controller must go on merging while
/// merging pays and end the run with at least 80% of the common data one
/// tenant holds saved.
#[test]
fn adaptive_keeps_merging_while_the_tenants_swap() {
    let Some(_h) = host() else { return };
    let dir = pagefleet_systest::tempdir("ksm-swapping");
    let o = Command::new(bin("pagefleet"))
        .args([
            "bench", "ksm", "--quick", "--json", "--fit", "0.6", "--secs", "90", "--only",
            "adaptive", "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "bench ksm failed: {err}");
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    let a = &r["configs"].as_array().unwrap()[0];
    assert!(a["error"].is_null(), "{}", a["error"]);
    // The starting state this test is about: tenants partly in swap.
    assert!(a["start_swap_mib"].as_f64().unwrap() > 10.0, "{err}");
    let opts = &r["opts"];
    let common_mib = opts["tenant_bytes"].as_f64().unwrap() / 1048576.0
        * opts["shared_frac"].as_f64().unwrap()
        * (opts["tenants"].as_f64().unwrap() - 1.0);
    let saved = a["final_saved_mib"].as_f64().unwrap();
    assert!(
        saved >= 0.8 * common_mib,
        "adaptive saved {saved:.0} MiB of {common_mib:.0} MiB of common data: {err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Duplicates in swap that nothing touches: ksmd skips swapped-out pages,
/// and no client brings them back, so without help they stay unmerged
/// forever (a `pagefleet bench ksm` round ended 45 MiB short of the others
/// so). Three identical tenants squeezed into a memory cgroup until most
/// of their memory is in swap, then given room, never touched: the
/// adaptive controller must bring the swapped pages back in and merge them
/// (at least 80% of the two redundant copies), and the tenants' data must
/// be intact.
#[test]
fn adaptive_merges_cold_duplicates_that_sit_in_swap() {
    let Some(_h) = host() else { return };
    const MIB: u64 = 1 << 20;
    let _swap = pagefleet_lab::system::Swap::file(512 * MIB).expect("a swap file");
    let cg = pagefleet_lab::system::MemCgroup::new(1 << 40).expect("a memory cgroup");
    let mut holders: Vec<Holder> = (0..3)
        .map(|_| Holder::start_in(48, true, Some(&cg.path)))
        .collect();
    let sums: Vec<String> = holders.iter_mut().map(|h| h.check()).collect();
    let swap_of = |h: &Holder| -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", h.pid()))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmSwap:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap()
            << 10
    };
    // Squeeze: most of the 144 MiB goes to swap.
    std::fs::write(
        cg.path.join("memory.limit_in_bytes"),
        (64 * MIB).to_string(),
    )
    .unwrap();
    wait_for("the tenants to be mostly in swap", 60, || {
        holders.iter().map(swap_of).sum::<u64>() >= 80 * MIB
    });
    let swapped: u64 = holders.iter().map(swap_of).sum();
    // Room again; nothing touches the tenants from here on.
    std::fs::write(
        cg.path.join("memory.limit_in_bytes"),
        (512 * MIB).to_string(),
    )
    .unwrap();
    let dir = pagefleet_systest::tempdir("ksm-cold");
    let state = dir.join("ksm.json");
    let mut c = Controller::start(&[
        "--pressure-below",
        "100%",
        "--state",
        state.to_str().unwrap(),
    ]);
    // The tenants' own merged pages: three identical copies merged save
    // two of them, so 80% of the two redundant copies saved is 80% of the
    // three merged.
    let target = 3 * 48 * MIB * 8 / 10;
    let t = Instant::now();
    while merged_bytes(&holders) < target {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{} MiB of the tenants' 144 MiB merged ({} MiB were in swap): {}",
            merged_bytes(&holders) >> 20,
            swapped >> 20,
            std::fs::read_to_string(&state).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(c.stop().success());
    let after: Vec<String> = holders.iter_mut().map(|h| h.check()).collect();
    assert_eq!(sums, after, "the tenants' data changed");
    drop(holders);
    let _ = std::fs::remove_dir_all(dir);
}
