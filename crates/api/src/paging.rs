//! The paging runtime's choices as one name list each: how victims are
//! chosen ([`Policy`]) and what a remote fault brings in besides its page
//! ([`Prefetch`]). The CLI's flags, the HTTP API's guest specs, the C ABI
//! and the benchmarks all parse and print them through these types, so a
//! new variant is named in one place.

use serde::{Deserialize, Serialize};

/// Declares a choice enum whose variants have one spelling each: the
/// spelling is its `Display`, `FromStr`, serde form and `--help` text.
macro_rules! choice {
    (
        $(#[$meta:meta])*
        $name:ident, $what:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $spelling:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every variant, in the order `--help` lists them.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// How flags, the API and reports spell it.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $spelling),+
                }
            }

            /// The accepted spellings, for error messages and `--help`.
            pub fn names() -> String {
                Self::ALL.iter().map(|v| v.name()).collect::<Vec<_>>().join(", ")
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|v| v.name() == s)
                    .ok_or_else(|| format!(concat!($what, " {:?}: use one of {}"), s, Self::names()))
            }
        }

        impl TryFrom<String> for $name {
            type Error = String;
            fn try_from(s: String) -> Result<Self, String> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.name().to_string()
            }
        }
    };
}

choice! {
    /// How victims are chosen when a region is over its budget. Each is a
    /// file under the runtime's `pager/victims/`.
    Policy, "victim policy" {
        /// One reference bit per page. The victim hand reads the page
        /// tables as it goes: a chunk it looks at gives up its pages not
        /// used since its last look, and the rest are unmapped again, so
        /// their next use shows. The default: the fewest page-ins per
        /// operation on the kv bench (`docs/paging.md`), paid for with more
        /// minor faults and TLB shootdowns than aging.
        #[default]
        Clock = "clock",
        /// Eight history bits per page shifted each sampling sweep, the
        /// newest highest; a chunk's hotness is its pages' highest age and
        /// the victim is the coldest whole chunk of a window. Reference bits
        /// come from the sampling hand alone, within its CPU budget.
        Aging = "aging",
        /// LRU-2 on the same history: the victim is the chunk whose second
        /// most recent use is oldest (a page a scan touched once goes
        /// before one used twice); a page used in the current period is
        /// not eligible (the correlated reference period), so a page just
        /// brought in does not evict itself.
        Lru2 = "lru2",
    }
}

choice! {
    /// What a remote fault brings in besides the faulting page.
    Prefetch, "prefetch" {
        /// A window that doubles while faults continue a sequential stream
        /// and is one page for random access (the default).
        #[default]
        Adaptive = "adaptive",
        /// The rest of the faulting page's chunk (on the same server).
        Chunk = "chunk",
    }
}

impl Policy {
    /// The C ABI's number for it (`pf_config.policy`: its index in [`Policy::ALL`]).
    pub fn from_index(i: u32) -> Option<Policy> {
        Self::ALL.get(i as usize).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_round_trips_through_text_and_json() {
        for p in Policy::ALL {
            assert_eq!(p.name().parse::<Policy>().unwrap(), *p);
            let j = serde_json::to_string(p).unwrap();
            assert_eq!(j, format!("\"{}\"", p.name()));
            assert_eq!(serde_json::from_str::<Policy>(&j).unwrap(), *p);
        }
        for p in Prefetch::ALL {
            assert_eq!(p.name().parse::<Prefetch>().unwrap(), *p);
            let j = serde_json::to_string(p).unwrap();
            assert_eq!(serde_json::from_str::<Prefetch>(&j).unwrap(), *p);
        }
    }

    #[test]
    fn an_unknown_spelling_is_refused_with_the_list() {
        let e = "lru; rm -rf /".parse::<Policy>().unwrap_err();
        assert!(e.contains("clock, aging"), "{e}");
        assert!(serde_json::from_str::<Prefetch>("\"all\"").is_err());
        assert!(serde_json::from_str::<Policy>("3").is_err());
    }

    #[test]
    fn the_c_abi_numbers_follow_the_list() {
        assert_eq!(Policy::from_index(0), Some(Policy::Clock));
        assert_eq!(Policy::from_index(1), Some(Policy::Aging));
        assert_eq!(Policy::from_index(2), Some(Policy::Lru2));
        assert_eq!(Policy::from_index(Policy::ALL.len() as u32), None);
        assert_eq!(Policy::default(), Policy::Clock);
        assert_eq!(Prefetch::default(), Prefetch::Adaptive);
    }
}
