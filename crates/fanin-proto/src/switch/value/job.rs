//! A job record as one shard sees it ([`Job`], Trio-ML's job context): its
//! members, slots and tree role, its scanner schedule, and what it costs
//! the switch's memory.

use super::*;

/// Each member's address, learned from its packets, and whether two
/// members share one (hosts behind a GOAT relay, docs/goat.md, or a NAT):
/// then a datagram for every member goes once to each distinct address.
/// Written only through [`MemberAddrs::set`] and [`MemberAddrs::clear`], so
/// `shared` is never stale (it may stay set after the sharing ended, which
/// costs a deduplication pass, never a datagram).
#[derive(Debug)]
pub(super) struct MemberAddrs<A> {
    by_member: Vec<Option<A>>,
    shared: bool,
}

impl<A: Copy + PartialEq> MemberAddrs<A> {
    pub(super) fn new(capacity: usize) -> Self {
        Self { by_member: vec![None; capacity], shared: false }
    }

    /// Member `id` sends from `addr`. Checking for sharing costs a pass over
    /// the members, only when a member's address changes (its first datagram).
    pub(super) fn set(&mut self, id: usize, addr: A) {
        if self.by_member[id] == Some(addr) {
            return;
        }
        if !self.shared {
            self.shared = self.by_member.iter().enumerate().any(|(i, a)| i != id && *a == Some(addr));
        }
        self.by_member[id] = Some(addr);
    }

    pub(super) fn clear(&mut self, id: usize) {
        self.by_member[id] = None;
    }

    pub(super) fn grow(&mut self, capacity: usize) {
        if self.by_member.len() < capacity {
            self.by_member.resize(capacity, None);
        }
    }

    /// Whether two members were seen at one address.
    pub(super) fn shared(&self) -> bool {
        self.shared
    }
}

impl<A> MemberAddrs<A> {
    pub(super) fn capacity(&self) -> usize {
        self.by_member.capacity()
    }
}

impl<A> std::ops::Deref for MemberAddrs<A> {
    type Target = [Option<A>];
    fn deref(&self) -> &[Option<A>] {
        &self.by_member
    }
}

