//! NDP end hosts (Handley et al., SIGCOMM 2017) as used by the trimming paper:
//! the first `initial_window` packets go out unsolicited at line rate; every
//! other transmission, retransmissions included, needs a PULL from the
//! receiver's pull pacer. A NACK (trimmed header at the receiver) queues a
//! retransmission (sent on the next PULL, ahead of new data); a returned
//! header queues one and grants a credit, since the receiver never saw it;
//! a retransmission timeout is the fallback and also grants a credit.

use std::collections::VecDeque;

use serde::Serialize;

use crate::kernel::Ps;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeqState {
    InFlight,
    Acked,
    /// Waiting in the retransmission queue.
    Queued,
}

/// How a flow's sender decides what to send.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transport {
    /// NDP: the initial window unsolicited, then one packet per PULL.
    Ndp,
    /// A TCP-like window (the end-to-end baseline of the trimming paper,
    /// §6.5: kernel TCP over drop-tail switches): Reno's slow start and
    /// congestion avoidance on per-packet ACKs; a packet is lost when three
    /// packets sent after it were acknowledged (fast retransmit, the window
    /// halved once per window of data) or on the retransmission timeout
    /// (the window back to one packet).
    Window(WindowState),
}

/// Congestion state of a [`Transport::Window`] sender.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowState {
    pub cwnd: f64,
    pub ssthresh: f64,
    inflight: u32,
    highest_acked: Option<u32>,
    /// Losses of sequence numbers below this belong to the episode that
    /// already halved the window.
    recover: u32,
}

impl WindowState {
    /// Linux's initial window (10 packets), no ssthresh yet.
    pub fn reno() -> Self {
        Self { cwnd: 10.0, ssthresh: f64::INFINITY, inflight: 0, highest_acked: None, recover: 0 }
    }
}

/// One flow: sender state at `src`, receiver state at `dst`.
#[derive(Debug, Clone)]
pub struct Flow {
    pub src: u32,
    pub dst: u32,
    /// Packets to deliver; `u32::MAX` = until the end of the run.
    pub size_pkts: u32,
    pub start: Ps,
    // sender
    pub(crate) started: bool,
    pub(crate) next_seq: u32,
    /// Sequence numbers below this go out unsolicited (the initial window).
    pub(crate) initial_window: u32,
    /// Packets the sender may send beyond the initial window: one per PULL
    /// (plus one per returned header or timeout, which no PULL will cover).
    pub(crate) credit: u32,
    pub(crate) rtx: VecDeque<u32>,
    pub(crate) state: Vec<SeqState>,
    pub(crate) last_sent: Vec<Ps>,
    pub(crate) unacked: VecDeque<(u32, Ps)>,
    // receiver
    pub(crate) received: Vec<u64>,
    pub stats: FlowStats,
    pub transport: Transport,
    /// Bytes of each data packet (None: the network's MTU).
    pub pkt_size: Option<u32>,
    /// A flow to start, `delay` after this one is complete at its receiver
    /// (a request's response, the next request of a closed loop).
    pub then: Option<(u32, Ps)>,
    /// Started by another flow's `then`, not at a time of its own.
    pub(crate) triggered: bool,
}

/// What happened to one flow.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FlowStats {
    pub data_sent: u64,
    pub retransmissions: u64,
    pub timeouts: u64,
    pub nacks: u64,
    pub bounces: u64,
    pub pulls: u64,
    /// Distinct data packets received whole.
    pub delivered_pkts: u64,
    pub delivered_bytes: u64,
    pub duplicates: u64,
    pub headers_received: u64,
    pub finished_at_ps: Option<Ps>,
}

impl Flow {
    pub fn new(src: u32, dst: u32, size_pkts: u32, start: Ps, initial_window: u32) -> Self {
        Flow {
            src,
            dst,
            size_pkts,
            start,
            started: false,
            next_seq: 0,
            initial_window,
            credit: 0,
            rtx: VecDeque::new(),
            state: Vec::new(),
            last_sent: Vec::new(),
            unacked: VecDeque::new(),
            received: Vec::new(),
            stats: FlowStats::default(),
            transport: Transport::Ndp,
            pkt_size: None,
            then: None,
            triggered: false,
        }
    }

    pub fn is_finished(&self) -> bool {
        self.stats.finished_at_ps.is_some()
    }

