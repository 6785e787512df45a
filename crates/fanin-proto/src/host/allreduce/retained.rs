//! The contributions a worker retains for a switch restart
//! (docs/restart.md, "What is retained"), by block id in stream order.
//!
//! Block ids wrap (at a multiple of `block_cnt_max`, [`BlockSpace`]), and a
//! long job crosses the wrap: at 358 elements per block and 10 Gbit/s a
//! worker's stream wraps in about 80 minutes. So the store is a ring over
//! stream positions from its oldest block, not a map ordered by id: a map
//! put the blocks just past the wrap (ids near 0) before those just short
//! of it (ids near M), never pruned the latter, and resent them after a
//! restart as if they were the stream's newest. The ring is also cheaper:
//! one result adds to its back and prunes its front, where the map paid an
//! insert and a remove in a tree per block (about 2 % of a testbed
//! allreduce's CPU).

use std::collections::VecDeque;

use super::recovery::Kept;
use crate::serial::BlockSpace;

/// Blocks of the stream from `base` on, each retained or not.
#[derive(Debug, Default)]
pub(super) struct Retained {
    /// Block id of `kept[0]`.
    base: u32,
    /// `kept[i]`: block `base + i` (mod M).
    kept: VecDeque<Option<Kept>>,
}

/// The most stream positions the ring spans, in slot-cycles: what is
/// retained lies at most one slot-cycle below the lowest block without a
/// result and at most a window (one slot-cycle) above it, and a recovery,
/// which suspends pruning, lets the stream run at most one more slot-cycle
/// ahead (its gate). Beyond this the oldest blocks go, as pruning would
/// have dropped them; a block further behind than that is not kept.
const SPAN_CYCLES: usize = 4;

impl Retained {
    /// The span limit for a job of `block_cnt_max` slots.
    fn span_max(block_cnt_max: u32) -> usize {
        SPAN_CYCLES * (block_cnt_max.max(1) as usize) + 64
    }

    /// Retain `kept` for block `block_id` (replacing what was retained
    /// for it) in a job of `block_cnt_max` slots.
    pub(super) fn insert(&mut self, space: BlockSpace, block_cnt_max: u32, block_id: u32, kept: Kept) {
        let span_max = Self::span_max(block_cnt_max);
        if self.kept.is_empty() {
            self.base = block_id;
        } else if space.before(block_id, self.base) {
            let behind = space.distance(self.base, block_id) as usize;
            if behind + self.kept.len() > span_max {
                return; // older than anything a restart could ask for
            }
            for _ in 0..behind {
                self.kept.push_front(None);
            }
            self.base = block_id;
        } else {
            // the oldest blocks the new one pushes out of the span (all of
            // them when the stream jumped far ahead, as a new round does)
            while !self.kept.is_empty() && space.distance(block_id, self.base) as usize >= span_max {
                if space.distance(block_id, self.base) as usize >= self.kept.len() + span_max {
                    self.kept.clear();
                    break;
                }
                self.pop_front(space);
                self.trim_front(space);
            }
            if self.kept.is_empty() {
                self.base = block_id;
            }
        }
        let at = space.distance(block_id, self.base) as usize;
        while self.kept.len() <= at {
            self.kept.push_back(None);
        }
        self.kept[at] = Some(kept);
    }

    /// The contribution retained for `block_id`.
    pub(super) fn get(&self, space: BlockSpace, block_id: u32) -> Option<&Kept> {
        if self.kept.is_empty() || space.before(block_id, self.base) {
            return None;
        }
        self.kept.get(space.distance(block_id, self.base) as usize)?.as_ref()
    }

    /// Forget every block before `cut`, handing each freed contribution to
    /// `freed` (its buffer is reused).
    pub(super) fn prune_before(&mut self, space: BlockSpace, cut: u32, mut freed: impl FnMut(Kept)) {
        while !self.kept.is_empty() && space.before(self.base, cut) {
            if let Some(kept) = self.pop_front(space) {
                freed(kept);
            }
        }
        self.trim_front(space);
    }

