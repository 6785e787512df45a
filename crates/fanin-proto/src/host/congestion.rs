//! Congestion control of a worker's value stream (docs/congestion.md), as a
//! sans-IO machine: the allreduce session feeds it what it learns (a block
//! answered, a trim, a loss found by fast retransmit, a stall timeout) and
//! asks it how many blocks may be outstanding. The daemon-free simulator
//! and the host library run this same code.
//!
//! It is TCP's window algorithm (slow start, AIMD) in units of blocks, with
//! the signals in-network aggregation has:
//!
//! * **Trim** (NDP return-to-sender, `003_aa87202d16818bae.txt`): the switch
//!   returned the contribution's header instead of dropping it. An explicit,
//!   immediate congestion signal: the window is multiplied by
//!   [`TRIM_BETA`].
//! * **Marked** result (`AGE_OP_CONGESTED`): the switch saw a member's
//!   retransmission fill a hole in the block while the other members'
//!   contributions had arrived, i.e. a contribution was lost on its way (a
//!   queue on that member's path overflowed), or a queue marked one of the
//!   block's contributions ECN CE, or a member echoed a CE mark it saw on a
//!   result (docs/congestion.md, "ECN"). Every member gets the same
//!   mark in the same result, so every member cuts at the same point of the
//!   result stream and the windows stay equal: aggregation is lockstep, the
//!   job runs at its slowest member's pace, and a member whose window alone
//!   was cut would become that member. The window is multiplied by
//!   [`LOSS_BETA`] (CUBIC's 0.7), at most once per window of answers
//!   (counted in answers, not time, so every member gates alike).
//! * **Loss** found by fast retransmit (results of [`super::DUP_THRESH`]
//!   later blocks of the same shard arrived first): counted, not acted on.
//!   This member cannot tell its own loss from a peer's, which delays the
//!   block for everyone; the switch can, and marks the result (above).
//!   Cutting on it made the members' windows drift apart (measured:
//!   `[256, 256, 116, 256]` at 200 Mbit/s, 3-6 % of capacity lost).
//! * **Timeout** (nothing answered for an RTO): counted, not acted on. In a
//!   job a stall is most often a peer that has not started its allreduce
//!   yet, and collapsing the window then would throttle the next step of
//!   every member behind one straggler; real loss is found by fast
//!   retransmit one round trip after it happens.
//!
//! One decrease per round trip at most, so a burst of signals from one
//! overflow counts once (as TCP's recovery). Growth: slow start (one block
//! per answered block) up to `ssthresh`, then one block per window of
//! answers; never above the window the job and the caller allow, never
//! below [`MIN_WINDOW`]. The window outlives an allreduce: the next step of
//! a training job starts at what this one learnt.

use std::time::Duration;

use crate::time::Time;

/// Window multiplier on a trim.
pub const TRIM_BETA: f64 = 0.5;
/// Window multiplier on a result the switch marked congested.
pub const LOSS_BETA: f64 = 0.7;
/// The smallest window per switch shard (at most half the job's slots).
/// Fast retransmit needs DUP_THRESH later results *of the same shard* after
/// a loss; with a floor of 4 blocks a 5 %-loss test took two minutes on the
/// stall timer. And in a three-level aggregation tree under 1 % loss per
/// link (128 workers, `fanin sim allreduce --loss 0.01`), where nearly every
/// block loses a packet somewhere, windows of 16 blocks crawled: once the
/// window is blocked behind a lost block no later results flow, so every
/// repair waits for a stall timeout, one block per timeout, past 60 s of
/// simulated time; with 64 the job finishes in 0.83 ms (docs/congestion.md).
pub const MIN_WINDOW: u32 = 64;
/// The window a session starts with before anything was learnt about the
/// path: the floor (slow start takes it from there).
pub const INITIAL_WINDOW: u32 = MIN_WINDOW;

