//! Recovery of a worker's session after its switch restarted
//! (docs/restart.md has the design and the argument).
//!
//! A restarted switch has a new incarnation and no memory of the job's
//! blocks. The worker notices (a `StaleIncarnation` nack for a contribution
//! tagged with the old incarnation, a JoinAck with a new incarnation after a
//! silence, or an `UnknownJob` nack while the job is re-admitted), then:
//!
//! 1. *waits for the floor*: it sends `JOIN_RECOVER` joins carrying the
//!    lowest block of the stream it has no result for, and sends nothing
//!    else. The switch answers once every member reported, with the floor:
//!    the lowest block any member still needs;
//! 2. *resends*: it binds to the new incarnation (results of any other are
//!    dropped from then on), and sends the new switch its retained
//!    contributions of the blocks from the floor on that it already has
//!    results for, then its blocks without results, in stream order: no
//!    block goes out before the block one slot-cycle (`block_cnt_max`)
//!    earlier has its result *from the new incarnation*, so the new switch
//!    sees each slot's blocks in order, exactly as in a fresh job;
//! 3. ends when every retained block it resent has its new result.
//!
//! Every block the new incarnation completes sums contributions that were
//! all sent to it (the switch refuses contributions tagged with another
//! incarnation), so no result mixes two incarnations.

use std::collections::BTreeMap;
use std::time::Duration;

use fanin_wire::value::{incarnation_tag, JoinParams, Packet, RecoverAnchor, Repr, HEADER_LEN, JOIN_RECOVER};
use fanin_wire::MessageType;

use super::op::{BlockPhase, Op};
use super::transmit::emit_block;
use super::{AllreduceSession, SessionConfig, SessionError};
use crate::auth::push_sealed;
use crate::job::shard_of;
use crate::serial::BlockSpace;
use crate::time::Time;
use crate::transmit::Transmit;

/// First interval between recovery joins; doubled up to [`JOIN_INTERVAL_MAX`].
const JOIN_INTERVAL: Duration = Duration::from_millis(20);
/// (Short: the floor waits for the last member's join, so this bounds the
/// barrier's share of recovery; a join is a 24-byte datagram.)
const JOIN_INTERVAL_MAX: Duration = Duration::from_millis(50);
/// Pruned contribution buffers kept for reuse: at least this many, and up to
/// one slot-cycle (`block_cnt_max`), since results and the sends they let
/// out come a window at a time; a smaller pool frees most of a burst's
/// buffers only to allocate (and zero) as many again for the next.
const SPARE_BUFFERS_MIN: usize = 64;

/// A contribution retained for a switch restart.
#[derive(Debug)]
pub(super) enum Kept {
    /// The datagram's bytes (unsealed).
    Bytes(Vec<u8>),
    /// A block of the running allreduce whose output was lent
    /// (`begin_into`): its input is intact, so the contribution is emitted
    /// from it again only if it is needed, and before the allreduce ends
    /// (`materialize_retained`).
    FromInput,
}

/// A transmit sink holding one datagram, to capture a contribution.
struct OneBuf(Vec<u8>);

impl Transmit<u16> for OneBuf {
    fn push(&mut self, _dest: u16, len: usize) -> &mut [u8] {
        // A recycled buffer usually has the length already; the emitter
        // writes every byte, so only a new length needs the fill.
        if self.0.len() != len {
            self.0.clear();
            self.0.resize(len, 0);
        }
        &mut self.0
    }
}

/// Block `idx`'s data contribution as it is retained: its first data
/// transmission, unsealed, written into `buf`'s memory (recycled when it has
/// the length already).
pub(super) fn emit_contribution(
    config: &SessionConfig,
    params: &JoinParams,
    n_sources: u16,
    gen_id: u16,
    op: &Op,
    idx: u32,
    buf: Vec<u8>,
) -> Vec<u8> {
    let mut one = OneBuf(buf);
    emit_block(config, params, n_sources, gen_id, op, idx, false, false, 0, None, &mut one);
    one.0
}

