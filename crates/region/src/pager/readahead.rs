//! Adaptive read-ahead: how many pages a remote fault brings in.
//!
//! Up to [`STREAMS`] sequential streams are followed. A fault at or just past
//! where a stream's last window ended doubles its window, up to
//! [`MAX_READAHEAD`] pages; any other fault starts a new stream (replacing
//! the oldest) with a window of one page: Linux readahead's window growth,
//! Leap's trend detection. Random access (kv) thus moves one page per fault,
//! a scan up to 1 MiB per round trip, and a few scans interleaved by threads
//! each keep their own stream.

/// Largest window, pages (1 MiB).
pub(super) const MAX_READAHEAD: usize = 256;
/// Streams followed at once.
pub(super) const STREAMS: usize = 8;

#[derive(Clone, Copy, Default, Debug)]
struct Stream {
    /// First page after the last window brought in.
    next: usize,
    /// Its window, pages (0: unused slot).
    window: usize,
}

/// The streams being followed.
#[derive(Default, Debug)]
pub(super) struct Readahead {
    streams: [Stream; STREAMS],
    oldest: usize,
}

impl Readahead {
    /// The window for a fault at page `p`: pages from `p` on to bring in
    /// (at least 1, `p` itself).
    pub(super) fn window(&mut self, p: usize) -> usize {
        if let Some(st) = self
            .streams
            .iter_mut()
            .find(|st| st.window > 0 && p >= st.next && p <= st.next + st.window)
        {
            st.window = (st.window * 2).min(MAX_READAHEAD);
            st.next = p + st.window;
            return st.window;
        }
        self.streams[self.oldest] = Stream {
            next: p + 1,
            window: 1,
        };
        self.oldest = (self.oldest + 1) % STREAMS;
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulate a scanner over `pages` from `start`: it faults on the first
    /// page not brought in yet. Returns the windows it got.
    fn scan(r: &mut Readahead, start: usize, pages: usize) -> Vec<usize> {
        let mut p = start;
        let mut w = Vec::new();
        while p < start + pages {
            let n = r.window(p);
            w.push(n);
            p += n;
        }
        w
    }

    #[test]
    fn a_scan_doubles_its_window_up_to_the_cap() {
        let mut r = Readahead::default();
        let w = scan(&mut r, 1000, 4096);
        assert_eq!(&w[..9], &[1, 2, 4, 8, 16, 32, 64, 128, 256]);
        assert!(w[9..].iter().all(|x| *x == MAX_READAHEAD), "{w:?}");
    }

    #[test]
    fn random_faults_move_one_page_each() {
        let mut r = Readahead::default();
        let mut x = 12345u64;
        for _ in 0..10_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let p = ((x >> 33) % 1_000_000) as usize;
            let w = r.window(p);
            assert!(w <= 2, "random fault at {p} got a window of {w}");
        }
    }

    #[test]
    fn interleaved_scans_keep_their_own_streams() {
        let mut r = Readahead::default();
        let (mut a, mut b) = (0usize, 500_000usize);
        let (mut wa, mut wb) = (0, 0);
        for _ in 0..12 {
            wa = r.window(a);
            a += wa;
            wb = r.window(b);
            b += wb;
        }
        assert_eq!((wa, wb), (MAX_READAHEAD, MAX_READAHEAD));
    }

    #[test]
    fn a_skip_within_the_window_still_counts_as_sequential() {
        let mut r = Readahead::default();
        assert_eq!(r.window(10), 1);
        assert_eq!(r.window(11), 2);
        // The scanner skipped a page it did not need (it was local already).
        assert_eq!(r.window(14), 4);
        // A jump far ahead starts over.
        assert_eq!(r.window(10_000), 1);
    }
}
