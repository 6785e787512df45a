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
//! return-to-sender). The block is queued for retransmission at once, and
//! the window is halved, at most once per round trip, so one burst of trims
//! counts as one congestion signal. Each window's worth of accepted results
//! then grows the window by one block again, up to the configured window
//! (AIMD, as TCP's congestion avoidance).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use fanin_wire::value::{
    incarnation_tag, read_elements, Dtype, JoinParams, Nack, NackReason, Packet, Repr, AGE_OP_AGED, EXP_NONE, JOIN_ROUND_START,
    JOIN_SYNC, JOIN_WAIT, MAX_GRAD_CNT, MEMBERSHIP_FAILED, MEMBERSHIP_MISMATCH, MEMBERSHIP_READMITTED, MEMBERSHIP_RESTARTED, MEMBERSHIP_SLOW,
};
use fanin_wire::MessageType;

use crate::auth::{open_and_accept, push_sealed, Key, LaneWindows, Refusal, Sealer};
use crate::bfp::{self, NonFinite};
use crate::job::shard_of;
use crate::time::Time;
use crate::transmit::Transmit;

mod lending;
mod recovery;

use crate::serial::BlockSpace;

use lending::{Input, Lent};
pub use lending::{TensorMut, TensorRef};
use recovery::{Kept, Recovery};

/// Worker-side parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionConfig {
    pub job_id: u32,
    /// This worker's source id (rank) in the job.
    pub src_id: u16,
    /// Elements per packet (Trio-ML `grad_cnt`; 1024 by default as in Trio).
    pub elems_per_packet: u16,
    /// Most blocks outstanding at once; clamped to the job's `block_cnt_max`.
    pub window: u32,
    /// Retransmission timeout before any round trip was measured.
    pub rto_initial: Duration,
    pub rto_min: Duration,
    pub rto_max: Duration,
    /// Give up joining after this long without an answer.
    pub join_timeout: Duration,
    /// Fail an allreduce when the switch has been silent this long.
    pub dead_after: Duration,
    /// Most datagrams one `poll_transmit` call writes, so receiving is never
    /// starved by sending.
    pub max_burst: usize,
    /// Bytes of results for *later* allreduces kept until they begin. A
    /// straggler that fell behind finds the partial results the switch
    /// pushed to every member while it was busy, instead of missing them.
    pub stash_bytes: usize,
    /// Join a job that is already running (SwitchML++ runtime scaling): ask
    /// the tree's root for the current block offset and start at the next
    /// allreduce from there, instead of at the stream's start.
    pub sync_join: bool,
    /// Blocks per allreduce of the job's stream (every member reduces the
    /// same tensor each step, so allreduce `k` covers blocks `[k*n, (k+1)*n)`
    /// and is generation `k + 1`). A syncing worker needs it to line up with
    /// the others; 0 = unknown (only valid without `sync_join`).
    pub align_blocks: u32,
    /// This worker's member key in a keyed job (docs/security.md): every
    /// datagram is sealed with it, and only datagrams the switch sealed
    /// with it are accepted. None: an unauthenticated job.
    pub auth_key: Option<Key>,
    /// Wall-clock microseconds at start: sequence numbers count up from
    /// here, so a restarted worker continues above what it sent before.
    pub seal_clock_us: u64,
    /// The runtime receives on the job's result group (multicast): every
    /// Join says so, and the switch sends completion results there instead
    /// of to this worker's own address (docs/protocol.md §4.5).
    pub listens_on_group: bool,
    /// This session's member incarnation (non-zero; docs/protocol.md
    /// §4.12), sent in every Join: the switch tells a new process of a rank
    /// from the old one's repeated Joins by it. The host library draws a
    /// random one per session; a machine built by hand must give each
    /// session of a rank its own. 0: take no part in rounds (answered as
    /// before rounds existed).
    pub incarnation: u16,
    /// How long to wait at the job's join barrier (the switch answered, but
    /// the round starts only once every member joined) before giving up.
    pub barrier_timeout: Duration,
    /// The members the caller expects the job to have (a process group's
    /// world size); 0 = any. A job of another size is refused at the first
    /// answer, instead of waiting at a barrier that can never fill.
    pub expected_members: u16,
}

impl SessionConfig {
    pub fn new(job_id: u32, src_id: u16) -> Self {
        Self {
            job_id,
            src_id,
            elems_per_packet: 1024,
            window: 256,
            rto_initial: Duration::from_millis(50),
            // 25 ms: a 2-core host (or a busy one) stalls for several ms
            // at a time; below that, stalls read as losses and resend.
            rto_min: Duration::from_millis(25),
            rto_max: Duration::from_millis(1000),
            join_timeout: Duration::from_secs(5),
            dead_after: Duration::from_secs(10),
            max_burst: 64,
            stash_bytes: 64 << 20,
            sync_join: false,
            align_blocks: 0,
            auth_key: None,
            seal_clock_us: 1,
            listens_on_group: false,
            incarnation: 1,
            barrier_timeout: Duration::from_secs(120),
            expected_members: 0,
        }
    }

    pub fn validate(&self) -> Result<(), SessionError> {
        let bad = |msg: String| Err(SessionError::Config(msg));
        if self.sync_join && self.align_blocks == 0 {
            return bad("sync_join needs align_blocks (the blocks of one allreduce) to line up with the running job".into());
        }
        if self.elems_per_packet == 0 || self.elems_per_packet as usize > MAX_GRAD_CNT {
            return bad(format!(
                "elems_per_packet {} is out of range (1..={MAX_GRAD_CNT}, the most one UDP datagram carries)",
                self.elems_per_packet
            ));
        }
        if self.window == 0 {
            return bad("window must be at least 1".into());
        }
        if self.rto_min > self.rto_max || self.rto_min.is_zero() {
            return bad(format!("rto_min {:?} must be non-zero and at most rto_max {:?}", self.rto_min, self.rto_max));
        }
        if self.max_burst == 0 {
            return bad("max_burst must be at least 1".into());
        }
        Ok(())
    }
}

