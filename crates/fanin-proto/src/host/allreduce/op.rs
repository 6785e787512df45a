//! One running allreduce ([`Op`]): the state of each of its blocks, its
//! queues and statistics, and the fast-retransmit bookkeeping of results
//! that overtake a block.

use std::collections::VecDeque;
use std::time::Duration;

use fanin_wire::value::JoinParams;

use super::lending::{self, Input, Lent, TensorMut};
use super::DUP_THRESH;
use crate::job::shard_of;
use crate::serial::BlockSpace;
use crate::time::Time;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BlockPhase {
    Unsent,
    /// Exponent-only contribution sent, waiting for the negotiated exponent.
    ExpSent,
    /// Exponent known; the data contribution is queued.
    DataQueued,
    DataSent,
    Done,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct BlockState {
    pub(super) phase: BlockPhase,
    /// Negotiated (or announced-ahead) shared exponent; EXP_NONE = unknown.
    pub(super) exp: i8,
    /// Transmissions of the current phase beyond the first.
    pub(super) attempt: u32,
    /// Last transmission.
    pub(super) sent_at: Time,
    /// Results seen for later blocks of the same shard while this one waits.
    pub(super) later_results: u8,
    /// Queued for retransmission and not yet sent again.
    pub(super) queued: bool,
    /// The stall timer queued this transmission (nothing had been answered
    /// for an RTO): see [`note_later_result`].
    pub(super) timer_resend: bool,
    /// Order of the last transmission among all of this session's sends.
    pub(super) send_seq: u64,
    /// First transmission (for the latency statistics).
    pub(super) first_sent: Option<Time>,
}

pub(super) struct Op {
    /// The input; the results overwrite it unless an output was lent (a
    /// lent input always comes with a lent output).
    pub(super) input: Input,
    /// The caller's output buffer (`begin_into`): results go there and the
    /// input stays intact.
    pub(super) lent: Option<Lent>,
    /// Block id of the tensor's first block.
    pub(super) base_block: u32,
    /// The job's block ids (they wrap at a multiple of `block_cnt_max`).
    pub(super) space: BlockSpace,
    pub(super) blocks: Vec<BlockState>,
    /// This worker's own exponent per block (float tensors).
    pub(super) local_exp: Vec<i8>,
    /// Elements per block of this allreduce (16-bit tensors may use more
    /// than the session's `elems_per_packet`: the same bytes per datagram).
    pub(super) per: usize,
    /// Results are decoded as means ([`Prepared::averaged`](super::Prepared::averaged)).
    pub(super) average: bool,
    /// Lowest block index without a result.
    pub(super) low: u32,
    /// Next block index never sent.
    pub(super) next_new: u32,
    pub(super) done: u32,
    /// Blocks at or beyond `next_new` that are done already (a straggler
    /// finds results the switch pushed to it before it sent anything).
    pub(super) done_ahead: u32,
    pub(super) missed: u32,
    pub(super) latency_sum: Duration,
    pub(super) latency_max: Duration,
    pub(super) latency_samples: u32,
    pub(super) ready: VecDeque<u32>,
    pub(super) retransmit: VecDeque<u32>,
    /// Last time a result (data or exponent) arrived for this allreduce.
    pub(super) last_progress: Time,
    /// Consecutive stall timeouts without progress.
    pub(super) backoff: u32,
    /// Transmissions so far (orders blocks for fast retransmit).
    pub(super) send_seq: u64,
    pub(super) retransmissions: u64,
    pub(super) trimmed: u64,
    /// Blocks fast retransmit found lost.
    pub(super) fast_retransmits: u64,
    /// Stall timeouts that fired.
    pub(super) timeouts: u64,
    /// Results marked congested, and results that arrived with CE.
    pub(super) marked_results: u64,
    pub(super) ecn_ce: u64,
    pub(super) degraded: Vec<(u32, u16)>,
    pub(super) min_src_cnt: u16,
    pub(super) recoveries: u32,
    /// Next probe join while the switch is silent (see `PROBE_INTERVAL`).
    pub(super) next_probe: Time,
    /// Reduce-scatter: the elements whose sum this worker needs (the rest
    /// of the output is left as it was); `None`: all of them.
    pub(super) keep: Option<std::ops::Range<usize>>,
}

impl Op {
    /// This worker needs block `idx`'s sum: some element of the block lies
    /// in `keep`. Its contributions to other blocks say `no_data`, and the
    /// switch answers them with a result header without the sum.
    pub(super) fn wants(&self, idx: u32) -> bool {
        let Some(keep) = &self.keep else { return true };
        let start = idx as usize * self.per;
        let end = (start + self.per).min(self.input.view().len());
        start < keep.end && keep.start < end
    }

    /// The stream id of tensor block `idx`.
    pub(super) fn block_id(&self, idx: u32) -> u32 {
        self.space.add(self.base_block, idx)
    }
    /// Block `idx` has its result (summing `src_cnt` sources; `degraded`
    /// when fewer than the job has). Returns true when every block has one.
    pub(super) fn record_done(&mut self, idx: u32, src_cnt: u16, degraded: bool) -> bool {
        self.blocks[idx as usize].phase = BlockPhase::Done;
        self.done += 1;
        if idx >= self.next_new {
            self.done_ahead += 1;
        }
        if degraded {
            self.degraded.push((idx, src_cnt));
        }
        self.min_src_cnt = self.min_src_cnt.min(src_cnt);
        while self.low < self.blocks.len() as u32 && self.blocks[self.low as usize].phase == BlockPhase::Done {
            self.low += 1;
        }
        self.done == self.blocks.len() as u32
    }

    /// Where block `start..start + count`'s result goes: the lent output,
    /// or over the input.
    pub(super) fn output_block(&mut self, start: usize, count: usize) -> TensorMut<'_> {
        match &mut self.lent {
            Some(lent) => lent.block(start, count),
            None => match &mut self.input {
                Input::Owned(tensor) => lending::tensor_block(tensor, start, count),
                Input::Lent(_) => unreachable!("a lent input always comes with a lent output"),
            },
        }
    }

    /// Blocks sent (at least once) whose result has not arrived.
    pub(super) fn outstanding(&self) -> u32 {
        self.next_new - (self.done - self.done_ahead)
    }
}

