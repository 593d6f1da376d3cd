//! A VM's own network identity: its NIC on the host's VM bridge, its MAC
//! and its address, and the settings line the guest reads at boot.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// An Ethernet address, written `52:54:00:12:34:56`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// The MAC a VM gets when its spec names none: QEMU's prefix
    /// (52:54:00, locally administered, unicast) and three bytes of a hash
    /// of the guest's name, so it is the same on every host the VM moves
    /// to (switches and clients keep their tables) and different for
    /// other names (two of 4 000 guests share one with odds of 1 in 2 000;
    /// give `mac=` to be sure).
    pub fn for_guest(name: &str) -> MacAddr {
        // FNV-1a, 32 bits: stable across builds and platforms.
        let h = name.bytes().fold(0x811c_9dc5u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        });
        let [_, a, b, c] = h.to_be_bytes();
        MacAddr([0x52, 0x54, 0x00, a, b, c])
    }

    /// A unicast address (bit 0 of the first byte clear), not all zeros:
    /// what a NIC may have.
    pub fn is_unicast(&self) -> bool {
        self.0[0] & 1 == 0 && self.0 != [0; 6]
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for MacAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<MacAddr, String> {
        let bad = || format!("MAC {s:?}: six hex bytes, 52:54:00:12:34:56");
        let mut m = [0u8; 6];
        let mut parts = s.split(':');
        for b in m.iter_mut() {
            let p = parts.next().filter(|p| p.len() == 2).ok_or_else(bad)?;
            *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(MacAddr(m))
    }
}

impl TryFrom<String> for MacAddr {
    type Error = String;
    fn try_from(s: String) -> Result<MacAddr, String> {
        s.parse()
    }
}

impl From<MacAddr> for String {
    fn from(m: MacAddr) -> String {
        m.to_string()
    }
}

/// An IPv4 address with its prefix length, written `10.200.77.50/24`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Ipv4Net {
    /// The address.
    pub addr: Ipv4Addr,
    /// Its prefix length, 1 to 32.
    pub prefix: u8,
}

impl Ipv4Net {
    /// Whether `a` is in this network.
    pub fn contains(&self, a: Ipv4Addr) -> bool {
        let mask = u32::MAX << (32 - u32::from(self.prefix));
        u32::from(a) & mask == u32::from(self.addr) & mask
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl fmt::Debug for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Ipv4Net {
    type Err = String;
    fn from_str(s: &str) -> Result<Ipv4Net, String> {
        let bad = || format!("address {s:?}: IPv4 with a prefix length, 10.200.77.50/24");
        let (a, p) = s.split_once('/').ok_or_else(bad)?;
        let addr: Ipv4Addr = a.parse().map_err(|_| bad())?;
        let prefix: u8 = p.parse().map_err(|_| bad())?;
        if !(1..=32).contains(&prefix) || addr.is_unspecified() || addr.is_multicast() {
            return Err(bad());
        }
        Ok(Ipv4Net { addr, prefix })
    }
}

impl TryFrom<String> for Ipv4Net {
    type Error = String;
    fn try_from(s: String) -> Result<Ipv4Net, String> {
        s.parse()
    }
}

impl From<Ipv4Net> for String {
    fn from(n: Ipv4Net) -> String {
        n.to_string()
    }
}

/// A VM's NIC on its host's VM bridge (`pagefleetd --vm-bridge`): a
/// virtio-net device on a tap the runner adds to that bridge. The guest
/// keeps its MAC and address wherever it runs; after a migration QEMU
/// announces the MAC from the new host, so switches (and, through the
/// guest's gratuitous ARP, clients) follow it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VmNic {
    /// Its MAC (None: [`MacAddr::for_guest`] of the guest's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<MacAddr>,
    /// The address the guest sets on it (None: the guest's own choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<Ipv4Net>,
    /// Its default gateway (must be inside `ip`'s network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<Ipv4Addr>,
}

impl VmNic {
    /// Parse `bridge[,mac=M][,ip=A/N][,gw=A]` (the CLI's `--nic`).
    pub fn parse_arg(s: &str) -> Result<VmNic, String> {
        let mut parts = s.split(',');
        if parts.next() != Some("bridge") {
            return Err(format!(
                "--nic {s:?}: bridge[,mac=52:54:00:..][,ip=A.B.C.D/N][,gw=A.B.C.D] (the NIC goes on the host's VM bridge)"
            ));
        }
        let mut n = VmNic::default();
        for p in parts {
            match p.split_once('=') {
                Some(("mac", m)) => n.mac = Some(m.parse()?),
                Some(("ip", a)) => n.ip = Some(a.parse()?),
                Some(("gw", g)) => {
                    n.gw = Some(
                        g.parse()
                            .map_err(|_| format!("gw {g:?}: an IPv4 address"))?,
                    )
                }
                _ => return Err(format!("--nic: {p:?}: mac=, ip= or gw=")),
            }
        }
        n.validate()?;
        Ok(n)
    }

