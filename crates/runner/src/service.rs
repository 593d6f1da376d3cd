//! The service address that moves with a guest: a secondary IPv4 address
//! on a device, added over rtnetlink (no `ip` process: this runs inside a
//! migration's downtime) and announced with a gratuitous ARP.

use crate::sys;
use tracing::warn;

/// Why the service address could not be moved.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The address is not IPv4.
    #[error("service address {0:?} is not IPv4")]
    NotIpv4(String),
    /// No such network device.
    #[error("no network device {0:?}")]
    NoDevice(String),
    /// A socket call failed.
    #[error("{0}: {1}")]
    Os(&'static str, std::io::Error),
}

impl From<sys::NetError> for ServiceError {
    fn from(e: sys::NetError) -> Self {
        match e {
            sys::NetError::NotIpv4(a) => ServiceError::NotIpv4(a),
            sys::NetError::NoDevice(d) => ServiceError::NoDevice(d),
            sys::NetError::Os(what, e) => ServiceError::Os(what, e),
        }
    }
}

/// The service address that moves with the guest (secondary IP on a device).
#[derive(Clone, Debug)]
pub struct Service {
    /// The address.
    pub ip: String,
    /// The device it goes on.
    pub dev: String,
}

impl Service {
    /// Add the address here and tell the neighbours.
    pub fn claim(&self) -> Result<(), ServiceError> {
        sys::addr_change(&self.dev, &self.ip, true)?;
        // Tell the neighbours (gratuitous ARP) so clients need not wait for
        // their caches to time out; off the critical path of a migration.
        let (dev, ip) = (self.dev.clone(), self.ip.clone());
        std::thread::spawn(move || {
            if let Err(e) = sys::gratuitous_arp(&dev, &ip) {
                warn!(
                    "gratuitous ARP for {ip} on {dev}: {}",
                    ServiceError::from(e)
                );
            }
        });
        Ok(())
    }

    /// Remove the address here (the destination takes it over).
    pub fn release(&self) {
        if let Err(e) = sys::addr_change(&self.dev, &self.ip, false) {
            warn!(
                "removing service address {}: {}",
                self.ip,
                ServiceError::from(e)
            );
        }
    }
}
