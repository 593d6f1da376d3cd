//! The I/O controller on real cgroups (v1 blkio throttling) with real fio
//! load on a loop device (direct I/O over a file on this machine's disk):
//! a bursty tenant is capped and its cap goes away after, under both
//! policies; bad input gives clear errors; nothing stays throttled.

use pagefleet_systest::{bin, wait_for};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pagefleet_systest::iorig::V1;
use pagefleet_systest::IoRig as Rig;

struct Ctl(Child);
impl Drop for Ctl {
    fn drop(&mut self) {
        let _ = pagefleet_common::sys::process::signal(self.0.id() as i32, libc::SIGTERM);
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) && self.0.try_wait().ok().flatten().is_none() {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn state(p: &Path) -> Option<serde_json::Value> {
    serde_json::from_slice(&std::fs::read(p).ok()?).ok()
}

fn run_policy(tag: &str, extra: &[&str], steady_never_capped: bool) {
    let Some(rig) = Rig::new(tag, &["steady", "bursty"]) else {
        return;
    };
    let dir = pagefleet_systest::tempdir(tag);
    let st = dir.join("ioqos.json");
    // A small model makes any real load "busy", so the test does not depend on this disk's speed.
    // steady's minimum is out of reach: it is starved whenever the device is busy.
    let tenants = format!(
        "steady={}:min=1GiB,bursty={}:min=1MiB",
        rig.group(0).display(),
        rig.group(1).display()
    );
    let mut args = vec![
        "ioqos",
        "run",
        "--device",
        &rig.dev,
        "--tenants",
        &tenants,
        "--model",
        "100000,8MiB",
        "--state",
    ];
    let sp = st.to_str().unwrap().to_string();
    args.push(&sp);
    args.extend_from_slice(extra);
    let ctl = Ctl(Command::new(bin("pagefleet"))
        .args(&args)
        .env("PAGEFLEET_LOG", "info")
        .spawn()
        .unwrap());
    let mut steady = rig.fio(0, 1, 25);
    let mut bursty = rig.fio(1, 8, 8);
    wait_for("the bursty tenant to be capped", 20, || {
        state(&st).is_some_and(|v| v["tenants"][1]["cap_bps"].is_number())
            && !rig.throttle(1).trim().is_empty()
    });
    let v = state(&st).unwrap();
    if steady_never_capped {
        assert!(
            v["tenants"][0]["cap_bps"].is_null(),
            "the starved tenant is not capped: {v}"
        );
    }
    // The status command shows it.
    let out = Command::new(bin("pagefleet"))
        .args(["ioqos", "status", "--state", &sp])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("bursty"), "{text}");
    // The burst ends: the cap goes (the paper's after cap_time, guarantee's step by step).
    let _ = bursty.wait();
    wait_for("the cap to go", 40, || {
        state(&st).is_some_and(|v| v["tenants"][1]["cap_bps"].is_null())
            && rig.throttle(1).trim().is_empty()
    });
    let _ = steady.kill();
    let _ = steady.wait();
    drop(ctl);
    assert!(
        rig.rules(0).trim().is_empty() && rig.rules(1).trim().is_empty(),
        "no rule stays after the controller: {} {}",
        rig.rules(0),
        rig.rules(1)
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn guarantee_caps_a_bursty_tenant_then_releases_it() {
    run_policy("guar", &["--policy", "guarantee"], true);
}

#[test]
fn paper_caps_the_busiest_for_cap_time() {
    // Algorithm 1 may cap whoever is busiest, the steady tenant too (its known weakness).
    run_policy(
        "paper",
        &[
            "--policy",
            "paper",
            "--cap-time",
            "4",
            "--cap-interval",
            "1",
        ],
        false,
    );
}

#[test]
fn bad_input_gets_clear_errors_and_vanished_tenants_are_survived() {
    let Some(rig) = Rig::new("bad", &["a"]) else {
        return;
    };
    let a = format!("a={}", rig.group(0).display());
    let pf = |args: &[&str]| {
        let o = Command::new(bin("pagefleet")).args(args).output().unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "ioqos",
                "run",
                "--device",
                "/dev/nonexistent",
                "--tenants",
                &a,
            ],
            "unknown device",
        ),
        (
            vec!["ioqos", "run", "--device", "/etc/passwd", "--tenants", &a],
            "not a block device",
        ),
        (
            vec![
                "ioqos",
                "run",
                "--device",
                &rig.dev,
                "--tenants",
                "a=no-such-group-xyz",
            ],
            "not found",
        ),
        (
            vec!["ioqos", "run", "--device", &rig.dev, "--tenants", "a"],
            "NAME=LOCATION",
        ),
        (
            vec![
                "ioqos",
                "run",
                "--device",
                &rig.dev,
                "--tenants",
                &a,
                "--policy",
                "fair",
            ],
            "unknown policy fair",
        ),
        (
            vec![
                "ioqos",
                "run",
                "--device",
                &rig.dev,
                "--tenants",
                &a,
                "--policy",
                "paper",
                "--cap-time",
                "1",
                "--cap-interval",
                "5",
            ],
            "cap_time > cap_interval",
        ),
        (
            vec![
                "ioqos",
                "run",
                "--device",
                &rig.dev,
                "--tenants",
                &a,
                "--model",
                "x",
            ],
            "model wants MAX_IOPS,MAX_BYTES_PER_S",
        ),
        (
            vec!["ioqos", "status", "--state", "/nonexistent/ioqos.json"],
            "no I/O controller is running",
        ),
    ];
    for (args, want) in &cases {
        let (ok, err) = pf(args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: expected {want:?} in {err:?}");
    }
    // A tenant whose cgroup disappears while running: logged, the controller keeps going.
    let extra = PathBuf::from(V1).join(format!("pagefleet-test-gone-{}", std::process::id()));
    std::fs::create_dir_all(&extra).unwrap();
    let dir = pagefleet_systest::tempdir("gone");
    let st = dir.join("ioqos.json");
    let tenants = format!("{a},b={}", extra.display());
    let mut c = Command::new(bin("pagefleet"))
        .args([
            "ioqos",
            "run",
            "--device",
            &rig.dev,
            "--tenants",
            &tenants,
            "--model",
            "1000,10MiB",
            "--duration",
            "4",
            "--state",
        ])
        .arg(&st)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the state file", 10, || st.exists());
    std::fs::remove_dir(&extra).unwrap();
    let out = {
        let t = Instant::now();
        loop {
            if c.try_wait().unwrap().is_some() {
                break c.wait_with_output().unwrap();
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the controller did not finish"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    assert!(
        out.status.success(),
        "the controller survives a vanished tenant: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("tenant b"),
        "and says so in its log"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `pagefleet ioqos fifodisk`: the slow FIFO disk the benchmark shares
/// between tenants. Real FUSE, a real loop device with direct I/O; every
/// block written reads back intact; on SIGTERM the loop device and the mount go.
#[test]
fn fifo_disk_keeps_every_block_and_leaves_nothing_behind() {
    if !pagefleet_systest::is_root()
        || !Path::new("/dev/fuse").exists()
        || pagefleet_lab::proc::which("fio").is_err()
    {
        eprintln!("skipped: needs root, /dev/fuse and fio");
        return;
    }
    let dir = pagefleet_systest::tempdir("fifo");
    let mnt = dir.join("mnt");
    let mut c = Ctl(Command::new(bin("pagefleet"))
        .args([
            "ioqos",
            "fifodisk",
            "--size",
            "64MiB",
            "--bandwidth",
            "400MiB",
            "--per-io",
            "0.02",
            "--loop",
            "--dir",
        ])
        .arg(&mnt)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(c.0.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let dev = line.trim().to_string();
    assert!(
        dev.starts_with("/dev/loop"),
        "prints its loop device: {line:?}"
    );
    let name = dev.trim_start_matches("/dev/");
    assert_eq!(
        std::fs::read_to_string(format!("/sys/block/{name}/loop/dio"))
            .unwrap()
            .trim(),
        "1",
        "direct I/O on the FUSE file"
    );
    // Mixed sizes, several writers at once, each block checked on read-back.
    let out = Command::new("fio")
        .args([
            "--name=v",
            "--rw=randwrite",
            "--direct=1",
            "--ioengine=psync",
            "--bsrange=4k-128k",
            "--numjobs=4",
            "--size=12M",
            "--offset_increment=14M",
            "--verify=crc32c",
            "--do_verify=1",
            "--group_reporting",
        ])
        .arg(format!("--filename={dev}"))
        .output()
        .unwrap();
    assert!(
        out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("verify: bad"),
        "fio verify on the FIFO disk: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // What the block device wrote is what the FUSE file holds.
    let mut a = vec![0u8; 1 << 20];
    let mut b = vec![0u8; 1 << 20];
    use std::io::Read;
    std::fs::File::open(&dev)
        .unwrap()
        .read_exact(&mut a)
        .unwrap();
    std::fs::File::open(mnt.join("disk"))
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    assert!(a == b && a.iter().any(|&x| x != 0));
    drop(c);
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(
        !mounts.contains(mnt.to_str().unwrap()),
        "unmounted on SIGTERM"
    );
    let lo = Command::new("losetup").arg("-a").output().unwrap();
    assert!(
        !String::from_utf8_lossy(&lo.stdout).contains(&format!("{dev}:")),
        "loop device detached"
    );
    // Bad input: clear errors, nothing mounted.
    for (args, want) in [
        (vec!["--size", "1000"], "multiple of 4 KiB"),
        (vec!["--bandwidth", "0"], "--bandwidth must be positive"),
        (vec!["--per-io=-1"], "--per-io"),
    ] {
        let o = Command::new(bin("pagefleet"))
            .args(["ioqos", "fifodisk", "--dir"])
            .arg(dir.join("bad"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// pagefleetd runs the controller as a service: its tenants show in
/// `pagefleet ioqos status`, and SIGTERM leaves no rule behind.
#[test]
fn pagefleetd_runs_the_io_controller() {
    let Some(rig) = Rig::new("daemon", &["a", "b"]) else {
        return;
    };
    let dir = pagefleet_systest::tempdir("ioqos-daemon");
    let cfg = dir.join("pagefleetd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[ioqos]\ndevice = \"{}\"\ntenants = \"a={}:min=1GiB,b={}:min=1MiB\"\nmodel = \"100000,8MiB\"\n",
            rig.dev,
            rig.group(0).display(),
            rig.group(1).display()
        ),
    )
    .unwrap();
    let d = Ctl(Command::new(bin("pagefleetd"))
        .arg("--config")
        .arg(&cfg)
        .arg("--metrics")
        .arg("off")
        .arg("--secret-file")
        .arg(dir.join("secret"))
        .spawn()
        .unwrap());
    let mut fa = rig.fio(0, 1, 20);
    let mut fb = rig.fio(1, 8, 20);
    let status = || {
        Command::new(bin("pagefleet"))
            .args(["ioqos", "status", "--json"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
    };
    wait_for(
        "the daemon's controller to cap the bursty tenant",
        25,
        || {
            status().is_some_and(|v| {
                v["tenants"][1]["cap_bps"].is_number() && v["policy"] == "guarantee"
            })
        },
    );
    let _ = fa.kill();
    let _ = fb.kill();
    let _ = fa.wait();
    let _ = fb.wait();
    drop(d);
    assert!(
        rig.rules(0).trim().is_empty() && rig.rules(1).trim().is_empty(),
        "no rule stays after pagefleetd: {} {}",
        rig.rules(0),
        rig.rules(1)
    );
    assert!(status().is_none(), "no stale state after pagefleetd");
    let _ = std::fs::remove_dir_all(dir);
}

/// `pagefleet bench ioqos --json` end to end on the FIFO disk, short: the
/// JSON holds every tenant's figures and one goal per target of the issue,
/// computed from the run (their values are for the real run, not checked here).
#[test]
fn bench_ioqos_reports_runs_and_goals() {
    if !pagefleet_systest::is_root()
        || !Path::new("/dev/fuse").exists()
        || pagefleet_lab::proc::which("fio").is_err()
    {
        eprintln!("skipped: needs root, /dev/fuse and fio");
        return;
    }
    let dir = pagefleet_systest::tempdir("bench-ioqos");
    let out = Command::new(bin("pagefleet"))
        .args([
            "bench",
            "ioqos",
            "--json",
            "--secs",
            "20",
            "--dataset",
            "128MiB",
            "--only",
            "fifo,ramp,none,paper,guarantee",
            "--out",
        ])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its cgroups are named by its pid.
    let pid = out.id();
    let out = out.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3, "{v}");
    for r in runs {
        assert!(r["error"].is_null(), "{r}");
        let ts = r["tenants"].as_array().unwrap();
        assert_eq!(ts.len(), 4);
        // Every tenant wrote, and the samples cover the run.
        for t in ts {
            assert!(t["mean_bps"].as_f64().unwrap() > 0.0, "{t}");
            assert!(t["p99_ms"].as_f64().unwrap() > 0.0, "{t}");
        }
        assert!(r["t"].as_array().unwrap().len() >= 15);
    }
    let goals = v["goals"].as_array().unwrap();
    assert_eq!(goals.len(), 3, "{goals:?}");
    for g in goals {
        assert!(
            g["value"].as_f64().is_some_and(f64::is_finite) && g["met"].is_boolean(),
            "{g}"
        );
    }
    // The table went to stderr; nothing of the run is left behind.
    assert!(err.contains("Goals (from this run)"), "{err}");
    let groups = std::fs::read_dir(V1)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("pagefleet-bench-{pid}-"))
        })
        .count();
    assert_eq!(groups, 0, "bench cgroups removed");
    let _ = std::fs::remove_dir_all(dir);
}
