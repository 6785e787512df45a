//! Joining a running job: answers, sync offsets, recovery joins (docs/restart.md, docs/trees.md).

use super::*;

/// Forward a worker's join toward the root as a Sync request; `newcomer`:
/// this switch, or one below, holds the joiner (or the switch it joins
/// through) as awaiting ([`SYNC_NEWCOMER`]).
pub(super) fn forward_sync<A: Copy + PartialEq>(
    job: &mut Job<A>,
    origin: u16,
    align_blocks: u32,
    newcomer: bool,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) {
    let Some(up) = job.uplink.as_ref() else { return };
    let repr = Repr::new(MessageType::Sync, job.spec.job_id, up.rank);
    let env = envelope(job.auth.as_mut(), Peer::Parent);
    send(out, up.parent[0], repr.buffer_len(), env, |buf| {
        let mut packet = Packet::new_unchecked(buf);
        repr.emit(&mut packet);
        let flags = if newcomer { SYNC_NEWCOMER } else { 0 };
        SyncRequest { origin, flags, align_blocks }.emit(packet.payload_mut());
    });
    counters.syncs_forwarded += 1;
}

/// Answer a join (direct, or forwarded as a Sync) with the job's parameters
/// and the block offset the worker starts at.
pub(super) fn answer_join<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    origin: u16,
    // The member `dest` is: the worker itself, or the child switch it asked through.
    to: u16,
    dest: A,
    next_block: u32,
    out: &mut impl Transmit<A>,
) {
    answer_join_as(job, config, origin, to, dest, JoinStart::at(next_block), 0, out)
}

/// [`answer_join`] with `age_op` set (`JOIN_RECOVER` for a recovery floor),
/// and the generation a sync joiner's allreduces continue from in `gen_id`.
#[allow(clippy::too_many_arguments)]
pub(super) fn answer_join_as<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    origin: u16,
    to: u16,
    dest: A,
    start: JoinStart,
    age_op: u8,
    out: &mut impl Transmit<A>,
) {
    let next_block = start.block;
    let repr = Repr {
        src_cnt: job.scale_workers,
        age_op,
        gen_id: start.gen_id,
        ..Repr::new(MessageType::JoinAck, job.spec.job_id, origin)
    };
    let params = JoinParams {
        block_cnt_max: job.spec.block_cnt_max,
        block_grad_max: job.spec.block_grad_max,
        block_exp_ms: job.spec.block_exp_ms,
        incarnation: job.incarnation,
        shard_count: config.shard_count,
        next_block,
        // `to` is the member this switch sends the joiner's results to: the
        // worker itself, or the child switch it joined through.
        results_on_group: job.listens_on_group.contains(to as usize),
        // Blocks of this job may complete without every member, and the
        // job asked for that (docs/protocol.md §6.2).
        partial_results: job.spec.partial_results(),
        // One packet size for the whole job (a block's elements must line
        // up across members), chosen here where the data port's MTU is
        // known, not by each worker. A tree's switches (`workers` set by
        // the controller) may sit on links of different MTUs, and all its
        // workers must still agree: there the job's block_grad_max is the
        // packet size, which the controller chooses for the whole tree.
        packet_elems: if job.spec.workers == 0 {
            job.spec.block_grad_max.min(config.packet_elems_max)
        } else {
            job.spec.block_grad_max
        },
        // A root's results come in order per shard. A child whose parent is
        // spread over several switches (a root per spine) gets results of
        // different parents on different paths: in order only per parent
        // (`shard_of` over the parents, as it sends its partials) and per
        // own shard. (A relayed JoinAck adds what the parent knows, tree.rs.)
        order_shards: match job.uplink.as_ref().map(|up| up.parent.len()) {
            Some(parents) if parents > 1 => fanin_wire::value::order_shards_below(Some(parents as u16), config.shard_count),
            _ => 0,
        },
        // A member whose results come on the group, sealed once for all
        // listeners, needs the key they are sealed with.
        result_key: job.result_key_for(to),
    };
    let env = envelope(job.auth.as_mut(), Peer::Member(to as usize));
    send(out, dest, repr.buffer_len(), env, |buf| {
        let mut reply = Packet::new_unchecked(buf);
        repr.emit(&mut reply);
        params.emit(reply.payload_mut());
    });
}

