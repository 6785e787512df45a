//! A contribution datagram: the checks before it may touch a block (member,
//! incarnation, round, shard, rate limit, caps), finding or opening its
//! block in the slot, and what its outcome changes for the job.

use super::*;

impl<A: Copy + PartialEq> ValueSwitch<A> {
    pub(super) fn handle_contribution(
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
            send_nack(counters, out, from, env, packet, NackReason::StaleIncarnation, job.incarnation);
            return Verdict::Consumed;
        }
        if src >= SWITCH_RANK_BASE as usize && job.switches_rejoin {
            // A recovery here waits for every member's lowest block, a
            // child switch's too: its partials count again once the floor
            // is known. The nack makes it restart its subtree's stream and
            // report (parent_restart.rs).
            counters.child_rejoin_asked += 1;
            let env = envelope(job.auth.as_mut(), Peer::Member(src));
            send_nack(counters, out, from, env, packet, NackReason::StaleIncarnation, job.incarnation);
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
        job.addrs.set(src, from);

        let local = job.slot_of(block_id, shard_count);
        let may_take_record = job.may_take_record(self.memory_used, self.config.memory_limit);
        let pooled = job.pool_floor.is_some();
        let slot = &job.slots[local];
        // Find the record this packet belongs to: the slot's current block,
        // its shadow, or a new block if the packet opens the next use of the
        // slot.
        let (is_prev, opens) = match &slot.cur {
            None => {
                if job.space.before(block_id, job.start_block) {
                    if !job.start_settled && uses_rounds(job) {
                        // A recovering member's block, before this shard
                        // learnt where the stream resumes (join::resume_at):
                        // it is sent again, and by then the shard knows.
                        counters.recover_waiting += 1;
                        return Verdict::Consumed;
                    }
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
                    // A child that was in the block and sends the next one
                    // has the block's result, or no longer needs it: its
                    // partial here waits for a parent's answer that no child
                    // will ask for again (it reached this switch late: the
                    // child was the root meanwhile and finished the block
                    // alone, docs/trees.md). Ask the parent now, as a
                    // child's retransmission would; its answer frees the slot.
                    let waits_up = matches!(cur.phase, Phase::DataUp | Phase::ExponentUp) && cur.rcvd.contains(src);
                    let (held, gen, exp_up) = (cur.block_id, cur.gen_id, cur.phase == Phase::ExponentUp);
                    send_trim_nack(counters, out, from, env, packet, TrimCause::MemoryExhausted);
                    if waits_up {
                        return self.resend_partial_up(packet.job_id(), held, gen, exp_up, out);
                    }
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
        if !opens && !is_prev && slot.cur.as_ref().is_some_and(|b| b.released) {
            // Every member acknowledged this block's result and its buffer
            // went back to the pool: a copy from one of them is stale; anyone
            // else is told it expired, as after a slot reuse.
            let cur = slot.cur.as_ref().expect("checked");
            if cur.moved_on.contains(src) {
                counters.duplicate += 1;
            } else {
                let held = cur.block_id;
                let env = envelope(job.auth.as_mut(), Peer::Member(src));
                expired(counters, out, from, env, packet, held, job.tag);
            }
            return Verdict::Consumed;
        }
        // A new block needs a record: its slot's shadow is reused if it has
        // one; otherwise a new record takes a buffer from pooled memory if
        // the job may have one, or, with no memory free, the slot's done
        // block gives up its own once every member still active that was
        // in it has sent this block (so has its result); or, in a job whose
        // members acknowledge results, the latest block after this one that
        // the job still aggregates gives up its own (pool.rs). Until then:
        // the back-pressure nack, never another job's memory.
        let mut recycle = false;
        if opens && slot.prev.is_none() && !may_take_record {
            let slot = &mut job.slots[local];
            let done = slot.cur.as_mut().filter(|cur| cur.holds_result());
            let all_moved_on = done.is_some_and(|cur| {
                cur.moved_on.insert(src);
                cur.rcvd.iter().all(|m| !job.active.contains(m) || cur.moved_on.contains(m))
            });
            if all_moved_on {
                recycle = true;
                counters.records_recycled += 1;
            } else if !(job.frees_at_acknowledgement() && evict_later_block(job, block_id, pooled, counters, out)) {
                counters.memory_exhausted += 1;
                let env = envelope(job.auth.as_mut(), Peer::Member(src));
                send_trim_nack(counters, out, from, env, packet, TrimCause::MemoryExhausted);
                return Verdict::Consumed;
            }
        }
        let slot = &mut job.slots[local];
        if opens {
            if slot.prev.is_none() && !recycle {
                job.live_records += 1;
            }
            open_block(slot, local, job.members.capacity(), block_id, packet, exp_only, now, &job.active, &job.start_of, job.space, recycle);
            if let Some(aging) = job.aging.as_ref() {
                aging.board.touch(local, block_id);
            }
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
                let (same_allreduce, block_dtype) = (block.gen_id == packet.gen_id(), block.dtype);
                if same_allreduce && uses_rounds(job) && job.barrier.is_none() {
                    // The ranks disagree on the allreduce's element type: as
                    // with a length that does not line up, every member of
                    // the round raises at once (only this one was told, and
                    // the others waited for its contribution until the
                    // member timeout blamed it as silent).
                    let end = RoundEnd { cause: MEMBERSHIP_MISMATCH, rank: src as u16 };
                    return finish_round(job, &self.config, end, None, counters, out);
                }
                let env = envelope(job.auth.as_mut(), Peer::Member(src));
                send_nack(counters, out, from, env, packet, NackReason::DtypeMismatch, block_dtype as u32);
            }
            return Verdict::Consumed;
        }
        // A retransmission that fills a hole while other members'
        // contributions to this phase arrived: this member's transmission
        // was lost on its path (a queue overflowed), and the block's result
        // will say so to every member at once (docs/congestion.md). A
        // duplicate (a spurious retransmission) fills nothing and marks
        // nothing; nor does a straggler's first transmission.
        // In a tree, a child switch's partial carries the marks of its
        // subtree up, so the root's result marks the block for the whole job.
        {
            let block = if is_prev { slot.prev.as_mut() } else { slot.cur.as_mut() }.expect("located above");
            let same_phase = exp_only == (block.phase == Phase::Exponent);
            let fills_hole =
                packet.msg_type_code() == MessageType::Retransmission as u8 && !block.rcvd.is_empty();
            // A queue on the way up marked it (ECN CE), or the sender says
            // one on its way down did (a worker's echo); a child switch's
            // partial carries its subtree's marks the same way.
            let marked_below = packet.age_op() == AGE_OP_CONGESTED;
            let path_marked = self.rx_ce || marked_below;
            // A CE mark on a result this switch's parent sent it rides up
            // on the next partial: on this block's (docs/congestion.md).
            let echo_up = job.ce_echo_up && job.uplink.is_some();
            if same_phase && block.aggregating() && !block.rcvd.contains(src) && (fills_hole || path_marked || echo_up) {
                if !block.congested {
                    counters.congestion_marked += 1;
                }
                if marked_below && src < SWITCH_RANK_BASE as usize {
                    counters.ecn_echoed += 1;
                }
                if echo_up {
                    job.ce_echo_up = false;
                }
                block.congested = true;
            }
        }
        // A child switch's partial sums `src_cnt` workers; a worker is one.
        // (a child's data partial may sum no worker: every one of its
        // workers abstained from the block, protocol.md §5.5)
        let weight = if src < SWITCH_RANK_BASE as usize {
            1
        } else if packet.exp_only() {
            packet.src_cnt().max(1)
        } else {
            packet.src_cnt()
        };
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
            let in_job = |m| in_block(&job.awaiting, &job.start_of, job.space, block, m);
            account_missing(block, &job.members, &job.active, in_job, &mut job.missed_streak, job.aging.as_ref(), &mut newly_slow);
            // Every member contributed to the newer block, so every member had
            // the shadow's result: free it. After a partial result the shadow
            // stays until the slot is reused, for the stragglers that lack it.
            // (Members compared, not counted: a member that left after
            // contributing is in `rcvd` and stood in for one that lacked it.)
            if !lacks_a_member(&job.members, &job.awaiting, &job.start_of, job.space, block) {
                if let Some(old) = slot.prev.take() {
                    slot.spare = Some(release(old, pooled));
                    job.live_records -= 1;
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
