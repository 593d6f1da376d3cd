//! The web dashboard in a real browser (issue 51, items 4 and 5): Debian's
//! headless Chromium, driven over the W3C WebDriver protocol by
//! `chromedriver`, both inside lab host h1's namespace, opens the link
//! `pagefleet dashboard` prints. The page must load with no console
//! error, show the lab's hosts and guests, follow a split migration's
//! progress to the end and show its report. Without a session every
//! dashboard route answers 401; a forged, expired or used link is refused.
//! h1's pagefleetd also runs the KSM and I/O controllers (a loop device,
//! two blkio cgroups, fio in one): the page shows both, and `promtool check
//! metrics` finds nothing on any host mid-migration. The test saves a
//! screenshot taken mid-migration (`target/dashboard.png`).

use pagefleet_systest::*;
use pagefleet_testbed::Link;
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// Where chromedriver listens, inside h1's namespace.
const DRIVER: &str = "127.0.0.1:9515";
/// What the page may weigh on its first load (the bound).
const FIRST_LOAD_MAX: usize = 300 << 10;

/// chromedriver (and the browser it started), killed when dropped.
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// fio, killed when dropped.
struct Fio(Child);

impl Drop for Fio {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One exchange with chromedriver: (status, body). (It keeps the
/// connection open after its reply; the client reads by the length.)
fn driver_http(
    l: &LabRun,
    method: &str,
    path: &str,
    body: String,
) -> Result<(u16, String), String> {
    let (method, path) = (method.to_string(), path.to_string());
    l.lab
        .spawn_in(0, move || {
            let req = pagefleet_lab::rawhttp::Request {
                method: &method,
                path: &path,
                headers: &[("Content-Type", "application/json")],
                body: body.as_bytes(),
            };
            pagefleet_lab::rawhttp::exchange(DRIVER, &req, Duration::from_secs(120))
                .map(|r| (r.status, r.body))
        })
        .join()
        .map_err(|_| "the webdriver thread panicked".to_string())?
        .map_err(|e| e.to_string())?
}

/// One WebDriver command: its `value`.
fn wd(l: &LabRun, method: &str, path: &str, body: Option<Value>) -> Value {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let (status, text) =
        driver_http(l, method, path, body).unwrap_or_else(|e| panic!("chromedriver {path}: {e}"));
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
    assert_eq!(status, 200, "chromedriver {path}: {v}");
    v["value"].clone()
}

/// Run `script` in the page; its return value.
fn js(l: &LabRun, session: &str, script: &str) -> Value {
    wd(
        l,
        "POST",
        &format!("/session/{session}/execute/sync"),
        Some(json!({"script": script, "args": []})),
    )
}

/// The browser's console messages at level SEVERE (errors) so far.
fn console_errors(l: &LabRun, session: &str) -> Vec<String> {
    let log = wd(
        l,
        "POST",
        &format!("/session/{session}/se/log"),
        Some(json!({"type": "browser"})),
    );
    log.as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["level"] == "SEVERE")
        .map(|e| e["message"].as_str().unwrap_or("").to_string())
        .collect()
}

fn base64_decode(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => continue,
        } as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

fn screenshot(l: &LabRun, session: &str, to: &Path) {
    let png = base64_decode(
        wd(l, "GET", &format!("/session/{session}/screenshot"), None)
            .as_str()
            .unwrap(),
    );
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    std::fs::write(to, png).unwrap();
}

#[test]
fn the_dashboard_follows_a_split_migration_in_chromium_and_refuses_strangers() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    // The controllers on h1 (KSM is the machine's: one host runs it).
    let rig = IoRig::new("ui", &["db", "batch"]);
    let controllers: Vec<String> = match &rig {
        Some(r) => [
            "--ksm",
            "adaptive",
            "--ioqos-device",
            &r.dev,
            "--ioqos-tenants",
            &format!(
                "db={}:min=1GiB,batch={}:min=1MiB",
                r.group(0).display(),
                r.group(1).display()
            ),
        ]
        .map(String::from)
        .to_vec(),
        None => vec!["--ksm".into(), "adaptive".into()],
    };
    let l = lab_with(
        "ui",
        3,
        Link::Gbit1,
        256 * MIB,
        &[320 * MIB, 64 * MIB, 0],
        |o| o.host_args = vec![("h1".into(), controllers)],
    );
    let _load = rig.as_ref().map(|r| Fio(r.fio(1, 2, 120)));
    let h1 = l.lab.hosts[0].http();
    let t = Duration::from_secs(10);
    start_synthetic(&l, "g1", 256, 2000);

