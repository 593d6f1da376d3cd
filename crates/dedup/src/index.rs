//! A host's content index: which page of which local source holds a given
//! content, for the pages this host could supply without the network.
//!
//! Entries are hints. A source's page may change after it was hashed (a
//! guest writes it): whoever fills a page from a hit reads the local page
//! and checks its hash again before trusting it, and a mismatch is a miss.
//! So the index may lag behind its sources, never lie to a guest.
//!
//! Memory is bounded: at most `max_pages` entries, and per source a dense
//! array of the hash each of its pages is indexed under (to remove the old
//! entry when a page is hashed again). [`IndexStats::bytes_per_page`] says
//! what an indexed page costs.

use crate::hash::{ContentKey, PageHash};
use std::collections::HashMap;

/// A content source of this host: a guest's memory, the memory server's
/// store. Chosen by whoever registers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceId(pub u32);

/// Where a content is on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    /// The source holding it.
    pub source: SourceId,
    /// The page of that source.
    pub page: u32,
}

/// What the index holds and how it is used.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct IndexStats {
    /// Distinct contents indexed (the zero page not counted).
    pub pages_indexed: u64,
    /// Registered sources.
    pub sources: u64,
    /// Pages the sources have (indexed or not).
    pub source_pages: u64,
    /// Lookups answered.
    pub lookups: u64,
    /// Lookups that found the content (zero page included).
    pub hits: u64,
    /// Pages not indexed because the index was full.
    pub full_skips: u64,
    /// Memory the index holds, bytes (tables and per-source arrays).
    pub bytes: u64,
}

impl IndexStats {
    /// Memory per indexed page (0 when empty).
    pub fn bytes_per_page(&self) -> f64 {
        if self.pages_indexed == 0 {
            0.0
        } else {
            self.bytes as f64 / self.pages_indexed as f64
        }
    }

    /// Share of lookups that hit.
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }
}

/// A Bloom filter over page hashes: 10 bits per content, 4 probes (about
/// 1% false positives; never a false negative). The hashes are keyed
/// BLAKE3, already uniform: the probes are taken from their bits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    words: Vec<u64>,
}

impl Filter {
    /// Probes per content.
    const K: u64 = 4;

    /// An empty filter sized for `n` contents.
    pub fn with_capacity(n: usize) -> Filter {
        let bits = (n.max(1024) * 10).next_power_of_two();
        Filter {
            words: vec![0; bits / 64],
        }
    }

    /// A filter from its words (as [`Filter::words`] gave them); None if
    /// their count is not a power of two.
    pub fn from_words(words: Vec<u64>) -> Option<Filter> {
        (words.len().is_power_of_two()).then_some(Filter { words })
    }

    /// Its words, to send.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    fn probes(&self, h: &PageHash) -> impl Iterator<Item = usize> {
        let a = u64::from_le_bytes(h.0[..8].try_into().unwrap());
        let b = u64::from_le_bytes(h.0[8..].try_into().unwrap()) | 1;
        let mask = (self.words.len() * 64 - 1) as u64;
        (0..Self::K).map(move |i| (a.wrapping_add(i.wrapping_mul(b)) & mask) as usize)
    }

    /// Add a content.
    pub fn insert(&mut self, h: &PageHash) {
        let ps: Vec<usize> = self.probes(h).collect();
        for p in ps {
            self.words[p / 64] |= 1 << (p % 64);
        }
    }

    /// Whether the content may be in the set (false: certainly not).
    pub fn may_contain(&self, h: &PageHash) -> bool {
        self.probes(h)
            .all(|p| self.words[p / 64] & (1 << (p % 64)) != 0)
    }
}

/// The index (one per host, owned by its daemon).
pub struct ContentIndex {
    key: ContentKey,
    zero: PageHash,
    max_pages: usize,
    map: HashMap<PageHash, Location>,
    /// Per source, per page: the hash it is indexed under.
    sources: HashMap<SourceId, Vec<Option<PageHash>>>,
    lookups: u64,
    hits: u64,
    full_skips: u64,
}

