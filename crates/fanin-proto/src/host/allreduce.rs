//! A worker's allreduce session, as a sans-IO machine.
//!
//! The session joins the job (learning the job's slots, element cap, shard
//! count and sync offset from the switch), then runs one allreduce at a time:
//! the tensor is split into blocks of `elems_per_packet` elements, numbered
//! from a block counter that continues across allreduce calls (the job's
//! stream), and streamed with at most `window` blocks outstanding. A block is
//! sent only once every block `block_cnt_max` or more behind it has its
//! result, which is what lets the switch keep just one shadow copy per slot.
//!
//! Float tensors travel as block floating point: a block's exponent is either
//! known ahead (announced in `next_exp` by the contributions to the block
//! `block_cnt_max` earlier and returned with its result) or negotiated with an
//! exponent-only round first.
//!
//! **Calling contract** (the order a driver follows, as in quinn-proto):
//! 1. `new(config, now)`; then loop:
//! 2. `poll_transmit(now, out)` and send what it wrote (destination = shard);
//! 3. wait for a datagram or until `poll_timeout()`;
//! 4. `handle_datagram(now, bytes)` for each datagram, `handle_timeout(now)`
//!    when the deadline passed;
//! 5. `poll_event()` until it returns `None`.
//!
//! Start an allreduce with `begin(now, tensor)` once `Event::Joined` was seen.
//!
//! **Loss recovery.** Two triggers, as TCP has:
//! * *fast retransmit*: the switch handles a shard's packets in order, so
//!   when results arrive for [`DUP_THRESH`] blocks of the same shard that were
//!   sent after block `b`'s last transmission, that transmission or its
//!   result was lost: send `b` again at once (and again if the retransmission
//!   is overtaken the same way);
//! * *stall timeout*: if no result at all arrived for one RTO, resend the
//!   oldest waiting block of each shard (a stall is more often a slow peer
//!   than mass loss), doubling the RTO each time nothing moves. The timer
//!   restarts on progress, so a long queue in front of a block (a full
//!   window) never causes spurious retransmissions.
//!
//! **Back-pressure (trimming).** An overloaded switch answers a contribution
//! with a header-only `Trimmed` nack instead of dropping it silently (NDP's
//! return-to-sender). The block is queued for retransmission at once.
//!
//! **Congestion control.** How many blocks may be in flight is
//! [`super::congestion`]'s window, fed the answers, trims, the switch's
//! congestion marks, losses and stall timeouts this machine sees
//! (docs/congestion.md).

use std::collections::VecDeque;
use std::time::Duration;

use fanin_wire::value::{
    JoinParams, Nack, NackReason, Packet, Repr, TrimCause, EXP_NONE, MEMBERSHIP_FAILED, MEMBERSHIP_MISMATCH, MEMBERSHIP_READMITTED,
    MEMBERSHIP_RESTARTED, MEMBERSHIP_SLOW,
};
use fanin_wire::MessageType;

use super::congestion::{Congestion, CongestionStats, Signal, INITIAL_WINDOW};
use crate::bfp::OutOfRange;
use crate::auth::{open_and_accept, open_group_and_accept, push_sealed, Key, LaneWindows, Refusal, Sealer};
use crate::job::shard_of;
use crate::serial::BlockSpace;
use crate::time::Time;
use crate::transmit::Transmit;

mod config;
mod join;
mod lending;
mod linger;
mod op;
mod outcome;
mod recovery;
mod result_ack;
mod results;
mod retained;
mod tensor;
mod transmit;
#[cfg(test)]
mod tests;

pub use config::SessionConfig;
pub use linger::{LingerStats, LINGER_PROBE_INTERVAL};
use lending::{Input, Lent};
pub use lending::{TensorMut, TensorRef};
use op::{BlockPhase, BlockState, Op};
pub use outcome::{Event, Outcome, SessionError};
use recovery::Recovery;
pub use tensor::{Prepared, Tensor};
use tensor::PreparedInput;

/// How many allreduces ahead of this worker the stash keeps results for
/// (bounded in bytes by `stash_bytes`). A PyTorch step is several
/// allreduces (one per gradient bucket), so a straggler that sleeps through
/// a few steps is dozens of generations behind. Anything further ahead than
/// this, in the 16-bit generation space, is an old duplicate.
const STASH_GENERATIONS: u16 = 1024;

/// Results of later same-shard blocks that make a missing one count as lost.
pub const DUP_THRESH: u8 = 3;

/// Consecutive stall timeouts after which the worker also sends a Join, to
/// learn whether the switch restarted (a new incarnation in the JoinAck).
/// With the default RTOs that is after 1 + 2 + 4 RTOs of silence.
const PROBE_AFTER_BACKOFF: u32 = 3;
/// While that silence lasts, a probe every this long (the stall timer backs
/// off to `rto_max`; a restarted switch should not wait that long to be
/// found). A probe is one small Join; 20 a second per worker costs nothing.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

enum State {
    /// `barrier`: the switch answered that the job's join barrier holds
    /// this worker, with how many members had joined.
    Joining { started: Time, next_send: Time, interval: Duration, barrier: Option<u32> },
    Ready,
    Failed(SessionError),
}

