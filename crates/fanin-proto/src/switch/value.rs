//! The value-stream aggregation program of one switch shard.
//!
//! Records follow Trio-ML (job records with caps, block records created by
//! the first packet of a block and removed once its result is no longer
//! needed); loss recovery follows SwitchML (source bitmaps, shadow copies).
//!
//! **Slots.** A job owns `block_cnt_max` slots; block `b` lives in slot
//! `b % block_cnt_max`, so the block table is a direct-mapped hash table keyed
//! by `(job_id, block_id)`. A worker sends block `b + block_cnt_max` only after
//! it has the result of block `b`, so a slot holds at most two records: the
//! block being aggregated and the *shadow copy* of the previous one, kept so a
//! member whose result was lost can still fetch it. The shadow is freed as
//! soon as the newer block completes (every member contributed to it, so every
//! member had the older result). Nobody is ever stranded, and memory per job
//! is bounded by `2 * block_cnt_max * block_grad_max` elements.
//!
//! **Exponents.** Float blocks travel as block floating point. A block's
//! shared exponent is negotiated either by an exponent-only round on the block
//! itself, or ahead of time: each data contribution to block `b` announces the
//! sender's exponent for block `b + block_cnt_max` in `next_exp`, and the
//! switch returns the maximum with `b`'s result (SwitchML's pipelining).
//!
//! **Stragglers** (Trio §5, docs/stragglers.md). A job with a block timeout
//! `block_exp` is scanned by N scanners, started `1/N` of a visit period
//! apart, each visiting `1/N` of the job's slots. A block record carries
//! Trio's recently-referenced (REF) flag, set when the record is created and
//! whenever a contribution is added to it; a visit clears the flag, and a
//! block found unreferenced on `checks` consecutive visits (visit period
//! `block_exp / checks`) ages out: its partial result goes to every member
//! with `degraded` set and `src_cnt` = the sources in it. `checks = 1` is
//! exactly Trio (a block ages between `block_exp` and `2 * block_exp` after
//! its last contribution); larger values tighten that to
//! `block_exp * (1 + 1/checks)`. A source missing from the aged blocks of
//! `slow_after_windows` consecutive windows is declared permanently slow:
//! members are notified and blocks stop waiting for it, until it contributes
//! to an open block again (it caught up) or rejoins.
//!
//! **Calling contract.** Admit jobs with [`ValueSwitch::add_job`]; feed every
//! datagram to [`ValueSwitch::handle_datagram`] with the current time and the
//! sender's address; call [`ValueSwitch::handle_timeout`] when
//! [`ValueSwitch::poll_timeout`] has passed; send what both wrote into the
//! [`Transmit`] sink. A [`Verdict::WrongShard`] datagram belongs to another
//! shard of the same switch.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use fanin_wire::value::{
    incarnation_tag, Dtype, JoinParams, Nack, NackReason, Packet, RecoverAnchor, Repr, SyncRequest, TrimCause, AGE_OP_AGED, JOIN_RECOVER, JOIN_ROUND_START,
    JOIN_SYNC, JOIN_WAIT, SYNC_NEWCOMER, ELEM_LEN, EXP_NONE, HEADER_LEN, MEMBERSHIP_FAILED, MEMBERSHIP_MISMATCH, MEMBERSHIP_READMITTED,
    MEMBERSHIP_RESTARTED, MEMBERSHIP_SLOW, NACK_TAG,
};
use fanin_wire::MessageType;

use super::guard::{shard_share, Admission, Liveness, SourceBuckets};
use super::Counters;
use crate::job::{shard_of, FailurePolicy, JobMode, JobSpec, JobSpecError, RateLimit, SWITCH_RANK_BASE};
use crate::mask::SourceMask;
use crate::serial::BlockSpace;
use crate::time::Time;
use crate::transmit::Transmit;
use sealing::{envelope, send, send_copy, Envelope, JobAuth, Peer};

/// The [`Reply`] of `job`: it borrows only the job fields it needs, and as a
/// macro (not a method) it leaves `job.slots` free for the caller to hold.
macro_rules! job_reply {
    ($job:ident, $counters:expr, $out:expr, $scratch:expr, from: $from:expr, from_src: $src:expr, uplink: $uplink:expr) => {
        Reply {
            job_id: $job.spec.job_id,
            block_cnt_max: $job.spec.block_cnt_max,
            members: &$job.members,
            member_count: $job.member_count,
            addrs: &$job.addrs,
            group: $job.spec.result_group.map(|g| (g, &$job.listens_on_group)),
            uplink: $uplink,
            auth: $job.auth.as_mut(),
            counters: $counters,
            from: $from,
            from_src: $src,
            out: $out,
            scratch: $scratch,
            tag: $job.tag,
        }
    };
}

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
}

impl ShardConfig {
    /// A single-shard switch with `memory_limit` bytes.
    pub fn single(memory_limit: u64) -> Self {
        Self { shard: 0, shard_count: 1, incarnation: 1, memory_limit, aging: AgingConfig::default(), seal_clock_us: 1, rate_limit: None }
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
}

impl Default for AgingConfig {
    fn default() -> Self {
        Self { scanners: 8, checks: 4, min_tick: Duration::from_micros(20) }
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
        Ok(())
    }

    /// The scan tick for a timeout of `block_exp_ms`.
    pub fn tick(&self, block_exp_ms: u32) -> Duration {
        Duration::from_millis(block_exp_ms as u64) / (self.scanners as u32 * self.checks as u32)
    }
}

/// A non-root switch's place in a job's aggregation tree (SwitchML++): where
/// its partial results go. A switch without one is the root (or the only
/// switch) and sends results down to its members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uplink<A> {
    /// The parent's data-plane address of each of its shards: the partial
    /// of block `b` goes to `parent[shard_of(job, b, block_cnt_max, parent.len())]`.
    pub parent: Vec<A>,
    /// This switch's source id at the parent (at least `SWITCH_RANK_BASE`).
    pub rank: u16,
}