    /// Retained blocks at or after `from`, in stream order.
    pub(super) fn blocks_from(&self, space: BlockSpace, from: u32) -> impl Iterator<Item = u32> + '_ {
        self.iter(space).map(|(b, _)| b).filter(move |&b| space.at_or_after(b, from))
    }

    /// Every retained block and its contribution, in stream order.
    pub(super) fn iter(&self, space: BlockSpace) -> impl Iterator<Item = (u32, &Kept)> + '_ {
        let base = self.base;
        self.kept.iter().enumerate().filter_map(move |(i, k)| Some((space.add(base, i as u32), k.as_ref()?)))
    }

    /// As [`iter`](Self::iter), mutable.
    pub(super) fn iter_mut(&mut self, space: BlockSpace) -> impl Iterator<Item = (u32, &mut Kept)> + '_ {
        let base = self.base;
        self.kept.iter_mut().enumerate().filter_map(move |(i, k)| Some((space.add(base, i as u32), k.as_mut()?)))
    }

    fn pop_front(&mut self, space: BlockSpace) -> Option<Kept> {
        let front = self.kept.pop_front()?;
        self.base = space.add(self.base, 1);
        front
    }

    /// Keep the front a retained block, so `base` is the oldest one.
    fn trim_front(&mut self, space: BlockSpace) {
        while matches!(self.kept.front(), Some(None)) {
            self.pop_front(space);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(k: Option<&Kept>) -> Option<u8> {
        match k? {
            Kept::Bytes(b) => b.first().copied(),
            Kept::FromInput => None,
        }
    }

    /// Blocks just short of the wrap and just past it: stream order, found
    /// by id, pruned from the oldest across the wrap. (A map ordered by id
    /// lists 0, 1 before M-2, M-1, and pruning by `id < cut` keeps M-2.)
    #[test]
    fn blocks_across_the_wrap_stay_in_stream_order_and_are_pruned_from_the_oldest() {
        let space = BlockSpace::new(4);
        let m = space.size();
        let near = |back: u64| (m - back) as u32;
        let mut r = Retained::default();
        for (i, b) in [near(2), near(1), 0, 1].into_iter().enumerate() {
            r.insert(space, 4, b, Kept::Bytes(vec![i as u8]));
        }
        assert_eq!(r.iter(space).map(|(b, _)| b).collect::<Vec<_>>(), vec![near(2), near(1), 0, 1]);
        assert_eq!(r.blocks_from(space, near(1)).collect::<Vec<_>>(), vec![near(1), 0, 1]);
        assert_eq!(bytes(r.get(space, near(2))), Some(0));
        assert_eq!(bytes(r.get(space, 1)), Some(3));
        assert!(r.get(space, 2).is_none() && r.get(space, near(3)).is_none());
        let mut freed = Vec::new();
        r.prune_before(space, 0, |k| freed.push(k));
        assert_eq!(freed.len(), 2, "M-2 and M-1 are before 0 in the stream");
        assert_eq!(r.iter(space).map(|(b, _)| b).collect::<Vec<_>>(), vec![0, 1]);
    }

    /// Out of order, with holes: a block before the oldest goes in front;
    /// one far ahead (a new round) replaces everything; one far behind is
    /// not kept; the ring never spans more than its limit.
    #[test]
    fn holes_late_blocks_and_far_jumps_keep_the_ring_bounded() {
        let space = BlockSpace::new(4);
        let mut r = Retained::default();
        r.insert(space, 4, 10, Kept::FromInput);
        r.insert(space, 4, 13, Kept::FromInput);
        r.insert(space, 4, 8, Kept::FromInput);
        assert_eq!(r.iter(space).map(|(b, _)| b).collect::<Vec<_>>(), vec![8, 10, 13]);
        let span = Retained::span_max(4) as u32;
        r.insert(space, 4, 8 + span + 5, Kept::FromInput);
        assert_eq!(r.iter(space).map(|(b, _)| b).collect::<Vec<_>>(), vec![8 + span + 5]);
        r.insert(space, 4, 8, Kept::FromInput);
        assert_eq!(r.iter(space).count(), 1, "a block a whole span behind is not kept");
        for b in 0..3 * span {
            r.insert(space, 4, 1000 + b, Kept::FromInput);
            assert!(r.kept.len() <= span as usize);
        }
        // one past the span drops the oldest block only
        let mut r = Retained::default();
        for b in 0..span {
            r.insert(space, 4, b, Kept::FromInput);
        }
        r.insert(space, 4, span, Kept::FromInput);
        assert_eq!(r.iter(space).map(|(b, _)| b).collect::<Vec<_>>(), (1..=span).collect::<Vec<_>>());
    }
}
