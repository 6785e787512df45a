//! The value-stream aggregation program of one switch shard.
//!
//! Records follow Trio-ML (job records with caps, block records created by
//! the first packet of a block and removed once its result is no longer
//! needed); loss recovery follows SwitchML (source bitmaps, shadow copies).
//!
//! **Slots.** A job owns `block_cnt_max` slots; block `b` lives in slot
//! `b % block_cnt_max`, so the block table is a direct-mapped hash table keyed
//! by `(job_id, block_id)`. A worker sends block `b + block_cnt_max` only after
//! it has the result of block `b`, so a slot holds at most two records: the
//! block being aggregated and the *shadow copy* of the previous one, kept so a
//! member whose result was lost can still fetch it. The shadow is freed as
//! soon as the newer block completes (every member contributed to it, so every
//! member had the older result). Nobody is ever stranded, and memory per job
//! is bounded by `2 * block_cnt_max * block_grad_max` elements.
//!
//! **Exponents.** Float blocks travel as block floating point. A block's
//! shared exponent is negotiated either by an exponent-only round on the block
//! itself, or ahead of time: each data contribution to block `b` announces the
//! sender's exponent for block `b + block_cnt_max` in `next_exp`, and the
//! switch returns the maximum with `b`'s result (SwitchML's pipelining).
//!
//! **Calling contract.** Admit jobs with [`ValueSwitch::add_job`]; feed every
//! datagram to [`ValueSwitch::handle_datagram`] with the current time and the
//! sender's address; send what it wrote into the [`Transmit`] sink. A
//! [`Verdict::WrongShard`] datagram belongs to another shard of the same switch.

use std::collections::HashMap;

use fanin_wire::value::{
    Dtype, JoinParams, Nack, NackReason, Packet, Repr, ELEM_LEN, EXP_NONE, HEADER_LEN,
};
use fanin_wire::MessageType;

use super::Counters;
use crate::job::{shard_of, JobMode, JobSpec, JobSpecError};
use crate::mask::SourceMask;
use crate::time::Time;
use crate::transmit::Transmit;

/// Identity and limits of one shard of a switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardConfig {
    pub shard: u16,
    pub shard_count: u16,
    /// Changes on every switch start; announced to workers in `JoinAck`.
    pub incarnation: u32,
    /// Aggregation memory this shard may hand out to jobs, in bytes.
    pub memory_limit: u64,
}

impl ShardConfig {
    /// A single-shard switch with `memory_limit` bytes.
    pub fn single(memory_limit: u64) -> Self {
        Self { shard: 0, shard_count: 1, incarnation: 1, memory_limit }
    }
}

/// Why a job was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error(transparent)]
    Invalid(#[from] JobSpecError),
    #[error("job {0} already exists")]
    Duplicate(u32),
    #[error("job {job_id} needs {needed} bytes of aggregation memory but only {available} of {limit} are free")]
    OutOfMemory { job_id: u32, needed: u64, available: u64, limit: u64 },
}

/// What the runtime must do with a datagram after the program saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Verdict {
    /// Handled (accepted, answered, or counted and dropped).
    Consumed,
    /// The block belongs to shard `n`; hand the datagram to it unchanged.
    WrongShard(u16),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Collecting block exponents (exponent-only contributions).
    Exponent,
    /// Collecting data contributions.
    Data,
    /// Result emitted; kept for retransmissions.
    Done,
}

/// A block record (Trio-ML `trio_ml_block_ctx_t`).
#[derive(Debug)]
struct Block {
    block_id: u32,
    gen_id: u16,
    dtype: Dtype,
    phase: Phase,
    /// The exponent was fixed by an exponent-only round; data must match it.
    negotiated: bool,
    has_data: bool,
    final_block: bool,
    grad_cnt: u16,
    exp: i8,
    /// Maximum of the contributions' announcements for block + block_cnt_max.
    next_exp: i8,
    /// Sources counted in the current phase (`rcvd_mask`).
    rcvd: SourceMask,
    /// The aggregation buffer.
    sum: Vec<i32>,
    /// Trio's block_start_time: when the first packet arrived.
    start_time: Time,
}

impl Block {
    fn new(source_capacity: usize) -> Self {
        Self {
            block_id: 0,
            gen_id: 0,
            dtype: Dtype::Int32,
            phase: Phase::Data,
            negotiated: false,
            has_data: false,
            final_block: false,
            grad_cnt: 0,
            exp: EXP_NONE,
            next_exp: EXP_NONE,
            rcvd: SourceMask::with_capacity(source_capacity),
            sum: Vec::new(),
            start_time: Time::ZERO,
        }
    }

