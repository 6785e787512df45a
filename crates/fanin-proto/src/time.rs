//! Time as data. Machines never read a clock: every call takes `now`.
//! Integer nanoseconds keep the simulator exact and deterministic.

use core::ops::{Add, Sub};
use core::time::Duration;

/// A point in time, in nanoseconds since an epoch the driver chooses
/// (process start for the daemon, zero for the simulator and the tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(u64);

impl Time {
    pub const ZERO: Time = Time(0);

    pub const fn from_nanos(ns: u64) -> Self {
        Time(ns)
    }
    pub const fn as_nanos(self) -> u64 {
        self.0
    }
    pub fn from_secs_f64(s: f64) -> Self {
        Time((s * 1e9) as u64)
    }
    /// Time elapsed since `earlier`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Time {
    type Output = Time;
    fn add(self, d: Duration) -> Time {
        Time(self.0.saturating_add(d.as_nanos().min(u64::MAX as u128) as u64))
    }
}

impl Sub<Time> for Time {
    type Output = Duration;
    fn sub(self, earlier: Time) -> Duration {
        self.saturating_since(earlier)
    }
}
