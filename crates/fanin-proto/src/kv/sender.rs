//! A key-value sender (one data channel of one task), as a sans-IO machine.
//!
//! Tuples pushed with [`KvSender::push`] are placed by the sender-assisted
//! key-space partition (§3.2.2): a short key into the short slot
//! `hash(key) % short_slots`, a medium key into the coalesced group
//! `hash(key) % medium_groups`, a long key into `LongData` packets that
//! bypass the switch's aggregators. A packet takes the oldest queued tuple
//! of every slot (blank slots have their bit clear). A key longer than
//! `whole_key_len` travels in fragments, one per `LongData` packet (flag
//! `KEY_FRAGMENT`); the last fragment is sent only once every earlier one
//! is acknowledged, so an acknowledged last fragment means the receiver
//! holds the whole key (docs/kv.md, "Keys of any length").
//!
//! Reliability (§3.3): the packets unacknowledged span at most `window`
//! (W) seqs; a
//! packet is retransmitted only when its own fine timeout expires,
//! never because a later ACK arrived first (the switch and the receiver both
//! acknowledge, so ACKs come out of order by design). When every packet is
//! acknowledged and [`KvSender::finish`] was called, a FIN goes to the
//! receiver and is repeated until its FIN-ACK arrives.
//!
//! Congestion (not in ASK; [`KvCongestion`], docs/kv.md "Congestion"):
//! with `congestion` on (the default) at most `cwnd` of those packets are
//! unacknowledged, `cwnd` halving when a packet's timeout expires, and
//! the timeout follows the measured round trip (`rto` is only its value
//! before the first one), doubling with each resend of a packet.
//!
//! With `auth_key` (the channel's member key, docs/security.md) every
//! datagram it sends is sealed, each transmission with a fresh sequence
//! number, and a datagram from the switch that does not verify is dropped
//! and counted in [`SenderStats::auth`] before anything else reads it.
//!
//! **Calling contract**: `push` / `finish` (application), then loop:
//! `poll_transmit(now, out)` until it returns 0 (each call writes at most
//! `max_burst` datagrams) and send what it wrote to the switch; wait for
//! a datagram or `poll_timeout()`; `handle_datagram(now, bytes)` /
//! `handle_timeout(now)`; `poll_event()` until `None`.

use std::collections::VecDeque;
use std::time::Duration;

use fanin_wire::kv::{
    emit_key_fragment, emit_long_tuple, Nack, NackReason, Packet, Repr, FLAG_BY_SWITCH, FLAG_KEY_FRAGMENT,
    FRAGMENT_FIXED, HEADER_LEN, LONG_TUPLE_FIXED,
};
use fanin_wire::MessageType;

use super::congestion::{KvCongestion, KvCongestionStats, DEFAULT_MIN_RTO};
use super::layout::{encode_parts_into, KeyClass, Layout, LayoutError};
use super::sealing::{host_send, host_send_copy, unsealed_unknown_task, AuthStats, HostAuth};
use crate::auth::Key;
use crate::time::Time;
use crate::transmit::Transmit;

#[derive(Debug, Clone, PartialEq)]
pub struct SenderConfig {
    pub task_id: u32,
    pub channel: u16,
    pub layout: Layout,
    /// W: most unacknowledged packets; must not exceed the task's window.
    pub window: u32,
    /// The fine retransmission timeout (ASK: 100 µs); with `congestion`
    /// on, only until the first round trip is measured.
    pub rto: Duration,
    /// Adapt the window and the timeout to the path ([`KvCongestion`]);
    /// off: ASK's fixed window W and fixed timeout `rto`.
    pub congestion: bool,
    /// The shortest timeout the round-trip estimate may set.
    pub min_rto: Duration,
    /// Fail when nothing was acknowledged for this long.
    pub dead_after: Duration,
    /// Longest key accepted (the bound a receiver's reassembly memory
    /// needs; default 64 MiB).
    pub max_key_len: usize,
    /// Longest key sent whole in one `LongData` tuple; longer ones travel
    /// in fragments of about `long_packet_bytes`.
    pub whole_key_len: usize,
    /// Target body size of a `LongData` packet.
    pub long_packet_bytes: usize,
    /// Most datagrams one `poll_transmit` writes.
    pub max_burst: usize,
    /// The channel's member key of a keyed task (`channel_key`); `None`:
    /// the task is not keyed.
    pub auth_key: Option<Key>,
    /// Wall clock in microseconds: where sealed sequence numbers start.
    pub seal_clock_us: u64,
}