/// One answer's growth of a window (TCP's, in whatever units the window
/// counts): one unit per answer below `ssthresh` (slow start), then one per
/// window of answers (`credit` counts them), never above `max`. The value
/// streams' controller and the key-value senders' share it.
pub(crate) fn grow_window(cwnd: &mut u32, credit: &mut u32, ssthresh: u32, max: u32) {
    if *cwnd >= max {
        return;
    }
    if *cwnd < ssthresh {
        *cwnd += 1;
        return;
    }
    *credit += 1;
    if *credit >= *cwnd {
        *cwnd += 1;
        *credit = 0;
    }
}

/// What the session learnt that bears on congestion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// The switch trimmed a contribution (overload at the switch).
    Trim,
    /// The switch marked a result: a contribution to it had been lost.
    Marked,
    /// Fast retransmit found a transmission or its result lost.
    Loss,
    /// The stall timer fired (nothing answered for an RTO).
    Timeout,
}

/// Counts of what the controller saw, for statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CongestionStats {
    pub trims: u64,
    pub marks: u64,
    /// Blocks fast retransmit found lost (this member's or a peer's).
    pub losses: u64,
    pub timeouts: u64,
    /// Times the window was cut (at most one per round trip).
    pub decreases: u64,
    /// Times the memory window was cut (the switch short of memory).
    pub memory_decreases: u64,
}

#[derive(Debug, Clone)]
pub struct Congestion {
    cwnd: u32,
    ssthresh: u32,
    max: u32,
    /// Answers since the window last grew in congestion avoidance.
    credit: u32,
    last_decrease: Option<Time>,
    /// Answers since the last cut on a mark, and the window then: marks
    /// within one window of answers are one episode.
    answers_since_mark: u32,
    window_at_mark: u32,
    /// MIN_WINDOW per shard, at most `max`.
    floor: u32,
    /// The memory window: blocks the switch's pooled memory can take from
    /// this worker now (docs/memory.md). A refusal for memory halves it,
    /// down to one block, once per round trip; it grows back by one block
    /// per window of answers. Kept apart from `cwnd` because its floor is
    /// not the network's: memory shared by many jobs may fit only a few
    /// blocks of each, and a window of 16 sending into it is refused over
    /// and over (16 jobs on 1 MiB: 4.2 million refusals, 0.36x goodput).
    mem: u32,
    mem_credit: u32,
    last_mem_decrease: Option<Time>,
    stats: CongestionStats,
}

impl Congestion {
    /// A controller whose window starts at `initial` (clamped into
    /// `[MIN_WINDOW, max]`) and never exceeds `max`.
    pub fn new(initial: u32, max: u32) -> Self {
        let max = max.max(1);
        let floor = floor_of(MIN_WINDOW, max);
        Self {
            cwnd: initial.clamp(floor, max),
            ssthresh: max,
            max,
            credit: 0,
            last_decrease: None,
            answers_since_mark: 0,
            window_at_mark: 0,
            mem: u32::MAX,
            mem_credit: 0,
            last_mem_decrease: None,
            floor,
            stats: CongestionStats::default(),
        }
    }

    /// Blocks that may be outstanding now.
    pub fn window(&self) -> u32 {
        self.cwnd.min(self.mem)
    }

    /// The switch refused a block for want of pooled memory: halve the
    /// memory window (at least one block), once per `round_trip`.
    pub fn on_memory_short(&mut self, now: Time, round_trip: Duration) {
        if self.last_mem_decrease.is_some_and(|t| now.saturating_since(t) < round_trip) {
            return;
        }
        self.mem = (self.window() / 2).max(1);
        self.mem_credit = 0;
        self.last_mem_decrease = Some(now);
        self.stats.memory_decreases += 1;
    }

    pub fn max(&self) -> u32 {
        self.max
    }

    /// Below this the window grows by one block per answer (slow start).
    pub fn ssthresh(&self) -> u32 {
        self.ssthresh
    }

    pub fn stats(&self) -> CongestionStats {
        self.stats
    }

