//! A worker's session parameters ([`SessionConfig`]): what the caller chooses,
//! with the defaults and the checks `AllreduceSession::new` applies.

use std::time::Duration;

use fanin_wire::value::MAX_GRAD_CNT;

use super::SessionError;
use crate::auth::Key;

/// Worker-side parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionConfig {
    pub job_id: u32,
    /// This worker's source id (rank) in the job.
    pub src_id: u16,
    /// Elements per packet (Trio-ML `grad_cnt`). 0 (the default): the job's
    /// packet size, which the switch announces at join (`packet_elems`: the
    /// job's `block_grad_max` capped to one unfragmented datagram on its data
    /// port), so every member sends the same blocks and no datagram is cut
    /// into IP fragments. Any other value overrides it and must be the same
    /// on every member.
    pub elems_per_packet: u16,
    /// Most blocks outstanding at once (congestion control's window never
    /// exceeds it); clamped to the job's `block_cnt_max`.
    pub window: u32,
    /// Retransmission timeout before any round trip was measured.
    pub rto_initial: Duration,
    pub rto_min: Duration,
    pub rto_max: Duration,
    /// Give up joining after this long without an answer.
    pub join_timeout: Duration,
    /// Fail an allreduce when the switch has been silent this long.
    pub dead_after: Duration,
    /// Fail the session when the switch's host has said for this long that
    /// nothing listens on the switch's port (ICMP port unreachable, which
    /// the driver reports: [`AllreduceSession::handle_port_unreachable`](super::AllreduceSession::handle_port_unreachable))
    /// and nothing came from the switch since. A switch restarted on its
    /// port within this time answers, and the session recovers
    /// (docs/restart.md); zero, for a switch that cannot come back (the
    /// torch backend's embedded switch dies with its process), fails at
    /// the first report.
    pub switch_gone_after: Duration,
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
    /// This session's member incarnation (docs/protocol.md §4.12), 48
    /// bits: the low 16 in every Join (`src_cnt`, non-zero), the next 32 in
    /// a plain Join's `block_id`. The switch tells a new process of a rank
    /// from the old one's repeated Joins by it. The host library draws a
    /// random one per session; a machine built by hand must give each
    /// session of a rank its own. Low 16 bits 0: take no part in rounds
    /// (answered as before rounds existed). Bits above 48 are not sent.
    pub incarnation: u64,
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
            elems_per_packet: 0,
            window: 256,
            rto_initial: Duration::from_millis(50),
            // 25 ms: a 2-core host (or a busy one) stalls for several ms
            // at a time; below that, stalls read as losses and resend.
            rto_min: Duration::from_millis(25),
            rto_max: Duration::from_millis(1000),
            join_timeout: Duration::from_secs(5),
            dead_after: Duration::from_secs(10),
            switch_gone_after: Duration::from_secs(10),
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
        if self.elems_per_packet as usize > MAX_GRAD_CNT {
            return bad(format!(
                "elems_per_packet {} is out of range (0 = the job's, or 1..={MAX_GRAD_CNT}, the most one UDP datagram carries)",
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