pub struct AllreduceSession {
    config: SessionConfig,
    state: State,
    params: Option<JoinParams>,
    /// The job's block ids, from `params` (they wrap at a multiple of its
    /// `block_cnt_max`, crate::serial); kept rather than rebuilt, which
    /// divides, on every result.
    space: BlockSpace,
    /// Number of sources in the job (block floating point scales for it).
    n_sources: u16,
    /// Elements per block of a 16-bit allreduce: as many as fill the same
    /// datagram as `elems_per_packet` int32 lanes (twice as many, within
    /// the job's block_grad_max) when the packet size is the job's, so a
    /// 16-bit tensor costs 2 bytes per element on the link, headers
    /// included; the session's own size when it set one.
    half_elems_per_packet: u16,
    /// Next block id of the job's stream.
    next_block: u32,
    gen_id: u16,
    op: Option<Op>,
    /// Congestion control: the window (blocks outstanding), at most the
    /// configured window clamped to the job's `block_cnt_max`.
    cc: Congestion,
    /// A result reached this worker with CE in its IP header (a queue on
    /// the way down marked it): the next contribution sent carries the
    /// echo (`AGE_OP_CONGESTED`), so the switch marks that block's result
    /// for every member (docs/congestion.md, "ECN").
    ce_echo: bool,
    last_heard: Time,
    /// The first report, since the switch last sent anything, that nothing
    /// listens on its port ([`handle_port_unreachable`](Self::handle_port_unreachable)).
    unreachable_since: Option<Time>,
    srtt: Option<Duration>,
    rttvar: Duration,
    events: VecDeque<Event>,
    /// Join must be (re)sent at the next poll_transmit.
    join_due: bool,
    /// The earliest a failed group result may send another key probe, and
    /// the wait after that one.
    next_key_probe: Time,
    key_probe_interval: Duration,
    /// Sources the switch told us it declared permanently slow.
    slow_sources: Vec<u16>,
    /// Results of later generations (header, body), oldest first.
    stash: VecDeque<(Repr, Vec<u8>)>,
    stash_len: usize,
    /// Keyed job: seals what this worker sends.
    sealer: Option<Sealer>,
    /// Keyed job: replay windows over the switch shards' sequence numbers.
    windows: LaneWindows,
    /// Keyed job whose results come on its result group: the key they are
    /// sealed with (from the JoinAck) and the windows over their numbers.
    result_key: Option<HeldResultKey>,
    group_windows: LaneWindows,
    auth_stats: AuthStats,
    /// The data contribution of every recent block that has its result, by
    /// block id: the blocks at most `block_cnt_max` behind the lowest block
    /// without one, which a peer may still lack. After a switch restart they
    /// are sent again so the new incarnation can recompute those blocks
    /// (docs/restart.md).
    retained: retained::Retained,
    /// Buffers of pruned retained contributions, reused.
    spare: Vec<Vec<u8>>,
    /// First data transmissions of the blocks in flight, to be retained.
    captured: recovery::Captured,
    /// Set while recovering from a switch restart.
    recovery: Option<Recovery>,
    /// [`keep_only`](Self::keep_only)'s range, for the next allreduce.
    next_keep: Option<std::ops::Range<usize>>,
    /// Acknowledgements owed to shards short of memory.
    result_acks: result_ack::ResultAcks,
    /// Set while the driver keeps an idle session taking part in a switch
    /// restart ([`set_lingering`](Self::set_lingering)).
    linger: Option<linger::Linger>,
    linger_stats: LingerStats,
}

/// The result key a JoinAck gave, with the incarnation and key epoch it
/// belongs to (epochs only go forward within an incarnation).
#[derive(Debug, Clone, Copy)]
struct HeldResultKey {
    key: Key,
    incarnation: u32,
    epoch: u32,
}

/// Datagrams a keyed session dropped before looking at them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuthStats {
    /// The tag did not verify under this worker's key (or a sealed datagram
    /// reached an unkeyed session).
    pub bad_tag: u64,
    /// Valid tag, sequence number already seen or too old.
    pub replayed: u64,
    /// No tag although the job is keyed.
    pub unsealed: u64,
    /// A result on the group's lanes before a JoinAck gave the key to check
    /// it with (a late joiner's first group results): dropped, and fetched
    /// again by retransmission.
    pub before_result_key: u64,
    /// Probes sent because a group result failed under the result key held
    /// (the switch may have started a new key epoch: a member left).
    pub result_key_probes: u64,
    /// JoinAcks that gave a result key other than the one held.
    pub result_key_changes: u64,
}

/// True when a sealed datagram's sequence number is on the group lanes
/// (sealed under the result key, not this worker's own).
fn is_group_lane(bytes: &[u8]) -> bool {
    fanin_wire::auth::Sealed::split(bytes).is_ok_and(|s| fanin_wire::auth::is_group_seq(s.seq))
}

/// A Result of job `job_id` on the group lanes (the one thing a switch
/// seals under the result key; another job may share the group).
fn is_group_result(bytes: &[u8], job_id: u32) -> bool {
    is_group_lane(bytes)
        && bytes[3] & !fanin_wire::auth::SEALED == MessageType::Result as u8
        && bytes.get(12..16).is_some_and(|id| id == job_id.to_be_bytes())
}

