//! Lingering: a member that finished its last allreduce keeps taking part
//! in a switch restart until the others are done (docs/restart.md, "Idle
//! members").
//!
//! A restarted switch knows no member addresses, and its recovery floor
//! waits for a report from *every* member: a member that finished its last
//! allreduce before the restart holds the contributions the others need
//! (its retained blocks), but nothing drives its session, so the others
//! fail with `RecoveryStalled`. A lingering session is driven with no
//! allreduce running: it probes the switch with a plain Join every
//! [`LINGER_PROBE_INTERVAL`]; a JoinAck of another incarnation starts the
//! ordinary recovery (`low` = the end of its stream, since it has every
//! result), whose resends need no running allreduce. The driver says when
//! to stop (every member done, or a bound).

use std::time::Duration;

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
            (true, false) => self.linger = Some(Linger { next_probe: now }),
            (false, _) => self.linger = None,
            (true, true) => {}
        }
    }

    pub fn lingering(&self) -> bool {
        self.linger.is_some()
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
