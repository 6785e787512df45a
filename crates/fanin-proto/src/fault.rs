//! Seeded fault injection: drop decisions that replay exactly for a seed.
//! Used by the daemon (ingress/egress), the host runtime (worker send), the
//! simulator and tests. Nothing global: each injector owns its generator.

/// SplitMix64: tiny, fast, and good enough for drop decisions.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Drops each datagram independently with probability `p`.
#[derive(Debug, Clone)]
pub struct DropInjector {
    probability: f64,
    rng: SplitMix64,
    dropped: u64,
}

impl DropInjector {
    /// `probability` must lie in [0, 1]; validated by the configuration layer.
    pub fn new(probability: f64, seed: u64) -> Self {
        Self { probability: probability.clamp(0.0, 1.0), rng: SplitMix64::new(seed), dropped: 0 }
    }
    pub fn disabled() -> Self {
        Self::new(0.0, 0)
    }
    pub fn is_enabled(&self) -> bool {
        self.probability > 0.0
    }
    /// Decide the fate of the next datagram.
    pub fn should_drop(&mut self) -> bool {
        if self.probability <= 0.0 {
            return false;
        }
        let drop = self.rng.next_f64() < self.probability;
        self.dropped += drop as u64;
        drop
    }
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// Probabilities of the faults injected on received datagrams (the switch's
/// ingress, a worker's receive path).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReceiveFaultRates {
    pub drop: f64,
    /// Process a datagram twice (a duplicated packet).
    pub duplicate: f64,
    /// Process a datagram after the one behind it in the same receive batch.
    pub reorder: f64,
}

/// How many datagrams each kind of receive fault touched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiveFaultCounts {
    pub dropped: u64,
    pub duplicated: u64,
    pub reordered: u64,
}

/// Seeded drop, duplication and reordering of a receive batch, without a
/// qdisc (netem is not available everywhere): the daemon asks for the order
/// in which to process the batch's datagrams and processes exactly that.
#[derive(Debug, Clone)]
pub struct ReceiveFaults {
    rates: ReceiveFaultRates,
    rng: SplitMix64,
    counts: ReceiveFaultCounts,
}

impl ReceiveFaults {
    /// Rates must lie in [0, 1]; validated by the configuration layer.
    pub fn new(rates: ReceiveFaultRates, seed: u64) -> Self {
        let clamp = |p: f64| p.clamp(0.0, 1.0);
        let rates = ReceiveFaultRates { drop: clamp(rates.drop), duplicate: clamp(rates.duplicate), reorder: clamp(rates.reorder) };
        Self { rates, rng: SplitMix64::new(seed), counts: ReceiveFaultCounts::default() }
    }

    pub fn is_enabled(&self) -> bool {
        self.rates.drop > 0.0 || self.rates.duplicate > 0.0 || self.rates.reorder > 0.0
    }

    /// Write into `order` the indices of a batch of `n` datagrams in the
    /// order to process them: dropped ones left out, duplicated ones twice
    /// in a row, a reordered one swapped with its successor (the last of
    /// a batch has none and is never reordered).
    pub fn schedule(&mut self, n: usize, order: &mut Vec<usize>) {
        order.clear();
        if !self.is_enabled() {
            order.extend(0..n);
            return;
        }
        // A datagram held back to go after its successor: (index, copies).
        let mut held: Option<(usize, usize)> = None;
        for i in 0..n {
            if self.rates.drop > 0.0 && self.rng.next_f64() < self.rates.drop {
                self.counts.dropped += 1;
                continue;
            }
            let copies = if self.rates.duplicate > 0.0 && self.rng.next_f64() < self.rates.duplicate {
                self.counts.duplicated += 1;
                2
            } else {
                1
            };
            if held.is_none() && i + 1 < n && self.rates.reorder > 0.0 && self.rng.next_f64() < self.rates.reorder {
                held = Some((i, copies));
                continue;
            }
            order.extend(std::iter::repeat_n(i, copies));
            if let Some((h, c)) = held.take() {
                self.counts.reordered += 1;
                order.extend(std::iter::repeat_n(h, c));
            }
        }
        if let Some((h, c)) = held {
            // Everything after it was dropped: it keeps its place after all.
            order.extend(std::iter::repeat_n(h, c));
        }
    }

    pub fn counts(&self) -> ReceiveFaultCounts {
        self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_decisions_and_rate_close_to_p() {
        let mut a = DropInjector::new(0.3, 7);
        let mut b = DropInjector::new(0.3, 7);
        let da: Vec<bool> = (0..10_000).map(|_| a.should_drop()).collect();
        let db: Vec<bool> = (0..10_000).map(|_| b.should_drop()).collect();
        assert_eq!(da, db);
        let rate = a.dropped() as f64 / 10_000.0;
        assert!((rate - 0.3).abs() < 0.02, "rate {rate}");
        assert!(!DropInjector::disabled().should_drop());
    }

    #[test]
    fn receive_schedule_counts_every_fault_it_makes() {
        let mut order = Vec::new();
        let mut off = ReceiveFaults::new(ReceiveFaultRates::default(), 1);
        off.schedule(5, &mut order);
        assert_eq!(order, vec![0, 1, 2, 3, 4]);

        let rates = ReceiveFaultRates { drop: 0.1, duplicate: 0.1, reorder: 0.2 };
        let mut f = ReceiveFaults::new(rates, 42);
        let (mut kept, mut seen_swap) = (0usize, false);
        for _ in 0..2000 {
            f.schedule(16, &mut order);
            kept += order.len();
            // Every index appears at most twice, and out-of-order pairs come from reordering.
            for w in order.windows(2) {
                seen_swap |= w[0] > w[1];
            }
            for i in 0..16 {
                assert!(order.iter().filter(|&&x| x == i).count() <= 2);
            }
        }
        let c = f.counts();
        assert_eq!(kept as u64, 2000 * 16 - c.dropped + c.duplicated);
        assert!(seen_swap && c.reordered > 0);
        let total = 2000.0 * 16.0;
        assert!((c.dropped as f64 / total - 0.1).abs() < 0.01, "{c:?}");
        // Same seed, same schedule.
        let (mut a, mut b) = (ReceiveFaults::new(rates, 9), ReceiveFaults::new(rates, 9));
        let (mut oa, mut ob) = (Vec::new(), Vec::new());
        a.schedule(64, &mut oa);
        b.schedule(64, &mut ob);
        assert_eq!(oa, ob);
    }

    #[test]
    fn a_reordered_datagram_goes_right_after_its_successor() {
        let mut f = ReceiveFaults::new(ReceiveFaultRates { drop: 0.0, duplicate: 0.0, reorder: 1.0 }, 3);
        let mut order = Vec::new();
        f.schedule(4, &mut order);
        assert_eq!(order, vec![1, 0, 3, 2]);
        assert_eq!(f.counts().reordered, 2);
        f.schedule(3, &mut order);
        assert_eq!(order, vec![1, 0, 2], "the last datagram of a batch has no successor");
    }
}
