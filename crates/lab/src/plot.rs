//! Plots: the results JSON rendered to PNG by an embedded Python script.

use anyhow::{anyhow, bail, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Find a Python with matplotlib: $PAGEFLEET_PYTHON, the repository's
/// .venv (made by `make`), then python3.
pub fn python() -> Option<PathBuf> {
    let mut cands = Vec::new();
    if let Some(p) = std::env::var_os("PAGEFLEET_PYTHON") {
        cands.push(PathBuf::from(p));
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    cands.push(repo.join(".venv/bin/python3"));
    if let Ok(exe) = std::env::current_exe() {
        // target/release/pagefleet -> repo/.venv
        if let Some(r) = exe
            .parent()
            .and_then(|p| p.parent())
            .and_then(|p| p.parent())
        {
            cands.push(r.join(".venv/bin/python3"));
        }
    }
    cands.push(PathBuf::from("python3"));
    cands.into_iter().find(|p| {
        Command::new(p)
            .args(["-c", "import matplotlib"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Where a benchmark's PNG went, or why it was not written (top-level
/// `plot` / `plot_error` in the JSON).
#[derive(Debug, Default, Serialize)]
pub struct PlotOutcome {
    pub plot: Option<String>,
    pub plot_error: Option<String>,
}

impl PlotOutcome {
    pub fn print(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        match (&self.plot, &self.plot_error) {
            (Some(p), _) => writeln!(out, "\nPlot: {p}"),
            (None, Some(e)) => writeln!(out, "\nPlot not written: {e}"),
            _ => Ok(()),
        }
    }
}

/// Write `DIR/NAME.json`, render `DIR/NAME.png` with the embedded plot
/// script, record the outcome in the report and write the JSON again.
pub fn save_with_plot<R: Serialize>(
    report: &mut R,
    outcome: fn(&mut R) -> &mut PlotOutcome,
    dir: &Path,
    name: &str,
    script: &str,
) -> Result<()> {
    let json_path = dir.join(format!("{name}.json"));
    std::fs::write(&json_path, serde_json::to_vec_pretty(report)?)?;
    let o = match plot(
        &format!("plot_{name}.py"),
        script,
        &json_path,
        &dir.join(format!("{name}.png")),
    ) {
        Ok(p) => PlotOutcome {
            plot: Some(p.display().to_string()),
            plot_error: None,
        },
        Err(e) => PlotOutcome {
            plot: None,
            plot_error: Some(format!("{e:#}")),
        },
    };
    *outcome(report) = o;
    std::fs::write(&json_path, serde_json::to_vec_pretty(report)?)?;
    Ok(())
}

/// Run an embedded plot script on a results JSON file; returns the PNG path.
pub fn plot(script_name: &str, script: &str, json_path: &Path, png: &Path) -> Result<PathBuf> {
    let py = python().ok_or_else(|| {
        anyhow!("no Python with matplotlib found (run `make deps`, or set PAGEFLEET_PYTHON); results are in {}", json_path.display())
    })?;
    let dir = json_path.parent().unwrap();
    let sp = dir.join(script_name);
    std::fs::write(&sp, script)?;
    let out = Command::new(&py)
        .arg(&sp)
        .arg(json_path)
        .arg(png)
        .output()?;
    if !out.status.success() {
        bail!(
            "plot script failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(png.to_path_buf())
}
