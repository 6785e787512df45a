//! What the switch answers a running allreduce: results (kept for a later
//! allreduce, or written to the output), expired blocks, and trims.

use fanin_wire::value::{read_elements, Repr, AGE_OP_AGED, AGE_OP_CONGESTED, EXP_NONE};

use super::op::{note_later_result, BlockPhase};
use crate::host::congestion::Signal;
use super::recovery::{self, Kept};
use super::{AllreduceSession, SessionError, TensorMut, STASH_GENERATIONS};
use crate::bfp;
use crate::time::Time;

impl AllreduceSession {
    /// Keep a result of a later allreduce (bounded by `stash_bytes`).
    pub(super) fn stash_result(&mut self, repr: &Repr, payload: &[u8]) {
        if self.stash_len + payload.len() > self.config.stash_bytes {
            return;
        }
        self.stash_len += payload.len();
        self.stash.push_back((*repr, payload.to_vec()));
    }

    pub(super) fn on_result(&mut self, now: Time, repr: &Repr, payload: &[u8]) {
        // A later generation: the job is ahead of this worker (it straggled).
        let ahead = repr.gen_id.wrapping_sub(self.gen_id);
        if (1..=STASH_GENERATIONS).contains(&ahead) {
            self.stash_result(repr, payload);
            return;
        }
        // (none: a result of an earlier allreduce, duplicated by the network)
        let Some(idx) = self.block_index(repr) else { return };
        let (Some(params), Some(op)) = (self.params, self.op.as_mut()) else { return };
        let per = op.per;
        let start = idx as usize * per;
        let count = (op.input.view().len() - start).min(per);
        let phase = op.blocks[idx as usize].phase;
        if repr.exp_only && phase == BlockPhase::Unsent {
            // Pushed to a straggler before it sent anything: use the
            // negotiated exponent when the block goes out.
            op.blocks[idx as usize].exp = repr.exp;
            return;
        }
        if !repr.exp_only && repr.src_cnt == 0 && phase != BlockPhase::Done {
            // A result summing no source carries nothing to use; the switch
            // never emits one, but a worker must not wait forever for a
            // block whose only answer it is: record the block as missed.
            self.on_expired(now, repr);
            return;
        }
        // A result without the sum completes a block this worker does not
        // own (reduce-scatter) and nothing else: for a block it owns, it
        // is ignored, and the retransmission (without `no_data`) gets the sum.
        let wanted = op.wants(idx);
        let useful = if repr.exp_only {
            phase == BlockPhase::ExpSent
        } else if repr.no_data {
            phase != BlockPhase::Done && !wanted
        } else {
            // Any phase but done: a straggler may find the result of a block
            // it has not sent (or finished negotiating) yet.
            phase != BlockPhase::Done && repr.grad_cnt as usize == count
        };
        if !useful {
            return; // duplicate, or an answer to an earlier phase
        }
        // `degraded` is the switch's word that the block lacks a member it
        // waited for (aged, declared slow or dead, or so below it in a tree).
        // A src_cnt below the job's worker count alone is not: an elastic job
        // (SwitchML++) sums over the members subscribed now, fewer than the
        // workers its block floating point is scaled for.
        if !repr.exp_only && repr.degraded && !params.partial_results {
            self.fail(SessionError::PartialResult {
                job_id: self.config.job_id,
                block_id: repr.block_id,
                src_cnt: repr.src_cnt,
                members: self.n_sources,
            });
            return;
        }
        op.last_progress = now;
        op.backoff = 0;
        // An aged result says nothing about loss: the scanners emit blocks
        // in slice order, not block order.
        let mut losses = 0;
        if repr.age_op != AGE_OP_AGED {
            let before = op.fast_retransmits;
            note_later_result(op, idx, &params, self.config.job_id);
            losses = op.fast_retransmits - before;
        }
        let round_trip = self.srtt.unwrap_or(self.config.rto_initial);
        for _ in 0..losses {
            self.cc.on_signal(now, round_trip, Signal::Loss); // counted, not acted on
        }
        if repr.age_op == AGE_OP_CONGESTED {
            self.cc.on_signal(now, round_trip, Signal::Marked);
            if let Some(op) = self.op.as_mut() {
                op.marked_results += 1;
            }
        }
        let Some(op) = self.op.as_mut() else { return };
        if repr.exp_only {
            let block = &mut op.blocks[idx as usize];
            block.exp = repr.exp;
            block.phase = BlockPhase::DataQueued;
            block.attempt = 0;
            op.ready.push_back(idx);
            return;
        }
        // Keep this worker's contribution (scaled with the block's exponent)
        // before the result overwrites the tensor: a peer may still lack the
        // result if the switch restarts. With a lent output nothing is
        // overwritten: it can be emitted again from the input if needed.
        op.blocks[idx as usize].exp = repr.exp;
        let kept = if op.lent.is_some() {
            Kept::FromInput
        } else {
            Kept::Bytes(match self.captured.take(repr.block_id, repr.exp) {
                Some(sent) => sent,
                None => {
                    let buf = self.spare.pop().unwrap_or_default();
                    recovery::emit_contribution(&self.config, &params, self.n_sources, self.gen_id, op, idx, buf)
                }
            })
        };
        self.retained.insert(op.space, params.block_cnt_max, repr.block_id, kept);
        let Some(op) = self.op.as_mut() else { return };
        // (outside `keep` the output is left as it was, whatever came)
        // a block that lacks sources (recorded so by `record_done` below)
        let partial = repr.degraded || repr.src_cnt < self.n_sources;
        if wanted && !repr.no_data {
            // A mean divides by the sources this block summed, while
            // decoding: one rounding, and no overflow of a sum whose mean fits.
            let divisor = match (op.average, partial) {
                (false, _) => 1,
                (true, true) => repr.src_cnt,
                (true, false) => self.n_sources,
            };
            let n = self.n_sources as usize;
            match op.output_block(start, count) {
                TensorMut::I32(v) => read_elements(payload, v),
                TensorMut::F32(v) => bfp::dequantize_from_payload(payload, repr.exp, n, divisor, v),
                TensorMut::Half(kind, v) => bfp::half::dequantize_from_payload(kind, payload, repr.exp, n, divisor, v),
            }
        }
        let block = &mut op.blocks[idx as usize];
        if let Some(first) = block.first_sent {
            let latency = now.saturating_since(first);
            op.latency_sum += latency;
            op.latency_max = op.latency_max.max(latency);
            op.latency_samples += 1;
        }
        if block.attempt == 0 && phase == BlockPhase::DataSent {
            let sample = now.saturating_since(block.sent_at);
            self.srtt = Some(match self.srtt {
                None => {
                    self.rttvar = sample / 2;
                    sample
                }
                Some(srtt) => {
                    let diff = srtt.abs_diff(sample);
                    self.rttvar = (self.rttvar * 3 + diff) / 4;
                    (srtt * 7 + sample) / 8
                }
            });
        }
        self.cc.on_answer();
        let all_done = op.record_done(idx, repr.src_cnt, partial);
        let low_stream = op.block_id(op.low);
        self.prune_retained(low_stream, params.block_cnt_max);
        let Some(op) = self.op.as_mut() else { return };
        // The exponent announced for the block one slot-cycle ahead.
        let ahead = idx as usize + params.block_cnt_max as usize;
        if repr.next_exp != EXP_NONE {
            if let Some(b) = op.blocks.get_mut(ahead) {
                if b.phase == BlockPhase::Unsent {
                    b.exp = repr.next_exp;
                }
            }
        }
        if all_done {
            self.finish_op();
        }
    }