    fn reset(&mut self, block_id: u32, gen_id: u16, dtype: Dtype, exp_only: bool, now: Time) {
        self.block_id = block_id;
        self.gen_id = gen_id;
        self.dtype = dtype;
        self.phase = if exp_only { Phase::Exponent } else { Phase::Data };
        self.negotiated = false;
        self.has_data = false;
        self.final_block = false;
        self.grad_cnt = 0;
        self.exp = EXP_NONE;
        self.next_exp = EXP_NONE;
        self.rcvd.clear();
        self.start_time = now;
    }

    /// Header of this block's result (exponent-only while negotiating).
    fn result_repr(&self, job_id: u32, exp_only: bool) -> Repr {
        Repr {
            msg_type: MessageType::Result,
            age_op: 0,
            final_block: self.final_block,
            degraded: false,
            exp_only,
            dtype: self.dtype,
            src_id: 0,
            src_cnt: self.rcvd.count() as u16,
            gen_id: self.gen_id,
            job_id,
            block_id: self.block_id,
            grad_cnt: if exp_only { 0 } else { self.grad_cnt },
            exp: self.exp,
            next_exp: if exp_only { EXP_NONE } else { self.next_exp },
        }
    }
}

/// One slot of a job: the newest block and the shadow copy of its predecessor.
#[derive(Debug, Default)]
struct Slot {
    cur: Option<Block>,
    prev: Option<Block>,
    /// A freed record kept for reuse, so steady state allocates nothing.
    spare: Option<Block>,
}

/// A job record (Trio-ML `trio_ml_job_ctx_t`) as seen by one shard.
#[derive(Debug)]
struct Job<A> {
    spec: JobSpec,
    members: SourceMask,
    member_count: u16,
    /// Where each member's results go, learned from its packets.
    addrs: Vec<Option<A>>,
    /// This shard's slots: global slot `k` is local slot `k / shard_count`.
    slots: Vec<Slot>,
    memory: u64,
    /// First block id of the job's stream (the SwitchML++ sync offset).
    start_block: u32,
}

/// Value-stream aggregation for one shard. `A` is the address type of the
/// driver (a socket address in the daemon, a node id in the simulator).
#[derive(Debug)]
pub struct ValueSwitch<A> {
    config: ShardConfig,
    jobs: HashMap<u32, Job<A>>,
    memory_used: u64,
    counters: Counters,
    /// Result datagrams are built once here and copied to every member.
    scratch: Vec<u8>,
}

impl<A: Copy> ValueSwitch<A> {
    pub fn new(config: ShardConfig) -> Self {
        Self { config, jobs: HashMap::new(), memory_used: 0, counters: Counters::default(), scratch: Vec::new() }
    }

    pub fn config(&self) -> &ShardConfig {
        &self.config
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Bytes of aggregation memory this shard has handed out.
    pub fn memory_used(&self) -> u64 {
        self.memory_used
    }

    pub fn job_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.jobs.keys().copied()
    }

    pub fn job(&self, job_id: u32) -> Option<&JobSpec> {
        self.jobs.get(&job_id).map(|j| &j.spec)
    }

    /// Number of slots of `spec` this shard owns.
    fn local_slot_count(&self, spec: &JobSpec) -> usize {
        let (shard, count) = (self.config.shard, self.config.shard_count);
        (0..spec.block_cnt_max).filter(|&k| shard_of(spec.job_id, k, spec.block_cnt_max, count) == shard).count()
    }

    /// Admit a job. Its memory is reserved up front, so an admitted job can
    /// never be starved by another one.
    pub fn add_job(&mut self, spec: JobSpec) -> Result<(), AdmitError> {
        spec.validate()?;
        if self.jobs.contains_key(&spec.job_id) {
            return Err(AdmitError::Duplicate(spec.job_id));
        }
        let local_slots = self.local_slot_count(&spec);
        let memory = match spec.mode {
            JobMode::Aggregate => 2 * local_slots as u64 * spec.block_grad_max as u64 * ELEM_LEN as u64,
            JobMode::Forward => 0,
        };
        let available = self.config.memory_limit.saturating_sub(self.memory_used);
        if memory > available {
            return Err(AdmitError::OutOfMemory {
                job_id: spec.job_id,
                needed: memory,
                available,
                limit: self.config.memory_limit,
            });
        }
        let capacity = spec.source_capacity();
        let mut members = SourceMask::with_capacity(capacity);
        for &m in &spec.members {
            members.insert(m as usize);
        }
        let slot_count = if spec.mode == JobMode::Aggregate {
            // global slot k maps to local k / shard_count; size for the largest
            (spec.block_cnt_max as usize).div_ceil(self.config.shard_count.max(1) as usize)
        } else {
            0
        };
        self.memory_used += memory;
        self.jobs.insert(
            spec.job_id,
            Job {
                member_count: spec.members.len() as u16,
                members,
                addrs: vec![None; capacity],
                slots: (0..slot_count).map(|_| Slot::default()).collect(),
                memory,
                start_block: 0,
                spec,
            },
        );
        Ok(())
    }

