//! Rounds and member incarnations (docs/protocol.md §4.12): a job's stream
//! belongs to one set of worker processes at a time.
//!
//! Every session of a worker draws a **member incarnation** and sends it in
//! each of its Joins. The shard that answers Joins keeps the incarnation each
//! member joined the running **round** with. A Join from a known incarnation
//! (a repeated Join, a restart probe) is answered as always. A Join from a
//! new incarnation of a member of the running round means a new process took
//! that rank: the round cannot complete honestly (the survivors' open
//! allreduces lack the old process's contributions, and the new process
//! would start its own step 0 in the middle of their stream), so it **ends**:
//! every block is dropped, the other members are told (Membership notice
//! `MEMBERSHIP_RESTARTED`, and again in answer to anything they send for the
//! old round), and the job waits at its **join barrier** until every member
//! joined as a new incarnation. Then the next round starts, for everyone at
//! once, at a block beyond anything the old round could still send, so no
//! contribution or result of one round ever meets a block of another.
//!
//! A round also ends when a member's block does not line up with the
//! others' (`MEMBERSHIP_MISMATCH`: the members disagree on the allreduce's
//! length), so every member raises the same error instead of one being
//! refused and the others waiting for it.
//!
//! The barrier also holds the job's first round: nobody is answered before
//! every member joined, so aging and member timeouts never start on a job
//! whose members are still starting up.
//!
//! Rounds apply to a single switch or a tree's root whose members are all
//! workers; a tree's inner switches answer their workers' Joins from the
//! stream's start as before (docs/trees.md), and a worker that joins a
//! running round on purpose uses the SwitchML++ sync join, which changes its
//! incarnation without ending the round.

use super::*;

/// Why a round ended, as its Membership notice says it: `cause` is the
/// notice's `age_op` (`MEMBERSHIP_RESTARTED`: `rank` joined as a new
/// process; `MEMBERSHIP_MISMATCH`: `rank`'s block did not line up with the
/// others', so the members disagree on the allreduce's length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundEnd {
    pub cause: u8,
    pub rank: u16,
}

/// A worker session's member incarnation as its Joins say it
/// (docs/protocol.md §4.12): the low 16 bits in every Join's `src_cnt`, 32
/// more in a plain Join's `block_id` (a sync or recovery Join's `block_id`
/// is taken, so those say the low bits alone). 48 bits make two processes
/// of a rank drawing the same number a 1 in 2^48 event; 16 made it 1 in
/// 65 535, and such a pair was taken for one process (the new one answered
/// with the old round's start).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemberIncarnation {
    /// `src_cnt`: 0 = the worker says none (answered as before rounds).
    pub low: u16,
    /// A plain Join's `block_id`; unknown from the other Join kinds.
    pub high: Option<u32>,
}

impl MemberIncarnation {
    pub const NONE: Self = Self { low: 0, high: None };

    /// What a worker's Join says.
    pub fn of(packet: &Packet<&[u8]>) -> Self {
        // (only a plain Join says the high bits in its block_id)
        let plain = packet.age_op() == 0;
        Self { low: packet.member_incarnation(), high: plain.then(|| packet.block_id()) }
    }

    pub fn is_none(self) -> bool {
        self.low == 0
    }

    /// Whether it came in a plain Join (a first join or a probe), the only
    /// kind that says the high bits.
    pub fn from_plain_join(self) -> bool {
        self.high.is_some()
    }

    /// Whether the two can name one session: the low bits agree, and the
    /// high bits too where both are known.
    pub fn same(self, other: Self) -> bool {
        self.low == other.low && (self.high.is_none() || other.high.is_none() || self.high == other.high)
    }

    /// What to keep after a Join saying `new`: `new`, with the high bits
    /// this one knew if `new` is the same session and does not say them.
    pub fn then(self, new: Self) -> Self {
        if self.same(new) {
            Self { low: new.low, high: new.high.or(self.high) }
        } else {
            new
        }
    }
}

/// The join barrier: between two rounds, or before a job's first.
#[derive(Debug)]
pub(super) struct Barrier<A> {
    /// First block of the next round.
    pub(super) start: u32,
    /// Why the last round ended (none before the first round): the old
    /// round's contributions are answered with a notice saying so.
    pub(super) ended: Option<RoundEnd>,
    /// Members that joined the next round (on the shard answering Joins):
    /// their incarnation and address.
    pub(super) joined: HashMap<u16, (MemberIncarnation, A)>,
}

impl<A> Barrier<A> {
    pub(super) fn first() -> Self {
        Self { start: 0, ended: None, joined: HashMap::new() }
    }
}

/// Whether `job` runs rounds: the stream's position is decided here, not
/// by a parent switch, and every member is a worker with a session.
pub(super) fn uses_rounds<A>(job: &Job<A>) -> bool {
    job.uplink.is_none() && job.spec.mode == JobMode::Aggregate && job.members.iter().all(|m| m < SWITCH_RANK_BASE as usize)
}

