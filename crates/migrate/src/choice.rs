//! Whether asking about pages pays, decided from what this migration
//! measures (docs/dedup.md "When hashing pays").
//!
//! Sharing-aware sending costs the source a read, a zero scan and a hash
//! per page, and the destination a lookup, a read and a check per page it
//! fills; it saves the link a page per hit. Which wins depends on the link
//! rate, the hashing rate and the hit rate, and on a shared machine on the
//! CPU the other side needs: on a 1 Gbit link a page's 33 µs of link time
//! dwarfs its few µs of hashing, on 10 Gbit (3.3 µs) it does not. Rather
//! than model each term, the source measures the one figure they add up
//! to: wall seconds per page in each mode, over windows of
//! [`WINDOW_PAGES`] pages:
//!
//! - the first window asks (the paper's behaviour; it also learns the hit
//!   rate), the second sends every page as data (`sendfile`, no read, no
//!   hash): the *explore*;
//! - from then on the cheaper mode runs; asking must be at least
//!   [`HASH_MARGIN`] cheaper to be chosen (a tie sends: it costs no CPU on
//!   either end);
//! - every so often the other mode gets one window again (the guest's
//!   content, the link's load and the destination's index change as a
//!   migration runs): after [`FIRST_RECHECK`] windows, doubling while the
//!   choice holds, up to [`MAX_RECHECK`];
//! - a large win is not explored as often: when one mode measured at least
//!   [`CLEAR_WIN`] times cheaper, the other is tried only after
//!   [`CLEAR_RECHECK`] windows (an explore of sending on a slow link costs
//!   a window of pages the destination held);
//! - the chosen mode is measured every window: when its figure no longer
//!   beats the other's last, the other gets the next window.
//!
//! The part owns its state and takes its clock readings from the caller
//! ([`Choice::record`]), so its decisions are tested without a link.

/// Pages in a measuring window (8 MiB), timed launch to launch while a
/// mode goes on.
pub const WINDOW_PAGES: u64 = 2048;
/// Pages in the first window of each mode (2 MiB): the first figures come
/// early, and a first window of the losing mode costs little. The caller
/// times a window that may end in a switch from an empty send queue to an
/// empty one ([`Choice::exploring`]), so the socket's buffer (a few MiB)
/// does not decide the figure.
pub const FIRST_WINDOW_PAGES: u64 = 512;
/// Asking is chosen only when it measured this much cheaper per page.
pub const HASH_MARGIN: f64 = 0.97;
/// Windows in the chosen mode before the other is measured again.
pub const FIRST_RECHECK: u32 = 4;
/// At most this many windows between measurements of the other mode.
pub const MAX_RECHECK: u32 = 32;
/// A mode this many times cheaper than the other is re-checked only after
/// [`CLEAR_RECHECK`] windows.
pub const CLEAR_WIN: f64 = 1.5;
/// Windows between measurements of the other mode after a clear win
/// (1 GiB: an explore of sending on a 1 Gbit link costs 8 MiB of pages the
/// destination held, 0.8% of the bytes at most). Safe to be long: the
/// chosen mode is measured every window, and its figure turning worse than
/// the other's last brings the other's window at once.
pub const CLEAR_RECHECK: u32 = 128;

/// How a batch of pages goes to the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Hashes first; data only for what the destination lacks.
    Ask,
    /// Every page as data.
    Send,
}

/// The decision and what it was made from.
#[derive(Clone, Debug)]
pub struct Choice {
    mode: Mode,
    /// The mode the measurements favour (what runs outside an explore).
    chosen: Mode,
    /// Wall seconds per page last measured in each mode ([Ask, Send]).
    cost: [Option<f64>; 2],
    /// Windows run in the chosen mode since the other was measured.
    since: u32,
    /// Windows in the chosen mode before the next measurement of the other.
    recheck: u32,
    /// Pages in windows of each mode ([Ask, Send]).
    pub pages: [u64; 2],
    /// Pages of the last window measured in each mode.
    last_pages: [Option<u64>; 2],
    /// Ask whatever the measurements say (`--dedup-always`).
    fixed: bool,
}

impl Default for Choice {
    fn default() -> Self {
        Choice::new()
    }
}

fn ix(m: Mode) -> usize {
    match m {
        Mode::Ask => 0,
        Mode::Send => 1,
    }
}

fn other(m: Mode) -> Mode {
    match m {
        Mode::Ask => Mode::Send,
        Mode::Send => Mode::Ask,
    }
}