/// A job record (Trio-ML `trio_ml_job_ctx_t`) as seen by one shard.
#[derive(Debug)]
pub(super) struct Job<A> {
    pub(super) spec: JobSpec,
    pub(super) members: SourceMask,
    pub(super) member_count: u16,
    /// The worker count the job was admitted with (`JobSpec::worker_count`):
    /// every JoinAck says it, and workers scale block floating point and
    /// divide averages by it, so an update may not raise the count above it.
    pub(super) scale_workers: u16,
    /// Where each member's results go, learned from its packets.
    pub(super) addrs: MemberAddrs<A>,
    /// Members whose latest Join said they listen on the job's result group
    /// (only kept when the job has one): completion results reach them there.
    pub(super) listens_on_group: SourceMask,
    /// This shard's slots: global slot `k` is local slot `k / shard_count`.
    pub(super) slots: Vec<Slot>,
    /// What the job costs the switch: `data_memory` (its aggregation
    /// buffers) plus its record ([`Job::record_bytes`]).
    pub(super) memory: u64,
    pub(super) data_memory: u64,
    /// Bytes of one block record's buffer (`block_grad_max` elements).
    pub(super) record_cost: u64,
    /// Pooled memory (`MemoryModel::Pooled`): the buffers the job reserved
    /// and may always use ([`pool_floor`]); `None`: its buffers are all
    /// reserved.
    pub(super) pool_floor: Option<u32>,
    /// Block records holding a buffer (a slot's block and its shadow).
    pub(super) live_records: u32,
    /// First block id of the job's stream (the SwitchML++ sync offset).
    pub(super) start_block: u32,
    /// An allreduce boundary of the running round and its generation: the
    /// round's first block and generation 1, or what a recovering member
    /// reported after this switch restarted. Sync joins are answered on
    /// the boundaries it fixes (join.rs `sync_start`).
    pub(super) anchor: RecoverAnchor,
    /// Sources new blocks wait for: members minus the permanently slow.
    pub(super) active: SourceMask,
    /// Per source: aged blocks it was missing from since it last contributed.
    pub(super) missed_streak: Vec<u32>,
    /// Blocks still aggregating on this shard (the scanners idle at zero).
    pub(super) open_blocks: usize,
    pub(super) aging: Option<JobAging>,
    /// Where partial results go; none at the root.
    pub(super) uplink: Option<Uplink<A>>,
    /// Sync requests forwarded toward the root: requesting worker -> the
    /// child it came through, so the root's answer finds its way down.
    /// (and the alignment it asked for: its allreduces' length in blocks).
    pub(super) pending_sync: HashMap<u16, (u16, u32)>,
    /// Members whose sync join this (root) switch deferred: on a fresh job
    /// they wait for an active member to open the stream, but not for one
    /// another (if every member rejoins with sync, someone must go first).
    pub(super) sync_waiting: BTreeSet<u16>,
    /// Members added to a running job that are not waited for until their
    /// sync answer passes this switch (it tells where they start).
    pub(super) awaiting: SourceMask,
    /// Members that start at a later block than the stream: blocks before
    /// it do not wait for them.
    pub(super) start_of: HashMap<u16, u32>,
    /// Root: the start block answered to each syncing worker, answered
    /// again to a repeated request so every switch on its path agrees.
    pub(super) sync_answers: HashMap<u16, u32>,
    /// Non-root: workers whose new branch this switch admitted later than
    /// the root's sync answer said ([`start_here`]): worker -> the start
    /// here, relayed again to a repeated answer.
    pub(super) sync_moved: HashMap<u16, JoinStart>,
    /// A keyed job's member keys, replay windows and sequence counter.
    pub(super) auth: Option<JobAuth>,
    /// Per-source rate limits (this shard's share).
    pub(super) buckets: SourceBuckets,
    /// Member timeout and the job's failure, if it failed.
    pub(super) liveness: Liveness,
    /// The job's incarnation on this switch: the switch's own, moved on
    /// each time the job restarts below a restarted parent
    /// ([`parent_restart`](super::parent_restart)). JoinAcks and
    /// StaleIncarnation nacks say it...
    pub(super) incarnation: u32,
    /// ...and its tag (results and nacks carry it; worker contributions
    /// must carry it or 0).
    pub(super) tag: u16,
    /// Non-root: the parent incarnation this job last restarted for (its
    /// StaleIncarnation nack); until the parent answers its floor, the
    /// recovery floor here is the parent's, not this switch's.
    pub(super) parent_restart: Option<u32>,
    /// ...and, until that floor comes, the tag of the life before: the
    /// earlier parent's results still on their way to this switch go down
    /// under it, to the workers still bound to that life.
    pub(super) earlier_tag: Option<u16>,
    /// A recovery is under way here and the floor is not known: a child
    /// switch's partial is refused (StaleIncarnation), so that the child
    /// restarts its subtree's stream and reports its lowest block in a
    /// recovery Join of its own (docs/restart.md, "Trees").
    pub(super) switches_rejoin: bool,
    /// Non-root: when this switch last probed its parent for a member's
    /// probe ([`probe_up`](super::parent_restart::probe_up)).
    pub(super) last_probe_up: Option<Time>,
    /// Non-root: a result from the parent arrived CE-marked, or the parent
    /// trimmed a partial for overload; the next partial this switch sends
    /// up carries the congestion mark (docs/congestion.md).
    pub(super) ce_echo_up: bool,
    /// Members that said they are done (a [`JOIN_DONE`] Join: lingering
    /// after their last allreduce), with the end of their stream.
    pub(super) done_at: HashMap<u16, u32>,
    /// Non-root: the parent said every worker of the tree is done at this
    /// block ([`JOIN_ALL_DONE`]).
    pub(super) all_done_above: Option<u32>,
    /// Recovery after a restart (docs/restart.md): the lowest block without
    /// a result each member reported in its `JOIN_RECOVER` join...
    pub(super) recover_lows: HashMap<u16, u32>,
    /// ...and, once every member reported, the floor answered to all.
    pub(super) recover_floor: Option<u32>,
    /// Whether `start_block` is known to be where the stream stands: after
    /// a round ended, or once the recovery floor is known. Until then (the
    /// first round of a job just admitted, perhaps to a restarted switch)
    /// a block before the start is not answered as expired: it may be a
    /// recovering member's, sent to this shard before it learnt the floor.
    pub(super) start_settled: bool,
    /// Rounds (docs/protocol.md §4.12): the member incarnation each member
    /// joined the running round with (none: none said); on a tree's
    /// switch, the one each worker joined it with.
    pub(super) incarnations: Vec<MemberIncarnation>,
    /// The join barrier, between rounds and before the first one.
    pub(super) barrier: Option<Barrier<A>>,
    /// Highest block opened on this shard in the running round.
    pub(super) high_block: Option<u32>,
    /// The job's block ids and their order (they wrap at a multiple of
    /// `block_cnt_max`, crate::serial).
    pub(super) space: BlockSpace,
}

