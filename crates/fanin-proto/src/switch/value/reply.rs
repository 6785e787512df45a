//! How the program answers: a [`Reply`] bundles what sending a result, a
//! partial to the parent or a nack needs (`job_reply!` builds one for a job).

use super::*;

/// The [`Reply`] of `job`: it borrows only the job fields it needs, and as a
/// macro (not a method) it leaves `job.slots` free for the caller to hold.
macro_rules! job_reply {
    ($job:ident, $counters:expr, $out:expr, $scratch:expr, from: $from:expr, from_src: $src:expr, uplink: $uplink:expr) => {
        Reply {
            job_id: $job.spec.job_id,
            block_cnt_max: $job.spec.block_cnt_max,
            members: &$job.members,
            awaiting: &$job.awaiting,
            start_of: &$job.start_of,
            space: $job.space,
            quorum: $job.spec.quorum,
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
            aging: $job.aging.as_mut(),
        }
    };
}

/// Everything a contribution needs to answer: the job's members and their
/// addresses, the sender, the counters and the output sink.
pub(super) struct Reply<'a, A, T> {
    pub(super) job_id: u32,
    pub(super) block_cnt_max: u32,
    pub(super) members: &'a SourceMask,
    /// Members that will join (sync joins) and the joiners' start blocks:
    /// a block before a member's start never had it ([`Reply::members_of`]).
    pub(super) awaiting: &'a SourceMask,
    pub(super) start_of: &'a HashMap<u16, u32>,
    pub(super) space: BlockSpace,
    /// GOAT's K: a phase completes with this many contributions (0: all).
    pub(super) quorum: u16,
    pub(super) addrs: &'a MemberAddrs<A>,
    /// The job's result group and the members listening on it.
    pub(super) group: Option<(std::net::SocketAddrV4, &'a SourceMask)>,
    /// A non-root switch sends completed phases to its parent.
    pub(super) uplink: Option<&'a Uplink<A>>,
    /// A keyed job's keys: every datagram is sealed for its destination.
    pub(super) auth: Option<&'a mut JobAuth>,
    pub(super) counters: &'a mut Counters,
    /// The sender of the datagram being handled (none for timer work).
    pub(super) from: Option<A>,
    /// Its source id (meaningful when `from` is set).
    pub(super) from_src: usize,
    pub(super) out: &'a mut T,
    /// The result is built once here and copied to each destination.
    pub(super) scratch: &'a mut Vec<u8>,
    /// This switch's incarnation tag, carried in results and nacks.
    pub(super) tag: u16,
    /// The job's straggler detector, if it ages blocks: its clock stamps a
    /// phase's start, and phases and late contributions are its samples.
    pub(super) aging: Option<&'a mut JobAging>,
}

