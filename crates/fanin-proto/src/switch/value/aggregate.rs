//! Aggregating one block: exponent rounds, data contributions, results, aging (Trio-ML §4, SwitchML).

use super::*;

/// What a contribution did to its block.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Outcome {
    /// It was counted (not a duplicate, not refused).
    pub(super) accepted: bool,
    /// It completed the block: the final result went out.
    pub(super) completed: bool,
    /// A data contribution to a block already emitted without its source.
    pub(super) late: bool,
    /// A data contribution that does not line up with the block's (another
    /// element count or `final` bit): the members disagree on the length.
    pub(super) mismatch: bool,
}

/// Copy the datagram in `scratch` to every member with a known address
/// (sealed for each, if the job is keyed).
pub(super) fn broadcast<A: Copy + PartialEq>(
    members: &SourceMask,
    addrs: &MemberAddrs<A>,
    auth: Option<&mut JobAuth>,
    out: &mut impl Transmit<A>,
    scratch: &[u8],
    sent: &mut u64,
) {
    send_to_members(members.iter(), addrs, auth, out, scratch, sent)
}

/// Copy the datagram in `scratch` to the members `ids` that have a known
/// address (sealed for each, if the job is keyed); unkeyed, once per
/// distinct address (members behind one GOAT relay share its address, and
/// the relay fans the one copy out, docs/goat.md).
pub(super) fn send_to_members<A: Copy + PartialEq>(
    ids: impl Iterator<Item = usize>,
    addrs: &MemberAddrs<A>,
    mut auth: Option<&mut JobAuth>,
    out: &mut impl Transmit<A>,
    scratch: &[u8],
    sent: &mut u64,
) {
    // Unkeyed: the same bytes for everyone, queued once.
    if auth.is_none() && !fanin_wire::auth::is_sealed(scratch) {
        let dests = ids.filter_map(|id| addrs.get(id).copied().flatten());
        if addrs.shared() {
            let mut distinct: Vec<A> = Vec::new();
            for addr in dests {
                if !distinct.contains(&addr) {
                    distinct.push(addr);
                }
            }
            *sent += out.push_fanout(distinct, scratch) as u64;
        } else {
            *sent += out.push_fanout(dests, scratch) as u64;
        }
        return;
    }
    for id in ids {
        if let Some(addr) = addrs.get(id).copied().flatten() {
            if send_copy(out, addr, scratch, envelope(auth.as_deref_mut(), Peer::Member(id))) {
                *sent += 1;
            }
        }
    }
}

/// `no_data`: the header of a data result without its sum, for a member
/// that owns no part of the block (reduce-scatter).
pub(super) fn build_result(
    block: &Block,
    job_id: u32,
    exp_only: bool,
    no_data: bool,
    lacking: bool,
    tag: u16,
    scratch: &mut Vec<u8>,
) {
    // src_id of a result is the switch's incarnation tag (docs/restart.md)
    let mut repr = Repr { src_id: tag, ..block.result_repr(job_id, exp_only, lacking) };
    let no_data = no_data && !exp_only;
    if no_data {
        repr.no_data = true;
        repr.grad_cnt = 0;
    }
    // Every byte is written below (header, then the payload when there is
    // one), so a scratch of the right length needs no zeroing first.
    if scratch.len() != repr.buffer_len() {
        scratch.clear();
        scratch.resize(repr.buffer_len(), 0);
    }
    let mut packet = Packet::new_unchecked(&mut scratch[..]);
    repr.emit(&mut packet);
    if !exp_only && !no_data {
        fanin_wire::value::write_lanes(block.dtype, &block.sum[..block.grad_cnt as usize], packet.payload_mut());
    }
}

