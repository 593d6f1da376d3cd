//! DMPS (distributed memory paging system): several memory servers
//! aggregated into one virtual block device, exported over NBD so Linux,
//! QEMU and every storage tool can use it (as swap, or as a disk).

pub mod backend;
pub mod engine;
pub mod layout;
pub mod nbd;

/// Why the export could not start.
#[derive(Debug, thiserror::Error)]
pub enum BlockdevError {
    /// A size or unit that is not whole blocks.
    #[error("{flag} must be a positive multiple of 4096 bytes")]
    NotBlocks {
        /// The flag.
        flag: &'static str,
    },
    /// A listen address strangers could reach.
    #[error("--listen {spec}: the NBD export has no authentication of its own, so without a TLS identity (--tls-dir) it listens on loopback (127.0.0.1:PORT) or a unix socket (unix:PATH) only, not on {ip}")]
    Exposed {
        /// The address given.
        spec: String,
        /// The non-loopback address it resolves to.
        ip: std::net::IpAddr,
    },
    /// A socket or file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// A memory server.
    #[error(transparent)]
    Server(#[from] pagefleet_client::ClientError),
    /// The layout does not fit the servers.
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
}

type Result<T> = std::result::Result<T, BlockdevError>;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BlockdevError {
    let what = what.into();
    move |source| BlockdevError::Io { what, source }
}
use backend::{Shared, Written, BLOCK};
use pagefleet_client::{Conn, ConnectOptions};
use pagefleet_proto::auth::Secret;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// What `blockdev serve` exports and how.
#[derive(Clone, Debug)]
pub struct Options {
    /// The memory servers making up the devices.
    pub servers: Vec<String>,
    /// The exports: each a device of its own (its own blocks on the
    /// servers), laid out alike; the first is the default ("").
    pub exports: Vec<ExportSpec>,
    /// Stripe unit in bytes (None: linear, DMPS eq. (1)).
    pub stripe: Option<u64>,
    /// Keep every block on two servers.
    pub mirror: bool,
    /// HOST:PORT or unix:PATH.
    pub listen: String,
}

/// One export: its name and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSpec {
    /// What clients ask for.
    pub name: String,
    /// Bytes.
    pub size: u64,
}

impl std::str::FromStr for ExportSpec {
    type Err = String;
    /// `NAME=SIZE` (e.g. `swap=1GiB`).
    fn from_str(s: &str) -> std::result::Result<ExportSpec, String> {
        let (name, size) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: an export is NAME=SIZE (e.g. swap=1GiB)"))?;
        if name.is_empty() || name.len() > 255 || name.chars().any(|c| c.is_control()) {
            return Err(format!(
                "{name:?}: an export name is 1 to 255 printable characters"
            ));
        }
        let size = pagefleet_common::units::parse_size(size).map_err(|e| format!("{s:?}: {e}"))?;
        Ok(ExportSpec {
            name: name.to_string(),
            size,
        })
    }
}

/// Where the export listens.
pub enum Listener {
    /// TCP on loopback.
    Tcp(std::net::TcpListener),
    /// A unix socket (its path, removed at the end).
    Unix(std::os::unix::net::UnixListener, std::path::PathBuf),
}

impl Listener {
    /// Listen for NBD clients. NBD has no authentication of its own, so
    /// strangers are kept out by where the export listens — TCP on
    /// loopback, or a unix socket only its owner may open (mode 0600) — or,
    /// with a TLS identity (`tls`), by TLS: then the export may listen on a
    /// network address, and every client not on loopback must STARTTLS with
    /// a certificate the cluster CA signed before it can do anything else.
    pub fn bind(spec: &str, tls: bool) -> Result<Listener> {
        Ok(match spec.strip_prefix("unix:") {
            Some(p) => {
                let _ = std::fs::remove_file(p);
                let l = std::os::unix::net::UnixListener::bind(p)
                    .map_err(io(format!("cannot listen on {p}")))?;
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600))
                    .map_err(io(format!("cannot restrict {p} to its owner")))?;
                Listener::Unix(l, p.into())
            }
            None => {
                let addrs: Vec<std::net::SocketAddr> =
                    std::net::ToSocketAddrs::to_socket_addrs(spec)
                        .map_err(io(format!("--listen {spec}: not HOST:PORT or unix:PATH")))?
                        .collect();
                if let Some(a) = addrs.iter().find(|a| !a.ip().is_loopback() && !tls) {
                    return Err(BlockdevError::Exposed {
                        spec: spec.to_string(),
                        ip: a.ip(),
                    });
                }
                Listener::Tcp(
                    pagefleet_common::listen::listen(&addrs[..])
                        .map_err(io(format!("cannot listen on {spec}")))?,
                )
            }
        })
    }
    /// Where it listens, as a client would name it.
    pub fn describe(&self) -> String {
        match self {
            Listener::Tcp(l) => l.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            Listener::Unix(_, p) => format!("unix:{}", p.display()),
        }
    }
    /// A client, and its address (None: a unix socket, its owner's alone).
    fn accept(&self) -> std::io::Result<(Box<dyn nbd::Io>, Option<std::net::SocketAddr>)> {
        Ok(match self {
            Listener::Tcp(l) => {
                let (s, peer) = l.accept()?;
                let _ = s.set_nodelay(true);
                (Box::new(pagefleet_tls::Stream::plain(s)), Some(peer))
            }
            Listener::Unix(l, _) => (Box::new(l.accept()?.0), None),
        })
    }
}

