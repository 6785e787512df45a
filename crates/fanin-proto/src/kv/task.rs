//! A task's life cycle at the receiver's daemon (ASK §3.1; docs/kv.md §10,
//! "Failed senders") as a sans-IO machine: which sender channels joined,
//! which finished, which failed and why, and when a silent one is declared
//! failed. The daemon feeds it the control channel's typed requests and the
//! clock and carries out what it answers (tell the receiver machine, tell
//! a sender's daemon); deterministic tests drive it with a scripted clock.
//!
//! Life cycle of one task:
//! * `create`: the daemon allocates the region and makes a [`TaskLedger`];
//! * `join`: each sender channel joins once, naming its daemon
//!   ([`TaskLedger::join`]);
//! * `progress`: reports restart a channel's silence clock only when more
//!   packets were acknowledged ([`TaskLedger::progress`]);
//! * `finished` / `fail`: a channel ends ([`TaskLedger::finished`],
//!   [`TaskLedger::fail`]); a channel silent for the task's `silence` is
//!   failed by [`TaskLedger::overdue`];
//! * collect and release: the receiver machine ends the task; an abort
//!   ([`TaskLedger::abort`]) names the senders still to be told.
//!
//! Why liveness lives on the control channel and not the data path: the
//! switch acknowledges packets it absorbs completely itself, so a receiver
//! that hears nothing from a channel cannot tell a dead sender from a
//! well-aggregated one, and the data path carries no sender address to name.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::SenderProgress;
use crate::Time;

/// How often a sender's daemon reports progress for a task whose silence
/// timeout is `silence`: five reports per timeout, so one lost or late
/// report never trips it; at least every second, at most every 20 ms.
pub fn progress_interval(silence: Duration) -> Duration {
    (silence / 5).clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// A `progress` report as it travels: [`SenderProgress`] of the sender
/// machine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressReport {
    pub tuples_pushed: u64,
    pub tuples_acked: u64,
    /// The first `acked_prefix` input tuples (records, or words in text
    /// mode) are all aggregated: they are in the task's results even if the
    /// sender dies now.
    pub acked_prefix: u64,
    pub packets_sent: u64,
    pub packets_acked: u64,
}

impl From<SenderProgress> for ProgressReport {
    fn from(p: SenderProgress) -> Self {
        Self {
            tuples_pushed: p.tuples_pushed,
            tuples_acked: p.tuples_acked,
            acked_prefix: p.acked_prefix,
            packets_sent: p.packets_sent as u64,
            packets_acked: p.packets_acked,
        }
    }
}

/// Where one joined channel stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkState {
    Active,
    /// The sender's FIN was acknowledged.
    Finished,
    Failed { reason: String },
}

/// What the receiver's daemon knows about one joined channel.
#[derive(Debug, Clone)]
pub struct SenderLink {
    /// The sender daemon's control address (it names the sender).
    pub control: String,
    pub state: LinkState,
    pub progress: Option<ProgressReport>,
    joined: Time,
    last_advance: Time,
    failed_at: Option<Time>,
}

impl SenderLink {
    fn new(control: String, now: Time) -> Self {
        Self { control, state: LinkState::Active, progress: None, joined: now, last_advance: now, failed_at: None }
    }

    pub fn is_active(&self) -> bool {
        self.state == LinkState::Active
    }

    fn on_progress(&mut self, report: ProgressReport, now: Time) -> bool {
        let before = self.progress.map_or(0, |p| p.packets_acked);
        self.progress = Some(report);
        let advanced = report.packets_acked > before;
        if advanced {
            self.last_advance = now;
        }
        advanced
    }

    fn overdue(&self, now: Time, silence: Duration) -> Option<String> {
        let quiet = now.saturating_since(self.last_advance);
        (self.is_active() && quiet >= silence).then(|| match self.progress {
            None => format!("no progress report for {} ms after it joined", quiet.as_millis()),
            Some(_) => format!("no progress for {} ms (nothing more acknowledged or not reported)", quiet.as_millis()),
        })
    }

