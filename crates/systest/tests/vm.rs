//! VM guests: a real QEMU (TCG) whose RAM is a pagefleet region, its
//! faults served through the userfaultfd the VM shim hands over, pages
//! going to real memory servers. The in-guest workload (vmwork) checks
//! every word it reads.

use pagefleet_region::{Adopt, Config, Region};
use pagefleet_systest::*;
use pagefleet_vm::{Vm, VmSpec};
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

#[test]
fn a_vm_with_a_quarter_of_its_memory_resident_verifies_every_value() {
    let (kernel, initrd) = vm_image();
    let c = Cluster::start(1, "256MiB");
    let dir = tempdir("vm");
    let size = 256 * MIB;
    let spec = VmSpec {
        kernel,
        initrd,
        append: "vmwork_mb=120 vmwork_secs=8 vmwork_write=20 vmwork_seed=7".into(),
        disk: None,
        smp: 1,
        size,
        name: "vmtest".into(),
    };
    let adopt = Adopt::create("pagefleet-vmtest", size).expect("memfd");
    let (vm, foreign) = Vm::start(&spec, &adopt.memfd, &dir, false).expect("QEMU starts");
    let mut cfg = Config::new(size, size / 4096 / 4);
    cfg.servers = c.addrs();
    cfg.secret = Some(c.secret.clone());
    cfg.adopt = Some(Arc::new(adopt));
    cfg.foreign = Some(Arc::new(foreign));
    cfg.name = "vmtest".into();
    let region = Region::new(cfg).expect("region on QEMU's RAM");
    vm.release().expect("QEMU goes on");
    let w = wait_done(&vm, Duration::from_secs(240));
    let st = region.stats();
    let tail = vm.console.tail(15).join("\n");
    eprintln!("vmwork: {w:?}\nregion: {st:?}");
    assert!(w.done, "vmwork did not finish; console:\n{tail}");
    assert_eq!(w.errors, 0, "wrong values read; console:\n{tail}");
    assert_eq!(w.verified, 120 * MIB / 4096, "final pass; console:\n{tail}");
    assert!(w.ops > 0);
    // 120 MiB of data through 64 MiB resident: pages left and came back.
    assert!(st.page_outs + st.clean_drops > 5000, "{st:?}");
    assert!(st.page_ins > 5000, "{st:?}");
    assert!(st.resident_pages <= size / 4096 / 4, "{st:?}");
    vm.shutdown(Duration::from_secs(5));
    region.close().expect("pages freed on the server");
}
