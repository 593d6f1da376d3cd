//! The kv guest's memcached text protocol on arbitrary client bytes:
//! `serve_session` (the code that serves each TCP client) over a table in
//! 4 MiB of memory, kept across inputs so later inputs meet what earlier
//! ones stored. No input may panic it or hang it; afterwards a value just
//! stored through the same code reads back whole.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_guests::kv::{serve_session, Kv};
use pagefleet_guests::Mem;
use std::sync::OnceLock;

const BYTES: usize = 4 << 20;

fn kv() -> &'static Kv {
    static KV: OnceLock<Kv> = OnceLock::new();
    KV.get_or_init(|| {
        let words: &'static mut [u64] = Box::leak(vec![0u64; BYTES / 8].into_boxed_slice());
        // SAFETY: leaked, so valid and unaliased for the rest of the process;
        // the table is its only user.
        Kv::open(unsafe { Mem::new(words.as_mut_ptr().cast(), BYTES) })
    })
}

fuzz_target!(|data: &[u8]| {
    let kv = kv();
    let mut out = Vec::new();
    let _ = serve_session(kv, data, &mut out);
    assert!(out.len() <= 64 << 20, "{} bytes of replies", out.len());
    // The table still works: a set and a get of a fresh key, through the
    // same protocol code.
    let mut reply = Vec::new();
    serve_session(
        kv,
        &b"set fuzz:check 7 0 5\r\nhello\r\nget fuzz:check\r\n"[..],
        &mut reply,
    )
    .expect("in-memory session");
    let want = b"STORED\r\nVALUE fuzz:check 7 5\r\nhello\r\nEND\r\n";
    assert!(
        reply.ends_with(want),
        "after the input, set+get of a fresh key replied {:?}",
        String::from_utf8_lossy(&reply)
    );
});
