//! The C ABI: a C program compiled against include/pagefleet.h and linked
//! with libpagefleet_region.so pages to a real memory server.

use pagefleet_systest::*;
use std::path::Path;
use std::process::Command;

#[test]
fn c_program_pages_through_the_c_abi() {
    let c = Cluster::start(1, "64MiB");
    let dir = tempdir("capi");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let libdir = bin("pagefleetd").parent().unwrap().to_path_buf();
    assert!(
        libdir.join("libpagefleet_region.so").exists(),
        "libpagefleet_region.so not built"
    );
    let exe = dir.join("capi_test");
    let st = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(root.join("crates/systest/c/capi_test.c"))
        .arg(format!("-I{}", root.join("include").display()))
        .arg(format!("-L{}", libdir.display()))
        .arg("-lpagefleet_region")
        .status()
        .expect("cc");
    assert!(st.success(), "compiling the C test failed");
    let out = Command::new(&exe)
        .arg(c.addrs().join(","))
        .arg(&c.secret_file)
        .env("LD_LIBRARY_PATH", &libdir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "C test failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