    fn fail(&mut self, reason: String, now: Time) -> bool {
        if !self.is_active() {
            return false;
        }
        self.state = LinkState::Failed { reason };
        self.failed_at = Some(now);
        true
    }

    fn report(&self, channel: u16, now: Time) -> ChannelReport {
        let (state, reason) = match &self.state {
            LinkState::Active => (ChannelState::Active, None),
            LinkState::Finished => (ChannelState::Finished, None),
            LinkState::Failed { reason } => (ChannelState::Failed, Some(reason.clone())),
        };
        let ms = |since: Time| now.saturating_since(since).as_millis() as u64;
        ChannelReport {
            channel,
            sender: Some(self.control.clone()),
            state,
            reason,
            progress: self.progress,
            ms_since_join: Some(ms(self.joined)),
            ms_since_progress: Some(ms(self.last_advance)),
            ms_since_failure: self.failed_at.map(ms),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChannelState {
    Active,
    Finished,
    Failed,
}

/// One channel as `status` and a failed `wait` report it (JSON; every field
/// is present, null where it does not apply).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelReport {
    pub channel: u16,
    /// The sender daemon's control address; none if it never joined.
    pub sender: Option<String>,
    pub state: ChannelState,
    pub reason: Option<String>,
    pub progress: Option<ProgressReport>,
    pub ms_since_join: Option<u64>,
    pub ms_since_progress: Option<u64>,
    pub ms_since_failure: Option<u64>,
}

impl ChannelReport {
    /// A channel the task waited for that never joined.
    pub fn never_joined(channel: u16) -> Self {
        Self {
            channel,
            sender: None,
            state: ChannelState::Failed,
            reason: Some("never joined".into()),
            progress: None,
            ms_since_join: None,
            ms_since_progress: None,
            ms_since_failure: None,
        }
    }

    /// "sender channel 1 (daemon 10.0.0.2:4000) failed: reason"
    pub fn describe(&self) -> String {
        format!(
            "sender channel {} (daemon {}) failed: {}",
            self.channel,
            self.sender.as_deref().unwrap_or("unknown"),
            self.reason.as_deref().unwrap_or("unknown")
        )
    }
}

/// Why a `join` is refused (the message is what the sender's daemon shows).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinRefused {
    #[error("channel {channel} is out of range: task {task_id} has {senders} senders")]
    OutOfRange { task_id: u32, channel: u16, senders: u16 },
    #[error("channel {channel} of task {task_id} has already joined")]
    AlreadyJoined { task_id: u32, channel: u16 },
}

/// Why a `progress` report is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProgressRefused {
    #[error("channel {channel} has not joined task {task_id}")]
    NotJoined { task_id: u32, channel: u16 },
    /// The sender's daemon must stop sending on this channel.
    #[error("the receiver declared channel {channel} of task {task_id} failed: {reason}")]
    DeclaredFailed { task_id: u32, channel: u16, reason: String },
}

/// Most sender channels one task may have.
pub const MAX_SENDERS: u16 = 1024;

/// A task's sender count as a `create` request gives it: 1..=[`MAX_SENDERS`].
pub fn check_senders(senders: u64) -> Result<u16, String> {
    match senders {
        1..=1024 => Ok(senders as u16),
        _ => Err(format!("senders must be 1..={MAX_SENDERS}, got {senders}")),
    }
}

/// The receiver-side record of one task's sender channels.
#[derive(Debug, Clone)]
pub struct TaskLedger {
    task_id: u32,
    senders: u16,
    /// A joined sender without progress this long is declared failed.
    silence: Duration,
    links: BTreeMap<u16, SenderLink>,
    /// Until then, channels that have not joined yet are still expected
    /// (their applications may prepare their input after the task was
    /// created): [`TaskLedger::awaiting_joins`].
    join_by: Option<Time>,
}

