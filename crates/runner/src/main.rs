//! `pagefleet-runner`: the process pagefleetd starts for each guest.
//!
//! `pagefleet-runner runner-guest --name=NAME` runs a guest,
//! `pagefleet-runner runner-incoming --name=NAME` waits for one migrating
//! in; either way the job comes as one JSON line (`Launch`) on stdin, and
//! the name only labels the process for `ps` (and lets the next daemon
//! recognise its runners). Everything else is [`pagefleet_runner::launch`].

use std::process::ExitCode;

const USAGE: &str = "usage: pagefleet-runner runner-guest|runner-incoming --name=NAME < launch.json

The process pagefleetd starts for each guest; it reads its job (a Launch
message, one JSON line) from stdin. Not for running by hand: start guests
with `pagefleet guest start` or `pagefleet run`.
Logging: PAGEFLEET_LOG (default info).";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let kind = match args.first().map(String::as_str) {
        Some("runner-guest") => "guest",
        Some("runner-incoming") => "incoming",
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if !args[1..].iter().all(|a| a.starts_with("--name=")) {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            std::env::var("PAGEFLEET_LOG").unwrap_or_else(|_| "info".into()),
        ))
        .with_writer(std::io::stderr)
        .init();
    match pagefleet_runner::launch(std::io::stdin().lock(), kind) {
        Ok(exit) => {
            tracing::info!("runner ends: guest {exit}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("pagefleet-runner: {e}");
            ExitCode::FAILURE
        }
    }
}