/// What a Join did to the job's rounds.
pub(super) enum RoundJoin {
    /// The Join belongs to the running round: answer it as usual.
    Proceed,
    /// Answered (or held) here.
    Done(Verdict),
}

/// A Join from `src` carrying member incarnation `inc` (not none) of a job
/// that uses rounds.
#[allow(clippy::too_many_arguments)]
pub(super) fn join_round<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    src: u16,
    inc: MemberIncarnation,
    from: A,
    sync: bool,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) -> RoundJoin {
    let member = src as usize;
    if let Some(barrier) = job.barrier.as_mut() {
        if let Some(end) = barrier.ended.filter(|_| job.incarnations[member].same(inc)) {
            // A survivor of the ended round (its probe): tell it again.
            counters.stale_round += 1;
            notify_round_end(job, end, &[(member, from)], counters, out);
            return RoundJoin::Done(Verdict::Consumed);
        }
        barrier.joined.insert(src, (inc, from));
        if job.members.iter().all(|m| barrier.joined.contains_key(&(m as u16))) {
            let start = barrier.start;
            begin_round(job, config, start, counters, out);
            let listens = job.listens_on_group.contains(member);
            return RoundJoin::Done(Verdict::RoundStarted { job_id: job.spec.job_id, start, member: src, listens });
        }
        let joined = barrier.joined.len() as u32;
        counters.barrier_waiting += 1;
        answer_join_as(job, config, src, src, from, JoinStart::at(joined), JOIN_WAIT, out);
        return RoundJoin::Done(Verdict::Consumed);
    }
    let current = job.incarnations[member];
    if current.same(inc) || current.is_none() || sync {
        // The same session again, a member the round did not have (added
        // while it ran), or a deliberate SwitchML++ sync into the running
        // stream: no round ends.
        job.incarnations[member] = current.then(inc);
        return RoundJoin::Proceed;
    }
    // A new process took a rank of the running round.
    let end = RoundEnd { cause: MEMBERSHIP_RESTARTED, rank: src };
    let ended = finish_round(job, config, end, Some(member), counters, out);
    match join_round(job, config, src, inc, from, sync, counters, out) {
        // a one-member job starts its next round at once
        RoundJoin::Done(v @ Verdict::RoundStarted { .. }) => RoundJoin::Done(v),
        _ => RoundJoin::Done(ended),
    }
}

/// End the running round here for `end` and tell the members (all but
/// `except`, whose new process caused it); the verdict passes it on to the
/// other shards.
pub(super) fn finish_round<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    end: RoundEnd,
    except: Option<usize>,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) -> Verdict {
    let start = next_round_start(job, config);
    end_round(job, Some(end), start);
    counters.rounds_ended += 1;
    let to: Vec<(usize, A)> = job
        .members
        .iter()
        .filter(|&m| Some(m) != except)
        .filter_map(|m| Some((m, job.addrs.get(m).copied().flatten()?)))
        .collect();
    notify_round_end(job, end, &to, counters, out);
    let listens = job.listens_on_group.contains(end.rank as usize);
    Verdict::RoundEnded { job_id: job.spec.job_id, cause: end.cause, rank: end.rank, start, member: end.rank, listens }
}

/// Where the next round starts: beyond every block the ended round opened
/// on any shard, or can still open. This shard opened blocks up to
/// `high_block`; another shard is at most a window (S) and a lap of the
/// shards (T) further, and the survivors, whose blocks no longer complete,
/// send at most a window beyond the last result. Rounded up to a multiple of
/// S, so a round starts at slot 0.
pub(super) fn next_round_start<A>(job: &Job<A>, config: &ShardConfig) -> u32 {
    let s = job.spec.block_cnt_max;
    let space = job.space;
    let base = job.high_block.map_or(job.start_block, |h| space.later(h, job.start_block));
    let beyond = space.add(base, 3 * s + config.shard_count as u32 + 1);
    // ids wrap at a multiple of S, so this stays a multiple of S
    space.add(beyond, (s - beyond % s) % s)
}

/// End the running round on this shard: its blocks are dropped (nobody
/// may get their results any more), and contributions for blocks before
/// `start` are answered with a notice saying why it `ended`.
pub(super) fn end_round<A>(job: &mut Job<A>, ended: Option<RoundEnd>, start: u32) {
    drop_blocks(job);
    if ended.is_some() {
        job.start_settled = true;
    }
    job.barrier = Some(Barrier { start, ended, joined: HashMap::new() });
    // The next round waits for every member (reset_for_round): so does a
    // block this shard opens before it learns that round started.
    job.active.clone_from(&job.members);
    job.awaiting.clear();
    job.start_of.clear();
}