impl ContentIndex {
    /// An empty index hashing with `key`, holding at most `max_pages`
    /// contents.
    pub fn new(key: ContentKey, max_pages: usize) -> ContentIndex {
        ContentIndex {
            zero: key.zero(),
            key,
            max_pages,
            map: HashMap::new(),
            sources: HashMap::new(),
            lookups: 0,
            hits: 0,
            full_skips: 0,
        }
    }

    /// The key it hashes with.
    pub fn key(&self) -> &ContentKey {
        &self.key
    }

    /// Register a source of `pages` pages (again: it is resized, pages
    /// beyond the new size are forgotten).
    pub fn add_source(&mut self, id: SourceId, pages: u32) {
        let old = self.sources.remove(&id).unwrap_or_default();
        let mut v: Vec<Option<PageHash>> = vec![None; pages as usize];
        for (p, h) in old.into_iter().enumerate() {
            match (p < v.len(), h) {
                (true, h) => v[p] = h,
                (false, Some(h)) => self.unmap(
                    h,
                    Location {
                        source: id,
                        page: p as u32,
                    },
                ),
                (false, None) => {}
            }
        }
        self.sources.insert(id, v);
    }

    /// Forget a source and everything indexed from it.
    pub fn remove_source(&mut self, id: SourceId) {
        if let Some(v) = self.sources.remove(&id) {
            for (p, h) in v.into_iter().enumerate() {
                if let Some(h) = h {
                    self.unmap(
                        h,
                        Location {
                            source: id,
                            page: p as u32,
                        },
                    );
                }
            }
            // A guest left: give back the table's room beyond what is left
            // (hashbrown never shrinks on its own), so the index's memory
            // follows the guests here instead of their high-water mark.
            if self.map.capacity() > 2 * self.map.len() + 1024 {
                self.map.shrink_to(self.map.len() + self.map.len() / 4);
            }
        }
    }

    /// Remove the forward entry for `h` if it points at `at`.
    fn unmap(&mut self, h: PageHash, at: Location) {
        if self.map.get(&h) == Some(&at) {
            self.map.remove(&h);
        }
    }

    /// Page `page` of `source` holds content `hash` now. Returns false if
    /// the source or page is unknown, or the index is full.
    pub fn record(&mut self, source: SourceId, page: u32, hash: PageHash) -> bool {
        let at = Location { source, page };
        let Some(slot) = self
            .sources
            .get_mut(&source)
            .and_then(|v| v.get_mut(page as usize))
        else {
            return false;
        };
        let old = slot.replace(hash);
        if let Some(o) = old {
            if o == hash && self.map.get(&hash) == Some(&at) {
                return true;
            }
            if o != hash {
                self.unmap(o, at);
            }
        }
        // The zero page needs no entry: every host has it.
        if hash == self.zero {
            return true;
        }
        if self.map.len() >= self.max_pages && !self.map.contains_key(&hash) {
            self.full_skips += 1;
            if let Some(s) = self
                .sources
                .get_mut(&source)
                .and_then(|v| v.get_mut(page as usize))
            {
                *s = None;
            }
            return false;
        }
        // An equal content elsewhere stays the entry (either will do).
        self.map.entry(hash).or_insert(at);
        true
    }

    /// Hash `data` and record it for (`source`, `page`).
    pub fn record_page(
        &mut self,
        source: SourceId,
        page: u32,
        data: &[u8; crate::PAGE],
    ) -> PageHash {
        let h = self.key.hash(data);
        self.record(source, page, h);
        h
    }

    /// Page `page` of `source` no longer holds what it was indexed under
    /// (it was written, punched, freed).
    pub fn forget(&mut self, source: SourceId, page: u32) {
        let Some(h) = self
            .sources
            .get_mut(&source)
            .and_then(|v| v.get_mut(page as usize))
            .and_then(|s| s.take())
        else {
            return;
        };
        self.unmap(h, Location { source, page });
    }

