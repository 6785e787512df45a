//! Trio's straggler scan state, shared (Trio-ML §5: N timer threads, each
//! scanning 1/N of the block records every period). Each aggregating block
//! record's recently-referenced (REF) flag and its count of unreferenced
//! visits live in one atomic word per slot of a job's shard: the shard
//! that owns the blocks sets REF on every contribution, and a scanner —
//! the shard itself between batches, or a timer thread of its own on
//! another core (`aging.threads`) — visits a slice of the words with
//! compare-and-swap and names the blocks found idle for enough visits. Only
//! the owning shard acts on a name (ages the block out), after checking the
//! word still says so: a contribution between the visit and the action
//! wins. One implementation for both: `ValueSwitch::handle_timeout` visits
//! inline with [`AgingBoard::visit`], and the daemon's scanner threads call
//! the same function.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// Word layout: `block_id` in bits 0..32, [`LIVE`], [`REF`], and the
/// unreferenced visits in bits 40..48.
const LIVE: u64 = 1 << 32;
const REF: u64 = 1 << 33;
const IDLE_SHIFT: u32 = 40;
const IDLE_MASK: u64 = 0xff << IDLE_SHIFT;

/// The scan words of one job's slots on one shard, and how many
/// unreferenced visits age a block now (the job's adaptive expiry).
#[derive(Debug)]
pub struct AgingBoard {
    words: Box<[AtomicU64]>,
    needed_checks: AtomicU8,
}

/// A block a visit found unreferenced for enough visits: `(local slot,
/// block_id)`.
pub type Idle = (u32, u32);

impl AgingBoard {
    pub fn new(slots: usize, needed_checks: u8) -> Self {
        Self { words: (0..slots).map(|_| AtomicU64::new(0)).collect(), needed_checks: AtomicU8::new(needed_checks) }
    }

    pub fn slots(&self) -> usize {
        self.words.len()
    }

    /// Block `block_id` in slot `local` aggregates and was just referenced
    /// (opened, a contribution added, its data phase began): REF set, the
    /// count cleared. Only the owning shard writes this.
    pub(super) fn touch(&self, local: usize, block_id: u32) {
        self.words[local].store(block_id as u64 | LIVE | REF, Ordering::Release);
    }

    /// Keep waiting for block `block_id` from now: the count cleared, REF
    /// as it was (an aged phase nobody has sent to yet).
    pub(super) fn restart_count(&self, local: usize, block_id: u32) {
        self.words[local].store(block_id as u64 | LIVE, Ordering::Release);
    }

    /// Slot `local` holds no aggregating block any more.
    pub(super) fn close(&self, local: usize) {
        if let Some(w) = self.words.get(local) {
            w.store(0, Ordering::Release);
        }
    }

    pub(super) fn set_needed_checks(&self, checks: u8) {
        self.needed_checks.store(checks, Ordering::Relaxed);
    }

    /// Does slot `local` still say block `block_id` is idle for enough
    /// visits? (The owning shard asks before it acts on a visit's name.)
    pub(super) fn still_idle(&self, local: usize, block_id: u32) -> bool {
        let Some(w) = self.words.get(local).map(|w| w.load(Ordering::Acquire)) else { return false };
        w & (LIVE | REF) == LIVE
            && w as u32 == block_id
            && ((w & IDLE_MASK) >> IDLE_SHIFT) as u8 >= self.needed_checks.load(Ordering::Relaxed)
    }

    /// One scanner visit of slots `[lo, hi)`: a referenced block loses its
    /// flag and its count; an unreferenced one counts one more visit, and
    /// is named (pushed to `idle`) once it reaches the needed visits.
    pub fn visit(&self, lo: usize, hi: usize, idle: &mut Vec<Idle>) {
        let needed = self.needed_checks.load(Ordering::Relaxed);
        for (local, word) in self.words.iter().enumerate().take(hi).skip(lo) {
            let mut w = word.load(Ordering::Acquire);
            loop {
                if w & LIVE == 0 {
                    break;
                }
                let (next, named) = if w & REF != 0 {
                    (w & !(REF | IDLE_MASK), false)
                } else {
                    let count = (((w & IDLE_MASK) >> IDLE_SHIFT) + 1).min(0xff);
                    ((w & !IDLE_MASK) | count << IDLE_SHIFT, count as u8 >= needed)
                };
                match word.compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        if named {
                            idle.push((local as u32, w as u32));
                        }
                        break;
                    }
                    Err(now) => w = now,
                }
            }
        }
    }

    /// Slice `slice` of `slices` of this board's slots.
    pub fn slice(&self, slice: u64, slices: u64) -> (usize, usize) {
        let n = self.words.len();
        ((slice as usize * n) / slices as usize, ((slice as usize + 1) * n) / slices as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_named_after_the_needed_unreferenced_visits_and_a_touch_resets_it() {
        let b = AgingBoard::new(4, 2);
        let mut idle = Vec::new();
        b.touch(1, 77);
        b.visit(0, 4, &mut idle); // clears REF
        b.visit(0, 4, &mut idle); // 1
        assert!(idle.is_empty() && !b.still_idle(1, 77));
        b.visit(0, 4, &mut idle); // 2: named
        assert_eq!(idle, [(1, 77)]);
        assert!(b.still_idle(1, 77) && !b.still_idle(1, 78));
        b.touch(1, 77); // a contribution between the visit and the action wins
        assert!(!b.still_idle(1, 77));
        b.close(1);
        idle.clear();
        for _ in 0..5 {
            b.visit(0, 4, &mut idle);
        }
        assert!(idle.is_empty(), "a closed slot is never named");
    }

    #[test]
    fn scanners_on_other_threads_and_the_owner_never_lose_a_touch() {
        // Two scanner threads visit while the owner touches: a block touched
        // after its last visit is never still idle.
        let b = std::sync::Arc::new(AgingBoard::new(64, 3));
        for s in 0..64 {
            b.touch(s, s as u32);
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let scanners: Vec<_> = (0..2)
            .map(|i| {
                let (b, stop) = (b.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut idle = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let (lo, hi) = b.slice(i, 2);
                        b.visit(lo, hi, &mut idle);
                    }
                    idle.len()
                })
            })
            .collect();
        for round in 0..20_000u32 {
            let s = (round % 64) as usize;
            b.touch(s, s as u32);
            assert!(!b.still_idle(s, s as u32), "round {round}: a touch was lost");
        }
        // left alone, every block is found idle by the scanners
        let t0 = std::time::Instant::now();
        while !(0..64).all(|s| b.still_idle(s, s as u32)) {
            assert!(t0.elapsed().as_secs() < 10, "the scanners never aged the untouched blocks");
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        let named: usize = scanners.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(named >= 64);
    }
}
