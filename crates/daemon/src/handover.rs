//! In-place restart: this pagefleetd `exec`s the next one — the binary at
//! the path it was started from, so after a package upgrade the new version
//! — in the same process, handing over what must outlive it:
//!
//! - the memory server's pool (a file, see `pagefleet_memserver` `pool`),
//!   its index and its server id: clients of pages lent here reconnect and
//!   find the same server with the same pages;
//! - the memory server's and the HTTP API's listening sockets: connections
//!   made meanwhile wait in their backlogs instead of being refused;
//! - the cordon.
//!
//! Guests' runners need nothing: they outlive the daemon either way and the
//! next one adopts them (`Guests::adopt`); after `exec` they are still this
//! process's children, so their exit status is known again.
//!
//! What crosses is described by a memfd whose descriptor number is in
//! [`ENV`]: a 4-byte length, a JSON [`Header`] naming the inherited
//! descriptors, then the store's index. Every descriptor but these is
//! close-on-exec (Rust's default); these get the flag back as soon as the
//! next process took them, so its runners do not inherit them.

use crate::error::{Error, Result};
use crate::sys;
use pagefleet_memserver::{ServerState, Store};
use serde::{Deserialize, Serialize};
use std::ffi::{CString, OsString};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The environment variable naming the handover's descriptor.
pub const ENV: &str = "PAGEFLEET_HANDOVER";

/// The handover format this binary writes and reads.
const FORMAT: u32 = 1;

/// How long pages pinned by the daemon's own readers may keep the store
/// from being frozen.
const FREEZE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Longest header: it names a few descriptors.
const MAX_HEADER: usize = 64 * 1024;

/// What the previous process says it handed over.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    format: u32,
    /// Its version (`pagefleetd --version`), for the log.
    from_version: String,
    /// When it execed, seconds since the Unix epoch.
    at_unix: f64,
    cordoned: bool,
    http: Option<RawFd>,
    memserver: Option<MemHeader>,
}

#[derive(Debug, Serialize, Deserialize)]
struct MemHeader {
    listener: RawFd,
    pool: RawFd,
    server_id: u64,
    index_len: u64,
}

/// The memory server the previous process ran.
pub struct InheritedServer {
    /// Its listening socket.
    pub listener: TcpListener,
    /// Its pages.
    pub store: Store,
    /// Its id (clients reconnect to the same server).
    pub server_id: u64,
}

/// What the previous pagefleetd handed over.
pub struct Inherited {
    /// Its memory server, if it lent memory.
    pub memserver: Option<InheritedServer>,
    /// Its HTTP API socket.
    pub http: Option<TcpListener>,
    /// Whether it was cordoned.
    pub cordoned: bool,
    /// When it execed, seconds since the Unix epoch.
    pub at_unix: f64,
    /// Its version.
    pub from_version: String,
}

/// Own an inherited descriptor: it must be open; it is close-on-exec again.
fn own(fd: RawFd, what: &str) -> Result<OwnedFd> {
    // SAFETY: the previous process handed this descriptor to us alone.
    unsafe { sys::set_cloexec(fd, true) }.map_err(|e| {
        Error::Invalid(format!(
            "in-place restart: the handed-over {what} (descriptor {fd}) is not open: {e}"
        ))
    })?;
    // SAFETY: the previous process handed this descriptor to us alone
    // (named once in the header); nothing else in this process uses it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// What the previous pagefleetd handed over, if this process is the next
/// one of an in-place restart. Call once, first thing: the descriptors are
/// owned from here on. A handover that cannot be used is an error (the
/// pages it describes would otherwise be silently dropped).
pub fn take() -> Result<Option<Inherited>> {
    let Some(v) = std::env::var_os(ENV) else {
        return Ok(None);
    };
    // Not for the runners this daemon starts. (No other thread runs yet:
    // this is the first thing the daemon does.)
    std::env::remove_var(ENV);
    let fd: RawFd = v
        .to_str()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| Error::Invalid(format!("{ENV}={v:?} is not a descriptor number")))?;
    let mut f = std::fs::File::from(own(fd, "description")?);
    let mut len = [0u8; 4];
    f.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_HEADER {
        return Err(Error::Invalid(format!(
            "in-place restart: a handover header of {len} bytes"
        )));
    }
    let mut h = vec![0u8; len];
    f.read_exact(&mut h)?;
    let h: Header = serde_json::from_slice(&h)
        .map_err(|e| Error::Invalid(format!("in-place restart: unreadable handover: {e}")))?;
    if h.format != FORMAT {
        return Err(Error::Invalid(format!(
            "in-place restart: handover format {} from pagefleetd {}; this one reads {FORMAT}",
            h.format, h.from_version
        )));
    }
    let http = match h.http {
        Some(fd) => Some(TcpListener::from(own(fd, "HTTP socket")?)),
        None => None,
    };
    let memserver = match &h.memserver {
        Some(m) => {
            let listener = TcpListener::from(own(m.listener, "memory-server socket")?);
            let pool = own(m.pool, "page pool")?;
            let mut index = Vec::new();
            (&mut f).take(m.index_len).read_to_end(&mut index)?;
            if index.len() as u64 != m.index_len {
                return Err(Error::Invalid(format!(
                    "in-place restart: the page index is {} bytes, not {}",
                    index.len(),
                    m.index_len
                )));
            }
            let store = Store::adopt(pool, &index)
                .map_err(|e| Error::Invalid(format!("in-place restart: {e}")))?;
            Some(InheritedServer {
                listener,
                store,
                server_id: m.server_id,
            })
        }
        None => None,
    };
    Ok(Some(Inherited {
        memserver,
        http,
        cordoned: h.cordoned,
        at_unix: h.at_unix,
        from_version: h.from_version,
    }))
}