/// Scanner schedule of one job: one tick every `block_exp / (N * checks)`;
/// tick `k` (counted from time zero) visits slice `k mod N`, so scanner `i`
/// fires at `i * period / N + j * period` with `period = block_exp / checks`.
#[derive(Debug)]
pub(super) struct JobAging {
    pub(super) tick: u64,
    pub(super) slices: u64,
    pub(super) checks: u8,
    pub(super) next_tick: Time,
    /// Aged blocks a source may miss in a row before it is declared
    /// permanently slow (K windows of this shard's slots); 0 = never.
    pub(super) slow_after_blocks: u64,
    /// Unreferenced visits that age a block now: `checks` for `block_exp`,
    /// more while the job's complete blocks show a larger spread.
    pub(super) needed_checks: u8,
    /// `checks` x `max_factor`: the ceiling of `needed_checks`.
    pub(super) max_checks: u8,
    /// The time of the event being handled (set where the job is looked up).
    pub(super) clock: Time,
    /// Recent spreads: how far apart the contributions to a block arrive.
    pub(super) spread: SpreadSamples,
    /// The scan words of the job's slots on this shard (REF flags and
    /// unreferenced visits), shared with scanner threads (board.rs).
    pub(super) board: std::sync::Arc<AgingBoard>,
}

/// The last [`SPREAD_SAMPLES`] spreads (µs) of the job's blocks on this
/// shard: a phase that completed with every source it waited for gives the
/// time from its start to its last contribution; a contribution that
/// arrives after its block aged without it gives its own arrival time from
/// the phase's start (without these, a job whose members are always further
/// apart than `block_exp` would age every block and learn nothing). The
/// expiry is twice the median: the delays members ordinarily have (ranks
/// that share cores or a GPU, descheduled or starting a bucket late) lie
/// below it, a straggler's (the Slow Worker Pattern sleeps half an
/// iteration or more) above it, and a median is not moved by how long the
/// stragglers are (docs/stragglers.md, "Skew-aware expiry").
#[derive(Debug, Clone)]
pub(super) struct SpreadSamples {
    ring: [u32; SPREAD_SAMPLES],
    len: usize,
    next: usize,
    since_update: usize,
}

/// Spreads kept per job.
pub(super) const SPREAD_SAMPLES: usize = 64;
/// New samples between two updates of the expiry (a median of 64 costs a
/// selection; once per 8 blocks keeps it off the per-block path).
const SPREAD_UPDATE_EVERY: usize = 8;

impl Default for SpreadSamples {
    fn default() -> Self {
        Self { ring: [0; SPREAD_SAMPLES], len: 0, next: 0, since_update: 0 }
    }
}

