//! An in-memory network for one key-value task: senders, one switch, one
//! receiver, links with a fixed delay plus optional seeded loss,
//! duplication and jitter (which reorders). It drives the real machines with
//! virtual time, so tests, property tests and the prioritisation benchmark
//! run exactly the code the daemon runs.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{KvReceiver, KvSender, KvSwitch, ReceiverEvent, SenderEvent};
use crate::fault::SplitMix64;
use crate::time::Time;
use crate::transmit::VecTransmit;

/// A host attached to the switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Node {
    Sender(usize),
    Receiver,
}

/// Link behaviour, applied to every datagram on every hop.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkConfig {
    pub delay_ns: u64,
    /// Extra uniform delay in `0..jitter_ns`; reorders when non-zero.
    pub jitter_ns: u64,
    pub loss: f64,
    pub duplicate: f64,
    pub seed: u64,
}

impl LinkConfig {
    pub fn perfect() -> Self {
        Self { delay_ns: 1_000, jitter_ns: 0, loss: 0.0, duplicate: 0.0, seed: 0 }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Hop {
    ToSwitch(Node),
    ToHost(Node),
}

/// What ended a run.
#[derive(Debug, Clone, PartialEq)]
pub enum RunOutcome {
    /// Every sender finished and the receiver has its results.
    Finished,
    SenderFailed(usize, super::SenderError),
    ReceiverFailed(super::ReceiverError),
    /// Nothing to deliver and no timer armed.
    Stalled,
    /// `deadline` passed first.
    TimedOut,
}

/// Decides, per datagram, whether to drop it (exact traces).
pub type DropFilter = Box<dyn FnMut(&Direction, &[u8]) -> bool>;
/// (due time, order, hop, bytes), earliest first.
type Scheduled = Reverse<(u64, u64, Hop, Vec<u8>)>;

pub struct Loopback {
    pub switch: KvSwitch<Node>,
    pub senders: Vec<KvSender>,
    pub receiver: KvReceiver,
    pub link: LinkConfig,
    /// Drop every datagram for which this returns true (exact traces).
    pub filter: Option<DropFilter>,
    now: Time,
    rng: SplitMix64,
    order: u64,
    queue: BinaryHeap<Scheduled>,
    pub datagrams: u64,
    /// `run` also waits for the receiver to release the switch region.
    pub wait_for_release: bool,
    /// Senders that died ([`Loopback::kill_sender`]): not driven any more,
    /// datagrams to them vanish.
    dead: Vec<bool>,
    /// The receiver reported `Incomplete` with these channels.
    pub incomplete: Option<Vec<u16>>,
}

/// The hop a datagram is about to take, as the filter sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From this host to the switch.
    Up(Node),
    /// From the switch to this host.
    Down(Node),
}

impl Loopback {
    pub fn new(switch: KvSwitch<Node>, senders: Vec<KvSender>, receiver: KvReceiver, link: LinkConfig) -> Self {
        let rng = SplitMix64::new(link.seed);
        let dead = vec![false; senders.len()];
        Self {
            switch,
            senders,
            receiver,
            link,
            filter: None,
            now: Time::ZERO,
            rng,
            order: 0,
            queue: BinaryHeap::new(),
            datagrams: 0,
            wait_for_release: false,
            dead,
            incomplete: None,
        }
    }

    /// Sender `i` dies now (a killed process): it sends nothing more and
    /// what is on its way to it is lost. Its datagrams already on the wire
    /// still arrive, as they would.
    pub fn kill_sender(&mut self, i: usize) {
        self.dead[i] = true;
    }

    pub fn now(&self) -> Time {
        self.now
    }

    fn schedule(&mut self, hop: Hop, mut bytes: Vec<u8>) {
        let view = match hop {
            Hop::ToSwitch(n) => Direction::Up(n),
            Hop::ToHost(n) => Direction::Down(n),
        };
        if let Some(f) = self.filter.as_mut() {
            if f(&view, &bytes) {
                return;
            }
        }
        if self.link.loss > 0.0 && self.rng.next_f64() < self.link.loss {
            return;
        }
        let copies = if self.link.duplicate > 0.0 && self.rng.next_f64() < self.link.duplicate { 2 } else { 1 };
        for copy in (0..copies).rev() {
            let jitter = if self.link.jitter_ns > 0 { self.rng.below(self.link.jitter_ns) } else { 0 };
            let at = self.now.as_nanos() + self.link.delay_ns + jitter;
            self.order += 1;
            let b = if copy == 0 { std::mem::take(&mut bytes) } else { bytes.clone() };
            self.queue.push(Reverse((at, self.order, hop.clone(), b)));
        }
    }