/// A device ready to serve: connected to its servers, its layout fixed.
pub struct Device {
    /// What every connection shares.
    pub shared: Arc<Shared>,
    /// Its I/O: a lane per memory server.
    pub engine: Arc<engine::Engine>,
    /// What NBD clients are told.
    pub export: nbd::Export,
    /// Set to end the sessions that hold the device's blocks.
    holding: Arc<AtomicBool>,
}

/// How often the holder checks its sessions: a server restarted in between
/// is noticed (and the device's blocks there reported lost) within this.
const HOLD_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// The device's name on the memory servers: unique per device (its region
/// id), so a server counts this device's region in use exactly while one of
/// this device's sessions is connected — with or without NBD clients.
fn client_name(export: &str, region: u64) -> String {
    let e: String = export
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(32)
        .collect();
    format!(
        "blockdev/{}/{region:x}",
        if e.is_empty() { "-" } else { &e }
    )
}

/// Keep one session to every server for as long as the device exists, so
/// no collector takes its blocks while it has no NBD client: the servers
/// count a region in use while a session of its owner is connected. A
/// session that broke is opened again; a server that answers with a new
/// server id restarted empty, and the device's blocks there are gone.
fn hold(sh: &Shared, mut conns: Vec<Option<pagefleet_client::Conn>>, stop: &AtomicBool) {
    use std::sync::atomic::Ordering::Relaxed;
    let ids: Vec<u64> = conns
        .iter()
        .map(|c| c.as_ref().map(|c| c.info.server_id).unwrap_or(0))
        .collect();
    while !stop.load(Relaxed) {
        for _ in 0..(HOLD_CHECK.as_millis() / 100) {
            if stop.load(Relaxed) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        for (i, slot) in conns.iter_mut().enumerate() {
            if let Some(c) = slot {
                if c.ping().is_ok() {
                    continue;
                }
                *slot = None;
            }
            let opts = ConnectOptions {
                name: sh.client_name.clone(),
                ..Default::default()
            };
            match Conn::connect(&sh.servers[i], &sh.secret, &opts) {
                Ok(c) => {
                    if c.info.server_id != ids[i] && !sh.down[i].swap(true, Relaxed) {
                        tracing::error!(
                            "memory server {} restarted (new server id): this device's blocks there are lost; reads of them fail, mirrored blocks are read from their other copy",
                            sh.servers[i]
                        );
                    }
                    *slot = Some(c);
                }
                Err(e) => tracing::warn!(
                    "cannot reach memory server {} to hold this device's blocks: {e}",
                    sh.servers[i]
                ),
            }
        }
    }
}

impl Device {
    /// Connect to the servers and fix the layout for export `e`, leaving
    /// `taken[i]` blocks of server i to the exports opened before it.
    pub fn open(o: &Options, e: &ExportSpec, taken: &[u64], secret: Secret) -> Result<Device> {
        if e.size == 0 || !e.size.is_multiple_of(BLOCK as u64) {
            return Err(BlockdevError::NotBlocks { flag: "--size" });
        }
        let region = pagefleet_proto::auth::random_u64() | 1;
        let client_name = client_name(&e.name, region);
        let mut cap = Vec::new();
        let mut holders = Vec::new();
        for s in &o.servers {
            let opts = ConnectOptions {
                name: client_name.clone(),
                ..Default::default()
            };
            // The client's error names the server already.
            let c = Conn::connect(s, &secret, &opts)?;
            let free = c.info.capacity_pages.saturating_sub(c.info.used_pages);
            cap.push(free.saturating_sub(taken.get(cap.len()).copied().unwrap_or(0)));
            holders.push(Some(c));
        }
        let unit = match o.stripe {
            Some(u) if u == 0 || !u.is_multiple_of(BLOCK as u64) => {
                return Err(BlockdevError::NotBlocks {
                    flag: "--stripe-unit",
                })
            }
            Some(u) => Some(u / BLOCK as u64),
            None => None,
        };
        let t = layout::Translator::new(&cap, e.size / BLOCK as u64, unit, o.mirror)?;
        let down = o.servers.iter().map(|_| AtomicBool::new(false)).collect();
        let shared = Arc::new(Shared {
            t,
            region,
            servers: o.servers.clone(),
            secret,
            down,
            written: Written::new(e.size / BLOCK as u64),
            client_name,
        });
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (sh, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new()
                .name("blockdev-hold".into())
                .spawn(move || hold(&sh, holders, &stop))
                .map_err(io("cannot start the session holder thread"))?;
        }
        let export = nbd::Export {
            name: e.name.clone(),
            description: format!(
                "pagefleet DMPS device over {} memory server(s), {}{}",
                o.servers.len(),
                if unit.is_some() { "striped" } else { "linear" },
                if o.mirror { ", mirrored" } else { "" }
            ),
            size: e.size,
        };
        Ok(Device {
            engine: engine::Engine::start(shared.clone()),
            shared,
            export,
            holding: stop,
        })
    }

    /// Drop the device's blocks on every server.
    pub fn delete(&self) {
        self.holding
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.engine.stop();
        for s in &self.shared.servers {
            let opts = ConnectOptions {
                name: self.shared.client_name.clone(),
                ..Default::default()
            };
            if let Err(e) = Conn::connect(s, &self.shared.secret, &opts)
                .and_then(|mut c| c.delete_region(self.shared.region))
            {
                tracing::warn!("could not delete the device's blocks on {s}: {e}");
            }
        }
    }
}

/// Serve clients of `devices` (the first is the default export) until the
/// listener fails; one thread per client.
pub fn serve(devices: &[Arc<Device>], l: Listener) -> Result<()> {
    let tls = pagefleet_tls::process_identity();
    let exports: Arc<[nbd::Served]> = devices
        .iter()
        .map(|d| nbd::Served {
            export: d.export.clone(),
            engine: d.engine.clone(),
        })
        .collect();
    loop {
        let (c, peer) = match l.accept() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("accept: {e}");
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        let exports = exports.clone();
        let tls = nbd::Tls {
            required: peer.is_some_and(|p| pagefleet_tls::required(tls.as_deref(), p)),
            identity: tls.clone(),
        };
        std::thread::spawn(move || {
            let _ = nbd::serve_client(c, &exports, &tls);
        });
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.holding
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// `pagefleet blockdev serve`: export the device until SIGINT or SIGTERM,
/// then delete its blocks on the memory servers (and a unix socket's file).
/// Prints `listening ADDR` on stdout once clients may connect.
pub fn serve_until_signal(o: &Options, secret: Secret) -> Result<()> {
    // Blocked before any thread starts, so every thread inherits the mask.
    let signals = pagefleet_common::signal::TermSignals::block();
    if o.exports.is_empty() {
        return Err(BlockdevError::NotBlocks { flag: "--size" });
    }
    let mut devices: Vec<Arc<Device>> = Vec::new();
    let mut taken = vec![0u64; o.servers.len()];
    for e in &o.exports {
        if devices.iter().any(|d| d.export.name == e.name) {
            return Err(BlockdevError::Io {
                what: format!("--export {}", e.name),
                source: std::io::Error::other("two exports of one name"),
            });
        }
        let d = match Device::open(o, e, &taken, secret.clone()) {
            Ok(d) => d,
            Err(err) => {
                for d in &devices {
                    d.delete();
                }
                return Err(err);
            }
        };
        for (t, n) in taken.iter_mut().zip(d.shared.t.blocks_per_server()) {
            *t += n;
        }
        devices.push(Arc::new(d));
    }
    let l = Listener::bind(&o.listen, pagefleet_tls::process_identity().is_some())?;
    println!("listening {}", l.describe());
    for d in &devices {
        eprintln!(
            "{:?}: {} bytes: {}",
            d.export.name, d.export.size, d.export.description
        );
    }
    use std::io::Write;
    std::io::stdout().flush().map_err(io("stdout"))?;
    let served = devices.clone();
    std::thread::spawn(move || {
        let _ = serve(&served, l);
    });
    signals.wait();
    for d in &devices {
        d.delete();
    }
    if let Some(p) = o.listen.strip_prefix("unix:") {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}
