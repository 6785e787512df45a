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

/// One NDP flow: sender state at `src`, receiver state at `dst`.
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
        if retransmit || seq >= self.initial_window {
            self.credit -= 1;
        }
        self.state[seq as usize] = SeqState::InFlight;
        self.last_sent[seq as usize] = now;
        self.unacked.push_back((seq, now));
        self.stats.data_sent += 1;
        self.stats.retransmissions += retransmit as u64;
    }

    pub(crate) fn on_ack(&mut self, seq: u32) {
        if let Some(s) = self.state.get_mut(seq as usize) {
            *s = SeqState::Acked;
        }
    }

    /// A NACK or a returned header: queue the retransmission.
    pub(crate) fn on_loss(&mut self, seq: u32) {
        if let Some(s) = self.state.get_mut(seq as usize) {
            if *s == SeqState::InFlight {
                *s = SeqState::Queued;
                self.rtx.push_back(seq);
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
                self.credit += 1; // the fallback resends without waiting for a pull
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
