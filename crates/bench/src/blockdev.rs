//! `pagefleet bench blockdev`: the DMPS export against its peers, all over
//! NBD on loopback and all driven by fio's nbd engine: pagefleet with 1 and
//! 2 memory servers (linear, stripe, mirror), nbdkit's memory plugin, and
//! qemu-nbd over a file on tmpfs. Sequential and random reads and writes,
//! 4–128 KiB, queue depth 1 and 16; IOPS and MB/s side by side.

use crate::util::{self, ChildDaemon, Goal, PlotOutcome};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Opts {
    pub size: u64,
    pub runtime_secs: u64,
    pub block_sizes: Vec<u64>,
    pub depths: Vec<u32>,
    pub patterns: Vec<&'static str>,
    pub quick: bool,
    pub out_dir: PathBuf,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            size: 512 << 20,
            runtime_secs: 3,
            block_sizes: vec![4 << 10, 16 << 10, 64 << 10, 128 << 10],
            depths: vec![1, 16],
            patterns: vec!["read", "write", "randread", "randwrite"],
            quick: false,
            out_dir,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            size: 64 << 20,
            runtime_secs: 1,
            block_sizes: vec![4 << 10, 128 << 10],
            depths: vec![1, 16],
            patterns: vec!["read", "randwrite"],
            quick: true,
            out_dir,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub target: String,
    pub rw: String,
    pub bs: u64,
    pub iodepth: u32,
    pub iops: f64,
    pub mb_per_s: f64,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub size_bytes: u64,
    pub rows: Vec<Row>,
    pub goals: Vec<Goal>,
    #[serde(flatten)]
    pub plot: PlotOutcome,
}

