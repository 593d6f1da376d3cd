//! A port on this machine that leads into a lab host: the lab's hosts live
//! in network namespaces joined by a bridge in a namespace of its own, so
//! a browser on this machine cannot reach their addresses. [`Forward`]
//! listens on a local address (loopback by default) and carries each
//! connection to an address inside one host's namespace, unchanged: the
//! daemon there still refuses anyone without a signature or a session.
//!
//! Bounds: at most [`MAX_CONNS`] connections at once (more are closed at
//! once); a connection idle for [`IDLE`] either way is closed.

use anyhow::{Context, Result};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Connections carried at once (a browser opens a handful).
pub const MAX_CONNS: usize = 64;
/// A connection with nothing to carry for this long is closed (the
/// dashboard's event stream sends a snapshot every second).
pub const IDLE: Duration = Duration::from_secs(120);

/// The forwarder; stops listening when dropped.
pub struct Forward {
    /// The local address it listens on.
    pub local: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Forward {
    /// Listen on `listen` (here) and carry every connection to `to` inside
    /// the network namespace `netns` (a lab host's).
    pub fn start(listen: &str, netns: &str, to: &str) -> Result<Forward> {
        let l = TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
        l.set_nonblocking(true)?;
        let local = l.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (st, netns, to) = (stop.clone(), netns.to_string(), to.to_string());
        let open = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("forward".into())
            .spawn(move || {
                while !st.load(Relaxed) {
                    let c = match l.accept() {
                        Ok((c, _)) => c,
                        Err(_) => {
                            std::thread::sleep(Duration::from_millis(50));
                            continue;
                        }
                    };
                    if open.load(Relaxed) >= MAX_CONNS {
                        continue; // dropped: closed
                    }
                    open.fetch_add(1, Relaxed);
                    let (netns, to, open) = (netns.clone(), to.clone(), open.clone());
                    let _ = std::thread::Builder::new()
                        .name("forward conn".into())
                        .spawn(move || {
                            let _ = carry(c, &netns, &to);
                            open.fetch_sub(1, Relaxed);
                        });
                }
            })?;
        Ok(Forward { local, stop })
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

/// Connect to `to` from inside `netns` and copy both ways until either
/// side closes or is idle for [`IDLE`].
fn carry(c: TcpStream, netns: &str, to: &str) -> Result<()> {
    c.set_nonblocking(false)?;
    pagefleet_testbed::enter_netns(netns)?;
    let s = TcpStream::connect(to).with_context(|| format!("connecting to {to} in {netns}"))?;
    for x in [&c, &s] {
        x.set_read_timeout(Some(IDLE))?;
        x.set_nodelay(true)?;
    }
    let (c2, s2) = (c.try_clone()?, s.try_clone()?);
    let up = std::thread::spawn(move || pipe(c2, s2));
    pipe(s, c);
    let _ = up.join();
    Ok(())
}

/// Copy `from` to `to` until `from` ends (or idles); then end both.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 32 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// Forward `listen` to lab host `h`'s HTTP API and make a login link for
/// its dashboard that leads through it (signed with the lab's secret; it
/// works once, within a minute). A TLS lab's API takes only HTTPS from
/// other addresses, which a browser at `listen` cannot check: refused.
pub fn dashboard(
    lab: &pagefleet_testbed::Lab,
    h: usize,
    listen: &str,
) -> Result<(Forward, String)> {
    if lab.admin_tls.is_some() {
        anyhow::bail!(
            "this lab runs TLS: its hosts' APIs take only HTTPS, with certificates for their lab addresses; \
             open the dashboard from inside the lab instead (pagefleet testbed exec h1 -- pagefleet dashboard)"
        );
    }
    let host = lab.hosts.get(h).context("no such lab host")?;
    let f = Forward::start(listen, &host.netns, &host.http())?;
    let link = login_link(lab, &f)?;
    Ok((f, link))
}

/// A fresh login link through `f` (each works once, within a minute).
pub fn login_link(lab: &pagefleet_testbed::Lab, f: &Forward) -> Result<String> {
    let secret = pagefleet_proto::auth::Secret::load(&lab.secret_file)?;
    Ok(format!(
        "http://{}{}?{}",
        f.local,
        pagefleet_common::httpauth::UI_LOGIN_PATH,
        pagefleet_common::httpauth::ui_login_query(&secret)
    ))
}
