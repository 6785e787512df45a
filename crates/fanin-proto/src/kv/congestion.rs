//! Congestion control of a key-value sender channel (docs/kv.md,
//! "Congestion"), as a sans-IO machine the [`KvSender`](super::KvSender)
//! feeds.
//!
//! ASK (§3.3) sends a fixed window of W packets and resends each one when
//! its own fine timeout (100 µs on Tofino) expires. That fits a switch
//! wired to hosts at line rate with shallow queues. On a rate-limited link
//! it does not: a window of 2 048 packets waits tens of milliseconds in the
//! link's queue, longer than any fixed timeout that is also short enough
//! to repair a loss quickly, so every packet is resent again and again
//! while the first copy is still queued (measured on the testbed at
//! 100 Mbit/s: 3.3 retransmissions per packet, 0.22 of the link's
//! capacity for the task's own bytes).
//!
//! So the sender's timeout and window adapt, as TCP's do:
//!
//! * **Timeout**: RFC 6298's estimator (SRTT, RTTVAR, RTO = SRTT + 4
//!   RTTVAR) fed only by packets acknowledged at their first transmission
//!   (Karn). A packet takes one of two paths: acknowledged by the switch
//!   (every tuple absorbed) or forwarded and acknowledged by the receiver,
//!   two hops more. The two are estimated apart and a packet's timer is
//!   the larger RTO, since the sender cannot know its path in advance; one
//!   mixed estimate would sit between the two and fire early on the slow
//!   one. Each resend of a packet doubles its own timeout (at most
//!   [`MAX_BACKOFF`] times), so a timeout too short for the path costs a
//!   few copies, not a storm.
//! * **Window**: at most `cwnd` packets unacknowledged, besides ASK's seq
//!   span W (which the switch's receive window needs and which stays).
//!   Slow start from [`INITIAL_CWND`], then one packet per window of acks;
//!   a packet whose timeout expired halves it (NewReno: once per window of
//!   packets, the ones sent before the cut count as one loss episode),
//!   never below [`MIN_CWND`].
//!
//! Acks arrive out of order by design (the switch acknowledges what it
//! absorbed at once, the receiver what was forwarded), so a later packet's
//! ack says nothing about an earlier one: there is no fast retransmit, and
//! a timeout is the loss signal.

use std::time::Duration;


/// The window a channel starts with (packets).
pub const INITIAL_CWND: u32 = 32;
/// The smallest window (packets).
pub const MIN_CWND: u32 = 4;
/// A packet's timeout doubles with each resend, at most this many times.
pub const MAX_BACKOFF: u32 = 6;
/// The shortest timeout the estimator may choose by default: ASK's fine
/// timeout (a switch wired to its hosts).
pub const DEFAULT_MIN_RTO: Duration = Duration::from_micros(100);
/// The shortest on Linux hosts (the kv daemon's): a UDP path on shared
/// cores stalls for a millisecond now and then (scheduling), and a resend
/// then is spurious.
pub const HOST_MIN_RTO: Duration = Duration::from_millis(10);
/// The longest (a packet's backed-off timeout may be longer).
pub const MAX_RTO: Duration = Duration::from_secs(1);
/// The longest timeout of a resent packet (the sender's `dead_after`
/// ends a channel that hears nothing long before it matters).
pub const MAX_RESEND_RTO: Duration = Duration::from_secs(4);

/// RFC 6298's smoothed round-trip time and variation of one path.
#[derive(Debug, Clone, Copy, Default)]
struct RttEstimator {
    srtt: Option<Duration>,
    rttvar: Duration,
}

impl RttEstimator {
    fn sample(&mut self, rtt: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
            }
            Some(srtt) => {
                // RTTVAR = 3/4 RTTVAR + 1/4 |SRTT - R|; SRTT = 7/8 SRTT + 1/8 R
                let dev = if srtt > rtt { srtt - rtt } else { rtt - srtt };
                self.rttvar = (self.rttvar * 3 + dev) / 4;
                self.srtt = Some((srtt * 7 + rtt) / 8);
            }
        }
    }

    fn rto(&self) -> Option<Duration> {
        self.srtt.map(|s| s + self.rttvar * 4)
    }
}

/// What the controller saw, for statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvCongestionStats {
    /// Packets whose timeout expired (each resend counts once).
    pub timeouts: u64,
    /// Times the window was halved (at most once per window of packets).
    pub window_cuts: u64,
    /// Round-trip samples taken (packets acknowledged at their first send).
    pub rtt_samples: u64,
}