impl AllreduceSession {
    pub fn new(config: SessionConfig, now: Time) -> Self {
        let state = match config.validate() {
            Ok(()) => State::Joining { started: now, next_send: now, interval: Duration::from_millis(50), barrier: None },
            Err(e) => State::Failed(e),
        };
        let mut session = Self {
            cc: Congestion::new(INITIAL_WINDOW, config.window),
            ce_echo: false,
            config,
            state,
            params: None,
            space: BlockSpace::new(1),
            n_sources: 1,
            half_elems_per_packet: 0,
            next_block: 0,
            gen_id: 0,
            op: None,
            last_heard: now,
            unreachable_since: None,
            srtt: None,
            rttvar: Duration::ZERO,
            events: VecDeque::new(),
            join_due: true,
            next_key_probe: now,
            key_probe_interval: PROBE_INTERVAL,
            slow_sources: Vec::new(),
            stash: VecDeque::new(),
            stash_len: 0,
            sealer: None,
            windows: LaneWindows::default(),
            result_key: None,
            group_windows: LaneWindows::default(),
            auth_stats: AuthStats::default(),
            retained: retained::Retained::default(),
            spare: Vec::new(),
            captured: recovery::Captured::default(),
            recovery: None,
            next_keep: None,
            result_acks: Default::default(),
            linger: None,
            linger_stats: LingerStats::default(),
        };
        session.sealer = session.config.auth_key.map(|k| Sealer::new(k, 0, session.config.seal_clock_us));
        if let State::Failed(e) = &session.state {
            session.events.push_back(Event::Failed(e.clone()));
        }
        session
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// What the session refused before looking at it (keyed jobs).
    pub fn auth_stats(&self) -> AuthStats {
        self.auth_stats
    }

    pub fn params(&self) -> Option<&JoinParams> {
        self.params.as_ref()
    }

    pub fn n_sources(&self) -> u16 {
        self.n_sources
    }

    /// Elements per packet this session sends: the override it was given,
    /// or the job's packet size once joined (0 before).
    pub fn elems_per_packet(&self) -> u16 {
        self.config.elems_per_packet
    }

    /// Elements per block of a float16/bfloat16 allreduce (0 before the
    /// join): see `half_elems_per_packet`.
    pub fn half_elems_per_packet(&self) -> u16 {
        self.half_elems_per_packet
    }

    /// Sources the switch currently reports as permanently slow.
    pub fn slow_sources(&self) -> &[u16] {
        &self.slow_sources
    }

    pub fn is_ready(&self) -> bool {
        matches!(self.state, State::Ready) && self.op.is_none()
    }

    pub fn error(&self) -> Option<&SessionError> {
        match &self.state {
            State::Failed(e) => Some(e),
            _ => None,
        }
    }

    /// Current window: blocks this worker may have outstanding.
    pub fn window(&self) -> u32 {
        self.cc.window()
    }

    /// What congestion control saw over the session's life.
    pub fn congestion(&self) -> CongestionStats {
        self.cc.stats()
    }

    /// Current retransmission timeout (before per-block backoff).
    pub fn rto(&self) -> Duration {
        match self.srtt {
            None => self.config.rto_initial,
            Some(srtt) => (srtt + 4 * self.rttvar).clamp(self.config.rto_min, self.config.rto_max),
        }
    }

    fn check_ready(&self) -> Result<(), SessionError> {
        match &self.state {
            State::Failed(e) => Err(e.clone()),
            State::Joining { .. } => Err(SessionError::NotReady("still joining the job")),
            State::Ready if self.op.is_some() => Err(SessionError::NotReady("an allreduce is already running")),
            State::Ready => Ok(()),
        }
    }

    /// Make the next allreduce begun (whether it starts or is refused) a
    /// **reduce-scatter**: only the elements in `keep` (indices into the
    /// flattened tensor) are summed into the output; every other element
    /// of it is left as it was. The blocks outside `keep` are contributed
    /// with `no_data`, and the switch answers them with a result header
    /// without the sum, so this worker's link carries about
    /// `keep.len()` elements down instead of the whole tensor
    /// (docs/protocol.md §4.13).
    pub fn keep_only(&mut self, keep: std::ops::Range<usize>) {
        self.next_keep = Some(keep);
    }

    /// Drop a [`keep_only`](Self::keep_only) range no allreduce has taken
    /// (a driver whose call failed before it began one).
    pub fn keep_all(&mut self) {
        self.next_keep = None;
    }

    /// Start an allreduce of `tensor`. The result comes as `Event::Completed`.
    /// A value block floating point cannot carry fails the call and the
    /// session ([`refuse_input`](Self::refuse_input)).
    pub fn begin(&mut self, now: Time, tensor: Tensor) -> Result<(), SessionError> {
        let keep = self.next_keep.take();
        self.check_ready()?;
        let prepared = Prepared::new(tensor, self.config.elems_per_packet as usize).map_err(|e| self.refuse_input(e))?;
        self.begin_owned(now, prepared, keep)
    }

    /// This worker refused its input to an allreduce before sending any of
    /// it (`e`: a finite value beyond block floating point's range; the
    /// caller prepared it with [`Prepared::new`], `borrow` or `copy_f32`).
    /// The job's other ranks may be waiting in that allreduce, and this
    /// session's next allreduce of the same length would be summed with
    /// their pending one, so the session fails: every later call gets
    /// [`SessionError::OutOfStep`] and the others' call fails at their
    /// timeout (docs/protocol.md §5.1). Returns the error for the refused
    /// call. Whoever prepares an input and gets `Err` must call this.
    pub fn refuse_input(&mut self, e: OutOfRange) -> SessionError {
        if !matches!(self.state, State::Failed(_)) && self.op.is_none() {
            self.state = State::Failed(SessionError::OutOfStep(e));
        }
        SessionError::OutOfRange(e)
    }

    /// Start an allreduce of a tensor whose exponents are already known
    /// (prepared for another block size, they are computed again).
    /// A borrowed input is copied first: the results overwrite the input
    /// the session owns.
    pub fn begin_prepared(&mut self, now: Time, prepared: Prepared<'_>) -> Result<(), SessionError> {
        let keep = self.next_keep.take();
        self.begin_owned(now, prepared, keep)
    }

    /// `begin_prepared` with the `keep_only` range its caller took.
    fn begin_owned(
        &mut self,
        now: Time,
        prepared: Prepared<'_>,
        keep: Option<std::ops::Range<usize>>,
    ) -> Result<(), SessionError> {
        self.check_ready()?;
        let Prepared { input, local_exp, per, average } = prepared;
        let tensor = match input {
            PreparedInput::Owned(t) => t,
            PreparedInput::Borrowed(v) => v.to_owned(),
        };
        self.begin_op(now, Prepared { input: PreparedInput::Owned(tensor), local_exp, per, average }, None, keep)
    }

    /// Start an allreduce of `prepared` whose sum is written into `out`
    /// (same dtype and length) instead of over the input, which stays
    /// intact: an owned input comes back unchanged in the `Outcome`, a
    /// borrowed one ([`Prepared::borrow`]) is only read, and the outcome's
    /// tensor is then empty. Saves copying the result into memory the
    /// session cannot own, and the contributions retained for a switch
    /// restart need no copy either (see `lending`). A borrowed input must
    /// not overlap `out`; an owned one may have been staged from it.
    ///
    /// # Safety
    ///
    /// `out`'s memory, and a borrowed input's, must stay valid until this
    /// allreduce ends: `Event::Completed` or `Event::Failed` is queued, or
    /// [`abandon`](Self::abandon) returns. Until then nothing else may read
    /// or write `out`, nor write the input. (The borrows cannot be tied to
    /// the session, which outlives the call.)
    /// `fanin_host::Session::allreduce_into` is the safe wrapper.
    pub unsafe fn begin_into(
        &mut self,
        now: Time,
        prepared: Prepared<'_>,
        out: TensorMut<'_>,
    ) -> Result<(), SessionError> {
        let keep = self.next_keep.take();
        let input = prepared.input.view();
        if matches!(prepared.input, PreparedInput::Borrowed(_)) && lending::overlaps(&out, input) {
            return Err(SessionError::Config(
                "the output overlaps the borrowed input: results would overwrite contributions still to be sent; \
                 prepare an owned copy of the input (Prepared::new or copy_f32) instead"
                    .into(),
            ));
        }
        let (want, len) = (input.dtype(), input.len());
        let lent = Lent::new(out, input).ok_or_else(|| {
            SessionError::Config(format!("the output must match the input ({want:?}, {len} elements)"))
        })?;
        self.begin_op(now, prepared, Some(lent), keep)
    }

    /// End the running allreduce, if any, without a result: its lent output
    /// is released and no event is queued for it. For a driver that gives up
    /// (an I/O error) so that `begin_into`'s buffer is free again.
    pub fn abandon(&mut self) {
        drop(self.end_op());
    }

    /// The caller gave up (Ctrl-C): the running allreduce ends without a
    /// result and the session fails; the job's other ranks are left
    /// waiting for this one, so only new sessions continue.
    pub fn interrupt(&mut self) {
        self.fail(SessionError::Interrupted);
    }

    /// `lent` is `Some` whenever the input is borrowed (`begin_prepared`
    /// copies it otherwise).
    fn begin_op(
        &mut self,
        now: Time,
        prepared: Prepared<'_>,
        lent: Option<Lent>,
        keep: Option<std::ops::Range<usize>>,
    ) -> Result<(), SessionError> {
        self.check_ready()?;
        if let Some(k) = &keep {
            let len = prepared.input.view().len();
            if k.start > k.end || k.end > len {
                return Err(SessionError::Config(format!(
                    "keep_only range {}..{} is not within the tensor's {len} elements",
                    k.start, k.end
                )));
            }
        }
        let per = match prepared.input.view() {
            TensorRef::Half(..) => self.half_elems_per_packet.max(1) as usize,
            _ => self.config.elems_per_packet as usize,
        };
        let Prepared { input, local_exp, average, .. } =
            prepared.for_block_size(per).map_err(|e| self.refuse_input(e))?;
        if average && !input.view().dtype().is_block_floating_point() {
            return Err(SessionError::Config("averaging needs a float tensor (an int32 mean is not an int32)".into()));
        }
        if matches!(input.view(), TensorRef::Half(..)) {
            crate::bfp::half::check_sources(self.n_sources as usize).map_err(SessionError::Config)?;
        }
        let n_blocks = input.view().len().div_ceil(per) as u32;
        let input = match input {
            PreparedInput::Owned(t) => Input::Owned(t),
            PreparedInput::Borrowed(v) => {
                assert!(lent.is_some(), "a borrowed input needs a lent output");
                Input::lend(v)
            }
        };
        let base_block = self.next_block;
        let space = self.block_space();
        self.next_block = space.add(self.next_block, n_blocks);
        self.gen_id = self.gen_id.wrapping_add(1);
        let fresh = BlockState {
            phase: BlockPhase::Unsent,
            exp: EXP_NONE,
            attempt: 0,
            sent_at: now,
            later_results: 0,
            queued: false,
            timer_resend: false,
            send_seq: 0,
            first_sent: None,
        };
        let blocks = vec![fresh; n_blocks as usize];
        self.op = Some(Op {
            input,
            lent,
            base_block,
            space,
            blocks,
            local_exp,
            per,
            average,
            low: 0,
            next_new: 0,
            done: 0,
            done_ahead: 0,
            missed: 0,
            latency_sum: Duration::ZERO,
            latency_max: Duration::ZERO,
            latency_samples: 0,
            ready: VecDeque::new(),
            retransmit: VecDeque::new(),
            last_progress: now,
            backoff: 0,
            send_seq: 0,
            retransmissions: 0,
            trimmed: 0,
            fast_retransmits: 0,
            timeouts: 0,
            marked_results: 0,
            ecn_ce: 0,
            degraded: Vec::new(),
            min_src_cnt: self.n_sources,
            recoveries: 0,
            next_probe: now,
            keep,
        });
        self.last_heard = now;
        // Results the switch pushed for this allreduce before it began.
        let stash = std::mem::take(&mut self.stash);
        self.stash_len = 0;
        for (repr, body) in stash {
            let ahead = repr.gen_id.wrapping_sub(self.gen_id);
            if ahead == 0 {
                self.on_result(now, &repr, &body);
            } else if (1..=STASH_GENERATIONS).contains(&ahead) {
                self.stash_result(&repr, &body);
            }
        }
        if n_blocks == 0 {
            self.finish_op();
        }
        Ok(())
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// The next time `handle_timeout` must be called, if any.
    pub fn poll_timeout(&self) -> Option<Time> {
        match &self.state {
            State::Failed(_) => None,
            State::Joining { started, next_send, barrier, .. } => {
                Some((*next_send).min(*started + self.join_deadline(*barrier)))
            }
            State::Ready => {
                let recovery = self.recovery_deadline();
                let Some(op) = self.op.as_ref() else { return recovery.or(self.linger_deadline()) };
                let dead = self.last_heard + self.config.dead_after;
                if op.outstanding() == 0 {
                    // Nothing in flight (or everything behind the recovery
                    // gate): only the recovery's timers, and the silence
                    // limit while it resends.
                    let resending = self.recovery.as_ref().is_some_and(|r| !r.waiting());
                    return match recovery {
                        Some(t) if resending => Some(t.min(dead)),
                        Some(t) => Some(t),
                        None => Some(dead),
                    };
                }
                let probe = if op.backoff >= PROBE_AFTER_BACKOFF && self.recovery.is_none() { op.next_probe } else { dead };
                let t = self.stall_deadline(op).min(dead).min(probe);
                Some(recovery.map_or(t, |r| r.min(t)))
            }
        }
    }

    pub fn handle_timeout(&mut self, now: Time) {
        match &mut self.state {
            State::Failed(_) => {}
            State::Joining { started, next_send, barrier, .. } => {
                let (started, next_send, barrier) = (*started, *next_send, *barrier);
                if now >= started + self.join_deadline(barrier) {
                    self.fail(match barrier {
                        // the switch's host said nothing listens there
                        None if self.unreachable_since.is_some() => SessionError::SwitchGone {
                            waited: now.saturating_since(self.unreachable_since.unwrap_or(now)),
                        },
                        None => SessionError::SwitchUnreachable(self.config.join_timeout),
                        Some(joined) => SessionError::JoinBarrier {
                            job_id: self.config.job_id,
                            joined,
                            members: self.n_sources,
                            waited: self.config.barrier_timeout,
                        },
                    });
                } else if now >= next_send {
                    self.join_due = true;
                }
            }
            State::Ready => {
                if self.recovery.is_some() && self.recovery_timeout(now) {
                    return; // failed
                }
                let rto = self.rto();
                let Some(op) = self.op.as_ref() else {
                    self.linger_timeout(now);
                    return;
                };
                let stalled = op.outstanding() > 0 && now >= self.stall_deadline(op);
                let op = self.op.as_mut().expect("checked above");
                if stalled {
                    // Nothing moved for an RTO. Usually a peer is slow rather
                    // than many packets lost, so, like TCP, resend only the
                    // oldest waiting block of each shard; once results flow
                    // again, fast retransmit finds any other hole.
                    let shards = self.params.map_or(1, |p| p.shard_count.max(1)) as usize;
                    let mut resent = vec![false; shards];
                    for idx in op.low..op.next_new {
                        let b = &op.blocks[idx as usize];
                        let waiting = matches!(b.phase, BlockPhase::ExpSent | BlockPhase::DataSent);
                        if !waiting || now.saturating_since(b.sent_at) < rto {
                            continue;
                        }
                        let shard = self.params.map_or(0, |p| {
                            shard_of(self.config.job_id, op.block_id(idx), p.block_cnt_max, p.shard_count)
                        }) as usize;
                        if !resent[shard] {
                            resent[shard] = true;
                            if !op.blocks[idx as usize].queued {
                                op.blocks[idx as usize].queued = true;
                                op.blocks[idx as usize].timer_resend = true;
                                op.retransmit.push_back(idx);
                            }
                            if resent.iter().all(|r| *r) {
                                break;
                            }
                        }
                    }
                    op.backoff = (op.backoff + 1).min(6);
                    op.last_progress = now;
                    op.timeouts += 1;
                    self.cc.on_signal(now, rto, Signal::Timeout);
                    if op.backoff >= PROBE_AFTER_BACKOFF {
                        // Silent for a while: ask the switch who it is now (a
                        // restarted one answers with a new incarnation).
                        self.join_due = true;
                        op.next_probe = now + PROBE_INTERVAL;
                    }
                } else if op.backoff >= PROBE_AFTER_BACKOFF && op.outstanding() > 0 && now >= op.next_probe {
                    self.join_due = true;
                    op.next_probe = now + PROBE_INTERVAL;
                }
                let outstanding = op.outstanding();
                // While waiting for the floor, RecoveryStalled bounds the wait;
                // while resending retained blocks, silence counts as usual.
                let waiting = self.recovery.as_ref().is_some_and(|r| r.waiting());
                let resending = self.recovery.as_ref().is_some_and(|r| !r.waiting());
                if (outstanding > 0 || resending) && !waiting && now >= self.last_heard + self.config.dead_after {
                    let waited = now.saturating_since(self.last_heard);
                    self.fail(SessionError::SwitchSilent { waited, outstanding: outstanding as usize });
                }
            }
        }
    }

    /// Write datagrams to send; the destination is the switch shard.
    pub fn poll_transmit(&mut self, now: Time, out: &mut impl Transmit<u16>) -> usize {
        match &mut self.state {
            State::Failed(_) => 0,
            State::Joining { next_send, interval, .. } => {
                if !self.join_due {
                    return 0;
                }
                self.join_due = false;
                *next_send = now + *interval;
                *interval = (*interval * 2).min(Duration::from_millis(500));
                let repr = self.join_request();
                let seal = self.sealer.as_mut().map(|s| (s.key, s.take_seq()));
                push_sealed(out, 0, repr.buffer_len(), seal.as_ref().map(|(k, q)| (k, *q)), |buf| {
                    repr.emit(&mut Packet::new_unchecked(buf))
                });
                1
            }
            State::Ready => {
                let mut sent = 0;
                if self.join_due {
                    self.join_due = false;
                    let (repr, anchor) = match self.recovery_join() {
                        Some((repr, anchor)) => (repr, Some(anchor)),
                        None => (self.done_request().unwrap_or_else(|| self.probe_request()), None),
                    };
                    let seal = self.sealer.as_mut().map(|s| (s.key, s.take_seq()));
                    push_sealed(out, 0, repr.buffer_len(), seal.as_ref().map(|(k, q)| (k, *q)), |buf| {
                        let mut packet = Packet::new_unchecked(buf);
                        repr.emit(&mut packet);
                        if let Some(anchor) = anchor {
                            anchor.emit(packet.payload_mut());
                        }
                    });
                    sent += 1;
                }
                if self.recovery.as_ref().is_some_and(|r| r.waiting()) {
                    return sent; // nothing goes out until the floor is known
                }
                sent += self.send_retained(now, out);
                sent += self.send_result_acks(now, out);
                sent + self.transmit_blocks(now, out)
            }
        }
    }

    /// Verify a datagram of a keyed job: a result sealed once for the
    /// job's result group (its sequence number on the group lanes) under
    /// the result key the JoinAck gave, anything else under this worker's
    /// own key; each with replay windows of its own.
    fn open_sealed<'a>(&mut self, key: &Key, bytes: &'a [u8]) -> Result<&'a [u8], Refusal> {
        match (is_group_lane(bytes), &self.result_key) {
            (false, _) => open_and_accept(key, &mut self.windows, bytes),
            (true, Some(held)) => open_group_and_accept(&held.key, &mut self.group_windows, bytes),
            // not told the key (yet): nothing to check it with
            (true, None) => Err(Refusal::NoKey),
        }
    }