impl SpreadSamples {
    /// The median of the samples (µs), or `None` before the first.
    pub(super) fn median(&self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let mut v = self.ring;
        let v = &mut v[..self.len];
        // the lower median: with two samples, the smaller
        let mid = (v.len() - 1) / 2;
        Some(*v.select_nth_unstable(mid).1)
    }
}

impl JobAging {
    /// One spread sample (ns); every few samples, re-derive how many
    /// unreferenced visits age a block: `2 x median`, at least `block_exp`
    /// (`checks` visits), at most `max_factor x block_exp`.
    pub(super) fn sample_spread(&mut self, spread_ns: u64) {
        let s = &mut self.spread;
        s.ring[s.next] = (spread_ns / 1_000).min(u32::MAX as u64) as u32;
        s.next = (s.next + 1) % SPREAD_SAMPLES;
        s.len = (s.len + 1).min(SPREAD_SAMPLES);
        s.since_update += 1;
        // the first samples each count (a job learns its skew at once), then
        // one update per SPREAD_UPDATE_EVERY
        if s.len > SPREAD_UPDATE_EVERY && s.since_update < SPREAD_UPDATE_EVERY {
            return;
        }
        s.since_update = 0;
        let median_ns = s.median().unwrap_or(0) as u64 * 1_000;
        // a block is visited once per period = tick x slices
        let period = (self.tick * self.slices).max(1);
        let visits = (2 * median_ns).div_ceil(period);
        self.needed_checks = visits.clamp(self.checks as u64, self.max_checks as u64) as u8;
        self.board.set_needed_checks(self.needed_checks);
    }
}

impl<A> Job<A> {
    /// Record whether `member` listens on the result group (only a job
    /// that has one keeps anyone as listening).
    pub(super) fn set_listening(&mut self, member: u16, listens: bool) {
        if listens && self.spec.result_group.is_some() {
            self.listens_on_group.insert(member as usize);
        } else {
            self.listens_on_group.remove(member as usize);
        }
    }

    /// The result key a JoinAck to `member` carries: wrapped for it when it
    /// listens on a keyed job's group (its results come sealed once under
    /// that key), none otherwise.
    pub(super) fn result_key_for(&self, member: u16) -> Option<fanin_wire::value::WrappedResultKey> {
        let auth = self.auth.as_ref()?;
        self.listens_on_group.contains(member as usize).then(|| auth.wrapped_result_key(member as usize)).flatten()
    }

    /// Bytes the job's record takes beyond its aggregation buffers (those
    /// are `data_memory`): the record, its per-member tables and masks, its
    /// slots and the block records they hold at most (two per slot, each
    /// with four source masks: rcvd, expected, moved_on, no_data). Counted against the switch's memory limit
    /// like the buffers, so the number of jobs and members is bounded by it
    /// (issue: 6 256 jobs of 4 096 members took 2.3 GB that memory_used did
    /// not show).
    pub(super) fn record_bytes(&self) -> u64 {
        use std::mem::size_of;
        let mask = |m: &SourceMask| m.capacity().div_ceil(64) * 8;
        let per_block = size_of::<Block>() + 4 * mask(&self.members);
        let maps = (self.pending_sync.capacity() + self.start_of.capacity() + self.sync_answers.capacity())
            * (size_of::<(u16, (u16, u32))>() + 8)
            + self.sync_moved.capacity() * (size_of::<(u16, JoinStart)>() + 8)
            + self.recover_lows.capacity() * (size_of::<(u16, u32)>() + 8);
        let bytes = size_of::<Job<A>>()
            + self.addrs.capacity() * size_of::<Option<A>>()
            + self.missed_streak.capacity() * size_of::<u32>()
            + self.incarnations.capacity() * size_of::<MemberIncarnation>()
            + [&self.members, &self.active, &self.awaiting, &self.listens_on_group].into_iter().map(mask).sum::<usize>()
            + self.liveness.heap_bytes()
            + self.buckets.heap_bytes()
            + self.auth.as_ref().map_or(0, JobAuth::heap_bytes)
            + self.slots.capacity() * (size_of::<Slot>() + 2 * per_block)
            + maps;
        bytes as u64
    }