    /// Remove a job and free its memory. Returns false if it did not exist.
    pub fn remove_job(&mut self, job_id: u32) -> bool {
        match self.jobs.remove(&job_id) {
            Some(job) => {
                self.memory_used -= job.memory;
                true
            }
            None => false,
        }
    }

    /// Process one datagram from `from`.
    pub fn handle_datagram(&mut self, now: Time, from: A, bytes: &[u8], out: &mut impl Transmit<A>) -> Verdict {
        self.counters.rx_datagrams += 1;
        let packet = match Packet::new_checked(bytes) {
            Ok(p) => p,
            Err(err) => {
                self.counters.count_malformed(&err);
                return Verdict::Consumed;
            }
        };
        match MessageType::from_u8(packet.msg_type_code()) {
            Ok(MessageType::Join) => {
                self.handle_join(from, &packet, out);
                Verdict::Consumed
            }
            Ok(t @ (MessageType::Contribution | MessageType::Retransmission)) => {
                if t == MessageType::Retransmission {
                    self.counters.retransmissions += 1;
                }
                self.handle_contribution(now, from, &packet, out)
            }
            _ => {
                self.counters.protocol_violation += 1;
                Verdict::Consumed
            }
        }
    }

    fn handle_join(&mut self, from: A, packet: &Packet<&[u8]>, out: &mut impl Transmit<A>) {
        self.counters.joins += 1;
        let src = packet.src_id();
        let Some(job) = self.jobs.get_mut(&packet.job_id()) else {
            self.counters.unknown_job += 1;
            send_nack(&mut self.counters, out, from, packet, NackReason::UnknownJob, packet.job_id());
            return;
        };
        if !job.members.contains(src as usize) {
            self.counters.non_member += 1;
            send_nack(&mut self.counters, out, from, packet, NackReason::NotMember, src as u32);
            return;
        }
        job.addrs[src as usize] = Some(from);
        let repr = Repr { src_cnt: job.member_count, ..Repr::new(MessageType::JoinAck, job.spec.job_id, src) };
        let params = JoinParams {
            block_cnt_max: job.spec.block_cnt_max,
            block_grad_max: job.spec.block_grad_max,
            block_exp_ms: job.spec.block_exp_ms,
            incarnation: self.config.incarnation,
            shard_count: self.config.shard_count,
            next_block: job.start_block,
        };
        let buf = out.push(from, repr.buffer_len());
        let mut reply = Packet::new_unchecked(&mut buf[..]);
        repr.emit(&mut reply);
        params.emit(reply.payload_mut());
    }

    fn handle_contribution(
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
            send_nack(counters, out, from, packet, NackReason::NotMember, src as u32);
            return Verdict::Consumed;
        }
        if job.spec.mode == JobMode::Forward {
            reflect(counters, out, from, packet);
            return Verdict::Consumed;
        }
        let block_id = packet.block_id();
        let s = job.spec.block_cnt_max;
        let owner = shard_of(job.spec.job_id, block_id, s, self.config.shard_count);
        if owner != self.config.shard {
            counters.wrong_shard += 1;
            return Verdict::WrongShard(owner);
        }
        if packet.grad_cnt() as u32 > job.spec.block_grad_max {
            counters.over_cap += 1;
            send_nack(counters, out, from, packet, NackReason::TooManyElements, job.spec.block_grad_max);
            return Verdict::Consumed;
        }
        let dtype = Dtype::from_u8(packet.dtype_code()).expect("checked by new_checked");
        let exp_only = packet.exp_only();
        if exp_only && !dtype.is_block_floating_point() {
            counters.protocol_violation += 1;
            return Verdict::Consumed;
        }
        job.addrs[src] = Some(from);