    /// Index of `repr`'s block in the running allreduce, if it is one of its
    /// blocks (same generation, inside the tensor).
    fn block_index(&self, repr: &Repr) -> Option<u32> {
        let op = self.op.as_ref()?;
        let idx = op.space.distance(repr.block_id, op.base_block);
        (idx < op.blocks.len() as u32 && repr.gen_id == self.gen_id).then_some(idx)
    }

    /// The switch no longer holds the result of a block this worker asked
    /// for: the job moved on without it. Record the block as missed (zero,
    /// `src_cnt` 0) and move on, so a straggler catches up with the job.
    pub(super) fn on_expired(&mut self, now: Time, repr: &Repr) {
        let Some(idx) = self.block_index(repr) else { return };
        let Some(op) = self.op.as_mut() else { return };
        if op.blocks[idx as usize].phase == BlockPhase::Done {
            return;
        }
        if !self.params.is_some_and(|p| p.partial_results) {
            // Zeros are no answer for a job that wants complete results.
            self.fail(SessionError::MissedBlocks { job_id: self.config.job_id, block_id: repr.block_id });
            return;
        }
        if let Some(params) = self.params {
            // Its contribution, for a recovery (int32, or float with a known
            // exponent; otherwise the block cannot be sent again exactly).
            let known = !op.input.view().dtype().is_block_floating_point() || op.blocks[idx as usize].exp != EXP_NONE;
            if known {
                let buf = self.spare.pop().unwrap_or_default();
                let buf = recovery::emit_contribution(&self.config, &params, self.n_sources, self.gen_id, op, idx, buf);
                self.retained.insert(op.space, params.block_cnt_max, repr.block_id, Kept::Bytes(buf));
            }
        }
        let Some(op) = self.op.as_mut() else { return };
        let per = op.per;
        let start = idx as usize * per;
        let count = (op.input.view().len() - start).min(per);
        // (outside `keep` the output is left as it was, docs/protocol.md §4.13)
        if op.wants(idx) {
            match op.output_block(start, count) {
                TensorMut::I32(v) => v.fill(0),
                TensorMut::F32(v) => v.fill(0.0),
                TensorMut::Half(_, v) => v.fill(0), // +0.0 in both formats
            }
        }
        op.missed += 1;
        op.last_progress = now;
        op.backoff = 0;
        if op.record_done(idx, 0, true) {
            self.finish_op();
        }
    }

    /// The switch returned a contribution unprocessed (overload): resend it
    /// at once and halve the window, at most once per round trip. Ignored
    /// unless the block still waits for an answer to that very phase and is
    /// not queued already, so a trim is never acted on twice.
    pub(super) fn on_trimmed(&mut self, now: Time, repr: &Repr) {
        let Some(idx) = self.block_index(repr) else { return };
        let Some(op) = self.op.as_mut() else { return };
        let block = &mut op.blocks[idx as usize];
        let expected = if repr.exp_only { BlockPhase::ExpSent } else { BlockPhase::DataSent };
        if block.phase != expected {
            return; // answered already, or a trim of an earlier phase
        }
        // Before any RTT sample, the trim itself measures one: it answers
        // the block's last transmission.
        let round_trip = self.srtt.unwrap_or_else(|| now.saturating_since(block.sent_at));
        if !block.queued {
            // Fast retransmit may have queued it already: resend once.
            block.queued = true;
            op.retransmit.push_back(idx);
            op.trimmed += 1;
        }
        // The packet's fate is known: not a stall.
        op.last_progress = now;
        self.cc.on_signal(now, round_trip, Signal::Trim);
    }
}
