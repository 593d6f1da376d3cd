//! QEMU's side of QMP on arbitrary bytes: `Qmp::over` (the greeting and
//! `qmp_capabilities`) and the commands pagefleet's VM code runs (status,
//! query-migrate, stop, cont, migrate-set-capabilities), over a real Unix
//! socket pair whose other end sends the input and then hangs up. No reply
//! may panic the client or hang it past the end of the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_vm::qmp::Qmp;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

fuzz_target!(|data: &[u8]| {
    let (ours, mut theirs) = UnixStream::pair().expect("socketpair");
    let input = data.to_vec();
    // QEMU's end: the input, then end of stream; what the client sends is
    // read and dropped (so its writes never fail or block).
    let qemu = std::thread::spawn(move || {
        let _ = theirs.write_all(&input);
        let _ = theirs.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = theirs.read_to_end(&mut sink);
    });
    if let Ok(mut q) = Qmp::over(ours, "fuzz") {
        let _ = q.status();
        let _ = q.query_migrate();
        let _ = q.set_capabilities(&[("postcopy-ram", true)]);
        let _ = q.stop();
        let _ = q.cont();
        let _ = q.last_event("STOP");
    }
    qemu.join().expect("QEMU's end");
});