/// The first data transmission of each block in flight, unsealed, by block
/// id modulo `block_cnt_max` (no two blocks in flight share a slot: the
/// window is at most `block_cnt_max` wide). When the block's result comes,
/// its contribution is retained by moving this buffer instead of quantizing
/// the block a second time (and the bytes are exactly those sent).
#[derive(Debug, Default)]
pub(super) struct Captured {
    slots: Vec<CaptureSlot>,
}

#[derive(Debug)]
struct CaptureSlot {
    /// `u32::MAX`: empty (taken, or never used).
    block_id: u32,
    /// The exponent the block was scaled with, kept here so that taking the
    /// capture does not touch its (by then cold) bytes.
    exp: i8,
    buf: Vec<u8>,
}

impl Captured {
    /// Emit block `block_id` with `emit` into its slot, in a buffer recycled
    /// from `spare` or the slot's previous block, and return the bytes;
    /// `None` if there are no slots (`block_cnt_max` 0).
    pub(super) fn record(
        &mut self,
        block_id: u32,
        block_cnt_max: u32,
        spare: &mut Vec<Vec<u8>>,
        emit: impl FnOnce(Vec<u8>) -> Vec<u8>,
    ) -> Option<&[u8]> {
        if self.slots.len() != block_cnt_max as usize {
            self.slots =
                (0..block_cnt_max).map(|_| CaptureSlot { block_id: u32::MAX, exp: 0, buf: Vec::new() }).collect();
        }
        let n = self.slots.len();
        let slot = self.slots.get_mut(block_id as usize % n.max(1))?;
        let recycled = if slot.buf.capacity() == 0 { spare.pop().unwrap_or_default() } else { std::mem::take(&mut slot.buf) };
        slot.buf = emit(recycled);
        if slot.buf.len() < HEADER_LEN {
            slot.block_id = u32::MAX;
            return None;
        }
        slot.block_id = block_id;
        slot.exp = Packet::new_unchecked(&slot.buf[..]).exp();
        Some(&slot.buf)
    }

    /// Blocks captured and not yet taken by a result.
    #[cfg(test)]
    pub(super) fn pending(&self) -> usize {
        self.slots.iter().filter(|s| s.block_id != u32::MAX).count()
    }

    /// Take block `block_id`'s captured contribution if it was scaled with
    /// `exp` (a straggler's block may have been sent before its exponent
    /// changed; then the caller emits it afresh).
    pub(super) fn take(&mut self, block_id: u32, exp: i8) -> Option<Vec<u8>> {
        let n = self.slots.len();
        let slot = self.slots.get_mut(block_id as usize % n.max(1))?;
        if slot.block_id != block_id || slot.exp != exp {
            return None;
        }
        slot.block_id = u32::MAX;
        Some(std::mem::take(&mut slot.buf))
    }
}

#[derive(Debug)]
pub(super) struct Recovery {
    /// The incarnation the switch announced (0: unknown, the job was lost).
    target: u32,
    started: Time,
    /// Lowest block of the stream this worker has no result for.
    low: u32,
    next_join: Time,
    interval: Duration,
    /// The switch's answer: the lowest block any member still needs.
    floor: Option<u32>,
    /// Retained blocks resent to the new incarnation that have no new result
    /// yet, with their last transmission (None: due), by their distance
    /// from the floor: stream order, across the wrap of block ids too.
    pending: BTreeMap<u32, Option<Time>>,
    /// The job's block ids.
    space: BlockSpace,
}

impl Recovery {
    /// Still waiting for the floor (nothing but joins may be sent).
    pub(super) fn waiting(&self) -> bool {
        self.floor.is_none()
    }

