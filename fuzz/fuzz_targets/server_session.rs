//! Feed arbitrary bytes to a real server session (the same code that serves
//! TCP connections) backed by a real, tiny page store. First input byte: bit 0
//! selects a pre-authenticated session, so the fuzzer reaches page operations.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_memserver::server::{Session, Transport};
use pagefleet_memserver::{Backing, ServerConfig, ServerState, Store};
use pagefleet_proto::auth::Secret;
use pagefleet_proto::io::ReadAll;
use std::io::{self, Read, Write};

struct Mem<'a> {
    input: &'a [u8],
    written: usize,
}

impl Read for Mem<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // Deliver in small, odd-sized pieces to exercise partial reads.
        let n = buf.len().min(self.input.len()).min(97);
        buf[..n].copy_from_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Ok(n)
    }
}

impl ReadAll for Mem<'_> {}

impl Write for Mem<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.written += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for Mem<'_> {
    fn read_nonblocking(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        self.read(buf).map(Some)
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let secret = Secret::from_bytes(b"fuzz-secret-0123456789", "fuzz").unwrap();
    let st = ServerState::new(
        Store::with_backing(64 * 4096, Backing::Memfd).unwrap(),
        secret,
        ServerConfig::default(),
    );
    let mut t = Mem {
        input: rest,
        written: 0,
    };
    let s = if mode & 1 == 1 {
        Session::new_preauthenticated(&st, &mut t)
    } else {
        Session::new(&st, &mut t, "fuzz")
    };
    let _ = s.run();
    // Whatever happened, the store's books must balance.
    let stats = st.store.stats(usize::MAX);
    assert!(stats.used_slots <= stats.capacity_pages);
    assert_eq!(
        stats.used_slots, stats.stored_pages,
        "slots leaked or double-freed"
    );
    assert_eq!(
        stats.regions.iter().map(|r| r.1).sum::<u64>(),
        stats.stored_pages
    );
});
