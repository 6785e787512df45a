//! The aggregation tree (SwitchML++) from a child switch's side: sync
//! requests forwarded toward the root, and what comes down from the parent
//! (results, refusals, membership notices, sync answers), relayed to the
//! children.

use super::*;

impl<A: Copy + PartialEq> ValueSwitch<A> {
    /// Resend this switch's cached partial of a block that waits for its
    /// parent's answer (the data partial, or the exponent one when
    /// `exp_only`), because the partial or the answer was trimmed on the
    /// way: the parent adds a retransmission once and answers a block it
    /// completed with its result. Anything else is stale.
    pub(super) fn resend_partial_up(
        &mut self,
        job_id: u32,
        block_id: u32,
        gen_id: u16,
        exp_only: bool,
        out: &mut impl Transmit<A>,
    ) -> Verdict {
        let counters = &mut self.counters;
        let Some(job) = self.jobs.get_mut(&job_id) else {
            counters.unknown_job += 1;
            return Verdict::Consumed;
        };
        let local = job.slot_of(block_id, self.config.shard_count);
        let waiting = if exp_only { Phase::ExponentUp } else { Phase::DataUp };
        let Some(block) = job.slots.get_mut(local).and_then(|s| s.cur.as_mut()).filter(|b| {
            b.block_id == block_id && b.gen_id == gen_id && b.phase == waiting
        }) else {
            counters.parent_stale += 1;
            return Verdict::Consumed;
        };
        let mut reply = job_reply!(job, counters, out, &mut self.scratch, from: None, from_src: 0, uplink: job.uplink.as_ref());
        reply.send_up(block, exp_only, true);
        Verdict::Consumed
    }