        let local = (block_id % s) as usize / self.config.shard_count.max(1) as usize;
        let slot = &mut job.slots[local];
        // Find the record this packet belongs to, creating it if the packet
        // opens the next use of the slot.
        let is_prev = match &slot.cur {
            None => {
                let offset = block_id.wrapping_sub(job.start_block);
                if block_id < job.start_block {
                    counters.stale += 1;
                    return Verdict::Consumed;
                }
                if offset >= s {
                    counters.out_of_window += 1;
                    return Verdict::Consumed;
                }
                open_block(slot, job.members.capacity(), block_id, packet, exp_only, now);
                false
            }
            Some(cur) if cur.block_id == block_id => false,
            Some(cur) if cur.block_id.checked_add(s) == Some(block_id) => {
                if cur.phase != Phase::Done {
                    counters.slot_busy += 1;
                    return Verdict::Consumed;
                }
                open_block(slot, job.members.capacity(), block_id, packet, exp_only, now);
                false
            }
            Some(cur) => {
                if slot.prev.as_ref().is_some_and(|p| p.block_id == block_id) {
                    true
                } else if block_id < cur.block_id {
                    counters.stale += 1;
                    return Verdict::Consumed;
                } else {
                    counters.out_of_window += 1;
                    return Verdict::Consumed;
                }
            }
        };
        let block = if is_prev { slot.prev.as_mut() } else { slot.cur.as_mut() }.expect("located above");
        if block.gen_id != packet.gen_id() || block.dtype != dtype {
            counters.mismatch += 1;
            if block.dtype != dtype {
                send_nack(counters, out, from, packet, NackReason::DtypeMismatch, block.dtype as u32);
            }
            return Verdict::Consumed;
        }
        let member_count = job.member_count as usize;
        let mut reply = Reply {
            job_id: job.spec.job_id,
            members: &job.members,
            addrs: &job.addrs,
            counters,
            from,
            out,
            scratch: &mut self.scratch,
        };
        let completed = if exp_only {
            contribute_exponent(block, src, packet.exp(), member_count, &mut reply)
        } else {
            contribute_data(block, src, packet, member_count, &mut reply)
        };
        if completed && !is_prev {
            // Every member contributed to the newer block, so every member had
            // the shadow's result: free it.
            if let Some(old) = slot.prev.take() {
                slot.spare = Some(old);
            }
        }
        Verdict::Consumed
    }
}

/// Start a new block in `slot`: the current block becomes the shadow copy
/// and the old shadow's storage is reused.
fn open_block(slot: &mut Slot, capacity: usize, block_id: u32, packet: &Packet<&[u8]>, exp_only: bool, now: Time) {
    let mut block = slot.prev.take().or_else(|| slot.spare.take()).unwrap_or_else(|| Block::new(capacity));
    let dtype = Dtype::from_u8(packet.dtype_code()).expect("checked by new_checked");
    block.reset(block_id, packet.gen_id(), dtype, exp_only, now);
    slot.prev = slot.cur.take();
    slot.cur = Some(block);
}

/// Everything a contribution needs to answer: the job's members and their
/// addresses, the sender, the counters and the output sink.
struct Reply<'a, A, T> {
    job_id: u32,
    members: &'a SourceMask,
    addrs: &'a [Option<A>],
    counters: &'a mut Counters,
    from: A,
    out: &'a mut T,
    /// The result is built once here and copied to each destination.
    scratch: &'a mut Vec<u8>,
}

impl<A: Copy, T: Transmit<A>> Reply<'_, A, T> {
    /// Send the result to every member with a known address (members that
    /// never sent anything fetch it by retransmitting).
    fn send_to_all(&mut self, block: &Block, exp_only: bool) {
        build_result(block, self.job_id, exp_only, self.scratch);
        for id in self.members.iter() {
            if let Some(addr) = self.addrs.get(id).copied().flatten() {
                self.out.push_copy(addr, self.scratch);
                self.counters.results_sent += 1;
            }
        }
    }

    /// Send the result again to the sender only.
    fn send_to_sender(&mut self, block: &Block, exp_only: bool) {
        build_result(block, self.job_id, exp_only, self.scratch);
        self.out.push_copy(self.from, self.scratch);
        self.counters.results_resent += 1;
    }

    fn nack(&mut self, request: &Packet<&[u8]>, reason: NackReason, detail: u32) {
        send_nack(self.counters, self.out, self.from, request, reason, detail);
    }
}

fn build_result(block: &Block, job_id: u32, exp_only: bool, scratch: &mut Vec<u8>) {
    let repr = block.result_repr(job_id, exp_only);
    scratch.clear();
    scratch.resize(repr.buffer_len(), 0);
    let mut packet = Packet::new_unchecked(&mut scratch[..]);
    repr.emit(&mut packet);
    if !exp_only {
        fanin_wire::value::write_elements(&block.sum[..block.grad_cnt as usize], packet.payload_mut());
    }
}

