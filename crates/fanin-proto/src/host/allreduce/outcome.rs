//! What a session reports: its events, a finished allreduce ([`Outcome`], and
//! averaging its sum) and why a session or an allreduce failed ([`SessionError`]).

use std::time::Duration;

use fanin_wire::value::{JoinParams, NackReason};

use super::Tensor;
use crate::bfp::OutOfRange;

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
    #[error(
        "nothing listens on the switch's port: its host has answered so (ICMP port unreachable) for {waited:?}. \
         The switch process stopped, or is not running at that address (under torch: rank 0, whose process ran \
         the embedded switch, died); start new sessions once a switch runs there"
    )]
    SwitchGone { waited: Duration },
    #[error("the switch refused job {job_id}: {} (detail {detail})", reason.describe())]
    Refused { job_id: u32, reason: NackReason, detail: u32 },
    #[error("job {job_id} failed: worker rank {rank} stopped sending (silent past the job's member timeout) and the job's failure policy is `fail`; re-create the job to start again")]
    MemberFailed { job_id: u32, rank: u16 },
    #[error("the job's block_grad_max is {cap} elements but this worker sends {requested} per packet; lower elems_per_packet")]
    PacketTooLarge { requested: u16, cap: u32 },
    /// Refused before anything was sent; the session then fails with
    /// [`OutOfStep`](Self::OutOfStep) ([`AllreduceSession::refuse_input`](super::AllreduceSession::refuse_input)).
    #[error(transparent)]
    OutOfRange(OutOfRange),
    #[error(
        "this session takes no more allreduces: an earlier one was refused before it was sent ({0}), so the ranks are \
         out of step (the others may be waiting in that allreduce, and this session's next one would be summed with \
         theirs); start a new session on every rank (in torch: a new process group)"
    )]
    OutOfStep(OutOfRange),
    #[error("the session is not ready: {0}")]
    NotReady(&'static str),
    #[error("the switch restarted (or lost job {job_id}) and recovery did not finish within {waited:?}: not every member of the job rejoined (a member stopped calling allreduce without lingering, or died), or the job was not re-admitted to the restarted switch")]
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
        "job {job_id}: the ranks disagree on this allreduce's length or element type (rank {rank}'s blocks do not \
         line up with the others': another element count, another dtype, or another tensor); every rank of the job \
         raises this. Give every rank the same tensors (sizes and dtypes) in the same order, then start new sessions"
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

/// A finished allreduce.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The reduced tensor (sum over the sources each block reports); after
    /// [`AllreduceSession::begin_into`](super::AllreduceSession::begin_into), which wrote the sum into the
    /// caller's buffer, the input handed back unchanged (to reuse its memory).
    pub tensor: Tensor,
    pub gen_id: u16,
    pub blocks: u32,
    /// Elements per block of this allreduce (block `i` covers elements
    /// `[i * elems_per_block, (i + 1) * elems_per_block)`): the session's
    /// `elems_per_packet`, or its 16-bit block size for float16/bfloat16.
    pub elems_per_block: usize,
    /// Contributions this worker sent again (after a timeout, fast
    /// retransmit or a trim).
    pub retransmissions: u64,
    /// Trimmed nacks that made this worker resend a block (each counted once;
    /// stale or duplicate trims are ignored).
    pub trimmed: u64,
    /// Blocks fast retransmit found lost (results of later blocks came
    /// first): congestion signals found within about one round trip.
    pub fast_retransmits: u64,
    /// Stall timeouts (nothing answered for an RTO) during this allreduce.
    pub timeouts: u64,
    /// Results the switch marked congested (`AGE_OP_CONGESTED`: a loss
    /// repaired, or a CE mark on some member's path; docs/congestion.md).
    pub marked_results: u64,
    /// Results that reached this worker with the IP header's ECN field at
    /// CE (a queue on the way down marked them); the next contribution this
    /// worker sends echoes them (one echo for all that came since the last
    /// one).
    pub ecn_ce: u64,
    /// The congestion window when the allreduce ended (blocks).
    pub window: u32,
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