/// What goes to the next process.
pub struct Outgoing<'a> {
    /// The binary to exec and its arguments (argv[0] first).
    pub exe: &'a Path,
    /// Its arguments.
    pub args: &'a [OsString],
    /// The memory server (its sessions already ended: `quiesce`) and a
    /// handle on its listening socket.
    pub memserver: Option<(&'a ServerState, &'a TcpListener)>,
    /// A handle on the HTTP API's socket.
    pub http: Option<&'a TcpListener>,
    /// Whether this host is cordoned.
    pub cordoned: bool,
}

/// Exec the next pagefleetd with everything handed over. Returns only when
/// that could not be done, with why; nothing was lost then (the store's
/// lock is released, the descriptors are close-on-exec again) and the
/// caller serves on.
pub fn exec(o: Outgoing<'_>) -> Error {
    match try_exec(o) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

enum Never {}

fn try_exec(o: Outgoing<'_>) -> Result<Never> {
    let mut f = std::fs::File::from(pagefleet_common::sys::mapping::memfd(
        c"pagefleet-handover",
        0,
        0,
    )?);
    let frozen = match o.memserver {
        // Sessions have ended; the content scanner pins what it copies for
        // microseconds at a time: try again briefly.
        Some((st, _)) => {
            let until = std::time::Instant::now() + FREEZE_WAIT;
            loop {
                match st.store.freeze() {
                    Ok(z) => break Some(z),
                    Err(pagefleet_memserver::StoreError::InFlight { .. })
                        if std::time::Instant::now() < until =>
                    {
                        std::thread::sleep(std::time::Duration::from_millis(1))
                    }
                    Err(e) => {
                        return Err(Error::Invalid(format!(
                            "cannot hand the page store over: {e}"
                        )))
                    }
                }
            }
        }
        None => None,
    };
    let h = Header {
        format: FORMAT,
        from_version: env!("CARGO_PKG_VERSION").to_string(),
        at_unix: now_unix(),
        cordoned: o.cordoned,
        http: o.http.map(|l| l.as_raw_fd()),
        memserver: o.memserver.map(|(st, l)| MemHeader {
            listener: l.as_raw_fd(),
            pool: st.store.pool_file().as_raw_fd(),
            server_id: st.server_id,
            index_len: frozen.as_ref().map(|z| z.index.len() as u64).unwrap_or(0),
        }),
    };
    let hb = serde_json::to_vec(&h).expect("a plain struct serializes");
    f.write_all(&(hb.len() as u32).to_le_bytes())?;
    f.write_all(&hb)?;
    if let Some(z) = &frozen {
        f.write_all(&z.index)?;
    }
    use std::io::Seek;
    f.seek(std::io::SeekFrom::Start(0))?;
    let mut pass: Vec<RawFd> = vec![f.as_raw_fd()];
    pass.extend(h.http);
    if let Some(m) = &h.memserver {
        pass.extend([m.listener, m.pool]);
    }
    let cstr =
        |b: &[u8]| CString::new(b).map_err(|_| Error::Invalid("a NUL byte in an argument".into()));
    let exe = cstr(o.exe.as_os_str().as_bytes())?;
    let argv: Vec<CString> = o
        .args
        .iter()
        .map(|a| cstr(a.as_bytes()))
        .collect::<Result<_>>()?;
    let mut envp: Vec<CString> = std::env::vars_os()
        .filter(|(k, _)| k != ENV)
        .map(|(k, v)| cstr(&[k.as_bytes(), b"=", v.as_bytes()].concat()))
        .collect::<Result<_>>()?;
    envp.push(cstr(format!("{ENV}={}", f.as_raw_fd()).as_bytes())?);
    for fd in &pass {
        // SAFETY: descriptors this process owns (the handover file, its
        // listeners and pool), kept open until the exec.
        unsafe { sys::set_cloexec(*fd, false) }?;
    }
    tracing::info!(
        "restarting in place: exec {} (handing over {})",
        o.exe.display(),
        match &frozen {
            Some(z) => format!("{} pages and the listening sockets", z.pages),
            None => "the listening sockets".to_string(),
        }
    );
    let e = sys::exec(&exe, &argv, &envp);
    for fd in &pass {
        // SAFETY: as above: still ours, the exec having failed.
        let _ = unsafe { sys::set_cloexec(*fd, true) };
    }
    drop(frozen);
    Err(Error::Invalid(format!(
        "cannot exec {}: {e}; serving on",
        o.exe.display()
    )))
}

/// Whether `exe` runs and is a pagefleetd: its `--version` line, within
/// 10 s. Checked before anything is handed over, so a missing or broken
/// binary costs nothing.
pub fn preflight(exe: &Path) -> std::result::Result<String, String> {
    let mut c = std::process::Command::new(exe)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match c.try_wait() {
            Ok(Some(s)) if s.success() => break,
            Ok(Some(s)) => return Err(format!("{} --version: {s}", exe.display())),
            Ok(None) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            Ok(None) => {
                let _ = c.kill();
                let _ = c.wait();
                return Err(format!(
                    "{} --version did not answer within 10 s",
                    exe.display()
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    let mut out = String::new();
    let _ = c.stdout.take().map(|mut o| o.read_to_string(&mut out));
    let line = out.lines().next().unwrap_or("").trim().to_string();
    if !line.starts_with("pagefleetd ") {
        return Err(format!(
            "{} is not a pagefleetd (its --version says {line:?})",
            exe.display()
        ));
    }
    Ok(line)
}

/// Seconds since the Unix epoch, for the restart's gap in the log.
pub fn since(at_unix: f64) -> f64 {
    (now_unix() - at_unix).max(0.0)
}