    fn transmit_hosts(&mut self) {
        let mut out = VecTransmit::new();
        for i in 0..self.senders.len() {
            if self.dead[i] {
                continue;
            }
            while self.senders[i].poll_transmit(self.now, &mut out) > 0 {
                for (_, b) in out.drain() {
                    self.schedule(Hop::ToSwitch(Node::Sender(i)), b);
                }
            }
        }
        while self.receiver.poll_transmit(self.now, &mut out) > 0 {
            for (_, b) in out.drain() {
                self.schedule(Hop::ToSwitch(Node::Receiver), b);
            }
        }
    }

    fn next_timer(&self) -> Option<Time> {
        let s = self.senders.iter().zip(&self.dead).filter(|(_, d)| !**d).filter_map(|(s, _)| s.poll_timeout());
        s.chain(self.receiver.poll_timeout()).chain(self.switch.poll_timeout()).min()
    }

    /// Deliver one datagram (already due).
    fn deliver(&mut self, hop: Hop, bytes: Vec<u8>) {
        self.datagrams += 1;
        match hop {
            Hop::ToSwitch(from) => {
                let mut out = VecTransmit::new();
                self.switch.handle_datagram(self.now, from, &bytes, &mut out);
                for (to, b) in out.drain() {
                    self.schedule(Hop::ToHost(to), b);
                }
            }
            Hop::ToHost(Node::Sender(i)) if self.dead[i] => {}
            Hop::ToHost(Node::Sender(i)) => self.senders[i].handle_datagram(self.now, &bytes),
            Hop::ToHost(Node::Receiver) => self.receiver.handle_datagram(self.now, &bytes),
        }
    }

    /// Run until every machine is finished (or failed), nothing can happen
    /// any more, or `deadline`.
    pub fn run(&mut self, deadline: Time) -> RunOutcome {
        loop {
            self.transmit_hosts();
            for (i, s) in self.senders.iter_mut().enumerate().filter(|(i, _)| !self.dead[*i]) {
                while let Some(ev) = s.poll_event() {
                    if let SenderEvent::Failed(e) = ev {
                        return RunOutcome::SenderFailed(i, e);
                    }
                }
            }
            while let Some(ev) = self.receiver.poll_event() {
                match ev {
                    ReceiverEvent::Failed(e) => return RunOutcome::ReceiverFailed(e),
                    ReceiverEvent::Incomplete { failed } => self.incomplete = Some(failed),
                    ReceiverEvent::Finished => {}
                }
            }
            let receiver_done = if self.wait_for_release { self.receiver.is_released() } else { self.receiver.is_done() };
            let senders_done = self.senders.iter().zip(&self.dead).all(|(s, d)| *d || s.is_done());
            if receiver_done && senders_done && self.queue.is_empty() {
                return RunOutcome::Finished;
            }
            let next_packet = self.queue.peek().map(|Reverse((at, ..))| Time::from_nanos(*at));
            let Some(next) = next_packet.into_iter().chain(self.next_timer()).min() else {
                return RunOutcome::Stalled;
            };
            if next > deadline {
                return RunOutcome::TimedOut;
            }
            self.now = self.now.max(next);
            while self.queue.peek().is_some_and(|Reverse((at, ..))| *at <= self.now.as_nanos()) {
                let Reverse((_, _, hop, bytes)) = self.queue.pop().expect("peeked");
                self.deliver(hop, bytes);
            }
            for (s, _) in self.senders.iter_mut().zip(&self.dead).filter(|(_, d)| !**d) {
                if s.poll_timeout().is_some_and(|t| t <= self.now) {
                    s.handle_timeout(self.now);
                }
            }
            if self.receiver.poll_timeout().is_some_and(|t| t <= self.now) {
                self.receiver.handle_timeout(self.now);
            }
            if self.switch.poll_timeout().is_some_and(|t| t <= self.now) {
                self.switch.handle_timeout(self.now);
            }
        }
    }
}