    /// The next sequence number to send if the flow may send now.
    pub(crate) fn next_to_send(&mut self) -> Option<(u32, bool)> {
        if !self.started {
            return None;
        }
        if let Transport::Window(w) = &self.transport {
            if w.inflight as f64 >= w.cwnd.floor().max(1.0) {
                return None;
            }
            while let Some(seq) = self.rtx.pop_front() {
                if self.state[seq as usize] == SeqState::Queued {
                    return Some((seq, true));
                }
            }
            if self.next_seq < self.size_pkts {
                let seq = self.next_seq;
                self.next_seq += 1;
                self.state.push(SeqState::InFlight);
                self.last_sent.push(0);
                return Some((seq, false));
            }
            return None;
        }
        if self.credit > 0 {
            while let Some(seq) = self.rtx.pop_front() {
                if self.state[seq as usize] == SeqState::Queued {
                    return Some((seq, true));
                }
            }
        }
        if self.next_seq < self.size_pkts && (self.next_seq < self.initial_window || self.credit > 0) {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.state.push(SeqState::InFlight);
            self.last_sent.push(0);
            return Some((seq, false));
        }
        None
    }

    pub(crate) fn on_sent(&mut self, seq: u32, retransmit: bool, now: Ps) {
        match &mut self.transport {
            Transport::Window(w) => w.inflight += 1,
            Transport::Ndp if retransmit || seq >= self.initial_window => self.credit -= 1,
            Transport::Ndp => {}
        }
        self.state[seq as usize] = SeqState::InFlight;
        self.last_sent[seq as usize] = now;
        self.unacked.push_back((seq, now));
        self.stats.data_sent += 1;
        self.stats.retransmissions += retransmit as u64;
    }

    pub(crate) fn on_ack(&mut self, seq: u32) {
        let Some(s) = self.state.get_mut(seq as usize) else { return };
        let was_in_flight = *s == SeqState::InFlight;
        *s = SeqState::Acked;
        let Transport::Window(w) = &mut self.transport else { return };
        if !was_in_flight {
            return; // a duplicate, or the ACK of a copy already given up
        }
        w.inflight -= 1;
        w.cwnd += if w.cwnd < w.ssthresh { 1.0 } else { 1.0 / w.cwnd };
        w.highest_acked = Some(w.highest_acked.map_or(seq, |h| h.max(seq)));
        let highest = w.highest_acked.unwrap_or(0);
        // fast retransmit: the oldest packets in flight that three later
        // packets overtook
        while let Some(&(old, t)) = self.unacked.front() {
            let i = old as usize;
            if self.state[i] != SeqState::InFlight || self.last_sent[i] != t {
                self.unacked.pop_front();
                continue;
            }
            if old + 3 > highest {
                break;
            }
            self.unacked.pop_front();
            self.state[i] = SeqState::Queued;
            self.rtx.push_back(old);
            w.inflight -= 1;
            if old >= w.recover {
                w.ssthresh = (w.cwnd / 2.0).max(2.0);
                w.cwnd = w.ssthresh;
                w.recover = self.next_seq;
            }
        }
    }

    /// A NACK or a returned header: queue the retransmission.
    pub(crate) fn on_loss(&mut self, seq: u32) {
        if let Some(s) = self.state.get_mut(seq as usize) {
            if *s == SeqState::InFlight {
                *s = SeqState::Queued;
                self.rtx.push_back(seq);
                if let Transport::Window(w) = &mut self.transport {
                    w.inflight -= 1;
                }
            }
        }
    }

    /// Retransmission-timeout scan. Returns the earliest pending deadline.
    pub(crate) fn on_rto_check(&mut self, now: Ps, rto: Ps) -> Option<Ps> {
        while let Some(&(seq, t)) = self.unacked.front() {
            let i = seq as usize;
            if self.state[i] != SeqState::InFlight || self.last_sent[i] != t {
                self.unacked.pop_front();
            } else if t + rto <= now {
                self.unacked.pop_front();
                self.state[i] = SeqState::Queued;
                self.rtx.push_back(seq);
                match &mut self.transport {
                    // the fallback resends without waiting for a pull
                    Transport::Ndp => self.credit += 1,
                    Transport::Window(w) => {
                        w.inflight -= 1;
                        w.ssthresh = (w.cwnd / 2.0).max(2.0);
                        w.cwnd = 1.0;
                        w.recover = self.next_seq;
                    }
                }
                self.stats.timeouts += 1;
            } else {
                return Some(t + rto);
            }
        }
        None
    }

    /// Receiver side: a whole data packet arrived. Returns true if new.
    pub(crate) fn on_receive(&mut self, seq: u32, bytes: u32, now: Ps) -> bool {
        let (w, b) = ((seq / 64) as usize, seq % 64);
        if self.received.len() <= w {
            self.received.resize(w + 1, 0);
        }
        if self.received[w] & (1 << b) != 0 {
            self.stats.duplicates += 1;
            return false;
        }
        self.received[w] |= 1 << b;
        self.stats.delivered_pkts += 1;
        self.stats.delivered_bytes += bytes as u64;
        if self.stats.delivered_pkts == self.size_pkts as u64 {
            self.stats.finished_at_ps = Some(now);
        }
        true
    }
}