/// The job's result key moved to a new epoch (a member left): send each
/// member that listens on the group, and whose address is known, the new
/// key unasked (`JOIN_KEY_UPDATE`, sealed under its own key), so it stops
/// taking what the old key seals at once rather than at its first failed
/// result. Lost, it is made up by the probe that result makes the worker
/// send. One shard sends it (all of them rotate together).
pub(super) fn send_key_updates<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) {
    let listeners: Vec<(u16, A)> = job
        .members
        .iter()
        .filter(|&m| job.listens_on_group.contains(m))
        .filter_map(|m| job.addrs.get(m).copied().flatten().map(|a| (m as u16, a)))
        .collect();
    let start = JoinStart::at(job.start_block);
    for (m, addr) in listeners {
        answer_join_as(job, config, m, m, addr, start, fanin_wire::value::JOIN_KEY_UPDATE, out);
        counters.result_key_updates += 1;
    }
}

/// The root's answer to a sync: the first allreduce boundary (multiples of
/// `align_blocks`) at or after the sync offset, plus a window
/// (`block_cnt_max`) for a `newcomer` once the job runs. A repeated request
/// (its answer was lost) gets the same start while the job is within a
/// window of it, so every switch on the worker's path agrees on it.
///
/// Why the extra window: the offset is the lowest block *this shard* still
/// needs, and no worker has a result for it yet, so no worker has sent a
/// block at or beyond offset + window (windows are at most
/// `block_cnt_max`). Answering a newcomer from there means no switch or
/// shard has begun, let alone completed, a block from its start without it;
/// the other shards and switches admit it (runtime message, the answer on
/// its way down) while the others still have a window of blocks to go.
/// Answering from the offset itself let another shard, up to a window
/// ahead, complete blocks from the start without the joiner: its result
/// then silently lacked the joiner's contribution. A member that is not a
/// newcomer (every block already waits for it: it gave up and syncs again)
/// is answered from the offset, where the others' blocks wait for it.
///
/// The JoinAck's header carries the generation of the allreduce before the
/// start (`gen_id`): the others' allreduce `k` of the round is generation
/// `k + 1`, and the joiner's first one must be the same generation as theirs
/// at its start, or the switch refuses its contributions as a mismatch.
///
/// None (no answer yet; the worker asks again) while this shard has seen no
/// block but other members are active: a root that just took over (the
/// tree grew above the old one) does not know the job's position until the
/// old root's first partial arrives (SwitchML++ answers with an error flag
/// in that case, for the same reason).
pub(super) fn sync_start<A>(
    job: &mut Job<A>,
    config: &ShardConfig,
    origin: u16,
    via: u16,
    align_blocks: u32,
    newcomer: bool,
) -> Option<JoinStart> {
    let fresh = job.slots.iter().all(|s| s.cur.is_none());
    let waiting = &job.sync_waiting;
    if fresh && job.active.iter().any(|m| m != via as usize && !waiting.contains(&(m as u16))) {
        job.sync_waiting.insert(via);
        return None;
    }
    job.sync_waiting.remove(&via);
    let offset = if newcomer && !fresh { newcomer_offset(job, config) } else { sync_offset(job, config) };
    let space = job.space;
    let align = align_blocks.max(1);
    let RecoverAnchor { block: base, gen_id: base_gen } = job.anchor;
    // the allreduce before the one at `block` (`base` is generation base_gen)
    let answer = |block: u32| JoinStart {
        block,
        gen_id: base_gen.wrapping_sub(1).wrapping_add((space.distance(block, base) / align) as u16),
    };
    let earliest = if newcomer && !fresh { space.add(offset, job.spec.block_cnt_max) } else { offset };
    if let Some(&start) = job.sync_answers.get(&origin) {
        if space.before(offset, space.add(start, job.spec.block_cnt_max)) {
            return Some(answer(start));
        }
    }
    // Allreduces start at the job's anchor (the round's first block, or
    // what recovering members reported), not at block 0: a round starts at
    // a multiple of S (rounds.rs), not of the joiner's allreduce length.
    // Aligning to multiples of `align` from block 0 put a joiner's
    // allreduces across the others' after a restart, and the job stalled.
    // (Counted mod M: after the ids wrap, M need not be a multiple of
    // `align` either; a stream of 2^32 blocks is left with that.)
    let into = if space.before(earliest, base) { 0 } else { space.distance(earliest, base) };
    let start = space.add(base, into.div_ceil(align).saturating_mul(align));
    job.sync_answers.insert(origin, start);
    Some(answer(start))
}