/// Default longest key (64 MiB): no token of a real corpus comes near it,
/// and a receiver reassembling one holds at most this much per key.
pub const MAX_KEY_LEN: usize = 64 << 20;

impl SenderConfig {
    pub fn new(task_id: u32, channel: u16, layout: Layout) -> Self {
        Self {
            task_id,
            channel,
            layout,
            window: 256,
            rto: Duration::from_micros(100),
            congestion: true,
            min_rto: DEFAULT_MIN_RTO,
            dead_after: Duration::from_secs(10),
            max_key_len: MAX_KEY_LEN,
            whole_key_len: 1024,
            long_packet_bytes: 1200,
            max_burst: 64,
            auth_key: None,
            seal_clock_us: 1,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SenderError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("window must be 1..=4096, got {0}")]
    Window(u32),
    #[error("key of {len} bytes exceeds the limit of {max} bytes")]
    KeyTooLong { len: usize, max: usize },
    #[error("push after finish(): the task's input is closed")]
    Finished,
    #[error("nothing was acknowledged for {0:?}: is the receiver (and the switch) still there?")]
    PeerSilent(Duration),
    #[error("the switch refused task {task_id}: {} (detail {detail})", reason.describe())]
    Refused { task_id: u32, reason: NackReason, detail: u32 },
    #[error("channel {channel} of task {task_id} has sent {} datagrams, as many as its 32-bit sequence numbers \
             count (they are not reused within a task): split the input over more channels or tasks", u32::MAX)]
    SequenceExhausted { task_id: u32, channel: u16 },
}

#[derive(Debug, Clone, PartialEq)]
pub enum SenderEvent {
    /// Every tuple was acknowledged and the FIN was acknowledged.
    Finished,
    Failed(SenderError),
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SenderStats {
    pub tuples: u64,
    pub long_tuples: u64,
    /// Keys longer than `whole_key_len`, sent in fragments.
    pub fragmented_keys: u64,
    pub packets: u64,
    /// Bytes of the packets' first transmissions as they leave (sealed
    /// size; no IP or UDP header): what the channel had to carry at least.
    pub first_bytes: u64,
    pub retransmissions: u64,
    pub acks_from_switch: u64,
    pub acks_from_receiver: u64,
    pub duplicate_acks: u64,
    /// Datagrams refused before they were read (keyed tasks).
    pub auth: AuthStats,
    /// Timeouts, window cuts and round-trip samples.
    pub congestion: KvCongestionStats,
    /// The window and the first-send timeout (µs) now.
    pub cwnd: u32,
    pub rto_us: u64,
}

/// How far a sender got, for its daemon's progress reports (liveness at
/// the receiver's daemon, and what a failed channel contributed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SenderProgress {
    /// Tuples pushed so far.
    pub tuples_pushed: u64,
    /// Tuples in acknowledged packets. An acknowledged tuple is aggregated
    /// (in the switch, or by the receiver before it acknowledged), so it is
    /// in the task's results even if this sender dies now.
    pub tuples_acked: u64,
    /// The first `acked_prefix` pushed tuples are all acknowledged (tuples
    /// travel out of push order: per-slot queues, long keys apart).
    pub acked_prefix: u64,
    /// Packets sent (the next seq) and packets acknowledged.
    pub packets_sent: u32,
    pub packets_acked: u64,
    /// The FIN was acknowledged.
    pub finished: bool,
    /// Unsealed Nack UnknownTask replies to a keyed sender: the switch may
    /// have lost the task (a restart), or someone forged them. The machine
    /// cannot tell; its daemon asks the switch's control API.
    pub unknown_task_hints: u64,
}

struct InFlight {
    seq: u32,
    bytes: Vec<u8>,
    /// First transmission (round-trip samples) and resends since.
    sent_at: Time,
    resends: u32,
    deadline: Time,
    acked: bool,
    /// Push index of the oldest tuple in the packet and how many it holds
    /// (progress accounting; a key's fragments hold it in the last one).
    first: u64,
    tuples: u32,
    /// A fragment of the key pushed with this index, but not its last.
    fragment_of: Option<u64>,
}

/// A key being sent in fragments.
struct Fragmenting {
    index: u64,
    key: Vec<u8>,
    value: i64,
    /// Bytes of the key already sent.
    offset: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Sending,
    FinWait { deadline: Time },
    Done,
    Failed,
}

pub struct KvSender {
    config: SenderConfig,
    // Queued tuples carry their push index (progress accounting).
    short: Vec<VecDeque<(u64, u64, i64)>>,
    medium: Vec<VecDeque<(u64, i64)>>,
    /// The key parts of each medium group's queued tuples, `medium_parts`
    /// words per tuple in queue order (flat: no allocation per tuple).
    medium_words: Vec<VecDeque<u64>>,
    /// Buffers of acknowledged packets, reused for new ones.
    spare: Vec<Vec<u8>>,
    long: VecDeque<(u64, Vec<u8>, i64)>,
    /// The key at the head of `long` once its fragments started.
    fragmenting: Option<Fragmenting>,
    queued: usize,
    tuples_acked: u64,
    packets_acked: u64,
    unknown_task_hints: u64,
    input_closed: bool,
    next_seq: u32,
    /// Unacknowledged packets in seq order; front is the window base.
    inflight: VecDeque<InFlight>,
    /// Packets in `inflight` not yet acknowledged.
    outstanding: u32,
    cc: KvCongestion,
    state: State,
    last_progress: Time,
    events: VecDeque<SenderEvent>,
    stats: SenderStats,
    auth: Option<HostAuth>,
}

impl KvSender {
    pub fn new(config: SenderConfig, now: Time) -> Result<Self, SenderError> {
        config.layout.validate()?;
        if config.window == 0 || config.window > 4096 {
            return Err(SenderError::Window(config.window));
        }
        Ok(Self {
            short: vec![VecDeque::new(); config.layout.short_slots as usize],
            medium: vec![VecDeque::new(); config.layout.medium_groups as usize],
            medium_words: vec![VecDeque::new(); config.layout.medium_groups as usize],
            spare: Vec::new(),
            long: VecDeque::new(),
            fragmenting: None,
            queued: 0,
            tuples_acked: 0,
            packets_acked: 0,
            unknown_task_hints: 0,
            input_closed: false,
            next_seq: 0,
            inflight: VecDeque::new(),
            outstanding: 0,
            cc: KvCongestion::new(config.congestion, config.window, config.rto, config.min_rto),
            state: State::Sending,
            last_progress: now,
            events: VecDeque::new(),
            stats: SenderStats::default(),
            auth: config.auth_key.map(|k| HostAuth::new(k, config.seal_clock_us)),
            config,
        })
    }