/// An exponent-only contribution. Returns true if it completed the block.
fn contribute_exponent<A: Copy, T: Transmit<A>>(
    block: &mut Block,
    src: usize,
    exp: i8,
    member_count: usize,
    reply: &mut Reply<'_, A, T>,
) -> bool {
    match block.phase {
        Phase::Exponent => {
            if !block.rcvd.insert(src) {
                reply.counters.duplicate += 1;
                return false;
            }
            reply.counters.accepted += 1;
            block.exp = block.exp.max(exp);
            if block.rcvd.count() == member_count {
                block.phase = Phase::Data;
                block.negotiated = true;
                reply.send_to_all(block, true);
                block.rcvd.clear();
            }
            false
        }
        // The sender missed the negotiated exponent: tell it again.
        Phase::Data | Phase::Done => {
            reply.counters.duplicate += 1;
            reply.send_to_sender(block, true);
            false
        }
    }
}

/// A data contribution. Returns true if it completed the block.
fn contribute_data<A: Copy, T: Transmit<A>>(
    block: &mut Block,
    src: usize,
    packet: &Packet<&[u8]>,
    member_count: usize,
    reply: &mut Reply<'_, A, T>,
) -> bool {
    match block.phase {
        Phase::Exponent => {
            reply.counters.protocol_violation += 1;
            false
        }
        Phase::Done => {
            if block.rcvd.contains(src) {
                reply.counters.duplicate += 1;
            } else {
                reply.counters.late += 1;
            }
            reply.send_to_sender(block, false);
            false
        }
        Phase::Data => {
            let grad_cnt = packet.grad_cnt();
            let float = block.dtype.is_block_floating_point();
            if block.has_data {
                if grad_cnt != block.grad_cnt {
                    reply.counters.mismatch += 1;
                    reply.nack(packet, NackReason::ShapeMismatch, block.grad_cnt as u32);
                    return false;
                }
                if float && packet.exp() != block.exp {
                    reply.counters.mismatch += 1;
                    reply.nack(packet, NackReason::ExponentMismatch, block.exp as u8 as u32);
                    return false;
                }
            } else if float && block.negotiated && packet.exp() != block.exp {
                reply.counters.mismatch += 1;
                reply.nack(packet, NackReason::ExponentMismatch, block.exp as u8 as u32);
                return false;
            }
            if !block.rcvd.insert(src) {
                reply.counters.duplicate += 1;
                return false;
            }
            reply.counters.accepted += 1;
            let payload = packet.payload();
            let n = grad_cnt as usize;
            if block.has_data {
                accumulate(&mut block.sum[..n], payload);
            } else {
                block.has_data = true;
                block.grad_cnt = grad_cnt;
                block.exp = packet.exp();
                block.sum.resize(n, 0);
                fanin_wire::value::read_elements(payload, &mut block.sum[..n]);
            }
            block.next_exp = block.next_exp.max(packet.next_exp());
            block.final_block |= packet.final_block();
            if block.rcvd.count() == member_count {
                block.phase = Phase::Done;
                reply.counters.blocks_completed += 1;
                reply.send_to_all(block, false);
                return true;
            }
            false
        }
    }
}

/// The aggregation loop: wrapping int32 adds of a big-endian payload, written
/// so the compiler vectorises it.
#[inline]
fn accumulate(sum: &mut [i32], payload: &[u8]) {
    for (acc, src) in sum.iter_mut().zip(payload.chunks_exact(ELEM_LEN)) {
        *acc = acc.wrapping_add(i32::from_be_bytes([src[0], src[1], src[2], src[3]]));
    }
}

/// NoAggr: return the contribution to its sender as a result, untouched.
fn reflect<A: Copy>(counters: &mut Counters, out: &mut impl Transmit<A>, from: A, packet: &Packet<&[u8]>) {
    let bytes = packet.into_inner();
    let buf = out.push(from, bytes.len());
    buf.copy_from_slice(bytes);
    let mut reply = Packet::new_unchecked(&mut buf[..]);
    reply.set_msg_type(MessageType::Result);
    reply.set_src_cnt(1);
    counters.forwarded += 1;
}

fn send_nack<A: Copy>(
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    dest: A,
    request: &Packet<&[u8]>,
    reason: NackReason,
    detail: u32,
) {
    let repr = Repr {
        dtype: Dtype::from_u8(request.dtype_code()).unwrap_or(Dtype::Int32),
        gen_id: request.gen_id(),
        block_id: request.block_id(),
        ..Repr::new(MessageType::Nack, request.job_id(), request.src_id())
    };
    let buf = out.push(dest, HEADER_LEN + Nack::LEN);
    let mut reply = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut reply);
    Nack { reason, detail }.emit(reply.payload_mut());
    counters.nacks_sent += 1;
}

#[cfg(test)]
mod tests;