/// A result for block `idx` arrived: earlier blocks of the same shard still
/// waiting have now been overtaken once more; at [`DUP_THRESH`] they are
/// presumed lost and queued for a fast retransmission. Only earlier blocks:
/// a later block still waiting is usually waiting for a slower member, not
/// lost (counting those too, RACK-style, made a 1.9 MB allreduce of 4
/// workers at 100 Mbit/s resend 27 000 blocks).
///
/// When the answered transmission is one the stall timer sent, every block
/// of the shard sent before it is presumed lost at once, later ones too: it
/// went out at least an RTO after them and came back first. Without this a
/// burst lost at the tail of a window (no later block left to overtake it)
/// was repaired one block per stall timeout, each timeout longer than the
/// last: 200 lost blocks took 39 s on a 100 Mbit/s testbed link (NewReno's
/// partial-ACK rule, for blocks). A stall that was a slow member, not loss,
/// then costs one spurious resend of the window, once.
pub(super) fn note_later_result(op: &mut Op, idx: u32, params: &JoinParams, job_id: u32) {
    let answered = op.blocks[idx as usize];
    // Results come back in order within a class of blocks: the switch's
    // shard, or, below a root spread over several switches, the class the
    // JoinAck names (`order_shards`); a result overtakes only its class.
    // With no order to rely on, only a timer resend's answer says anything
    // (about every block sent before it); the stall timer finds the rest.
    let classes = match params.order_classes() {
        Some(classes) => classes,
        None if answered.timer_resend => 1,
        None => return,
    };
    let class = |op: &Op, j: u32| shard_of(job_id, op.block_id(j), params.block_cnt_max, classes);
    let own = (classes > 1).then(|| class(op, idx));
    let (end, thresh) = if answered.timer_resend { (op.next_new, 1) } else { (idx, DUP_THRESH) };
    for j in op.low..end {
        if j == idx || own.is_some_and(|s| class(op, j) != s) {
            continue;
        }
        overtaken(op, j, answered.send_seq, thresh);
    }
}

/// Block `j` was overtaken if the answered transmission left after `j`'s.
fn overtaken(op: &mut Op, j: u32, answered_seq: u64, thresh: u8) {
    let b = &mut op.blocks[j as usize];
    if b.send_seq >= answered_seq {
        return;
    }
    let waiting = matches!(b.phase, BlockPhase::ExpSent | BlockPhase::DataSent);
    if !waiting || b.queued {
        return;
    }
    b.later_results = b.later_results.saturating_add(1);
    if b.later_results >= thresh {
        // Also after a retransmission: a lost retransmission is found the
        // same way, one round trip later, instead of by the stall timer.
        b.queued = true;
        b.timer_resend = false;
        op.retransmit.push_back(j);
        op.fast_retransmits += 1;
    }
}