    /// A unicast MAC; a gateway only with an address, and inside its network.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(m) = self.mac {
            if !m.is_unicast() {
                return Err(format!(
                    "mac {m}: a unicast address (first byte even), not zero"
                ));
            }
        }
        match (self.ip, self.gw) {
            (None, Some(g)) => Err(format!("gw {g} without ip")),
            (Some(n), Some(g)) if !n.contains(g) || g == n.addr => {
                Err(format!("gw {g}: another address inside {n}"))
            }
            _ => Ok(()),
        }
    }
}

/// Most bytes of a VM's settings line (`guest_config`).
pub const MAX_GUEST_CONFIG: usize = 1024;

/// Check a VM's settings line: `key=value` words of printable ASCII
/// (QEMU's firmware configuration hands it to the guest as one line).
pub fn check_guest_config(s: &str) -> Result<(), String> {
    if s.len() > MAX_GUEST_CONFIG {
        return Err(format!(
            "guest config: {} bytes, at most {MAX_GUEST_CONFIG}",
            s.len()
        ));
    }
    for w in s.split_ascii_whitespace() {
        let ok = w.split_once('=').is_some_and(|(k, _)| {
            !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        }) && w.bytes().all(|b| b.is_ascii_graphic());
        if !ok {
            return Err(format!(
                "guest config word {w:?}: key=value, the key letters, digits and '_', printable ASCII"
            ));
        }
    }
    if s.bytes().any(|b| !(b.is_ascii_graphic() || b == b' ')) {
        return Err("guest config: printable ASCII and spaces only".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_parse_print_and_derive_stably() {
        let m: MacAddr = "52:54:00:0a:bc:de".parse().unwrap();
        assert_eq!(m.to_string(), "52:54:00:0a:bc:de");
        assert!("52:54:00:0a:bc".parse::<MacAddr>().is_err());
        assert!("52:54:00:0a:bc:de:00".parse::<MacAddr>().is_err());
        assert!("52-54-00-0a-bc-de".parse::<MacAddr>().is_err());
        let a = MacAddr::for_guest("mc1");
        assert_eq!(a, MacAddr::for_guest("mc1"));
        assert_ne!(a, MacAddr::for_guest("mc2"));
        assert_eq!(&a.0[..3], &[0x52, 0x54, 0x00]);
        assert!(a.is_unicast());
        assert!(!"01:00:5e:00:00:01".parse::<MacAddr>().unwrap().is_unicast());
        let j = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<MacAddr>(&j).unwrap(), a);
    }

    #[test]
    fn nic_arguments_are_checked() {
        let n = VmNic::parse_arg("bridge,ip=10.200.77.50/24,gw=10.200.77.1").unwrap();
        assert_eq!(n.ip.unwrap().to_string(), "10.200.77.50/24");
        assert!(VmNic::parse_arg("bridge,gw=10.200.77.1").is_err());
        assert!(VmNic::parse_arg("bridge,ip=10.200.77.50/24,gw=10.9.0.1").is_err());
        assert!(VmNic::parse_arg("bridge,ip=10.200.77.50").is_err());
        assert!(VmNic::parse_arg("bridge,ip=10.200.77.50/33").is_err());
        assert!(VmNic::parse_arg("user").is_err());
        assert!(VmNic::parse_arg("bridge,mac=03:00:00:00:00:01").is_err());
        assert!(VmNic::parse_arg("bridge,script=/bin/sh").is_err());
        assert_eq!(VmNic::parse_arg("bridge").unwrap(), VmNic::default());
    }

    #[test]
    fn guest_config_is_key_value_words() {
        assert!(check_guest_config("memcached_mb=160 x=1").is_ok());
        assert!(check_guest_config("").is_ok());
        assert!(check_guest_config("novalue").is_err());
        assert!(check_guest_config("a=b\nc=d").is_err());
        assert!(check_guest_config("a=b\tc=d").is_err());
        assert!(check_guest_config("-x=1").is_err());
        assert!(check_guest_config(&"a=".repeat(600)).is_err());
    }
}
