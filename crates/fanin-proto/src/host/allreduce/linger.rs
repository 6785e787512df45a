//! Lingering: a member that finished its last allreduce keeps taking part
//! in a switch restart until the others are done (docs/restart.md, "Idle
//! members").
//!
//! A restarted switch knows no member addresses, and its recovery floor
//! waits for a report from *every* member: a member that finished its last
//! allreduce before the restart holds the contributions the others need
//! (its retained blocks), but nothing drives its session, so the others
//! fail with `RecoveryStalled`. A lingering session is driven with no
//! allreduce running: it probes the switch every [`LINGER_PROBE_INTERVAL`]
//! with a `JOIN_DONE` Join saying the end of its stream; a JoinAck of
//! another incarnation starts the ordinary recovery (`low` = the end of its
//! stream, since it has every result), whose resends need no running
//! allreduce, and a `JOIN_ALL_DONE` says every member is done. The driver
//! stops then, or at its own signal or bound.

use std::time::Duration;

use fanin_wire::value::{Repr, JOIN_DONE};

use super::AllreduceSession;
use crate::time::Time;

/// Between two probes of a lingering session: four times a running
/// allreduce's probe interval. One 24-byte datagram per rank per interval
/// while the slowest rank finishes; a restart is found within this plus a
/// round trip, well inside the others' `dead_after`.
pub const LINGER_PROBE_INTERVAL: Duration = Duration::from_millis(200);

/// What a lingering session did (over the session's life).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LingerStats {
    /// Probe Joins sent while lingering.
    pub probes: u64,
    /// Recoveries from a switch restart this session took part in with no
    /// allreduce running (its retained blocks resent for the others).
    pub idle_recoveries: u64,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Linger {
    pub(super) next_probe: Time,
    /// The switch said every member is done at the end of this session's
    /// stream (a `JOIN_ALL_DONE` JoinAck).
    pub(super) all_done: bool,
}

impl AllreduceSession {
    /// Start (`true`) or stop lingering. While it lingers and no allreduce
    /// runs, [`poll_timeout`](Self::poll_timeout) asks for a probe every
    /// [`LINGER_PROBE_INTERVAL`]; the driver must keep driving the session
    /// (read its socket, fire its timers) until it stops. The first probe
    /// goes out at once: a restart may have happened while nothing drove
    /// the session. Starting an allreduce needs no stop first.
    pub fn set_lingering(&mut self, now: Time, on: bool) {
        match (on, self.linger.is_some()) {
            // due at once: the first probe goes at the next timer
            (true, false) => self.linger = Some(Linger { next_probe: now, all_done: false }),
            (false, _) => self.linger = None,
            (true, true) => {}
        }
    }

    pub fn lingering(&self) -> bool {
        self.linger.is_some()
    }

    /// Whether the switch said, while this session lingered, that every
    /// member of the job is done at the end of this session's stream:
    /// nobody can need its retained contributions any more, so lingering
    /// may stop.
    pub fn all_done(&self) -> bool {
        self.linger.is_some_and(|l| l.all_done)
    }

    /// The probe of a lingering session with nothing running: a
    /// `JOIN_DONE` Join saying the end of its stream (every result before
    /// it is here), which the switch answers as a probe, or with
    /// `JOIN_ALL_DONE` once every member said the same.
    pub(super) fn done_request(&self) -> Option<Repr> {
        self.linger_deadline()?;
        Some(Repr { age_op: JOIN_DONE, block_id: self.next_block, src_cnt: self.config.incarnation as u16, ..self.join_repr() })
    }

    /// A `JOIN_ALL_DONE` JoinAck: every member is done at `block`.
    pub(super) fn on_all_done(&mut self, block: u32) {
        let at_end = self.op.is_none() && block == self.next_block;
        if let Some(linger) = self.linger.as_mut().filter(|_| at_end) {
            linger.all_done = true;
        }
    }

    pub fn linger_stats(&self) -> LingerStats {
        self.linger_stats
    }

    /// The next probe of a lingering session with nothing else to do.
    pub(super) fn linger_deadline(&self) -> Option<Time> {
        let linger = self.linger.as_ref()?;
        (self.op.is_none() && self.recovery.is_none()).then_some(linger.next_probe)
    }

    /// Timer work of a lingering session with no allreduce running.
    pub(super) fn linger_timeout(&mut self, now: Time) {
        let Some(due) = self.linger_deadline() else { return };
        if now >= due {
            self.join_due = true;
            self.linger_stats.probes += 1;
            if let Some(linger) = self.linger.as_mut() {
                linger.next_probe = now + LINGER_PROBE_INTERVAL;
            }
        }
    }
}
