//! A task's aggregator memory: every AA of every copy in one array, and a
//! bit per aggregator saying whether it holds a key.
//!
//! ASK's hardware reads and resets an inactive copy register by register;
//! a software switch would scan the whole copy (tens of thousands of
//! aggregators per AA) for a few percent that are occupied, at every swap.
//! The occupancy bits let a fetch jump from one occupied aggregator to the
//! next and a clear touch only those: the same entries in the same order,
//! at a fraction of the memory traffic.

use super::ValueType;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Aggregator {
    pub key: u64,
    pub count: u32,
    pub sum: i64,
    pub min: i64,
    pub max: i64,
}

/// `len` aggregators of all-zero bytes, which is `Aggregator::default()`.
fn zeroed_aggregators(len: usize) -> Vec<Aggregator> {
    if len == 0 || std::mem::size_of::<Aggregator>() == 0 {
        return Vec::new();
    }
    let layout = std::alloc::Layout::array::<Aggregator>(len).expect("aggregator region fits in memory");
    // SAFETY: the allocation has the layout of `len` aggregators, every
    // field of `Aggregator` is an integer, so all-zero bytes are a valid
    // value (the blank aggregator), and the Vec takes ownership of memory
    // allocated by the global allocator with exactly that layout.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut Aggregator;
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Vec::from_raw_parts(ptr, len, len)
    }
}

pub(super) struct Aggregators {
    aggs: Vec<Aggregator>,
    /// Bit `i` set iff `aggs[i].count > 0`.
    occupied: Vec<u64>,
}

impl Aggregators {
    /// `len` blank aggregators, from zeroed memory: a region is tens of
    /// megabytes, and filling it with `Aggregator::default()` wrote all of
    /// it while the task was being admitted (the sender waits for that);
    /// zeroed pages come from the kernel as they are first touched.
    pub fn new(len: usize) -> Self {
        Self { aggs: zeroed_aggregators(len), occupied: vec![0; len.div_ceil(64)] }
    }

    pub fn get(&self, at: usize) -> Aggregator {
        self.aggs[at]
    }

    /// Ask the CPU to start loading aggregator `at` (both cache lines it
    /// may straddle: an aggregator is 40 bytes), so a later `get`/`add`
    /// finds it in cache. A hint only: out-of-range `at` is ignored.
    #[inline]
    pub fn prefetch(&self, at: usize) {
        #[cfg(target_arch = "x86_64")]
        if let Some(agg) = self.aggs.get(at) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let first = agg as *const Aggregator as *const i8;
            let last = first.wrapping_add(std::mem::size_of::<Aggregator>() - 1);
            // SAFETY: prefetch never faults and reads nothing visible; the
            // addresses lie inside `self.aggs` anyway.
            #[allow(unused_unsafe)]
            unsafe {
                _mm_prefetch(first, _MM_HINT_T0);
                _mm_prefetch(last, _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = at;
    }

    /// Algorithm 1's `Write` into an aggregator that is empty or holds `key`.
    /// The caller has checked (`ValueType::checked_add`) that an int64 sum
    /// does not overflow.
    pub fn add(&mut self, at: usize, key: u64, value: i64, value_type: ValueType) {
        let agg = &mut self.aggs[at];
        if agg.count == 0 {
            *agg = Aggregator { key, count: 1, sum: value, min: value, max: value };
            self.occupied[at / 64] |= 1 << (at % 64);
        } else {
            agg.count = agg.count.saturating_add(1);
            agg.sum = value_type.saturating_add(agg.sum, value).0;
            agg.min = value_type.min(agg.min, value);
            agg.max = value_type.max(agg.max, value);
        }
    }

    /// Set the count of every occupied aggregator (tests: a register near
    /// its limit without adding 2^32 tuples).
    #[cfg(test)]
    pub fn set_counts(&mut self, count: u32) {
        for agg in self.aggs.iter_mut().filter(|a| a.count > 0) {
            agg.count = count;
        }
    }

    /// The first occupied aggregator in `from..end`.
    pub fn next_occupied(&self, from: usize, end: usize) -> Option<usize> {
        if from >= end {
            return None;
        }
        let mut word = from / 64;
        let mut bits = self.occupied[word] & (!0u64 << (from % 64));
        loop {
            if bits != 0 {
                let at = word * 64 + bits.trailing_zeros() as usize;
                return (at < end).then_some(at);
            }
            word += 1;
            if word * 64 >= end {
                return None;
            }
            bits = self.occupied[word];
        }
    }

    /// Empty every aggregator in `start..end`.
    pub fn clear(&mut self, start: usize, end: usize) {
        let mut at = start;
        while let Some(i) = self.next_occupied(at, end) {
            self.aggs[i] = Aggregator::default();
            self.occupied[i / 64] &= !(1 << (i % 64));
            at = i + 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_region_is_blank() {
        let a = Aggregators::new(1000);
        assert!((0..1000).all(|i| a.get(i) == Aggregator::default()));
        assert_eq!(a.next_occupied(0, 1000), None);
        assert_eq!(Aggregators::new(0).next_occupied(0, 0), None);
    }

    #[test]
    fn occupancy_follows_the_aggregators_across_word_edges() {
        let mut a = Aggregators::new(200);
        for at in [0, 63, 64, 130, 199] {
            a.add(at, at as u64, 5, ValueType::Int64);
        }
        a.add(64, 64, -1, ValueType::Int64);
        let scan = |a: &Aggregators, from, end| {
            let mut seen = Vec::new();
            let mut at = from;
            while let Some(i) = a.next_occupied(at, end) {
                seen.push(i);
                at = i + 1;
            }
            seen
        };
        assert_eq!(scan(&a, 0, 200), [0, 63, 64, 130, 199]);
        assert_eq!(scan(&a, 1, 130), [63, 64]);
        assert_eq!(scan(&a, 131, 199), Vec::<usize>::new());
        assert_eq!(a.get(64), Aggregator { key: 64, count: 2, sum: 4, min: -1, max: 5 });
        a.clear(60, 131);
        assert_eq!(scan(&a, 0, 200), [0, 199]);
        assert_eq!(a.get(63), Aggregator::default());
        // the plain scan agrees everywhere
        let plain: Vec<usize> = (0..200).filter(|&i| a.get(i).count > 0).collect();
        assert_eq!(scan(&a, 0, 200), plain);
    }
}