/// Where a joiner starts at this non-root switch, which admits it (or the
/// new branch it joins through) as the root's `answered` start passes
/// down: that start, unless this switch's other members may already have
/// sent blocks from it. The root answers a window beyond what it still
/// needs, so that every switch admits the joiner before such a block; but
/// an answer lost on its way here comes again only after the worker asks
/// again, and meanwhile the other members go on: their blocks from the
/// start went up without the joiner, and its first results lacked it
/// (honestly `degraded` since, but a job that takes only complete results
/// then failed on one lost datagram). Such a joiner starts instead at the
/// first of its allreduces a window beyond the lowest block this switch
/// still needs, which none of its members has sent yet (the reasoning of
/// [`sync_start`], on this switch's own position). A new branch with no
/// other member here has sent nothing; the root's start stands, as the
/// switches above have admitted the branch from it.
pub(super) fn start_here<A>(
    job: &mut Job<A>,
    config: &ShardConfig,
    origin: u16,
    via: u16,
    align: u32,
    answered: JoinStart,
) -> JoinStart {
    let space = job.space;
    let window = job.spec.block_cnt_max;
    let align = align.max(1);
    // Admitted here already (the answer was lost below this switch and
    // the worker asked again): it starts where this switch waits for it,
    // whatever the root answers now. (Once the job is a window past that
    // start the root answers afresh, and a start moved here may lie
    // beyond the root's old one.) Only while the joiner has not begun: a
    // member that syncs again later is answered by the root.
    let pending = |start: u32| space.before(sync_offset(job, config), space.add(start, window));
    if !job.awaiting.contains(via as usize) {
        if origin == via {
            if let Some(&start) = job.start_of.get(&via).filter(|&&s| pending(s)) {
                return shift(answered, start, align, space);
            }
        } else if let Some(&here) = job.sync_moved.get(&origin).filter(|m| pending(m.block)) {
            // a new branch admitted for this worker (the entry says which worker)
            return here;
        }
        return answered;
    }
    if !job.active.iter().any(|m| m != via as usize) {
        return answered;
    }
    let safe = space.add(newcomer_offset(job, config), window);
    if !space.before(answered.block, safe) {
        return answered;
    }
    let steps = space.distance(safe, answered.block).div_ceil(align);
    let here = shift(answered, space.add(answered.block, steps.saturating_mul(align)), align, space);
    if origin != via {
        // a worker joining here directly finds its start in `start_of`
        job.sync_moved.insert(origin, here);
    }
    here
}

/// `answered` moved to `block`, a whole number of allreduces of `align`
/// blocks away: the generation before it moves as many.
fn shift(answered: JoinStart, block: u32, align: u32, space: BlockSpace) -> JoinStart {
    let gen_id = if space.before(block, answered.block) {
        answered.gen_id.wrapping_sub((space.distance(answered.block, block) / align) as u16)
    } else {
        answered.gen_id.wrapping_add((space.distance(block, answered.block) / align) as u16)
    };
    JoinStart { block, gen_id }
}

/// Where a joiner starts: its first block, and the generation of the
/// allreduce before it (see [`sync_start`]; 0 for any other join).
#[derive(Debug, Clone, Copy)]
pub(super) struct JoinStart {
    pub block: u32,
    pub gen_id: u16,
}

impl JoinStart {
    /// A start that is not a sync answer: the generation is the joiner's own.
    pub(super) fn at(block: u32) -> Self {
        Self { block, gen_id: 0 }
    }
}