    /// Take the result key a JoinAck carries (wrapped under our key, bound
    /// to the answering switch's incarnation), or forget the one we had if
    /// it carries none: our results no longer come on a group.
    pub(super) fn learn_result_key(&mut self, params: &JoinParams) {
        let Some(key) = self.config.auth_key else { return };
        let (job_id, incarnation) = (self.config.job_id, params.incarnation);
        let Some(rk) = params.result_key else {
            self.result_key = None;
            return;
        };
        if let Some(held) = &self.result_key {
            // Epochs only go forward within one incarnation: the key we hold,
            // or an older epoch's (a delayed probe answer, or one an attacker
            // held back and releases within the replay window, which must
            // not bring back a key that a member who left still holds),
            // changes nothing.
            if held.incarnation == incarnation && rk.epoch <= held.epoch {
                return;
            }
            self.auth_stats.result_key_changes += 1;
        }
        let learnt = Key(fanin_wire::auth::wrap_result_key(&key, job_id, incarnation, rk.epoch, &Key(rk.wrapped)));
        self.result_key = Some(HeldResultKey { key: learnt, incarnation, epoch: rk.epoch });
        // A new key's numbers start a window of their own: what an old key's
        // holder sealed (perhaps with a number far ahead) fails the new key
        // anyway, and must not push the genuine numbers out of the window.
        self.group_windows = LaneWindows::default();
        self.key_probe_interval = PROBE_INTERVAL;
    }

