//! The kv guest as a memcached its clients cannot tell apart, for the
//! commands it implements: libmemcached's tools (memcping, memcstat,
//! memcslap, memcdump) and a Python client (pymemcache) against a kv guest
//! paging to a real memory server; filled past its memory it keeps serving
//! by evicting the least recently used items, or refuses with --no-evict.

use pagefleet_systest::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A `pagefleet run kv` killed and reaped on drop, even when the test fails.
struct KvRun {
    child: std::process::Child,
    addr: String,
}

impl Drop for KvRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `pagefleet run kv` of `size` (extra flags after), listening on loopback.
/// A free port is only free until someone binds it: a test running beside
/// this one may start a server on the same port first (then the kv exits
/// with "address in use" and what answers on the port is that server). So
/// the kv is ready when it answers `version` itself, and a kv that lost
/// its port that way is started again on another.
fn kv(c: Option<&Cluster>, size: &str, extra: &[&str]) -> KvRun {
    for _attempt in 0..5 {
        let port = pagefleet_lab::proc::free_port().unwrap();
        let addr = format!("127.0.0.1:{port}");
        let mut cmd = Command::new(bin("pagefleet"));
        if let Some(c) = c {
            cmd.arg("--secret-file").arg(&c.secret_file);
        }
        cmd.args(["run", "kv", "--size", size, "--listen", &addr]);
        if let Some(c) = c {
            cmd.args(["--servers", &c.addrs().join(","), "--budget", "50%"]);
        }
        let log = tempfile_path(&format!("kv-{port}.log"));
        let child = cmd
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut r = KvRun { child, addr };
        let t = Instant::now();
        loop {
            if let Some(st) = r.child.try_wait().unwrap() {
                let err = std::fs::read_to_string(&log).unwrap_or_default();
                let _ = std::fs::remove_file(&log);
                assert!(
                    err.contains("in use"),
                    "pagefleet run kv exited ({st}): {err}"
                );
                break;
            }
            if answers_version(&r.addr) {
                let _ = std::fs::remove_file(&log);
                return r;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "kv never listened: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    panic!("five ports in a row were taken before the kv could bind them");
}

/// Something at `addr` speaks memcached's text protocol.
fn answers_version(addr: &str) -> bool {
    let Ok(s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut w = match s.try_clone() {
        Ok(w) => w,
        Err(_) => return false,
    };
    if w.write_all(b"version\r\n").is_err() {
        return false;
    }
    let mut l = String::new();
    BufReader::new(s).read_line(&mut l).is_ok() && l.starts_with("VERSION ")
}

fn tempfile_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("pagefleet-test-{}-{name}", std::process::id()))
}

fn tool(name: &str, args: &[&str]) -> String {
    let out = Command::new(name)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{name} (libmemcached-tools; make deps installs it): {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{name} {args:?} failed: {text}");
    text
}

/// A memcached text-protocol connection.
struct Conn {
    w: std::net::TcpStream,
    r: BufReader<std::net::TcpStream>,
}

impl Conn {
    fn new(addr: &str) -> Conn {
        let s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.set_nodelay(true).unwrap();
        Conn {
            w: s.try_clone().unwrap(),
            r: BufReader::new(s),
        }
    }
    fn line(&mut self) -> String {
        let mut l = String::new();
        self.r.read_line(&mut l).unwrap();
        l
    }
    fn set(&mut self, key: &str, v: &[u8]) -> String {
        let mut req = format!("set {key} 0 0 {}\r\n", v.len()).into_bytes();
        req.extend_from_slice(v);
        req.extend_from_slice(b"\r\n");
        self.w.write_all(&req).unwrap();
        self.line()
    }
    fn get(&mut self, key: &str) -> Option<Vec<u8>> {
        write!(self.w, "get {key}\r\n").unwrap();
        let head = self.line();
        if head == "END\r\n" {
            return None;
        }
        let n: usize = head.split_whitespace().nth(3).unwrap().parse().unwrap();
        let mut v = vec![0u8; n + 2];
        std::io::Read::read_exact(&mut self.r, &mut v).unwrap();
        assert_eq!(self.line(), "END\r\n");
        v.truncate(n);
        Some(v)
    }
    fn stat(&mut self, name: &str) -> u64 {
        self.w.write_all(b"stats\r\n").unwrap();
        let mut found = None;
        loop {
            let l = self.line();
            if l == "END\r\n" || l.is_empty() {
                break;
            }
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.get(1) == Some(&name) {
                found = f.get(2).and_then(|v| v.parse().ok());
            }
        }
        found.unwrap_or_else(|| panic!("no stat {name}"))
    }
}

fn value(i: u64, len: usize) -> Vec<u8> {
    let mut x = i | 1;
    (0..len)
        .map(|_| b'a' + (xorshift(&mut x) % 26) as u8)
        .collect()
}

#[test]
fn libmemcached_tools_and_pymemcache_work_against_a_paging_kv_guest() {
    let c = Cluster::start(1, "256MiB");
    let k = kv(Some(&c), "64MiB", &[]);
    let servers = format!("--servers={}", k.addr);
    tool("memcping", &[&servers]);
    let stat = tool("memcstat", &[&servers]);
    assert!(stat.contains("version: 1.6."), "{stat}");
    assert!(
        stat.contains("curr_connections:") && stat.contains("limit_maxbytes: 67108864"),
        "{stat}"
    );
    // memcslap: sets then gets from 4 threads.
    tool(
        "memcslap",
        &[&servers, "--concurrency=4", "--execute-number=2000"],
    );
    tool(
        "memcslap",
        &[
            &servers,
            "--concurrency=4",
            "--execute-number=2000",
            "--test=get",
        ],
    );
    // memcdump lists every key stored.
    let items = Conn::new(&k.addr).stat("curr_items");
    assert!(items >= 2000, "{items}");
    let dump = tool("memcdump", &[&servers]);
    assert_eq!(
        dump.lines().count() as u64,
        items,
        "memcdump: {} keys, {items} items",
        dump.lines().count()
    );
    // pymemcache, as a Python application would use it.
    let script = r#"
import sys
from pymemcache.client.base import Client
host, port = sys.argv[1].rsplit(":", 1)
c = Client((host, int(port)), timeout=10)
assert c.version().startswith(b"1.6."), c.version()
c.set("a", b"hello")
assert c.get("a") == b"hello"
assert c.add("a", b"x", noreply=False) is False
assert c.replace("a", b"world", noreply=False) is True
assert c.append("a", b"!", noreply=False) is True
assert c.get("a") == b"world!"
c.set("n", b"41")
assert c.incr("n", 1) == 42
assert c.decr("n", 2) == 40
v, cas = c.gets("n")
assert c.cas("n", b"7", cas) is True
assert c.cas("n", b"8", cas) is False
assert c.get_many(["a", "n", "missing"]) == {"a": b"world!", "n": b"7"}
assert c.touch("a", 100, noreply=False) is True
assert c.delete("a", noreply=False) is True
assert c.get("a") is None
s = c.stats()
assert s[b"cas_hits"] == 1 and s[b"cas_badval"] == 1, s
assert s[b"delete_hits"] >= 1 and s[b"incr_hits"] == 1, s
print("pymemcache ok")
"#;
    let out = Command::new("/usr/bin/python3")
        .args(["-c", script, &k.addr])
        .output()
        .expect("python3");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("pymemcache ok"),
        "{text}"
    );
}

#[test]
fn filled_past_its_memory_it_keeps_serving_by_evicting() {
    // 16 MiB of guest memory, 48 MiB of 4000-byte values.
    let k = kv(None, "16MiB", &[]);
    let mut c = Conn::new(&k.addr);
    let n = 12_000u64;
    for i in 0..n {
        assert_eq!(
            c.set(&format!("k{i}"), &value(i, 4000)),
            "STORED\r\n",
            "set {i}"
        );
    }
    let evicted = c.stat("evictions");
    let items = c.stat("curr_items");
    assert!(evicted > n / 2, "{evicted} evictions");
    assert_eq!(items + evicted, n);
    // What fits of the 16 MiB (less the table and the slack of a class) is
    // kept, and the newest items are all there with their values.
    assert!(items * 4000 > 12 << 20, "{items} items kept");
    for i in n - 500..n {
        assert_eq!(c.get(&format!("k{i}")), Some(value(i, 4000)), "k{i}");
    }
    assert_eq!(c.get("k0"), None, "the oldest was evicted");
    // The values change size: pages move to the new size class (memcached's
    // slab reassignment) and the new values take the memory over in turn.
    for i in 0..200u64 {
        assert_eq!(
            c.set(&format!("big{i}"), &value(i, 64 << 10)),
            "STORED\r\n",
            "big{i}"
        );
    }
    assert!(
        c.stat("slabs_moved") > 4,
        "{} pages moved",
        c.stat("slabs_moved")
    );
    let bytes = c.stat("bytes");
    assert!(
        bytes > 8 << 20,
        "{bytes} bytes of values in 16 MiB after the change"
    );
    for i in 150..200u64 {
        assert_eq!(
            c.get(&format!("big{i}")),
            Some(value(i, 64 << 10)),
            "big{i}"
        );
    }
    drop(c);
    drop(k);

    // 64 KiB values (power-of-two classes filled at half the memory):
    // past its memory it holds more than 12 of its 16 MiB in values.
    let k = kv(None, "16MiB", &[]);
    let mut c = Conn::new(&k.addr);
    for i in 0..400u64 {
        assert_eq!(c.set(&format!("big{i}"), &value(i, 64 << 10)), "STORED\r\n");
    }
    let bytes = c.stat("bytes");
    assert!(bytes > 12 << 20, "{bytes} bytes of values in 16 MiB");
    assert!(c.stat("evictions") > 0);
    assert_eq!(c.get("big399"), Some(value(399, 64 << 10)));
    drop(c);
    drop(k);

    // With --no-evict it refuses as memcached -M does, keeping what it has.
    let k = kv(None, "16MiB", &["--no-evict"]);
    let mut c = Conn::new(&k.addr);
    let mut refused = None;
    for i in 0..n {
        let r = c.set(&format!("k{i}"), &value(i, 4000));
        if r != "STORED\r\n" {
            assert_eq!(r, "SERVER_ERROR out of memory storing object\r\n");
            refused = Some(i);
            break;
        }
    }
    let first = refused.expect("a full --no-evict kv refuses stores");
    assert_eq!(c.stat("evictions"), 0);
    assert_eq!(c.get("k0"), Some(value(0, 4000)));
    assert_eq!(
        c.get(&format!("k{}", first - 1)),
        Some(value(first - 1, 4000))
    );
}