    pub fn stats(&self) -> SenderStats {
        SenderStats {
            congestion: self.cc.stats(),
            cwnd: self.cc.window(),
            rto_us: self.cc.rto().as_micros() as u64,
            ..self.stats
        }
    }
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }
    /// Tuples pushed but not yet in a packet. A driver streaming a large
    /// input pushes more when this runs low, instead of queueing it all.
    pub fn queued(&self) -> usize {
        self.queued
    }
    /// Packets sent so far (the next seq).
    pub fn next_seq(&self) -> u32 {
        self.next_seq
    }

    /// How far the sender got. O(slots + W): call it for periodic reports,
    /// not per datagram.
    pub fn progress(&self) -> SenderProgress {
        let pushed = self.stats.tuples;
        let queued = self.short.iter().filter_map(|q| q.front().map(|t| t.0));
        let queued = queued.chain(self.medium.iter().filter_map(|q| q.front().map(|t| t.0)));
        let queued = queued.chain(self.long.front().map(|t| t.0)).chain(self.fragmenting.as_ref().map(|f| f.index));
        let unacked = self.inflight.iter().filter(|p| !p.acked && p.tuples > 0).map(|p| p.first);
        SenderProgress {
            tuples_pushed: pushed,
            tuples_acked: self.tuples_acked,
            acked_prefix: queued.chain(unacked).min().unwrap_or(pushed),
            packets_sent: self.next_seq,
            packets_acked: self.packets_acked,
            finished: self.state == State::Done,
            unknown_task_hints: self.unknown_task_hints,
        }
    }

    /// Queue one tuple.
    pub fn push(&mut self, key: &[u8], value: i64) -> Result<(), SenderError> {
        if self.input_closed {
            return Err(SenderError::Finished);
        }
        if key.len() > self.config.max_key_len || key.len() > u32::MAX as usize {
            return Err(SenderError::KeyTooLong { len: key.len(), max: self.config.max_key_len });
        }
        let index = self.stats.tuples;
        match self.config.layout.classify(key) {
            KeyClass::Short { slot, part } => self.short[slot as usize].push_back((index, part, value)),
            KeyClass::Medium { group, .. } => {
                self.medium[group as usize].push_back((index, value));
                encode_parts_into(key, self.config.layout.medium_parts as usize, &mut self.medium_words[group as usize]);
            }
            KeyClass::Long => {
                self.long.push_back((index, key.to_vec(), value));
                self.stats.long_tuples += 1;
            }
        }
        self.queued += 1;
        self.stats.tuples += 1;
        Ok(())
    }