/// Why a session or an allreduce failed. Messages say what to check.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionError {
    #[error("invalid session configuration: {0}")]
    Config(String),
    #[error(
        "no answer from the switch within {0:?}: is `fanin switch` running at that address, is the job admitted, \
         and, if the job is keyed (the controller's default), does this worker have its member key (auth_key)? \
         A keyed job drops unsealed datagrams without an answer"
    )]
    SwitchUnreachable(Duration),
    #[error("the switch has been silent for {waited:?} with {outstanding} blocks outstanding; giving up")]
    SwitchSilent { waited: Duration, outstanding: usize },
    #[error("the switch refused job {job_id}: {} (detail {detail})", reason.describe())]
    Refused { job_id: u32, reason: NackReason, detail: u32 },
    #[error("job {job_id} failed: worker rank {rank} stopped sending (silent past the job's member timeout) and the job's failure policy is `fail`; re-create the job to start again")]
    MemberFailed { job_id: u32, rank: u16 },
    #[error("the job's block_grad_max is {cap} elements but this worker sends {requested} per packet; lower elems_per_packet")]
    PacketTooLarge { requested: u16, cap: u32 },
    #[error(transparent)]
    NonFinite(#[from] NonFinite),
    #[error("the session is not ready: {0}")]
    NotReady(&'static str),
    #[error("the switch restarted (or lost job {job_id}) and recovery did not finish within {waited:?}: not every member of the job rejoined (a member stopped calling allreduce or died), or the job was not re-admitted to the restarted switch")]
    RecoveryStalled { job_id: u32, waited: Duration },
    #[error("job {job_id} came back from the switch restart with other parameters ({what}); the running stream cannot continue")]
    JobChanged { job_id: u32, what: String },
    #[error(
        "job {job_id}: rank {rank} joined again as a new process while this round ran, so this round's allreduces cannot \
         complete with its old contributions; start a new session on every rank (under torchrun: let the group restart)"
    )]
    MemberRestarted { job_id: u32, rank: u16 },
    #[error(
        "interrupted (Ctrl-C); this session cannot continue, since the job's other ranks wait for its contribution: \
         start a new session on every rank"
    )]
    Interrupted,
    #[error(
        "job {job_id}: the ranks disagree on this allreduce's length (rank {rank}'s blocks do not line up with the \
         others': another element count, or another tensor); every rank of the job raises this. Give every rank the \
         same tensor sizes in the same order, then start new sessions"
    )]
    LengthMismatch { job_id: u32, rank: u16 },
    #[error("job {job_id} on the switch has {members} members but {expected} ranks join it; admit it with sources={expected}")]
    MemberCount { job_id: u32, members: u16, expected: u16 },
    #[error(
        "job {job_id}: waited {waited:?} at the join barrier and only {joined} of the job's {members} members joined; \
         start every rank of the job (a round begins when all have joined)"
    )]
    JoinBarrier { job_id: u32, joined: u32, members: u16, waited: Duration },
    #[error(
        "job {job_id}: the switch no longer holds the result of block {block_id} (this worker fell more than a window \
         behind the job, or the block belongs to another round); the job does not accept partial results, so this \
         allreduce has no correct answer"
    )]
    MissedBlocks { job_id: u32, block_id: u32 },
    #[error(
        "job {job_id}: block {block_id} completed with {src_cnt} of {members} sources (a member was declared slow or \
         dead); the job did not opt into partial results (block_exp_ms, on_failure=degrade), so this is an error"
    )]
    PartialResult { job_id: u32, block_id: u32, src_cnt: u16, members: u16 },
}

/// A tensor to reduce, owned by the session while the allreduce runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Tensor {
    I32(Vec<i32>),
    F32(Vec<f32>),
}

impl Tensor {
    pub fn len(&self) -> usize {
        match self {
            Tensor::I32(v) => v.len(),
            Tensor::F32(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> Dtype {
        self.view().dtype()
    }
}

/// A tensor with the local exponent of each of its blocks computed (float32
/// block floating point), ready for [`AllreduceSession::begin_prepared`].
/// It owns the tensor, or borrows it ([`borrow`](Self::borrow)) for
/// [`AllreduceSession::begin_into`].
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared<'a> {
    input: PreparedInput<'a>,
    local_exp: Vec<i8>,
    /// The block size the exponents were computed for.
    per: usize,
}

#[derive(Debug, Clone, PartialEq)]
enum PreparedInput<'a> {
    Owned(Tensor),
    Borrowed(TensorRef<'a>),
}

impl PreparedInput<'_> {
    fn view(&self) -> TensorRef<'_> {
        match self {
            PreparedInput::Owned(t) => t.view(),
            PreparedInput::Borrowed(v) => *v,
        }
    }
}

impl Prepared<'static> {
    /// The exponents of `tensor`'s blocks of `per` elements (none for int32).
    /// A value block floating point cannot carry is refused with its index
    /// in the tensor.
    pub fn new(tensor: Tensor, per: usize) -> Result<Self, NonFinite> {
        let per = per.max(1);
        let local_exp = exponents_of(tensor.view(), per)?;
        Ok(Prepared { input: PreparedInput::Owned(tensor), local_exp, per })
    }

    /// Copy `values` into `buf` (reusing its memory) a block at a time,
    /// taking each block's exponent while the block is in cache: one pass
    /// over a large input instead of a copy and then a second read.
    pub fn copy_f32(values: &[f32], per: usize, mut buf: Vec<f32>) -> Result<Self, NonFinite> {
        let per = per.max(1);
        buf.clear();
        buf.reserve(values.len());
        let mut local_exp = Vec::with_capacity(values.len().div_ceil(per));
        for chunk in values.chunks(per) {
            let start = buf.len();
            buf.extend_from_slice(chunk);
            local_exp.push(block_exponent_at(&buf[start..], start)?);
        }
        Ok(Prepared { input: PreparedInput::Owned(Tensor::F32(buf)), local_exp, per })
    }
}

impl<'a> Prepared<'a> {
    /// Prepare `input` without copying it, for [`AllreduceSession::begin_into`]
    /// (an output other than the input itself): the session then reads each
    /// block from `input` as it goes out, and again only if a switch restart
    /// needs a retained contribution. One read-only pass takes the
    /// exponents, so a refused value is still refused before anything is
    /// sent.
    pub fn borrow(input: TensorRef<'a>, per: usize) -> Result<Self, NonFinite> {
        let per = per.max(1);
        let local_exp = exponents_of(input, per)?;
        Ok(Prepared { input: PreparedInput::Borrowed(input), local_exp, per })
    }

    pub fn len(&self) -> usize {
        self.input.view().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same tensor prepared for blocks of `per` elements.
    fn for_block_size(self, per: usize) -> Result<Self, NonFinite> {
        let per = per.max(1);
        if self.per == per {
            return Ok(self);
        }
        let local_exp = exponents_of(self.input.view(), per)?;
        Ok(Prepared { local_exp, per, ..self })
    }
}

/// The block exponents of `input` in blocks of `per` (none for int32).
fn exponents_of(input: TensorRef<'_>, per: usize) -> Result<Vec<i8>, NonFinite> {
    match input {
        TensorRef::F32(values) => block_exponents(values.chunks(per)),
        TensorRef::I32(_) => Ok(Vec::new()),
    }
}

/// Each block's exponent, in order.
fn block_exponents<'a>(blocks: impl Iterator<Item = &'a [f32]>) -> Result<Vec<i8>, NonFinite> {
    let mut offset = 0;
    blocks
        .map(|block| {
            let e = block_exponent_at(block, offset);
            offset += block.len();
            e
        })
        .collect()
}

/// The exponent of the block starting at element `offset`; a refused value
/// is reported with its index in the whole tensor, not in its block.
fn block_exponent_at(block: &[f32], offset: usize) -> Result<i8, NonFinite> {
    bfp::block_exponent(block).map_err(|e| NonFinite { index: offset + e.index, ..e })
}

