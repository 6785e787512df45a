//! A job's guards against misbehaving or dead members: a token bucket per
//! source (rate limits) and the member timeout (worker failure).
//!
//! **Rate limits.** A job's limit (or the switch's default) is a rate and a
//! burst for the whole switch; each of its T shards sees about 1/T of a
//! source's blocks (`shard_of` spreads consecutive blocks over the shards),
//! so each shard enforces `pps / T` and `burst / T` (at least 1). Only
//! workers are limited: a child switch in a tree carries many workers.
//! A refused contribution is answered with a Trimmed nack while the
//! source's *nack budget* (a second bucket with the same rate and burst)
//! lasts, and dropped silently past it: a sender that backs off is refused
//! about as often as it is admitted and hears of every refusal, while a
//! flood that ignores the nacks costs the switch a reply for at most one
//! packet in (flood rate / limit), not for every packet.
//!
//! **Member timeout.** A member is dead when it has sent nothing for the
//! job's member timeout *and* an open block has waited that long for it.
//! The second condition keeps a worker that merely computes longer than the
//! others between allreduces (no block open yet) from looking dead, and
//! bounds detection: from the moment a block waits for a dead worker it is
//! found within `timeout * (1 + 1/CHECKS_PER_TIMEOUT)`, whatever
//! `block_exp_ms` is. docs/failures.md.

use std::time::Duration;

use crate::job::{RateLimit, SWITCH_RANK_BASE};
use crate::time::Time;

const NANOS: u128 = 1_000_000_000;

/// A token bucket in integer arithmetic: `level` counts tokens in units of
/// 1/`pps` nanosecond-tokens so refills are exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    pps: u64,
    /// Capacity and level in token-nanoseconds (one token = 1e9 units).
    capacity: u128,
    level: u128,
    last: Time,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(limit: RateLimit) -> Self {
        let capacity = limit.burst.max(1) as u128 * NANOS;
        Self { pps: limit.pps.max(1) as u64, capacity, level: capacity, last: Time::ZERO }
    }

    /// Take one token if there is one (refilling for the time since the
    /// last call first). Time that runs backwards refills nothing.
    pub fn admit(&mut self, now: Time) -> bool {
        let elapsed = now.as_nanos().saturating_sub(self.last.as_nanos()) as u128;
        self.last = Time::from_nanos(self.last.as_nanos().max(now.as_nanos()));
        self.level = (self.level + elapsed * self.pps as u128).min(self.capacity);
        if self.level >= NANOS {
            self.level -= NANOS;
            true
        } else {
            false
        }
    }
}

/// This shard's share of a switch-wide limit.
pub fn shard_share(limit: RateLimit, shard_count: u16) -> RateLimit {
    let t = shard_count.max(1) as u32;
    RateLimit { pps: (limit.pps / t).max(1), burst: (limit.burst / t).max(1) }
}

/// What to do with one contribution of a rate-limited source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Admit,
    /// Over the rate: refuse it, with a nack while the budget lasts.
    Refuse { nack: bool },
}

/// A source's rate bucket and its nack budget.
#[derive(Debug, Clone, Copy)]
struct SourceGuard {
    rate: TokenBucket,
    nacks: TokenBucket,
}

impl SourceGuard {
    fn new(limit: RateLimit) -> Self {
        Self { rate: TokenBucket::new(limit), nacks: TokenBucket::new(limit) }
    }
}

/// One bucket pair per source id of a job (empty when the job is unlimited).
#[derive(Debug, Default)]
pub struct SourceBuckets {
    limit: Option<RateLimit>,
    buckets: Vec<SourceGuard>,
}

impl SourceBuckets {
    /// Heap bytes of the per-source buckets (switch memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<SourceGuard>()
    }

    pub fn new(limit: Option<RateLimit>, capacity: usize) -> Self {
        let buckets = limit.map_or_else(Vec::new, |l| vec![SourceGuard::new(l); capacity]);
        Self { limit, buckets }
    }

    /// Room for source ids below `capacity` (a member with a larger id joined).
    pub fn grow(&mut self, capacity: usize) {
        if let Some(l) = self.limit {
            if self.buckets.len() < capacity {
                self.buckets.resize(capacity, SourceGuard::new(l));
            }
        }
    }

    /// Whether `src` may send one more contribution now, and if not,
    /// whether it is still owed a nack.
    pub fn admit(&mut self, src: usize, now: Time) -> Admission {
        if src >= SWITCH_RANK_BASE as usize {
            return Admission::Admit;
        }
        let Some(g) = self.buckets.get_mut(src) else { return Admission::Admit };
        if g.rate.admit(now) {
            Admission::Admit
        } else {
            Admission::Refuse { nack: g.nacks.admit(now) }
        }
    }
}

/// Liveness checks per member timeout (the check period is timeout / this).
pub const CHECKS_PER_TIMEOUT: u32 = 4;

/// When each member of a job was last heard from, and when to look again.
#[derive(Debug)]
pub struct Liveness {
    pub timeout: Duration,
    last_heard: Vec<Time>,
    next_check: Time,
    /// The job failed (policy `fail`): the member that died.
    pub failed: Option<u16>,
}