impl Choice {
    /// A migration's first window asks.
    pub fn new() -> Choice {
        Choice {
            mode: Mode::Ask,
            chosen: Mode::Ask,
            cost: [None, None],
            since: 0,
            recheck: FIRST_RECHECK,
            pages: [0, 0],
            last_pages: [None, None],
            fixed: false,
        }
    }

    /// Ask about every page whatever the measurements say (they are still
    /// taken and reported).
    pub fn always_ask() -> Choice {
        Choice {
            fixed: true,
            ..Choice::new()
        }
    }

    /// The mode of the current window.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Pages the current window should span.
    pub fn window_pages(&self) -> u64 {
        if self.cost.iter().any(Option::is_none) {
            FIRST_WINDOW_PAGES
        } else {
            WINDOW_PAGES
        }
    }

    /// The current window measures a mode that is not the chosen one (or
    /// the first figures): it is likely the last of its mode, so it is
    /// timed until what it wrote has left.
    pub fn exploring(&self) -> bool {
        self.cost.iter().any(Option::is_none) || self.mode != self.chosen
    }

    /// Wall microseconds per page last measured asking and sending.
    pub fn costs_us(&self) -> (Option<f64>, Option<f64>) {
        let us = |c: Option<f64>| c.map(|s| s * 1e6);
        (us(self.cost[0]), us(self.cost[1]))
    }

    /// The last window of `mode` took `secs` more than recorded: what it
    /// left in flight, settled after it was recorded (before the other
    /// mode's first window). Counts in the next decision.
    pub fn amend(&mut self, mode: Mode, secs: f64) {
        if let (Some(c), Some(p)) = (self.cost[ix(mode)].as_mut(), self.last_pages[ix(mode)]) {
            *c += secs / p as f64;
        }
    }