#[derive(Debug, Clone)]
pub struct KvCongestion {
    enabled: bool,
    cwnd: u32,
    ssthresh: u32,
    /// Acks since the window last grew in congestion avoidance.
    credit: u32,
    /// ASK's W: the window never exceeds it.
    max: u32,
    /// A timeout of a packet sent before this seq belongs to the loss
    /// episode already answered (NewReno's `recover`).
    recover: Option<u32>,
    by_switch: RttEstimator,
    by_receiver: RttEstimator,
    initial_rto: Duration,
    min_rto: Duration,
    /// Loss episodes since the last round-trip sample: each doubles the
    /// timeout (RFC 6298 §5.5), so a timeout too short for the path finds
    /// the path's length even when every packet gets resent before its ack
    /// (and so gives no sample, Karn).
    backoff: u32,
    stats: KvCongestionStats,
}

impl KvCongestion {
    /// A controller for a channel whose seq span is at most `max` packets,
    /// with `initial_rto` until the first round trip is measured and
    /// never a timeout below `min_rto`. Disabled (`enabled` false): ASK's
    /// fixed window `max` and fixed timeout `initial_rto`, for comparison.
    pub fn new(enabled: bool, max: u32, initial_rto: Duration, min_rto: Duration) -> Self {
        let max = max.max(1);
        Self {
            enabled,
            cwnd: if enabled { INITIAL_CWND.clamp(MIN_CWND.min(max), max) } else { max },
            ssthresh: max,
            credit: 0,
            max,
            recover: None,
            by_switch: RttEstimator::default(),
            by_receiver: RttEstimator::default(),
            initial_rto,
            min_rto,
            backoff: 0,
            stats: KvCongestionStats::default(),
        }
    }

    /// Packets that may be unacknowledged now.
    pub fn window(&self) -> u32 {
        self.cwnd
    }

    pub fn ssthresh(&self) -> u32 {
        self.ssthresh
    }

    pub fn stats(&self) -> KvCongestionStats {
        self.stats
    }

    /// The timeout of a packet's first send: the larger of the two paths'
    /// estimates (the initial RTO until one is measured).
    pub fn rto(&self) -> Duration {
        if !self.enabled {
            return self.initial_rto;
        }
        let base = match (self.by_switch.rto(), self.by_receiver.rto()) {
            (None, None) => self.initial_rto,
            (a, b) => a.max(b).expect("one is measured").clamp(self.min_rto, MAX_RTO),
        };
        (base * (1u32 << self.backoff.min(MAX_BACKOFF))).min(MAX_RTO.max(base))
    }

    /// The timeout of a packet's `resends`-th resend: doubled each time,
    /// [`MAX_BACKOFF`] times at most.
    pub fn backed_off_rto(&self, resends: u32) -> Duration {
        if !self.enabled {
            return self.initial_rto;
        }
        (self.rto() * (1u32 << resends.min(MAX_BACKOFF))).min(MAX_RESEND_RTO)
    }

    /// A packet was acknowledged, `rtt` after it was sent if it was
    /// acknowledged at its first transmission (Karn: a resent packet's ack
    /// could answer either copy, so it gives no sample).
    pub fn on_ack(&mut self, rtt: Option<Duration>, by_switch: bool) {
        if !self.enabled {
            return;
        }
        if let Some(rtt) = rtt {
            self.stats.rtt_samples += 1;
            self.backoff = 0;
            if by_switch {
                self.by_switch.sample(rtt);
            } else {
                self.by_receiver.sample(rtt);
            }
        }
        crate::host::congestion::grow_window(&mut self.cwnd, &mut self.credit, self.ssthresh, self.max);
    }

    /// The packet `seq` was not acknowledged within its timeout; `next_seq`
    /// is the seq the next new packet will take. Halves the window unless
    /// this loss belongs to the episode already answered.
    pub fn on_timeout(&mut self, seq: u32, next_seq: u32) {
        self.stats.timeouts += 1;
        if !self.enabled {
            return;
        }
        if self.recover.is_some_and(|r| seq < r) {
            return;
        }
        self.recover = Some(next_seq);
        self.ssthresh = (self.cwnd / 2).max(MIN_CWND).min(self.max);
        self.cwnd = self.ssthresh;
        self.credit = 0;
        self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
        self.stats.window_cuts += 1;
    }

