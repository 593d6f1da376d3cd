//! A QEMU without pagefleet: ordinary anonymous RAM, QEMU's own migration
//! (pre-copy or post-copy). The baselines `pagefleet bench vm-migration`
//! compares against, driven the same way (QMP, console).

use crate::console::Console;
use crate::process::qemu_binary;
use crate::process::Process;
use crate::qmp::Qmp;
use crate::{VmError, VmSpec};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where and how to start one.
pub struct PlainLaunch<'a> {
    /// What to boot (the destination of a migration boots nothing: same spec).
    pub spec: &'a VmSpec,
    /// Run inside this network namespace (a testbed host).
    pub netns: Option<&'a str>,
    /// Wait for a migration on this URI (`tcp:IP:PORT`); it runs as soon
    /// as the migration lets it (QEMU's default).
    pub incoming: Option<String>,
    /// Directory for its QMP socket.
    pub dir: &'a Path,
    /// Put it in this memory cgroup (v1 directory) right after it starts.
    pub cgroup: Option<PathBuf>,
    /// The tap of the spec's NIC, made by the caller in `netns`
    /// ([`crate::tap::Tap::on_bridge`] on a thread inside it); QEMU
    /// inherits it.
    pub tap: Option<&'a crate::tap::Tap>,
}

/// A running baseline QEMU.
pub struct PlainVm {
    child: Process,
    qmp: Mutex<Qmp>,
    /// Its serial console.
    pub console: Arc<Console>,
    /// QEMU's pid.
    pub pid: u32,
}

impl PlainVm {
    /// Start it and open QMP.
    pub fn start(l: PlainLaunch<'_>) -> Result<PlainVm, VmError> {
        l.spec.validate()?;
        let qmp_path = l.dir.join(format!("{}-qmp.sock", l.spec.name));
        let _ = std::fs::remove_file(&qmp_path);
        let mut cmd = match l.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(qemu_binary());
                c
            }
            None => Command::new(qemu_binary()),
        };
        // The same accelerator as pagefleet's own VMs on this host: a
        // baseline on another would measure the accelerator.
        let accel = crate::accel::choose(l.spec.kernel.as_deref());
        if l.spec.nic.is_some() != l.tap.is_some() {
            return Err(VmError::Invalid(
                "a plain VM's NIC needs its tap (and a tap its NIC)".into(),
            ));
        }
        if let Some(t) = l.tap {
            t.pass_to(&mut cmd);
        }
        cmd.args(l.spec.qemu_args(
            &format!("memory-backend-ram,id=pf-ram,size={}M", l.spec.size >> 20),
            &qmp_path,
            accel.accel,
            l.tap.map(|t| t.raw_fd()),
        ));
        if let Some(uri) = &l.incoming {
            cmd.args(["-incoming", uri]);
        }
        let console = Arc::new(Console::default());
        let child = Process::spawn(cmd, &console, &l.spec.name, false)?;
        let pid = child.pid;
        if let Some(cg) = &l.cgroup {
            if let Err(e) = std::fs::write(cg.join("cgroup.procs"), pid.to_string()) {
                child.kill();
                return Err(VmError::io(format!("moving QEMU into {}", cg.display()), e));
            }
        }
        let qmp = match Qmp::connect(&qmp_path, Duration::from_secs(30)) {
            Ok(q) => q,
            Err(e) => {
                child.kill();
                return Err(e);
            }
        };
        Ok(PlainVm {
            child,
            qmp: Mutex::new(qmp),
            console,
            pid,
        })
    }

    /// Run `f` on its QMP session.
    pub fn qmp<T>(&self, f: impl FnOnce(&mut Qmp) -> Result<T, VmError>) -> Result<T, VmError> {
        f(&mut self.qmp.lock().unwrap_or_else(|e| e.into_inner()))
            .map_err(|e| self.child.explain(e, &self.console))
    }

    /// Its exit status, if it has exited.
    pub fn exited(&self) -> Option<std::process::ExitStatus> {
        self.child.exited()
    }

    /// `quit`, then a kill after `grace`.
    pub fn shutdown(&self, grace: Duration) {
        self.child.stop(grace, || {
            let _ = self.qmp(|q| q.execute::<serde_json::Value>("quit", None));
        });
    }
}

impl Drop for PlainVm {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.shutdown(Duration::from_secs(2));
        }
    }
}

/// A post-copy's downtime: QEMU's `downtime` is not the pause there, so
/// it is from the source's STOP to the destination's RESUME (QMP event
/// timestamps; NaN when either is missing).
pub fn postcopy_downtime_ms(src: &PlainVm, dst: &PlainVm) -> f64 {
    // A command each, so the events that came meanwhile are read.
    let _ = src.qmp(|q| q.status());
    let _ = dst.qmp(|q| q.status());
    let stop = src.qmp(|q| Ok(q.last_event("STOP"))).ok().flatten();
    let resume = dst.qmp(|q| Ok(q.last_event("RESUME"))).ok().flatten();
    match (stop, resume) {
        (Some(a), Some(b)) if b >= a => (b - a) * 1e3,
        _ => f64::NAN,
    }
}