    // Strangers: no session, no route.
    for p in [
        "/ui/",
        "/ui",
        "/ui/app.js",
        "/ui/app.css",
        "/ui/api/snapshot",
        "/ui/api/events",
    ] {
        let r = http_in(&l, 0, &h1, ("GET", p), &[], t).unwrap();
        assert_eq!(r.status, 401, "GET {p} without a session: {}", r.body);
    }
    let fake = format!("pagefleet_session={}", "ab".repeat(32));
    let r = http_in(
        &l,
        0,
        &h1,
        ("GET", "/ui/api/snapshot"),
        &[("Cookie", &fake)],
        t,
    )
    .unwrap();
    assert_eq!(r.status, 401, "a made-up session");
    let now = pagefleet_common::httpauth::unix_now();
    let forged = format!(
        "/ui/login?t={now}&n={}&m={}",
        "1".repeat(32),
        "2".repeat(64)
    );
    assert_eq!(
        http_in(&l, 0, &h1, ("GET", &forged), &[], t)
            .unwrap()
            .status,
        401,
        "forged"
    );
    // An expired link, signed with the cluster's secret ten minutes ago.
    let secret = pagefleet_proto::auth::Secret::load(&l.lab.secret_file).unwrap();
    let old = pagefleet_common::httpauth::sign_at(&secret, "GET", "/ui/login", b"", now - 600);
    let f: Vec<&str> = old.trim_start_matches("PF1 ").split(',').collect();
    let expired = format!("/ui/login?{}", f.join("&"));
    let r = http_in(&l, 0, &h1, ("GET", &expired), &[], t).unwrap();
    assert_eq!(r.status, 401, "expired: {}", r.body);
    assert!(
        r.body.contains("pagefleet dashboard"),
        "says what to do: {}",
        r.body
    );
    // A link works once.
    let (ok, link, err) = l.pf(0, &["dashboard", "--on", "h1"]);
    assert!(ok, "pagefleet dashboard: {err}");
    let link = link.trim().to_string();
    assert!(
        link.starts_with(&format!("http://{h1}/ui/login?")),
        "{link}"
    );
    let path = link.trim_start_matches(&format!("http://{h1}"));
    let r = http_in(&l, 0, &h1, ("GET", path), &[], t).unwrap();
    assert_eq!(r.status, 303, "{}", r.head);
    let cookie = r
        .header("set-cookie")
        .expect("a session cookie")
        .to_string();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    assert_eq!(
        http_in(&l, 0, &h1, ("GET", path), &[], t).unwrap().status,
        401,
        "used twice"
    );
    let session = cookie.split(';').next().unwrap().to_string();
    let r = http_in(
        &l,
        0,
        &h1,
        ("GET", "/ui/api/snapshot"),
        &[("Cookie", &session)],
        t,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let r = http_in(
        &l,
        0,
        &h1,
        ("POST", "/ui/api/snapshot"),
        &[("Cookie", &session)],
        t,
    )
    .unwrap();
    assert_eq!(r.status, 405, "the dashboard only reads");
    // The first load: the page and its assets.
    let first: usize = ["/ui/", "/ui/app.js", "/ui/app.css"]
        .iter()
        .map(|p| {
            let r = http_in(&l, 0, &h1, ("GET", p), &[("Cookie", &session)], t).unwrap();
            assert_eq!(r.status, 200, "{p}");
            assert!(
                r.header("content-security-policy").is_some(),
                "{p}: {}",
                r.head
            );
            r.body.len()
        })
        .sum();
    assert!(first < FIRST_LOAD_MAX, "first load {first} bytes");

    // The browser.
    let dir = tempdir("ui-chromium");
    let log = std::fs::File::create(dir.path().join("chromedriver.log")).unwrap();
    let _driver = Driver(
        l.lab
            .exec(0, "chromedriver")
            .arg(format!("--port={}", DRIVER.rsplit(':').next().unwrap()))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("chromedriver (Debian's chromium-driver: make deps installs it)"),
    );
    wait_for("chromedriver", 30, || {
        driver_http(&l, "GET", "/status", String::new()).is_ok_and(|(s, _)| s == 200)
    });
    let caps = json!({"capabilities": {"alwaysMatch": {
        "browserName": "chrome",
        "goog:chromeOptions": {
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1100",
                     format!("--user-data-dir={}", dir.path().join("profile").display())]
        },
        "goog:loggingPrefs": {"browser": "ALL"}
    }}});
    let s = wd(&l, "POST", "/session", Some(caps));
    let id = s["sessionId"]
        .as_str()
        .expect("a WebDriver session")
        .to_string();
    // A fresh link (the one above is used).
    let (ok, link, err) = l.pf(0, &["dashboard", "--on", "h1"]);
    assert!(ok, "pagefleet dashboard: {err}");
    wd(
        &l,
        "POST",
        &format!("/session/{id}/url"),
        Some(json!({"url": link.trim()})),
    );
    let at = js(&l, &id, "return location.pathname");
    assert_eq!(at, "/ui/", "the link leads to the dashboard");
    wait_for("the page to show the lab's hosts and g1", 30, || {
        let v = js(
            &l,
            &id,
            "return [document.querySelectorAll('#hosts tbody tr').length, \
             !!document.querySelector('#guests tr[data-guest=\"g1\"]'), \
             document.getElementById('conn').textContent]",
        );
        v[0] == 3 && v[1] == true && v[2] == "live"
    });
    let hosts = js(
        &l,
        &id,
        "return document.getElementById('hosts').textContent",
    );
    for h in &l.lab.hosts {
        assert!(
            hosts.as_str().unwrap().contains(&h.name),
            "{} on the page: {hosts}",
            h.name
        );
    }

