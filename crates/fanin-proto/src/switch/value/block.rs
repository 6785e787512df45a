//! A block record and its phases ([`Block`], Trio-ML's block context), and
//! the slot that holds a block with the shadow copy of its predecessor.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Collecting block exponents (exponent-only contributions).
    Exponent,
    /// Collecting data contributions.
    Data,
    /// Non-root switch: the exponent partial went to the parent; waiting
    /// for the parent's exponent.
    ExponentUp,
    /// Non-root switch: the data partial went to the parent; waiting for the
    /// parent's result.
    DataUp,
    /// Result emitted; kept for retransmissions.
    Done,
}

/// A block record (Trio-ML `trio_ml_block_ctx_t`).
#[derive(Debug)]
pub(super) struct Block {
    pub(super) block_id: u32,
    pub(super) gen_id: u16,
    pub(super) dtype: Dtype,
    pub(super) phase: Phase,
    /// The exponent was fixed by an exponent-only round; data must match it.
    pub(super) negotiated: bool,
    pub(super) has_data: bool,
    pub(super) final_block: bool,
    pub(super) grad_cnt: u16,
    pub(super) exp: i8,
    /// Maximum of the contributions' announcements for block + block_cnt_max.
    pub(super) next_exp: i8,
    /// Sources counted in the current phase (`rcvd_mask`).
    pub(super) rcvd: SourceMask,
    /// The aggregation buffer.
    pub(super) sum: Vec<i32>,
    /// Trio's block_start_time: when the first packet arrived.
    pub(super) start_time: Time,
    /// When the current phase began (creation, or the exponent announced):
    /// a phase's spread is measured from here.
    pub(super) phase_start: Time,
    /// Sources this block waits for: the job's active sources when it was
    /// created (after an aged exponent round, the sources in that round).
    pub(super) expected: SourceMask,
    pub(super) expected_count: u16,
    /// How many of `expected` are in `rcvd`.
    pub(super) expected_rcvd: u16,
    /// The slot it lives in on this shard: where its scan word is (Trio's
    /// REF flag and unreferenced visits, board.rs).
    pub(super) local: u32,
    /// The block aged out (in either phase): its result is partial.
    pub(super) aged: bool,
    /// A retransmission filled a hole in this phase (a contribution was lost
    /// while others arrived): the result is marked `AGE_OP_CONGESTED`.
    pub(super) congested: bool,
    /// Workers summed in the current phase: one per worker, a child
    /// switch's `src_cnt` per switch.
    pub(super) workers: u16,
    /// A child switch's partial was itself partial.
    pub(super) child_degraded: bool,
    /// A worker abstained from this phase (its values exceed the block's
    /// exponent, which was fixed without it): the sum lacks it.
    pub(super) abstained: bool,
    /// A rank that contributed to this phase, left, and was added back: the
    /// sum holds its old process's contribution (which cannot be taken
    /// out), not its new one's (which cannot be added: the rank is in
    /// `rcvd`), so the result lacks the member as it is now.
    pub(super) replaced: bool,
    /// Non-root switch: `(src_cnt, degraded)` of the parent's result, which
    /// is what the children get.
    pub(super) parent_result: Option<(u16, bool)>,
    /// Non-root switch: the `age_op` of the parent's last result for this
    /// block (exponent or data), which the children get instead of this
    /// switch's own: the root's verdict is the job's, so every member cuts
    /// its window at the same results (docs/congestion.md). This switch
    /// aging the block itself (`aged`) or its subtree's marks must not
    /// change what its children read.
    pub(super) parent_age_op: Option<u8>,
    /// The parent refused the block as expired: the children are told so.
    pub(super) expired_up: bool,
    /// Children's retransmissions since the cached partial last went up.
    pub(super) asks_since_resend: u16,
    /// Pooled memory: members that sent the slot's next block while this
    /// one (done) held the slot and no memory was free. A member sends
    /// block `b + block_cnt_max` only once it has `b`'s result, so when
    /// every active member is here this record is needed no more and the
    /// next block takes it.
    pub(super) moved_on: SourceMask,
    /// Sources whose data contribution in this phase said `no_data` (they
    /// own no part of a reduce-scatter's block): they get a result header
    /// without the sum.
    pub(super) no_data: SourceMask,
    /// Pooled memory: a done block whose result every member acknowledged
    /// (a `ResultAck`) gave its buffer back; the record stays in its slot
    /// without a sum, so a late copy of it is told the block expired and
    /// the slot's next block opens as after any done block. Never set on a
    /// slot's shadow (a shadow is dropped instead).
    pub(super) released: bool,
}

