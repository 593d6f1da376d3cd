//! A slow shared disk with one FIFO queue, for reproducing paper 004's
//! storage array (where the tenant with the most requests in flight takes the
//! queue) on a machine with no device-mapper, null_blk or brd.
//!
//! The disk is one file, `DIR/disk`, on a FUSE filesystem served by a single
//! thread: the kernel hands requests over in arrival order, and each one is
//! answered only when a virtual clock says the device would have finished it
//! (`per_io + bytes / bandwidth` after the previous one). A loop device with
//! direct I/O over that file gives a block device whose capacity is bounded
//! and whose queue is first-come first-served, so blkio throttling, BFQ and
//! the ioqos controllers act on it exactly as on a real disk.

/// Why the disk could not be made, mounted or attached.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A size or rate that cannot be used.
    #[error("{0}")]
    Invalid(String),
    /// A system operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        source: std::io::Error,
    },
}

/// A result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyWrite, Request, WriteFlags,
};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// The device's service model.
#[derive(Clone, Copy, Debug)]
pub struct Pace {
    /// Fixed cost of every request (seek, controller), whatever its size.
    pub per_io: Duration,
    /// Transfer rate, bytes per second.
    pub bandwidth: f64,
}

impl Pace {
    /// The time one request of `bytes` takes.
    pub fn cost(&self, bytes: usize) -> Duration {
        self.per_io + Duration::from_secs_f64(bytes as f64 / self.bandwidth)
    }
}

/// Counters a caller can read while the disk is mounted.
#[derive(Default, Debug)]
pub struct Stats {
    /// Read requests served.
    pub reads: AtomicU64,
    /// Write requests served.
    pub writes: AtomicU64,
    /// Bytes moved.
    pub bytes: AtomicU64,
    /// Time the device was busy serving requests, ns.
    pub busy_ns: AtomicU64,
}

const ROOT: INodeNo = INodeNo::ROOT;
const DISK: INodeNo = INodeNo(2);
const TTL: Duration = Duration::from_secs(3600);

struct Fs {
    size: u64,
    data: Mutex<Vec<u8>>,
    pace: Pace,
    /// When the device finishes the request it is serving now.
    free_at: Mutex<Instant>,
    stats: Arc<Stats>,
}