    /// A window of `pages` pages in the current mode took `secs` of wall
    /// time (the caller closes a window at [`Choice::window_pages`], or
    /// earlier at the end of a round; a window of under half of
    /// [`FIRST_WINDOW_PAGES`] is not a measurement, its pages only
    /// counted). Returns the next window's mode.
    pub fn record(&mut self, pages: u64, secs: f64) -> Mode {
        let m = self.mode;
        self.pages[ix(m)] += pages;
        if pages < FIRST_WINDOW_PAGES / 2 || !secs.is_finite() || secs <= 0.0 {
            return self.mode;
        }
        self.cost[ix(m)] = Some(secs / pages as f64);
        self.last_pages[ix(m)] = Some(pages);
        if self.fixed {
            return self.mode;
        }
        let (Some(ask), Some(send)) = (self.cost[0], self.cost[1]) else {
            // The first measurement of one mode: measure the other next.
            self.mode = other(m);
            return self.mode;
        };
        let best = if ask < send * HASH_MARGIN {
            Mode::Ask
        } else {
            Mode::Send
        };
        if m != self.chosen || self.since >= self.recheck {
            // A fresh pair of figures: decide.
            let (win, lose) = match best {
                Mode::Ask => (ask, send),
                Mode::Send => (send, ask),
            };
            self.recheck = if lose >= win * CLEAR_WIN {
                CLEAR_RECHECK
            } else if best == self.chosen {
                (self.recheck * 2).min(MAX_RECHECK)
            } else {
                FIRST_RECHECK
            };
            self.chosen = best;
            self.since = 0;
            self.mode = best;
            return self.mode;
        }
        self.since += 1;
        self.mode = if self.since >= self.recheck || best != self.chosen {
            // Measure the other mode for one window: it is time, or the
            // chosen mode's fresh figure no longer beats the other's last.
            other(self.chosen)
        } else {
            self.chosen
        };
        self.mode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = WINDOW_PAGES;

    /// Run `n` windows with the given costs (seconds per page per mode);
    /// the modes run, in order.
    fn drive(c: &mut Choice, n: usize, ask: f64, send: f64) -> Vec<Mode> {
        (0..n)
            .map(|_| {
                let m = c.mode();
                let per = if m == Mode::Ask { ask } else { send };
                c.record(W, per * W as f64);
                m
            })
            .collect()
    }

    #[test]
    fn it_asks_first_then_measures_sending_and_keeps_the_cheaper() {
        let mut c = Choice::new();
        assert_eq!(c.window_pages(), FIRST_WINDOW_PAGES);
        assert!(c.exploring());
        // A fast link: sending every page is cheaper.
        let modes = drive(&mut c, 6, 5e-6, 3e-6);
        assert_eq!(modes[0], Mode::Ask);
        assert_eq!(modes[1], Mode::Send);
        assert!(modes[2..].iter().all(|m| *m == Mode::Send), "{modes:?}");
        assert_eq!(c.window_pages(), WINDOW_PAGES);
        assert!(!c.exploring());
        assert_eq!(c.costs_us().0.map(|u| u.round()), Some(5.0));
    }

    #[test]
    fn a_slow_link_keeps_asking_and_rarely_explores() {
        let mut c = Choice::new();
        // 1 Gbit, 80% held: asking costs a fifth of sending.
        let modes = drive(&mut c, 64, 7e-6, 33e-6);
        let sends = modes.iter().filter(|m| **m == Mode::Send).count();
        // The first explore only (a clear win: CLEAR_RECHECK windows).
        assert!(sends == 1, "{sends} sends: {modes:?}");
        assert_eq!(modes[2], Mode::Ask);
    }

    #[test]
    fn a_tie_sends() {
        let mut c = Choice::new();
        let modes = drive(&mut c, 4, 3.0e-6, 3.05e-6);
        assert_eq!(modes[2..], [Mode::Send, Mode::Send]);
    }

    #[test]
    fn a_change_in_the_guest_is_found_at_the_next_recheck() {
        let mut c = Choice::new();
        // Little is held: sending wins by a little.
        drive(&mut c, 2 + FIRST_RECHECK as usize, 4e-6, 3.5e-6);
        assert_eq!(c.mode(), Mode::Ask, "rechecks asking after a few windows");
        // Now most is held: asking measures cheaper and is chosen.
        let modes = drive(&mut c, 3, 1e-6, 3.5e-6);
        assert_eq!(modes[0], Mode::Ask);
        assert!(modes[1..].iter().all(|m| *m == Mode::Ask), "{modes:?}");
    }

    #[test]
    fn rechecks_back_off_while_the_choice_holds() {
        let mut c = Choice::new();
        let modes = drive(&mut c, 80, 4e-6, 3e-6);
        let asks: Vec<usize> = modes
            .iter()
            .enumerate()
            .filter(|(_, m)| **m == Mode::Ask)
            .map(|(i, _)| i)
            .collect();
        let gaps: Vec<usize> = asks.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] >= g[0]), "gaps grow: {gaps:?}");
        assert!(
            gaps.iter().all(|g| *g <= MAX_RECHECK as usize + 1),
            "{gaps:?}"
        );
    }

    #[test]
    fn answers_settled_after_a_window_count_against_asking() {
        let mut c = Choice::new();
        c.record(W, 3e-6 * W as f64);
        // The switch to sending settles what was in flight: 2 µs a page more.
        c.amend(Mode::Ask, 2e-6 * W as f64);
        assert_eq!(c.costs_us().0.map(|u| u.round()), Some(5.0));
        // Sending at 4 µs now wins where asking's 3 µs seemed to.
        assert_eq!(c.record(W, 4e-6 * W as f64), Mode::Send);
    }

    #[test]
    fn asking_that_turns_slower_tries_sending_at_once() {
        let mut c = Choice::new();
        // A clear win for asking: the next recheck is far away.
        drive(&mut c, 4, 5e-6, 30e-6);
        assert_eq!(c.mode(), Mode::Ask);
        // The guest's shared content is behind it: asking now costs more
        // than sending did; sending gets the next window, and keeps it.
        let modes = drive(&mut c, 3, 40e-6, 30e-6);
        assert_eq!(modes, [Mode::Ask, Mode::Send, Mode::Send]);
    }

    #[test]
    fn always_ask_never_sends() {
        let mut c = Choice::always_ask();
        assert!(drive(&mut c, 8, 9e-6, 1e-6).iter().all(|m| *m == Mode::Ask));
        assert!(c.costs_us().0.is_some());
    }

    #[test]
    fn short_windows_count_pages_but_decide_nothing() {
        let mut c = Choice::new();
        assert_eq!(c.record(FIRST_WINDOW_PAGES / 4, 1.0), Mode::Ask);
        assert_eq!(c.pages, [FIRST_WINDOW_PAGES / 4, 0]);
        assert_eq!(c.costs_us(), (None, None), "no figure taken");
        assert_eq!(c.record(W, 0.0), Mode::Ask, "a zero-length clock reading");
    }
}