/// An exponent-only contribution.
pub(super) fn contribute_exponent<A: Copy + PartialEq, T: Transmit<A>>(
    block: &mut Block,
    src: usize,
    weight: u16,
    exp: i8,
    reply: &mut Reply<'_, A, T>,
) -> Outcome {
    match block.phase {
        Phase::Exponent => {
            if !block.receive(src, weight) {
                reply.counters.duplicate += 1;
                return Outcome::default();
            }
            reply.touch(block);
            reply.counters.accepted += 1;
            block.exp = block.exp.max(exp);
            if block.satisfied(reply.quorum) {
                if !block.aged {
                    reply.sample_spread(block);
                }
                finish_exponent_round(block, reply);
            }
            Outcome { accepted: true, ..Outcome::default() }
        }
        // The parent's exponent is outstanding: a child retransmitting
        // means the answer may be lost; resend the cached partial.
        Phase::ExponentUp => {
            reply.counters.duplicate += 1;
            reply.send_up(block, true, true);
            Outcome::default()
        }
        Phase::Done if block.expired_up => {
            reply.nack_expired(block);
            Outcome::default()
        }
        // The sender missed the negotiated exponent: tell it again.
        Phase::Data | Phase::DataUp | Phase::Done => {
            reply.counters.duplicate += 1;
            reply.send_to_sender(block, true, false);
            Outcome::default()
        }
    }
}

/// The exponent round is over (everyone expected sent one, or it aged): the
/// root announces the exponent; a non-root switch sends its maximum up and
/// waits for the parent's.
pub(super) fn finish_exponent_round<A: Copy + PartialEq, T: Transmit<A>>(block: &mut Block, reply: &mut Reply<'_, A, T>) {
    if reply.uplink.is_some() {
        block.phase = Phase::ExponentUp;
        reply.send_up(block, true, false);
    } else {
        announce_exponent(block, reply);
    }
}

/// Tell the members the block's exponent and collect data from the sources
/// that took part in the exponent round.
pub(super) fn announce_exponent<A: Copy + PartialEq, T: Transmit<A>>(block: &mut Block, reply: &mut Reply<'_, A, T>) {
    block.phase = Phase::Data;
    block.negotiated = true;
    reply.send_to_all(block, true);
    if block.aged {
        // Sources that sent no exponent are not waited for with data either.
        block.expected.clone_from(&block.rcvd);
        block.expected_count = block.rcvd.count() as u16;
    }
    block.restart_collection();
    reply.start_phase(block);
    reply.touch(block);
}

