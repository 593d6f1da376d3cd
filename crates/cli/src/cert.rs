//! `pagefleet cert`: the cluster CA and the certificates hosts and people
//! present (files in `pagefleet_tls::certs`).

use anyhow::{Context, Result};
use clap::Subcommand;
use pagefleet_tls::certs::{self, IssueRequest};
use std::net::IpAddr;
use std::path::PathBuf;

/// Certificates for TLS on every pagefleet port.
#[derive(Subcommand)]
pub enum CertCmd {
    /// Create the cluster CA (once per cluster; keep its key off the hosts
    /// if you can: only `cert issue` needs it).
    ///
    /// Example: pagefleet cert init --ca-dir /etc/pagefleet/ca
    Init {
        /// Where the CA's certificate and key go.
        #[arg(long, default_value = "/etc/pagefleet/ca")]
        ca_dir: PathBuf,
    },
    /// Issue a host's (or a person's) key and certificate, signed by the
    /// cluster CA, into an identity directory that pagefleetd --tls-dir,
    /// pagefleet --tls-dir, QEMU's tls-creds-x509 and nbdinfo's
    /// tls-certificates all read.
    ///
    /// Example: pagefleet cert issue h2 --ip 10.0.0.2 --out /etc/pagefleet/tls
    Issue {
        /// The identity's name (its certificate's common name and a DNS name
        /// it may serve as).
        name: String,
        /// The cluster CA's directory.
        #[arg(long, default_value = "/etc/pagefleet/ca")]
        ca_dir: PathBuf,
        /// Where the identity goes (replaced if there).
        #[arg(long, default_value = "/etc/pagefleet/tls")]
        out: PathBuf,
        /// Addresses peers dial this host at (repeat; 127.0.0.1 and ::1 are
        /// always in). Clients check the address they dialled against these.
        #[arg(long)]
        ip: Vec<IpAddr>,
        /// More DNS names it serves as (repeat; its name and localhost are in).
        #[arg(long)]
        dns: Vec<String>,
        /// Years the certificate stays valid.
        #[arg(long, default_value_t = 5)]
        years: u16,
    },
}

/// Run a `pagefleet cert` command.
pub fn main(c: CertCmd) -> Result<()> {
    match c {
        CertCmd::Init { ca_dir } => {
            let p = certs::init_ca(&ca_dir).context("creating the cluster CA")?;
            println!("cluster CA written: {}", p.display());
            println!(
                "next: pagefleet cert issue HOST --ip ADDRESS --ca-dir {} --out DIR, once per host",
                ca_dir.display()
            );
        }
        CertCmd::Issue {
            name,
            ca_dir,
            out,
            ip,
            dns,
            years,
        } => {
            let req = IssueRequest {
                name: name.clone(),
                dns,
                ips: ip,
                years,
            };
            certs::issue(&ca_dir, &req, &out)
                .with_context(|| format!("issuing a certificate for {name}"))?;
            println!("identity {name:?} written to {}", out.display());
            println!(
                "use it: pagefleetd --tls-dir {0} (the host), pagefleet --tls-dir {0} (a CLI), \
                 QEMU -object tls-creds-x509,dir={0},endpoint=client",
                out.display()
            );
        }
    }
    Ok(())
}