/// A finished allreduce.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The reduced tensor (sum over the sources each block reports); after
    /// [`AllreduceSession::begin_into`], which wrote the sum into the
    /// caller's buffer, the input handed back unchanged (to reuse its memory).
    pub tensor: Tensor,
    pub gen_id: u16,
    pub blocks: u32,
    /// Contributions this worker sent again (after a timeout, fast
    /// retransmit or a trim).
    pub retransmissions: u64,
    /// Trimmed nacks that made this worker resend a block (each counted once;
    /// stale or duplicate trims are ignored).
    pub trimmed: u64,
    /// Blocks whose result summed fewer sources than the job has:
    /// (block index within the tensor, `src_cnt`).
    pub degraded_blocks: Vec<(u32, u16)>,
    /// Smallest `src_cnt` over all blocks (the job size if none degraded).
    pub min_src_cnt: u16,
    /// Blocks whose result the switch no longer held when this worker asked
    /// (it straggled behind the job): their elements are zero, reported in
    /// `degraded_blocks` with `src_cnt` 0.
    pub missed_blocks: u32,
    /// From a block's first transmission to its result, over the blocks
    /// this worker sent (mean and maximum).
    pub latency_mean: Duration,
    pub latency_max: Duration,
    /// Switch restarts this allreduce recovered from (docs/restart.md).
    pub recoveries: u32,
}

impl Outcome {
    /// Sources summed in block `idx` of the tensor.
    pub fn src_cnt_of(&self, idx: u32, n_sources: u16) -> u16 {
        // degraded_blocks is sorted by completion, not index: search it all
        self.degraded_blocks.iter().find(|(b, _)| *b == idx).map_or(n_sources, |(_, c)| *c)
    }

    /// Turn the sum into a mean: each block is divided by the number of
    /// sources its result summed (`src_cnt`), not by the job size, so a
    /// partial result averages the contributions it has. Blocks that summed
    /// no source stay zero. Float tensors only.
    pub fn average(&mut self, elems_per_packet: usize, n_sources: u16) -> Result<(), SessionError> {
        let Tensor::F32(values) = &mut self.tensor else {
            return Err(SessionError::Config("averaging needs a float tensor".into()));
        };
        average_blocks(values, &self.degraded_blocks, elems_per_packet, n_sources);
        Ok(())
    }

    /// [`average`](Self::average) of a sum written into the caller's buffer
    /// ([`AllreduceSession::begin_into`]).
    pub fn average_into(&self, values: &mut [f32], elems_per_packet: usize, n_sources: u16) {
        average_blocks(values, &self.degraded_blocks, elems_per_packet, n_sources);
    }
}