    /// No more tuples: send what is queued, then FIN.
    pub fn finish(&mut self) {
        self.input_closed = true;
    }

    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.events.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Time> {
        match self.state {
            State::Sending => {
                let rto = self.inflight.iter().filter(|p| !p.acked).map(|p| p.deadline).min();
                let dead = (!self.inflight.is_empty()).then(|| self.last_progress + self.config.dead_after);
                rto.into_iter().chain(dead).min()
            }
            State::FinWait { deadline } => Some(deadline.min(self.last_progress + self.config.dead_after)),
            State::Done | State::Failed => None,
        }
    }

    /// Fail if the peers have been silent too long. Retransmissions happen in
    /// `poll_transmit`.
    pub fn handle_timeout(&mut self, now: Time) {
        let waiting = match self.state {
            State::Sending => !self.inflight.is_empty(),
            State::FinWait { .. } => true,
            _ => false,
        };
        if waiting && now >= self.last_progress + self.config.dead_after {
            self.fail(SenderError::PeerSilent(self.config.dead_after));
        }
    }

    fn fail(&mut self, err: SenderError) {
        if !matches!(self.state, State::Done | State::Failed) {
            self.state = State::Failed;
            self.events.push_back(SenderEvent::Failed(err));
        }
    }

    pub fn handle_datagram(&mut self, now: Time, bytes: &[u8]) {
        let bytes = match &mut self.auth {
            Some(auth) => match auth.open(bytes, &mut self.stats.auth) {
                Some(inner) => inner,
                None => {
                    if unsealed_unknown_task(bytes, self.config.task_id) {
                        self.unknown_task_hints += 1;
                    }
                    return;
                }
            },
            None => bytes,
        };
        let Ok(p) = Packet::new_checked(bytes) else { return };
        if p.task_id() != self.config.task_id || p.channel() != self.config.channel {
            return;
        }
        match p.msg_type() {
            MessageType::KvAck => self.on_ack(now, p.seq(), p.flags() & FLAG_BY_SWITCH != 0),
            MessageType::KvFinAck if matches!(self.state, State::FinWait { .. }) && p.seq() == self.next_seq => {
                {
                    self.state = State::Done;
                    self.last_progress = now;
                    self.events.push_back(SenderEvent::Finished);
                }
            }
            MessageType::KvNack => {
                if let Ok(n) = Nack::parse(p.body()) {
                    self.fail(SenderError::Refused { task_id: p.task_id(), reason: n.reason, detail: n.detail });
                }
            }
            _ => {}
        }
    }

    fn on_ack(&mut self, now: Time, seq: u32, by_switch: bool) {
        let Some(base) = self.inflight.front().map(|p| p.seq) else {
            self.stats.duplicate_acks += 1;
            return;
        };
        let Some(i) = seq.checked_sub(base).map(|d| d as usize).filter(|&i| i < self.inflight.len()) else {
            self.stats.duplicate_acks += 1;
            return;
        };
        let pkt = &mut self.inflight[i];
        if pkt.acked {
            self.stats.duplicate_acks += 1;
            return;
        }
        pkt.acked = true;
        self.outstanding -= 1;
        let rtt = (pkt.resends == 0).then(|| now.saturating_since(pkt.sent_at));
        self.cc.on_ack(rtt, by_switch);
        self.tuples_acked += pkt.tuples as u64;
        self.packets_acked += 1;
        if by_switch {
            self.stats.acks_from_switch += 1;
        } else {
            self.stats.acks_from_receiver += 1;
        }
        self.last_progress = now;
        while self.inflight.front().is_some_and(|p| p.acked) {
            let done = self.inflight.pop_front().expect("checked");
            if self.spare.len() < self.config.window as usize {
                self.spare.push(done.bytes);
            }
        }
    }

