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
//! **Memory** (docs/memory.md). [`MemoryModel::Reserved`] reserves that
//! bound at admission (SwitchML). [`MemoryModel::Pooled`] is Trio-ML's
//! shared memory: a job reserves one buffer per slot; a shadow copy takes a
//! buffer from the shard's free memory when its slot's next block opens and
//! gives it back when freed, so jobs' caps may add up to twice the memory.
//! With none free the next block waits (a Trimmed nack, `MemoryExhausted`)
//! until every member that was in the done block has sent it (so has the
//! older result), then takes the done block's own record.
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
    incarnation_tag, Dtype, JoinParams, Nack, NackReason, Packet, RecoverAnchor, Repr, SyncRequest, TrimCause, AGE_OP_AGED, AGE_OP_CONGESTED, JOIN_ALL_DONE, JOIN_DONE, JOIN_RECOVER, JOIN_ROUND_START,
    JOIN_SYNC, JOIN_WAIT, SYNC_NEWCOMER, ELEM_LEN, EXP_NONE, HEADER_LEN, MEMBERSHIP_FAILED, MEMBERSHIP_MISMATCH, MEMBERSHIP_READMITTED,
    MEMBERSHIP_RESTARTED, MEMBERSHIP_SLOW, NACK_TAG,
};
use fanin_wire::MessageType;

use super::guard::{shard_share, Admission, Liveness, SourceBuckets};
use super::Counters;
use crate::job::{job_shards, shard_of, FailurePolicy, JobMode, JobSpec, JobSpecError, SWITCH_RANK_BASE};
use crate::mask::SourceMask;
use crate::serial::BlockSpace;
use crate::time::Time;
use crate::transmit::Transmit;
use sealing::{envelope, send, send_copy, Envelope, JobAuth, Peer};

/// One job's straggler scan on one shard, for a scanner thread: visit
/// slice `i` of `slices` of `board` at `(i + k * slices) * tick_ns`
/// nanoseconds of the shard's clock, and hand what it names to the shard
/// ([`ValueSwitch::age_idle`]).
#[derive(Debug, Clone)]
pub struct ScanSchedule {
    pub job_id: u32,
    pub tick_ns: u64,
    pub slices: u64,
    pub board: std::sync::Arc<AgingBoard>,
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
    #[error("job {job_id} was admitted with complete results only (no quorum, no aging, on_failure = fail), and its workers joined refusing partial ones: a quorum, aging or on_failure = degrade cannot be added while it runs. Admit it with quorum = its member count (every member; K can then change at runtime), or remove and re-admit it")]
    PartialResultsAdded { job_id: u32 },
    #[error("job {job_id}: {workers} workers is more than the {admitted} it was admitted for (its workers scale block floating point and averages for {admitted}): admit it with workers = the most it will ever have, or remove and re-admit it")]
    WorkersGrown { job_id: u32, workers: u16, admitted: u16 },
    #[error("job {job_id}: member {member} cannot be added to this tree switch as an active member: the job's stream has run here without rounds, so its Join would be answered from the stream's start, where this switch and those above hold results it took no part in (or an earlier process of it did). Add it as awaiting (a sync join: the controller's subscribe with sync=True, fanin.Session(sync_join=True)), or remove the job from every switch and admit it again for a new run")]
    PlainMemberIntoRunningTree { job_id: u32, member: u16 },
    #[error("job {job_id}: tree rank {rank} must be at least {SWITCH_RANK_BASE} (ranks below name workers), and the parent needs at least one address")]
    BadUplink { job_id: u32, rank: u16 },
    #[error("job {job_id}: a transit needs the next hop's address of each of this switch's {shards} shards, got {hops}: every switch on a worker's path must run the same number of shards (a worker picks the shard from the aggregation node's answer)")]
    BadTransit { job_id: u32, hops: usize, shards: u16 },
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
    /// Handled, and the restarted job's recovery floor is known (every
    /// member reported, docs/restart.md): its stream resumes at `floor`,
    /// which every other shard must learn too ([`ValueSwitch::resume`]).
    /// `member`, whose recovery Join completed the floor, does or does not
    /// listen on the result group.
    Recovered { job_id: u32, floor: u32, member: u16, listens: bool },
    /// Handled, and a recovery began on a job with child switches (its
    /// first recovery Join): every other shard drops the children's
    /// partials and refuses them until the floor is known
    /// ([`ValueSwitch::begin_recovery`], docs/restart.md "Trees").
    RecoveryBegun { job_id: u32 },
    /// Handled, and the job restarted its stream here because the parent
    /// restarted (`parent`: its incarnation, from its StaleIncarnation
    /// nack): every other shard restarts it too
    /// ([`ValueSwitch::restart_for_parent`]).
    ParentRestarted { job_id: u32, parent: u32 },
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
    /// Above every result-key epoch a removed keyed job reached: a job
    /// admitted again (the same key, e.g. re-created after it failed)
    /// starts its epochs here, so it never seals group results under a key
    /// that a member removed from it before already held.
    result_epoch_floor: u32,
    /// Jobs relayed for sources this switch does not aggregate (GOAT's
    /// on-path filtering, [`transit`]).
    transits: BTreeMap<u32, transit::Transit<A>>,
    /// The datagram being handled arrived with ECN Congestion Experienced
    /// ([`handle_datagram_ce`](Self::handle_datagram_ce)); false otherwise.
    rx_ce: bool,
}