/// A server process exporting NBD on a port; killed on drop.
struct Server {
    child: Child,
    uri: String,
    cleanup: Option<PathBuf>,
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM first: pagefleet's export deletes its blocks on it.
        let _ = pagefleet_common::sys::process::signal(self.child.id() as i32, libc::SIGTERM);
        for _ in 0..50 {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(p) = &self.cleanup {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Start an NBD server process (quiet) and wait for its port.
fn spawn_nbd(cmd: &mut Command, port: u16, cleanup: Option<PathBuf>) -> Result<Server> {
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let s = Server {
        child,
        uri: format!("nbd://127.0.0.1:{port}"),
        cleanup,
    };
    util::wait_listening(&format!("127.0.0.1:{port}"), Duration::from_secs(10))?;
    Ok(s)
}

fn pagefleet_export(
    servers: &[String],
    secret: &std::path::Path,
    size: u64,
    extra: &[&str],
) -> Result<Server> {
    let port = util::free_port()?;
    let mut cmd = Command::new(util::sibling_binary("pagefleet")?);
    cmd.arg("--secret-file").arg(secret);
    cmd.args([
        "blockdev",
        "serve",
        "--servers",
        &servers.join(","),
        "--size",
        &size.to_string(),
        "--listen",
        &format!("127.0.0.1:{port}"),
    ])
    .args(extra);
    spawn_nbd(&mut cmd, port, None)
}

fn nbdkit_memory(size: u64) -> Result<Server> {
    let port = util::free_port()?;
    let mut cmd = Command::new(util::which("nbdkit")?);
    cmd.args([
        "-f",
        "--exit-with-parent",
        "-p",
        &port.to_string(),
        "memory",
        &size.to_string(),
    ]);
    spawn_nbd(&mut cmd, port, None)
}

fn qemu_nbd_tmpfs(size: u64) -> Result<Server> {
    let port = util::free_port()?;
    let file = PathBuf::from(format!(
        "/dev/shm/pagefleet-bench-qemu-nbd-{}",
        std::process::id()
    ));
    std::fs::File::create(&file)?.set_len(size)?;
    let mut cmd = Command::new(util::which("qemu-nbd")?);
    cmd.args([
        "-t",
        "-f",
        "raw",
        "-p",
        &port.to_string(),
        "-b",
        "127.0.0.1",
        "--shared=16",
    ])
    .arg(&file);
    spawn_nbd(&mut cmd, port, Some(file))
}

/// Write every block once (so reads read data, not holes).
fn fill(uri: &str, size: u64) -> Result<()> {
    let out = Command::new(util::which("fio")?)
        .args([
            "--name=fill",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=write",
            "--bs=1M",
            "--iodepth=16",
            &format!("--size={size}"),
        ])
        .output()?;
    if !out.status.success() {
        bail!("fio fill: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn fio(uri: &str, rw: &str, bs: u64, qd: u32, size: u64, secs: u64) -> Result<(f64, f64)> {
    let out = Command::new(util::which("fio")?)
        .args([
            "--name=bench",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            &format!("--rw={rw}"),
            &format!("--bs={bs}"),
            &format!("--iodepth={qd}"),
            &format!("--size={size}"),
            &format!("--runtime={secs}"),
            "--time_based",
            "--output-format=json",
        ])
        .output()?;
    if !out.status.success() {
        bail!("fio: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    // fio may print engine messages before its JSON.
    let f = pagefleet_lab::fio::Output::parse(&String::from_utf8_lossy(&out.stdout))
        .map_err(anyhow::Error::msg)?;
    let job = f.job().map_err(anyhow::Error::msg)?;
    let side = if rw.contains("read") {
        &job.read
    } else {
        &job.write
    };
    Ok((side.iops, side.bw_bytes / 1e6))
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    for t in ["fio", "nbdkit", "qemu-nbd"] {
        util::which(t).with_context(|| format!("{t} is needed (make deps installs it)"))?;
    }
    let dir = util::temp_dir("bench-blockdev")?;
    let secret = dir.join("secret");
    std::fs::write(&secret, pagefleet_proto::auth::Secret::generate_hex())?;
    // Each memory server can hold the whole device twice (mirror copies).
    let lend = o.size * 2 + (16 << 20);
    let mut ms = Vec::new();
    for _ in 0..3 {
        ms.push(ChildDaemon::start(lend, &secret)?);
    }
    let addrs: Vec<String> = ms.iter().map(|m| m.addr.clone()).collect();
    type Make<'a> = Box<dyn Fn() -> Result<Server> + 'a>;
    let targets: Vec<(&str, Make)> = vec![
        (
            "pagefleet 1 server",
            Box::new(|| pagefleet_export(&addrs[..1], &secret, o.size, &[])),
        ),
        (
            "pagefleet 2 linear",
            Box::new(|| pagefleet_export(&addrs[..2], &secret, o.size, &[])),
        ),
        (
            "pagefleet 2 stripe",
            Box::new(|| {
                pagefleet_export(
                    &addrs[..2],
                    &secret,
                    o.size,
                    &["--layout", "stripe", "--stripe-unit", "128KiB"],
                )
            }),
        ),
        (
            "pagefleet 2 mirror",
            Box::new(|| pagefleet_export(&addrs[..2], &secret, o.size, &["--mirror"])),
        ),
        ("nbdkit memory", Box::new(|| nbdkit_memory(o.size))),
        ("qemu-nbd tmpfs", Box::new(|| qemu_nbd_tmpfs(o.size))),
    ];
    let targets: Vec<_> = if o.quick {
        targets
            .into_iter()
            .filter(|t| t.0 == "pagefleet 2 linear" || t.0 == "nbdkit memory")
            .collect()
    } else {
        targets
    };
    let mut rows = Vec::new();
    for (name, make) in &targets {
        log(&format!(
            "{name}: filling {} then measuring",
            crate::fmt_bytes(o.size)
        ));
        let s = make()?;
        fill(&s.uri, o.size)?;
        for rw in &o.patterns {
            for &bs in &o.block_sizes {
                for &qd in &o.depths {
                    let r = fio(&s.uri, rw, bs, qd, o.size, o.runtime_secs);
                    let (iops, mbs, error) = match r {
                        Ok((i, m)) => (i, m, None),
                        Err(e) => (f64::NAN, f64::NAN, Some(format!("{e:#}"))),
                    };
                    rows.push(Row {
                        target: name.to_string(),
                        rw: rw.to_string(),
                        bs,
                        iodepth: qd,
                        iops,
                        mb_per_s: mbs,
                        error,
                    });
                }
            }
        }
    }
    drop(ms);
    let _ = std::fs::remove_dir_all(&dir);
    let mut r = Report {
        size_bytes: o.size,
        goals: goals(&rows),
        rows,
        plot: PlotOutcome::default(),
    };
    std::fs::create_dir_all(&o.out_dir)?;
    util::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "blockdev",
        include_str!("../../../bench/plot_blockdev.py"),
    )?;
    Ok(r)
}

fn goals(rows: &[Row]) -> Vec<Goal> {
    let mut g = Vec::new();
    let find = |t: &str, rw: &str, bs: u64, qd: u32| {
        rows.iter()
            .find(|r| r.target == t && r.rw == rw && r.bs == bs && r.iodepth == qd)
    };
    for r in rows.iter().filter(|r| r.target == "nbdkit memory") {
        if let Some(p) = find("pagefleet 2 linear", &r.rw, r.bs, r.iodepth) {
            g.push(Goal::at_least(
                &format!(
                    "{} {}K QD{}: pagefleet (2 servers) / nbdkit memory",
                    r.rw,
                    r.bs >> 10,
                    r.iodepth
                ),
                p.iops / r.iops,
                1.0,
                "x IOPS",
            ));
        }
    }
    let best = rows
        .iter()
        .filter(|r| r.target.starts_with("pagefleet 2") && r.rw == "read" && r.bs == 128 << 10)
        .map(|r| r.mb_per_s)
        .fold(f64::NAN, f64::max);
    g.push(Goal::at_least(
        "sequential read 128K, 2 servers",
        best / 1000.0,
        2.0,
        "GB/s",
    ));
    g
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    let mut targets: Vec<&str> = Vec::new();
    for x in &r.rows {
        if !targets.contains(&x.target.as_str()) {
            targets.push(&x.target);
        }
    }
    writeln!(
        out,
        "NBD exports over loopback, fio nbd engine, {} device; IOPS (MB/s)",
        crate::fmt_bytes(r.size_bytes)
    )?;
    write!(out, "{:<10} {:>5} {:>3}", "pattern", "bs", "qd")?;
    for t in &targets {
        write!(out, " {:>21}", t)?;
    }
    writeln!(out)?;
    let mut keys: Vec<(String, u64, u32)> = Vec::new();
    for x in &r.rows {
        let k = (x.rw.clone(), x.bs, x.iodepth);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (rw, bs, qd) in keys {
        write!(out, "{:<10} {:>4}K {:>3}", rw, bs >> 10, qd)?;
        for t in &targets {
            match r
                .rows
                .iter()
                .find(|x| x.target == *t && x.rw == rw && x.bs == bs && x.iodepth == qd)
            {
                Some(x) if x.error.is_none() => {
                    write!(out, " {:>11.0} ({:>7.0})", x.iops, x.mb_per_s)?
                }
                _ => write!(out, " {:>21}", "failed")?,
            }
        }
        writeln!(out)?;
    }
    writeln!(out)?;
    util::print_goals(&r.goals, out)?;
    r.plot.print(out)
}

/// `pagefleet bench blockdev`: the DMPS NBD export against nbdkit's memory
/// plugin and qemu-nbd on tmpfs, with fio.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// The device's size (at least 16MiB).
    #[arg(long, value_parser = pagefleet_common::units::parse_size)]
    pub dataset: Option<u64>,
    /// Seconds each fio job runs.
    #[arg(long = "secs", alias = "reps")]
    pub secs: Option<u64>,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(d) = self.dataset {
            let d = crate::at_least("--dataset", "the device size", d, 16 << 20)?;
            o.size = d / (1 << 20) * (1 << 20);
        }
        if let Some(s) = self.secs {
            o.runtime_secs = s.max(1);
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}
