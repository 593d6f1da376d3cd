//! Adaptive read-ahead: how many pages a remote fault brings in.
//!
//! Up to [`STREAMS`] sequential streams are followed. A fault at or just past
//! where a stream's last window ended doubles its window, up to a cap (at
//! most [`MAX_READAHEAD`] pages, and a 16th of the budget so a window never
//! pushes out much of what is resident); any other fault starts a new stream
//! (replacing the oldest) with a window of one page: Linux readahead's window
//! growth, Leap's trend detection. Random access (kv) thus moves one page per
//! fault, a scan up to 4 MiB per round trip (1 MiB windows gave 1.43 GB/s, 4
//! MiB 1.82 GB/s on the paging bench's scan), and a few scans interleaved by
//! threads each keep their own stream.

/// Largest window, pages (4 MiB).
pub(super) const MAX_READAHEAD: usize = 1024;
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
    /// (at least 1, `p` itself), at most `cap`.
    pub(super) fn window(&mut self, p: usize, cap: usize) -> usize {
        let cap = cap.clamp(1, MAX_READAHEAD);
        if let Some(st) = self
            .streams
            .iter_mut()
            .find(|st| st.window > 0 && p >= st.next && p <= st.next + st.window)
        {
            st.window = (st.window * 2).min(cap);
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
            let n = r.window(p, MAX_READAHEAD);
            w.push(n);
            p += n;
        }
        w
    }

    #[test]
    fn a_scan_doubles_its_window_up_to_the_cap() {
        let mut r = Readahead::default();
        let w = scan(&mut r, 1000, 16384);
        assert_eq!(&w[..11], &[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]);
        assert!(w[11..].iter().all(|x| *x == MAX_READAHEAD), "{w:?}");
        // A small budget caps the window.
        let mut r = Readahead::default();
        let w: Vec<usize> = (0..20)
            .scan(5000usize, |p, _| {
                let n = r.window(*p, 64);
                *p += n;
                Some(n)
            })
            .collect();
        assert_eq!(*w.iter().max().unwrap(), 64, "{w:?}");
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
            let w = r.window(p, MAX_READAHEAD);
            assert!(w <= 2, "random fault at {p} got a window of {w}");
        }
    }

    #[test]
    fn interleaved_scans_keep_their_own_streams() {
        let mut r = Readahead::default();
        let (mut a, mut b) = (0usize, 500_000usize);
        let (mut wa, mut wb) = (0, 0);
        for _ in 0..14 {
            wa = r.window(a, MAX_READAHEAD);
            a += wa;
            wb = r.window(b, MAX_READAHEAD);
            b += wb;
        }
        assert_eq!((wa, wb), (MAX_READAHEAD, MAX_READAHEAD));
    }

    #[test]
    fn a_skip_within_the_window_still_counts_as_sequential() {
        let mut r = Readahead::default();
        assert_eq!(r.window(10, MAX_READAHEAD), 1);
        assert_eq!(r.window(11, MAX_READAHEAD), 2);
        // The scanner skipped a page it did not need (it was local already).
        assert_eq!(r.window(14, MAX_READAHEAD), 4);
        // A jump far ahead starts over.
        assert_eq!(r.window(10_000, MAX_READAHEAD), 1);
    }
}
