//! The NBD export's handshake and transmission phase on arbitrary client
//! bytes: `serve_client` (the code that serves TCP and Unix clients) over an
//! in-memory connection, backed by a real memory server on loopback (started
//! once). No input may panic it, hang it or make it touch blocks outside the
//! export; whatever it did, the server's books balance.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_blockdev::backend::{Shared, Written};
use pagefleet_blockdev::engine::Engine;
use pagefleet_blockdev::layout::Translator;
use pagefleet_blockdev::nbd::{serve_client, Export, Io, Served, Tls};
use pagefleet_memserver::{Backing, ServerConfig, ServerState, Store};
use pagefleet_proto::auth::Secret;
use std::io::{self, Read, Write};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

/// The export's blocks (4 KiB each), and the memory server's room.
const BLOCKS: u64 = 64;

struct World {
    engine: Arc<Engine>,
    state: Arc<ServerState>,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let secret = Secret::from_bytes(b"fuzz-secret-0123456789", "fuzz").unwrap();
        let state = Arc::new(ServerState::new(
            Store::with_backing(2 * BLOCKS * 4096, Backing::Memfd).unwrap(),
            secret.clone(),
            ServerConfig::default(),
        ));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let st = state.clone();
        std::thread::spawn(move || pagefleet_memserver::gate::serve(l, st));
        let shared = Arc::new(Shared {
            t: Translator::new(&[2 * BLOCKS], BLOCKS, None, false).unwrap(),
            region: 0x4e42_4400,
            servers: vec![addr],
            secret,
            down: vec![AtomicBool::new(false)],
            written: Written::new(BLOCKS),
            client_name: "fuzz-nbd".into(),
        });
        World {
            engine: Engine::start(shared),
            state,
        }
    })
}

/// The client's bytes in, replies counted and dropped.
struct Client {
    input: Vec<u8>,
    at: usize,
}

impl Read for Client {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // Small, odd-sized pieces: partial reads everywhere.
        let n = buf.len().min(self.input.len() - self.at).min(61);
        buf[..n].copy_from_slice(&self.input[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

impl Write for Client {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Io for Client {
    fn try_clone_box(&self) -> io::Result<Box<dyn Io>> {
        // The reply writer's handle: writes only.
        Ok(Box::new(Client {
            input: Vec::new(),
            at: 0,
        }))
    }
    fn close(&self) {}
    fn send_now(&self, bufs: &[io::IoSlice<'_>]) -> Option<io::Result<usize>> {
        // A socket that takes 61 bytes at a time: every longer reply goes
        // through the connection's backlog and its writer thread.
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        Some(Ok(total.min(61)))
    }
    fn set_write_timeout(&self, _d: Option<std::time::Duration>) -> io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let w = world();
    let ex = Export {
        name: "fuzz".into(),
        description: "fuzzed export".into(),
        size: BLOCKS * 4096,
    };
    let c = Client {
        input: data.to_vec(),
        at: 0,
    };
    let served = [Served {
        export: ex,
        engine: w.engine.clone(),
    }];
    let _ = serve_client(Box::new(c), &served, &Tls::default());
    let stats = w.state.store.stats(usize::MAX);
    assert!(stats.used_slots <= stats.capacity_pages);
    assert!(
        stats.stored_pages <= BLOCKS,
        "the export stored {} blocks; it has {BLOCKS}",
        stats.stored_pages
    );
});