/// A data contribution.
pub(super) fn contribute_data<A: Copy + PartialEq, T: Transmit<A>>(
    block: &mut Block,
    src: usize,
    weight: u16,
    packet: &Packet<&[u8]>,
    reply: &mut Reply<'_, A, T>,
) -> Outcome {
    if matches!(block.phase, Phase::Exponent | Phase::ExponentUp) {
        // Data carries an exponent the switch gave out already (the
        // lookahead from block - block_cnt_max, which every worker that had
        // that result shares): adopt it. This happens when a worker that
        // lacks the lookahead (a straggler catching up) opened the block
        // with an exponent-only round; the round's senders get the exponent
        // now instead of everyone waiting for the round to age.
        // (In a tree the parent adopts it the same way when this switch's
        // data partial arrives.)
        block.exp = packet.exp();
        block.phase = Phase::Data;
        block.negotiated = true;
        reply.send_to_all(block, true);
        block.restart_collection();
        reply.start_phase(block);
    }
    match block.phase {
        Phase::Exponent | Phase::ExponentUp => unreachable!("left above"),
        Phase::Done if block.expired_up => {
            reply.nack_expired(block);
            Outcome::default()
        }
        Phase::DataUp => {
            // The parent's result is outstanding: answer a child's
            // retransmission by resending the cached partial, never by
            // adding anything (a late child's data is not in it). All the
            // children retransmit after a loss, so the partial goes up on
            // the first request and then once per round of requests (one
            // per child), not once per request: a switch with many children
            // would otherwise flood its uplink with copies exactly when it
            // is lossy (found by `fanin sim allreduce` at 1% loss).
            count_unadded(block, src, reply.counters);
            block.asks_since_resend += 1;
            if block.asks_since_resend == 1 || block.asks_since_resend > block.expected_count {
                block.asks_since_resend = 1;
                reply.send_up(block, false, true);
            }
            Outcome::default()
        }
        Phase::Done => {
            // A straggler's contribution to a block emitted without it is
            // never added anywhere; it gets the partial result instead.
            let late = count_unadded(block, src, reply.counters);
            if late && block.aged {
                // how late the skew made it: a sample, so a job whose ranks
                // are always further apart than block_exp learns to wait
                reply.sample_spread(block);
            }
            reply.send_to_sender(block, false, packet.no_data());
            Outcome { late, ..Outcome::default() }
        }
        Phase::Data => {
            let grad_cnt = packet.grad_cnt();
            let float = block.dtype.is_block_floating_point();
            if block.has_data {
                // Members that reduce tensors of one length send every block
                // with the same element count, and mark the same block final.
                // Otherwise they disagree on the allreduce's length: the
                // caller ends the round (or refuses the sender).
                if grad_cnt != block.grad_cnt || packet.final_block() != block.final_block {
                    reply.counters.mismatch += 1;
                    return Outcome { mismatch: true, ..Outcome::default() };
                }
                if float && packet.exp() != block.exp {
                    reply.counters.mismatch += 1;
                    reply.nack(packet, NackReason::ExponentMismatch, block.exp as u8 as u32);
                    return Outcome::default();
                }
            } else if float && block.negotiated && packet.exp() != block.exp {
                reply.counters.mismatch += 1;
                reply.nack(packet, NackReason::ExponentMismatch, block.exp as u8 as u32);
                return Outcome::default();
            }
            // A worker whose values the block's exponent cannot carry (it
            // took no part in fixing it: a straggler) abstains, `degraded`
            // on its contribution (protocol.md §5.5): it counts as arrived,
            // so nobody waits for it, but sums no worker and adds nothing,
            // and the result says it lacks a member.
            let abstains = src < SWITCH_RANK_BASE as usize && packet.degraded();
            if !block.receive(src, if abstains { 0 } else { weight }) {
                reply.counters.duplicate += 1;
                return Outcome::default();
            }
            reply.touch(block);
            reply.counters.accepted += 1;
            if packet.no_data() {
                block.no_data.insert(src);
            }
            block.child_degraded |= src >= SWITCH_RANK_BASE as usize && packet.degraded();
            block.abstained |= abstains;
            let payload = packet.payload();
            let n = grad_cnt as usize;
            if block.has_data {
                if !abstains {
                    fanin_wire::value::add_lanes(block.dtype, &mut block.sum[..n], payload);
                }
            } else {
                block.has_data = true;
                block.grad_cnt = grad_cnt;
                block.exp = packet.exp();
                block.sum.resize(n, 0);
                if abstains {
                    block.sum[..n].fill(0);
                } else {
                    fanin_wire::value::read_lanes(block.dtype, payload, &mut block.sum[..n]);
                }
            }
            block.next_exp = block.next_exp.max(packet.next_exp());
            block.final_block |= packet.final_block();
            let completed = block.satisfied(reply.quorum);
            if completed {
                if !block.aged {
                    reply.sample_spread(block);
                }
                finish_block(block, reply);
            }
            Outcome { accepted: true, completed, ..Outcome::default() }
        }
    }
}

/// A contribution to a block past its data phase adds nothing: count it as a
/// duplicate if its source is in the block, as late otherwise (returned).
pub(super) fn count_unadded(block: &Block, src: usize, counters: &mut Counters) -> bool {
    if block.rcvd.contains(src) {
        counters.duplicate += 1;
        false
    } else {
        counters.late += 1;
        true
    }
}