/// A member recovering after this switch restarted reports the lowest block
/// it has no result for. Nobody is answered until every member reported:
/// then the floor (the lowest reported block, the lowest any member still
/// needs) goes to all, and again to any repeated recovery join. Members
/// resend their retained contributions from the floor on (docs/restart.md).
#[allow(clippy::too_many_arguments)]
pub(super) fn recover_join<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    src: u16,
    from: A,
    low: u32,
    anchor: Option<RecoverAnchor>,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) -> Verdict {
    if let Some(floor) = job.recover_floor {
        answer_join_as(job, config, src, src, from, JoinStart::at(floor), JOIN_RECOVER, out);
        return Verdict::Consumed;
    }
    // A child switch is a member too: it reports for its subtree once told
    // (parent_restart.rs); the other shards must tell it as well.
    let waiting = if begin_switch_recovery(job) { Verdict::RecoveryBegun { job_id: job.spec.job_id } } else { Verdict::Consumed };
    job.recover_lows.insert(src, low);
    if let Some(anchor) = anchor {
        // Every member's allreduces start on the same boundaries: any one
        // member's anchor fixes them for the restarted switch.
        job.anchor = anchor;
    }
    if !job.members.iter().all(|m| job.recover_lows.contains_key(&(m as u16))) {
        counters.recover_waiting += 1;
        return waiting;
    }
    // The lowest in stream order: block ids wrap, and the members' lows
    // may straddle the wrap (ids near M and near 0).
    let space = job.space;
    let floor = job.recover_lows.values().copied().reduce(|a, b| if space.before(b, a) { b } else { a }).unwrap_or(low);
    if job.parent_restart.is_some() && job.uplink.is_some() {
        // Restarted below a restarted parent: the floor is the parent's,
        // over the whole tree; this subtree's lowest block goes up.
        report_low_up(job, floor, counters, out);
        return waiting;
    }
    settle_floor(job, config, floor, counters, out);
    // (this Join may also have changed whether its member listens on the
    // result group: the verdict carries that too)
    let listens = job.listens_on_group.contains(src as usize);
    Verdict::Recovered { job_id: job.spec.job_id, floor, member: src, listens }
}

/// The recovery floor is known (every member reported here, or the
/// restarted parent answered for the whole tree): the stream resumes there
/// and every member is told.
pub(super) fn settle_floor<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    floor: u32,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) {
    job.recover_floor = Some(floor);
    // The round that ran before the restart goes on: the (fresh) job's
    // barrier does not hold it (docs/protocol.md §4.12).
    job.barrier = None;
    resume_at(job, floor);
    counters.recoveries += 1;
    let members: Vec<usize> = job.members.iter().collect();
    for m in members {
        if let Some(addr) = job.addrs.get(m).copied().flatten() {
            answer_join_as(job, config, m as u16, m as u16, addr, JoinStart::at(floor), JOIN_RECOVER, out);
        }
    }
}

/// The restarted job's stream resumes at `floor` (on every shard: the one
/// that answered the recovery joins, and the others from its
/// [`Verdict::Recovered`]). Its empty slots take blocks from there on: the
/// fresh job's start (0, or where the members' probes started a round)
/// may lie ahead of the floor in stream order, as it does when the stream
/// crosses the wrap of its ids, and a resent block before the start would
/// be answered as expired.
pub(super) fn resume_at<A>(job: &mut Job<A>, floor: u32) {
    if job.earlier_tag.take().is_some() {
        // restarted below a restarted parent: the earlier life's blocks
        // go at the floor (parent_restart.rs)
        drop_blocks(job);
    }
    job.start_block = floor;
    job.start_settled = true;
    // the child switches reported: their partials count again
    job.switches_rejoin = false;
}

/// Admit `src` from `start` here, and tell the runtime so the other shards
/// do too (only if it was waiting: the common join of a member that is
/// already active needs nothing).
pub(super) fn joined<A>(job: &mut Job<A>, src: u16, start: u32) -> Verdict {
    if !job.awaiting.contains(src as usize) {
        return Verdict::Consumed;
    }
    admit_joiner(job, src, start);
    let listens = job.listens_on_group.contains(src as usize);
    Verdict::Joined { job_id: job.spec.job_id, member: src, start, listens }
}

/// Member `src` (a joining worker, or the child switch it joins through)
/// starts at block `start`: open blocks from there on wait for it, earlier
/// ones never do.
pub(super) fn admit_joiner<A>(job: &mut Job<A>, src: u16, start: u32) {
    if !job.awaiting.remove(src as usize) {
        return;
    }
    job.active.insert(src as usize);
    job.start_of.insert(src, start);
    for block in job.slots.iter_mut().filter_map(|s| s.cur.as_mut()).filter(|b| b.aggregating()) {
        if job.space.at_or_after(block.block_id, start) {
            block.expect(src as usize);
        }
    }
}

/// The SwitchML++ sync offset: the lowest block this shard still needs,
/// over its slots (an unused slot needs its first block at or after the
/// job's start). At the start of a job it is the start block, so workers
/// joining together agree; later, a joiner starts near the job's current
/// position instead of at blocks the others completed long ago. Only this
/// shard's slots are looked at; another shard may be up to a window ahead,
/// which is why [`sync_start`] answers a window beyond it.
pub(super) fn sync_offset<A>(job: &Job<A>, config: &ShardConfig) -> u32 {
    lowest_needed(job, config, true).unwrap_or(job.start_block)
}