    /// The job's limits, learnt at join: at most `max` blocks outstanding
    /// (the job's `block_cnt_max` and the caller's window), spread over
    /// `shards` switch shards (the floor is [`MIN_WINDOW`] per shard).
    pub fn set_limits(&mut self, max: u32, shards: u16) {
        self.max = max.max(1);
        self.floor = floor_of(MIN_WINDOW * shards.max(1) as u32, self.max);
        self.cwnd = self.cwnd.clamp(self.floor, self.max);
        self.ssthresh = self.ssthresh.clamp(self.floor, self.max);
    }

    /// One block was answered (its result came).
    pub fn on_answer(&mut self) {
        self.answers_since_mark = self.answers_since_mark.saturating_add(1);
        if self.mem < self.max {
            self.mem_credit += 1;
            if self.mem_credit >= self.mem {
                self.mem += 1;
                self.mem_credit = 0;
            }
        }
        grow_window(&mut self.cwnd, &mut self.credit, self.ssthresh, self.max);
    }

    /// A congestion signal at `now`; `round_trip` is the smoothed RTT (a
    /// second decrease within it is the same congestion episode).
    pub fn on_signal(&mut self, now: Time, round_trip: Duration, signal: Signal) {
        let beta = match signal {
            Signal::Trim => {
                self.stats.trims += 1;
                TRIM_BETA
            }
            Signal::Marked => {
                self.stats.marks += 1;
                if self.answers_since_mark < self.window_at_mark {
                    return; // the same episode
                }
                LOSS_BETA
            }
            Signal::Loss => {
                self.stats.losses += 1;
                return;
            }
            Signal::Timeout => {
                self.stats.timeouts += 1;
                return;
            }
        };
        if signal == Signal::Trim && self.last_decrease.is_some_and(|t| now.saturating_since(t) < round_trip) {
            return;
        }
        self.cwnd = ((self.cwnd as f64 * beta) as u32).max(self.floor);
        self.ssthresh = self.cwnd;
        self.credit = 0;
        self.last_decrease = Some(now);
        if signal == Signal::Marked {
            self.answers_since_mark = 0;
            self.window_at_mark = self.cwnd;
        }
        self.stats.decreases += 1;
    }
}