    /// Blocks at or beyond this stream id may not be sent yet: the lowest
    /// block that needs a result from the new incarnation, plus one
    /// slot-cycle (`block_cnt_max`).
    pub(super) fn gate(&self, op: Option<&Op>, block_cnt_max: u32) -> Option<u32> {
        let floor = self.floor?;
        let space = self.space;
        let retained = self.pending.keys().next().map(|&off| space.add(floor, off));
        let op_low = op.filter(|op| op.low < op.blocks.len() as u32).map(|op| op.block_id(op.low));
        let lowest = match (retained, op_low) {
            (Some(a), Some(b)) => if space.before(b, a) { b } else { a },
            (a, b) => a.or(b)?,
        };
        Some(space.add(lowest, block_cnt_max))
    }

    /// Whether block `block_id` may not be sent yet (`gate` from [`gate`](Self::gate)).
    pub(super) fn holds(&self, gate: u32, block_id: u32) -> bool {
        self.space.at_or_after(block_id, gate)
    }
}

impl AllreduceSession {
    /// Tag of the incarnation this worker is bound to (after joining).
    pub(super) fn tag(&self) -> Option<u16> {
        self.params.map(|p| incarnation_tag(p.incarnation))
    }

    /// Whether the session is recovering from a switch restart.
    pub fn recovering(&self) -> bool {
        self.recovery.is_some()
    }

    /// The switch restarted (`incarnation` is its new one; 0 if it lost the
    /// job and its incarnation is not known yet): start over at step 1.
    pub(super) fn begin_recovery(&mut self, now: Time, incarnation: u32) {
        let Some(params) = self.params else { return };
        if incarnation != 0 && incarnation == params.incarnation {
            return; // a late answer to a packet sent before we rebound
        }
        if let Some(rec) = &self.recovery {
            if rec.waiting() && (incarnation == 0 || rec.target == incarnation || rec.target == 0) {
                return; // already waiting for that switch's floor
            }
        }
        let low = match &self.op {
            Some(op) => op.block_id(op.low),
            None => self.next_block,
        };
        self.recovery = Some(Recovery {
            target: incarnation,
            started: now,
            low,
            next_join: now + JOIN_INTERVAL,
            interval: JOIN_INTERVAL,
            floor: None,
            pending: BTreeMap::new(),
            space: self.space,
        });
        self.join_due = true;
    }

    /// The join to send while waiting for the floor, with its body: where
    /// this worker's running (or next) allreduce begins, so the restarted
    /// switch can answer later sync joins on the job's allreduce boundaries.
    pub(super) fn recovery_join(&self) -> Option<(Repr, RecoverAnchor)> {
        let rec = self.recovery.as_ref().filter(|r| r.waiting())?;
        let anchor = match &self.op {
            Some(op) => RecoverAnchor { block: op.block_id(0), gen_id: self.gen_id },
            None => RecoverAnchor { block: self.next_block, gen_id: self.gen_id.wrapping_add(1) },
        };
        Some((Repr { age_op: JOIN_RECOVER, block_id: rec.low, ..self.join_repr() }, anchor))
    }

    pub(super) fn recovery_deadline(&self) -> Option<Time> {
        let rec = self.recovery.as_ref()?;
        if rec.waiting() {
            return Some(rec.next_join.min(rec.started + self.config.dead_after));
        }
        let rto = self.rto();
        rec.pending.values().flatten().map(|&t| t + rto).min()
    }

    /// Timer work of a recovery. Returns true if the session failed.
    pub(super) fn recovery_timeout(&mut self, now: Time) -> bool {
        let rto = self.rto();
        let dead_after = self.config.dead_after;
        let Some(rec) = self.recovery.as_mut() else { return false };
        if rec.waiting() {
            if now >= rec.started + dead_after {
                let waited = now.saturating_since(rec.started);
                self.fail(SessionError::RecoveryStalled { job_id: self.config.job_id, waited });
                return true;
            }
            if now >= rec.next_join {
                self.join_due = true;
                rec.next_join = now + rec.interval;
                rec.interval = (rec.interval * 2).min(JOIN_INTERVAL_MAX);
            }
            return false;
        }
        // A resent contribution (or its result) was lost: send it again.
        for sent in rec.pending.values_mut() {
            if sent.is_some_and(|t| now >= t + rto) {
                *sent = None;
            }
        }
        false
    }

