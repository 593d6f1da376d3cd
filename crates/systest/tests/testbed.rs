//! The testbed: hosts in network namespaces behind a shaped bridge, one real
//! pagefleetd each; everything removed by `down`, which is safe twice.

use pagefleet_systest::*;
use pagefleet_testbed::{down_prefix, Lab, Link, Options};
use std::process::Command;

struct Guard(Lab);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.down();
    }
}

fn netns() -> String {
    String::from_utf8_lossy(
        &Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned()
}

#[test]
fn testbed_up_connects_hosts_shapes_links_and_comes_down_twice() {
    if !pagefleet_common::sys::process::is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let r = pagefleet_proto::auth::random_u64();
    let prefix = format!("t{:04x}", r & 0xffff);
    let dir = tempdir("testbed");
    let mut o = Options::new(3, Link::Gbit1, bin("pagefleetd"));
    o.prefix = prefix.clone();
    o.dir = dir.to_path_buf();
    o.lend = 64 << 20;
    o.subnet_octet = 100 + (r >> 16) as u8 % 100;
    let lab = Guard(Lab::up(&o).expect("testbed up"));
    let ns = netns();
    for h in &lab.0.hosts {
        assert!(ns.contains(&h.netns), "{} missing: {ns}", h.netns);
        // Shaped to 1 Gbit/s on the host side.
        let q = Command::new("tc")
            .args(["-n", &h.netns, "qdisc", "show", "dev", "eth0"])
            .output()
            .unwrap();
        let q = String::from_utf8_lossy(&q.stdout);
        assert!(q.contains("tbf") && q.contains("1Gbit"), "{}: {q}", h.name);
        // Only the lab subnet is routable: no way out of the lab.
        let rt = Command::new("ip")
            .args(["-n", &h.netns, "route"])
            .output()
            .unwrap();
        let rt = String::from_utf8_lossy(&rt.stdout);
        assert!(!rt.contains("default"), "{}: {rt}", h.name);
    }
    // Host 2 reaches host 1's and host 3's memory servers through the bridge.
    for target in [0, 2] {
        let out = lab
            .0
            .exec(1, bin("pagefleet"))
            .arg("--secret-file")
            .arg(&lab.0.secret_file)
            .args([
                "memserver",
                "ping",
                "--count",
                "2",
                "--server",
                &lab.0.hosts[target].addr,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "h2 -> {}: {}",
            lab.0.hosts[target].name,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Each host reports its memory and what its memory server lends.
    let out = lab
        .0
        .exec(0, bin("pagefleet"))
        .args([
            "status",
            "--json",
            "--hosts",
            &format!("{}:7071", lab.0.hosts[0].ip),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("\"lend_capacity\": 67108864"),
        "{text}"
    );
    // Bringing it up again over itself replaces the old lab (crashed-run cleanup).
    let lab2 = Lab::up(&o).expect("testbed up over an existing lab");
    assert_eq!(lab2.hosts.len(), 3);
    std::mem::forget(lab);
    down_prefix(&dir, &prefix).unwrap();
    down_prefix(&dir, &prefix).expect("down twice");
    let ns = netns();
    assert!(!ns.contains(&format!("{prefix}-")), "namespaces left: {ns}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A guest's service address moves between hosts: clients elsewhere in the
/// lab reach whatever now serves it, on the new host.
#[test]
fn service_address_moves_between_hosts() {
    if !pagefleet_common::sys::process::is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let r = pagefleet_proto::auth::random_u64();
    let prefix = format!("s{:04x}", r & 0xffff);
    let dir = tempdir("svc");
    let mut o = Options::new(3, Link::Unshaped, bin("pagefleetd"));
    o.prefix = prefix.clone();
    o.dir = dir.to_path_buf();
    o.lend = 16 << 20;
    o.subnet_octet = 100 + (r >> 16) as u8 % 100;
    let lab = Guard(Lab::up(&o).expect("testbed up"));
    let ip = lab.0.service_ip(1);
    let svc = format!("{ip}:7090");
    let serve_on = |host: usize| {
        let mut c = lab
            .0
            .exec(host, bin("pagefleetd"))
            .args([
                "--lend",
                "4MiB",
                "--listen",
                &svc,
                "--metrics",
                "off",
                "--log",
                "error",
                "--secret-file",
            ])
            .arg(&lab.0.secret_file)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(c.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert!(line.starts_with("listening"), "{line}");
        c
    };
    let ping_from_h3 = || {
        let out = lab
            .0
            .exec(2, bin("pagefleet"))
            .arg("--secret-file")
            .arg(&lab.0.secret_file)
            .args(["memserver", "ping", "--count", "1", "--server", &svc])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .to_string()
    };
    lab.0.place_service_ip(&ip, 0).unwrap();
    assert_eq!(lab.0.service_ip_host(&ip), Some(0));
    let mut a = serve_on(0);
    let first = ping_from_h3();
    let _ = a.kill();
    let _ = a.wait();
    lab.0.place_service_ip(&ip, 1).unwrap();
    assert_eq!(lab.0.service_ip_host(&ip), Some(1));
    let mut b = serve_on(1);
    let second = ping_from_h3();
    let _ = b.kill();
    let _ = b.wait();
    // Each line names the server id: a different process answered, on host 2.
    assert_ne!(
        first, second,
        "the moved address must reach the new host's server"
    );
    drop(lab);
    assert!(!netns().contains(&format!("{prefix}-")));
    let _ = std::fs::remove_dir_all(&dir);
}