/// The floor for a window of at most `max` blocks: `want`, but at most half
/// of `max`, so a small job's window still backs off.
fn floor_of(want: u32, max: u32) -> u32 {
    want.min(max / 2).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Time {
        Time::from_nanos(ms * 1_000_000)
    }

    const RTT: Duration = Duration::from_millis(10);

    #[test]
    fn slow_start_doubles_per_window_of_answers_up_to_the_limit() {
        let mut cc = Congestion::new(INITIAL_WINDOW, 1024);
        assert_eq!(cc.window(), 64);
        for _ in 0..64 {
            cc.on_answer();
        }
        assert_eq!(cc.window(), 128, "one window of answers doubles it");
        for _ in 0..5000 {
            cc.on_answer();
        }
        assert_eq!(cc.window(), 1024, "never above the job's slots");
    }

    #[test]
    fn a_trim_halves_the_window_once_per_round_trip() {
        let mut cc = Congestion::new(400, 1024);
        cc.on_signal(at(0), RTT, Signal::Trim);
        assert_eq!((cc.window(), cc.ssthresh()), (200, 200));
        // the same episode: further trims within one RTT change nothing
        cc.on_signal(at(5), RTT, Signal::Trim);
        assert_eq!(cc.window(), 200);
        cc.on_signal(at(10), RTT, Signal::Trim);
        assert_eq!(cc.window(), 100);
        let s = cc.stats();
        assert_eq!((s.trims, s.decreases), (3, 2));
    }

    #[test]
    fn a_marked_result_cuts_to_seven_tenths_once_per_window_of_answers() {
        let mut cc = Congestion::new(400, 1024);
        cc.on_signal(at(0), RTT, Signal::Marked);
        assert_eq!(cc.window(), 280);
        // marks before 280 more answers: the same episode, whatever the time
        for _ in 0..279 {
            cc.on_answer();
        }
        cc.on_signal(at(1000), RTT, Signal::Marked);
        assert_eq!(cc.window(), 280);
        cc.on_answer();
        cc.on_signal(at(1000), RTT, Signal::Marked);
        assert_eq!(cc.window(), 196);
        assert_eq!((cc.stats().marks, cc.stats().decreases), (3, 2));
    }

    #[test]
    fn two_members_fed_the_same_results_keep_the_same_window() {
        // what the switch's marks are for: every member sees the same
        // answers and marks, in the same order, at different times
        let (mut a, mut b) = (Congestion::new(INITIAL_WINDOW, 256), Congestion::new(INITIAL_WINDOW, 256));
        for i in 0..5000u64 {
            let marked = i % 97 == 0 || i % 211 == 0;
            for (cc, t) in [(&mut a, i), (&mut b, i * 3 + 7)] {
                cc.on_answer();
                if marked {
                    cc.on_signal(at(t), RTT, Signal::Marked);
                }
            }
            assert_eq!(a.window(), b.window(), "answer {i}");
        }
        assert!(a.stats().decreases > 10);
    }

    #[test]
    fn a_memory_refusal_halves_below_the_floor_and_grows_back_one_block_per_window() {
        let mut cc = Congestion::new(INITIAL_WINDOW, 32);
        cc.on_signal(at(0), RTT, Signal::Trim);
        assert_eq!(cc.window(), 16, "a trim stops at the floor");
        for (t, want) in [(0, 8), (5, 8), (10, 4), (20, 2), (30, 1), (40, 1)] {
            cc.on_memory_short(at(t), RTT);
            assert_eq!(cc.window(), want, "at {t} ms");
        }
        assert_eq!(cc.stats().memory_decreases, 5);
        // additive increase: 1 answer takes it to 2, 2 more to 3, ...
        for want in 2..=16 {
            for _ in 0..want - 1 {
                cc.on_answer();
            }
            assert_eq!(cc.window(), want);
        }
        for _ in 0..1000 {
            cc.on_answer();
        }
        assert_eq!(cc.window(), 32, "back to the job's limit");
    }

    #[test]
    fn a_loss_found_by_fast_retransmit_is_counted_but_does_not_cut() {
        let mut cc = Congestion::new(100, 256);
        cc.on_signal(at(0), RTT, Signal::Loss);
        assert_eq!((cc.window(), cc.stats().losses), (100, 1));
    }

    #[test]
    fn after_a_decrease_the_window_grows_by_one_block_per_window() {
        let mut cc = Congestion::new(400, 1024);
        cc.on_signal(at(0), RTT, Signal::Marked);
        assert_eq!(cc.window(), 280);
        for _ in 0..279 {
            cc.on_answer();
        }
        assert_eq!(cc.window(), 280);
        cc.on_answer();
        assert_eq!(cc.window(), 281);
    }

    #[test]
    fn a_timeout_is_counted_but_leaves_the_window_alone() {
        let mut cc = Congestion::new(64, 256);
        for i in 0..5 {
            cc.on_signal(at(i * 100), RTT, Signal::Timeout);
        }
        assert_eq!(cc.window(), 64);
        assert_eq!((cc.stats().timeouts, cc.stats().decreases), (5, 0));
    }

    #[test]
    fn the_window_never_falls_below_the_floor_nor_rises_above_a_new_limit() {
        let mut cc = Congestion::new(8, 256);
        for i in 0..10 {
            cc.on_signal(at(i * 100), RTT, Signal::Trim);
        }
        assert_eq!(cc.window(), MIN_WINDOW);
        // two shards: the floor is per shard
        cc.set_limits(256, 2);
        assert_eq!(cc.window(), 2 * MIN_WINDOW);
        let mut cc = Congestion::new(200, 256);
        cc.set_limits(32, 1);
        assert_eq!((cc.window(), cc.max()), (32, 32));
        // a job of 8 slots: the floor is half of it
        let mut tiny = Congestion::new(INITIAL_WINDOW, 8);
        assert_eq!(tiny.window(), 8);
        tiny.on_signal(at(0), RTT, Signal::Trim);
        tiny.on_signal(at(100), RTT, Signal::Trim);
        assert_eq!(tiny.window(), 4);
    }
}
