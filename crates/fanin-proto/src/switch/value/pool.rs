//! Pooled memory beyond the slot floor (docs/memory.md, "Free at
//! acknowledgement"): result acknowledgements free done blocks in any slot,
//! and a job short of memory moves a record from a later block it is still
//! aggregating to a lower one (eviction), so a job whose members acknowledge
//! results always progresses with one reserved record per shard.

use fanin_wire::value::result_ack_holds;

use super::*;

impl<A: Copy + PartialEq> ValueSwitch<A> {
    /// A member's `ResultAck`: it holds every result before the header's
    /// block and those its bitmap names. Each done block of this shard it
    /// names records the member as having moved on; a block every member
    /// has moved on from gives its buffer back (a shadow is dropped, a
    /// slot's current block keeps its header, `released`).
    pub(super) fn handle_result_ack(&mut self, packet: &Packet<&[u8]>) -> Verdict {
        let counters = &mut self.counters;
        let Some(job) = self.jobs.get_mut(&packet.job_id()) else {
            counters.unknown_job += 1;
            return Verdict::Consumed;
        };
        let src = packet.src_id() as usize;
        if !job.members.contains(src) || job.spec.mode != JobMode::Aggregate {
            counters.non_member += 1;
            return Verdict::Consumed;
        }
        counters.result_acks += 1;
        let (base, body, space) = (packet.block_id(), packet.payload(), job.space);
        let holds = |b: u32| space.before(b, base) || result_ack_holds(body, space.distance(b, base));
        let pooled = job.pool_floor.is_some();
        for local in 0..job.slots.len() {
            let slot = &mut job.slots[local];
            for block in [slot.prev.as_mut(), slot.cur.as_mut()].into_iter().flatten() {
                if block.holds_result() && holds(block.block_id) {
                    block.moved_on.insert(src);
                }
            }
            if slot.prev.as_ref().is_some_and(|b| every_holder_moved_on(b, &job.active, &job.start_of, space)) {
                let old = slot.prev.take().expect("checked");
                slot.spare = Some(release(old, pooled));
                job.live_records -= 1;
                counters.records_acked += 1;
            }
            let cur_done = slot.cur.as_ref().is_some_and(|b| b.holds_result() && every_holder_moved_on(b, &job.active, &job.start_of, space));
            if slot.prev.is_none() && cur_done && pooled {
                let cur = slot.cur.as_mut().expect("checked");
                cur.sum = Vec::new();
                cur.released = true;
                job.live_records -= 1;
                counters.records_acked += 1;
            }
        }
        Verdict::Consumed
    }
}

/// Every member that may still ask for `block`'s result has said it holds
/// it: the active members (a permanently slow one is told the block
/// expired, as after any slot reuse), except those that start after it.
pub(super) fn every_holder_moved_on(
    block: &Block,
    active: &SourceMask,
    start_of: &HashMap<u16, u32>,
    space: BlockSpace,
) -> bool {
    active.iter().all(|m| {
        block.moved_on.contains(m) || start_of.get(&(m as u16)).is_some_and(|&s| space.before(block.block_id, s))
    })
}

/// With no memory for block `block_id`, take the record of the latest block
/// after it that this job still aggregates on this shard: its partial sum
/// is dropped, its contributors get the same `MemoryExhausted` trim a
/// refused block gets (they resend it), and its slot goes back to what it
/// held before. The lowest blocks of a job are the ones its members wait
/// for first, so a job never waits on memory its own later blocks hold.
/// Returns whether a record was freed (the caller's block takes it).
pub(super) fn evict_later_block<A: Copy + PartialEq>(
    job: &mut Job<A>,
    block_id: u32,
    pooled: bool,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) -> bool {
    let space = job.space;
    let victim = job
        .slots
        .iter()
        .enumerate()
        // (not a block whose exponent was negotiated: its members were told
        // it, and a reopened exponent round could age into another one)
        .filter_map(|(i, s)| {
            s.cur.as_ref().filter(|b| b.aggregating() && !b.negotiated && space.before(block_id, b.block_id)).map(|b| (i, b.block_id))
        })
        .reduce(|a, b| if space.before(a.1, b.1) { b } else { a });
    let Some((local, victim_id)) = victim else { return false };
    let s = job.spec.block_cnt_max;
    let slot = &mut job.slots[local];
    let mut block = slot.cur.take().expect("found above");
    for m in block.rcvd.iter() {
        let Some(dest) = job.addrs.get(m).copied().flatten() else { continue };
        let repr = Repr {
            exp_only: block.phase == Phase::Exponent,
            dtype: block.dtype,
            gen_id: block.gen_id,
            block_id: victim_id,
            ..Repr::new(MessageType::Nack, job.spec.job_id, m as u16)
        };
        let env = envelope(job.auth.as_mut(), Peer::Member(m));
        send_counted_nack(counters, out, dest, env, |buf| {
            let mut reply = Packet::new_unchecked(&mut *buf);
            repr.emit(&mut reply);
            Nack { reason: NackReason::Trimmed, detail: TrimCause::MemoryExhausted as u32 }.emit(reply.payload_mut());
        });
    }
    // The slot holds what it held before the victim opened: its shadow
    // again, or a released header one slot-cycle before the victim, so the
    // victim's resend opens as the slot's next block and a copy of the
    // block before it is told it expired.
    match slot.prev.take() {
        Some(shadow) => {
            slot.cur = Some(shadow);
            slot.spare = Some(release(block, pooled));
        }
        None => {
            block.block_id = space.add(victim_id, space.size().saturating_sub(s as u64) as u32);
            block.phase = Phase::Done;
            block.released = true;
            block.sum = Vec::new();
            block.rcvd.clear();
            block.moved_on.clear();
            slot.cur = Some(block);
        }
    }
    job.live_records -= 1;
    job.open_blocks -= 1;
    counters.records_evicted += 1;
    true
}