    /// The round-trip estimates (switch path, receiver path), for statistics.
    pub fn srtt(&self) -> (Option<Duration>, Option<Duration>) {
        (self.by_switch.srtt, self.by_receiver.srtt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn cc() -> KvCongestion {
        KvCongestion::new(true, 2048, 20 * MS, MS)
    }

    #[test]
    fn slow_start_doubles_per_window_then_grows_by_one_per_window() {
        let mut c = cc();
        assert_eq!(c.window(), INITIAL_CWND);
        for _ in 0..INITIAL_CWND {
            c.on_ack(None, true);
        }
        assert_eq!(c.window(), 2 * INITIAL_CWND, "one per ack in slow start");
        c.on_timeout(0, 100);
        assert_eq!((c.window(), c.ssthresh()), (INITIAL_CWND, INITIAL_CWND));
        for _ in 0..INITIAL_CWND - 1 {
            c.on_ack(None, true);
        }
        assert_eq!(c.window(), INITIAL_CWND, "avoidance: a whole window of acks for one more");
        c.on_ack(None, true);
        assert_eq!(c.window(), INITIAL_CWND + 1);
    }

    #[test]
    fn timeouts_of_one_episode_cut_once_and_the_floor_holds() {
        let mut c = cc();
        for _ in 0..200 {
            c.on_ack(None, false);
        }
        let w = c.window();
        // packets 10..20 lost from one overflow, found as their timers fire
        c.on_timeout(10, 300);
        for seq in 11..20 {
            c.on_timeout(seq, 300 + seq);
        }
        assert_eq!(c.window(), w / 2);
        assert_eq!(c.stats().window_cuts, 1);
        assert_eq!(c.stats().timeouts, 10);
        // a packet sent after the cut: a new episode
        c.on_timeout(300, 400);
        assert_eq!(c.window(), w / 4);
        for seq in 400..420 {
            c.on_timeout(seq, seq + 1);
        }
        assert_eq!(c.window(), MIN_CWND);
    }

    #[test]
    fn the_timeout_follows_the_slower_path_and_karn_skips_resent_packets() {
        let mut c = cc();
        assert_eq!(c.rto(), 20 * MS, "the initial RTO until a round trip is measured");
        for _ in 0..50 {
            c.on_ack(Some(2 * MS), true);
        }
        // switch path only: SRTT 2 ms, RTTVAR decays toward 0
        assert!(c.rto() >= 2 * MS && c.rto() < 3 * MS, "{:?}", c.rto());
        for _ in 0..50 {
            c.on_ack(Some(10 * MS), false);
        }
        assert!(c.rto() >= 10 * MS, "the receiver's path is the longer: {:?}", c.rto());
        let before = c.rto();
        c.on_ack(None, false);
        assert_eq!(c.rto(), before, "no sample from a resent packet");
        assert_eq!(c.stats().rtt_samples, 100);
        // a queue building up: the estimate follows
        for _ in 0..30 {
            c.on_ack(Some(40 * MS), true);
        }
        assert!(c.rto() >= 40 * MS);
        // the floor and the backoff
        let mut fast = cc();
        for _ in 0..50 {
            fast.on_ack(Some(Duration::from_micros(30)), true);
        }
        assert_eq!(fast.rto(), MS, "the floor");
        assert_eq!(fast.backed_off_rto(1), 2 * MS);
        assert_eq!(fast.backed_off_rto(40), MS * (1 << MAX_BACKOFF));
    }

    #[test]
    fn loss_episodes_without_a_sample_double_the_timeout_until_one_comes() {
        let mut c = cc();
        c.on_timeout(0, 32);
        assert_eq!(c.rto(), 40 * MS);
        c.on_timeout(5, 40);
        assert_eq!(c.rto(), 40 * MS, "the same episode");
        c.on_timeout(40, 64);
        assert_eq!(c.rto(), 80 * MS);
        assert_eq!(c.backed_off_rto(2), 320 * MS);
        for seq in 0..20 {
            c.on_timeout(100 * seq + 100, 100 * seq + 150);
        }
        assert_eq!(c.rto(), MAX_RTO, "capped");
        assert_eq!(c.backed_off_rto(5), MAX_RESEND_RTO);
        c.on_ack(Some(3 * MS), true);
        assert!(c.rto() < 10 * MS, "a sample ends the backoff: {:?}", c.rto());
    }

    #[test]
    fn disabled_it_is_asks_fixed_window_and_timeout() {
        let mut c = KvCongestion::new(false, 256, 20 * MS, DEFAULT_MIN_RTO);
        assert_eq!(c.window(), 256);
        c.on_ack(Some(MS), true);
        c.on_timeout(0, 10);
        assert_eq!((c.window(), c.rto(), c.backed_off_rto(3)), (256, 20 * MS, 20 * MS));
        assert_eq!(c.stats().timeouts, 1);
    }

    #[test]
    fn a_window_smaller_than_the_initial_one_is_kept() {
        let c = KvCongestion::new(true, 8, 20 * MS, DEFAULT_MIN_RTO);
        assert_eq!(c.window(), 8);
        let c = KvCongestion::new(true, 2, 20 * MS, DEFAULT_MIN_RTO);
        assert_eq!(c.window(), 2);
    }
}