impl Liveness {
    /// Heap bytes of the per-member records (switch memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.last_heard.capacity() * std::mem::size_of::<Time>()
    }

    pub fn new(timeout: Duration, capacity: usize) -> Self {
        Self { timeout, last_heard: vec![Time::ZERO; capacity], next_check: Time::ZERO, failed: None }
    }

    pub fn grow(&mut self, capacity: usize) {
        if self.last_heard.len() < capacity {
            self.last_heard.resize(capacity, Time::ZERO);
        }
    }

    pub fn heard(&mut self, src: usize, now: Time) {
        if let Some(t) = self.last_heard.get_mut(src) {
            *t = now;
        }
    }

    /// A member that left and joins again starts with a clean record.
    pub fn forget(&mut self, src: usize) {
        self.heard(src, Time::ZERO);
    }

    /// The next check, while blocks are open and the job has not failed.
    pub fn deadline(&self) -> Option<Time> {
        self.failed.is_none().then_some(self.next_check)
    }

    /// Whether a check is due now; if so the next one is scheduled.
    pub fn check_due(&mut self, now: Time) -> bool {
        if self.failed.is_some() || now < self.next_check {
            return false;
        }
        self.next_check = now + self.timeout / CHECKS_PER_TIMEOUT;
        true
    }

    /// A block opened at `opened` (the job had none open): look at it
    /// once it has waited a full timeout, not at a stale schedule.
    pub fn arm(&mut self, opened: Time) {
        self.next_check = opened + self.timeout;
    }

    /// `src` is silent: nothing from it for the timeout, up to `now`.
    pub fn silent(&self, src: usize, now: Time) -> bool {
        src < SWITCH_RANK_BASE as usize
            && self.last_heard.get(src).is_some_and(|t| now.saturating_since(*t) >= self.timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Time {
        Time::from_nanos(n * 1_000_000)
    }

    #[test]
    fn a_bucket_allows_its_burst_then_refills_at_its_rate() {
        let mut b = TokenBucket::new(RateLimit { pps: 1000, burst: 4 });
        let t0 = ms(10);
        assert_eq!((0..6).filter(|_| b.admit(t0)).count(), 4, "a full bucket holds the burst");
        assert!(!b.admit(t0 + Duration::from_micros(999)), "one token takes 1 ms at 1000 pps");
        assert!(b.admit(t0 + Duration::from_millis(1)));
        assert!(!b.admit(t0 + Duration::from_millis(1)));
        // a long pause refills to the burst, never beyond
        let later = t0 + Duration::from_secs(60);
        assert_eq!((0..10).filter(|_| b.admit(later)).count(), 4);
        // time going backwards refills nothing and does not panic
        assert!(!b.admit(t0));
    }

    #[test]
    fn a_steady_sender_gets_exactly_its_rate() {
        let mut b = TokenBucket::new(RateLimit { pps: 2000, burst: 1 });
        // offered 10 000 pps for one second: 2000 admitted (+ the first token)
        let admitted = (0..10_000u64).filter(|i| b.admit(Time::from_nanos(i * 100_000))).count();
        assert!((2000..=2001).contains(&admitted), "{admitted}");
    }

    #[test]
    fn shards_split_the_limit_and_switches_are_not_limited() {
        assert_eq!(shard_share(RateLimit { pps: 1000, burst: 10 }, 4), RateLimit { pps: 250, burst: 2 });
        assert_eq!(shard_share(RateLimit { pps: 3, burst: 1 }, 4), RateLimit { pps: 1, burst: 1 });
        let mut buckets = SourceBuckets::new(Some(RateLimit { pps: 1, burst: 1 }), 3);
        assert_eq!(buckets.admit(2, ms(0)), Admission::Admit);
        assert_eq!(buckets.admit(2, ms(1)), Admission::Refuse { nack: true });
        assert_eq!(buckets.admit(1, ms(1)), Admission::Admit, "each source has its own bucket");
        assert!((0..5).all(|_| buckets.admit(SWITCH_RANK_BASE as usize, ms(1)) == Admission::Admit), "a child switch is not limited");
        let mut none = SourceBuckets::new(None, 3);
        assert!((0..100).all(|_| none.admit(0, ms(0)) == Admission::Admit));
    }

    #[test]
    fn a_flood_gets_nacks_only_within_its_budget() {
        // 1000 pps, burst 10; offered 20 000 pps for one second.
        let mut buckets = SourceBuckets::new(Some(RateLimit { pps: 1000, burst: 10 }), 1);
        let (mut admitted, mut nacked, mut silent) = (0, 0, 0);
        for i in 0..20_000u64 {
            match buckets.admit(0, Time::from_nanos(i * 50_000)) {
                Admission::Admit => admitted += 1,
                Admission::Refuse { nack: true } => nacked += 1,
                Admission::Refuse { nack: false } => silent += 1,
            }
        }
        assert!((1000..=1010).contains(&admitted), "{admitted}");
        assert!((1000..=1010).contains(&nacked), "the budget has the same rate and burst: {nacked}");
        assert_eq!(admitted + nacked + silent, 20_000);
        // A sender refused no more often than it is admitted hears of every refusal.
        let mut steady = SourceBuckets::new(Some(RateLimit { pps: 1000, burst: 10 }), 1);
        let refusals: Vec<bool> = (0..2_000u64)
            .filter_map(|i| match steady.admit(0, Time::from_nanos(i * 500_000)) {
                Admission::Refuse { nack } => Some(nack),
                Admission::Admit => None,
            })
            .collect();
        assert!(!refusals.is_empty() && refusals.iter().all(|&n| n), "{refusals:?}");
    }

    #[test]
    fn liveness_checks_every_quarter_timeout_and_knows_who_is_silent() {
        let mut l = Liveness::new(Duration::from_millis(100), 3);
        l.heard(1, ms(50));
        l.arm(ms(50));
        assert!(!l.check_due(ms(149)));
        assert!(l.check_due(ms(150)));
        assert!(!l.check_due(ms(160)), "next check a quarter timeout later");
        assert!(l.check_due(ms(175)));
        assert!(l.silent(0, ms(175)), "never heard from");
        assert!(!l.silent(1, ms(149)) && l.silent(1, ms(150)));
        l.failed = Some(0);
        assert_eq!(l.deadline(), None);
        assert!(!l.check_due(ms(1000)));
    }
}
