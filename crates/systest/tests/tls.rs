//! TLS on every port between hosts (issue 20): a testbed whose daemons run
//! with `--tls-dir` (a lab CA, a certificate per host). Clients of the
//! cluster (the admin certificate) are served; a client without
//! certificates, or with one another CA signed, is refused by the memory
//! server and the HTTP API; a split migration runs end to end over TLS
//! (migration stream, pages to the sub-host's memory server, paging after).

use pagefleet_systest::*;
use pagefleet_testbed::Link;
use serde_json::Value;

const MIB: u64 = 1 << 20;

/// `pagefleet ARGS` in host `h` presenting `tls` (None: no certificate).
fn pf_as(
    l: &LabRun,
    h: usize,
    tls: Option<&std::path::Path>,
    args: &[&str],
) -> (bool, String, String) {
    let mut c = l.lab.exec(h, bin("pagefleet"));
    match tls {
        Some(p) => c.env("PAGEFLEET_TLS_DIR", p),
        None => c.env_remove("PAGEFLEET_TLS_DIR"),
    };
    let out = c.args(args).output().expect("run pagefleet in the lab");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn every_port_takes_only_tls_from_other_hosts_and_refuses_strangers() {
    if !is_root() {
        eprintln!("skipped: needs root (network namespaces)");
        return;
    }
    // h2 has memory for about half of g1: the rest goes to h3.
    let l = lab_with(
        "tls",
        3,
        Link::Gbit10,
        256 * MIB,
        &[256 * MIB, 40 * MIB, 0],
        |o| o.tls = true,
    );
    let admin = l
        .lab
        .admin_tls
        .clone()
        .expect("the lab has an admin identity");
    // A stranger: a certificate for h1's address that another CA signed.
    let tmp = tempdir("tls-stranger");
    let ca = tmp.path().join("ca");
    pagefleet_tls::certs::init_ca(&ca).unwrap();
    let stranger = tmp.path().join("id");
    let req = pagefleet_tls::certs::IssueRequest {
        ips: vec![l.lab.hosts[0].ip.parse().unwrap()],
        ..pagefleet_tls::certs::IssueRequest::named("h1")
    };
    pagefleet_tls::certs::issue(&ca, &req, &stranger).unwrap();

    // The memory server on h3, asked from h1.
    let ms = l.lab.hosts[2].addr.clone();
    let (ok, out, err) = pf_as(
        &l,
        0,
        Some(&admin),
        &["memserver", "stat", "--server", &ms, "--json"],
    );
    assert!(ok, "the cluster's client refused: {err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["tls"], true, "{v}");
    let (ok, _, err) = pf_as(&l, 0, None, &["memserver", "stat", "--server", &ms]);
    assert!(
        !ok && err.contains("only TLS"),
        "no certificate, yet: ok={ok} {err}"
    );
    let (ok, _, err) = pf_as(
        &l,
        0,
        Some(&stranger),
        &["memserver", "stat", "--server", &ms],
    );
    assert!(
        !ok && err.contains("TLS"),
        "a stranger's certificate, yet: ok={ok} {err}"
    );

    // The HTTP API of h3.
    let api = l.lab.hosts[2].http();
    let (ok, _, err) = pf_as(&l, 0, Some(&admin), &["status", "--hosts", &api, "--json"]);
    assert!(ok, "status over HTTPS: {err}");
    let (ok, _, err) = pf_as(&l, 0, None, &["status", "--hosts", &api, "--json"]);
    let (ok2, _, err2) = pf_as(
        &l,
        0,
        Some(&stranger),
        &["status", "--hosts", &api, "--json"],
    );
    eprintln!("no certificate: {err}\nstranger: {err2}");
    // `status` reports an unreachable host in its table rather than failing:
    // look for the refusal in what it says.
    let (_, out, _) = pf_as(&l, 0, None, &["status", "--hosts", &api, "--json"]);
    assert!(
        out.contains("only HTTPS") || (!ok && err.contains("only HTTPS")),
        "{out} {err}"
    );
    let (_, out2, _) = pf_as(
        &l,
        0,
        Some(&stranger),
        &["status", "--hosts", &api, "--json"],
    );
    assert!(
        out2.contains("TLS") || out2.contains("alert") || (!ok2 && err2.contains("TLS")),
        "{out2} {err2}"
    );

    // The NBD export (DMPS) on h1's address: nbdinfo from h2 without TLS
    // is told TLS is required; with the cluster's certificates it is served.
    let nbd = format!("{}:10809", l.lab.hosts[0].ip);
    let servers = format!("{},{}", l.lab.hosts[1].addr, l.lab.hosts[2].addr);
    let mut serve = l.lab.exec(0, bin("pagefleet"));
    serve
        .args(["--tls-dir", l.lab.host_tls(0).unwrap().to_str().unwrap()])
        .args(["blockdev", "serve", "--servers", &servers, "--size", "8MiB"])
        .args(["--listen", &nbd]);
    let mut child = spawn_listening(&mut serve);
    let plain = l
        .lab
        .exec(1, "nbdinfo")
        .arg(format!("nbd://{nbd}"))
        .output()
        .unwrap();
    let tls = l
        .lab
        .exec(1, "nbdinfo")
        .arg(format!(
            "nbds://{nbd}/?tls-certificates={}",
            admin.display()
        ))
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let said = String::from_utf8_lossy(&plain.stderr);
    assert!(
        !plain.status.success(),
        "plaintext NBD from another host was served"
    );
    // libnbd reports NBD_REP_ERR_TLS_REQD as "not supported".
    eprintln!("plaintext nbdinfo from h2: {said}");
    assert!(
        tls.status.success() && String::from_utf8_lossy(&tls.stdout).contains("8388608"),
        "nbdinfo over TLS: {}",
        String::from_utf8_lossy(&tls.stderr)
    );

    // A split migration h1 -> h2 with h3 as sub-host, all over TLS; the
    // guest's checksum is the same on both sides.
    // Every host reports its identity; `pagefleet status` shows it.
    let st = l.status(0);
    assert_eq!(st.len(), 3);
    for (i, h) in st.iter().enumerate() {
        let tls = h.report.as_ref().and_then(|r| r.tls.clone());
        assert_eq!(tls.as_deref(), Some(l.lab.hosts[i].name.as_str()), "{h:?}");
    }
    start_synthetic(&l, "g1", 64, 2000);
    let before = l.get_text(2, "/metrics").expect("h3 metrics over HTTPS");
    let (ok, out, err) = l.pf(
        0,
        &[
            "migrate", "g1", "--to", "h2", "--sub", "h3", "--verify", "--json",
        ],
    );
    assert!(ok, "split migration over TLS: {err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    let after = l.get_text(2, "/metrics").expect("h3 metrics over HTTPS");
    let name = "pagefleet_memserver_tls_handshakes_total";
    eprintln!("migration: {r}");
    eprintln!(
        "h3 /metrics TLS lines: {:?}",
        after
            .lines()
            .filter(|l| l.contains("tls"))
            .collect::<Vec<_>>()
    );
    assert!(
        metric(&after, name) > metric(&before, name),
        "h3's memory server saw no TLS connection during the migration"
    );
    assert!(
        metric(&after, "pagefleet_memserver_tls_failures_total") >= 1.0,
        "the stranger's handshake was not counted as refused"
    );
    let (_, g) = l.guest("g1").expect("g1 runs");
    eprintln!("g1 after the migration: {g:?}");
}