/// Divide each block of `values` by the sources its result summed.
fn average_blocks(values: &mut [f32], degraded_blocks: &[(u32, u16)], elems_per_packet: usize, n_sources: u16) {
    let scale = 1.0 / n_sources.max(1) as f32;
    values.iter_mut().for_each(|v| *v *= scale);
    for &(idx, cnt) in degraded_blocks {
        let start = idx as usize * elems_per_packet;
        let end = (start + elems_per_packet).min(values.len());
        // undo the job-size division, apply the block's own
        let fix = if cnt == 0 { 0.0 } else { n_sources as f32 / cnt as f32 };
        values[start..end].iter_mut().for_each(|v| *v *= fix);
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The switch accepted this worker; `begin` may be called.
    Joined(JoinParams),
    /// The switch declared `source` permanently slow (`slow`) or re-admitted
    /// it; blocks now wait for `waiting_for` sources.
    Membership { source: u16, slow: bool, waiting_for: u16 },
    Completed(Outcome),
    Failed(SessionError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockPhase {
    Unsent,
    /// Exponent-only contribution sent, waiting for the negotiated exponent.
    ExpSent,
    /// Exponent known; the data contribution is queued.
    DataQueued,
    DataSent,
    Done,
}

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

#[derive(Debug, Clone, Copy)]
struct BlockState {
    phase: BlockPhase,
    /// Negotiated (or announced-ahead) shared exponent; EXP_NONE = unknown.
    exp: i8,
    /// Transmissions of the current phase beyond the first.
    attempt: u32,
    /// Last transmission.
    sent_at: Time,
    /// Results seen for later blocks of the same shard while this one waits.
    later_results: u8,
    /// Queued for retransmission and not yet sent again.
    queued: bool,
    /// Order of the last transmission among all of this session's sends.
    send_seq: u64,
    /// First transmission (for the latency statistics).
    first_sent: Option<Time>,
}

struct Op {
    /// The input; the results overwrite it unless an output was lent (a
    /// lent input always comes with a lent output).
    input: Input,
    /// The caller's output buffer (`begin_into`): results go there and the
    /// input stays intact.
    lent: Option<Lent>,
    /// Block id of the tensor's first block.
    base_block: u32,
    /// The job's block ids (they wrap at a multiple of `block_cnt_max`).
    space: BlockSpace,
    blocks: Vec<BlockState>,
    /// This worker's own exponent per block (float tensors).
    local_exp: Vec<i8>,
    /// Lowest block index without a result.
    low: u32,
    /// Next block index never sent.
    next_new: u32,
    done: u32,
    /// Blocks at or beyond `next_new` that are done already (a straggler
    /// finds results the switch pushed to it before it sent anything).
    done_ahead: u32,
    missed: u32,
    latency_sum: Duration,
    latency_max: Duration,
    latency_samples: u32,
    ready: VecDeque<u32>,
    retransmit: VecDeque<u32>,
    /// Last time a result (data or exponent) arrived for this allreduce.
    last_progress: Time,
    /// Consecutive stall timeouts without progress.
    backoff: u32,
    /// Transmissions so far (orders blocks for fast retransmit).
    send_seq: u64,
    retransmissions: u64,
    trimmed: u64,
    degraded: Vec<(u32, u16)>,
    min_src_cnt: u16,
    recoveries: u32,
    /// Next probe join while the switch is silent (see `PROBE_INTERVAL`).
    next_probe: Time,
}

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
    /// Number of sources in the job (block floating point scales for it).
    n_sources: u16,
    /// Next block id of the job's stream.
    next_block: u32,
    gen_id: u16,
    op: Option<Op>,
    /// Current window (blocks outstanding): shrunk by trims, regrown by
    /// results, never above `window_max`.
    window: u32,
    /// The configured window clamped to the job's `block_cnt_max`.
    window_max: u32,
    /// Results since the window last grew (additive increase).
    window_credit: u32,
    /// When a trim last halved the window (one decrease per round trip).
    last_decrease: Option<Time>,
    last_heard: Time,
    srtt: Option<Duration>,
    rttvar: Duration,
    events: VecDeque<Event>,
    /// Join must be (re)sent at the next poll_transmit.
    join_due: bool,
    /// Sources the switch told us it declared permanently slow.
    slow_sources: Vec<u16>,
    /// Results of later generations (header, body), oldest first.
    stash: VecDeque<(Repr, Vec<u8>)>,
    stash_len: usize,
    /// Keyed job: seals what this worker sends.
    sealer: Option<Sealer>,
    /// Keyed job: replay windows over the switch shards' sequence numbers.
    windows: LaneWindows,
    auth_stats: AuthStats,
    /// The data contribution of every recent block that has its result, by
    /// block id: the blocks at most `block_cnt_max` behind the lowest block
    /// without one, which a peer may still lack. After a switch restart they
    /// are sent again so the new incarnation can recompute those blocks
    /// (docs/restart.md).
    retained: BTreeMap<u32, Kept>,
    /// Buffers of pruned retained contributions, reused.
    spare: Vec<Vec<u8>>,
    /// First data transmissions of the blocks in flight, to be retained.
    captured: recovery::Captured,
    /// Set while recovering from a switch restart.
    recovery: Option<Recovery>,
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
}

impl AllreduceSession {
    pub fn new(config: SessionConfig, now: Time) -> Self {
        let state = match config.validate() {
            Ok(()) => State::Joining { started: now, next_send: now, interval: Duration::from_millis(50), barrier: None },
            Err(e) => State::Failed(e),
        };
        let mut session = Self {
            window: config.window,
            window_max: config.window,
            window_credit: 0,
            last_decrease: None,
            config,
            state,
            params: None,
            n_sources: 1,
            next_block: 0,
            gen_id: 0,
            op: None,
            last_heard: now,
            srtt: None,
            rttvar: Duration::ZERO,
            events: VecDeque::new(),
            join_due: true,
            slow_sources: Vec::new(),
            stash: VecDeque::new(),
            stash_len: 0,
            sealer: None,
            windows: LaneWindows::default(),
            auth_stats: AuthStats::default(),
            retained: BTreeMap::new(),
            spare: Vec::new(),
            captured: recovery::Captured::default(),
            recovery: None,
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
        self.window
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

    /// Start an allreduce of `tensor`. The result comes as `Event::Completed`.
    pub fn begin(&mut self, now: Time, tensor: Tensor) -> Result<(), SessionError> {
        self.check_ready()?;
        let prepared = Prepared::new(tensor, self.config.elems_per_packet as usize)?;
        self.begin_prepared(now, prepared)
    }

    /// Start an allreduce of a tensor whose exponents are already known
    /// (prepared for another block size, they are computed again).
    /// A borrowed input is copied first: the results overwrite the input
    /// the session owns.
    pub fn begin_prepared(&mut self, now: Time, prepared: Prepared<'_>) -> Result<(), SessionError> {
        self.check_ready()?;
        let Prepared { input, local_exp, per } = prepared;
        let tensor = match input {
            PreparedInput::Owned(t) => t,
            PreparedInput::Borrowed(v) => v.to_owned(),
        };
        self.begin_op(now, Prepared { input: PreparedInput::Owned(tensor), local_exp, per }, None)
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
        self.begin_op(now, prepared, Some(lent))
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
    fn begin_op(&mut self, now: Time, prepared: Prepared<'_>, lent: Option<Lent>) -> Result<(), SessionError> {
        self.check_ready()?;
        let per = self.config.elems_per_packet as usize;
        let Prepared { input, local_exp, .. } = prepared.for_block_size(per)?;
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
            degraded: Vec::new(),
            min_src_cnt: self.n_sources,
            recoveries: 0,
            next_probe: now,
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
                let Some(op) = self.op.as_ref() else { return recovery };
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
                let Some(op) = self.op.as_ref() else { return };
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
                                op.retransmit.push_back(idx);
                            }
                            if resent.iter().all(|r| *r) {
                                break;
                            }
                        }
                    }
                    op.backoff = (op.backoff + 1).min(6);
                    op.last_progress = now;
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
                        None => (self.probe_request(), None),
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
                sent + self.transmit_blocks(now, out)
            }
        }
    }

    fn transmit_blocks(&mut self, now: Time, out: &mut impl Transmit<u16>) -> usize {
        let Some(params) = self.params else { return 0 };
        let Some(op) = self.op.as_mut() else { return 0 };
        let mut sent = 0;
        let budget = self.config.max_burst;
        // After a switch restart: no block opens a slot before the block one
        // slot-cycle earlier has its new result (docs/restart.md).
        let gate = self.recovery.as_ref().and_then(|r| r.gate(Some(&*op), params.block_cnt_max));
        while sent < budget {
            if let Some(gate) = gate {
                let front = op.retransmit.front().or(op.ready.front()).copied().unwrap_or(op.next_new);
                if op.block_id(front) >= gate {
                    break;
                }
            }
            let (idx, retransmission) = if let Some(i) = op.retransmit.pop_front() {
                (i, true)
            } else if let Some(i) = op.ready.pop_front() {
                (i, false)
            } else if op.next_new < op.blocks.len() as u32 && op.next_new < op.low + self.window {
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
                    push_sealed(out, shard, bytes.len(), seal.as_ref().map(|(k, q)| (k, *q)), |b| b.copy_from_slice(bytes));
                }
                None => emit_block(config, &params, n_sources, gen_id, op, idx, exp_only, retransmission, seal, out),
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

    pub fn handle_datagram(&mut self, now: Time, bytes: &[u8]) {
        // Keyed job: only what the switch sealed with this worker's key,
        // once; checked before anything else is looked at.
        let bytes = match &self.config.auth_key {
            Some(key) => match open_and_accept(key, &mut self.windows, bytes) {
                Ok(inner) => inner,
                Err(Refusal::Replay(_)) => {
                    self.auth_stats.replayed += 1;
                    return;
                }
                Err(Refusal::Auth(fanin_wire::auth::AuthError::Unsealed)) => {
                    self.auth_stats.unsealed += 1;
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
        let Ok(packet) = Packet::new_checked(bytes) else { return };
        if packet.job_id() != self.config.job_id {
            return;
        }
        let Ok(repr) = Repr::parse(&packet) else { return };
        match repr.msg_type {
            MessageType::JoinAck => self.on_join_ack(now, &repr, packet.payload()),
            MessageType::Nack => {
                if let Ok(nack) = Nack::parse(packet.payload()) {
                    let tag = Nack::tag_of(bytes);
                    if nack.reason == NackReason::StaleIncarnation {
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
                    // next round: notices of the last one are not for it.)
                    if matches!(self.state, State::Ready) {
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

    /// The job's block ids (known once joined: they wrap at a multiple of
    /// its `block_cnt_max`, crate::serial).
    fn block_space(&self) -> BlockSpace {
        BlockSpace::new(self.params.map_or(1, |p| p.block_cnt_max))
    }

    /// How long joining may take: `join_timeout` until the switch answers
    /// at all, `barrier_timeout` once it said the job's barrier holds us.
    fn join_deadline(&self, barrier: Option<u32>) -> Duration {
        match barrier {
            None => self.config.join_timeout,
            Some(_) => self.config.barrier_timeout.max(self.config.join_timeout),
        }
    }

    fn on_join_ack(&mut self, now: Time, repr: &Repr, body: &[u8]) {
        let Ok(params) = JoinParams::parse(body) else { return };
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
        self.params = Some(params);
        self.n_sources = repr.src_cnt.max(1);
        self.next_block = params.next_block;
        if self.config.sync_join && repr.age_op != JOIN_ROUND_START {
            // The switch answered an allreduce boundary of the running round
            // (counted from the round's first block, which this worker cannot
            // know) and the generation of the allreduce before it; begin()
            // moves to the next, the one the others use at that block.
            self.gen_id = repr.gen_id;
        }
        self.window_max = self.config.window.min(params.block_cnt_max).max(1);
        self.window = self.window_max;
        self.last_heard = now;
        self.state = State::Ready;
        self.events.push_back(Event::Joined(params));
    }

    /// Keep a result of a later allreduce (bounded by `stash_bytes`).
    fn stash_result(&mut self, repr: &Repr, payload: &[u8]) {
        if self.stash_len + payload.len() > self.config.stash_bytes {
            return;
        }
        self.stash_len += payload.len();
        self.stash.push_back((*repr, payload.to_vec()));
    }

    fn on_result(&mut self, now: Time, repr: &Repr, payload: &[u8]) {
        // A later generation: the job is ahead of this worker (it straggled).
        let ahead = repr.gen_id.wrapping_sub(self.gen_id);
        if (1..=STASH_GENERATIONS).contains(&ahead) {
            self.stash_result(repr, payload);
            return;
        }
        // (none: a result of an earlier allreduce, duplicated by the network)
        let Some(idx) = self.block_index(repr) else { return };
        let (Some(params), Some(op)) = (self.params, self.op.as_mut()) else { return };
        let per = self.config.elems_per_packet as usize;
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
        let useful = if repr.exp_only {
            phase == BlockPhase::ExpSent
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
        if repr.age_op != AGE_OP_AGED {
            note_later_result(op, idx, &params, self.config.job_id);
        }
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
        self.retained.insert(repr.block_id, kept);
        let Some(op) = self.op.as_mut() else { return };
        match op.output_block(start, count) {
            TensorMut::I32(v) => read_elements(payload, v),
            TensorMut::F32(v) => bfp::dequantize_from_payload(payload, repr.exp, self.n_sources as usize, v),
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
        // Additive increase: one block more per window of results.
        if self.window < self.window_max {
            self.window_credit += 1;
            if self.window_credit >= self.window {
                self.window += 1;
                self.window_credit = 0;
            }
        }
        let all_done = op.record_done(idx, repr.src_cnt, repr.degraded || repr.src_cnt < self.n_sources);
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
    fn on_expired(&mut self, now: Time, repr: &Repr) {
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
                self.retained.insert(repr.block_id, Kept::Bytes(buf));
            }
        }
        let Some(op) = self.op.as_mut() else { return };
        let per = self.config.elems_per_packet as usize;
        let start = idx as usize * per;
        let count = (op.input.view().len() - start).min(per);
        match op.output_block(start, count) {
            TensorMut::I32(v) => v.fill(0),
            TensorMut::F32(v) => v.fill(0.0),
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
    fn on_trimmed(&mut self, now: Time, repr: &Repr) {
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
        if self.last_decrease.is_none_or(|t| now.saturating_since(t) >= round_trip) {
            self.window = (self.window / 2).max(1);
            self.window_credit = 0;
            self.last_decrease = Some(now);
        }
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
            tensor: op.input.into_outcome_tensor(),
            gen_id: self.gen_id,
            retransmissions: op.retransmissions,
            trimmed: op.trimmed,
            degraded_blocks: op.degraded,
            min_src_cnt: op.min_src_cnt,
            missed_blocks: op.missed,
            latency_mean: if op.latency_samples == 0 { Duration::ZERO } else { op.latency_sum / op.latency_samples },
            latency_max: op.latency_max,
            recoveries: op.recoveries,
        }));
    }

    fn fail(&mut self, err: SessionError) {
        if matches!(self.state, State::Failed(_)) {
            return;
        }
        drop(self.end_op());
        self.state = State::Failed(err.clone());
        self.events.push_back(Event::Failed(err));
    }

    /// A join while bound to the switch: a probe for its incarnation
    /// (docs/restart.md). Always a plain join, even for a worker that
    /// joined with sync: a restarted switch defers sync joins on its fresh
    /// job until an active member opens the stream, so a sync probe from
    /// every member would never be answered and nobody would learn of the
    /// restart (the 10-minute chaos soak hit exactly that).
    fn probe_request(&self) -> Repr {
        self.join_repr()
    }

    fn join_request(&self) -> Repr {
        Repr {
            age_op: if self.config.sync_join { JOIN_SYNC } else { 0 },
            // the root answers an allreduce boundary of this many blocks
            block_id: if self.config.sync_join { self.config.align_blocks } else { 0 },
            ..self.join_repr()
        }
    }

    /// What every Join of this worker carries (plain, sync, probe,
    /// recovery): each one tells the switch afresh whether it listens on
    /// the result group (the `final` bit, which a Join has no other use for).
    fn join_repr(&self) -> Repr {
        Repr {
            gen_id: self.gen_id,
            src_cnt: self.config.incarnation,
            final_block: self.config.listens_on_group,
            ..Repr::new(MessageType::Join, self.config.job_id, self.config.src_id)
        }
    }
}

impl Op {
    /// The stream id of tensor block `idx`.
    fn block_id(&self, idx: u32) -> u32 {
        self.space.add(self.base_block, idx)
    }
    /// Block `idx` has its result (summing `src_cnt` sources; `degraded`
    /// when fewer than the job has). Returns true when every block has one.
    fn record_done(&mut self, idx: u32, src_cnt: u16, degraded: bool) -> bool {
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
    fn output_block(&mut self, start: usize, count: usize) -> TensorMut<'_> {
        match &mut self.lent {
            Some(lent) => lent.block(start, count),
            None => match &mut self.input {
                Input::Owned(tensor) => lending::tensor_block(tensor, start, count),
                Input::Lent(_) => unreachable!("a lent input always comes with a lent output"),
            },
        }
    }

    /// Blocks sent (at least once) whose result has not arrived.
    fn outstanding(&self) -> u32 {
        self.next_new - (self.done - self.done_ahead)
    }
}

/// A result for block `idx` arrived: earlier blocks of the same shard still
/// waiting have now been overtaken once more; at [`DUP_THRESH`] they are
/// presumed lost and queued for a fast retransmission.
fn note_later_result(op: &mut Op, idx: u32, params: &JoinParams, job_id: u32) {
    let seq = op.blocks[idx as usize].send_seq;
    if params.shard_count > 1 {
        let shard = shard_of(job_id, op.block_id(idx), params.block_cnt_max, params.shard_count);
        for j in op.low..idx {
            let same = shard_of(job_id, op.block_id(j), params.block_cnt_max, params.shard_count) == shard;
            if same {
                overtaken(op, j, seq);
            }
        }
    } else {
        for j in op.low..idx {
            overtaken(op, j, seq);
        }
    }
}

/// Block `j` was overtaken if the answered transmission left after `j`'s.
fn overtaken(op: &mut Op, j: u32, answered_seq: u64) {
    let b = &mut op.blocks[j as usize];
    if b.send_seq >= answered_seq {
        return;
    }
    let waiting = matches!(b.phase, BlockPhase::ExpSent | BlockPhase::DataSent);
    if !waiting || b.queued {
        return;
    }
    b.later_results = b.later_results.saturating_add(1);
    if b.later_results >= DUP_THRESH {
        // Also after a retransmission: a lost retransmission is found the
        // same way, one round trip later, instead of by the stall timer.
        b.queued = true;
        op.retransmit.push_back(j);
    }
}

/// Write one contribution (data or exponent-only) for block `idx`.
#[allow(clippy::too_many_arguments)]
fn emit_block(
    config: &SessionConfig,
    params: &JoinParams,
    n_sources: u16,
    gen_id: u16,
    op: &Op,
    idx: u32,
    exp_only: bool,
    retransmission: bool,
    sealer: Option<&mut Sealer>,
    out: &mut impl Transmit<u16>,
) {
    let per = config.elems_per_packet as usize;
    let start = idx as usize * per;
    let count = (op.input.view().len() - start).min(per);
    let block_id = op.block_id(idx);
    let state = &op.blocks[idx as usize];
    let ahead = idx as usize + params.block_cnt_max as usize;
    let input = op.input.view();
    let (exp, next_exp) = match input {
        TensorRef::I32(_) => (EXP_NONE, EXP_NONE),
        TensorRef::F32(_) if exp_only => (op.local_exp[idx as usize], EXP_NONE),
        TensorRef::F32(_) => (state.exp, op.local_exp.get(ahead).copied().unwrap_or(EXP_NONE)),
    };
    let repr = Repr {
        msg_type: if retransmission { MessageType::Retransmission } else { MessageType::Contribution },
        age_op: 0,
        final_block: idx as usize + 1 == op.blocks.len(),
        degraded: false,
        exp_only,
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
        match input {
            TensorRef::I32(v) => fanin_wire::value::write_elements(&v[start..start + count], packet.payload_mut()),
            TensorRef::F32(v) => {
                bfp::quantize_into_payload(&v[start..start + count], exp, n_sources as usize, packet.payload_mut())
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::JobSpec;
    use crate::switch::{ShardConfig, ValueSwitch};
    use crate::transmit::VecTransmit;

    /// One worker, one switch shard, datagrams moved by hand.
    fn joined(window: u32) -> (AllreduceSession, ValueSwitch<u16>) {
        let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
        sw.add_job(JobSpec::with_sources(1, 1, 16, 64)).unwrap();
        let mut cfg = SessionConfig::new(1, 0);
        cfg.elems_per_packet = 4;
        cfg.window = window;
        let mut s = AllreduceSession::new(cfg, Time::ZERO);
        let mut out = VecTransmit::new();
        s.poll_transmit(Time::ZERO, &mut out);
        for (_, join) in out.drain() {
            let mut reply = VecTransmit::new();
            let _ = sw.handle_datagram(Time::ZERO, 0, &join, &mut reply);
            for (_, b) in reply.drain() {
                s.handle_datagram(Time::ZERO, &b);
            }
        }
        assert!(matches!(s.poll_event(), Some(Event::Joined(_))));
        (s, sw)
    }

    #[test]
    fn a_worker_that_joined_with_sync_probes_with_a_plain_join() {
        let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
        sw.add_job(JobSpec::with_sources(1, 1, 16, 64)).unwrap();
        let mut cfg = SessionConfig::new(1, 0);
        cfg.elems_per_packet = 4;
        cfg.sync_join = true;
        cfg.align_blocks = 2;
        let mut s = AllreduceSession::new(cfg, Time::ZERO);
        let mut out = VecTransmit::new();
        s.poll_transmit(Time::ZERO, &mut out);
        let joins: Vec<_> = out.drain().collect();
        assert_eq!(Packet::new_checked(&joins[0].1[..]).unwrap().age_op(), JOIN_SYNC);
        deliver(&mut s, &mut sw, Time::ZERO, joins);
        assert!(matches!(s.poll_event(), Some(Event::Joined(_))));
        // The switch goes silent: everything sent is lost.
        s.begin(Time::ZERO, Tensor::I32(vec![1; 8])).unwrap();
        let mut now = Time::ZERO;
        let mut probe = None;
        while probe.is_none() && now < Time::from_nanos(30_000_000_000) {
            now = s.poll_timeout().unwrap();
            s.handle_timeout(now);
            s.poll_transmit(now, &mut out);
            probe = out.drain().map(|(_, b)| b).find(|b| {
                Packet::new_checked(&b[..]).is_ok_and(|p| p.msg_type_code() == MessageType::Join as u8)
            });
        }
        let probe = probe.expect("a probe after three stall timeouts");
        assert_eq!(Packet::new_checked(&probe[..]).unwrap().age_op(), 0, "a plain join, not a sync join");
    }

    fn deliver(s: &mut AllreduceSession, sw: &mut ValueSwitch<u16>, now: Time, datagrams: Vec<(u16, Vec<u8>)>) {
        for (_, bytes) in datagrams {
            let mut reply = VecTransmit::new();
            let _ = sw.handle_datagram(now, 0, &bytes, &mut reply);
            for (_, b) in reply.drain() {
                s.handle_datagram(now, &b);
            }
        }
    }

    /// Two workers listening on the job's result group and one not: results
    /// reach the listeners through the group datagram, the other by
    /// unicast, and all three get the same sum.
    #[test]
    fn workers_listening_on_the_group_get_their_results_from_it() {
        let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
        let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
        sw.add_job(JobSpec { result_group: Some(group), ..JobSpec::with_sources(1, 3, 16, 64) }).unwrap();
        let mut workers: Vec<AllreduceSession> = (0..3u16)
            .map(|src| {
                let mut cfg = SessionConfig::new(1, src);
                cfg.elems_per_packet = 4;
                cfg.listens_on_group = src != 1;
                AllreduceSession::new(cfg, Time::ZERO)
            })
            .collect();
        let now = Time::ZERO;
        // worker address = source id; a datagram to the group reaches the listeners
        let pump = |workers: &mut Vec<AllreduceSession>, sw: &mut ValueSwitch<u16>| {
            let mut moved = 0;
            for src in 0..3u16 {
                let mut out = VecTransmit::new();
                while workers[src as usize].poll_transmit(now, &mut out) > 0 {}
                for (_, bytes) in out.drain() {
                    if src == 0 {
                        // every Join of a listener says so
                        let p = Packet::new_checked(&bytes[..]).unwrap();
                        if p.msg_type_code() == MessageType::Join as u8 {
                            assert!(p.listens_on_group());
                        }
                    }
                    let mut reply = VecTransmit::new();
                    reply.groups_reachable = true;
                    let _ = sw.handle_datagram(now, src, &bytes, &mut reply);
                    for (to, b) in reply.drain() {
                        workers[to as usize].handle_datagram(now, &b);
                        moved += 1;
                    }
                    for (_, b) in reply.group_datagrams.drain(..) {
                        for w in [0, 2] {
                            workers[w].handle_datagram(now, &b);
                        }
                        moved += 1;
                    }
                }
            }
            moved
        };
        while pump(&mut workers, &mut sw) > 0 {}
        for (src, w) in workers.iter_mut().enumerate() {
            match w.poll_event() {
                Some(Event::Joined(p)) => assert_eq!(p.results_on_group, src != 1, "worker {src}"),
                other => panic!("worker {src}: {other:?}"),
            }
            w.begin(now, Tensor::I32((0..10).map(|i| i * (src as i32 + 1)).collect())).unwrap();
        }
        while pump(&mut workers, &mut sw) > 0 {}
        let want: Vec<i32> = (0..10).map(|i| i * 6).collect();
        for (src, w) in workers.iter_mut().enumerate() {
            match w.poll_event() {
                Some(Event::Completed(o)) => assert_eq!(o.tensor, Tensor::I32(want.clone()), "worker {src}"),
                other => panic!("worker {src}: {other:?}"),
            }
        }
        let c = sw.counters();
        assert_eq!((c.results_to_group, c.results_sent), (3, 3), "3 blocks: one group datagram and one unicast each");
    }

    #[test]
    fn a_lost_contribution_is_resent_after_three_later_results_without_waiting_for_a_timeout() {
        let (mut s, mut sw) = joined(8);
        let now = Time::from_nanos(1_000);
        s.begin(now, Tensor::I32((0..20).collect())).unwrap();
        let mut out = VecTransmit::new();
        while s.poll_transmit(now, &mut out) > 0 {}
        let mut sent: Vec<_> = out.drain().collect();
        assert_eq!(sent.len(), 5, "20 elements / 4 per packet");
        sent.remove(0); // block 0's contribution is lost
        deliver(&mut s, &mut sw, now, sent);
        // results of blocks 1..4 overtook block 0: it goes out again at once
        let mut out = VecTransmit::new();
        s.poll_transmit(now, &mut out);
        let resent: Vec<_> = out.drain().collect();
        assert_eq!(resent.len(), 1);
        let p = Packet::new_checked(&resent[0].1[..]).unwrap();
        assert_eq!((p.msg_type_code(), p.block_id()), (MessageType::Retransmission as u8, 0));
        deliver(&mut s, &mut sw, now, resent);
        match s.poll_event() {
            Some(Event::Completed(o)) => {
                assert_eq!(o.tensor, Tensor::I32((0..20).collect()));
                assert_eq!(o.retransmissions, 1);
            }
            other => panic!("{other:?}"),
        }
    }

    /// How a test's allreduce holds its tensors.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Lending {
        /// The session owns the input; results overwrite it.
        Nothing,
        /// Results go to a lent output; the session owns the input.
        Output,
        /// Results go to a lent output; the input is borrowed too.
        InputAndOutput,
    }
    const LENDINGS: [Lending; 3] = [Lending::Nothing, Lending::Output, Lending::InputAndOutput];

    fn lossy_40_values() -> Vec<f32> {
        (0..40).map(|i| (i as f32 - 17.5) * 0.37).collect()
    }

    /// Runs one float allreduce of 40 elements with block 3's first data
    /// transmission lost, holding its tensors as `lending` says; returns
    /// the sum, the tensor the outcome handed back, the first data
    /// transmission of each block and the session.
    fn run_lossy_40(lending: Lending) -> (Vec<f32>, Tensor, std::collections::HashMap<u32, Vec<u8>>, AllreduceSession) {
        let (mut s, mut sw) = joined(8);
        let now = Time::from_nanos(1_000);
        let values = lossy_40_values();
        let mut out = vec![f32::NAN; 40];
        // SAFETY (both `begin_into`s): `out` and `values` outlive the
        // allreduce, which completes below (asserted) before `out` is read.
        match lending {
            Lending::Nothing => s.begin_prepared(now, Prepared::new(Tensor::F32(values.clone()), 4).unwrap()).unwrap(),
            Lending::Output => {
                let prepared = Prepared::new(Tensor::F32(values.clone()), 4).unwrap();
                unsafe { s.begin_into(now, prepared, TensorMut::F32(&mut out)) }.unwrap()
            }
            Lending::InputAndOutput => {
                let prepared = Prepared::borrow(TensorRef::F32(&values), 4).unwrap();
                unsafe { s.begin_into(now, prepared, TensorMut::F32(&mut out)) }.unwrap()
            }
        }
        let mut sent_data = std::collections::HashMap::new();
        let mut lost_once = false;
        let mut outcome = None;
        for _ in 0..100 {
            let mut tx = VecTransmit::new();
            while s.poll_transmit(now, &mut tx) > 0 {}
            let mut batch: Vec<_> = tx.drain().collect();
            for (_, b) in &batch {
                let p = Packet::new_checked(&b[..]).unwrap();
                if !p.exp_only() && p.msg_type_code() == MessageType::Contribution as u8 {
                    sent_data.insert(p.block_id(), b.clone());
                }
            }
            // block 3's first data transmission is lost: its result comes
            // from a retransmission, and what is retained is still what
            // the first transmission carried
            if !lost_once {
                if let Some(i) = batch.iter().position(|(_, b)| {
                    let p = Packet::new_checked(&b[..]).unwrap();
                    !p.exp_only() && p.block_id() == 3
                }) {
                    batch.remove(i);
                    lost_once = true;
                }
            }
            deliver(&mut s, &mut sw, now, batch);
            if let Some(Event::Completed(o)) = s.poll_event() {
                outcome = Some(o);
                break;
            }
        }
        assert!(lost_once);
        let o = outcome.expect("the allreduce completes");
        assert_eq!(values, lossy_40_values(), "the input is never written");
        let sum = if lending == Lending::Nothing {
            let Tensor::F32(v) = o.tensor.clone() else { unreachable!() };
            v
        } else {
            out
        };
        (sum, o.tensor, sent_data, s)
    }

    #[test]
    fn a_retained_contribution_is_the_very_datagram_first_sent() {
        for lending in LENDINGS {
            let (_, _, sent_data, s) = run_lossy_40(lending);
            assert_eq!(s.captured.pending(), 0, "every result took its block's capture (none emitted twice)");
            let retained = s.retained_blocks();
            assert_eq!(retained, (0..10).collect::<Vec<_>>(), "every block of the one allreduce");
            for b in retained {
                let kept = s.retained_bytes(b).expect("emitted by the time the allreduce ended");
                assert_eq!(kept, &sent_data[&b][..], "block {b}, {lending:?} lent");
                assert_eq!(Packet::new_checked(kept).unwrap().grad_cnt(), 4);
            }
        }
    }

    #[test]
    fn a_lent_output_gets_the_same_sum_and_the_input_comes_back_unchanged() {
        let (owned_sum, _, _, _) = run_lossy_40(Lending::Nothing);
        let (lent_sum, handed_back, _, _) = run_lossy_40(Lending::Output);
        assert_eq!(lent_sum, owned_sum, "bit-identical to the owned path");
        assert_eq!(handed_back, Tensor::F32(lossy_40_values()), "the input, untouched");
        assert!(lent_sum.iter().all(|v| v.is_finite()), "every element written");
    }

    #[test]
    fn a_borrowed_input_gets_the_same_sum_and_nothing_is_handed_back() {
        let (owned_sum, _, _, _) = run_lossy_40(Lending::Nothing);
        let (lent_sum, handed_back, _, _) = run_lossy_40(Lending::InputAndOutput);
        assert_eq!(lent_sum, owned_sum, "bit-identical to the owned path");
        assert_eq!(handed_back, Tensor::F32(Vec::new()), "the caller has the input");
    }

    #[test]
    fn a_borrowed_input_with_a_refused_value_is_refused_with_its_index() {
        let mut values = vec![1.0f32; 10];
        values[6] = f32::INFINITY;
        let err = Prepared::borrow(TensorRef::F32(&values), 4).unwrap_err();
        assert_eq!(err.index, 6);
    }

    #[test]
    fn a_lent_output_of_the_wrong_shape_or_dtype_is_refused_before_anything_is_sent() {
        let (mut s, _) = joined(8);
        let now = Time::from_nanos(1_000);
        let mut short = vec![0.0f32; 7];
        let mut ints = vec![0i32; 8];
        for out in [TensorMut::F32(&mut short), TensorMut::I32(&mut ints)] {
            let prepared = Prepared::new(Tensor::F32(vec![1.0; 8]), 4).unwrap();
            // SAFETY: refused, so the session keeps nothing.
            let err = unsafe { s.begin_into(now, prepared, out) }.unwrap_err();
            assert!(err.to_string().contains("output must match the input"), "{err}");
        }
        let mut tx = VecTransmit::new();
        assert_eq!(s.poll_transmit(now, &mut tx), 0, "nothing sent");
        assert!(s.op.is_none());
    }

    #[test]
    fn abandoning_an_allreduce_releases_its_output_and_the_session_can_begin_again() {
        let (mut s, _) = joined(8);
        let now = Time::from_nanos(1_000);
        let mut out = vec![0i32; 8];
        // SAFETY: abandoned below, before `out` is used again.
        unsafe { s.begin_into(now, Prepared::new(Tensor::I32(vec![1; 8]), 4).unwrap(), TensorMut::I32(&mut out)) }
            .unwrap();
        let mut tx = VecTransmit::new();
        assert!(s.poll_transmit(now, &mut tx) > 0);
        s.abandon();
        assert!(s.op.is_none() && s.poll_event().is_none(), "ended without an event");
        s.begin(now, Tensor::I32(vec![1; 8])).unwrap();
    }

    #[test]
    fn a_tensor_prepared_while_copied_equals_one_prepared_after() {
        let values: Vec<f32> = (0..5000).map(|i| ((i * 37) % 1001) as f32 * 0.5f32.powi(i % 40) - 3.0).collect();
        let copied = Prepared::copy_f32(&values, 64, vec![9.0; 10]).unwrap();
        assert_eq!(copied, Prepared::new(Tensor::F32(values.clone()), 64).unwrap());
        // a refused value is named by its index in the tensor, not its block
        let mut bad = values;
        bad[4321] = f32::INFINITY;
        let e = Prepared::copy_f32(&bad, 64, Vec::new()).unwrap_err();
        assert_eq!((e.index, e.value), (4321, f32::INFINITY));
        assert_eq!(Prepared::new(Tensor::F32(bad), 1024).unwrap_err().index, 4321);
    }

    #[test]
    fn a_tensor_prepared_for_another_block_size_is_prepared_again() {
        let (mut s, mut sw) = joined(8);
        let now = Time::from_nanos(1_000);
        // prepared for blocks of 2; the session sends blocks of 4
        let values = vec![1.0f32, 2.0, 1000.0, 0.5, 0.25, 3.0];
        s.begin_prepared(now, Prepared::new(Tensor::F32(values.clone()), 2).unwrap()).unwrap();
        for _ in 0..10 {
            let mut out = VecTransmit::new();
            while s.poll_transmit(now, &mut out) > 0 {}
            deliver(&mut s, &mut sw, now, out.drain().collect());
        }
        match s.poll_event() {
            Some(Event::Completed(o)) => assert_eq!(o.tensor, Tensor::F32(values)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn stall_timer_resends_only_after_an_rto_without_progress() {
        let (mut s, mut sw) = joined(8);
        let t0 = Time::from_nanos(1_000);
        s.begin(t0, Tensor::I32(vec![7; 4])).unwrap();
        let mut out = VecTransmit::new();
        s.poll_transmit(t0, &mut out);
        out.drain().for_each(drop); // lost
        let deadline = s.poll_timeout().unwrap();
        assert_eq!(deadline, t0 + s.config().rto_initial);
        s.handle_timeout(Time::from_nanos(deadline.as_nanos() - 1));
        assert_eq!(s.poll_transmit(deadline, &mut out), 0, "not yet");
        s.handle_timeout(deadline);
        assert_eq!(s.poll_transmit(deadline, &mut out), 1);
        deliver(&mut s, &mut sw, deadline, out.drain().collect());
        assert!(matches!(s.poll_event(), Some(Event::Completed(_))));
    }
}

#[cfg(test)]
mod averaging_tests {
    use super::*;

    #[test]
    fn average_divides_each_block_by_its_own_src_cnt() {
        let mut o = Outcome {
            tensor: Tensor::F32(vec![8.0, 8.0, 6.0, 6.0, 4.0]),
            gen_id: 1,
            blocks: 3,
            retransmissions: 0,
            trimmed: 0,
            degraded_blocks: vec![(1, 3), (2, 0)],
            min_src_cnt: 0,
            missed_blocks: 1,
            latency_mean: Duration::ZERO,
            latency_max: Duration::ZERO,
            recoveries: 0,
        };
        assert_eq!(o.src_cnt_of(0, 4), 4);
        assert_eq!(o.src_cnt_of(1, 4), 3);
        o.average(2, 4).unwrap();
        assert_eq!(o.tensor, Tensor::F32(vec![2.0, 2.0, 2.0, 2.0, 0.0]));
        let mut ints = Outcome { tensor: Tensor::I32(vec![1]), ..o };
        assert!(ints.average(2, 4).is_err());
    }
}