    /// A JoinAck while the session runs: the floor of a recovery, or the
    /// answer to a join sent after a silence (a probe).
    pub(super) fn on_rejoin_ack(&mut self, now: Time, repr: &Repr, params: JoinParams) {
        let Some(current) = self.params else { return };
        if repr.age_op != JOIN_RECOVER {
            // A probe's answer. It does not count as hearing from the switch:
            // a switch that answers joins but sends no results is still dead
            // for this allreduce.
            if params.incarnation != current.incarnation {
                self.begin_recovery(now, params.incarnation);
            }
            return;
        }
        if !self.recovery.as_ref().is_some_and(|r| r.waiting()) {
            return; // a repeated answer; the floor is known
        }
        if params.block_cnt_max != current.block_cnt_max
            || params.block_grad_max != current.block_grad_max
            || repr.src_cnt.max(1) != self.n_sources
        {
            let what = format!(
                "block_cnt_max {} -> {}, block_grad_max {} -> {}, sources {} -> {}",
                current.block_cnt_max,
                params.block_cnt_max,
                current.block_grad_max,
                params.block_grad_max,
                self.n_sources,
                repr.src_cnt
            );
            self.fail(SessionError::JobChanged { job_id: self.config.job_id, what });
            return;
        }
        // Bind to the new incarnation: from now on only its results count.
        self.params = Some(JoinParams { incarnation: params.incarnation, shard_count: params.shard_count, ..current });
        let floor = params.next_block;
        let rec = self.recovery.as_mut().expect("checked above");
        rec.target = params.incarnation;
        rec.floor = Some(floor);
        let space = rec.space;
        rec.pending = self.retained.blocks_from(space, floor).map(|b| (space.distance(b, floor), None)).collect();
        if let Some(op) = self.op.as_mut() {
            // Everything in flight goes to the new switch again, in order.
            op.retransmit.clear();
            for idx in op.low..op.next_new {
                let b = &mut op.blocks[idx as usize];
                b.later_results = 0;
                b.queued = matches!(b.phase, BlockPhase::ExpSent | BlockPhase::DataSent);
                if b.queued {
                    op.retransmit.push_back(idx);
                }
            }
            op.last_progress = now;
            op.backoff = 0;
            op.recoveries += 1;
        } else {
            // an idle (lingering) member: its retained blocks are for the others
            self.linger_stats.idle_recoveries += 1;
        }
        self.last_heard = now;
        if self.recovery.as_ref().is_some_and(|r| r.pending.is_empty()) {
            self.recovery = None;
        }
    }

    /// Send the retained contributions that are due (step 2), tagged with
    /// the new incarnation, in stream order and behind the gate.
    pub(super) fn send_retained(&mut self, now: Time, out: &mut impl Transmit<u16>) -> usize {
        let Some(params) = self.params else { return 0 };
        let Some(rec) = self.recovery.as_mut() else { return 0 };
        let gate = rec.gate(self.op.as_ref(), params.block_cnt_max);
        let tag = incarnation_tag(params.incarnation).to_be_bytes();
        let (space, floor) = (rec.space, rec.floor.unwrap_or_default());
        let mut sent = 0;
        for (&offset, last) in rec.pending.iter_mut() {
            let block_id = space.add(floor, offset);
            if sent >= self.config.max_burst || gate.is_some_and(|g| space.at_or_after(block_id, g)) {
                break;
            }
            if last.is_some() {
                continue;
            }
            let fresh;
            let bytes = match self.retained.get(space, block_id) {
                Some(Kept::Bytes(bytes)) => bytes,
                Some(Kept::FromInput) => {
                    let Some(op) = self.op.as_ref() else { continue };
                    let idx = op.space.distance(block_id, op.base_block);
                    fresh = emit_contribution(&self.config, &params, self.n_sources, self.gen_id, op, idx, Vec::new());
                    &fresh
                }
                None => continue,
            };
            let shard = shard_of(self.config.job_id, block_id, params.block_cnt_max, params.shard_count);
            // Retained unsealed; a keyed job seals each resend afresh.
            let seal = self.sealer.as_mut().map(|s| (s.key, s.take_seq()));
            push_sealed(out, shard, bytes.len(), seal.as_ref().map(|(k, q)| (k, *q)), |buf| {
                buf.copy_from_slice(bytes);
                buf[3] = MessageType::Retransmission as u8;
                buf[8..10].copy_from_slice(&tag);
            });
            *last = Some(now);
            sent += 1;
        }
        if let Some(op) = self.op.as_mut() {
            op.retransmissions += sent as u64;
        }
        sent
    }