/// Why a job was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error(transparent)]
    Invalid(#[from] JobSpecError),
    #[error("job {0} already exists")]
    Duplicate(u32),
    #[error("job {job_id} needs {needed} bytes of aggregation memory but only {available} of {limit} are free")]
    OutOfMemory { job_id: u32, needed: u64, available: u64, limit: u64 },
    #[error("job {job_id}: block_exp_ms {block_exp_ms} with {scanners} scanners x {checks} checks needs a scan every {tick:?}, finer than this switch's timers keep ({min_tick:?}); use a longer block_exp_ms or fewer aging.scanners/aging.checks")]
    AgingTooFine { job_id: u32, block_exp_ms: u32, scanners: u16, checks: u8, tick: Duration, min_tick: Duration },
    #[error("job {0} does not exist")]
    Unknown(u32),
    #[error("job {job_id}: {field} cannot change while the job runs (remove and re-admit it)")]
    Immutable { job_id: u32, field: &'static str },
    #[error("job {job_id}: tree rank {rank} must be at least {SWITCH_RANK_BASE} (ranks below name workers), and the parent needs at least one address")]
    BadUplink { job_id: u32, rank: u16 },
}

/// What the runtime must do with a datagram after the program saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Verdict {
    /// Handled (accepted, answered, or counted and dropped).
    Consumed,
    /// The block belongs to shard `n`; hand the datagram to it unchanged.
    WrongShard(u16),
    /// Handled, and a member joining a running job now starts at block
    /// `start`: every other shard of this switch must learn it too
    /// ([`ValueSwitch::admit_joiner`]), since each holds its own blocks,
    /// and whether it listens on the job's result group
    /// ([`ValueSwitch::set_listening`]).
    Joined { job_id: u32, member: u16, start: u32, listens: bool },
    /// Handled, and a member's Join changed whether it listens on the job's
    /// result group: every other shard must learn it too
    /// ([`ValueSwitch::set_listening`]), since each sends its own blocks'
    /// results.
    Listening { job_id: u32, member: u16, listens: bool },
    /// Handled, and the job's next round begins at block `start`
    /// (docs/protocol.md §4.12): every other shard must drop the old
    /// round's blocks and start there too ([`ValueSwitch::start_round`]);
    /// `member`, whose Join completed the barrier, does or does not listen
    /// on the result group.
    RoundStarted { job_id: u32, start: u32, member: u16, listens: bool },
    /// Handled, and the job's round ended (`cause`, `rank`: a
    /// [`RoundEnd`]): every other shard must drop its blocks and answer the
    /// old round's contributions (before `start`) with the round's end
    /// notice ([`ValueSwitch::end_round`]); `member` (= `rank`) does or does
    /// not listen on the result group.
    RoundEnded { job_id: u32, cause: u8, rank: u16, start: u32, member: u16, listens: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Collecting block exponents (exponent-only contributions).
    Exponent,
    /// Collecting data contributions.
    Data,
    /// Non-root switch: the exponent partial went to the parent; waiting
    /// for the parent's exponent.
    ExponentUp,
    /// Non-root switch: the data partial went to the parent; waiting for the
    /// parent's result.
    DataUp,
    /// Result emitted; kept for retransmissions.
    Done,
}

/// A block record (Trio-ML `trio_ml_block_ctx_t`).
#[derive(Debug)]
struct Block {
    block_id: u32,
    gen_id: u16,
    dtype: Dtype,
    phase: Phase,
    /// The exponent was fixed by an exponent-only round; data must match it.
    negotiated: bool,
    has_data: bool,
    final_block: bool,
    grad_cnt: u16,
    exp: i8,
    /// Maximum of the contributions' announcements for block + block_cnt_max.
    next_exp: i8,
    /// Sources counted in the current phase (`rcvd_mask`).
    rcvd: SourceMask,
    /// The aggregation buffer.
    sum: Vec<i32>,
    /// Trio's block_start_time: when the first packet arrived.
    start_time: Time,
    /// Sources this block waits for: the job's active sources when it was
    /// created (after an aged exponent round, the sources in that round).
    expected: SourceMask,
    expected_count: u16,
    /// How many of `expected` are in `rcvd`.
    expected_rcvd: u16,
    /// Trio's recently-referenced flag: set on creation and on every
    /// contribution added; cleared by the scanner.
    referenced: bool,
    /// Consecutive scanner visits that found the flag clear.
    idle_checks: u8,
    /// The block aged out (in either phase): its result is partial.
    aged: bool,
    /// Workers summed in the current phase: one per worker, a child
    /// switch's `src_cnt` per switch.
    workers: u16,
    /// A child switch's partial was itself partial.
    child_degraded: bool,
    /// Non-root switch: `(src_cnt, degraded)` of the parent's result, which
    /// is what the children get.
    parent_result: Option<(u16, bool)>,
    /// The parent refused the block as expired: the children are told so.
    expired_up: bool,
    /// Children's retransmissions since the cached partial last went up.
    asks_since_resend: u16,
}

impl Block {
    fn new(source_capacity: usize) -> Self {
        Self {
            block_id: 0,
            gen_id: 0,
            dtype: Dtype::Int32,
            phase: Phase::Data,
            negotiated: false,
            has_data: false,
            final_block: false,
            grad_cnt: 0,
            exp: EXP_NONE,
            next_exp: EXP_NONE,
            rcvd: SourceMask::with_capacity(source_capacity),
            sum: Vec::new(),
            start_time: Time::ZERO,
            expected: SourceMask::with_capacity(source_capacity),
            expected_count: 0,
            expected_rcvd: 0,
            referenced: false,
            idle_checks: 0,
            aged: false,
            workers: 0,
            child_degraded: false,
            parent_result: None,
            expired_up: false,
            asks_since_resend: 0,
        }
    }

    fn is_open(&self) -> bool {
        self.phase != Phase::Done
    }

    /// Collecting from the children (not waiting for the parent, not done):
    /// the phases the scanners age and slow-source declarations close.
    fn aggregating(&self) -> bool {
        matches!(self.phase, Phase::Exponent | Phase::Data)
    }

    /// Start a phase's collection afresh (the exponent round ended).
    fn restart_collection(&mut self) {
        self.rcvd.clear();
        self.expected_rcvd = 0;
        self.workers = 0;
        self.child_degraded = false;
    }

    /// Every source the block waits for has contributed in this phase, and
    /// at least one did: a result always sums at least one source (the
    /// sources it waited for may all have been declared slow meanwhile).
    fn satisfied(&self) -> bool {
        self.expected_rcvd >= self.expected_count && !self.rcvd.is_empty()
    }

    /// Count `src` (summing `weight` workers) in the current phase; false
    /// if it already was.
    fn receive(&mut self, src: usize, weight: u16) -> bool {
        if !self.rcvd.insert(src) {
            return false;
        }
        self.workers = self.workers.saturating_add(weight);
        if self.expected.contains(src) {
            self.expected_rcvd += 1;
        }
        self.referenced = true;
        self.idle_checks = 0;
        true
    }

    /// Stop waiting for `src` (declared permanently slow).
    fn forget(&mut self, src: usize) {
        if self.expected.remove(src) {
            self.expected_count -= 1;
            if self.rcvd.contains(src) {
                self.expected_rcvd -= 1;
            }
        }
    }

    fn reset(&mut self, block_id: u32, gen_id: u16, dtype: Dtype, exp_only: bool, now: Time, active: &SourceMask) {
        self.block_id = block_id;
        self.gen_id = gen_id;
        self.dtype = dtype;
        self.phase = if exp_only { Phase::Exponent } else { Phase::Data };
        self.negotiated = false;
        self.has_data = false;
        self.final_block = false;
        self.grad_cnt = 0;
        self.exp = EXP_NONE;
        self.next_exp = EXP_NONE;
        if self.rcvd.capacity() < active.capacity() {
            // the job grew (a member with a larger id joined)
            self.rcvd = SourceMask::with_capacity(active.capacity());
        }
        self.rcvd.clear();
        self.start_time = now;
        self.expected.clone_from(active);
        self.expected_count = active.count() as u16;
        self.expected_rcvd = 0;
        self.referenced = true;
        self.idle_checks = 0;
        self.aged = false;
        self.workers = 0;
        self.child_degraded = false;
        self.parent_result = None;
        self.expired_up = false;
        self.asks_since_resend = 0;
    }

    /// Header of this block's result (exponent-only while negotiating).
    fn result_repr(&self, job_id: u32, exp_only: bool, member_count: u16) -> Repr {
        let (src_cnt, degraded) = match self.parent_result {
            Some(from_parent) => from_parent,
            None => (
                self.workers,
                self.aged || self.child_degraded || (self.rcvd.count() as u16) < member_count,
            ),
        };
        Repr {
            msg_type: MessageType::Result,
            age_op: if self.aged { AGE_OP_AGED } else { 0 },
            final_block: self.final_block,
            degraded: !exp_only && degraded,
            exp_only,
            dtype: self.dtype,
            src_id: 0,
            src_cnt,
            gen_id: self.gen_id,
            job_id,
            block_id: self.block_id,
            grad_cnt: if exp_only { 0 } else { self.grad_cnt },
            exp: self.exp,
            next_exp: if exp_only { EXP_NONE } else { self.next_exp },
        }
    }
}

/// One slot of a job: the newest block and the shadow copy of its predecessor.
#[derive(Debug, Default)]
struct Slot {
    cur: Option<Block>,
    prev: Option<Block>,
    /// A freed record kept for reuse, so steady state allocates nothing.
    spare: Option<Block>,
}

/// A job record (Trio-ML `trio_ml_job_ctx_t`) as seen by one shard.
#[derive(Debug)]
struct Job<A> {
    spec: JobSpec,
    members: SourceMask,
    member_count: u16,
    /// Where each member's results go, learned from its packets.
    addrs: Vec<Option<A>>,
    /// Members whose latest Join said they listen on the job's result group
    /// (only kept when the job has one): completion results reach them there.
    listens_on_group: SourceMask,
    /// This shard's slots: global slot `k` is local slot `k / shard_count`.
    slots: Vec<Slot>,
    /// What the job costs the switch: `data_memory` (its aggregation
    /// buffers) plus its record ([`Job::record_bytes`]).
    memory: u64,
    data_memory: u64,
    /// First block id of the job's stream (the SwitchML++ sync offset).
    start_block: u32,
    /// An allreduce boundary of the running round and its generation: the
    /// round's first block and generation 1, or what a recovering member
    /// reported after this switch restarted. Sync joins are answered on
    /// the boundaries it fixes (join.rs `sync_start`).
    anchor: RecoverAnchor,
    /// Sources new blocks wait for: members minus the permanently slow.
    active: SourceMask,
    /// Per source: aged blocks it was missing from since it last contributed.
    missed_streak: Vec<u32>,
    /// Blocks still aggregating on this shard (the scanners idle at zero).
    open_blocks: usize,
    aging: Option<JobAging>,
    /// Where partial results go; none at the root.
    uplink: Option<Uplink<A>>,
    /// Sync requests forwarded toward the root: requesting worker -> the
    /// child it came through, so the root's answer finds its way down.
    pending_sync: HashMap<u16, u16>,
    /// Members whose sync join this (root) switch deferred: on a fresh job
    /// they wait for an active member to open the stream, but not for one
    /// another (if every member rejoins with sync, someone must go first).
    sync_waiting: BTreeSet<u16>,
    /// Members added to a running job that are not waited for until their
    /// sync answer passes this switch (it tells where they start).
    awaiting: SourceMask,
    /// Members that start at a later block than the stream: blocks before
    /// it do not wait for them.
    start_of: HashMap<u16, u32>,
    /// Root: the start block answered to each syncing worker, answered
    /// again to a repeated request so every switch on its path agrees.
    sync_answers: HashMap<u16, u32>,
    /// A keyed job's member keys, replay windows and sequence counter.
    auth: Option<JobAuth>,
    /// Per-source rate limits (this shard's share).
    buckets: SourceBuckets,
    /// Member timeout and the job's failure, if it failed.
    liveness: Liveness,
    /// This switch's incarnation tag (results and nacks carry it; worker
    /// contributions must carry it or 0).
    tag: u16,
    /// Recovery after a restart (docs/restart.md): the lowest block without
    /// a result each member reported in its `JOIN_RECOVER` join...
    recover_lows: HashMap<u16, u32>,
    /// ...and, once every member reported, the floor answered to all.
    recover_floor: Option<u32>,
    /// Rounds (docs/protocol.md §4.12): the member incarnation each member
    /// joined the running round with (0: none said).
    incarnations: Vec<u16>,
    /// The join barrier, between rounds and before the first one.
    barrier: Option<Barrier<A>>,
    /// Highest block opened on this shard in the running round.
    high_block: Option<u32>,
    /// The job's block ids and their order (they wrap at a multiple of
    /// `block_cnt_max`, crate::serial).
    space: BlockSpace,
}

/// Scanner schedule of one job: one tick every `block_exp / (N * checks)`;
/// tick `k` (counted from time zero) visits slice `k mod N`, so scanner `i`
/// fires at `i * period / N + j * period` with `period = block_exp / checks`.
#[derive(Debug)]
struct JobAging {
    tick: u64,
    slices: u64,
    checks: u8,
    next_tick: Time,
    /// Aged blocks a source may miss in a row before it is declared
    /// permanently slow (K windows of this shard's slots); 0 = never.
    slow_after_blocks: u64,
}

impl<A> Job<A> {
    /// Record whether `member` listens on the result group (only a job
    /// that has one keeps anyone as listening).
    fn set_listening(&mut self, member: u16, listens: bool) {
        if listens && self.spec.result_group.is_some() {
            self.listens_on_group.insert(member as usize);
        } else {
            self.listens_on_group.remove(member as usize);
        }
    }

    /// Bytes the job's record takes beyond its aggregation buffers (those
    /// are `data_memory`): the record, its per-member tables and masks, its
    /// slots and the block records they hold at most (two per slot, each
    /// with two source masks). Counted against the switch's memory limit
    /// like the buffers, so the number of jobs and members is bounded by it
    /// (issue: 6 256 jobs of 4 096 members took 2.3 GB that memory_used did
    /// not show).
    fn record_bytes(&self) -> u64 {
        use std::mem::size_of;
        let mask = |m: &SourceMask| m.capacity().div_ceil(64) * 8;
        let per_block = size_of::<Block>() + 2 * mask(&self.members);
        let maps = (self.pending_sync.capacity() + self.start_of.capacity() + self.sync_answers.capacity())
            * (size_of::<(u16, u32)>() + 8)
            + self.recover_lows.capacity() * (size_of::<(u16, u32)>() + 8);
        let bytes = size_of::<Job<A>>()
            + self.addrs.capacity() * size_of::<Option<A>>()
            + self.missed_streak.capacity() * size_of::<u32>()
            + self.incarnations.capacity() * size_of::<u16>()
            + [&self.members, &self.active, &self.awaiting, &self.listens_on_group].into_iter().map(mask).sum::<usize>()
            + self.liveness.heap_bytes()
            + self.buckets.heap_bytes()
            + self.auth.as_ref().map_or(0, JobAuth::heap_bytes)
            + self.slots.capacity() * (size_of::<Slot>() + 2 * per_block)
            + maps;
        bytes as u64
    }

    fn slot_of(&self, block_id: u32, shard_count: u16) -> usize {
        (block_id % self.spec.block_cnt_max) as usize / shard_count.max(1) as usize
    }
}

/// Value-stream aggregation for one shard. `A` is the address type of the
/// driver (a socket address in the daemon, a node id in the simulator).
#[derive(Debug)]
pub struct ValueSwitch<A> {
    config: ShardConfig,
    /// Ordered by job_id: timers walk the jobs, and the order of what they
    /// emit must not depend on a hash map's per-process random state (the
    /// simulator is reproducible from its seed). A shard holds few jobs, so
    /// the per-datagram lookup costs no more than hashing.
    jobs: BTreeMap<u32, Job<A>>,
    memory_used: u64,
    counters: Counters,
    /// Result datagrams are built once here and copied to every member.
    scratch: Vec<u8>,
    /// Above every sequence number a removed keyed job used: a job admitted
    /// again continues from here, so its members' windows accept it.
    seq_floor: u64,
}

impl<A: Copy + PartialEq> ValueSwitch<A> {
    pub fn new(config: ShardConfig) -> Self {
        Self { config, jobs: BTreeMap::new(), memory_used: 0, counters: Counters::default(), scratch: Vec::new(), seq_floor: 0 }
    }

    pub fn config(&self) -> &ShardConfig {
        &self.config
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Bytes of aggregation memory this shard has handed out.
    pub fn memory_used(&self) -> u64 {
        self.memory_used
    }

    pub fn job_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.jobs.keys().copied()
    }

    pub fn job(&self, job_id: u32) -> Option<&JobSpec> {
        self.jobs.get(&job_id).map(|j| &j.spec)
    }

    /// Sources of `job_id` this shard has declared permanently slow.
    pub fn slow_sources(&self, job_id: u32) -> Vec<u16> {
        let Some(job) = self.jobs.get(&job_id) else { return Vec::new() };
        job.members.iter().filter(|&m| !job.active.contains(m)).map(|m| m as u16).collect()
    }

    /// The member whose death failed `job_id` (failure policy `fail`).
    pub fn failed_member(&self, job_id: u32) -> Option<u16> {
        self.jobs.get(&job_id).and_then(|j| j.liveness.failed)
    }

    /// This shard's buckets for `spec` (its own limit, else the switch's).
    fn buckets_for(&self, spec: &JobSpec, capacity: usize) -> SourceBuckets {
        let limit = spec.rate_limit.or(self.config.rate_limit).map(|l| shard_share(l, self.config.shard_count));
        SourceBuckets::new(limit, capacity)
    }

    /// Number of slots of `spec` this shard owns.
    fn local_slot_count(&self, spec: &JobSpec) -> usize {
        let (shard, count) = (self.config.shard, self.config.shard_count);
        (0..spec.block_cnt_max).filter(|&k| shard_of(spec.job_id, k, spec.block_cnt_max, count) == shard).count()
    }

    /// Admit a job. Its memory is reserved up front, so an admitted job can
    /// never be starved by another one.
    pub fn add_job(&mut self, spec: JobSpec) -> Result<(), AdmitError> {
        spec.validate()?;
        if self.jobs.contains_key(&spec.job_id) {
            return Err(AdmitError::Duplicate(spec.job_id));
        }
        let local_slots = self.local_slot_count(&spec);
        let memory = match spec.mode {
            JobMode::Aggregate => 2 * local_slots as u64 * spec.block_grad_max as u64 * ELEM_LEN as u64,
            JobMode::Forward => 0,
        };
        let aging = if spec.block_exp_ms > 0 && spec.mode == JobMode::Aggregate {
            let cfg = self.config.aging;
            let tick = cfg.tick(spec.block_exp_ms);
            if tick < cfg.min_tick || tick.is_zero() {
                return Err(AdmitError::AgingTooFine {
                    job_id: spec.job_id,
                    block_exp_ms: spec.block_exp_ms,
                    scanners: cfg.scanners,
                    checks: cfg.checks,
                    tick,
                    min_tick: cfg.min_tick,
                });
            }
            Some(JobAging {
                tick: tick.as_nanos() as u64,
                slices: cfg.scanners as u64,
                checks: cfg.checks,
                next_tick: Time::ZERO,
                slow_after_blocks: spec.slow_after_windows as u64 * local_slots as u64,
            })
        } else {
            None
        };
        let capacity = spec.source_capacity();
        let mut members = SourceMask::with_capacity(capacity);
        for &m in &spec.members {
            members.insert(m as usize);
        }
        let slot_count = if spec.mode == JobMode::Aggregate {
            // global slot k maps to local k / shard_count; size for the largest
            (spec.block_cnt_max as usize).div_ceil(self.config.shard_count.max(1) as usize)
        } else {
            0
        };
        let first_seq = fanin_wire::auth::first_seq(self.config.shard, self.config.seal_clock_us).max(self.seq_floor);
        let auth = spec.key.map(|key| JobAuth::new(key, spec.job_id, &spec.members, first_seq));
        let buckets = self.buckets_for(&spec, capacity);
        let liveness = Liveness::new(spec.member_timeout(), capacity);
        let space = BlockSpace::new(spec.block_cnt_max);
        let job_id = spec.job_id;
        let mut job = Job {
            member_count: spec.members.len() as u16,
            active: members.clone(),
            members,
            addrs: vec![None; capacity],
            listens_on_group: SourceMask::with_capacity(capacity),
            slots: (0..slot_count).map(|_| Slot::default()).collect(),
            memory,
            data_memory: memory,
            start_block: 0,
            anchor: RecoverAnchor { block: 0, gen_id: 1 },
            missed_streak: vec![0; capacity],
            open_blocks: 0,
            aging,
            spec,
            uplink: None,
            pending_sync: HashMap::new(),
            sync_waiting: BTreeSet::new(),
            awaiting: SourceMask::with_capacity(capacity),
            start_of: HashMap::new(),
            sync_answers: HashMap::new(),
            auth,
            buckets,
            liveness,
            tag: incarnation_tag(self.config.incarnation),
            recover_lows: HashMap::new(),
            recover_floor: None,
            incarnations: vec![0; capacity],
            barrier: Some(Barrier::first()),
            high_block: None,
            space,
        };
        // The buffers and the record itself: what the job costs is what the
        // switch counts (and refuses past its limit).
        let needed = memory + job.record_bytes();
        let available = self.config.memory_limit.saturating_sub(self.memory_used);
        if needed > available {
            return Err(AdmitError::OutOfMemory { job_id, needed, available, limit: self.config.memory_limit });
        }
        job.memory = needed;
        self.memory_used += needed;
        self.jobs.insert(job_id, job);
        Ok(())
    }

    /// Remove a job and free its memory. Returns false if it did not exist.
    pub fn remove_job(&mut self, job_id: u32) -> bool {
        match self.jobs.remove(&job_id) {
            Some(job) => {
                self.memory_used -= job.memory;
                if let Some(auth) = &job.auth {
                    self.seq_floor = self.seq_floor.max(auth.next_seq());
                }
                true
            }
            None => false,
        }
    }

    /// This shard's tree role for `job_id` (none: root or single switch).
    pub fn uplink(&self, job_id: u32) -> Option<&Uplink<A>> {
        self.jobs.get(&job_id).and_then(|j| j.uplink.as_ref())
    }

    /// Change an admitted job while it runs (SwitchML++ runtime scaling):
    /// its members (in a tree: its children), its worker count and its
    /// tree role. Caps, timeout and mode cannot change. Open blocks stop
    /// waiting for members that left (which may complete them now). New
    /// members are waited for in new blocks, except those listed in
    /// `awaiting` (joining a running job): they are waited for only from
    /// the start block their sync answer names, once it passes this switch.
    /// A switch that becomes the root finishes the blocks it had sent up
    /// with what it has.
    pub fn update_job(
        &mut self,
        now: Time,
        spec: JobSpec,
        uplink: Option<Uplink<A>>,
        awaiting: &[u16],
        out: &mut impl Transmit<A>,
    ) -> Result<(), AdmitError> {
        spec.validate()?;
        let job_id = spec.job_id;
        if let Some(up) = &uplink {
            if up.rank < SWITCH_RANK_BASE || up.parent.is_empty() {
                return Err(AdmitError::BadUplink { job_id, rank: up.rank });
            }
        }
        let capacity = {
            let Some(job) = self.jobs.get(&job_id) else { return Err(AdmitError::Unknown(job_id)) };
            if let Some(field) = job.spec.fixed_field_changed(&spec) {
                return Err(AdmitError::Immutable { job_id, field });
            }
            spec.source_capacity().max(job.members.capacity())
        };
        let limits_changed = self.jobs[&job_id].spec.rate_limit != spec.rate_limit;
        let buckets = limits_changed.then(|| self.buckets_for(&spec, capacity));
        let job = self.jobs.get_mut(&job_id).expect("checked above");
        if let Some(b) = buckets {
            job.buckets = b;
        }
        job.buckets.grow(capacity);
        job.liveness.grow(capacity);
        job.liveness.timeout = spec.member_timeout();
        job.members.grow(capacity);
        job.active.grow(capacity);
        job.awaiting.grow(capacity);
        if job.addrs.len() < capacity {
            job.addrs.resize(capacity, None);
            job.incarnations.resize(capacity, 0);
            job.missed_streak.resize(capacity, 0);
        }
        for slot in &mut job.slots {
            for block in [&mut slot.cur, &mut slot.prev, &mut slot.spare].into_iter().flatten() {
                block.rcvd.grow(capacity);
                block.expected.grow(capacity);
            }
        }
        let mut new_members = SourceMask::with_capacity(capacity);
        for &m in &spec.members {
            new_members.insert(m as usize);
        }
        let left: Vec<usize> = job.members.iter().filter(|&m| !new_members.contains(m)).collect();
        let joined: Vec<usize> = new_members.iter().filter(|&m| !job.members.contains(m)).collect();
        for &m in &joined {
            if awaiting.contains(&(m as u16)) {
                job.awaiting.insert(m);
            } else {
                job.active.insert(m);
            }
            job.missed_streak[m] = 0;
        }
        for &m in &left {
            job.liveness.forget(m);
            job.active.remove(m);
            job.awaiting.remove(m);
            job.start_of.remove(&(m as u16));
            job.addrs[m] = None;
            job.pending_sync.retain(|_, via| *via as usize != m);
        }
        job.members = new_members;
        job.member_count = job.members.count() as u16;
        if let Some(auth) = job.auth.as_mut() {
            auth.set_members(&spec.members);
            auth.set_uplink_rank(uplink.as_ref().map(|u| u.rank));
        }
        job.spec = spec;
        let became_root = job.uplink.is_some() && uplink.is_none();
        job.uplink = uplink;
        let _ = now;
        // No block waits for a member that left.
        let mut newly_slow = Vec::new();
        for local in 0..job.slots.len() {
            let Some(block) = job.slots[local].cur.as_mut() else { continue };
            if block.aggregating() {
                for &m in &left {
                    block.forget(m);
                }
                if block.satisfied() {
                    close_phase(job, local, &mut self.counters, out, &mut self.scratch, &mut newly_slow);
                }
            } else if became_root && matches!(block.phase, Phase::ExponentUp | Phase::DataUp) {
                // The parent is gone: this switch completes what it sent up.
                if block.phase == Phase::DataUp {
                    job.open_blocks += 1; // close_phase counts it done again
                }
                block.phase = if block.phase == Phase::ExponentUp { Phase::Exponent } else { Phase::Data };
                close_phase(job, local, &mut self.counters, out, &mut self.scratch, &mut newly_slow);
            }
        }
        settle_slow_sources(job, &mut newly_slow, &mut self.counters, out, &mut self.scratch);
        // members added or removed change what the record costs
        let cost = job.data_memory + job.record_bytes();
        self.memory_used = self.memory_used - job.memory + cost;
        job.memory = cost;
        Ok(())
    }

    /// A member added to a running job starts at block `start` (another
    /// shard relayed its sync answer, see [`Verdict::Joined`]).
    pub fn admit_joiner(&mut self, job_id: u32, member: u16, start: u32) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            admit_joiner(job, member, start);
        }
    }

    /// Apply what another shard's Join handling changed (a [`Verdict`]
    /// other than `Consumed`/`WrongShard`): the one place a runtime with
    /// several shards passes them on, whatever carries them between shards.
    pub fn learn(&mut self, verdict: Verdict) {
        match verdict {
            Verdict::Consumed | Verdict::WrongShard(_) => {}
            Verdict::Joined { job_id, member, start, listens } => {
                self.admit_joiner(job_id, member, start);
                self.set_listening(job_id, member, listens);
            }
            Verdict::Listening { job_id, member, listens } => self.set_listening(job_id, member, listens),
            Verdict::RoundStarted { job_id, start, member, listens } => {
                self.start_round(job_id, start);
                self.set_listening(job_id, member, listens);
            }
            Verdict::RoundEnded { job_id, cause, rank, start, member, listens } => {
                self.end_round(job_id, RoundEnd { cause, rank }, start);
                self.set_listening(job_id, member, listens);
            }
        }
    }

    /// Another shard's [`Verdict::RoundStarted`]: the job's next round
    /// starts at block `start`.
    pub fn start_round(&mut self, job_id: u32, start: u32) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            reset_for_round(job, start);
        }
    }

    /// Another shard's [`Verdict::RoundEnded`]: the job's round is over
    /// (`end` says why) and the next starts at `start`.
    pub fn end_round(&mut self, job_id: u32, end: RoundEnd, start: u32) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            end_round(job, Some(end), start);
        }
    }

    /// Another shard's [`Verdict::Listening`] (or `Joined`): `member` does
    /// or does not listen on the job's result group now.
    pub fn set_listening(&mut self, job_id: u32, member: u16, listens: bool) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            job.set_listening(member, listens);
        }
    }

    /// Set the tree role of an admitted job (at admission: the controller
    /// admits, then places the job in its tree).
    pub fn set_uplink(&mut self, job_id: u32, uplink: Option<Uplink<A>>) -> Result<(), AdmitError> {
        if let Some(up) = &uplink {
            if up.rank < SWITCH_RANK_BASE || up.parent.is_empty() {
                return Err(AdmitError::BadUplink { job_id, rank: up.rank });
            }
        }
        let job = self.jobs.get_mut(&job_id).ok_or(AdmitError::Unknown(job_id))?;
        if let Some(auth) = job.auth.as_mut() {
            auth.set_uplink_rank(uplink.as_ref().map(|u| u.rank));
        }
        job.uplink = uplink;
        Ok(())
    }

    /// When [`handle_timeout`](Self::handle_timeout) must run next: the next
    /// scanner tick of a job with blocks still aggregating.
    pub fn poll_timeout(&self) -> Option<Time> {
        self.jobs
            .values()
            .filter(|j| j.open_blocks > 0)
            .flat_map(|j| [j.aging.as_ref().map(|a| a.next_tick), j.liveness.deadline()])
            .flatten()
            .min()
    }

    /// Run every scanner tick that is due: visit the tick's slice of the
    /// job's slots, clear REF flags, and age out blocks left unreferenced for
    /// `checks` visits (their partial results go out through `out`).
    pub fn handle_timeout(&mut self, now: Time, out: &mut impl Transmit<A>) {
        for job in self.jobs.values_mut() {
            if job.open_blocks > 0 && job.liveness.check_due(now) {
                check_members(job, now, &mut self.counters, out, &mut self.scratch);
            }
            let Some(aging) = job.aging.as_mut() else { continue };
            if job.open_blocks == 0 {
                continue;
            }
            // A runtime that fell behind (a long batch, a descheduled thread)
            // runs at most one round of the N scanners now: visiting a slice
            // twice at one instant would age blocks early.
            let (tick, slices) = (aging.tick, aging.slices);
            let late = now.as_nanos().saturating_sub(aging.next_tick.as_nanos()) / tick;
            if late >= slices {
                aging.next_tick = Time::from_nanos(aging.next_tick.as_nanos() + (late + 1 - slices) * tick);
            }
            let checks = aging.checks;
            let mut newly_slow = Vec::new();
            while job.open_blocks > 0 {
                let aging = job.aging.as_mut().expect("checked above");
                if aging.next_tick > now {
                    break;
                }
                let k = aging.next_tick.as_nanos() / tick;
                aging.next_tick = Time::from_nanos(aging.next_tick.as_nanos() + tick);
                let slice = (k % slices) as usize;
                self.counters.scans += 1;
                let n = job.slots.len();
                let (lo, hi) = (slice * n / slices as usize, (slice + 1) * n / slices as usize);
                for local in lo..hi {
                    let Some(block) = job.slots[local].cur.as_mut() else { continue };
                    if !block.aggregating() {
                        continue;
                    }
                    if block.referenced {
                        block.referenced = false;
                        block.idle_checks = 0;
                        continue;
                    }
                    block.idle_checks += 1;
                    if block.idle_checks >= checks {
                        age_out(job, local, &mut self.counters, out, &mut self.scratch, &mut newly_slow);
                    }
                }
                settle_slow_sources(job, &mut newly_slow, &mut self.counters, out, &mut self.scratch);
            }
        }
    }

    /// Process one datagram from `from`.
    pub fn handle_datagram(&mut self, now: Time, from: A, bytes: &[u8], out: &mut impl Transmit<A>) -> Verdict {
        self.counters.rx_datagrams += 1;
        // A keyed job's datagrams are verified before anything else is
        // looked at: a forgery or a replay changes nothing but a counter.
        let job = bytes.get(12..16).and_then(|b| self.jobs.get_mut(&u32::from_be_bytes([b[0], b[1], b[2], b[3]])));
        let job_known = job.is_some();
        let Some(bytes) = sealing::admit(job.and_then(|j| j.auth.as_mut()), job_known, bytes, &mut self.counters) else {
            return Verdict::Consumed;
        };
        let packet = match Packet::new_checked(bytes) {
            Ok(p) => p,
            Err(err) => {
                self.counters.count_malformed(&err);
                return Verdict::Consumed;
            }
        };
        match MessageType::from_u8(packet.msg_type_code()) {
            Ok(MessageType::Join) => self.handle_join(now, from, &packet, out),
            Ok(t @ (MessageType::Contribution | MessageType::Retransmission)) => {
                if t == MessageType::Retransmission {
                    self.counters.retransmissions += 1;
                }
                self.handle_contribution(now, from, &packet, out)
            }
            Ok(MessageType::Sync) => self.handle_sync(from, &packet, out),
            Ok(MessageType::Result | MessageType::Nack | MessageType::Membership | MessageType::JoinAck) => {
                self.handle_from_parent(from, &packet, out)
            }
            _ => {
                self.counters.protocol_violation += 1;
                Verdict::Consumed
            }
        }
    }

    fn handle_join(&mut self, now: Time, from: A, packet: &Packet<&[u8]>, out: &mut impl Transmit<A>) -> Verdict {
        let (job_id, member) = (packet.job_id(), packet.src_id());
        let listening = |sw: &Self| sw.jobs.get(&job_id).is_some_and(|j| j.listens_on_group.contains(member as usize));
        let before = listening(self);
        let verdict = self.answer_join_request(now, from, packet, out);
        let listens = listening(self);
        match verdict {
            Verdict::Consumed if listens != before => Verdict::Listening { job_id, member, listens },
            v => v,
        }
    }

    fn answer_join_request(&mut self, now: Time, from: A, packet: &Packet<&[u8]>, out: &mut impl Transmit<A>) -> Verdict {
        self.counters.joins += 1;
        let src = packet.src_id();
        let Some(job) = self.jobs.get_mut(&packet.job_id()) else {
            self.counters.unknown_job += 1;
            send_nack(&mut self.counters, out, from, Envelope::Plain, packet, NackReason::UnknownJob, packet.job_id());
            return Verdict::Consumed;
        };
        if !job.members.contains(src as usize) {
            self.counters.non_member += 1;
            let env = envelope(job.auth.as_mut(), Peer::Member(src as usize));
            send_nack(&mut self.counters, out, from, env, packet, NackReason::NotMember, src as u32);
            return Verdict::Consumed;
        }
        // A Join saying its member incarnation, to a job whose stream
        // position is decided here, takes part in the job's rounds: a new
        // process of a rank starts a new round (rounds.rs).
        let inc = packet.member_incarnation();
        let in_rounds = inc != 0 && packet.age_op() != JOIN_RECOVER && uses_rounds(job);
        let current = job.incarnations[src as usize];
        let new_process = in_rounds && current != 0 && current != inc;
        // A new process of a rank (or any Join after a restart ended the
        // round) goes to the barrier even on a failed job: a whole-job
        // restart starts afresh without the control plane.
        let restart_barrier = job.barrier.as_ref().is_some_and(|b| b.ended.is_some());
        if let Some(dead) = job.liveness.failed.filter(|_| !(in_rounds && (new_process || restart_barrier))) {
            let env = envelope(job.auth.as_mut(), Peer::Member(src as usize));
            send_nack(&mut self.counters, out, from, env, packet, NackReason::JobFailed, dead as u32);
            return Verdict::Consumed;
        }
        job.addrs[src as usize] = Some(from);
        // Every Join says afresh whether the worker listens on the group: a
        // worker that restarted without it gets unicast again.
        job.set_listening(src, packet.listens_on_group());
        job.liveness.heard(src as usize, now);
        if in_rounds {
            let sync = packet.age_op() == JOIN_SYNC;
            if let RoundJoin::Done(verdict) = join_round(job, &self.config, src, inc, from, sync, &mut self.counters, out) {
                return verdict;
            }
        }
        // A permanently slow source that rejoins is waited for again.
        if !job.active.contains(src as usize) && !job.awaiting.contains(src as usize) {
            readmit(job, src as usize, packet.block_id(), &mut self.counters, out, &mut self.scratch);
        }
        if packet.age_op() == JOIN_RECOVER {
            if inc != 0 {
                // a restarted switch learns the round's incarnations here
                job.incarnations[src as usize] = inc;
            }
            // (the body is there: Packet::new_checked sized it by age_op)
            let anchor = RecoverAnchor::parse(packet.payload()).ok();
            return recover_join(job, &self.config, src, from, packet.block_id(), anchor, &mut self.counters, out);
        }
        if packet.age_op() != JOIN_SYNC {
            // Joining with the others: the stream's start, which every
            // switch of the tree knows.
            let start = job.start_block;
            answer_join(job, &self.config, src, src, from, start, out);
            return joined(job, src, start);
        }
        let newcomer = job.awaiting.contains(src as usize);
        if job.uplink.is_some() {
            // Only the root knows the current block offset: ask it.
            job.pending_sync.insert(src, src);
            forward_sync(job, src, packet.block_id(), newcomer, &mut self.counters, out);
        } else if let Some(start) = sync_start(job, &self.config, src, src, packet.block_id(), newcomer) {
            answer_join_as(job, &self.config, src, src, from, start, 0, out);
            return joined(job, src, start.block);
        } else {
            self.counters.sync_deferred += 1;
        }
        Verdict::Consumed
    }

    /// A child switch forwards a worker's join toward the root.
    fn handle_sync(&mut self, from: A, packet: &Packet<&[u8]>, out: &mut impl Transmit<A>) -> Verdict {
        let Ok(request) = SyncRequest::parse(packet.payload()) else {
            self.counters.protocol_violation += 1;
            return Verdict::Consumed;
        };
        let Some(job) = self.jobs.get_mut(&packet.job_id()) else {
            self.counters.unknown_job += 1;
            return Verdict::Consumed;
        };
        let via = packet.src_id();
        if !job.members.contains(via as usize) || via < SWITCH_RANK_BASE {
            self.counters.non_member += 1;
            return Verdict::Consumed;
        }
        job.addrs[via as usize] = Some(from);
        job.pending_sync.insert(request.origin, via);
        let newcomer = request.flags & SYNC_NEWCOMER != 0 || job.awaiting.contains(via as usize);
        if job.uplink.is_some() {
            forward_sync(job, request.origin, request.align_blocks, newcomer, &mut self.counters, out);
        } else if let Some(start) = sync_start(job, &self.config, request.origin, via, request.align_blocks, newcomer) {
            answer_join_as(job, &self.config, request.origin, via, from, start, 0, out);
            return joined(job, via, start.block);
        } else {
            self.counters.sync_deferred += 1;
        }
        Verdict::Consumed
    }

    /// A datagram only a parent sends: a result, a refusal, a membership
    /// notice or the answer to a sync request. Relayed down the tree.
    fn handle_from_parent(&mut self, from: A, packet: &Packet<&[u8]>, out: &mut impl Transmit<A>) -> Verdict {
        let counters = &mut self.counters;
        let Some(job) = self.jobs.get_mut(&packet.job_id()) else {
            counters.unknown_job += 1;
            return Verdict::Consumed;
        };
        if !job.uplink.as_ref().is_some_and(|up| up.parent.contains(&from)) {
            // Workers never send these; and a root has no parent.
            counters.protocol_violation += 1;
            return Verdict::Consumed;
        }
        counters.from_parent += 1;
        let Ok(repr) = Repr::parse(packet) else {
            counters.protocol_violation += 1;
            return Verdict::Consumed;
        };
        match repr.msg_type {
            MessageType::JoinAck => {
                let Some(via) = job.pending_sync.remove(&repr.src_id) else {
                    counters.parent_stale += 1;
                    return Verdict::Consumed;
                };
                let Some(dest) = job.addrs.get(via as usize).copied().flatten() else {
                    counters.parent_stale += 1;
                    return Verdict::Consumed;
                };
                let Ok(mut params) = JoinParams::parse(packet.payload()) else {
                    counters.protocol_violation += 1;
                    return Verdict::Consumed;
                };
                // The worker talks to this switch's shards, not the root's,
                // and gets its results the way this switch sends them.
                params.incarnation = self.config.incarnation;
                params.shard_count = self.config.shard_count;
                params.results_on_group = job.listens_on_group.contains(via as usize);
                let env = envelope(job.auth.as_mut(), Peer::Member(via as usize));
                send(out, dest, repr.buffer_len(), env, |buf| {
                    let mut reply = Packet::new_unchecked(buf);
                    repr.emit(&mut reply);
                    params.emit(reply.payload_mut());
                });
                return joined(job, via, params.next_block);
            }
            MessageType::Membership => {
                broadcast(&job.members, &job.addrs, job.auth.as_mut(), out, packet.into_inner(), &mut counters.notices_sent);
            }
            MessageType::Nack => {
                let expired = Nack::parse(packet.payload()).is_ok_and(|n| n.reason == NackReason::BlockExpired);
                let local = job.slot_of(repr.block_id, self.config.shard_count);
                let slot = job.slots.get_mut(local);
                let block = slot.and_then(|s| {
                    [s.cur.as_mut(), s.prev.as_mut()].into_iter().flatten().find(|b| b.block_id == repr.block_id)
                });
                match block {
                    Some(block) if expired && block.is_open() => {
                        // The tree moved on without this subtree: the
                        // children record the block as missed.
                        if block.phase != Phase::DataUp {
                            job.open_blocks -= 1; // still counted as aggregating
                        }
                        block.phase = Phase::Done;
                        block.expired_up = true;
                        // the children are bound to this switch's incarnation
                        self.scratch.clear();
                        self.scratch.extend_from_slice(packet.into_inner());
                        if let Some(t) = self.scratch.get_mut(NACK_TAG) {
                            t.copy_from_slice(&job.tag.to_be_bytes());
                        }
                        broadcast(&job.members, &job.addrs, job.auth.as_mut(), out, &self.scratch, &mut counters.relayed_down);
                    }
                    // Other refusals (e.g. the parent is being reprogrammed):
                    // the children's retransmissions try again.
                    _ => counters.parent_stale += 1,
                }
            }
            MessageType::Result => {
                let owner = shard_of(job.spec.job_id, repr.block_id, job.spec.block_cnt_max, self.config.shard_count);
                if owner != self.config.shard {
                    counters.wrong_shard += 1;
                    return Verdict::WrongShard(owner);
                }
                let local = job.slot_of(repr.block_id, self.config.shard_count);
                let Some(slot) = job.slots.get_mut(local) else {
                    counters.parent_stale += 1;
                    return Verdict::Consumed;
                };
                let Some(block) = slot.cur.as_mut().filter(|b| b.block_id == repr.block_id && b.gen_id == repr.gen_id)
                else {
                    counters.parent_stale += 1;
                    return Verdict::Consumed;
                };
                // what the parent says goes down, never up again: no uplink
                let mut reply = job_reply!(job, counters, out, &mut self.scratch, from: None, from_src: 0, uplink: None);
                if repr.exp_only {
                    if matches!(block.phase, Phase::Exponent | Phase::ExponentUp) {
                        block.exp = repr.exp;
                        announce_exponent(block, &mut reply);
                    } else {
                        reply.counters.parent_stale += 1;
                    }
                    return Verdict::Consumed;
                }
                match block.phase {
                    Phase::Done => {
                        reply.counters.parent_stale += 1;
                        return Verdict::Consumed;
                    }
                    Phase::DataUp => {}
                    // The parent completed (aged) the block before this
                    // subtree's partial reached it.
                    Phase::Exponent | Phase::ExponentUp | Phase::Data => job.open_blocks -= 1,
                }
                let n = repr.grad_cnt as usize;
                block.sum.resize(n, 0);
                fanin_wire::value::read_elements(packet.payload(), &mut block.sum[..n]);
                block.grad_cnt = repr.grad_cnt;
                block.has_data = true;
                block.exp = repr.exp;
                block.next_exp = repr.next_exp;
                block.final_block = repr.final_block;
                block.aged |= repr.age_op == AGE_OP_AGED;
                block.parent_result = Some((repr.src_cnt, repr.degraded));
                block.phase = Phase::Done;
                reply.send_to_all(block, false);
                reply.counters.relayed_down += job.member_count as u64;
            }
            _ => counters.protocol_violation += 1,
        }
        Verdict::Consumed
    }

    fn handle_contribution(
        &mut self,
        now: Time,
        from: A,
        packet: &Packet<&[u8]>,
        out: &mut impl Transmit<A>,
    ) -> Verdict {
        let counters = &mut self.counters;
        let Some(job) = self.jobs.get_mut(&packet.job_id()) else {
            counters.unknown_job += 1;
            return Verdict::Consumed;
        };
        let src = packet.src_id() as usize;
        if !job.members.contains(src) {
            counters.non_member += 1;
            let env = envelope(job.auth.as_mut(), Peer::Member(src));
            send_nack(counters, out, from, env, packet, NackReason::NotMember, src as u32);
            return Verdict::Consumed;
        }
        if let Some(dead) = job.liveness.failed {
            let env = envelope(job.auth.as_mut(), Peer::Member(src));
            send_nack(counters, out, from, env, packet, NackReason::JobFailed, dead as u32);
            return Verdict::Consumed;
        }
        // A worker tags its contributions with the incarnation it joined
        // (0: untagged). Another tag was meant for a previous life of this
        // switch, whose blocks are gone: the worker must recover first.
        let tag = packet.src_cnt();
        if src < SWITCH_RANK_BASE as usize && tag != 0 && tag != job.tag {
            counters.stale_incarnation += 1;
            let env = envelope(job.auth.as_mut(), Peer::Member(src));
            send_nack(counters, out, from, env, packet, NackReason::StaleIncarnation, self.config.incarnation);
            return Verdict::Consumed;
        }
        if job.spec.mode == JobMode::Forward {
            if let Admission::Refuse { nack } = job.buckets.admit(src, now) {
                let env = envelope(job.auth.as_mut(), Peer::Member(src));
                rate_limited(counters, out, from, env, packet, nack);
                return Verdict::Consumed;
            }
            let env = envelope(job.auth.as_mut(), Peer::Member(src));
            reflect(counters, out, from, env, packet, job.tag);
            return Verdict::Consumed;
        }
        let block_id = packet.block_id();
        if !job.space.contains(block_id) {
            // past where the job's ids wrap: no worker sends it
            counters.out_of_window += 1;
            return Verdict::Consumed;
        }
        if let Some(end) = stale_round(job, block_id) {
            // The round this block belongs to has ended (rounds.rs).
            counters.stale_round += 1;
            notify_round_end(job, end, &[(src, from)], counters, out);
            return Verdict::Consumed;
        }
        let s = job.spec.block_cnt_max;
        let shard_count = self.config.shard_count;
        let owner = shard_of(job.spec.job_id, block_id, s, shard_count);
        if owner != self.config.shard {
            counters.wrong_shard += 1;
            return Verdict::WrongShard(owner);
        }
        // Only the owning shard charges the sender, once per datagram.
        if let Admission::Refuse { nack } = job.buckets.admit(src, now) {
            let env = envelope(job.auth.as_mut(), Peer::Member(src));
            rate_limited(counters, out, from, env, packet, nack);
            return Verdict::Consumed;
        }
        job.liveness.heard(src, now);
        if packet.grad_cnt() as u32 > job.spec.block_grad_max {
            counters.over_cap += 1;
            let env = envelope(job.auth.as_mut(), Peer::Member(src));
            send_nack(counters, out, from, env, packet, NackReason::TooManyElements, job.spec.block_grad_max);
            return Verdict::Consumed;
        }
        let dtype = Dtype::from_u8(packet.dtype_code()).expect("checked by new_checked");
        let exp_only = packet.exp_only();
        if exp_only && !dtype.is_block_floating_point() {
            counters.protocol_violation += 1;
            return Verdict::Consumed;
        }
        job.addrs[src] = Some(from);

        let local = job.slot_of(block_id, shard_count);
        let slot = &mut job.slots[local];
        // Find the record this packet belongs to: the slot's current block,
        // its shadow, or a new block if the packet opens the next use of the
        // slot.
        let (is_prev, opens) = match &slot.cur {
            None => {
                if job.space.before(block_id, job.start_block) {
                    let env = envelope(job.auth.as_mut(), Peer::Member(src));
                    expired(counters, out, from, env, packet, job.start_block, job.tag);
                    return Verdict::Consumed;
                }
                // The slot's first use may be any block: a worker that
                // joined a running job (or a switch added to its tree)
                // starts at the job's current offset, not at its start.
                (false, true)
            }
            Some(cur) if cur.block_id == block_id => (false, false),
            Some(cur) if job.space.add(cur.block_id, s) == block_id => {
                if cur.phase != Phase::Done {
                    // The job's block table has no room for this block yet:
                    // back-pressure, not a silent drop. The sender retries
                    // with a smaller window; by then the slot is free.
                    counters.slot_busy += 1;
                    let env = envelope(job.auth.as_mut(), Peer::Member(src));
                    send_trim_nack(counters, out, from, env, packet, TrimCause::MemoryExhausted);
                    return Verdict::Consumed;
                }
                (false, true)
            }
            Some(cur) => {
                if slot.prev.as_ref().is_some_and(|p| p.block_id == block_id) {
                    (true, false)
                } else if job.space.before(block_id, cur.block_id) {
                    // The job moved on without this source and the slot was
                    // reused: tell it, so it stops asking (a straggler).
                    let now_held = cur.block_id;
                    let env = envelope(job.auth.as_mut(), Peer::Member(src));
                    expired(counters, out, from, env, packet, now_held, job.tag);
                    return Verdict::Consumed;
                } else {
                    counters.out_of_window += 1;
                    return Verdict::Consumed;
                }
            }
        };
        if opens {
            open_block(slot, job.members.capacity(), block_id, packet, exp_only, now, &job.active, &job.start_of, job.space);
            job.high_block = Some(job.high_block.map_or(block_id, |h| job.space.later(h, block_id)));
            if job.open_blocks == 0 {
                job.liveness.arm(now);
            }
            job.open_blocks += 1;
            if let Some(aging) = job.aging.as_mut() {
                realign_scanners(aging, now, job.open_blocks);
            }
        }
        let block = if is_prev { slot.prev.as_ref() } else { slot.cur.as_ref() }.expect("located above");
        if block.gen_id != packet.gen_id() || block.dtype != dtype {
            counters.mismatch += 1;
            if block.dtype != dtype {
                let env = envelope(job.auth.as_mut(), Peer::Member(src));
                send_nack(counters, out, from, env, packet, NackReason::DtypeMismatch, block.dtype as u32);
            }
            return Verdict::Consumed;
        }
        // A child switch's partial sums `src_cnt` workers; a worker is one.
        let weight = if src >= SWITCH_RANK_BASE as usize { packet.src_cnt().max(1) } else { 1 };
        let outcome = {
            let mut reply = job_reply!(job, &mut *counters, &mut *out, &mut self.scratch,
                from: Some(from), from_src: src, uplink: job.uplink.as_ref());
            let block = if is_prev { slot.prev.as_mut() } else { slot.cur.as_mut() }.expect("located above");
            if exp_only {
                contribute_exponent(block, src, weight, packet.exp(), &mut reply)
            } else {
                contribute_data(block, src, weight, packet, &mut reply)
            }
        };
        if outcome.mismatch {
            let block = if is_prev { slot.prev.as_ref() } else { slot.cur.as_ref() }.expect("located above");
            let grad_cnt = block.grad_cnt;
            if uses_rounds(job) && job.barrier.is_none() {
                // A round runs (its members said their incarnations): every
                // member raises the same error, not just this one.
                let end = RoundEnd { cause: MEMBERSHIP_MISMATCH, rank: src as u16 };
                return finish_round(job, &self.config, end, None, counters, out);
            }
            let env = envelope(job.auth.as_mut(), Peer::Member(src));
            send_nack(counters, out, from, env, packet, NackReason::ShapeMismatch, grad_cnt as u32);
            return Verdict::Consumed;
        }
        if outcome.accepted {
            job.missed_streak[src] = 0;
        }
        let mut newly_slow = Vec::new();
        if outcome.completed {
            job.open_blocks -= 1;
            let block = slot.cur.as_ref().expect("only an open block completes, and it is current");
            account_missing(block, &job.members, &job.active, &mut job.missed_streak, job.aging.as_ref(), &mut newly_slow);
            // Every member contributed to the newer block, so every member had
            // the shadow's result: free it. After a partial result the shadow
            // stays until the slot is reused, for the stragglers that lack it.
            if block.rcvd.count() == job.member_count as usize {
                if let Some(old) = slot.prev.take() {
                    slot.spare = Some(old);
                }
            }
        }
        // A permanently slow source has caught up when it adds to an open
        // block, or sends the current block of a slot (not its shadow) even
        // if the others just completed it: it is within one window of them.
        if (outcome.accepted || (outcome.late && !is_prev)) && !job.active.contains(src) && !job.awaiting.contains(src) {
            readmit(job, src, block_id, counters, out, &mut self.scratch);
        }
        settle_slow_sources(job, &mut newly_slow, counters, out, &mut self.scratch);
        Verdict::Consumed
    }
}

