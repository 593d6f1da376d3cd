//! VM guests: a real QEMU (TCG) whose RAM is a pagefleet region, its
//! faults served through the userfaultfd the VM shim hands over, pages
//! going to real memory servers. The in-guest workload (vmwork) checks
//! every word it reads.

use pagefleet_api::DiskFormat;
use pagefleet_region::{Adopt, Config, Region};
use pagefleet_systest::*;
use pagefleet_vm::{Disk, Vm, VmSpec};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// Wait for the in-guest workload to finish (bounded); its final counters.
fn wait_done(vm: &Vm, limit: Duration) -> pagefleet_vm::console::Workload {
    let t0 = Instant::now();
    loop {
        let w = vm.console.workload();
        if w.done || vm.exited().is_some() || t0.elapsed() > limit {
            // The last lines come after "done": give the reader a moment.
            std::thread::sleep(Duration::from_millis(200));
            return vm.console.workload();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// QEMU started on a fresh memfd of `spec.size`, its RAM a region paging
/// to `c`'s servers with `budget` pages resident, and let go on.
fn start_paged(spec: &VmSpec, c: &Cluster, dir: &std::path::Path, budget: u64) -> (Vm, Region) {
    let adopt = Adopt::create(&format!("pagefleet-{}", spec.name), spec.size).expect("memfd");
    let (vm, foreign) = Vm::start(spec, &adopt.memfd, dir, false).expect("QEMU starts");
    let mut cfg = Config::new(spec.size, budget);
    cfg.servers = c.addrs();
    cfg.secret = Some(c.secret.clone());
    cfg.adopt = Some(Arc::new(adopt));
    cfg.foreign = Some(Arc::new(foreign));
    cfg.name = spec.name.clone();
    let region = Region::new(cfg).expect("region on QEMU's RAM");
    vm.release().expect("QEMU goes on");
    (vm, region)
}

/// The VM pages at a quarter of its size while it also reads its disk with
/// O_DIRECT into a buffer that goes cold between uses: QEMU's `preadv`
/// into paged-out guest RAM faults in the host kernel, which only a
/// registration that is not user-mode-only serves (else the guest's read
/// fails). vmwork checks every word from memory and from the disk.
#[test]
fn a_vm_with_a_quarter_of_its_memory_resident_verifies_every_value() {
    let (kernel, initrd) = vm_image();
    let disk = kernel.with_file_name("disk.img");
    let c = Cluster::start(1, "256MiB");
    let dir = tempdir("vm");
    let size = 256 * MIB;
    let spec = VmSpec {
        kernel: Some(kernel),
        initrd: Some(initrd),
        append: "vmwork_mb=120 vmwork_secs=8 vmwork_write=20 vmwork_seed=7 vmwork_disk=2".into(),
        disks: vec![Disk {
            path: disk,
            format: DiskFormat::Raw,
            readonly: true,
            overlay: None,
        }],
        forward: None,
        nic: None,
        guest_config: String::new(),
        machine: Default::default(),
        smp: 1,
        size,
        name: "vmtest".into(),
        operator_qmp: None,
        firmware: Default::default(),
    };
    let (vm, region) = start_paged(&spec, &c, &dir, size / 4096 / 4);
    let w = wait_done(&vm, Duration::from_secs(240));
    let st = region.stats();
    let tail = vm.console.tail(15).join("\n");
    eprintln!("vmwork: {w:?}\nregion: {st:?}");
    assert!(w.done, "vmwork did not finish; console:\n{tail}");
    assert_eq!(w.errors, 0, "wrong values read; console:\n{tail}");
    assert_eq!(w.verified, 120 * MIB / 4096, "final pass; console:\n{tail}");
    assert!(w.ops > 0);
    assert!(w.disk_reads > 100, "the disk was not read: {w:?}");
    // 120 MiB of data through 64 MiB resident: pages left and came back.
    assert!(st.page_outs + st.clean_drops > 5000, "{st:?}");
    assert!(st.page_ins > 5000, "{st:?}");
    assert!(st.resident_pages <= size / 4096 / 4, "{st:?}");
    vm.shutdown(Duration::from_secs(5));
    region.close().expect("pages freed on the server");
}

/// An operator's kind of VM: no kernel named, QEMU's firmware (SeaBIOS)
/// boots the first disk — a qcow2 image whose format is read from its
/// header — and its boot loader (syslinux) starts the guest; the VM's RAM
/// is a region paging at half its size to a memory server, and vmwork
/// checks every value it reads.
#[test]
fn a_vm_boots_from_a_qcow2_disk_through_its_firmware_and_pages() {
    let (kernel, _) = vm_image();
    let boot = kernel.with_file_name("boot.qcow2");
    let disk = Disk::resolve(&pagefleet_api::VmDisk {
        path: boot.display().to_string(),
        format: None,
        readonly: true,
        overlay: None,
    })
    .expect("the boot disk's format");
    assert_eq!(disk.format, DiskFormat::Qcow2);
    let c = Cluster::start(1, "256MiB");
    let dir = tempdir("vmboot");
    let size = 256 * MIB;
    let spec = VmSpec {
        kernel: None,
        initrd: None,
        append: String::new(),
        disks: vec![disk],
        forward: None,
        nic: None,
        guest_config: String::new(),
        machine: Default::default(),
        smp: 1,
        size,
        name: "vmboot".into(),
        operator_qmp: None,
        firmware: Default::default(),
    };
    let (vm, region) = start_paged(&spec, &c, &dir, size / 4096 / 2);
    // The firmware booted the disk: the boot loader's banner on the serial
    // console, then the kernel with the loader's command line (vmwork's
    // reports soon push both out of the console's tail).
    let (mut loader, mut cmdline) = (false, false);
    let t0 = Instant::now();
    while !(loader && cmdline) && vm.exited().is_none() && t0.elapsed() < Duration::from_secs(120) {
        let lines = vm.console.tail(usize::MAX);
        loader |= lines.iter().any(|l| l.contains("SYSLINUX"));
        cmdline |= lines
            .iter()
            .any(|l| l.contains("Command line:") && l.contains("vmwork_seed=11"));
        std::thread::sleep(Duration::from_millis(50));
    }
    let w = wait_done(&vm, Duration::from_secs(300));
    let st = region.stats();
    let console = vm.console.tail(40).join("\n");
    eprintln!("vmwork: {w:?}\nregion: {st:?}");
    assert!(loader, "no boot loader ran; console:\n{console}");
    assert!(
        cmdline,
        "the kernel did not get the disk's command line; console:\n{console}"
    );
    assert!(w.done, "vmwork did not finish; console:\n{console}");
    assert_eq!(w.errors, 0, "wrong values read; console:\n{console}");
    assert_eq!(
        w.verified,
        120 * MIB / 4096,
        "final pass; console:\n{console}"
    );
    // 120 MiB of data through 128 MiB resident beside the guest's kernel
    // and page cache: pages left and came back.
    assert!(st.page_outs + st.clean_drops > 1000, "{st:?}");
    assert!(st.page_ins > 1000, "{st:?}");
    vm.shutdown(Duration::from_secs(5));
    region.close().expect("pages freed on the server");
}

/// The accelerator probe tells a kernel that boots from one that does not:
/// under TCG the VM test kernel, given no root, reaches its panic and QEMU
/// exits by itself — the probe's success. Under KVM the answer depends on
/// the host (these machines' KVM runs only PVM guests: there the kernel
/// hangs and the probe says so within its limit); either way it says why.
#[test]
fn the_accelerator_probe_boots_a_real_kernel() {
    use pagefleet_vm::accel::{probe, Accel, PROBE_SECS};
    let (kernel, _) = vm_image();
    let qemu = std::path::Path::new("qemu-system-x86_64");
    let secs = probe(qemu, &kernel, Accel::Tcg).expect("the test kernel panics under TCG");
    assert!(secs < PROBE_SECS as f64, "{secs}");
    // An empty file is no kernel: QEMU refuses it at once, and the probe
    // says so rather than waiting.
    let dir = tempdir("probe");
    let empty = dir.join("empty");
    std::fs::write(&empty, b"").unwrap();
    let t = Instant::now();
    let e = probe(qemu, &empty, Accel::Tcg).unwrap_err();
    assert!(e.contains("QEMU exited"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(PROBE_SECS), "{e}");
    match probe(qemu, &kernel, Accel::Kvm) {
        Ok(s) => eprintln!("KVM boots a kernel here in {s:.1} s"),
        Err(e) => {
            eprintln!("KVM does not boot a kernel here: {e}");
            assert!(!e.is_empty());
        }
    }
}

/// Disk images QEMU would read other files through are refused before any
/// QEMU starts, naming the image and the file; a format given that the
/// header contradicts is refused too.
#[test]
fn disks_that_name_other_files_or_lie_about_their_format_are_refused() {
    let (kernel, _) = vm_image();
    let dir = tempdir("vmdisks");
    let overlay = dir.join("overlay.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(kernel.with_file_name("disk.img"))
        .arg(&overlay)
        .status()
        .expect("qemu-img");
    assert!(st.success());
    let run = |disk: String| {
        let out = std::process::Command::new(bin("pagefleet"))
            .args(["run", "--size", "64MiB", "vm", "--disk", &disk])
            .output()
            .expect("pagefleet run");
        assert!(!out.status.success(), "{disk} was attached");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run(overlay.display().to_string());
    assert!(
        e.contains("backing file") && e.contains("disk.img") && e.contains("overlay.qcow2"),
        "{e}"
    );
    let e = run(format!(
        "{},format=qcow2",
        kernel.with_file_name("disk.img").display()
    ));
    assert!(e.contains("no qcow2 header"), "{e}");
    // The same file as the overlay of another base: refused, naming both.
    let other = dir.join("other.img");
    std::fs::write(&other, vec![0u8; 1 << 20]).unwrap();
    let e = run(format!("{},overlay={}", other.display(), overlay.display()));
    assert!(
        e.contains("made over") && e.contains("disk.img") && e.contains("other.img"),
        "{e}"
    );
    let vmdk = dir.join("d.vmdk");
    let st = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "vmdk"])
        .arg(&vmdk)
        .arg("1M")
        .status()
        .expect("qemu-img");
    assert!(st.success());
    let e = run(vmdk.display().to_string());
    assert!(e.contains("VMDK") && e.contains("qemu-img convert"), "{e}");
}

/// `pagefleet CMD --json ARGS` in h1: the report, or the error text.
fn report(
    l: &pagefleet_lab::LabRun,
    cmd: &str,
    args: &[&str],
) -> Result<serde_json::Value, String> {
    let mut a = vec![cmd, "--json"];
    a.extend_from_slice(args);
    let (ok, out, err) = l.pf(0, &a);
    if ok {
        Ok(serde_json::from_str(&out).unwrap_or_else(|e| panic!("report: {e}: {out}")))
    } else {
        Err(err)
    }
}

/// The VM runs on host `on` and its workload makes progress with 0 errors.
fn assert_vm_runs(l: &pagefleet_lab::LabRun, name: &str, on: usize) -> pagefleet_api::GuestStatus {
    let (h, g) = l.guest(name).unwrap_or_else(|| panic!("{name} is gone"));
    assert_eq!(h, on, "{name} should run on h{}: {g:?}", on + 1);
    let a = g.ops;
    let t = Instant::now();
    loop {
        let (_, g) = l.guest(name).expect("guest");
        let vm = g.vm.clone().expect("VM status");
        assert_eq!(vm.errors, 0, "the VM read wrong values: {:?}", vm.console);
        if g.ops > a {
            return g;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{name} makes no progress on h{}: {vm:?}",
            on + 1
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// `guest start NAME --on h1 --size 256MiB -- vm ...` with the test image,
/// vmwork's `append` and `extra` vm flags; returns once vmwork runs.
fn start_vm(l: &pagefleet_lab::LabRun, name: &str, append: &str, extra: &[&str]) {
    let (kernel, initrd) = vm_image();
    let mut args = vec![
        "guest",
        "start",
        name,
        "--on",
        "h1",
        "--size",
        "256MiB",
        "--",
        "vm",
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        initrd.to_str().unwrap(),
        "--append",
        append,
    ];
    args.extend_from_slice(extra);
    let (ok, _, err) = l.pf(0, &args);
    assert!(ok, "guest start: {err}");
    // Booted, filled, and running its checked reads and writes.
    let t = Instant::now();
    while l.guest(name).is_none_or(|(_, g)| g.ops == 0) {
        assert!(
            // UEFI under TCG adds its own boot time.
            t.elapsed() < Duration::from_secs(120),
            "the VM never started its workload: {:?}",
            l.guest(name)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A file removed when the test ends, passed or not.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_uefi_vm_on_an_overlay_is_split_migrated_and_gathered_back_while_its_workload_checks_every_value(
) {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    // h1 runs the VM; h2 has memory for half of it; h3 only lends.
    let l = lab(
        "vmmig",
        3,
        pagefleet_testbed::Link::Gbit10,
        512 * MIB,
        &[512 * MIB, 128 * MIB, 0],
    );
    // The shared test disk as a read-only base under the VM's own overlay
    // (both under the allowed image directory, the overlay made by h1 at
    // start): vmwork writes chunks and checks them on later reads, also
    // after the VM moved to another QEMU — writes made on the source must
    // be in the overlay the destination's QEMU reads, and the base must
    // never change.
    let image = vm_image().0.with_file_name("disk.img");
    let base_before = std::fs::read(&image).expect("the test disk");
    let overlay =
        RemoveOnDrop(image.with_file_name(format!("disk-vmmig-{}.qcow2", std::process::id())));
    let _ = std::fs::remove_file(&overlay.0);
    let disk_arg = format!(
        "{},overlay={}",
        image.to_str().unwrap(),
        overlay.0.to_str().unwrap()
    );
    // UEFI: OVMF boots the kernel (its EFI stub); the variable store is
    // the VM's, made by h1 from OVMF's template, and moves with it.
    let nvram = RemoveOnDrop(image.with_file_name(format!("vmmig-{}_VARS.fd", std::process::id())));
    let _ = std::fs::remove_file(&nvram.0);
    start_vm(
        &l,
        "vm1",
        "vmwork_mb=120 vmwork_secs=0 vmwork_write=20 vmwork_seed=3 vmwork_disk=1 vmwork_diskw=30",
        &[
            "--disk",
            &disk_arg,
            "--firmware",
            "uefi",
            "--nvram",
            nvram.0.to_str().unwrap(),
        ],
    );
    pagefleet_common::disk_image::check_overlay(&overlay.0, &image)
        .expect("h1 made the VM's overlay over the test disk");
    assert_eq!(
        std::fs::metadata(&nvram.0).map(|m| m.len()).ok(),
        std::fs::metadata(pagefleet_vm::firmware::ovmf_vars_template())
            .map(|m| m.len())
            .ok(),
        "h1 made the VM's UEFI variable store"
    );
    assert_vm_runs(&l, "vm1", 0);
    // The operator's QMP socket reaches the VM's disk (what the I/O
    // guarantee's QMP backend throttles).
    let (_, g) = l.guest("vm1").unwrap();
    let qmp_path =
        g.vm.and_then(|v| v.operator_qmp)
            .expect("operator QMP socket");
    let mut q =
        pagefleet_vm::qmp::Qmp::connect(std::path::Path::new(&qmp_path), Duration::from_secs(5))
            .expect("operator QMP");
    let blocks: serde_json::Value = q.execute("query-block", None).unwrap();
    assert!(blocks.to_string().contains("disk0"), "{blocks}");
    q.execute::<serde_json::Value>(
        "block_set_io_throttle",
        Some(
            serde_json::json!({"id": "/machine/peripheral-anon/device[0]/virtio-backend",
            "bps": 0, "bps_rd": 0, "bps_wr": 0, "iops": 100, "iops_rd": 0, "iops_wr": 0}),
        ),
    )
    .or_else(|_| {
        q.execute::<serde_json::Value>(
            "block_set_io_throttle",
            Some(serde_json::json!({"device": "disk0",
                "bps": 0, "bps_rd": 0, "bps_wr": 0, "iops": 100, "iops_rd": 0, "iops_wr": 0})),
        )
    })
    .expect("throttle the VM's disk");
    drop(q);
    // Its serial console is kept in the runner's log.
    let log =
        std::fs::read_to_string(l.control(0, "vm1").with_extension("log")).unwrap_or_default();
    assert!(
        log.contains("vmwork: filled"),
        "no console lines in the runner's log:\n{log}"
    );
    // Split: h2 keeps what fits, h3 gets the rest.
    let r = report(&l, "migrate", &["vm1", "--verify"]).expect("split migration of the VM");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    assert!(r["checksum_source"].is_string(), "{r}");
    assert!(
        r["pages_subs"][0].as_u64().unwrap() > 1000,
        "nothing went to the sub-host: {r}"
    );
    eprintln!(
        "split: total {} s, downtime {} ms, main {} pages, subs {}",
        r["total_secs"], r["downtime_ms"], r["pages_main"], r["pages_subs"]
    );
    let g = assert_vm_runs(&l, "vm1", 1);
    assert!(g.resident_pages <= 128 * MIB / 4096, "{g:?}");
    // Evacuate the sub-host: the VM's pages move off h3 while it runs.
    let on = |h: usize| {
        l.guest("vm1")
            .and_then(|g| g.1.pages)
            .and_then(|p| p.remote.get(&l.lab.hosts[h].addr).copied())
            .unwrap_or(0)
    };
    assert!(on(2) > 0, "nothing on h3 to evacuate");
    let (ok, out, err) = l.pf(0, &["evacuate", "h3"]);
    assert!(
        ok && out.contains("pages moved from h3"),
        "evacuate h3: {out} {err}"
    );
    assert_eq!(on(2), 0, "pages left on h3");
    assert!(on(0) + on(1) > 0, "the pages went nowhere");
    assert_vm_runs(&l, "vm1", 1);
    // Gather it back to h1 (it pages on h2 meanwhile).
    let r = report(&l, "gather", &["vm1", "--to", "h1", "--verify"]).expect("gather of the VM");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    let g = assert_vm_runs(&l, "vm1", 0);
    assert_eq!(g.remote_pages, 0, "{g:?}");
    // vmwork wrote its disk all along and its reads (0 errors) saw those writes.
    let console = g.vm.map(|v| v.console).unwrap_or_default();
    let writes = console
        .iter()
        .rev()
        .find_map(|l| {
            l.split_whitespace()
                .find_map(|f| f.strip_prefix("disk_writes="))
        })
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(writes > 100, "vmwork did not write its disk: {console:?}");
    let (ok, _, err) = l.pf(0, &["guest", "stop", "vm1"]);
    assert!(ok, "guest stop: {err}");
    // The writes are in the overlay; the base is as it was.
    assert!(
        std::fs::read(&image).expect("the test disk") == base_before,
        "the read-only base changed"
    );
    let written = std::fs::metadata(&overlay.0).map(|m| m.len()).unwrap_or(0);
    assert!(
        written > 1 << 20,
        "the overlay holds no writes ({written} bytes)"
    );
}

#[test]
fn a_host_refuses_vm_files_outside_its_image_directories() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let (kernel, _) = vm_image();
    let l = lab(
        "vmref",
        1,
        pagefleet_testbed::Link::Gbit10,
        64 * MIB,
        &[256 * MIB],
    );
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "v",
            "--on",
            "h1",
            "--size",
            "64MiB",
            "--",
            "vm",
            "--kernel",
            kernel.to_str().unwrap(),
            "--initrd",
            "/etc/shadow",
        ],
    );
    assert!(!ok, "a VM with /etc/shadow as its initrd was started");
    assert!(err.contains("--vm-images"), "{err}");
    assert!(l.guest("v").is_none());
}

/// Abort drills with a VM: the destination dies in pre-copy, the command is
/// interrupted (Ctrl-C), the destination dies at stop-and-copy, and it dies
/// after QEMU's device state has left the source (the source QEMU is then
/// "postmigrate" and must run again). Each time the VM keeps running on
/// the source with 0 errors and nothing is left on the sub-host; a final
/// migration's checksums agree.
#[test]
fn aborted_vm_migrations_leave_the_vm_running_on_the_source() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    // 1 Gbit links: round 1 of ~130 MiB takes about a second.
    let l = lab(
        "vmabt",
        3,
        pagefleet_testbed::Link::Gbit1,
        512 * MIB,
        &[512 * MIB, 128 * MIB, 0],
    );
    start_vm(
        &l,
        "va",
        "vmwork_mb=120 vmwork_secs=0 vmwork_write=20 vmwork_seed=5",
        &[],
    );
    let src_ctl = l.control(0, "va");
    let phase = || {
        guest_status(&src_ctl)
            .and_then(|g| g.migration)
            .map(|m| m.phase)
            .unwrap_or_default()
    };
    let wait_phase = |p: &str| -> bool {
        let t = Instant::now();
        while !phase().starts_with(p) {
            if t.elapsed() > Duration::from_secs(60) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    };
    let kill_dest = || {
        kill_in(&l, 1, "runner-incoming");
    };
    let run_bg = |extra: &[&str]| {
        let mut c = l.lab.exec(0, bin("pagefleet"));
        c.args(["migrate", "va", "--to", "h2", "--sub", "h3"])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };
    let check_clean = |what: &str| {
        let t = Instant::now();
        while !phase().is_empty() && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let g = assert_vm_runs(&l, "va", 0);
        let vm = g.vm.expect("VM status");
        assert_eq!(vm.state, "running", "{what}: {vm:?}");
        if let Some(rep) = l.host_report(2) {
            assert_eq!(rep.lend_used, 0, "{what}: pages left on the sub-host");
        }
        // The destination's QEMU ends with its runner (the shim's agent
        // sees the runner's socket close); a drill must not meet the last
        // one's QEMU still exiting.
        let t = Instant::now();
        while signal_in(&l, 1, "qemu-system", 0) {
            if t.elapsed() > Duration::from_secs(20) {
                let ps = std::process::Command::new("sh")
                    .arg("-c")
                    .arg(format!("for p in $(ip netns pids {}); do echo \"== $p $(tr '\\0' ' ' < /proc/$p/cmdline | cut -c1-80)\"; grep -E 'State|PPid' /proc/$p/status; for t in /proc/$p/task/*; do echo \"$t $(cat $t/wchan) $(cut -d' ' -f3 $t/stat)\"; done; cat /proc/$p/stack; done", l.lab.hosts[1].netns))
                    .output()
                    .unwrap();
                panic!(
                    "{what}: the destination's QEMU outlived its runner:\n{}",
                    String::from_utf8_lossy(&ps.stdout)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // The destination's reserved memory comes back when its runner goes.
        let t = Instant::now();
        while l.host_report(1).unwrap().guest_free != 128 * MIB {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{what}: destination memory still reserved"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };

    // 1. The destination runner dies during round 1.
    let mut m = run_bg(&[]);
    assert!(wait_phase("round 1"), "never reached round 1");
    kill_dest();
    assert!(
        !m.wait().unwrap().success(),
        "migration to a dead destination succeeded"
    );
    check_clean("destination killed in round 1");

    // 2. Ctrl-C during round 1.
    let m = run_bg(&[]);
    assert!(wait_phase("round 1"));
    let _ = pagefleet_common::sys::process::signal(m.id() as i32, libc::SIGINT);
    let out = m.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("rolled back:"),
        "Ctrl-C: {said}"
    );
    check_clean("Ctrl-C");

    // 3. The destination dies at stop-and-copy (the VM is stopped; the
    // stop-time checksum holds the phase open).
    let mut m = run_bg(&["--verify", "--max-rounds", "2"]);
    if !wait_phase("stop-and-copy") {
        let _ = m.kill();
        let out = m.wait_with_output().unwrap();
        panic!(
            "never reached stop-and-copy: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    kill_dest();
    assert!(!m.wait().unwrap().success());
    check_clean("destination killed at stop-and-copy");

    // 4. The destination's QEMU dies during pre-copy (it starts early, on
    // the memory being received): the destination fails at commit, after
    // the source's device state was taken (the source QEMU is then
    // "postmigrate" and must run again). It is killed the moment it shows,
    // not after round 1 shows on the source: on a loaded host the whole
    // pre-copy can pass between two polls.
    let mut m = run_bg(&[]);
    let t = Instant::now();
    while !kill_in(&l, 1, "qemu-system") {
        if let Some(st) = m.try_wait().unwrap() {
            let mut said = String::new();
            use std::io::Read;
            let _ = m.stderr.take().unwrap().read_to_string(&mut said);
            panic!("the migration ended ({st}) before its destination QEMU was seen: {said}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the destination's QEMU never started"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let out = m.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "migration with a dead destination QEMU succeeded: {said}"
    );
    assert!(!said.contains("in doubt"), "{said}");
    check_clean("destination QEMU killed");

    // The data is intact: a migration's checksums agree.
    let r = report(
        &l,
        "migrate",
        &["va", "--to", "h2", "--sub", "h3", "--verify"],
    )
    .expect("migration after the drills");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    assert_vm_runs(&l, "va", 1);
}

/// A VM running Debian's memcached, driven by the kv client as a kv guest
/// is: its service address is forwarded into the VM (QEMU user-mode
/// network), follows it through a split migration and a gather, and every
/// value the client reads back is the one it stored — the VM's memory and
/// its NIC's state moved, the clients reconnected.
#[test]
fn a_memcached_vm_serves_the_kv_client_through_split_and_gather() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    use pagefleet_lab::kvload;
    use std::sync::atomic::Ordering::Relaxed;
    let l = lab(
        "vmkv",
        3,
        pagefleet_testbed::Link::Gbit10,
        512 * MIB,
        &[512 * MIB, 160 * MIB, 0],
    );
    let ip = l.lab.service_ip(3);
    let svc = format!("{ip}:11211");
    let (kernel, initrd) = vm_image();
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "mc1",
            "--on",
            "h1",
            "--size",
            "256MiB",
            "--",
            "vm",
            "--kernel",
            kernel.to_str().unwrap(),
            "--initrd",
            initrd.to_str().unwrap(),
            "--append",
            "memcached_mb=160",
            "--listen",
            &svc,
            "--service-ip",
            &ip,
        ],
    );
    assert!(ok, "guest start: {err}");
    let spec = kvload::Spec {
        addr: svc,
        keys: 8_000,
        value_len: 2000,
        conns: 4,
        get_frac: 0.9,
        theta: 0.99,
        netns: Some(l.lab.hosts[2].netns.clone()),
        reconnect: true,
        pace: None,
    };
    // memcached boots in a few seconds under TCG: prefill once it answers.
    kvload::prefill_patiently(&spec, Duration::from_secs(60)).expect("memcached in the VM");
    let load = kvload::Load::start(&spec);
    let progress = |what: &str| wait_progress(&load, what);
    progress("before the migration");
    let r = report(
        &l,
        "migrate",
        &["mc1", "--to", "h2", "--sub", "h3", "--verify"],
    )
    .expect("split migration");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    assert_eq!(
        l.lab.service_ip_host(&ip),
        Some(1),
        "the service address did not move to h2"
    );
    progress("after the split");
    let r = report(&l, "gather", &["mc1", "--to", "h1", "--verify"]).expect("gather");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    progress("after the gather");
    let c = load.counters.clone();
    let err = load.error();
    load.stop().expect("load");
    assert!(err.is_none(), "{err:?}");
    assert_eq!(c.bad_values.load(Relaxed), 0, "wrong values served");
    assert_eq!(c.misses.load(Relaxed), 0, "keys lost");
    assert!(
        c.reconnects.load(Relaxed) > 0,
        "clients should have reconnected to the moved address"
    );
    let (ok, _, err) = l.pf(0, &["guest", "stop", "mc1"]);
    assert!(ok, "guest stop: {err}");
}

/// Wait until the kv clients have made 200 more operations (30 s at most).
fn wait_progress(load: &pagefleet_lab::kvload::Load, what: &str) {
    use std::sync::atomic::Ordering::Relaxed;
    let a = load.counters.ops.load(Relaxed);
    let t = Instant::now();
    while load.counters.ops.load(Relaxed) < a + 200 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "clients make no progress {what}: {:?}",
            load.error()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Tap devices (`pft*`) on lab host `h`'s network namespace.
fn taps_on(l: &pagefleet_lab::LabRun, h: usize) -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args(["-n", &l.lab.hosts[h].netns, "-o", "link", "show"])
        .output()
        .expect("ip link");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_string())
        .filter(|n| n.starts_with("pft"))
        .collect()
}

/// A libvirt domain definition as real libvirt writes it: `virsh` (its
/// test driver, no daemon) defines the domain, sets pagefleet's metadata
/// (the VM's address and settings) and dumps it.
fn virsh_domain_xml(
    dir: &std::path::Path,
    name: &str,
    disk: &str,
    ip: &str,
    config: &str,
) -> std::path::PathBuf {
    let input = dir.join(format!("{name}-in.xml"));
    std::fs::write(
        &input,
        format!(
            "<domain type='kvm'>
  <name>{name}</name>
  <memory unit='MiB'>384</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type><boot dev='hd'/></os>
  <features><acpi/></features>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <interface type='bridge'>
      <mac address='52:54:00:5e:00:51'/>
      <source bridge='vmbr0'/>
      <model type='virtio'/>
    </interface>
    <serial type='pty'/>
    <console type='pty'/>
    <graphics type='vnc' port='-1'/>
    <video><model type='vga'/></video>
    <memballoon model='virtio'/>
  </devices>
</domain>"
        ),
    )
    .unwrap();
    let script = format!(
        "define {}; metadata {name} --uri urn:pagefleet:guest:1 --key pagefleet --set '<guest ip=\"{ip}\" config=\"{config}\"/>'; dumpxml {name}",
        input.display()
    );
    let out = std::process::Command::new("virsh")
        .args(["-q", "-c", "test:///default", &script])
        .output()
        .expect("virsh (Debian's libvirt-clients)");
    assert!(
        out.status.success(),
        "virsh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let xml = String::from_utf8(out.stdout).unwrap();
    let xml = &xml[xml.find("<domain").expect("virsh printed a domain")..];
    assert!(xml.contains("urn:pagefleet:guest:1"), "{xml}");
    let file = dir.join(format!("{name}.xml"));
    std::fs::write(&file, xml).unwrap();
    file
}

#[test]
fn a_debian_vm_keeps_its_address_and_connections_through_split_and_gather() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    use pagefleet_lab::kvload;
    use std::sync::atomic::Ordering::Relaxed;
    let l = lab(
        "vmdeb",
        3,
        pagefleet_testbed::Link::Gbit10,
        512 * MIB,
        &[512 * MIB, 256 * MIB, 0],
    );
    let disk = debian_disk(&l.lab.prefix);
    let ip = l.lab.vm_ip(1);
    let addr = format!("{}:11211", ip.split('/').next().unwrap());
    // Defined as an operator's VM is: a libvirt domain, as virsh writes it.
    let tmp = tempdir("vmdeb");
    let xml = virsh_domain_xml(&tmp, "deb1", disk.path(), &ip, "memcached_mb=96");
    let (ok, out, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "deb1",
            "--on",
            "h1",
            "--domain-xml",
            xml.to_str().unwrap(),
        ],
    );
    assert!(ok, "guest start: {err}");
    for left_out in [
        "devices/graphics (vnc)",
        "devices/memballoon",
        "source bridge='vmbr0'",
    ] {
        assert!(
            out.contains(left_out),
            "{left_out} should be listed as left out: {out}"
        );
    }
    assert_eq!(taps_on(&l, 0).len(), 1, "one tap on h1's VM bridge");
    let spec = kvload::Spec {
        addr,
        keys: 8_000,
        value_len: 2000,
        conns: 4,
        get_frac: 0.9,
        theta: 0.99,
        netns: Some(l.lab.hosts[2].netns.clone()),
        reconnect: true,
        pace: None,
    };
    // Debian boots in 15-40 s under TCG; its memcached then answers on
    // the VM's own address, reached from h3 across the lab's switch.
    kvload::prefill_patiently(&spec, Duration::from_secs(180)).expect("memcached in the Debian VM");
    let on = |want: usize| {
        let (h, g) = l.guest("deb1").expect("deb1 is gone");
        assert_eq!(h, want, "deb1 should run on h{}: {g:?}", want + 1);
        g.vm.map(|v| v.console.join("\n")).unwrap_or_default()
    };
    // memcached answers a moment before the guest's ready line.
    let t = Instant::now();
    let vm = loop {
        let (_, g) = l.guest("deb1").expect("deb1");
        let vm = g.vm.expect("VM status");
        if vm.ready.is_some() || t.elapsed() > Duration::from_secs(30) {
            break vm;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    let console = on(0);
    let mac = "52:54:00:5e:00:51";
    assert!(
        vm.nic.as_deref().is_some_and(|n| n.starts_with(mac)),
        "status should show the NIC with MAC {mac}: {:?}",
        vm.nic
    );
    let ready = vm.ready.unwrap_or_default();
    assert!(
        ready.starts_with(&format!("host=deb1 ip={ip} memcached=")),
        "the guest's ready line should show the name and address it read from fw_cfg: {ready:?} (console: {console})"
    );
    let load = kvload::Load::start(&spec);
    let progress = |what: &str| wait_progress(&load, what);
    progress("before the migration");
    let r = report(
        &l,
        "migrate",
        &["deb1", "--to", "h2", "--sub", "h3", "--verify"],
    )
    .expect("split migration");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    progress("after the split");
    on(1);
    assert_eq!(
        taps_on(&l, 0),
        Vec::<String>::new(),
        "h1's tap left with its QEMU"
    );
    assert_eq!(taps_on(&l, 1).len(), 1, "one tap on h2's VM bridge");
    let r = report(&l, "gather", &["deb1", "--to", "h1", "--verify"]).expect("gather");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    progress("after the gather");
    let c = load.counters.clone();
    let err = load.error();
    load.stop().expect("load");
    assert!(err.is_none(), "{err:?}");
    assert_eq!(c.bad_values.load(Relaxed), 0, "wrong values served");
    assert_eq!(c.misses.load(Relaxed), 0, "keys lost");
    // The VM's TCP connections live in the guest's kernel and its address
    // moved with it: the clients' connections survive both moves.
    assert_eq!(
        c.reconnects.load(Relaxed),
        0,
        "the clients' connections should have survived the moves (console: {console})"
    );
    let (ok, _, err) = l.pf(0, &["guest", "stop", "deb1"]);
    assert!(ok, "guest stop: {err}");
    let t = Instant::now();
    while !taps_on(&l, 0).is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "h1's tap outlived the VM"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The migration abort drills on the Debian VM, started from CLI flags
/// (`--disk`, `--nic`, `--guest-config`), with memcached under the kv
/// client's load from h3: the destination killed in round 1 and at
/// stop-and-copy, the command interrupted, the sub-host's daemon killed.
/// After each the VM runs on h1 and its clients make progress; a final
/// split's checksums agree; no value read is wrong or missing, and no
/// client connection broke (the VM's address never left it).
#[test]
fn debian_vm_migration_drills_keep_memcached_serving() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    use pagefleet_lab::kvload;
    use pagefleet_lab::LabRun;
    use std::sync::atomic::Ordering::Relaxed;
    // 1 Gbit links: round 1 (the booted system and memcached's data) takes
    // about a second.
    let mut l = lab(
        "vmdrl",
        3,
        pagefleet_testbed::Link::Gbit1,
        512 * MIB,
        // h2 holds a third of the VM: the rest of what it touched goes to
        // the sub-host h3.
        &[512 * MIB, 128 * MIB, 0],
    );
    let disk = debian_disk(&l.lab.prefix);
    let ip = l.lab.vm_ip(2);
    let nic = format!("bridge,ip={ip}");
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "dd",
            "--on",
            "h1",
            "--size",
            "384MiB",
            "--",
            "vm",
            "--disk",
            disk.path(),
            "--nic",
            &nic,
            "--guest-config",
            "memcached_mb=96",
        ],
    );
    assert!(ok, "guest start: {err}");
    let spec = kvload::Spec {
        addr: format!("{}:11211", ip.split('/').next().unwrap()),
        keys: 8_000,
        value_len: 2000,
        conns: 4,
        get_frac: 0.9,
        theta: 0.99,
        netns: Some(l.lab.hosts[2].netns.clone()),
        reconnect: true,
        pace: None,
    };
    kvload::prefill_patiently(&spec, Duration::from_secs(180)).expect("memcached in the Debian VM");
    let load = kvload::Load::start(&spec);
    let progress = |what: &str| wait_progress(&load, what);
    progress("before the drills");
    let phase = |l: &LabRun| {
        guest_status(&l.control(0, "dd"))
            .and_then(|g| g.migration)
            .map(|m| m.phase)
            .unwrap_or_default()
    };
    let wait_phase = |l: &LabRun, p: &str| -> bool {
        let t = Instant::now();
        while !phase(l).starts_with(p) {
            if t.elapsed() > Duration::from_secs(60) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    };
    let run_bg = |l: &LabRun, extra: &[&str]| {
        let mut c = l.lab.exec(0, bin("pagefleet"));
        c.args(["migrate", "dd", "--to", "h2", "--sub", "h3"])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };
    let check_clean = |l: &LabRun, what: &str| {
        let t = Instant::now();
        while !phase(l).is_empty() && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let (h, g) = l.guest("dd").expect("dd is gone");
        assert_eq!(h, 0, "{what}: the VM should run on h1: {g:?}");
        let vm = g.vm.expect("VM status");
        assert_eq!(vm.state, "running", "{what}: {vm:?}");
        if let Some(rep) = l.host_report(2) {
            assert_eq!(rep.lend_used, 0, "{what}: pages left on the sub-host");
        }
        let t = Instant::now();
        while signal_in(l, 1, "qemu-system", 0) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{what}: the destination's QEMU outlived its runner"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        progress(what);
    };

    // 1. The destination runner dies during round 1.
    let mut m = run_bg(&l, &[]);
    assert!(wait_phase(&l, "round 1"), "never reached round 1");
    kill_in(&l, 1, "runner-incoming");
    assert!(
        !m.wait().unwrap().success(),
        "migration to a dead destination succeeded"
    );
    check_clean(&l, "destination killed in round 1");

    // 2. The command interrupted (Ctrl-C) during round 1.
    let m = run_bg(&l, &[]);
    assert!(wait_phase(&l, "round 1"));
    let _ = pagefleet_common::sys::process::signal(m.id() as i32, libc::SIGINT);
    let out = m.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("rolled back:"),
        "Ctrl-C: {said}"
    );
    check_clean(&l, "Ctrl-C");

    // 3. The destination dies at stop-and-copy (the VM is stopped; the
    // stop-time checksum holds the phase open).
    let mut m = run_bg(&l, &["--verify", "--max-rounds", "2"]);
    if !wait_phase(&l, "stop-and-copy") {
        let _ = m.kill();
        let out = m.wait_with_output().unwrap();
        panic!(
            "never reached stop-and-copy: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    kill_in(&l, 1, "runner-incoming");
    assert!(!m.wait().unwrap().success());
    check_clean(&l, "destination killed at stop-and-copy");

    // 4. The sub-host's daemon dies during pre-copy; it comes back after.
    let mut m = run_bg(&l, &[]);
    assert!(wait_phase(&l, "round 1"));
    kill_in(&l, 2, "pagefleetd");
    assert!(
        !m.wait().unwrap().success(),
        "migration with a dead sub-host succeeded"
    );
    check_clean(&l, "sub-host killed");
    l.restart_daemon(2).expect("restart h3's daemon");

    // The data is intact: a split's checksums agree, and it serves on h2.
    let r = report(
        &l,
        "migrate",
        &["dd", "--to", "h2", "--sub", "h3", "--verify"],
    )
    .expect("split after the drills");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    progress("after the split");
    assert_eq!(
        l.guest("dd").map(|g| g.0),
        Some(1),
        "the VM should run on h2"
    );
    let c = load.counters.clone();
    let err = load.error();
    load.stop().expect("load");
    assert!(err.is_none(), "{err:?}");
    assert_eq!(c.bad_values.load(Relaxed), 0, "wrong values served");
    assert_eq!(c.misses.load(Relaxed), 0, "keys lost");
    assert_eq!(c.reconnects.load(Relaxed), 0, "client connections broke");
    let (ok, _, err) = l.pf(1, &["guest", "stop", "dd"]);
    assert!(ok, "guest stop: {err}");
}
