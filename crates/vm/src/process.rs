//! A QEMU child process: spawned with its serial console and stderr fed
//! into a [`Console`], polled, stopped (`quit`, then a kill).

use crate::console::Console;
use crate::VmError;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// The host's QEMU.
pub fn qemu_binary() -> PathBuf {
    std::env::var_os("PAGEFLEET_QEMU")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64"))
}

/// " (QEMU said: LAST LINES)" from the console of a QEMU that has just
/// exited, or nothing if it said nothing.
pub(crate) fn last_words(console: &Console) -> String {
    // Give the console threads a moment to take QEMU's last words.
    std::thread::sleep(Duration::from_millis(50));
    let tail = console.tail(5).join(" | ");
    if tail.is_empty() {
        String::new()
    } else {
        format!(" (QEMU said: {tail})")
    }
}

pub(crate) struct Process {
    child: Mutex<Child>,
    /// Its pid (QEMU's, also behind `ip netns exec`, which execs it).
    pub(crate) pid: u32,
    name: String,
}

impl Process {
    /// Spawn `cmd` with stdin closed; its stdout (the serial console) and
    /// stderr go to `console`, stdout lines also to the log when `log`.
    pub(crate) fn spawn(
        mut cmd: Command,
        console: &Arc<Console>,
        name: &str,
        log: bool,
    ) -> Result<Process, VmError> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .map_err(|e| VmError::io(format!("cannot start {}", qemu_binary().display()), e))?;
        if let Some(out) = child.stdout.take() {
            let (c, n) = (console.clone(), name.to_string());
            std::thread::spawn(move || {
                c.pump(out, &|l| {
                    if log {
                        info!(target: "vm-console", "{n}: {l}")
                    }
                })
            });
        }
        if let Some(err) = child.stderr.take() {
            let (c, n) = (console.clone(), name.to_string());
            std::thread::spawn(move || c.pump(err, &|l| warn!(target: "qemu", "{n}: {l}")));
        }
        Ok(Process {
            pid: child.id(),
            child: Mutex::new(child),
            name: name.to_string(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Child> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Its exit status, if it has exited.
    pub(crate) fn exited(&self) -> Option<ExitStatus> {
        self.lock().try_wait().ok().flatten()
    }

    /// `e`, a failed QMP exchange, with what QEMU's end tells about it:
    /// when QEMU has exited (a broken pipe or a closed socket mostly means
    /// it did), its exit status and the console's last lines.
    pub(crate) fn explain(&self, e: VmError, console: &Console) -> VmError {
        // An answer from QEMU (an error reply) says all there is.
        if !matches!(e, VmError::Io { .. } | VmError::QmpClosed) {
            return e;
        }
        let t0 = Instant::now();
        let mut st = self.exited();
        // A QEMU that closed its socket is usually a moment from exiting.
        while st.is_none() && t0.elapsed() < Duration::from_millis(300) {
            std::thread::sleep(Duration::from_millis(20));
            st = self.exited();
        }
        let Some(st) = st else {
            return e;
        };
        VmError::Qemu(format!(
            "{} exited ({st}) — {e}{}",
            self.name,
            last_words(console)
        ))
    }

    /// Kill it now and reap it.
    pub(crate) fn kill(&self) {
        let mut c = self.lock();
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Ask it to end with `quit` (QMP), kill it after `grace`.
    pub(crate) fn stop(&self, grace: Duration, quit: impl FnOnce()) {
        quit();
        let t0 = Instant::now();
        while self.exited().is_none() && t0.elapsed() < grace {
            std::thread::sleep(Duration::from_millis(10));
        }
        if self.exited().is_none() {
            warn!("{}: QEMU did not quit; killing it", self.name);
        }
        self.kill();
    }
}
