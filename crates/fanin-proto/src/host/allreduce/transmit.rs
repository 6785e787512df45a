//! Sending the running allreduce's blocks: the window, the retransmission
//! queue and the recovery gate decide which block goes next
//! (`transmit_blocks`); `emit_block` writes one contribution.

use fanin_wire::value::{incarnation_tag, JoinParams, Packet, Repr, AGE_OP_CONGESTED, EXP_NONE};
use fanin_wire::MessageType;

use super::op::{BlockPhase, Op};
use super::{recovery, AllreduceSession, SessionConfig, TensorRef};
use crate::auth::{push_sealed, Sealer};
use crate::bfp;
use crate::job::shard_of;
use crate::time::Time;
use crate::transmit::Transmit;

impl AllreduceSession {
    pub(super) fn transmit_blocks(&mut self, now: Time, out: &mut impl Transmit<u16>) -> usize {
        let Some(params) = self.params else { return 0 };
        let Some(op) = self.op.as_mut() else { return 0 };
        let mut sent = 0;
        let budget = self.config.max_burst;
        // Two limits on a new block: the job's slots (a block may open a
        // slot only once the block `span` before it has its result: the
        // span from the oldest unfinished block) and congestion control's
        // window, which counts blocks in flight, as TCP's counts bytes. A
        // lost block that holds the span's start back does not hold the
        // window: blocks after it keep going out, and their results find a
        // lost retransmission of it within a round trip instead of the
        // stall timer (the window counted as a span did that: at 5 %
        // loss, 9-16 stall timeouts per allreduce instead of 1-6).
        let span = self.cc.max();
        let window = self.cc.window();
        // After a switch restart: no block opens a slot before the block one
        // slot-cycle earlier has its new result (docs/restart.md).
        let recovery = self.recovery.as_ref();
        let gate = recovery.and_then(|r| Some((r, r.gate(Some(&*op), params.block_cnt_max)?)));
        while sent < budget {
            if let Some((rec, gate)) = gate {
                let front = op.retransmit.front().or(op.ready.front()).copied().unwrap_or(op.next_new);
                if rec.holds(gate, op.block_id(front)) {
                    break;
                }
            }
            let (idx, retransmission) = if let Some(i) = op.retransmit.pop_front() {
                (i, true)
            } else if let Some(i) = op.ready.pop_front() {
                (i, false)
            } else if op.next_new < op.blocks.len() as u32
                && op.next_new < op.low + span
                && op.outstanding() < window
            {
                op.next_new += 1;
                if op.blocks[op.next_new as usize - 1].phase == BlockPhase::Done {
                    op.done_ahead -= 1; // its result came before we sent it
                    continue;
                }
                (op.next_new - 1, false)
            } else {
                break;
            };
            let state = op.blocks[idx as usize];
            let exp_only = match state.phase {
                BlockPhase::Unsent => {
                    op.input.view().dtype().is_block_floating_point() && state.exp == EXP_NONE
                }
                BlockPhase::ExpSent => true,
                // queued for its first data transmission already
                BlockPhase::DataQueued if retransmission => continue,
                BlockPhase::DataQueued | BlockPhase::DataSent => false,
                BlockPhase::Done => continue,
            };
            if retransmission {
                op.retransmissions += 1;
            }
            let seal = self.sealer.as_mut();
            let block_id = op.block_id(idx);
            // The first data transmission is emitted once, unsealed, into
            // the capture (to be retained when its result comes) and sent as
            // a copy, sealed if the job is keyed.
            let (config, n_sources, gen_id) = (&self.config, self.n_sources, self.gen_id);
            // A CE mark seen on a result rides up on this one datagram
            // (not on the capture: a contribution resent after a switch
            // restart says nothing about the path now).
            let age_op = if std::mem::take(&mut self.ce_echo) { AGE_OP_CONGESTED } else { 0 };
            // (With a lent output the input stays intact: a retained
            // contribution is emitted again from it, nothing is captured.)
            let captured = if exp_only || retransmission || op.lent.is_some() {
                None
            } else {
                let op = &*op;
                self.captured.record(block_id, params.block_cnt_max, &mut self.spare, |buf| {
                    recovery::emit_contribution(config, &params, n_sources, gen_id, op, idx, buf)
                })
            };
            match captured {
                Some(bytes) => {
                    let shard = shard_of(config.job_id, block_id, params.block_cnt_max, params.shard_count);
                    let seal = seal.map(|s| (s.key, s.take_seq()));
                    push_sealed(out, shard, bytes.len(), seal.as_ref().map(|(k, q)| (k, *q)), |b| {
                        b.copy_from_slice(bytes);
                        if age_op != 0 {
                            Packet::new_unchecked(b).set_age_op(age_op);
                        }
                    });
                }
                None => emit_block(config, &params, n_sources, gen_id, op, idx, exp_only, retransmission, age_op, seal, out),
            }
            let b = &mut op.blocks[idx as usize];
            b.phase = if exp_only { BlockPhase::ExpSent } else { BlockPhase::DataSent };
            if retransmission {
                b.attempt += 1;
            } else {
                b.attempt = 0;
            }
            b.later_results = 0;
            b.queued = false;
            b.sent_at = now;
            b.first_sent.get_or_insert(now);
            op.send_seq += 1;
            b.send_seq = op.send_seq;
            sent += 1;
        }
        sent
    }
}