    /// A result on the group lanes failed under the result key we hold: the
    /// switch may have started a new epoch (a member left), so ask for the
    /// current key with a probe Join: [`PROBE_INTERVAL`] apart at first,
    /// backing off while the answers bring no new key (a forger sending junk
    /// to the group gets no more than that). The result itself comes again
    /// when our contribution is retransmitted.
    fn ask_for_result_key(&mut self, now: Time) {
        if matches!(self.state, State::Ready) && now >= self.next_key_probe {
            self.join_due = true;
            self.next_key_probe = now + self.key_probe_interval;
            // while the answers bring no new key (junk on the group, not a
            // new epoch) each probe waits twice as long, up to 1.6 s
            self.key_probe_interval = (self.key_probe_interval * 2).min(PROBE_INTERVAL * 32);
            self.auth_stats.result_key_probes += 1;
        }
    }

    pub fn handle_datagram(&mut self, now: Time, bytes: &[u8]) {
        self.handle_datagram_ce(now, bytes, false)
    }

    /// [`handle_datagram`](Self::handle_datagram) of a datagram whose IP
    /// header said `ce`: the ECN field was Congestion Experienced, a queue
    /// on its way marked it instead of dropping it (RFC 3168). A result so
    /// marked is echoed on this worker's next contribution.
    pub fn handle_datagram_ce(&mut self, now: Time, bytes: &[u8], ce: bool) {
        // Keyed job: only what the switch sealed with this worker's key,
        // once; checked before anything else is looked at.
        let bytes = match self.config.auth_key {
            Some(key) => match self.open_sealed(&key, bytes) {
                Ok(inner) => inner,
                Err(Refusal::Replay(_)) => {
                    self.auth_stats.replayed += 1;
                    return;
                }
                Err(Refusal::Auth(fanin_wire::auth::AuthError::Unsealed)) => {
                    self.auth_stats.unsealed += 1;
                    return;
                }
                Err(Refusal::NoKey) => {
                    self.auth_stats.before_result_key += 1;
                    return;
                }
                Err(Refusal::Auth(fanin_wire::auth::AuthError::BadTag)) if self.result_key.is_some() && is_group_result(bytes, self.config.job_id) => {
                    self.auth_stats.bad_tag += 1;
                    self.ask_for_result_key(now);
                    return;
                }
                Err(_) => {
                    self.auth_stats.bad_tag += 1;
                    return;
                }
            },
            None if fanin_wire::auth::is_sealed(bytes) => {
                self.auth_stats.bad_tag += 1;
                return;
            }
            None => bytes,
        };
        let packet = match Packet::new_checked(bytes) {
            Ok(packet) => packet,
            Err(_) => {
                // A result a trimming link cut to its header on the way
                // (docs/protocol.md §4.14): the sum is lost, and known to be
                // lost now, one trip before any timer would say so. Ask for
                // it again at once and count the trim as congestion, as if
                // the switch had trimmed the contribution.
                if let Some(cut) = Packet::trimmed_header(bytes) {
                    if cut.job_id() == self.config.job_id && cut.msg_type_code() == MessageType::Result as u8 {
                        self.last_heard = now;
                        let repr = Repr { block_id: cut.block_id(), gen_id: cut.gen_id(), ..Repr::new(MessageType::Result, cut.job_id(), cut.src_id()) };
                        self.on_trimmed(now, &repr);
                    }
                }
                return;
            }
        };
        if packet.job_id() != self.config.job_id {
            return;
        }
        let Ok(repr) = Repr::parse(&packet) else { return };
        // something listens on the switch's port again
        self.unreachable_since = None;
        if ce && repr.msg_type == MessageType::Result {
            self.ce_echo = true;
            if let Some(op) = self.op.as_mut() {
                op.ecn_ce += 1;
            }
        }
        match repr.msg_type {
            MessageType::JoinAck => self.on_join_ack(now, &repr, packet.payload()),
            MessageType::Nack => {
                if let Ok(nack) = Nack::parse(packet.payload()) {
                    let tag = Nack::tag_of(bytes);
                    let bound = self.params.is_some();
                    if nack.reason == NackReason::StaleIncarnation
                        || (nack.reason == NackReason::TreeSwitchRestarted && bound)
                    {
                        // (a tree's switch that restarted refuses a bound
                        // worker's probe: the worker recovers; a session
                        // still joining is a new run, refused below)
                        self.last_heard = now;
                        self.begin_recovery(now, nack.detail);
                    } else if nack.reason == NackReason::BlockExpired && tag != 0 && Some(tag) != self.tag() {
                        // from another incarnation than the one we are bound to
                    } else if nack.reason == NackReason::UnknownJob && self.params.is_some() {
                        // The switch lost the job (it restarted without it):
                        // wait for it to be re-admitted, as in a restart.
                        self.last_heard = now;
                        self.begin_recovery(now, 0);
                    } else if nack.reason == NackReason::BlockExpired {
                        self.last_heard = now;
                        self.on_expired(now, &repr);
                    } else if nack.reason == NackReason::Trimmed {
                        self.last_heard = now;
                        if nack.detail == TrimCause::MemoryExhausted as u32 {
                            self.on_memory_refusal(now, repr.block_id);
                        }
                        self.on_trimmed(now, &repr);
                    } else if nack.reason == NackReason::JobFailed {
                        self.fail(SessionError::MemberFailed { job_id: repr.job_id, rank: nack.detail as u16 });
                    } else {
                        // Other nacks name a problem no retransmission can fix.
                        self.fail(SessionError::Refused { job_id: repr.job_id, reason: nack.reason, detail: nack.detail });
                    }
                }
            }
            MessageType::Membership => {
                self.last_heard = now;
                if repr.age_op == MEMBERSHIP_FAILED {
                    self.fail(SessionError::MemberFailed { job_id: repr.job_id, rank: repr.src_id });
                    return;
                }
                if repr.age_op == MEMBERSHIP_RESTARTED || repr.age_op == MEMBERSHIP_MISMATCH {
                    // Our round is over. (A session still joining is of the
                    // next round: notices of the last one are not for it;
                    // nor is a notice whose next round starts at or before
                    // the block this session joined at: an ended round's,
                    // meant for a straggler of it, which a relay fans out to
                    // every host behind it, docs/goat.md.)
                    let ours = self.params.as_ref().map_or(true, |p| self.space.before(p.next_block, repr.block_id));
                    if matches!(self.state, State::Ready) && ours {
                        let (job_id, rank) = (repr.job_id, repr.src_id);
                        self.fail(if repr.age_op == MEMBERSHIP_RESTARTED {
                            SessionError::MemberRestarted { job_id, rank }
                        } else {
                            SessionError::LengthMismatch { job_id, rank }
                        });
                    }
                    return;
                }
                let slow = repr.age_op == MEMBERSHIP_SLOW;
                if repr.age_op == MEMBERSHIP_SLOW || repr.age_op == MEMBERSHIP_READMITTED {
                    self.slow_sources.retain(|&s| s != repr.src_id);
                    if slow {
                        self.slow_sources.push(repr.src_id);
                    }
                    self.events.push_back(Event::Membership { source: repr.src_id, slow, waiting_for: repr.src_cnt });
                }
            }
            MessageType::Result => {
                if Some(repr.src_id) != self.tag() {
                    // A result of another incarnation of the switch: never
                    // mixed with this one's (docs/restart.md).
                    return;
                }
                self.last_heard = now;
                self.confirm_retained(&repr);
                self.on_result(now, &repr, packet.payload());
            }
            _ => {}
        }
    }

