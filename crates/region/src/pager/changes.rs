//! Change tracking for migration: which pages changed content or location
//! since the owner last took the list.
//!
//! While tracking is on, every page the pager writes, installs, moves or
//! drops is marked once per round; `take` hands the round's pages over
//! sorted (each run is one write-protect call when the caller re-arms).

pub(super) struct Changes {
    on: bool,
    dirty: Vec<bool>,
    list: Vec<u32>,
}

impl Changes {
    pub fn new(pages: usize) -> Self {
        Changes {
            on: false,
            dirty: vec![false; pages],
            list: Vec::new(),
        }
    }

    pub fn on(&self) -> bool {
        self.on
    }

    /// Start or stop tracking; either way the round starts empty.
    pub fn set(&mut self, on: bool) {
        self.take();
        self.on = on;
    }

    /// Page `p` changed (ignored while tracking is off).
    pub fn mark(&mut self, p: usize) {
        if self.on && !self.dirty[p] {
            self.dirty[p] = true;
            self.list.push(p as u32);
        }
    }

    /// The pages marked since the last take, sorted; a new round begins.
    pub fn take(&mut self) -> Vec<u64> {
        let mut list: Vec<u64> = std::mem::take(&mut self.list)
            .into_iter()
            .map(u64::from)
            .collect();
        list.sort_unstable();
        for &p in &list {
            self.dirty[p as usize] = false;
        }
        list
    }
}

#[cfg(test)]
mod tests {
    use super::Changes;
    use proptest::prelude::*;

    proptest! {
        /// A round's list holds each page marked while on, once, sorted.
        #[test]
        fn a_round_is_each_marked_page_once(
            marks in prop::collection::vec((0usize..64, any::<bool>()), 0..200),
        ) {
            let mut c = Changes::new(64);
            let mut want = std::collections::BTreeSet::new();
            for (p, toggle) in marks {
                if toggle {
                    let round = c.take();
                    prop_assert_eq!(round, want.iter().map(|&p| p as u64).collect::<Vec<_>>());
                    want.clear();
                    let on = !c.on();
                    c.set(on);
                } else {
                    c.mark(p);
                    if c.on() {
                        want.insert(p);
                    }
                }
            }
            prop_assert_eq!(c.take(), want.into_iter().map(|p| p as u64).collect::<Vec<_>>());
        }
    }
}