/// Write one contribution (data or exponent-only) for block `idx`.
#[allow(clippy::too_many_arguments)]
pub(super) fn emit_block(
    config: &SessionConfig,
    params: &JoinParams,
    n_sources: u16,
    gen_id: u16,
    op: &Op,
    idx: u32,
    exp_only: bool,
    retransmission: bool,
    // 0, or `AGE_OP_CONGESTED`: the echo of a CE mark this worker saw
    age_op: u8,
    sealer: Option<&mut Sealer>,
    out: &mut impl Transmit<u16>,
) {
    let per = op.per;
    let start = idx as usize * per;
    let count = (op.input.view().len() - start).min(per);
    let block_id = op.block_id(idx);
    let state = &op.blocks[idx as usize];
    let ahead = idx as usize + params.block_cnt_max as usize;
    let input = op.input.view();
    let (exp, next_exp) = match input {
        TensorRef::I32(_) => (EXP_NONE, EXP_NONE),
        TensorRef::F32(_) | TensorRef::Half(..) if exp_only => (op.local_exp[idx as usize], EXP_NONE),
        TensorRef::F32(_) | TensorRef::Half(..) => (state.exp, op.local_exp.get(ahead).copied().unwrap_or(EXP_NONE)),
    };
    // The block's exponent was fixed without this worker's (it straggled
    // past the exponent round, or the lookahead was announced without it:
    // aging, a quorum) and is smaller than its own: its values would
    // saturate, and the sum would count them as if they were whole. It
    // abstains instead (`degraded` on a worker's contribution, protocol.md
    // §5.5): the switch adds nothing of it, stops waiting for it in this
    // block and answers with the result, which then lacks it.
    let abstain = !exp_only && input.dtype().is_block_floating_point() && op.local_exp[idx as usize] > exp;
    let repr = Repr {
        msg_type: if retransmission { MessageType::Retransmission } else { MessageType::Contribution },
        age_op,
        final_block: idx as usize + 1 == op.blocks.len(),
        degraded: abstain,
        exp_only,
        no_data: !exp_only && !op.wants(idx),
        dtype: input.dtype(),
        src_id: config.src_id,
        // the switch incarnation this contribution is meant for
        src_cnt: incarnation_tag(params.incarnation),
        gen_id,
        job_id: config.job_id,
        block_id,
        grad_cnt: if exp_only { 0 } else { count as u16 },
        exp,
        next_exp,
    };
    let shard = shard_of(config.job_id, block_id, params.block_cnt_max, params.shard_count);
    // Every transmission, retransmissions included, gets a fresh number.
    let seal = sealer.map(|s| (s.key, s.take_seq()));
    push_sealed(out, shard, repr.buffer_len(), seal.as_ref().map(|(k, q)| (k, *q)), |buf| {
        let mut packet = Packet::new_unchecked(buf);
        repr.emit(&mut packet);
        if exp_only {
            return;
        }
        if abstain {
            packet.payload_mut().fill(0);
            return;
        }
        match input {
            TensorRef::I32(v) => fanin_wire::value::write_elements(&v[start..start + count], packet.payload_mut()),
            TensorRef::F32(v) => {
                bfp::quantize_into_payload(&v[start..start + count], exp, n_sources as usize, packet.payload_mut())
            }
            TensorRef::Half(kind, v) => bfp::half::quantize_into_payload(
                kind,
                &v[start..start + count],
                exp,
                n_sources as usize,
                packet.payload_mut(),
            ),
        }
    });
}