/// The data phase is over: the root emits the block's final result to
/// every member; a non-root switch sends its partial up and waits.
pub(super) fn finish_block<A: Copy + PartialEq, T: Transmit<A>>(block: &mut Block, reply: &mut Reply<'_, A, T>) {
    if reply.uplink.is_some() {
        block.phase = Phase::DataUp;
        reply.send_up(block, false, false);
        return;
    }
    block.phase = Phase::Done;
    reply.counters.blocks_completed += 1;
    if reply.lacks_a_member(block) || block.aged || block.child_degraded || block.abstained || block.replaced {
        reply.counters.blocks_degraded += 1;
    }
    reply.send_to_all(block, false);
}

/// A scanner named block `block_id` of slot `local` idle: age it out if it
/// is still there, still aggregating and still unreferenced; a slot whose
/// block stopped aggregating gets its scan word closed.
pub(super) fn age_if_idle<A: Copy + PartialEq>(
    job: &mut Job<A>,
    local: usize,
    block_id: u32,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    scratch: &mut Vec<u8>,
    newly_slow: &mut Vec<usize>,
) {
    let Some(board) = job.aging.as_ref().map(|a| a.board.clone()) else { return };
    let here = job.slots.get(local).and_then(|s| s.cur.as_ref()).filter(|b| b.block_id == block_id);
    match here {
        Some(block) if block.aggregating() => {
            if board.still_idle(local, block_id) {
                age_out(job, local, counters, out, scratch, newly_slow);
            }
        }
        // done, waiting for the parent, evicted or dropped with its round
        _ => {
            if board.still_idle(local, block_id) {
                board.close(local);
            }
        }
    }
}

/// Block `local` of `job` was unreferenced for the job's `checks` visits:
/// give up on the missing sources. An exponent round moves on with the
/// exponents it has; a data block emits its partial sum.
pub(super) fn age_out<A: Copy + PartialEq>(
    job: &mut Job<A>,
    local: usize,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    scratch: &mut Vec<u8>,
    newly_slow: &mut Vec<usize>,
) {
    let block = job.slots[local].cur.as_mut().expect("the scanner found an open block here");
    if block.rcvd.is_empty() {
        // A data phase nobody has sent to yet (everyone in the exponent
        // round was declared slow): there is nothing to emit. Keep waiting;
        // the first data contribution re-arms the timeout.
        if let Some(aging) = job.aging.as_ref() {
            aging.board.restart_count(local, block.block_id);
        }
        return;
    }
    block.aged = true;
    counters.blocks_aged += 1;
    close_phase(job, local, counters, out, scratch, newly_slow);
}

/// End the current phase of the open block in slot `local` with what it
/// has: an exponent round announces its exponent, a data phase emits its
/// result (and counts the sources missing from it).
pub(super) fn close_phase<A: Copy + PartialEq>(
    job: &mut Job<A>,
    local: usize,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    scratch: &mut Vec<u8>,
    newly_slow: &mut Vec<usize>,
) {
    let mut reply = job_reply!(job, counters, out, scratch, from: None, from_src: 0, uplink: job.uplink.as_ref());
    let block = job.slots[local].cur.as_mut().expect("an open block");
    match block.phase {
        Phase::Exponent => finish_exponent_round(block, &mut reply),
        Phase::Data => {
            finish_block(block, &mut reply);
            job.open_blocks -= 1;
            let block = job.slots[local].cur.as_ref().expect("still there");
            let in_job = |m| in_block(&job.awaiting, &job.start_of, job.space, block, m);
            account_missing(block, &job.members, &job.active, in_job, &mut job.missed_streak, job.aging.as_ref(), newly_slow);
        }
        Phase::ExponentUp | Phase::DataUp | Phase::Done => {}
    }
}

