//! Per-sender liveness on the daemon control channel (docs/kv.md §10,
//! "Failed senders").
//!
//! A sender's daemon keeps one TCP connection ([`ControlSession`]) to the
//! receiver's daemon for as long as it sends on a channel: `join` on it,
//! then a `progress` report every [`progress_interval`], then `finished`
//! (its FIN was acknowledged) or `fail`. The receiver's daemon keeps a
//! [`SenderLink`] per joined channel and declares the sender failed when
//! * the connection closes before `finished` (the daemon was killed or its
//!   host rebooted: the kernel closes the socket), or
//! * no report showed progress (more packets acknowledged) for the task's
//!   `silence_ms` (a hung daemon, a host gone without closing the socket,
//!   or a sender cut off from the switch).
//!
//! Why the control channel and not the data path: the switch acknowledges
//! packets it absorbs completely itself, so a receiver that hears nothing
//! from a channel cannot tell a dead sender from a well-aggregated one, and
//! the data path carries no sender address to name.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use fanin_proto::kv::SenderProgress;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// How often a sender's daemon reports progress for a task whose silence
/// timeout is `silence`: five reports per timeout, so one lost or late
/// report never trips it; at least every second, at most every 20 ms.
pub fn progress_interval(silence: Duration) -> Duration {
    (silence / 5).clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// A `progress` report as it travels (JSON) — `SenderProgress` of the
/// sender machine.
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
    joined: Instant,
    last_advance: Instant,
    failed_at: Option<Instant>,
}

impl SenderLink {
    pub fn new(control: String, now: Instant) -> Self {
        Self { control, state: LinkState::Active, progress: None, joined: now, last_advance: now, failed_at: None }
    }

    pub fn is_active(&self) -> bool {
        self.state == LinkState::Active
    }

    /// Record a report; true when it shows progress (more packets
    /// acknowledged than the last one), which restarts the silence clock.
    pub fn on_progress(&mut self, report: ProgressReport, now: Instant) -> bool {
        let before = self.progress.map_or(0, |p| p.packets_acked);
        self.progress = Some(report);
        let advanced = report.packets_acked > before;
        if advanced {
            self.last_advance = now;
        }
        advanced
    }

    /// Active and without progress for `silence`: the reason to fail it.
    pub fn overdue(&self, now: Instant, silence: Duration) -> Option<String> {
        let quiet = now.saturating_duration_since(self.last_advance);
        (self.is_active() && quiet >= silence).then(|| match self.progress {
            None => format!("no progress report for {} ms after it joined", quiet.as_millis()),
            Some(_) => format!("no progress for {} ms (nothing more acknowledged or not reported)", quiet.as_millis()),
        })
    }

    /// Mark it failed; false if it was not active (finished or failed).
    pub fn fail(&mut self, reason: String, now: Instant) -> bool {
        if !self.is_active() {
            return false;
        }
        self.state = LinkState::Failed { reason };
        self.failed_at = Some(now);
        true
    }

    pub fn finish(&mut self) {
        if self.is_active() {
            self.state = LinkState::Finished;
        }
    }

    /// The machine-readable record of a channel (`wait` failure reports,
    /// `status`).
    pub fn to_json(&self, channel: u16, now: Instant) -> Value {
        let (state, reason) = match &self.state {
            LinkState::Active => ("active", None),
            LinkState::Finished => ("finished", None),
            LinkState::Failed { reason } => ("failed", Some(reason.clone())),
        };
        let ms = |d: Duration| d.as_millis() as u64;
        json!({
            "channel": channel,
            "sender": self.control,
            "state": state,
            "reason": reason,
            "progress": self.progress,
            "ms_since_join": ms(now.saturating_duration_since(self.joined)),
            "ms_since_progress": ms(now.saturating_duration_since(self.last_advance)),
            "ms_since_failure": self.failed_at.map(|t| ms(now.saturating_duration_since(t))),
        })
    }
}

/// A connection to another daemon's control channel: one JSON line out,
/// one JSON line back, as often as needed.
pub struct ControlSession {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

/// Write `msg` and a newline with one `write` (a JSON line of the local API
/// or the daemons' control channel). `writeln!` with a `Value` would issue a
/// write per formatting piece: tiny TCP segments, and a reader that sees the
/// line in fragments.
pub fn write_line(w: &mut (impl Write + ?Sized), msg: &Value) -> std::io::Result<()> {
    let mut line = msg.to_string();
    line.push('\n');
    w.write_all(line.as_bytes())?;
    w.flush()
}

impl ControlSession {
    pub fn connect(addr: &str) -> std::io::Result<Self> {
        let addr: SocketAddr = addr.parse().map_err(|_| std::io::Error::other(format!("bad address {addr:?}")))?;
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.set_nodelay(true)?;
        Ok(Self { reader: BufReader::new(stream.try_clone()?), writer: stream })
    }

    pub fn call(&mut self, msg: &Value) -> std::io::Result<Value> {
        write_line(&mut self.writer, msg)?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the peer closed the connection"));
        }
        serde_json::from_str(&line).map_err(std::io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(acked: u64) -> ProgressReport {
        ProgressReport { packets_acked: acked, tuples_acked: acked * 10, ..ProgressReport::default() }
    }

    #[test]
    fn only_reports_that_show_more_acknowledged_packets_restart_the_silence_clock() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let silence = ms(100);
        let mut link = SenderLink::new("127.0.0.1:9".into(), t0);
        assert_eq!(link.overdue(t0 + ms(99), silence), None);
        let why = link.overdue(t0 + ms(100), silence).unwrap();
        assert!(why.contains("no progress report for 100 ms"), "{why}");
        assert!(link.on_progress(report(1), t0 + ms(50)));
        // Reports keep coming, but nothing more is acknowledged: a sender
        // that is alive yet stuck (cut off from the switch) is still overdue.
        assert!(!link.on_progress(report(1), t0 + ms(120)));
        assert!(!link.on_progress(report(1), t0 + ms(149)));
        assert_eq!(link.overdue(t0 + ms(149), silence), None);
        assert!(link.overdue(t0 + ms(150), silence).unwrap().contains("no progress for 100 ms"));
    }

    #[test]
    fn a_finished_or_failed_link_is_never_overdue_and_fails_once() {
        let t0 = Instant::now();
        let late = t0 + Duration::from_secs(60);
        let mut done = SenderLink::new("a".into(), t0);
        done.finish();
        assert_eq!(done.overdue(late, Duration::from_millis(1)), None);
        assert!(!done.fail("x".into(), late), "a finished sender did not fail");
        let mut link = SenderLink::new("b".into(), t0);
        assert!(link.fail("gone".into(), t0));
        assert!(!link.fail("again".into(), t0));
        assert_eq!(link.overdue(late, Duration::from_millis(1)), None);
        let j = link.to_json(3, late);
        assert_eq!((j["channel"].as_u64(), j["state"].as_str(), j["reason"].as_str()), (Some(3), Some("failed"), Some("gone")));
        assert_eq!(j["sender"], "b");
    }

    #[test]
    fn progress_interval_is_a_fifth_of_the_silence_within_bounds() {
        assert_eq!(progress_interval(Duration::from_millis(1500)), Duration::from_millis(300));
        assert_eq!(progress_interval(Duration::from_millis(10)), Duration::from_millis(20));
        assert_eq!(progress_interval(Duration::from_secs(60)), Duration::from_secs(1));
    }
}
