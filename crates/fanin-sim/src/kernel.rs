//! The event kernel: a binary heap ordered by (time, insertion sequence).
//!
//! Time is integer picoseconds (as in htsim): a 64 B header at 100 Gbit/s
//! takes 5.12 ns, which nanoseconds would round. Ties are broken by the order
//! of scheduling, so a run is a pure function of its configuration and seed.
//! Nothing is global: every simulation owns its queue.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Simulated time in picoseconds.
pub type Ps = u64;

pub const PS_PER_NS: Ps = 1_000;
pub const PS_PER_US: Ps = 1_000_000;

/// The `q` quantile of ascending `sorted` values (the element at
/// `floor(n q)`, the last for q = 1); NaN when empty. Every figure of the
/// simulator takes its percentiles here.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n => sorted[((n as f64 * q) as usize).min(n - 1)],
    }
}

/// Serialisation time of `bytes` at `rate_bps`, in picoseconds (rounded up).
pub fn tx_time(bytes: u32, rate_bps: u64) -> Ps {
    let bits = bytes as u128 * 8 * 1_000_000_000_000;
    bits.div_ceil(rate_bps as u128) as Ps
}

/// Heap entries stay small so sifting moves little memory (the events wait
/// in a slab), and (time, sequence) is one integer so a comparison is one
/// branch-free u128 compare.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Entry {
    /// `time << 64 | seq`, inverted so that the max-heap pops the earliest.
    key: u128,
    slot: u32,
}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key.cmp(&other.key)
    }
}

fn key(time: Ps, seq: u64) -> u128 {
    !(((time as u128) << 64) | seq as u128)
}

fn time_of(key: u128) -> Ps {
    ((!key) >> 64) as Ps
}

/// A deterministic event list.
pub struct EventQueue<E> {
    heap: BinaryHeap<Entry>,
    slab: Vec<Option<E>>,
    free: Vec<u32>,
    seq: u64,
    now: Ps,
    popped: u64,
    max_len: usize,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> EventQueue<E> {
    pub fn new() -> Self {
        Self { heap: BinaryHeap::with_capacity(1024), slab: Vec::with_capacity(1024), free: Vec::new(), seq: 0, now: 0, popped: 0, max_len: 0 }
    }

    /// The time of the event being handled.
    pub fn now(&self) -> Ps {
        self.now
    }

    /// Events handled so far.
    pub fn events_handled(&self) -> u64 {
        self.popped
    }

    /// Most events ever pending at once.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Schedule `event` at `time` (never earlier than now).
    pub fn schedule(&mut self, time: Ps, event: E) {
        debug_assert!(time >= self.now, "event in the past: {time} < {}", self.now);
        let slot = match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = Some(event);
                i
            }
            None => {
                self.slab.push(Some(event));
                self.slab.len() as u32 - 1
            }
        };
        self.heap.push(Entry { key: key(time.max(self.now), self.seq), slot });
        self.seq += 1;
        self.max_len = self.max_len.max(self.heap.len());
    }

    /// Pop the next event if it is due no later than `until`.
    pub fn pop_until(&mut self, until: Ps) -> Option<(Ps, E)> {
        if time_of(self.heap.peek()?.key) > until {
            return None;
        }
        let e = self.heap.pop()?;
        let time = time_of(e.key);
        self.now = time;
        self.popped += 1;
        let event = self.slab[e.slot as usize].take().expect("scheduled event in its slot");
        self.free.push(e.slot);
        Some((time, event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_in_time_then_insertion_order() {
        let mut q = EventQueue::new();
        q.schedule(5, 'a');
        q.schedule(3, 'b');
        q.schedule(5, 'c');
        q.schedule(3, 'd');
        let got: Vec<_> = std::iter::from_fn(|| q.pop_until(u64::MAX)).collect();
        assert_eq!(got, [(3, 'b'), (3, 'd'), (5, 'a'), (5, 'c')]);
        assert_eq!(q.events_handled(), 4);
    }

    #[test]
    fn serialisation_times() {
        assert_eq!(tx_time(1500, 100_000_000_000), 120_000);
        assert_eq!(tx_time(64, 100_000_000_000), 5_120);
        assert_eq!(tx_time(1500, 25_000_000_000), 480_000);
    }
}