    /// A result of the bound incarnation: if it is one of the retained
    /// blocks resent in a recovery, that block is recomputed (step 3). The
    /// worker has its result already and does not use it again.
    pub(super) fn confirm_retained(&mut self, repr: &Repr) {
        let Some(rec) = self.recovery.as_mut() else { return };
        if rec.waiting() || repr.exp_only {
            return;
        }
        let Some(floor) = rec.floor else { return };
        if rec.space.before(repr.block_id, floor) {
            return;
        }
        if rec.pending.remove(&rec.space.distance(repr.block_id, floor)).is_some() && rec.pending.is_empty() {
            self.recovery = None;
        }
    }

    /// Forget contributions more than one slot-cycle behind `low_stream`
    /// (the lowest block without a result): every peer has their results.
    pub(super) fn prune_retained(&mut self, low_stream: u32, block_cnt_max: u32) {
        if self.recovery.is_some() {
            return;
        }
        let space = self.space;
        // the block one slot-cycle before `low_stream`, across the wrap too
        let cut = space.add(low_stream, (space.size() - block_cnt_max.max(1) as u64) as u32);
        let keep = (block_cnt_max as usize).max(SPARE_BUFFERS_MIN);
        let spare = &mut self.spare;
        self.retained.prune_before(space, cut, |kept| {
            if let Kept::Bytes(buf) = kept {
                if spare.len() < keep {
                    spare.push(buf);
                }
            }
        });
    }

    /// Emit the retained contributions still referring to the running
    /// allreduce's input (`Kept::FromInput`): it is about to end and hand
    /// the input back. At most one slot-cycle of blocks is left by then.
    pub(super) fn materialize_retained(&mut self) {
        let (Some(params), Some(op)) = (self.params, self.op.as_ref()) else { return };
        if op.lent.is_none() {
            return;
        }
        for (block_id, kept) in self.retained.iter_mut(op.space) {
            let idx = op.space.distance(block_id, op.base_block);
            if !matches!(kept, Kept::FromInput) || idx >= op.blocks.len() as u32 {
                continue;
            }
            let buf = self.spare.pop().unwrap_or_default();
            *kept = Kept::Bytes(emit_contribution(&self.config, &params, self.n_sources, self.gen_id, op, idx, buf));
        }
    }

    /// Contributions retained for a recovery (block ids), for tests.
    pub fn retained_blocks(&self) -> Vec<u32> {
        self.retained.iter(self.space).map(|(b, _)| b).collect()
    }

    /// A retained contribution's bytes (`None` while it is still to be
    /// emitted from the input), for tests.
    #[cfg(test)]
    pub(crate) fn retained_bytes(&self, block_id: u32) -> Option<&[u8]> {
        self.params?;
        match self.retained.get(self.space, block_id)? {
            Kept::Bytes(b) => Some(b),
            Kept::FromInput => None,
        }
    }
}