    /// The job's block ids (known once joined).
    fn block_space(&self) -> BlockSpace {
        self.space
    }

    /// When the stall timer fires: one (backed-off) RTO after the last progress.
    fn stall_deadline(&self, op: &Op) -> Time {
        let rto = (self.rto() * 2u32.pow(op.backoff)).min(self.config.rto_max);
        op.last_progress + rto
    }

    /// Take the running allreduce out of the session, releasing its lent
    /// output: the contributions retained from its input are emitted now,
    /// while the input is still at hand.
    fn end_op(&mut self) -> Option<Op> {
        self.materialize_retained();
        self.op.take()
    }

    fn finish_op(&mut self) {
        let Some(op) = self.end_op() else { return };
        self.events.push_back(Event::Completed(Outcome {
            blocks: op.blocks.len() as u32,
            elems_per_block: op.per,
            tensor: op.input.into_outcome_tensor(),
            gen_id: self.gen_id,
            retransmissions: op.retransmissions,
            trimmed: op.trimmed,
            fast_retransmits: op.fast_retransmits,
            timeouts: op.timeouts,
            marked_results: op.marked_results,
            ecn_ce: op.ecn_ce,
            window: self.cc.window(),
            degraded_blocks: op.degraded,
            min_src_cnt: op.min_src_cnt,
            missed_blocks: op.missed,
            latency_mean: if op.latency_samples == 0 { Duration::ZERO } else { op.latency_sum / op.latency_samples },
            latency_max: op.latency_max,
            recoveries: op.recoveries,
        }));
    }

    /// The driver's report that the switch's host answered a datagram of
    /// this session with ICMP port unreachable: nothing listens on the
    /// switch's port (its process is gone, or not started yet). Reports
    /// that go on for `switch_gone_after` with nothing from the switch in
    /// between fail the session with [`SessionError::SwitchGone`]; a switch
    /// that comes back on its port within that time answers, and the
    /// session goes on as after any restart. While joining, `join_timeout`
    /// stands (a switch may start after its workers): a join that times
    /// out after such reports fails with `SwitchGone` instead of
    /// `SwitchUnreachable`.
    pub fn handle_port_unreachable(&mut self, now: Time) {
        match self.state {
            State::Failed(_) => return,
            State::Joining { .. } => {
                self.unreachable_since.get_or_insert(now);
                return;
            }
            State::Ready => {}
        }
        let waited = now.saturating_since(*self.unreachable_since.get_or_insert(now));
        if waited >= self.config.switch_gone_after {
            self.fail(SessionError::SwitchGone { waited });
        }
    }

    fn fail(&mut self, err: SessionError) {
        if matches!(self.state, State::Failed(_)) {
            return;
        }
        drop(self.end_op());
        self.state = State::Failed(err.clone());
        self.events.push_back(Event::Failed(err));
    }
}