impl<A: Copy + PartialEq> ValueSwitch<A> {
    pub fn new(config: ShardConfig) -> Self {
        Self {
            rx_ce: false,
            config,
            jobs: BTreeMap::new(),
            memory_used: 0,
            counters: Counters::default(),
            scratch: Vec::new(),
            seq_floor: 0,
            result_epoch_floor: 0,
            transits: BTreeMap::new(),
        }
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
        // (shared by the shards that hold the job's slots)
        let spread = job_shards(spec.block_cnt_max, self.config.shard_count);
        let limit = spec.rate_limit.or(self.config.rate_limit).map(|l| shard_share(l, spread));
        SourceBuckets::new(limit, capacity)
    }

    /// Number of slots of `spec` this shard owns.
    fn local_slot_count(&self, spec: &JobSpec) -> usize {
        let (shard, count) = (self.config.shard, self.config.shard_count);
        (0..spec.block_cnt_max).filter(|&k| shard_of(spec.job_id, k, spec.block_cnt_max, count) == shard).count()
    }

    /// Admit a job. With [`MemoryModel::Reserved`] its buffers are reserved
    /// up front, so an admitted job can never be starved by another one;
    /// with [`MemoryModel::Pooled`] only its record and floor are, and its
    /// cap (two buffers per slot) must fit the shard's memory by itself.
    pub fn add_job(&mut self, spec: JobSpec) -> Result<(), AdmitError> {
        spec.validate()?;
        if self.jobs.contains_key(&spec.job_id) {
            return Err(AdmitError::Duplicate(spec.job_id));
        }
        let local_slots = self.local_slot_count(&spec);
        let record_cost = spec.block_grad_max as u64 * ELEM_LEN as u64;
        // the job's cap: a block and its shadow in every slot
        let cap = match spec.mode {
            JobMode::Aggregate => 2 * local_slots as u64 * record_cost,
            JobMode::Forward => 0,
        };
        let pool_floor = match self.config.memory_model {
            // (a tree role set later may raise it: set_uplink)
            MemoryModel::Pooled if spec.mode == JobMode::Aggregate => Some(pool_floor(&spec, local_slots, false)),
            _ => None,
        };
        let memory = pool_floor.map_or(cap, |floor| floor as u64 * record_cost);
        let slot_count = if spec.mode == JobMode::Aggregate {
            // global slot k maps to local k / job_shards; size for the largest
            (spec.block_cnt_max as usize).div_ceil(job_shards(spec.block_cnt_max, self.config.shard_count) as usize)
        } else {
            0
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
                needed_checks: cfg.checks,
                max_checks: cfg.checks.saturating_mul(cfg.max_factor),
                clock: Time::ZERO,
                spread: SpreadSamples::default(),
                board: std::sync::Arc::new(AgingBoard::new(slot_count, cfg.checks)),
            })
        } else {
            None
        };
        let capacity = spec.source_capacity();
        let mut members = SourceMask::with_capacity(capacity);
        for &m in &spec.members {
            members.insert(m as usize);
        }
        let first_seq = fanin_wire::auth::first_seq(self.config.shard, self.config.seal_clock_us).max(self.seq_floor);
        let group = spec.result_group.map(|_| (self.config.incarnation, self.result_epoch_floor));
        let auth = spec.key.map(|key| JobAuth::new(key, spec.job_id, &spec.members, first_seq, group));
        let buckets = self.buckets_for(&spec, capacity);
        let liveness = Liveness::new(spec.member_timeout(), capacity);
        let space = BlockSpace::new(spec.block_cnt_max);
        let job_id = spec.job_id;
        let resumed_with_children = spec.resumed && has_child_switches(&spec);
        let mut job = Job {
            member_count: spec.members.len() as u16,
            scale_workers: spec.worker_count(),
            active: members.clone(),
            members,
            addrs: MemberAddrs::new(capacity),
            listens_on_group: SourceMask::with_capacity(capacity),
            slots: (0..slot_count).map(|_| Slot::default()).collect(),
            memory,
            data_memory: memory,
            record_cost,
            pool_floor,
            live_records: 0,
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
            sync_moved: HashMap::new(),
            auth,
            buckets,
            liveness,
            incarnation: self.config.incarnation,
            tag: incarnation_tag(self.config.incarnation),
            parent_restart: None,
            earlier_tag: None,
            // installed again after a restart: the child switches report
            // before their partials count (parent_restart.rs)
            switches_rejoin: resumed_with_children,
            ce_echo_up: false,
            last_probe_up: None,
            done_at: HashMap::new(),
            all_done_above: None,
            recover_lows: HashMap::new(),
            recover_floor: None,
            start_settled: false,
            incarnations: vec![MemberIncarnation::NONE; capacity],
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
        if pool_floor.is_some() && cap + job.record_bytes() > self.config.memory_limit {
            // a cap beyond the whole memory could never be reached
            let needed = cap + job.record_bytes();
            return Err(AdmitError::OutOfMemory { job_id, needed, available, limit: self.config.memory_limit });
        }
        job.memory = needed;
        self.memory_used += needed;
        self.jobs.insert(job_id, job);
        Ok(())
    }

    /// Remove a job and free its memory. Returns false if it did not exist.
    pub fn remove_job(&mut self, job_id: u32) -> bool {
        self.remove_job_as(job_id, true)
    }

    /// Undo an admission that failed on another shard (or at its tree
    /// role) before the job ran: as [`remove_job`](Self::remove_job), but
    /// the result-key epochs go on where they were, so that shards which
    /// admitted the job and shards which did not keep agreeing on them.
    pub fn undo_add_job(&mut self, job_id: u32) -> bool {
        self.remove_job_as(job_id, false)
    }

    fn remove_job_as(&mut self, job_id: u32, ran: bool) -> bool {
        match self.jobs.remove(&job_id) {
            Some(job) => {
                self.memory_used -= job.memory;
                if let Some(auth) = &job.auth {
                    self.seq_floor = self.seq_floor.max(auth.next_seq());
                    if ran {
                        self.result_epoch_floor = self.result_epoch_floor.max(auth.next_result_epoch());
                    }
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
        let job_id = spec.job_id;
        let (capacity, new_floor) = self.check_update(&spec, uplink.as_ref(), awaiting)?;
        let limits_changed = self.jobs[&job_id].spec.rate_limit != spec.rate_limit;
        let buckets = limits_changed.then(|| self.buckets_for(&spec, capacity));
        let job = self.jobs.get_mut(&job_id).expect("checked above");
        let had_rounds = uses_rounds(job);
        if let Some(b) = buckets {
            job.buckets = b;
        }
        if new_floor.is_some() {
            job.pool_floor = new_floor;
            job.settle_memory(&mut self.memory_used);
        }
        job.buckets.grow(capacity);
        job.liveness.grow(capacity);
        job.liveness.timeout = spec.member_timeout();
        job.members.grow(capacity);
        job.active.grow(capacity);
        job.awaiting.grow(capacity);
        if job.addrs.len() < capacity {
            job.addrs.grow(capacity);
            job.incarnations.resize(capacity, MemberIncarnation::NONE);
            job.missed_streak.resize(capacity, 0);
        }
        for slot in &mut job.slots {
            for block in [&mut slot.cur, &mut slot.prev, &mut slot.spare].into_iter().flatten() {
                block.rcvd.grow(capacity);
                block.expected.grow(capacity);
                block.moved_on.grow(capacity);
            }
        }
        let mut new_members = SourceMask::with_capacity(capacity);
        for &m in &spec.members {
            new_members.insert(m as usize);
        }
        let left: Vec<usize> = job.members.iter().filter(|&m| !new_members.contains(m)).collect();
        let joined: Vec<usize> = new_members.iter().filter(|&m| !job.members.contains(m)).collect();
        for &m in &joined {
            let sync = awaiting.contains(&(m as u16));
            if sync {
                job.awaiting.insert(m);
            } else {
                job.active.insert(m);
            }
            for block in job.slots.iter_mut().filter_map(|s| s.cur.as_mut()).filter(|b| b.aggregating()) {
                if block.rcvd.contains(m) {
                    // A rank added back while a block still holds what its
                    // old process sent before it left (a non-member's is
                    // refused): that stands for nobody now, and the new
                    // process's cannot be added. It lacks the member.
                    block.replaced = true;
                } else if !sync && job.space.at_or_after(block.block_id, job.start_block) {
                    // It starts with the others, at the stream's start (a
                    // plain Join's answer): the open blocks wait for it too,
                    // as for a member readmitted. (They did not, and a block
                    // the others completed went to it, without its data, as
                    // complete.)
                    block.expect(m);
                }
            }
            job.missed_streak[m] = 0;
        }
        for &m in &left {
            job.liveness.forget(m);
            job.active.remove(m);
            job.awaiting.remove(m);
            job.start_of.remove(&(m as u16));
            job.addrs.clear(m);
            job.pending_sync.retain(|_, (via, _)| *via as usize != m);
            // Nothing of its life here outlives it: added back later, the
            // rank is a new member (with its old incarnation kept, its new
            // process's plain Join read as a restart of a running rank and
            // ended the round for everyone; an old sync answer could give
            // it a start it is past).
            job.incarnations[m] = MemberIncarnation::NONE;
            job.sync_answers.remove(&(m as u16));
            job.sync_moved.remove(&(m as u16));
            job.done_at.remove(&(m as u16));
            job.recover_lows.remove(&(m as u16));
            job.listens_on_group.remove(m);
        }
        job.members = new_members;
        job.member_count = job.members.count() as u16;
        let mut new_result_key = false;
        if let Some(auth) = job.auth.as_mut() {
            new_result_key = auth.set_members(&spec.members);
            auth.set_uplink_rank(uplink.as_ref().map(|u| u.rank));
        }
        job.spec = spec;
        let became_root = job.uplink.is_some() && uplink.is_none();
        job.uplink = uplink;
        if !had_rounds && uses_rounds(job) {
            // The job's stream ran here without rounds (an inner switch, or
            // a root with child switches), and it runs on: the first
            // barrier, never opened, must not hold it now. (It held a sync
            // joiner at the barrier, and the running members' probes then
            // started a "first" round at block 0, dropping the stream.)
            job.barrier = None;
        }
        let _ = now;
        // No block waits for a member that left, nor for more members than
        // a (new) quorum asks for.
        let mut newly_slow = Vec::new();
        let quorum = job.spec.quorum;
        for local in 0..job.slots.len() {
            let Some(block) = job.slots[local].cur.as_mut() else { continue };
            if block.aggregating() {
                for &m in &left {
                    block.forget(m);
                }
                if block.satisfied(quorum) {
                    close_phase(job, local, &mut self.counters, out, &mut self.scratch, &mut newly_slow);
                }
            } else if became_root && matches!(block.phase, Phase::ExponentUp | Phase::DataUp) {
                // The parent is gone: this switch completes what it sent up.
                if block.phase == Phase::DataUp {
                    job.open_blocks += 1; // close_phase counts it done again
                    // The parent may have completed the block already with
                    // the branches that left, and their workers hold that
                    // sum: this one, without them, says it is partial.
                    block.child_degraded = true;
                }
                block.phase = if block.phase == Phase::ExponentUp { Phase::Exponent } else { Phase::Data };
                close_phase(job, local, &mut self.counters, out, &mut self.scratch, &mut newly_slow);
            }
        }
        settle_slow_sources(job, &mut newly_slow, &mut self.counters, out, &mut self.scratch);
        if new_result_key && self.config.shard == 0 {
            send_key_updates(job, &self.config, &mut self.counters, out);
        }
        // members added or removed change what the record costs
        job.settle_memory(&mut self.memory_used);
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
            Verdict::Recovered { job_id, floor, member, listens } => {
                self.resume(job_id, floor);
                self.set_listening(job_id, member, listens);
            }
            Verdict::RecoveryBegun { job_id } => self.begin_recovery(job_id),
            Verdict::ParentRestarted { job_id, parent } => {
                self.restart_for_parent(job_id, parent);
            }
        }
    }

    /// Another shard's [`Verdict::Recovered`]: the restarted job's stream
    /// resumes at `floor`.
    pub fn resume(&mut self, job_id: u32, floor: u32) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            join::resume_at(job, floor);
        }
        self.settle_memory(job_id);
    }

    /// Another shard's [`Verdict::RoundStarted`]: the job's next round
    /// starts at block `start`.
    pub fn start_round(&mut self, job_id: u32, start: u32) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            learn_round_start(job, start);
        }
        self.settle_memory(job_id);
    }

    /// Another shard's [`Verdict::RoundEnded`]: the job's round is over
    /// (`end` says why) and the next starts at `start`.
    pub fn end_round(&mut self, job_id: u32, end: RoundEnd, start: u32) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            end_round(job, Some(end), start);
        }
        self.settle_memory(job_id);
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
        let spec = self.jobs.get(&job_id).ok_or(AdmitError::Unknown(job_id))?.spec.clone();
        let new_floor = self.floor_for(job_id, &spec, uplink.is_some())?;
        let job = self.jobs.get_mut(&job_id).expect("checked above");
        if let Some(auth) = job.auth.as_mut() {
            auth.set_uplink_rank(uplink.as_ref().map(|u| u.rank));
        }
        job.uplink = uplink;
        if new_floor.is_some() {
            job.pool_floor = new_floor;
            job.settle_memory(&mut self.memory_used);
        }
        Ok(())
    }

    /// The pooled floor `job_id` needs with `spec` and this tree role
    /// (`None` for reserved memory), refused if raising it does not fit.
    /// Whether [`update_job`](Self::update_job) would take `spec` (and
    /// the uplink): every check it makes before it changes anything, this
    /// shard's share of pooled memory included. A runtime with several
    /// shards asks them all first, so that an update one of them refuses
    /// changes none (an update taken and undone has already sent the
    /// results of blocks it completed without a member that left).
    /// With the job's new source capacity and pooled floor.
    /// Whether `update_job(spec, uplink, awaiting)` would be taken, changing
    /// nothing; its capacity and pooled-memory floor if so.
    pub fn check_update(
        &self,
        spec: &JobSpec,
        uplink: Option<&Uplink<A>>,
        awaiting: &[u16],
    ) -> Result<(usize, Option<u32>), AdmitError> {
        spec.validate()?;
        let job_id = spec.job_id;
        if let Some(up) = uplink {
            if up.rank < SWITCH_RANK_BASE || up.parent.is_empty() {
                return Err(AdmitError::BadUplink { job_id, rank: up.rank });
            }
        }
        let Some(job) = self.jobs.get(&job_id) else { return Err(AdmitError::Unknown(job_id)) };
        if let Some(field) = job.spec.fixed_field_changed(spec) {
            return Err(AdmitError::Immutable { job_id, field });
        }
        if job.spec.adds_partial_results(spec) {
            return Err(AdmitError::PartialResultsAdded { job_id });
        }
        if spec.worker_count() > job.scale_workers {
            return Err(AdmitError::WorkersGrown { job_id, workers: spec.worker_count(), admitted: job.scale_workers });
        }
        // A tree's switch has no rounds (docs/trees.md): a member added
        // active once its stream ran is answered from the stream's start,
        // where the switches hold results summed without it, or with an
        // earlier process of its rank (a rank that left and came back under
        // a fresh leaf: those look complete, and a new run would take them
        // for its own sums). Only a sync join (awaiting) may come in then.
        let in_tree = uplink.is_some() || spec.members.iter().any(|&m| m >= SWITCH_RANK_BASE);
        if in_tree && spec.mode == JobMode::Aggregate && job.high_block.is_some() {
            let plain = spec.members.iter().find(|&&m| !job.members.contains(m as usize) && !awaiting.contains(&m));
            if let Some(&member) = plain {
                return Err(AdmitError::PlainMemberIntoRunningTree { job_id, member });
            }
        }
        let capacity = spec.source_capacity().max(job.members.capacity());
        // Pooled memory: child switches joining the members, or a parent,
        // need the floor of one buffer per slot (job.rs `pool_floor`), if it fits.
        let new_floor = self.floor_for(job_id, spec, uplink.is_some())?;
        Ok((capacity, new_floor))
    }

    fn floor_for(&self, job_id: u32, spec: &JobSpec, has_uplink: bool) -> Result<Option<u32>, AdmitError> {
        let job = self.jobs.get(&job_id).ok_or(AdmitError::Unknown(job_id))?;
        let Some(_) = job.pool_floor else { return Ok(None) };
        let floor = pool_floor(spec, self.local_slot_count(spec), has_uplink);
        let grows = (floor.max(job.live_records) as u64 * job.record_cost).saturating_sub(job.data_memory);
        if self.memory_used + grows > self.config.memory_limit {
            let available = self.config.memory_limit.saturating_sub(self.memory_used);
            return Err(AdmitError::OutOfMemory { job_id, needed: grows, available, limit: self.config.memory_limit });
        }
        Ok(Some(floor))
    }

    /// When [`handle_timeout`](Self::handle_timeout) must run next: the next
    /// scanner tick of a job with blocks still aggregating.
    pub fn poll_timeout(&self) -> Option<Time> {
        // (with scanner threads, the scanners keep their own time)
        let inline = !self.config.aging.threads;
        self.jobs
            .values()
            .filter(|j| j.open_blocks > 0)
            .flat_map(|j| [j.aging.as_ref().filter(|_| inline).map(|a| a.next_tick), j.liveness.deadline()])
            .flatten()
            .min()
    }

    /// The scan schedule of every job this shard ages, for scanner threads
    /// (`aging.threads`): scanner `i` of `N` visits slice `i` of each
    /// board at `(i + k N) * tick_ns` (the inline schedule's ticks).
    pub fn scan_schedules(&self) -> Vec<ScanSchedule> {
        self.jobs
            .values()
            .filter_map(|j| j.aging.as_ref().map(|a| ScanSchedule { job_id: j.spec.job_id, tick_ns: a.tick, slices: a.slices, board: a.board.clone() }))
            .collect()
    }

    /// Blocks a scanner thread found idle for enough visits of `board`:
    /// each one that still aggregates and is still unreferenced (a
    /// contribution since the visit wins) ages out now, as an inline visit
    /// would have done. Names from the board of a job since removed (and
    /// perhaps admitted again under the same id) are ignored.
    pub fn age_idle(
        &mut self,
        now: Time,
        job_id: u32,
        board: &std::sync::Arc<AgingBoard>,
        idle: &[Idle],
        out: &mut impl Transmit<A>,
    ) {
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        if !job.aging.as_ref().is_some_and(|a| std::sync::Arc::ptr_eq(&a.board, board)) {
            return;
        }
        if let Some(aging) = job.aging.as_mut() {
            aging.clock = now;
        }
        let mut newly_slow = Vec::new();
        for &(local, block_id) in idle {
            age_if_idle(job, local as usize, block_id, &mut self.counters, out, &mut self.scratch, &mut newly_slow);
        }
        settle_slow_sources(job, &mut newly_slow, &mut self.counters, out, &mut self.scratch);
        job.settle_memory(&mut self.memory_used);
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
            aging.clock = now;
            if job.open_blocks == 0 || self.config.aging.threads {
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
            let mut newly_slow = Vec::new();
            let mut idle = Vec::new();
            while job.open_blocks > 0 {
                let aging = job.aging.as_mut().expect("checked above");
                if aging.next_tick > now {
                    break;
                }
                let k = aging.next_tick.as_nanos() / tick;
                aging.next_tick = Time::from_nanos(aging.next_tick.as_nanos() + tick);
                self.counters.scans += 1;
                let board = aging.board.clone();
                let (lo, hi) = board.slice(k % slices, slices);
                idle.clear();
                board.visit(lo, hi, &mut idle);
                for &(local, block_id) in &idle {
                    age_if_idle(job, local as usize, block_id, &mut self.counters, out, &mut self.scratch, &mut newly_slow);
                }
                settle_slow_sources(job, &mut newly_slow, &mut self.counters, out, &mut self.scratch);
            }
        }
        for job in self.jobs.values_mut() {
            job.settle_memory(&mut self.memory_used);
        }
    }

    /// Charge `job_id` for the block records it holds now (pooled memory).
    fn settle_memory(&mut self, job_id: u32) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            job.settle_memory(&mut self.memory_used);
        }
    }

    /// [`handle_datagram`](Self::handle_datagram) of a datagram whose IP
    /// header said `ce`: its ECN field was Congestion Experienced, a queue
    /// on the way marked it instead of dropping it (RFC 3168). A
    /// contribution so marked marks its block's result for every member; a
    /// result from the parent so marked is echoed up on this switch's next
    /// partial (docs/congestion.md, "ECN").
    pub fn handle_datagram_ce(&mut self, now: Time, from: A, bytes: &[u8], ce: bool, out: &mut impl Transmit<A>) -> Verdict {
        self.rx_ce = ce;
        let verdict = self.handle_datagram(now, from, bytes, out);
        self.rx_ce = false;
        // counted by the shard that handles it, not on the way to it
        if ce && !matches!(verdict, Verdict::WrongShard(_)) {
            self.counters.ecn_ce += 1;
        }
        verdict
    }

    /// Process one datagram from `from`.
    pub fn handle_datagram(&mut self, now: Time, from: A, bytes: &[u8], out: &mut impl Transmit<A>) -> Verdict {
        let job_id = bytes.get(12..16).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        let verdict = self.handle_datagram_of_job(now, from, bytes, out);
        if let Some(job_id) = job_id {
            self.settle_memory(job_id);
        }
        verdict
    }

    fn handle_datagram_of_job(&mut self, now: Time, from: A, bytes: &[u8], out: &mut impl Transmit<A>) -> Verdict {
        self.counters.rx_datagrams += 1;
        // A sub-model relayed for sources this switch does not aggregate
        // passes unchanged, before any tag is checked (a relay holds no key).
        if !self.transits.is_empty() {
            if let Some(verdict) = self.relay(from, bytes, out) {
                return verdict;
            }
        }
        // A keyed job's datagrams are verified before anything else is
        // looked at: a forgery or a replay changes nothing but a counter.
        let mut job = bytes.get(12..16).and_then(|b| self.jobs.get_mut(&u32::from_be_bytes([b[0], b[1], b[2], b[3]])));
        if let Some(aging) = job.as_mut().and_then(|j| j.aging.as_mut()) {
            aging.clock = now; // what a block's spread is measured with
        }
        let job_known = job.is_some();
        let Some(bytes) = sealing::admit(job.and_then(|j| j.auth.as_mut()), job_known, bytes, &mut self.counters) else {
            return Verdict::Consumed;
        };
        let packet = match Packet::new_checked(bytes) {
            Ok(p) => p,
            Err(err) => {
                if let Some(cut) = Packet::trimmed_header(bytes) {
                    return self.handle_trimmed_in_network(now, from, &cut, out);
                }
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
            Ok(MessageType::ResultAck) => self.handle_result_ack(&packet),
            Ok(MessageType::Result | MessageType::Nack | MessageType::Membership | MessageType::JoinAck) => {
                self.handle_from_parent(from, &packet, out)
            }
            _ => {
                self.counters.protocol_violation += 1;
                Verdict::Consumed
            }
        }
    }

}

// reply.rs first: its `job_reply!` is used by the modules after it.
#[macro_use]
mod reply;
mod block;
mod config;
mod contribution;
mod job;
mod tree;
mod sealing;
mod trimming;
mod join;
mod aggregate;
mod membership;
mod nacks;
mod rounds;
mod pool;
mod board;
mod transit;
mod parent_restart;
mod done;

use block::*;
pub use config::{AgingConfig, MemoryModel, ShardConfig, MAX_CHECKS, MAX_SCANNERS};
use job::*;
use reply::*;

use join::*;
use parent_restart::*;
use done::*;
use aggregate::*;
use membership::*;
use nacks::*;
use pool::*;
pub use board::{AgingBoard, Idle};
pub use rounds::RoundEnd;
pub use transit::MAX_TRANSIT_SOURCES;
use rounds::*;

#[cfg(test)]
mod aging_tests;
#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod parent_restart_tests;
#[cfg(test)]
mod guard_tests;
#[cfg(test)]
mod memory_tests;
#[cfg(test)]
mod transit_tests;
#[cfg(test)]
mod ecn_tests;