/// The offset a newcomer's start is counted from (a window beyond it):
/// the lowest block this shard still needs among the slots it has used.
/// A slot it never used may have had its blocks completed by another
/// switch (the old root, before this one took over above it), whose
/// results let the workers send up to a window past them: counting such a
/// slot from a window below the highest block opened here put a joiner's
/// start below blocks another shard had already completed without it (its
/// first results then lacked it). A slot it used holds a block no switch
/// completed before it (a block reaches a slot only after the one before
/// it there did), so no worker has sent a block a window beyond it. (A
/// member that syncs again is answered from [`sync_offset`] itself, where
/// every block waits for it, the unused slots' first blocks included.)
pub(super) fn newcomer_offset<A>(job: &Job<A>, config: &ShardConfig) -> u32 {
    lowest_needed(job, config, false).unwrap_or_else(|| sync_offset(job, config))
}

/// The lowest block this shard still needs, over its slots (`unused`: an
/// unused slot counts too, needing its first block at or after the job's
/// start); None if no slot counts.
fn lowest_needed<A>(job: &Job<A>, config: &ShardConfig, unused: bool) -> Option<u32> {
    let s = job.spec.block_cnt_max;
    // An unused slot needs its first block at or after the job's start,
    // and no earlier than a window below the highest block this shard
    // opened: a member sends block h only with the result of every block
    // up to h - S, so none of those is needed any more. (A root added
    // above the old one opens its first slots far from the job's start:
    // counting its unused slots from the start answered a joiner with a
    // block the job had completed long before, and the joiner's blocks,
    // opening slots nobody else would send to again, stalled the job.)
    let from = match job.high_block {
        Some(h) => job.space.later(job.start_block, job.space.add(h, (job.space.size() - (s as u64 - 1)) as u32)),
        None => job.start_block,
    };
    let mut lowest: Option<u32> = None;
    for k in 0..s {
        if shard_of(job.spec.job_id, k, s, config.shard_count) != config.shard {
            continue;
        }
        let needed = match job.slots.get(job.slot_of(k, config.shard_count)).and_then(|slot| slot.cur.as_ref()) {
            Some(block) if block.is_open() => block.block_id,
            Some(block) => job.space.add(block.block_id, s),
            // first block >= `from` that maps to global slot k
            None if unused => job.space.add(from, (k + s - from % s) % s),
            None => continue,
        };
        lowest = Some(lowest.map_or(needed, |l| if job.space.before(needed, l) { needed } else { l }));
    }
    lowest
}

/// Why a worker's Join to a tree's switch is refused ([`refuse_in_tree`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TreeRefusal {
    /// A new process of a rank whose earlier process joined here.
    RerunInTree,
    /// A rank new to this life of a switch that restarted with the job installed.
    Restarted,
}

/// Whether a worker's Join to a job without rounds (a tree's switch: an
/// inner one, or a root with child switches) must be refused; records the
/// member incarnation of one that is not. A plain Join is answered with the
/// stream's start, and the switches above may hold results of the stream
/// from there on that the joining process never took part in: it would
/// take them for its own sums, with clean statistics. Until trees have
/// rounds (docs/trees.md, "A second run on a live tree") such a Join is
/// refused:
///
/// * from a new process of a rank whose earlier process already joined here
///   (another member incarnation): `RerunInTree`;
/// * on a switch that restarted with the job installed (`JobSpec::resumed`), from
///   a rank that has not joined this life: it has forgotten the processes
///   it saw, and cannot tell a new run from a worker of the running one
///   probing for the restart (which recovers on the refusal): `Restarted`.
///
/// A sync join (joining the running stream on purpose, SwitchML++) and a
/// recovery join (after a switch restart, the same process) are not
/// refused, and record their incarnation too; a Join that says none is
/// refused only by a resumed switch.
pub(super) fn refuse_in_tree<A>(job: &mut Job<A>, src: u16, inc: MemberIncarnation) -> Option<TreeRefusal> {
    if src >= SWITCH_RANK_BASE || job.spec.mode != JobMode::Aggregate {
        return None;
    }
    let plain = inc.from_plain_join();
    let current = job.incarnations[src as usize];
    if plain && current.is_none() && job.spec.resumed {
        return Some(TreeRefusal::Restarted);
    }
    if inc.is_none() {
        return None;
    }
    if plain && !current.is_none() && !current.same(inc) {
        return Some(TreeRefusal::RerunInTree);
    }
    job.incarnations[src as usize] = current.then(inc);
    None
}

