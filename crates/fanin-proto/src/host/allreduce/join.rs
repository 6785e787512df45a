//! Joining the job: the Join a worker sends (plain, sync, probe), how long
//! it waits for an answer, and what the JoinAck tells it.

use std::time::Duration;

use fanin_wire::value::{JoinParams, Repr, JOIN_ALL_DONE, JOIN_KEY_UPDATE, JOIN_ROUND_START, JOIN_SYNC, JOIN_WAIT, MAX_GRAD_CNT};
use fanin_wire::MessageType;

use super::{AllreduceSession, Event, SessionError, State};
use crate::serial::BlockSpace;
use crate::time::Time;

impl AllreduceSession {
    /// How long joining may take: `join_timeout` until the switch answers
    /// at all, `barrier_timeout` once it said the job's barrier holds us.
    pub(super) fn join_deadline(&self, barrier: Option<u32>) -> Duration {
        match barrier {
            None => self.config.join_timeout,
            Some(_) => self.config.barrier_timeout.max(self.config.join_timeout),
        }
    }

    pub(super) fn on_join_ack(&mut self, now: Time, repr: &Repr, body: &[u8]) {
        let Ok(params) = JoinParams::parse(body) else { return };
        if repr.age_op == JOIN_KEY_UPDATE {
            // sent unasked when the result key moved on: the key, nothing else
            if params.result_key.is_some() {
                self.learn_result_key(&params);
            }
            return;
        }
        self.learn_result_key(&params);
        let expected = self.config.expected_members;
        if expected != 0 && repr.src_cnt != expected && matches!(self.state, State::Joining { .. }) {
            self.fail(SessionError::MemberCount { job_id: self.config.job_id, members: repr.src_cnt, expected });
            return;
        }
        if repr.age_op == JOIN_WAIT {
            // Held at the job's barrier: the switch is there; keep asking
            // (a lost answer to the round's start is asked for again).
            if let State::Joining { barrier, .. } = &mut self.state {
                *barrier = Some(params.next_block);
                self.n_sources = repr.src_cnt.max(1);
                if self.config.elems_per_packet as u32 > params.block_grad_max {
                    // no use waiting for the others to be refused then
                    let (requested, cap) = (self.config.elems_per_packet, params.block_grad_max);
                    self.fail(SessionError::PacketTooLarge { requested, cap });
                }
                return;
            }
            // A probe answered by a switch whose job waits at its barrier:
            // it restarted (another incarnation), which the probe is for.
        }
        if repr.age_op == JOIN_ALL_DONE {
            // every member is done (an answer to our JOIN_DONE: linger.rs)
            if matches!(self.state, State::Ready) {
                self.on_all_done(params.next_block);
            }
            return;
        }
        if matches!(self.state, State::Ready) {
            self.on_rejoin_ack(now, repr, params);
            return;
        }
        if !matches!(self.state, State::Joining { .. }) {
            return;
        }
        if self.config.elems_per_packet as u32 > params.block_grad_max {
            self.fail(SessionError::PacketTooLarge { requested: self.config.elems_per_packet, cap: params.block_grad_max });
            return;
        }
        if self.config.elems_per_packet == 0 {
            // the job's packet size, within what a block and a datagram hold;
            // never 0 (min before max: a malformed JoinAck with
            // block_grad_max 0 must not panic a clamp)
            let per = params.packet_elems.min(params.block_grad_max).min(MAX_GRAD_CNT as u32).max(1);
            self.config.elems_per_packet = per as u16;
            // int16 lanes: twice the elements in the same datagram
            self.half_elems_per_packet = (2 * per).min(params.block_grad_max).min(MAX_GRAD_CNT as u32).max(1) as u16;
        } else if self.half_elems_per_packet == 0 {
            self.half_elems_per_packet = self.config.elems_per_packet;
        }
        self.params = Some(params);
        self.space = BlockSpace::new(params.block_cnt_max);
        self.n_sources = repr.src_cnt.max(1);
        self.next_block = params.next_block;
        if self.config.sync_join && repr.age_op != JOIN_ROUND_START {
            // The switch answered an allreduce boundary of the running round
            // (counted from the round's first block, which this worker cannot
            // know) and the generation of the allreduce before it; begin()
            // moves to the next, the one the others use at that block.
            self.gen_id = repr.gen_id;
        }
        self.cc.set_limits(self.config.window.min(params.block_cnt_max).max(1), params.shard_count);
        self.last_heard = now;
        self.state = State::Ready;
        self.events.push_back(Event::Joined(params));
    }

    /// A join while bound to the switch: a probe for its incarnation
    /// (docs/restart.md). Always a plain join, even for a worker that
    /// joined with sync: a restarted switch defers sync joins on its fresh
    /// job until an active member opens the stream, so a sync probe from
    /// every member would never be answered and nobody would learn of the
    /// restart (the 10-minute chaos soak hit exactly that).
    pub(super) fn probe_request(&self) -> Repr {
        self.join_repr()
    }

    pub(super) fn join_request(&self) -> Repr {
        if !self.config.sync_join {
            return self.join_repr();
        }
        Repr {
            age_op: JOIN_SYNC,
            // the root answers an allreduce boundary of this many blocks
            block_id: self.config.align_blocks,
            ..self.join_repr()
        }
    }

    /// What every Join of this worker carries: each one tells the switch
    /// afresh whether it listens on the result group (the `final` bit,
    /// which a Join has no other use for), and its member incarnation —
    /// whole in a plain Join (a first join, a probe), whose `block_id` is
    /// free for the high 32 bits; a sync or recovery Join puts a block
    /// there and says the low 16 alone.
    pub(super) fn join_repr(&self) -> Repr {
        Repr {
            gen_id: self.gen_id,
            src_cnt: self.config.incarnation as u16,
            block_id: (self.config.incarnation >> 16) as u32,
            final_block: self.config.listens_on_group,
            ..Repr::new(MessageType::Join, self.config.job_id, self.config.src_id)
        }
    }
}