    /// Write retransmissions, then new packets (window permitting), then the
    /// FIN. Returns the number of datagrams written.
    pub fn poll_transmit(&mut self, now: Time, out: &mut impl Transmit<()>) -> usize {
        let mut sent = 0;
        match self.state {
            State::Sending => {}
            State::FinWait { deadline } => {
                if now >= deadline {
                    self.emit_fin(out);
                    self.state = State::FinWait { deadline: now + self.fin_rto() };
                    return 1;
                }
                return 0;
            }
            _ => return 0,
        }
        for pkt in self.inflight.iter_mut() {
            if sent >= self.config.max_burst {
                return sent;
            }
            if !pkt.acked && now >= pkt.deadline {
                self.cc.on_timeout(pkt.seq, self.next_seq);
                host_send_copy(self.auth.as_mut(), out, &pkt.bytes);
                pkt.resends += 1;
                pkt.deadline = now + self.cc.backed_off_rto(pkt.resends);
                self.stats.retransmissions += 1;
                sent += 1;
            }
        }
        while sent < self.config.max_burst
            && (self.next_seq - self.base()) < self.config.window
            && self.outstanding < self.cc.window()
        {
            if self.next_seq == u32::MAX && self.queued > 0 {
                // The FIN carries the count of datagrams sent, so u32::MAX
                // is the last number; wrapping would meet the switch's and
                // the receiver's windows of this channel as stale (a
                // misleading PeerSilent at best).
                let (task_id, channel) = (self.config.task_id, self.config.channel);
                self.fail(SenderError::SequenceExhausted { task_id, channel });
                return sent;
            }
            let Some((bytes, first, tuples, fragment_of)) = self.build_packet() else { break };
            host_send_copy(self.auth.as_mut(), out, &bytes);
            let sealed = if self.auth.is_some() { fanin_wire::auth::TRAILER_LEN } else { 0 };
            self.stats.first_bytes += (bytes.len() + sealed) as u64;
            let deadline = now + self.cc.rto();
            self.inflight.push_back(InFlight { seq: self.next_seq, bytes, sent_at: now, resends: 0, deadline,
                                               acked: false, first, tuples, fragment_of });
            self.outstanding += 1;
            self.next_seq += 1;
            self.stats.packets += 1;
            sent += 1;
        }
        if self.input_closed && self.queued == 0 && self.inflight.is_empty() && sent < self.config.max_burst {
            self.emit_fin(out);
            self.state = State::FinWait { deadline: now + self.fin_rto() };
            self.last_progress = now;
            sent += 1;
        }
        sent
    }

    /// Start numbering datagrams at `seq` (tests: a channel near the end
    /// of its sequence numbers without sending 2^32 datagrams).
    #[cfg(test)]
    pub(super) fn set_next_seq(&mut self, seq: u32) {
        self.next_seq = seq;
    }

    /// How long a FIN waits for its FIN-ACK before it is sent again: never
    /// longer than `rto`, the configured timeout, however long the round
    /// trip measured. The receiver answers repeated FINs only while it
    /// lingers after the task's end; a FIN resent after that meets a task
    /// the switch no longer holds (and a FIN is a few bytes).
    fn fin_rto(&self) -> Duration {
        self.cc.rto().min(self.config.rto)
    }

    fn base(&self) -> u32 {
        self.inflight.front().map_or(self.next_seq, |p| p.seq)
    }

    fn emit_fin(&mut self, out: &mut impl Transmit<()>) {
        let repr = Repr::new(MessageType::KvFin, self.config.task_id, self.config.channel, self.next_seq);
        host_send(self.auth.as_mut(), out, HEADER_LEN, |buf| repr.emit(&mut Packet::new_unchecked(buf)));
    }

    /// The next packet, if the queues hold enough: a full packet's worth of
    /// tuples, or anything once the input is closed. With the push index of
    /// its oldest tuple, its tuple count, and the key it is a non-final
    /// fragment of.
    fn build_packet(&mut self) -> Option<(Vec<u8>, u64, u32, Option<u64>)> {
        let layout = self.config.layout;
        let short_medium = self.queued - self.long.len() - self.fragmenting.is_some() as usize;
        let enough = short_medium >= layout.slot_count() || (self.input_closed && short_medium > 0);
        if !enough {
            return self.build_long();
        }
        let repr = Repr {
            slot_count: layout.slot_count() as u8,
            ..Repr::new(MessageType::KvData, self.config.task_id, self.config.channel, self.next_seq)
        };
        let mut bytes = self.spare.pop().unwrap_or_default();
        bytes.clear();
        bytes.resize(repr.buffer_len(), 0);
        let mut p = Packet::new_unchecked(&mut bytes[..]);
        repr.emit(&mut p);
        let mut bitmap = 0u64;
        let (mut first, mut tuples) = (u64::MAX, 0u32);
        for (slot, q) in self.short.iter_mut().enumerate() {
            if let Some((index, part, value)) = q.pop_front() {
                p.set_slot(slot, part.to_be_bytes(), value);
                bitmap |= 1 << slot;
                self.queued -= 1;
                first = first.min(index);
                tuples += 1;
            }
        }
        let parts = layout.medium_parts as usize;
        for (g, (q, words)) in self.medium.iter_mut().zip(&mut self.medium_words).enumerate() {
            if let Some((index, value)) = q.pop_front() {
                first = first.min(index);
                tuples += 1;
                let first = layout.group_first_slot(g as u8) as usize;
                for (j, part) in words.drain(..parts).enumerate() {
                    // ASK: (key, val) = {(key_1, 0), ..., (key_k, val)}
                    p.set_slot(first + j, part.to_be_bytes(), if j + 1 == parts { value } else { 0 });
                }
                bitmap |= layout.group_mask(g as u8);
                self.queued -= 1;
            }
        }
        p.set_bitmap(bitmap);
        Some((bytes, first, tuples, None))
    }