/// Start the next round at block `start` on the shard holding the
/// barrier: every member that joined is answered.
pub(super) fn begin_round<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    start: u32,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) {
    let joined = job.barrier.take().map(|b| b.joined).unwrap_or_default();
    reset_for_round(job, start);
    counters.rounds_started += 1;
    job.incarnations.iter_mut().for_each(|i| *i = MemberIncarnation::NONE);
    let mut joined: Vec<(u16, (MemberIncarnation, A))> = joined.into_iter().collect();
    joined.sort_by_key(|(m, _)| *m);
    for (m, (inc, addr)) in joined {
        job.incarnations[m as usize] = inc;
        job.addrs.set(m as usize, addr);
        answer_join_as(job, config, m, m, addr, JoinStart::at(start), JOIN_ROUND_START, out);
    }
}

/// The job's stream starts afresh at block `start` on this shard: no
/// block, no barrier, every member waited for, no failure, no slow source.
pub(super) fn reset_for_round<A>(job: &mut Job<A>, start: u32) {
    drop_blocks(job);
    job.high_block = None;
    start_afresh(job, start);
}

/// Another shard started the round at `start` ([`Verdict::RoundStarted`]).
/// This shard may hold blocks of that round already: the shard that
/// started it answered the members at once, and a runtime passes the
/// verdict on at its own pace (the daemon's shard threads read it between
/// batches), so their first contributions can arrive here before it. Every
/// block opened since this shard's barrier began is of the new round (an
/// ended round's blocks were dropped when it ended, and its contributions
/// are refused at the barrier, `stale_round`), so those blocks are kept:
/// dropping them lost results the members already held, and a late
/// retransmission of such a block then opened a record nobody else would
/// send to, holding its slot for ever. They waited for every member, as
/// the round does (`end_round` set that; a job starts that way).
///
/// Only a barrier that is this round's counts: one that ended a round, or
/// the job's first with the same start. A peer of a switch that restarted
/// still holds the first barrier while the recovered stream runs (shard 0
/// left it in `recover_join`); its blocks are that stream's, and a round
/// started without an end passed on (a one-member job's new process ends
/// and starts a round in one Join) drops them.
pub(super) fn learn_round_start<A>(job: &mut Job<A>, start: u32) {
    let ours = job.barrier.as_ref().is_some_and(|b| b.ended.is_some() || b.start == start);
    let keep = ours && job.active == job.members && job.start_of.is_empty() && job.awaiting.is_empty();
    if keep {
        start_afresh(job, start);
    } else {
        reset_for_round(job, start);
    }
}

/// [`reset_for_round`] but the blocks.
fn start_afresh<A>(job: &mut Job<A>, start: u32) {
    job.barrier = None;
    job.start_block = start;
    job.anchor = RecoverAnchor { block: start, gen_id: 1 };
    job.active.clone_from(&job.members);
    job.awaiting.clear();
    job.start_of.clear();
    job.sync_answers.clear();
    job.sync_moved.clear();
    job.sync_waiting.clear();
    job.pending_sync.clear();
    job.missed_streak.iter_mut().for_each(|s| *s = 0);
    job.recover_lows.clear();
    job.recover_floor = None;
    job.liveness.failed = None;
}

/// Free every block record of the job on this shard (spares are kept for
/// reuse; reserved memory stays reserved, pooled buffers go back).
pub(super) fn drop_blocks<A>(job: &mut Job<A>) {
    let pooled = job.pool_floor.is_some();
    for slot in &mut job.slots {
        let (cur, prev) = (slot.cur.take(), slot.prev.take());
        if slot.spare.is_none() {
            slot.spare = cur.or(prev).map(|b| release(b, pooled));
        }
    }
    job.open_blocks = 0;
    job.live_records = 0;
}

/// Tell the members `to` (at the addresses given) that their round is over
/// and why (Membership notice: `age_op` = the cause, `src_id` = the rank,
/// `block_id` = where the next round starts).
pub(super) fn notify_round_end<A: Copy + PartialEq>(
    job: &mut Job<A>,
    end: RoundEnd,
    to: &[(usize, A)],
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) {
    let repr = Repr {
        age_op: end.cause,
        src_cnt: job.member_count,
        block_id: job.barrier.as_ref().map_or(0, |b| b.start),
        ..Repr::new(MessageType::Membership, job.spec.job_id, end.rank)
    };
    for &(m, addr) in to {
        let env = envelope(job.auth.as_mut(), Peer::Member(m));
        send(out, addr, repr.buffer_len(), env, |buf| repr.emit(&mut Packet::new_unchecked(buf)));
        counters.notices_sent += 1;
    }
}

/// A contribution for block `block_id` arriving between rounds: one of the
/// ended round's (before the next round's start) is answered with the
/// round's end notice and never aggregated. None: it belongs to the next
/// round (a shard that has not yet heard that the round started), or the
/// job is before its first round.
pub(super) fn stale_round<A>(job: &Job<A>, block_id: u32) -> Option<RoundEnd> {
    let barrier = job.barrier.as_ref()?;
    let ended = barrier.ended?;
    job.space.before(block_id, barrier.start).then_some(ended)
}
