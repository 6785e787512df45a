//! Bitmask of sources (Trio-ML's `src_mask_*` / `rcvd_mask_*`, SwitchML's
//! worker bitmap), sized for the job instead of fixed at 256 bits.

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SourceMask {
    words: Vec<u64>,
}

impl SourceMask {
    /// An empty mask able to hold source ids `0..capacity`.
    pub fn with_capacity(capacity: usize) -> Self {
        Self { words: vec![0; capacity.div_ceil(64).max(1)] }
    }

    /// Make room for ids `0..capacity` (never shrinks), keeping the bits set.
    pub fn grow(&mut self, capacity: usize) {
        let words = capacity.div_ceil(64).max(1);
        if words > self.words.len() {
            self.words.resize(words, 0);
        }
    }

    pub fn capacity(&self) -> usize {
        self.words.len() * 64
    }

    /// Set bit `id`; returns true if it was clear. Ids beyond the capacity
    /// are refused (false) rather than growing the mask.
    pub fn insert(&mut self, id: usize) -> bool {
        let (w, b) = (id / 64, id % 64);
        match self.words.get_mut(w) {
            Some(word) if *word & (1 << b) == 0 => {
                *word |= 1 << b;
                true
            }
            _ => false,
        }
    }

    pub fn remove(&mut self, id: usize) -> bool {
        let (w, b) = (id / 64, id % 64);
        match self.words.get_mut(w) {
            Some(word) if *word & (1 << b) != 0 => {
                *word &= !(1 << b);
                true
            }
            _ => false,
        }
    }

    pub fn contains(&self, id: usize) -> bool {
        self.words.get(id / 64).is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    pub fn clear(&mut self) {
        self.words.iter_mut().for_each(|w| *w = 0);
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }

    /// True if every bit of `other` is set in `self`.
    pub fn is_superset(&self, other: &SourceMask) -> bool {
        other.words.iter().enumerate().all(|(i, w)| self.words.get(i).copied().unwrap_or(0) & w == *w)
    }

    /// Ids of the set bits, ascending.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
            let mut w = word;
            core::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let b = w.trailing_zeros() as usize;
                w &= w - 1;
                Some(i * 64 + b)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_count_iterate() {
        let mut m = SourceMask::with_capacity(300);
        assert!(m.capacity() >= 300);
        assert!(m.insert(0) && m.insert(63) && m.insert(64) && m.insert(299));
        assert!(!m.insert(63), "second insert reports the bit was already set");
        assert!(!m.insert(100_000), "ids beyond the capacity are refused");
        assert_eq!(m.count(), 4);
        assert_eq!(m.iter().collect::<Vec<_>>(), vec![0, 63, 64, 299]);
        assert!(m.remove(64) && !m.remove(64));
        assert!(m.contains(299) && !m.contains(64) && !m.contains(5000));
        let mut sub = SourceMask::with_capacity(300);
        sub.insert(0);
        assert!(m.is_superset(&sub));
        sub.insert(1);
        assert!(!m.is_superset(&sub));
        m.clear();
        assert!(m.is_empty());
    }
}