    fn build_long(&mut self) -> Option<(Vec<u8>, u64, u32, Option<u64>)> {
        if self.fragmenting.is_some() {
            return self.build_fragment();
        }
        if self.long.is_empty() || !(self.input_closed || self.long_bytes_queued() >= self.config.long_packet_bytes) {
            return None;
        }
        if self.long.front().is_some_and(|(_, k, _)| k.len() > self.config.whole_key_len) {
            let (index, key, value) = self.long.pop_front().expect("checked");
            self.fragmenting = Some(Fragmenting { index, key, value, offset: 0 });
            self.stats.fragmented_keys += 1;
            return self.build_fragment();
        }
        let mut take = 0usize;
        let mut len = 0usize;
        for (_, k, _) in self.long.iter() {
            let l = LONG_TUPLE_FIXED + k.len();
            if k.len() > self.config.whole_key_len
                || (take > 0 && (len + l > self.config.long_packet_bytes || take == u8::MAX as usize))
            {
                break;
            }
            take += 1;
            len += l;
        }
        let repr = Repr {
            slot_count: take as u8,
            ..Repr::new(MessageType::KvLongData, self.config.task_id, self.config.channel, self.next_seq)
        };
        let mut bytes = vec![0u8; HEADER_LEN + len];
        let mut p = Packet::new_unchecked(&mut bytes[..]);
        repr.emit(&mut p);
        let mut at = 0;
        let mut first = u64::MAX;
        for (index, k, v) in self.long.drain(..take) {
            at += emit_long_tuple(&k, v, &mut p.body_mut()[at..]);
            first = first.min(index);
        }
        self.queued -= take;
        Some((bytes, first, take as u32, None))
    }

    /// The next fragment of the key being fragmented; its last only once
    /// every earlier fragment is acknowledged.
    fn build_fragment(&mut self) -> Option<(Vec<u8>, u64, u32, Option<u64>)> {
        let f = self.fragmenting.as_ref()?;
        let room = self.config.long_packet_bytes.saturating_sub(FRAGMENT_FIXED + LONG_TUPLE_FIXED).clamp(64, u16::MAX as usize);
        let len = room.min(f.key.len() - f.offset);
        let last = f.offset + len == f.key.len();
        if last && self.inflight.iter().any(|p| !p.acked && p.fragment_of == Some(f.index)) {
            return None;
        }
        let repr = Repr {
            flags: FLAG_KEY_FRAGMENT,
            slot_count: 1,
            ..Repr::new(MessageType::KvLongData, self.config.task_id, self.config.channel, self.next_seq)
        };
        let mut bytes = vec![0u8; HEADER_LEN + FRAGMENT_FIXED + LONG_TUPLE_FIXED + len];
        let mut p = Packet::new_unchecked(&mut bytes[..]);
        repr.emit(&mut p);
        // the push index names the key (mod 2^32: keys of one channel in
        // flight together are never 2^32 pushes apart)
        emit_key_fragment(f.index as u32, f.key.len() as u32, f.offset as u32, &f.key[f.offset..f.offset + len],
                          f.value, p.body_mut());
        let index = f.index;
        if last {
            self.fragmenting = None;
            self.queued -= 1;
            return Some((bytes, index, 1, None));
        }
        self.fragmenting.as_mut().expect("checked").offset += len;
        Some((bytes, index, 0, Some(index)))
    }

    fn long_bytes_queued(&self) -> usize {
        self.long.iter().map(|(_, k, _)| LONG_TUPLE_FIXED + k.len()).sum()
    }
}