impl<A: Copy + PartialEq, T: Transmit<A>> Reply<'_, A, T> {
    /// Whether `block` lacks a member it should have summed ([`lacks_a_member`]).
    pub(super) fn lacks_a_member(&self, block: &Block) -> bool {
        lacks_a_member(self.members, self.awaiting, self.start_of, self.space, block)
    }

    /// The block was referenced (a contribution added, its data phase
    /// began): Trio's REF flag, in the job's scan words.
    pub(super) fn touch(&self, block: &Block) {
        if let Some(aging) = self.aging.as_ref() {
            aging.board.touch(block.local as usize, block.block_id);
        }
    }

    /// A block's phase begins now (its first contribution, or the exponent
    /// announced): where its spread is measured from.
    pub(super) fn start_phase(&self, block: &mut Block) {
        if let Some(aging) = self.aging.as_ref() {
            block.phase_start = aging.clock;
        }
    }

    /// A spread sample of `block`, taken now, from its phase's start: a
    /// phase that completed with every source it waited for (not aged), or
    /// a contribution arriving after its block aged without it.
    pub(super) fn sample_spread(&mut self, block: &Block) {
        if let Some(aging) = self.aging.as_mut() {
            aging.sample_spread(aging.clock.as_nanos().saturating_sub(block.phase_start.as_nanos()));
        }
    }

    /// Send the result to every member with a known address (members that
    /// never sent anything fetch it by retransmitting): once to the job's
    /// result group for the members listening there, if the runtime can
    /// reach groups, and to each other member's own address.
    ///
    /// A data result of a block some members said `no_data` to (a
    /// reduce-scatter block they do not own) goes whole to the others and
    /// as a header without the sum to them, each to its own address: a
    /// group would carry the sum to every listener.
    pub(super) fn send_to_all(&mut self, block: &Block, exp_only: bool) {
        if !exp_only && !block.no_data.is_empty() {
            self.send_by_ownership(block);
            return;
        }
        build_result(block, self.job_id, exp_only, false, self.lacks_a_member(block), self.tag, self.scratch);
        if let Some((group, listeners)) = self.group {
            let any = self.members.iter().any(|id| listeners.contains(id));
            if any && self.push_to_group(group, listeners) {
                self.counters.results_to_group += 1;
                let rest = self.members.iter().filter(|&id| !listeners.contains(id));
                let sent = &mut self.counters.results_sent;
                send_to_members(rest, self.addrs, self.auth.as_deref_mut(), self.out, self.scratch, sent);
                return;
            }
        }
        broadcast(self.members, self.addrs, self.auth.as_deref_mut(), self.out, self.scratch, &mut self.counters.results_sent);
    }

    /// Queue the result in `scratch` once to the job's result group: as it
    /// is for an unkeyed job, sealed once under the job's result key for a
    /// keyed one (every listener checks the same tag; docs/security.md).
    /// False if the runtime cannot reach groups.
    fn push_to_group(&mut self, group: std::net::SocketAddrV4, listeners: &SourceMask) -> bool {
        let (members, addrs) = (self.members, self.addrs);
        let listening = || members.iter().filter(|&id| listeners.contains(id)).map(|id| addrs.get(id).copied().flatten());
        let Some(auth) = self.auth.as_deref_mut() else {
            return self.out.push_group(group, listening(), self.scratch);
        };
        let Some((key, seq)) = auth.group_seal() else { return false };
        // Seal in place behind the result, send, and cut the trailer off
        // again: the members not on the group get their own seals of the
        // unsealed bytes.
        let len = self.scratch.len();
        self.scratch.resize(len + fanin_wire::auth::TRAILER_LEN, 0);
        fanin_wire::auth::seal(&key, seq, self.scratch).expect("sized for the trailer");
        let sent = self.out.push_group(group, listening(), self.scratch);
        self.scratch.truncate(len);
        fanin_wire::auth::clear_sealed_bit(self.scratch);
        sent
    }

    fn send_by_ownership(&mut self, block: &Block) {
        let lacking = self.lacks_a_member(block);
        let sent = &mut self.counters.results_sent;
        build_result(block, self.job_id, false, false, lacking, self.tag, self.scratch);
        let owners = self.members.iter().filter(|&id| !block.no_data.contains(id));
        send_to_members(owners, self.addrs, self.auth.as_deref_mut(), self.out, self.scratch, sent);
        build_result(block, self.job_id, false, true, lacking, self.tag, self.scratch);
        let before = *sent;
        let others = self.members.iter().filter(|&id| block.no_data.contains(id));
        send_to_members(others, self.addrs, self.auth.as_deref_mut(), self.out, self.scratch, sent);
        self.counters.results_without_data += *sent - before;
    }

    /// Send the result again to the sender only (`no_data`: the header
    /// without the sum, for a sender that owns no part of the block).
    pub(super) fn send_to_sender(&mut self, block: &Block, exp_only: bool, no_data: bool) {
        let Some(from) = self.from else { return };
        build_result(block, self.job_id, exp_only, no_data, self.lacks_a_member(block), self.tag, self.scratch);
        send_copy(self.out, from, self.scratch, envelope(self.auth.as_deref_mut(), Peer::Member(self.from_src)));
        self.counters.results_resent += 1;
        if no_data && !exp_only {
            self.counters.results_without_data += 1;
        }
    }

    /// Send this switch's partial (exponent or data) to the parent, as one
    /// source summing `block.workers` workers. `again` marks a resend from
    /// the cached partial, answering a child's retransmission.
    pub(super) fn send_up(&mut self, block: &Block, exp_only: bool, again: bool) {
        let Some(up) = self.uplink else { return };
        let repr = Repr {
            msg_type: if again { MessageType::Retransmission } else { MessageType::Contribution },
            src_id: up.rank,
            // a partial says only whether its subtree saw congestion
            // (protocol.md §1), aged here or not: an aged partial that
            // said "aged" lost the subtree's mark on its way to the root
            age_op: if block.congested { AGE_OP_CONGESTED } else { 0 },
            ..block.result_repr(self.job_id, exp_only, self.lacks_a_member(block))
        };
        let shard = shard_of(self.job_id, block.block_id, self.block_cnt_max, up.parent.len() as u16);
        let env = envelope(self.auth.as_deref_mut(), Peer::Parent);
        send(self.out, up.parent[shard as usize], repr.buffer_len(), env, |buf| {
            let mut packet = Packet::new_unchecked(buf);
            repr.emit(&mut packet);
            if !exp_only {
                fanin_wire::value::write_lanes(block.dtype, &block.sum[..block.grad_cnt as usize], packet.payload_mut());
            }
        });
        if again {
            self.counters.resent_up += 1;
        } else {
            self.counters.sent_up += 1;
        }
    }

    /// The parent refused this block as expired: pass that on to the sender.
    pub(super) fn nack_expired(&mut self, block: &Block) {
        let Some(from) = self.from else { return };
        let block_id = block.block_id;
        // src_id names the source refused, as every nack's does: a relay
        // on the way (docs/goat.md) routes it by that. The header copies the
        // refused request's gen_id and dtype (protocol.md §2.3), which are
        // the block's (checked on arrival): a worker takes a BlockExpired
        // only for a block of its current allreduce, so one with gen_id 0
        // was ignored, and a worker whose copy of the relayed nack was lost
        // asked again for ever (a tree with stragglers and loss livelocked).
        let repr = Repr {
            block_id,
            gen_id: block.gen_id,
            dtype: block.dtype,
            ..Repr::new(MessageType::Nack, self.job_id, self.from_src as u16)
        };
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

    pub(super) fn nack(&mut self, request: &Packet<&[u8]>, reason: NackReason, detail: u32) {
        let Some(from) = self.from else { return };
        let env = envelope(self.auth.as_deref_mut(), Peer::Member(self.from_src));
        send_nack(self.counters, self.out, from, env, request, reason, detail);
    }
}

/// Whether member `m` was in the job at `block`: not still awaiting its
/// sync join, and not joined with a start after the block.
pub(super) fn in_block(awaiting: &SourceMask, start_of: &HashMap<u16, u32>, space: BlockSpace, block: &Block, m: usize) -> bool {
    !awaiting.contains(m) && !start_of.get(&(m as u16)).is_some_and(|&start| space.before(block.block_id, start))
}

/// Whether `block` lacks a member it should have summed: a current member
/// that was in the job at that block ([`in_block`]) and whose contribution
/// is not in it (declared slow, left out by a quorum): its result is
/// `degraded`. Members are compared, not counted: a member that left after
/// contributing stays in `rcvd` (its contribution is in the sum), and a
/// count took it for a current member that never contributed, so a result
/// without that member was sent as complete. Blocks completed before a sync
/// joiner's start are complete without it (counting it made them degraded,
/// and workers that accept only complete results failed on exact sums).
pub(super) fn lacks_a_member(
    members: &SourceMask,
    awaiting: &SourceMask,
    start_of: &HashMap<u16, u32>,
    space: BlockSpace,
    block: &Block,
) -> bool {
    members.iter().any(|m| !block.rcvd.contains(m) && in_block(awaiting, start_of, space, block, m))
}