    // The controllers h1 runs, on the page.
    wait_for(
        "the page to show h1's KSM controller and I/O tenants",
        60,
        || {
            let v = js(
                &l,
                &id,
                "return [!document.getElementById('ksm-section').hidden, \
             document.getElementById('ksm').tBodies[0].textContent, \
             document.querySelectorAll('#ioqos tr[data-tenant]').length]",
            );
            v[0] == true
                && v[1].as_str().unwrap_or("").contains("adaptive")
                && (rig.is_none() || v[2] == 2)
        },
    );

    // A split migration, followed on the page.
    let shot = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/dashboard.png");
    let (report, seen) = std::thread::scope(|sc| {
        let m = sc.spawn(|| l.pf(0, &["migrate", "--json", "g1", "--to", "h2", "--sub", "h3"]));
        let mut seen: Vec<(String, f64)> = vec![];
        let t0 = Instant::now();
        while !m.is_finished() && t0.elapsed() < Duration::from_secs(300) {
            let v = js(
                &l,
                &id,
                "const c = document.querySelector('.migration[data-guest=\"g1\"]'); \
                 return c ? [c.querySelector('.phase').textContent, \
                             Number(c.querySelector('.progress').getAttribute('aria-valuenow'))] : null",
            );
            if let Some(a) = v.as_array() {
                let p = (
                    a[0].as_str().unwrap_or("").to_string(),
                    a[1].as_f64().unwrap_or(-1.0),
                );
                if seen.is_empty() {
                    screenshot(&l, &id, &shot);
                    // Every host's series as Prometheus' checker sees them,
                    // with guests, a migration and both controllers running.
                    for (i, h) in l.lab.hosts.iter().enumerate() {
                        let text = l.get_text(i, "/metrics").unwrap();
                        assert_eq!(
                            promtool_check_metrics(&text),
                            "",
                            "promtool on {}:\n{text}",
                            h.name
                        );
                        if i == 0 {
                            for series in
                                ["pagefleet_ksm_pages_sharing", "pagefleet_migration_phase"]
                            {
                                assert!(text.contains(series), "{series} on h1");
                            }
                            if rig.is_some() {
                                assert!(
                                    text.contains(
                                        "pagefleet_ioqos_tenant_bytes_per_second{tenant=\"batch\""
                                    ),
                                    "I/O QoS series on h1"
                                );
                            }
                        }
                    }
                }
                seen.push(p);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        (m.join().unwrap(), seen)
    });
    let (ok, out, err) = report;
    assert!(ok, "migrate g1: {err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    assert!(
        !seen.is_empty(),
        "the page showed the migration in progress"
    );
    assert!(
        seen.iter().all(|(_, p)| (0.0..=100.0).contains(p)),
        "progress within 0..100: {seen:?}"
    );
    assert!(
        seen.iter().any(|(_, p)| *p > 0.0),
        "the bar filled: {seen:?}"
    );
    // The end: the report in the finished table, the bar gone, g1 on h2.
    wait_for("the migration's report on the page", 30, || {
        let v = js(
            &l,
            &id,
            "const r = document.querySelector('#finished tr[data-guest=\"g1\"]'); \
             return [r ? r.textContent : '', !!document.querySelector('.migration[data-guest=\"g1\"]'), \
                     (document.querySelector('#guests tr[data-guest=\"g1\"]') || {textContent: ''}).textContent]",
        );
        v[0].as_str()
            .unwrap_or("")
            .contains("running at the destination")
            && v[1] == false
            && v[2].as_str().unwrap_or("").contains("h2")
    });
    let row = js(
        &l,
        &id,
        "return document.querySelector('#finished tr[data-guest=\"g1\"]').textContent",
    );
    assert!(
        row.as_str().unwrap().contains(&format!("{}", r["rounds"])),
        "rounds in {row}"
    );
    let errors = console_errors(&l, &id);
    assert!(errors.is_empty(), "console errors: {errors:?}");
    wd(&l, "DELETE", &format!("/session/{id}"), None);
    let (ok, _, err) = l.pf(0, &["guest", "stop", "g1"]);
    assert!(ok, "guest stop: {err}");
}

/// `pagefleet testbed dashboard` and `make demo`'s link: a port on this
/// machine (outside every lab namespace) leads to h1's dashboard; a
/// stranger through it is still refused, the printed link opens a session.
#[test]
fn a_forwarded_port_leads_to_the_dashboard_and_strangers_stay_out() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    use pagefleet_lab::rawhttp::{exchange, Request};
    let l = lab("uif", 2, Link::Gbit10, 64 * MIB, &[128 * MIB, 0]);
    let (f, link) = pagefleet_lab::forward::dashboard(&l.lab, 0, "127.0.0.1:0").unwrap();
    let at = f.local.to_string();
    let t = Duration::from_secs(10);
    let stranger = exchange(&at, &Request::get("/ui/api/snapshot"), t).unwrap();
    assert_eq!(stranger.status, 401, "{}", stranger.body);
    let path = link.trim_start_matches(&format!("http://{at}"));
    let r = exchange(&at, &Request::get(path), t).unwrap();
    assert_eq!(r.status, 303, "{}", r.head);
    let cookie = r
        .header("set-cookie")
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let req = Request {
        headers: &[("Cookie", &cookie)],
        ..Request::get("/ui/api/snapshot")
    };
    let r = exchange(&at, &req, t).unwrap();
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["view"]["hosts"].as_array().map(Vec::len), Some(2), "{v}");
    // A second link through the same port, and the first one is used up.
    let again = pagefleet_lab::forward::login_link(&l.lab, &f).unwrap();
    assert_ne!(again, link);
    assert_eq!(
        exchange(&at, &Request::get(path), t).unwrap().status,
        401,
        "used once"
    );
}