impl TaskLedger {
    /// A task waiting for `senders` channels (1..=[`MAX_SENDERS`]).
    pub fn new(task_id: u32, senders: u64, silence: Duration) -> Result<Self, String> {
        let senders = check_senders(senders)?;
        Ok(Self { task_id, senders, silence, links: BTreeMap::new(), join_by: None })
    }

    /// Channels may join until `deadline` (creation + the task's join
    /// time): while some have not, the receiver's silence clock is held
    /// ([`TaskLedger::awaiting_joins`]), so a task created before its
    /// senders' inputs are ready is not failed as silent.
    pub fn expect_joins_until(&mut self, deadline: Time) {
        self.join_by = Some(deadline);
    }

    /// Channels have still to join and may still do so: the receiver is
    /// waiting for them, not silent.
    pub fn awaiting_joins(&self, now: Time) -> bool {
        self.links.len() < self.senders as usize && self.join_by.is_some_and(|t| now < t)
    }

    /// Once the join time has passed: the channels that never joined (the
    /// task cannot be complete without them), said once.
    pub fn take_missed_joins(&mut self, now: Time) -> Vec<u16> {
        if !self.join_by.is_some_and(|t| now >= t) {
            return Vec::new();
        }
        self.join_by = None;
        (0..self.senders).filter(|c| !self.links.contains_key(c)).collect()
    }

    pub fn senders(&self) -> u16 {
        self.senders
    }

    pub fn silence(&self) -> Duration {
        self.silence
    }

    /// A channel joins, once; `control` is its daemon's control address.
    pub fn join(&mut self, channel: u16, control: String, now: Time) -> Result<(), JoinRefused> {
        let task_id = self.task_id;
        if channel >= self.senders {
            return Err(JoinRefused::OutOfRange { task_id, channel, senders: self.senders });
        }
        if self.links.contains_key(&channel) {
            return Err(JoinRefused::AlreadyJoined { task_id, channel });
        }
        self.links.insert(channel, SenderLink::new(control, now));
        Ok(())
    }

    /// Record a report. Ok(true) when it shows progress (more packets
    /// acknowledged than the last one), which restarts the silence clock and
    /// is worth telling the receiver machine (a sender is alive, so the
    /// task's silence is not the switch's).
    pub fn progress(&mut self, channel: u16, report: ProgressReport, now: Time) -> Result<bool, ProgressRefused> {
        let task_id = self.task_id;
        let link = self.links.get_mut(&channel).ok_or(ProgressRefused::NotJoined { task_id, channel })?;
        if let LinkState::Failed { reason } = &link.state {
            return Err(ProgressRefused::DeclaredFailed { task_id, channel, reason: reason.clone() });
        }
        Ok(link.on_progress(report, now))
    }

    /// The channel's FIN was acknowledged (a no-op unless it is active).
    pub fn finished(&mut self, channel: u16) {
        if let Some(link) = self.links.get_mut(&channel).filter(|l| l.is_active()) {
            link.state = LinkState::Finished;
        }
    }

    /// Declare an active channel failed. Returns its daemon's control
    /// address, to be told to stop; None if the channel was not active (it
    /// finished, failed before, or never joined): nothing to do.
    pub fn fail(&mut self, channel: u16, reason: String, now: Time) -> Option<String> {
        let link = self.links.get_mut(&channel)?;
        link.fail(reason, now).then(|| link.control.clone())
    }

    /// Active channels without progress for the task's silence, with the
    /// reason to fail each ([`TaskLedger::fail`] them).
    pub fn overdue(&self, now: Time) -> Vec<(u16, String)> {
        self.links.iter().filter_map(|(c, l)| l.overdue(now, self.silence).map(|why| (*c, why))).collect()
    }

    /// How often [`TaskLedger::overdue`] should be asked: five times per
    /// silence timeout, within 5..=50 ms.
    pub fn check_interval(&self) -> Duration {
        (self.silence / 5).clamp(Duration::from_millis(5), Duration::from_millis(50))
    }