    /// Pooled memory: may the job take one more block record? Within its
    /// floor always; beyond it if the shard has the bytes free.
    pub(super) fn may_take_record(&self, memory_used: u64, limit: u64) -> bool {
        match self.pool_floor {
            None => true,
            Some(floor) => self.live_records < floor || memory_used + self.record_cost <= limit,
        }
    }

    /// With pooled memory, charge the job for the block records it holds
    /// (never less than its floor, which it reserved at admission); the
    /// switch calls this after every event that touched the job, so
    /// `memory_used` is exact whenever a new block asks for a record.
    pub(super) fn settle_memory(&mut self, memory_used: &mut u64) {
        #[cfg(debug_assertions)]
        {
            let held: usize = self.slots.iter().map(|s| s.held() as usize).sum();
            debug_assert_eq!(held, self.live_records as usize, "live block records miscounted");
        }
        if let Some(floor) = self.pool_floor {
            let data = self.live_records.max(floor) as u64 * self.record_cost;
            *memory_used = *memory_used - self.data_memory + data;
            self.memory = self.memory - self.data_memory + data;
            self.data_memory = data;
        }
    }

    /// Pooled memory with a one-record floor: a done block is freed once
    /// every member acknowledged its result, and a block lower than one
    /// this job is aggregating may take that block's record (eviction).
    pub(super) fn frees_at_acknowledgement(&self) -> bool {
        self.pool_floor.is_some() && one_buffer_carries(&self.spec, self.uplink.is_some())
    }

    pub(super) fn slot_of(&self, block_id: u32, shard_count: u16) -> usize {
        // (the job's slots are spread over `job_shards` shards: shard_of)
        let spread = crate::job::job_shards(self.spec.block_cnt_max, shard_count);
        (block_id % self.spec.block_cnt_max) as usize / spread as usize
    }
}

/// Every member of the job is a worker, and workers acknowledge the results
/// they hold when a shard is short of memory (a `ResultAck`). A child
/// switch does not: its shard partition differs from its parent's, so it
/// cannot say "every result before block b" for the parent's blocks.
pub(super) fn acknowledges_results(spec: &JobSpec) -> bool {
    !has_child_switches(spec)
}

/// Some member of the job is a child switch (a tree's rank from
/// `SWITCH_RANK_BASE` up), not a worker.
pub(super) fn has_child_switches(spec: &JobSpec) -> bool {
    spec.members.iter().any(|&m| m >= SWITCH_RANK_BASE)
}

/// A root job whose members all acknowledge results: one reserved buffer
/// carries it forward (its done blocks freed at acknowledgement, its later
/// blocks evicted for its lowest one); see [`pool_floor`].
pub(super) fn one_buffer_carries(spec: &JobSpec, has_uplink: bool) -> bool {
    acknowledges_results(spec) && !has_uplink
}

/// The buffers a pooled job reserves on a shard that owns `local_slots` of
/// its slots (docs/memory.md). A root job whose members acknowledge
/// results needs one: its done blocks are freed once acknowledged, and its
/// lowest block may take the record of a later one it aggregates, so one
/// record always carries it forward. A job with child switches needs one
/// per slot: a done block is freed only when every member sent the slot's
/// next block, which must be able to open in every slot. So does a job at
/// a non-root switch (`has_uplink`): blocks it sent up hold their records
/// until the parent answers, and neither an acknowledgement nor an
/// eviction frees them, so two leaves could each hold what the other's
/// lowest block needs at the parent.
pub(super) fn pool_floor(spec: &JobSpec, local_slots: usize, has_uplink: bool) -> u32 {
    if one_buffer_carries(spec, has_uplink) {
        local_slots.min(1) as u32
    } else {
        local_slots as u32
    }
}