impl Block {
    pub(super) fn new(source_capacity: usize) -> Self {
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
            phase_start: Time::ZERO,
            expected: SourceMask::with_capacity(source_capacity),
            expected_count: 0,
            expected_rcvd: 0,
            local: 0,
            aged: false,
            congested: false,
            workers: 0,
            child_degraded: false,
            abstained: false,
            replaced: false,
            parent_result: None,
            parent_age_op: None,
            expired_up: false,
            asks_since_resend: 0,
            moved_on: SourceMask::with_capacity(source_capacity),
            no_data: SourceMask::with_capacity(source_capacity),
            released: false,
        }
    }

    /// Done, and its buffer still held (its result can be sent again).
    pub(super) fn holds_result(&self) -> bool {
        self.phase == Phase::Done && !self.released
    }

    pub(super) fn is_open(&self) -> bool {
        self.phase != Phase::Done
    }

    /// Collecting from the children (not waiting for the parent, not done):
    /// the phases the scanners age and slow-source declarations close.
    pub(super) fn aggregating(&self) -> bool {
        matches!(self.phase, Phase::Exponent | Phase::Data)
    }

    /// Start a phase's collection afresh (the exponent round ended).
    pub(super) fn restart_collection(&mut self) {
        self.rcvd.clear();
        self.no_data.clear();
        self.expected_rcvd = 0;
        self.workers = 0;
        self.child_degraded = false;
        self.abstained = false;
        self.replaced = false;
        self.congested = false;
    }

    /// Every source the block waits for has contributed in this phase, and
    /// at least one did: a result always sums at least one source (the
    /// sources it waited for may all have been declared slow meanwhile).
    pub(super) fn satisfied(&self, quorum: u16) -> bool {
        // with a quorum (GOAT's K), the first K of them suffice
        let need = if quorum == 0 { self.expected_count } else { self.expected_count.min(quorum) };
        self.expected_rcvd >= need && !self.rcvd.is_empty()
    }

    /// Count `src` (summing `weight` workers) in the current phase; false
    /// if it already was. (The caller marks the block referenced:
    /// `Reply::touch`.)
    pub(super) fn receive(&mut self, src: usize, weight: u16) -> bool {
        if !self.rcvd.insert(src) {
            return false;
        }
        self.workers = self.workers.saturating_add(weight);
        if self.expected.contains(src) {
            self.expected_rcvd += 1;
        }
        true
    }

    /// Wait for `src` too (a member that joined or caught up).
    pub(super) fn expect(&mut self, src: usize) {
        if self.expected.insert(src) {
            self.expected_count += 1;
            if self.rcvd.contains(src) {
                self.expected_rcvd += 1;
            }
        }
    }

    /// Stop waiting for `src` (declared permanently slow, or it left).
    pub(super) fn forget(&mut self, src: usize) {
        if self.expected.remove(src) {
            self.expected_count -= 1;
            if self.rcvd.contains(src) {
                self.expected_rcvd -= 1;
            }
        }
    }

    pub(super) fn reset(
        &mut self,
        block_id: u32,
        gen_id: u16,
        dtype: Dtype,
        exp_only: bool,
        now: Time,
        active: &SourceMask,
    ) {
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
        if self.rcvd.capacity() < active.capacity() {
            // the job grew (a member with a larger id joined)
            self.rcvd = SourceMask::with_capacity(active.capacity());
        }
        self.rcvd.clear();
        self.start_time = now;
        self.phase_start = now;
        self.expected.clone_from(active);
        self.expected_count = active.count() as u16;
        self.expected_rcvd = 0;
        self.aged = false;
        self.congested = false;
        self.workers = 0;
        self.child_degraded = false;
        self.abstained = false;
        self.replaced = false;
        self.parent_result = None;
        self.parent_age_op = None;
        self.expired_up = false;
        self.asks_since_resend = 0;
        if self.moved_on.capacity() < active.capacity() {
            self.moved_on = SourceMask::with_capacity(active.capacity());
        }
        self.moved_on.clear();
        if self.no_data.capacity() < active.capacity() {
            self.no_data = SourceMask::with_capacity(active.capacity());
        }
        self.no_data.clear();
        self.released = false;
    }

    /// Header of this block's result (exponent-only while negotiating);
    /// `lacks_a_member`: a member it should sum is not in it
    /// (`reply::lacks_a_member`).
    pub(super) fn result_repr(&self, job_id: u32, exp_only: bool, lacks_a_member: bool) -> Repr {
        let (src_cnt, degraded) = match self.parent_result {
            // The parent's flag, and this switch's own knowledge: a member
            // admitted here from a start at or before this block after the
            // block's partial went up (its sync answer was lost on the way
            // and came again later) is not in the sum. Relaying the
            // parent's flag alone said such a result was complete.
            Some((src_cnt, degraded)) => (src_cnt, degraded || lacks_a_member || self.replaced),
            None => (
                self.workers,
                self.aged || self.child_degraded || self.abstained || self.replaced || lacks_a_member,
            ),
        };
        Repr {
            msg_type: MessageType::Result,
            age_op: match self.parent_age_op {
                Some(age_op) => age_op,
                None if self.aged => AGE_OP_AGED,
                None if self.congested => AGE_OP_CONGESTED,
                None => 0,
            },
            final_block: self.final_block,
            degraded: !exp_only && degraded,
            exp_only,
            no_data: false,
            dtype: self.dtype,
            src_id: 0,
            src_cnt,
            gen_id: self.gen_id,
            job_id,
            block_id: self.block_id,
            grad_cnt: if exp_only { 0 } else { self.grad_cnt },
            exp: self.exp,
            next_exp: if exp_only { EXP_NONE } else { self.next_exp },
        }
    }
}

/// A record the job no longer holds goes to its slot's spare; with pooled
/// memory its buffer goes back to the shard first (the record's masks stay:
/// they are counted in the job's `record_bytes`).
pub(super) fn release(mut block: Block, pooled: bool) -> Block {
    if pooled {
        block.sum = Vec::new();
    }
    block
}

/// One slot of a job: the newest block and the shadow copy of its predecessor.
#[derive(Debug, Default)]
pub(super) struct Slot {
    pub(super) cur: Option<Block>,
    pub(super) prev: Option<Block>,
    /// A freed record kept for reuse, so steady state allocates nothing.
    pub(super) spare: Option<Block>,
}

impl Slot {
    /// Block records of this slot that hold a buffer (pooled memory counts
    /// these): the current block unless released, and the shadow. (Debug
    /// builds recount the job's records with it after every event.)
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub(super) fn held(&self) -> u32 {
        self.cur.as_ref().is_some_and(|b| !b.released) as u32 + self.prev.is_some() as u32
    }
}