impl Fs {
    fn attr(&self, ino: INodeNo) -> FileAttr {
        let dir = ino == ROOT;
        FileAttr {
            ino,
            size: if dir { 0 } else { self.size },
            blocks: if dir { 0 } else { self.size / 512 },
            atime: SystemTime::UNIX_EPOCH,
            mtime: SystemTime::UNIX_EPOCH,
            ctime: SystemTime::UNIX_EPOCH,
            crtime: SystemTime::UNIX_EPOCH,
            kind: if dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            },
            perm: if dir { 0o755 } else { 0o600 },
            nlink: if dir { 2 } else { 1 },
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// Serve one request of `bytes`: wait until the device has finished the
    /// previous one plus this one's cost. One server thread, so requests
    /// leave in the order they arrived.
    fn serve(&self, bytes: usize) {
        let cost = self.pace.cost(bytes);
        let done = {
            let mut free = self.free_at.lock().unwrap();
            let now = Instant::now();
            *free = (*free).max(now) + cost;
            *free
        };
        let now = Instant::now();
        if done > now {
            std::thread::sleep(done - now);
        }
        self.stats
            .busy_ns
            .fetch_add(cost.as_nanos() as u64, Ordering::Relaxed);
        self.stats.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn range(&self, offset: u64, len: usize) -> Option<(usize, usize)> {
        let end = offset.checked_add(len as u64)?;
        if offset > self.size {
            return None;
        }
        Some((offset as usize, end.min(self.size) as usize))
    }
}

impl Filesystem for Fs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Let the kernel queue many direct I/Os at once: the queue is ours.
        let _ = config.set_max_background(512);
        let _ = config.set_congestion_threshold(384);
        let _ = config.set_max_write(1 << 20);
        let _ = config.add_capabilities(fuser::InitFlags::FUSE_ASYNC_DIO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == ROOT && name == "disk" {
            reply.entry(&TTL, &self.attr(DISK), Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino {
            ROOT | DISK => reply.attr(&TTL, &self.attr(ino)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // A disk has a fixed size; times and modes are accepted and ignored.
        match (ino, size) {
            (DISK, Some(s)) if s != self.size => reply.error(Errno::EPERM),
            (ROOT | DISK, _) => reply.attr(&TTL, &self.attr(ino)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino == DISK {
            reply.opened(FileHandle(0), FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES);
        } else {
            reply.error(Errno::EISDIR);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != DISK {
            return reply.error(Errno::EISDIR);
        }
        let Some((a, b)) = self.range(offset, size as usize) else {
            return reply.error(Errno::EINVAL);
        };
        self.serve(b - a);
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        let data = self.data.lock().unwrap();
        reply.data(&data[a..b]);
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _wflags: WriteFlags,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != DISK {
            return reply.error(Errno::EISDIR);
        }
        match self.range(offset, data.len()) {
            Some((a, b)) if b - a == data.len() => {
                self.serve(data.len());
                self.stats.writes.fetch_add(1, Ordering::Relaxed);
                self.data.lock().unwrap()[a..b].copy_from_slice(data);
                reply.written(data.len() as u32);
            }
            _ => reply.error(Errno::ENOSPC),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (ROOT, FileType::Directory, "."),
            (ROOT, FileType::Directory, ".."),
            (DISK, FileType::RegularFile, "disk"),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// A mounted FIFO disk; unmounted when dropped.
pub struct FifoDisk {
    dir: PathBuf,
    /// The mount point was made by `mount` and goes with the disk.
    made_dir: bool,
    session: Option<fuser::BackgroundSession>,
    /// Its counters.
    pub stats: Arc<Stats>,
}

impl FifoDisk {
    /// Mount a disk of `size` bytes (kept in memory) at `dir` (created if
    /// missing); the block-device-like file is `dir/disk`. Root only.
    pub fn mount(dir: &Path, size: u64, pace: Pace) -> Result<FifoDisk> {
        if size < 1 << 20 || !size.is_multiple_of(4096) {
            return Err(Error::Invalid(format!(
                "disk size must be a multiple of 4 KiB and at least 1 MiB (got {size})"
            )));
        }
        if !(pace.bandwidth.is_finite() && pace.bandwidth > 0.0) {
            return Err(Error::Invalid(
                "disk bandwidth must be positive".to_string(),
            ));
        }
        let made_dir = !dir.exists();
        std::fs::create_dir_all(dir).map_err(io(format!("cannot create {}", dir.display())))?;
        let stats = Arc::new(Stats::default());
        let fs = Fs {
            size,
            // Zeroed allocation: pages appear only when written.
            data: Mutex::new(vec![0u8; size as usize]),
            pace,
            free_at: Mutex::new(Instant::now()),
            stats: stats.clone(),
        };
        let mut cfg = fuser::Config::default();
        cfg.mount_options = vec![fuser::MountOption::FSName("pagefleet-fifodisk".into())];
        cfg.acl = fuser::SessionACL::All;
        // One thread: the FIFO and the single server are the point.
        cfg.n_threads = Some(1);
        let session = fuser::Session::new(fs, dir, &cfg)
            .map_err(io(format!(
                "cannot mount a FUSE filesystem at {} (need root and /dev/fuse)",
                dir.display()
            )))
            .and_then(|s| s.spawn().map_err(io("cannot start the FUSE server thread")));
        let session = match session {
            Ok(s) => s,
            Err(e) => {
                if made_dir {
                    let _ = std::fs::remove_dir(dir);
                }
                return Err(e);
            }
        };
        Ok(FifoDisk {
            dir: dir.to_path_buf(),
            made_dir,
            session: Some(session),
            stats,
        })
    }

    /// The disk's file (to attach a loop device to).
    pub fn file(&self) -> PathBuf {
        self.dir.join("disk")
    }

    /// Unmount now (dropping also does), reporting failure.
    pub fn unmount(mut self) -> Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> Result<()> {
        if let Some(s) = self.session.take() {
            s.umount_and_join()
                .map_err(io(format!("cannot unmount {}", self.dir.display())))?;
            if self.made_dir {
                // Empty once unmounted; a failure leaves only an empty dir.
                let _ = std::fs::remove_dir(&self.dir);
            }
        }
        Ok(())
    }
}

impl Drop for FifoDisk {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// A loop device over a file, detached when dropped.
pub struct LoopDevice {
    /// The device, e.g. /dev/loop3.
    pub path: PathBuf,
}

impl LoopDevice {
    /// `losetup --find --show [--direct-io=on] FILE`. With direct I/O the
    /// loop driver submits requests to the file asynchronously and bypasses
    /// the page cache, so the file's own speed is the device's.
    pub fn attach(file: &Path, direct_io: bool) -> Result<LoopDevice> {
        let mut c = std::process::Command::new("losetup");
        c.arg("--find").arg("--show");
        if direct_io {
            c.arg("--direct-io=on");
        }
        let out = c
            .arg(file)
            .output()
            .map_err(io("cannot run losetup (util-linux)"))?;
        if !out.status.success() {
            return Err(Error::Invalid(format!(
                "losetup {}: {}",
                file.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let dev = LoopDevice { path };
        if direct_io && !dev.direct_io() {
            return Err(Error::Invalid(format!(
                "{} did not switch to direct I/O over {}",
                dev.path.display(),
                file.display()
            )));
        }
        Ok(dev)
    }

    /// The kernel's own view: `/sys/block/loopN/loop/dio`.
    pub fn direct_io(&self) -> bool {
        let name = self.path.file_name().unwrap_or_default().to_string_lossy();
        std::fs::read_to_string(format!("/sys/block/{name}/loop/dio"))
            .map(|s| s.trim() == "1")
            .unwrap_or(false)
    }

    /// The block queue's sysfs directory (scheduler, nr_requests).
    pub fn queue_dir(&self) -> PathBuf {
        let name = self.path.file_name().unwrap_or_default().to_string_lossy();
        PathBuf::from(format!("/sys/block/{name}/queue"))
    }

    /// Choose the device's I/O scheduler (e.g. bfq).
    pub fn set_scheduler(&self, name: &str) -> Result<()> {
        let p = self.queue_dir().join("scheduler");
        std::fs::write(&p, name).map_err(io(format!("cannot set {} to {name}", p.display())))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        // The loop device may still be closing after the last user; retry briefly.
        for _ in 0..20 {
            let ok = std::process::Command::new("losetup")
                .arg("-d")
                .arg(&self.path)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