    /// A child switch forwards a worker's join toward the root.
    pub(super) fn handle_sync(&mut self, from: A, packet: &Packet<&[u8]>, out: &mut impl Transmit<A>) -> Verdict {
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
        job.addrs.set(via as usize, from);
        job.pending_sync.insert(request.origin, (via, request.align_blocks));
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
    pub(super) fn handle_from_parent(&mut self, from: A, packet: &Packet<&[u8]>, out: &mut impl Transmit<A>) -> Verdict {
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
            MessageType::JoinAck if repr.age_op == JOIN_RECOVER && job.uplink.as_ref().is_some_and(|up| up.rank == repr.src_id) => {
                // The floor of a restarted parent's recovery, which this
                // switch reported its members' lowest block to.
                let Ok(params) = JoinParams::parse(packet.payload()) else {
                    counters.protocol_violation += 1;
                    return Verdict::Consumed;
                };
                return self.floor_from_parent(repr.job_id, params.next_block, out);
            }
            MessageType::JoinAck if repr.age_op == JOIN_ALL_DONE && job.uplink.as_ref().is_some_and(|up| up.rank == repr.src_id) => {
                // Every worker of the tree is done (done.rs).
                let Ok(params) = JoinParams::parse(packet.payload()) else {
                    counters.protocol_violation += 1;
                    return Verdict::Consumed;
                };
                all_done_from_parent(job, params.next_block);
                return Verdict::Consumed;
            }
            MessageType::JoinAck => {
                let Some((via, align)) = job.pending_sync.remove(&repr.src_id) else {
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
                // (the answer's header carries the generation before the start)
                let answered = JoinStart { block: params.next_block, gen_id: repr.gen_id };
                let start = start_here(job, &self.config, repr.src_id, via, align, answered);
                if start.block != answered.block {
                    counters.sync_moved += 1;
                }
                params.next_block = start.block;
                let repr = Repr { gen_id: start.gen_id, ..repr };
                // The worker talks to this switch's shards, not the root's,
                // and gets its results the way this switch sends them.
                params.incarnation = job.incarnation;
                // results reach the worker in order only within both this
                // switch's shard and the parent's order class
                params.order_shards = params.order_below(self.config.shard_count);
                params.shard_count = self.config.shard_count;
                params.results_on_group = job.listens_on_group.contains(via as usize);
                // the parent's result key (if any) is bound to the parent's
                // incarnation and wrapped for this switch: the worker gets
                // this switch's own, which its group results are sealed with
                params.result_key = job.result_key_for(via);
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
            MessageType::Nack
                if Nack::parse(packet.payload()).is_ok_and(|n| {
                    n.reason == NackReason::Trimmed && TrimCause::from_detail(n.detail) == Some(TrimCause::Network)
                }) =>
            {
                // A trimming link cut this switch's partial on its way up
                // (§4.14): resend it now rather than after the children's
                // next retransmissions.
                return self.resend_partial_up(repr.job_id, repr.block_id, repr.gen_id, repr.exp_only, out);
            }
            MessageType::Nack
                if Nack::parse(packet.payload()).is_ok_and(|n| {
                    n.reason == NackReason::Trimmed
                        && matches!(
                            TrimCause::from_detail(n.detail),
                            Some(TrimCause::ProcessingQueue | TrimCause::RateLimited)
                        )
                }) =>
            {
                // The parent is overloaded (its queue, or its policer for
                // this switch, which sends the whole subtree's partials):
                // the next partial up carries the congestion mark, as the
                // echo of a CE-marked result does, so the root marks that
                // block for every member and every window in the job
                // shrinks at the same result (docs/trimming-daemon.md, "In
                // aggregation trees"). A worker's own window cut on a trim
                // would not do: the trim reached this switch, not them. The
                // trimmed partial is recovered as before, through the
                // children's retransmissions; resending it now would add to
                // the overload.
                job.ce_echo_up = true;
                counters.parent_trimmed += 1;
                return Verdict::Consumed;
            }
            MessageType::Nack if Nack::parse(packet.payload()).is_ok_and(|n| n.reason == NackReason::StaleIncarnation) => {
                // The parent restarted and recovers: this switch's subtree
                // takes part (parent_restart.rs).
                let parent = Nack::parse(packet.payload()).map_or(0, |n| n.detail);
                return self.parent_restarted(repr.job_id, parent);
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
                if self.rx_ce {
                    // a queue between the parent and this switch marked the
                    // result: the next partial up echoes it (contribution.rs;
                    // by the owner only, so a handed-over result echoes once)
                    job.ce_echo_up = true;
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
                // This life of the job restarted (it or its parent did): a
                // partial its earlier life sent may have earned this result.
                let restarted_life = job.spec.resumed || job.parent_restart.is_some();
                let earlier_tag = job.earlier_tag;
                // what the parent says goes down, never up again: no uplink
                let mut reply = job_reply!(job, counters, out, &mut self.scratch, from: None, from_src: 0, uplink: None);
                if let Some(tag) = earlier_tag {
                    // the earlier parent's result of a block this switch
                    // still holds from before its restart (parent_restart.rs):
                    // for the workers still bound to that life
                    reply.tag = tag;
                }
                if repr.exp_only {
                    if matches!(block.phase, Phase::Exponent | Phase::ExponentUp) {
                        block.exp = repr.exp;
                        block.parent_age_op = Some(repr.age_op);
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
                    Phase::Exponent | Phase::Data if restarted_life && !repr.degraded => {
                        // A complete result of a block this life collects
                        // again (its members resend it in their recovery):
                        // earned by the partial an earlier life sent, and
                        // it may hold members' contributions this life has
                        // not seen yet. Relayed now it would go down marked
                        // degraded (lacking them here), failing a job that
                        // takes complete results only. The block completes
                        // here; its partial then finds the parent's result
                        // (the parent answers it as a duplicate, from the
                        // block or its slot's shadow).
                        reply.counters.parent_stale += 1;
                        return Verdict::Consumed;
                    }
                    // The parent completed (aged) the block before this
                    // subtree's partial reached it.
                    Phase::Exponent | Phase::ExponentUp | Phase::Data => job.open_blocks -= 1,
                }
                let n = repr.grad_cnt as usize;
                block.sum.resize(n, 0);
                fanin_wire::value::read_lanes(repr.dtype, packet.payload(), &mut block.sum[..n]);
                block.dtype = repr.dtype; // the lanes the result goes down in
                block.grad_cnt = repr.grad_cnt;
                block.has_data = true;
                block.exp = repr.exp;
                block.next_exp = repr.next_exp;
                block.final_block = repr.final_block;
                block.aged |= repr.age_op == AGE_OP_AGED;
                // the root's mark is the job's (it has every subtree's):
                // every member cuts at the same result (docs/congestion.md)
                block.congested = repr.age_op == AGE_OP_CONGESTED;
                block.parent_result = Some((repr.src_cnt, repr.degraded));
                block.parent_age_op = Some(repr.age_op);
                block.phase = Phase::Done;
                reply.send_to_all(block, false);
                reply.counters.relayed_down += job.member_count as u64;
            }
            _ => counters.protocol_violation += 1,
        }
        Verdict::Consumed
    }
}