    /// The task is given up: the channels still active, with their daemons'
    /// control addresses, to be told. The ledger forgets every channel.
    pub fn abort(&mut self) -> Vec<(u16, String)> {
        let links = std::mem::take(&mut self.links);
        links.into_iter().filter(|(_, l)| l.is_active()).map(|(c, l)| (c, l.control)).collect()
    }

    /// The channels still sending, with their daemons' control addresses.
    pub fn active(&self) -> Vec<(u16, String)> {
        self.links.iter().filter(|(_, l)| l.is_active()).map(|(c, l)| (*c, l.control.clone())).collect()
    }

    /// The channels declared failed, in channel order.
    pub fn declared_failed(&self) -> Vec<u16> {
        self.links.iter().filter(|(_, l)| matches!(l.state, LinkState::Failed { .. })).map(|(c, _)| *c).collect()
    }

    /// One channel's report; a channel that never joined is reported as
    /// failed for that reason.
    pub fn report(&self, channel: u16, now: Time) -> ChannelReport {
        match self.links.get(&channel) {
            Some(link) => link.report(channel, now),
            None => ChannelReport::never_joined(channel),
        }
    }

    /// Every joined channel's report, in channel order (`status`).
    pub fn status(&self, now: Time) -> Vec<ChannelReport> {
        self.links.iter().map(|(c, l)| l.report(*c, now)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(acked: u64) -> ProgressReport {
        ProgressReport { packets_acked: acked, tuples_acked: acked * 10, ..ProgressReport::default() }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn only_reports_that_show_more_acknowledged_packets_restart_the_silence_clock() {
        let t0 = Time::from_nanos(1_000_000_000);
        let mut task = TaskLedger::new(7, 2, ms(100)).unwrap();
        task.join(0, "127.0.0.1:9".into(), t0).unwrap();
        assert_eq!(task.overdue(t0 + ms(99)), vec![]);
        let why = &task.overdue(t0 + ms(100))[0];
        assert_eq!(why.0, 0);
        assert!(why.1.contains("no progress report for 100 ms"), "{}", why.1);
        assert_eq!(task.progress(0, report(1), t0 + ms(50)), Ok(true));
        // Reports keep coming, but nothing more is acknowledged: a sender
        // that is alive yet stuck (cut off from the switch) is still overdue.
        assert_eq!(task.progress(0, report(1), t0 + ms(120)), Ok(false));
        assert_eq!(task.progress(0, report(1), t0 + ms(149)), Ok(false));
        assert_eq!(task.overdue(t0 + ms(149)), vec![]);
        assert!(task.overdue(t0 + ms(150))[0].1.contains("no progress for 100 ms"));
    }

    #[test]
    fn a_task_from_create_to_abort() {
        let t0 = Time::from_nanos(0);
        assert_eq!(TaskLedger::new(1, 0, ms(10)).unwrap_err(), "senders must be 1..=1024, got 0");
        assert!(TaskLedger::new(1, 1025, ms(10)).is_err());
        let mut task = TaskLedger::new(3, 3, ms(100)).unwrap();
        task.join(0, "a:1".into(), t0).unwrap();
        task.join(1, "b:1".into(), t0).unwrap();
        assert_eq!(task.join(1, "c:1".into(), t0), Err(JoinRefused::AlreadyJoined { task_id: 3, channel: 1 }));
        let out = task.join(3, "c:1".into(), t0).unwrap_err();
        assert_eq!(out.to_string(), "channel 3 is out of range: task 3 has 3 senders");
        assert_eq!(task.progress(2, report(1), t0), Err(ProgressRefused::NotJoined { task_id: 3, channel: 2 }));
        // channel 0 finishes: never overdue, cannot fail any more
        task.finished(0);
        assert_eq!(task.fail(0, "late".into(), t0 + ms(500)), None);
        // channel 1 goes silent and is failed once; its reports are refused
        let overdue = task.overdue(t0 + ms(100));
        assert_eq!(overdue.iter().map(|o| o.0).collect::<Vec<_>>(), vec![1]);
        assert_eq!(task.fail(1, overdue[0].1.clone(), t0 + ms(100)), Some("b:1".into()));
        assert_eq!(task.fail(1, "again".into(), t0 + ms(101)), None);
        assert!(matches!(task.progress(1, report(5), t0 + ms(102)), Err(ProgressRefused::DeclaredFailed { .. })));
        assert_eq!(task.overdue(t0 + ms(10_000)), vec![]);
        assert_eq!(task.declared_failed(), vec![1]);
        // reports: joined channels with their state, one that never joined
        let r = task.report(1, t0 + ms(150));
        assert_eq!((r.state, r.sender.as_deref(), r.ms_since_failure), (ChannelState::Failed, Some("b:1"), Some(50)));
        assert!(r.describe().starts_with("sender channel 1 (daemon b:1) failed: no progress report"), "{}", r.describe());
        assert_eq!(task.report(2, t0).reason.as_deref(), Some("never joined"));
        assert_eq!(task.status(t0).iter().map(|r| r.state).collect::<Vec<_>>(), vec![ChannelState::Finished, ChannelState::Failed]);
        // channel 2 joins late and is active when the task is aborted
        task.join(2, "c:1".into(), t0 + ms(200)).unwrap();
        assert_eq!(task.active(), vec![(2, "c:1".to_string())]);
        assert_eq!(task.abort(), vec![(2, "c:1".to_string())], "only the active sender is told");
        assert_eq!(task.status(t0), vec![]);
    }

    #[test]
    fn a_report_serialises_as_the_daemon_api_documents_it() {
        let t0 = Time::from_nanos(0);
        let mut task = TaskLedger::new(3, 2, ms(100)).unwrap();
        task.join(0, "a:1".into(), t0).unwrap();
        let v = serde_json::to_value(task.report(0, t0 + ms(5))).unwrap();
        assert_eq!(v["state"], "active");
        assert_eq!(v["sender"], "a:1");
        assert_eq!(v["ms_since_join"], 5);
        assert!(v["reason"].is_null() && v["progress"].is_null() && v["ms_since_failure"].is_null());
        let never = serde_json::to_value(task.report(1, t0)).unwrap();
        assert_eq!(never, serde_json::json!({"channel": 1, "sender": null, "state": "failed", "reason": "never joined",
                                             "progress": null, "ms_since_join": null, "ms_since_progress": null,
                                             "ms_since_failure": null}));
    }

    #[test]
    fn progress_interval_is_a_fifth_of_the_silence_within_bounds() {
        assert_eq!(progress_interval(ms(1500)), ms(300));
        assert_eq!(progress_interval(ms(10)), ms(20));
        assert_eq!(progress_interval(Duration::from_secs(60)), Duration::from_secs(1));
    }

    #[test]
    fn channels_are_awaited_until_the_join_time_and_not_after() {
        let t0 = Time::from_nanos(0);
        let mut task = TaskLedger::new(3, 2, ms(100)).unwrap();
        assert!(!task.awaiting_joins(t0), "no join time: the receiver's own timeout decides");
        task.expect_joins_until(t0 + ms(250));
        assert!(task.awaiting_joins(t0 + ms(10)) && !task.awaiting_joins(t0 + ms(250)));
        assert_eq!(task.take_missed_joins(t0 + ms(10)), Vec::<u16>::new(), "not yet");
        task.join(1, "b:1".into(), t0).unwrap();
        assert_eq!(task.take_missed_joins(t0 + ms(250)), vec![0]);
        assert_eq!(task.take_missed_joins(t0 + ms(300)), Vec::<u16>::new(), "said once");
        task.join(0, "a:1".into(), t0).unwrap();
        assert!(!task.awaiting_joins(t0 + ms(10)), "every channel joined");
    }
}