/// Everything a contribution needs to answer: the job's members and their
/// addresses, the sender, the counters and the output sink.
struct Reply<'a, A, T> {
    job_id: u32,
    block_cnt_max: u32,
    members: &'a SourceMask,
    member_count: u16,
    addrs: &'a [Option<A>],
    /// The job's result group and the members listening on it.
    group: Option<(std::net::SocketAddrV4, &'a SourceMask)>,
    /// A non-root switch sends completed phases to its parent.
    uplink: Option<&'a Uplink<A>>,
    /// A keyed job's keys: every datagram is sealed for its destination.
    auth: Option<&'a mut JobAuth>,
    counters: &'a mut Counters,
    /// The sender of the datagram being handled (none for timer work).
    from: Option<A>,
    /// Its source id (meaningful when `from` is set).
    from_src: usize,
    out: &'a mut T,
    /// The result is built once here and copied to each destination.
    scratch: &'a mut Vec<u8>,
    /// This switch's incarnation tag, carried in results and nacks.
    tag: u16,
}

impl<A: Copy, T: Transmit<A>> Reply<'_, A, T> {
    /// Send the result to every member with a known address (members that
    /// never sent anything fetch it by retransmitting): once to the job's
    /// result group for the members listening there, if the runtime can
    /// reach groups, and to each other member's own address.
    fn send_to_all(&mut self, block: &Block, exp_only: bool) {
        build_result(block, self.job_id, exp_only, self.member_count, self.tag, self.scratch);
        if let Some((group, listeners)) = self.group {
            // (a keyed job has no group: validation refuses it)
            let any = self.members.iter().any(|id| listeners.contains(id));
            if any && self.auth.is_none() && self.out.push_group(group, self.scratch) {
                self.counters.results_to_group += 1;
                let rest = self.members.iter().filter(|&id| !listeners.contains(id));
                let dests = rest.filter_map(|id| self.addrs.get(id).copied().flatten());
                self.counters.results_sent += self.out.push_fanout(dests, self.scratch) as u64;
                return;
            }
        }
        broadcast(self.members, self.addrs, self.auth.as_deref_mut(), self.out, self.scratch, &mut self.counters.results_sent);
    }

    /// Send the result again to the sender only.
    fn send_to_sender(&mut self, block: &Block, exp_only: bool) {
        let Some(from) = self.from else { return };
        build_result(block, self.job_id, exp_only, self.member_count, self.tag, self.scratch);
        send_copy(self.out, from, self.scratch, envelope(self.auth.as_deref_mut(), Peer::Member(self.from_src)));
        self.counters.results_resent += 1;
    }

    /// Send this switch's partial (exponent or data) to the parent, as one
    /// source summing `block.workers` workers. `again` marks a resend from
    /// the cached partial, answering a child's retransmission.
    fn send_up(&mut self, block: &Block, exp_only: bool, again: bool) {
        let Some(up) = self.uplink else { return };
        let repr = Repr {
            msg_type: if again { MessageType::Retransmission } else { MessageType::Contribution },
            src_id: up.rank,
            ..block.result_repr(self.job_id, exp_only, self.member_count)
        };
        let shard = shard_of(self.job_id, block.block_id, self.block_cnt_max, up.parent.len() as u16);
        let env = envelope(self.auth.as_deref_mut(), Peer::Parent);
        send(self.out, up.parent[shard as usize], repr.buffer_len(), env, |buf| {
            let mut packet = Packet::new_unchecked(buf);
            repr.emit(&mut packet);
            if !exp_only {
                fanin_wire::value::write_elements(&block.sum[..block.grad_cnt as usize], packet.payload_mut());
            }
        });
        if again {
            self.counters.resent_up += 1;
        } else {
            self.counters.sent_up += 1;
        }
    }

    /// The parent refused this block as expired: pass that on to the sender.
    fn nack_expired(&mut self, block_id: u32) {
        let Some(from) = self.from else { return };
        let repr = Repr { block_id, ..Repr::new(MessageType::Nack, self.job_id, 0) };
        let env = envelope(self.auth.as_deref_mut(), Peer::Member(self.from_src));
        let tag = self.tag;
        send(self.out, from, HEADER_LEN + Nack::LEN, env, |buf| {
            let mut reply = Packet::new_unchecked(&mut buf[..]);
            repr.emit(&mut reply);
            Nack { reason: NackReason::BlockExpired, detail: block_id }.emit(reply.payload_mut());
            buf[NACK_TAG].copy_from_slice(&tag.to_be_bytes());
        });
        self.counters.nacks_sent += 1;
    }

    fn nack(&mut self, request: &Packet<&[u8]>, reason: NackReason, detail: u32) {
        let Some(from) = self.from else { return };
        let env = envelope(self.auth.as_deref_mut(), Peer::Member(self.from_src));
        send_nack(self.counters, self.out, from, env, request, reason, detail);
    }
}

/// What a contribution did to its block.
#[derive(Debug, Default, Clone, Copy)]
struct Outcome {
    /// It was counted (not a duplicate, not refused).
    accepted: bool,
    /// It completed the block: the final result went out.
    completed: bool,
    /// A data contribution to a block already emitted without its source.
    late: bool,
    /// A data contribution that does not line up with the block's (another
    /// element count or `final` bit): the members disagree on the length.
    mismatch: bool,
}

mod sealing;
mod trimming;
mod join;
mod aggregate;
mod membership;
mod nacks;
mod rounds;

use join::*;
use aggregate::*;
use membership::*;
use nacks::*;
pub use rounds::RoundEnd;
use rounds::*;

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod guard_tests;
