//! The block-id space of a job, and serial-number arithmetic on it (RFC 1982).
//!
//! Block ids advance without bound over a job's life (2^32 blocks is about
//! 35 000 steps of a 124 M-parameter model at 1024 elements per block), so
//! they wrap. They cannot wrap at 2^32: block `b` lives in slot
//! `b mod block_cnt_max` and block `b + block_cnt_max` must find the same
//! slot, which fails across 2^32 unless `block_cnt_max` divides it. So the
//! ids of a job with S = `block_cnt_max` slots live in `[0, M)`, M the
//! largest multiple of S that is at most 2^32 (2^32 itself when S is a power
//! of two), and wrap there; the worker and the switch both compute M from S.
//! "Before" means "less than M/2 behind": two ids that are compared are
//! always within a few windows (S ≤ 2^20) of each other or of a round's
//! start, far below M/2 ≥ 2^31 − 2^20.

/// The block ids of a job with `block_cnt_max` slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSpace {
    /// M: ids are `0..m`.
    m: u64,
}

impl BlockSpace {
    pub fn new(block_cnt_max: u32) -> Self {
        let s = block_cnt_max.max(1) as u64;
        Self {
            m: (1u64 << 32) / s * s,
        }
    }

    /// One past the largest id (M).
    pub fn size(self) -> u64 {
        self.m
    }

    /// Whether `b` is an id of this space at all (a datagram with another
    /// is malformed for the job).
    pub fn contains(self, b: u32) -> bool {
        (b as u64) < self.m
    }

    /// `x` mod M. Ids are in `[0, M)` but for a malformed datagram's, so
    /// the division (tens of cycles, several per datagram on the hot paths
    /// of the switch and the worker) is taken only for those.
    #[inline]
    fn reduce(self, x: u64) -> u64 {
        if x < self.m {
            x
        } else {
            x % self.m
        }
    }

    /// The id `n` blocks after `b`.
    pub fn add(self, b: u32, n: u32) -> u32 {
        self.reduce(self.reduce(b as u64) + n as u64) as u32
    }

    /// How many blocks `a` lies after `b` (mod M): `add(b, distance(a, b)) == a`.
    pub fn distance(self, a: u32, b: u32) -> u32 {
        self.reduce(self.reduce(a as u64) + self.m - self.reduce(b as u64)) as u32
    }

    /// `a` comes before `b` in the stream.
    pub fn before(self, a: u32, b: u32) -> bool {
        let ahead = self.distance(b, a) as u64;
        ahead != 0 && ahead < self.m / 2
    }

    /// `a` is `b` or comes after it.
    pub fn at_or_after(self, a: u32, b: u32) -> bool {
        !self.before(a, b)
    }

    /// The later of two ids.
    pub fn later(self, a: u32, b: u32) -> u32 {
        if self.before(a, b) {
            b
        } else {
            a
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_power_of_two_wraps_at_two_to_the_32() {
        let sp = BlockSpace::new(256);
        assert_eq!(sp.size(), 1 << 32);
        assert_eq!(sp.add(u32::MAX, 1), 0);
        assert!(
            sp.before(u32::MAX, 0) && sp.before(u32::MAX - 5, 3) && !sp.before(3, u32::MAX - 5)
        );
        assert_eq!(sp.distance(2, u32::MAX), 3);
        assert_eq!(sp.later(u32::MAX - 1, 4), 4);
    }

    #[test]
    fn other_slot_counts_wrap_at_a_multiple_of_it_so_slots_stay_in_step() {
        let sp = BlockSpace::new(6);
        let m = sp.size();
        assert_eq!(m % 6, 0);
        assert!(m <= 1 << 32 && m > (1 << 32) - 6);
        let last = (m - 1) as u32;
        assert!(!sp.contains(m as u32) && sp.contains(last));
        assert_eq!(sp.add(last, 1), 0);
        // b and b + S share a slot across the wrap
        for b in (m - 12) as u32..=last {
            assert_eq!(sp.add(b, 6) % 6, b % 6);
        }
        assert!(sp.before(last, 0) && sp.before(last - 3, 2));
        assert_eq!(sp.distance(1, last - 1), 3);
        // ids at or past M (only a malformed datagram's) reduce modulo M,
        // as the arithmetic without the in-range shortcut did
        for x in [m as u32, u32::MAX, 0, 5, last] {
            for n in [0u32, 1, 7, u32::MAX] {
                assert_eq!(sp.add(x, n) as u64, (x as u64 % m + n as u64) % m, "add({x}, {n})");
                assert_eq!(sp.distance(x, n) as u64, (x as u64 % m + m - n as u64 % m) % m, "distance({x}, {n})");
            }
        }
    }
}
