//! Every flag and argument of every command says what it is for: a
//! newcomer reading `--help` never meets a bare `--server <SERVER>`.

use std::process::Command;

fn help(bin: &str, path: &[String]) -> String {
    let out = Command::new(bin)
        .args(path)
        .arg("--help")
        .output()
        .expect("run --help");
    assert!(out.status.success(), "{path:?} --help failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Walk every subcommand; collect options and arguments without a description.
fn undocumented(bin: &str, path: Vec<String>, bad: &mut Vec<String>) {
    let text = help(bin, &path);
    let lines: Vec<&str> = text.lines().collect();
    let mut section = "";
    for (i, l) in lines.iter().enumerate() {
        if let Some(s) = ["Commands:", "Options:", "Arguments:"]
            .iter()
            .find(|s| l.starts_with(**s))
        {
            section = s;
            continue;
        }
        if !l.starts_with("  ") {
            continue;
        }
        let t = l.trim_start();
        if section == "Commands:" {
            let name = t.split_whitespace().next().unwrap_or("");
            if !name.is_empty() && name != "help" && l.starts_with("  ") && !l.starts_with("   ") {
                let mut p = path.clone();
                p.push(name.to_string());
                undocumented(bin, p, bad);
            }
            continue;
        }
        // Continuation lines of a long help are indented far deeper.
        let indent = l.len() - t.len();
        if section.is_empty()
            || indent > 6
            || !(t.starts_with('-') || t.starts_with('<') || t.starts_with('['))
        {
            continue;
        }
        // The flag with its value name, then (after 2+ spaces) its help.
        let desc = t.split_once("  ").map(|x| x.1.trim()).unwrap_or("");
        let desc = desc.split('[').next().unwrap_or("").trim();
        let continued = lines
            .get(i + 1)
            .is_some_and(|n| n.starts_with("          ") && !n.trim().is_empty());
        if desc.is_empty() && !continued {
            bad.push(format!(
                "{} {}",
                path.join(" "),
                t.split_whitespace().next().unwrap_or("")
            ));
        }
    }
}

#[test]
fn every_flag_of_every_command_has_help() {
    let pagefleet = env!("CARGO_BIN_EXE_pagefleet");
    // pagefleetd is built beside it (same workspace, same profile).
    let daemon = std::path::Path::new(pagefleet).with_file_name("pagefleetd");
    let mut bad = Vec::new();
    undocumented(pagefleet, Vec::new(), &mut bad);
    if daemon.exists() {
        undocumented(daemon.to_str().unwrap(), Vec::new(), &mut bad);
    }
    assert!(bad.is_empty(), "flags without help: {bad:#?}");
}