/// After a partial result: every active source missing from it moves one
/// block closer to being declared permanently slow.
/// (`in_job`: whether a member was in the job at the block, [`in_block`]:
/// one that joined later did not miss it.)
pub(super) fn account_missing(
    block: &Block,
    members: &SourceMask,
    active: &SourceMask,
    in_job: impl Fn(usize) -> bool,
    streak: &mut [u32],
    aging: Option<&JobAging>,
    newly_slow: &mut Vec<usize>,
) {
    let limit = aging.map_or(0, |a| a.slow_after_blocks);
    for m in members.iter() {
        if active.contains(m) && !block.rcvd.contains(m) && in_job(m) {
            streak[m] = streak[m].saturating_add(1);
            if limit > 0 && streak[m] as u64 >= limit && !newly_slow.contains(&m) {
                newly_slow.push(m);
            }
        }
    }
}

/// NoAggr: return the contribution to its sender as a result, untouched;
/// a `no_data` one (a reduce-scatter block its sender does not own) as the
/// header without lanes, as an aggregating job answers it: a result never
/// carries both.
pub(super) fn reflect<A: Copy + PartialEq>(
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    from: A,
    env: Envelope,
    packet: &Packet<&[u8]>,
    tag: u16,
) {
    let bytes = packet.into_inner();
    let no_data = packet.no_data();
    let len = if no_data { HEADER_LEN } else { bytes.len() };
    send(out, from, len, env, |buf| {
        buf.copy_from_slice(&bytes[..len]);
        let mut reply = Packet::new_unchecked(buf);
        reply.set_msg_type(MessageType::Result);
        reply.set_src_cnt(1);
        reply.set_src_id(tag);
        if no_data {
            reply.set_grad_cnt(0);
        }
    });
    counters.forwarded += 1;
}

/// A contribution for a block whose result is gone: count it and tell the
/// sender which block the slot holds now.
pub(super) fn expired<A: Copy + PartialEq>(
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    from: A,
    env: Envelope,
    packet: &Packet<&[u8]>,
    held: u32,
    tag: u16,
) {
    counters.expired += 1;
    send_nack_tagged(counters, out, from, env, packet, NackReason::BlockExpired, held, Some(tag));
}

/// Start a new block in `slot`: the current block becomes the shadow copy
/// and the old shadow's storage is reused; with `recycle`, the current
/// block's own record is (pooled memory: every member has its result, and
/// there is no memory for a shadow).
#[allow(clippy::too_many_arguments)]
pub(super) fn open_block(
    slot: &mut Slot,
    local: usize,
    capacity: usize,
    block_id: u32,
    packet: &Packet<&[u8]>,
    exp_only: bool,
    now: Time,
    active: &SourceMask,
    start_of: &HashMap<u16, u32>,
    space: BlockSpace,
    recycle: bool,
) {
    let mut old = slot.cur.take();
    let mut block = match recycle {
        true => old.take().expect("a recycled record is the slot's current block"),
        false => slot.prev.take().or_else(|| slot.spare.take()).unwrap_or_else(|| Block::new(capacity)),
    };
    if old.as_ref().is_some_and(|b| b.released) {
        // no shadow of a block every member acknowledged
        slot.spare = old.take();
    }
    let dtype = Dtype::from_u8(packet.dtype_code()).expect("checked by new_checked");
    block.reset(block_id, packet.gen_id(), dtype, exp_only, now, active);
    block.local = local as u32;
    // members that joined later are not waited for before their start
    for (&m, &start) in start_of {
        if space.before(block_id, start) && block.expected.remove(m as usize) {
            block.expected_count -= 1;
        }
    }
    slot.prev = old;
    slot.cur = Some(block);
}

/// Tick `k` of a job's scanners falls at `k * tick`; when blocks open after
/// the job was idle, the schedule resumes at the next tick after `now`.
pub(super) fn realign_scanners(aging: &mut JobAging, now: Time, open_blocks: usize) {
    if open_blocks == 1 && aging.next_tick <= now {
        aging.next_tick = Time::from_nanos((now.as_nanos() / aging.tick + 1) * aging.tick);
    }
}
