//! A shard's identity and limits ([`ShardConfig`]) and its straggler
//! detector's timers ([`AgingConfig`]).

use std::time::Duration;

use crate::job::RateLimit;

/// Identity and limits of one shard of a switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardConfig {
    pub shard: u16,
    pub shard_count: u16,
    /// Changes on every switch start; announced to workers in `JoinAck`.
    pub incarnation: u32,
    /// Aggregation memory this shard may hand out to jobs, in bytes.
    pub memory_limit: u64,
    pub aging: AgingConfig,
    /// Wall-clock microseconds when the switch started: keyed jobs' sequence
    /// numbers count up from here, so a restarted switch continues above
    /// what its previous incarnation sent (docs/security.md).
    pub seal_clock_us: u64,
    /// Per-source rate limit of jobs that set none (whole switch; each
    /// shard enforces its share). None = unlimited.
    pub rate_limit: Option<RateLimit>,
    /// Most elements one datagram carries over the switch's data port
    /// without IP fragmentation (`fanin_wire::value::elems_fitting_mtu` of
    /// its MTU; `u32::MAX`: no limit). A job's packet size, announced in
    /// every JoinAck, is its `block_grad_max` capped to this.
    pub packet_elems_max: u32,
    /// How jobs get aggregation buffers: reserved at admission (SwitchML)
    /// or taken per block from memory every job shares (Trio-ML).
    pub memory_model: MemoryModel,
}

/// How a shard hands out the buffers of block records (docs/memory.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryModel {
    /// SwitchML's static pool: a job reserves two buffers per slot (the
    /// block and its shadow copy) when it is admitted; jobs' reservations
    /// never exceed the memory, and a job is never slowed by another.
    Reserved,
    /// Trio-ML's shared memory (§4): a block record takes a buffer when its
    /// first packet arrives and gives it back when it is freed, so jobs
    /// share the memory statistically and their caps (two buffers per
    /// slot) may add up to many times it. A job reserves its record and a
    /// floor it can always use: one buffer if its members are workers (who
    /// acknowledge the results they hold, so done blocks are freed in any
    /// slot, and its lowest block may take a later one's record), one per
    /// slot with child switches among them (docs/memory.md). Records
    /// beyond the floor wait for free memory (the back-pressure nack) and
    /// never take another job's.
    Pooled,
}

impl ShardConfig {
    /// A single-shard switch with `memory_limit` bytes.
    pub fn single(memory_limit: u64) -> Self {
        Self {
            shard: 0,
            shard_count: 1,
            incarnation: 1,
            memory_limit,
            aging: AgingConfig::default(),
            seal_clock_us: 1,
            rate_limit: None,
            packet_elems_max: u32::MAX,
            memory_model: MemoryModel::Pooled,
        }
    }
}

/// The straggler detector's timer threads (Trio §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgingConfig {
    /// N: scanners per job; scanner `i` visits slice `i` of the job's slots.
    pub scanners: u16,
    /// Consecutive unreferenced visits before a block ages (1 = Trio).
    pub checks: u8,
    /// Finest scan tick (`block_exp / (scanners * checks)`) the runtime's
    /// timers keep; a job asking for a finer one is refused at admission.
    pub min_tick: Duration,
    /// Skew-aware expiry: a block ages after `max(block_exp, S + 4V)` (S and
    /// V the mean and mean deviation of the job's recent complete blocks'
    /// spreads, first to last contribution), at most `max_factor` ×
    /// `block_exp` (docs/stragglers.md). 1 = Trio's fixed timeout.
    pub max_factor: u8,
    /// The N scanners run as timer threads of their own (the daemon's, on
    /// other cores), as Trio's do: the shard's `handle_timeout` no longer
    /// visits, and the threads hand the blocks they find idle to
    /// `ValueSwitch::age_idle`. False: the shard visits between batches.
    pub threads: bool,
}

impl Default for AgingConfig {
    fn default() -> Self {
        Self { scanners: 8, checks: 4, min_tick: Duration::from_micros(20), max_factor: 16, threads: false }
    }
}

/// Most scanners per job.
pub const MAX_SCANNERS: u16 = 1024;
/// Most checks: the count lives in Trio's 4-bit `age_op` field.
pub const MAX_CHECKS: u8 = 15;

impl AgingConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.scanners == 0 || self.scanners > MAX_SCANNERS {
            return Err(format!("aging.scanners {} is out of range (1..={MAX_SCANNERS})", self.scanners));
        }
        if self.checks == 0 || self.checks > MAX_CHECKS {
            return Err(format!("aging.checks {} is out of range (1..={MAX_CHECKS})", self.checks));
        }
        if self.max_factor == 0 || self.checks as u32 * self.max_factor as u32 > u8::MAX as u32 {
            return Err(format!(
                "aging.max_factor {} is out of range (1..={} with checks {}: checks x max_factor visits must fit 255)",
                self.max_factor,
                u8::MAX / self.checks,
                self.checks
            ));
        }
        Ok(())
    }

    /// The scan tick for a timeout of `block_exp_ms`.
    pub fn tick(&self, block_exp_ms: u32) -> Duration {
        Duration::from_millis(block_exp_ms as u64) / (self.scanners as u32 * self.checks as u32)
    }
}