    /// Where content `hash` is here: `Some(None)` for the zero page (no
    /// source needed), `Some(Some(loc))` for an indexed page, None if this
    /// host does not have it (as far as the index knows).
    pub fn lookup(&mut self, hash: &PageHash) -> Option<Option<Location>> {
        self.lookups += 1;
        let r = if *hash == self.zero {
            Some(None)
        } else {
            self.map.get(hash).map(|l| Some(*l))
        };
        self.hits += r.is_some() as u64;
        r
    }

    /// A Bloom filter of the contents indexed now (the zero page not
    /// included): a process that holds it asks only about contents that
    /// may be here.
    pub fn filter(&self) -> Filter {
        let mut f = Filter::with_capacity(self.map.len());
        for h in self.map.keys() {
            f.insert(h);
        }
        f
    }

    /// Counters and memory.
    pub fn stats(&self) -> IndexStats {
        let entry = std::mem::size_of::<(PageHash, Location)>() + 1; // + hashbrown's control byte
        let slot = std::mem::size_of::<Option<PageHash>>();
        let source_pages: usize = self.sources.values().map(|v| v.len()).sum();
        let bytes = self.map.capacity() * entry
            + self
                .sources
                .values()
                .map(|v| v.capacity() * slot)
                .sum::<usize>();
        IndexStats {
            pages_indexed: self.map.len() as u64,
            sources: self.sources.len() as u64,
            source_pages: source_pages as u64,
            lookups: self.lookups,
            hits: self.hits,
            full_skips: self.full_skips,
            bytes: bytes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PAGE;
    use pagefleet_proto::auth::Secret;

    fn index(max: usize) -> ContentIndex {
        let s = Secret::from_bytes(b"0123456789abcdef0123456789abcdef", "test").unwrap();
        ContentIndex::new(ContentKey::from_secret(&s), max)
    }

    fn page(v: u8) -> [u8; PAGE] {
        [v; PAGE]
    }

    /// A page whose content is `i` (distinct for every i).
    fn numbered(i: u32) -> [u8; PAGE] {
        let mut p = [1u8; PAGE];
        p[..4].copy_from_slice(&i.to_le_bytes());
        p
    }

    #[test]
    fn the_filter_never_misses_an_indexed_content_and_rarely_lies() {
        let mut ix = index(100_000);
        ix.add_source(SourceId(1), 20_000);
        let k = ix.key().clone();
        let hash_of = |i: u32| k.hash(&numbered(i));
        for i in 0..20_000u32 {
            ix.record(SourceId(1), i, hash_of(i));
        }
        let f = ix.filter();
        assert!((0..20_000).all(|i| f.may_contain(&hash_of(i))));
        let false_pos = (20_000..40_000)
            .filter(|&i| f.may_contain(&hash_of(i)))
            .count();
        assert!(false_pos < 600, "{false_pos} false positives of 20000");
        let g = Filter::from_words(f.words().to_vec()).unwrap();
        assert_eq!(f, g);
        assert!(Filter::from_words(vec![0; 3]).is_none());
    }

    #[test]
    fn the_index_gives_back_its_room_when_a_large_source_goes() {
        let mut ix = index(100_000);
        let (big, small) = (SourceId(1), SourceId(2));
        ix.add_source(big, 20_000);
        ix.add_source(small, 100);
        for i in 0..20_000u32 {
            ix.record_page(big, i, &numbered(i));
        }
        for i in 0..100u32 {
            ix.record_page(small, i, &numbered(100_000 + i));
        }
        let full = ix.stats().bytes;
        ix.remove_source(big);
        let after = ix.stats();
        assert_eq!(after.pages_indexed, 100);
        assert!(
            after.bytes * 10 < full,
            "{} of {full} bytes kept",
            after.bytes
        );
        let h = ix.record_page(small, 5, &numbered(100_005));
        assert_eq!(
            ix.lookup(&h),
            Some(Some(Location {
                source: small,
                page: 5
            }))
        );
    }

    #[test]
    fn a_recorded_page_is_found_and_a_rewritten_one_is_not() {
        let mut ix = index(100);
        let a = SourceId(1);
        ix.add_source(a, 8);
        let h3 = ix.record_page(a, 3, &page(3));
        assert_eq!(ix.lookup(&h3), Some(Some(Location { source: a, page: 3 })));
        // Page 3 is written: hashed again, the old content is gone.
        let h9 = ix.record_page(a, 3, &page(9));
        assert_eq!(ix.lookup(&h3), None);
        assert_eq!(ix.lookup(&h9), Some(Some(Location { source: a, page: 3 })));
        ix.forget(a, 3);
        assert_eq!(ix.lookup(&h9), None);
        let st = ix.stats();
        assert_eq!((st.lookups, st.hits, st.pages_indexed), (4, 2, 0));
    }

    #[test]
    fn the_zero_page_is_always_there_and_takes_no_entry() {
        let mut ix = index(1);
        ix.add_source(SourceId(1), 4);
        let z = ix.record_page(SourceId(1), 0, &page(0));
        assert_eq!(ix.lookup(&z), Some(None));
        assert_eq!(ix.stats().pages_indexed, 0);
    }

    #[test]
    fn an_equal_page_elsewhere_keeps_the_content_findable_after_a_source_goes() {
        let mut ix = index(100);
        let (a, b) = (SourceId(1), SourceId(2));
        ix.add_source(a, 4);
        ix.add_source(b, 4);
        let h = ix.record_page(a, 1, &page(5));
        ix.record_page(b, 2, &page(5));
        ix.remove_source(a);
        // The entry pointed at a; b's copy is indexed again on its next scan.
        assert_eq!(ix.lookup(&h), None);
        ix.record_page(b, 2, &page(5));
        assert_eq!(ix.lookup(&h), Some(Some(Location { source: b, page: 2 })));
    }

    #[test]
    fn a_full_index_refuses_new_contents_and_counts_them() {
        let mut ix = index(2);
        let a = SourceId(7);
        ix.add_source(a, 4);
        ix.record_page(a, 0, &page(1));
        ix.record_page(a, 1, &page(2));
        let h = ix.record_page(a, 2, &page(3));
        assert_eq!(ix.lookup(&h), None);
        let st = ix.stats();
        assert_eq!((st.pages_indexed, st.full_skips), (2, 1));
        assert!(st.bytes_per_page() > 0.0);
    }

    #[test]
    fn a_shrunk_source_forgets_its_pages_beyond_the_end() {
        let mut ix = index(100);
        let a = SourceId(1);
        ix.add_source(a, 8);
        let h = ix.record_page(a, 6, &page(6));
        ix.add_source(a, 4);
        assert_eq!(ix.lookup(&h), None);
        assert!(!ix.record(a, 6, h));
    }

    proptest::proptest! {
        /// After any sequence of records and forgets, every hit points at a
        /// page whose last recorded content is that hash.
        #[test]
        fn hits_always_point_at_the_last_recorded_content(
            ops in proptest::collection::vec((0u32..16, 0u8..6, proptest::bool::ANY), 1..200)
        ) {
            let mut ix = index(1000);
            let a = SourceId(1);
            ix.add_source(a, 16);
            let mut truth: HashMap<u32, u8> = HashMap::new();
            for (p, v, forget) in ops {
                if forget {
                    ix.forget(a, p);
                    truth.remove(&p);
                } else {
                    ix.record_page(a, p, &page(v + 1));
                    truth.insert(p, v + 1);
                }
            }
            for v in 1..=6u8 {
                let h = ix.key().hash(&page(v));
                if let Some(Some(loc)) = ix.lookup(&h) {
                    proptest::prop_assert_eq!(truth.get(&loc.page), Some(&v));
                }
            }
        }
    }
}