impl<A: Copy + PartialEq> ValueSwitch<A> {
    pub(super) fn handle_join(
        &mut self,
        now: Time,
        from: A,
        packet: &Packet<&[u8]>,
        out: &mut impl Transmit<A>,
    ) -> Verdict {
        let (job_id, member) = (packet.job_id(), packet.src_id());
        let listening = |sw: &Self| sw.jobs.get(&job_id).is_some_and(|j| j.listens_on_group.contains(member as usize));
        let before = listening(self);
        // A plain Join again from a worker at the address it joined from:
        // its probe (it is stalled, or lingering after its last allreduce).
        let probe = packet.age_op() == 0
            && member < SWITCH_RANK_BASE
            && self.jobs.get(&job_id).is_some_and(|j| j.addrs.get(member as usize).copied().flatten() == Some(from));
        let verdict = self.answer_join_request(now, from, packet, out);
        if probe {
            // the restart it looks for may be further up the tree
            if let Some(job) = self.jobs.get_mut(&job_id) {
                parent_restart::probe_up(job, now, &mut self.counters, out);
            }
        }
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
        if src >= SWITCH_RANK_BASE && (packet.age_op() == 0 || packet.age_op() == JOIN_DONE) {
            // A child switch joins nothing: a plain Join from one is its
            // probe, a JOIN_DONE says its members all finished.
            return parent_restart::child_probe(job, &self.config, now, from, packet, &mut self.counters, out);
        }
        // A Join saying its member incarnation, to a job whose stream
        // position is decided here, takes part in the job's rounds: a new
        // process of a rank starts a new round (rounds.rs).
        let inc = MemberIncarnation::of(packet);
        let in_rounds = !inc.is_none() && packet.age_op() != JOIN_RECOVER && packet.age_op() != JOIN_DONE && uses_rounds(job);
        let current = job.incarnations[src as usize];
        let new_process = in_rounds && !current.is_none() && !current.same(inc);
        // A new process of a rank (or any Join after a restart ended the
        // round) goes to the barrier even on a failed job: a whole-job
        // restart starts afresh without the control plane.
        let restart_barrier = job.barrier.as_ref().is_some_and(|b| b.ended.is_some());
        if let Some(dead) = job.liveness.failed.filter(|_| !(in_rounds && (new_process || restart_barrier))) {
            let env = envelope(job.auth.as_mut(), Peer::Member(src as usize));
            send_nack(&mut self.counters, out, from, env, packet, NackReason::JobFailed, dead as u32);
            return Verdict::Consumed;
        }
        if let Some(refusal) = if in_rounds { None } else { refuse_in_tree(job, src, inc) } {
            let (reason, detail) = match refusal {
                TreeRefusal::RerunInTree => {
                    self.counters.rerun_in_tree += 1;
                    (NackReason::RerunInTree, src as u32)
                }
                TreeRefusal::Restarted => {
                    self.counters.resumed_refused += 1;
                    (NackReason::TreeSwitchRestarted, job.incarnation)
                }
            };
            let env = envelope(job.auth.as_mut(), Peer::Member(src as usize));
            send_nack(&mut self.counters, out, from, env, packet, reason, detail);
            return Verdict::Consumed;
        }
        job.addrs.set(src as usize, from);
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
            // (a plain Join's block_id carries its incarnation, not a block)
            let at = if inc.from_plain_join() { 0 } else { packet.block_id() };
            readmit(job, src as usize, at, &mut self.counters, out, &mut self.scratch);
        }
        if packet.age_op() == JOIN_DONE {
            return done_join(job, &self.config, now, src, from, packet.block_id(), &mut self.counters, out);
        }
        if packet.age_op() == JOIN_RECOVER {
            if !inc.is_none() {
                // a restarted switch learns the round's incarnations here
                job.incarnations[src as usize] = job.incarnations[src as usize].then(inc);
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
            job.pending_sync.insert(src, (src, packet.block_id()));
            forward_sync(job, src, packet.block_id(), newcomer, &mut self.counters, out);
        } else if let Some(start) = sync_start(job, &self.config, src, src, packet.block_id(), newcomer) {
            answer_join_as(job, &self.config, src, src, from, start, 0, out);
            return joined(job, src, start.block);
        } else {
            self.counters.sync_deferred += 1;
        }
        Verdict::Consumed
    }
}
