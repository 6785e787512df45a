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
}
