//! The receiver of a key-value task, as a sans-IO machine.
//!
//! It aggregates what the switch could not absorb (the tuples whose bits
//! are still set in forwarded packets, and long keys), deduplicating by
//! `(channel, seq)` and acknowledging every data packet (ASK §3.3, "Host
//! Receiver"). With shadow copies it runs Algorithm 1: after
//! `swap_threshold` arrived packets it asks the switch to flip the copy
//! indicator, then fetches the old copy, merges it and clears it. Once every
//! expected sender's FIN arrived it sends a final swap (freezing the
//! region), fetches the last copy, merges it, releases the region and
//! reports [`ReceiverEvent::Finished`].
//!
//! **Failed senders.** The driver learns of a dead sender out of band (its
//! daemon's control connection, docs/kv.md §10) and calls
//! [`KvReceiver::sender_failed`]. The machine then stops waiting for that
//! channel's FIN: once every other channel's FIN arrived it runs the same
//! final collection and reports [`ReceiverEvent::Incomplete`] naming the
//! failed channels. The results then hold every tuple of the finished
//! channels exactly once and a subset of each failed channel's tuples, each
//! at most once (what the switch absorbed plus what reached the receiver).
//!
//! Control requests (swap, fetch, clear) are stop-and-wait: one outstanding,
//! repeated every `rto` until answered. Each names the copy epoch, so a
//! delayed duplicate can never clear a copy that became active again.
//!
//! With `auth_key` (the receiver's member key, docs/security.md) what it
//! sends is sealed and a datagram that does not verify is dropped and
//! counted in [`ReceiverStats::auth`] before anything else reads it.
//!
//! **Calling contract**: as [`super::KvSender`]: `poll_transmit` (until it
//! returns 0),
//! `poll_timeout`, `handle_datagram`, `handle_timeout`, `poll_event`;
//! results with [`KvReceiver::results`] after `Finished`.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::time::Duration;

use fanin_wire::kv::{
    FetchEntry, FetchReplyHead, FetchRequest, KeyFragment, Nack, NackReason, Packet, Repr, FLAG_FINAL, HEADER_LEN,
    MAX_FETCH_ENTRIES,
};
use fanin_wire::MessageType;

use super::{FastMap, KvResults, ValueType};
use super::layout::{decode_parts, decode_short, Layout, LayoutError};
use super::sealing::{host_send_copy, unsealed_unknown_task, AuthStats, HostAuth};
use crate::auth::Key;
use crate::time::Time;
use crate::transmit::Transmit;

#[derive(Debug, Clone, PartialEq)]
pub struct ReceiverConfig {
    pub task_id: u32,
    pub layout: Layout,
    /// Must match the switch region.
    pub aa_size: u32,
    pub shadow_copies: bool,
    /// Number of sender channels whose FIN ends the task.
    pub senders: u16,
    /// Swap after this many arrived data packets (shadow copies only;
    /// `None` = never swap before the end).
    pub swap_threshold: Option<u64>,
    /// The senders' W (the deduplication window).
    pub window: u32,
    pub rto: Duration,
    /// Fail when no datagram arrived for this long.
    pub idle_timeout: Duration,
    /// After the results are complete, keep answering repeated FINs (whose
    /// FIN-ACK was lost) this long before releasing the switch region.
    pub linger: Duration,
    pub max_burst: usize,
    /// The receiver's member key of a keyed task (`receiver_key`); `None`:
    /// the task is not keyed.
    pub auth_key: Option<Key>,
    /// Wall clock in microseconds: where sealed sequence numbers start.
    pub seal_clock_us: u64,
    /// Longest key reassembled from fragments (the senders' `max_key_len`).
    pub max_key_len: usize,
    /// How values are merged; must match the switch region's.
    pub value_type: ValueType,
    /// Most fragment bytes held at once, over every key being reassembled
    /// (a correct sender has one key in fragments at a time per channel).
    pub max_pending_key_bytes: usize,
}

impl ReceiverConfig {
    pub fn new(task_id: u32, layout: Layout, aa_size: u32, senders: u16) -> Self {
        Self {
            task_id,
            layout,
            aa_size,
            shadow_copies: true,
            senders,
            swap_threshold: Some(1024),
            window: 256,
            rto: Duration::from_millis(1),
            idle_timeout: Duration::from_secs(10),
            linger: Duration::from_millis(50),
            max_burst: 64,
            auth_key: None,
            seal_clock_us: 1,
            max_key_len: super::sender::MAX_KEY_LEN,
            value_type: ValueType::Int64,
            max_pending_key_bytes: 2 * super::sender::MAX_KEY_LEN,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReceiverError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("nothing arrived for {waited:?}; FINs from {fins} of {senders} senders, none from channels {}: a sender or the switch is gone", list_channels(.missing))]
    Silent { waited: Duration, fins: usize, senders: u16, missing: Vec<u16> },
    #[error("the switch refused task {task_id}: {} (detail {detail})", reason.describe())]
    Refused { task_id: u32, reason: NackReason, detail: u32 },
}

#[derive(Debug, Clone, PartialEq)]
pub enum ReceiverEvent {
    Finished,
    /// The final collection is done without these channels' FINs (they were
    /// declared failed): the results are a partial aggregate.
    Incomplete { failed: Vec<u16> },
    Failed(ReceiverError),
}

/// "1, 2, 5" (at most 16 named, then "and N more").
fn list_channels(channels: &[u16]) -> String {
    let mut s = channels.iter().take(16).map(|c| c.to_string()).collect::<Vec<_>>().join(", ");
    if channels.len() > 16 {
        s.push_str(&format!(" and {} more", channels.len() - 16));
    }
    if s.is_empty() {
        s.push_str("(none)");
    }
    s
}

/// A key's aggregate: sum, count, min and max of its values (as bits of
/// the task's [`ValueType`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aggregate {
    pub sum: i64,
    pub count: u64,
    pub min: i64,
    pub max: i64,
}

impl Aggregate {
    pub fn of(value: i64) -> Self {
        Self { sum: value, count: 1, min: value, max: value }
    }
    /// Add `o` in, reading the value bits as `value_type`. An int64 sum
    /// saturates at the bounds instead of wrapping; true when it overflowed
    /// (the caller reports it).
    pub fn merge(&mut self, o: &Aggregate, value_type: ValueType) -> bool {
        let (sum, overflowed) = value_type.saturating_add(self.sum, o.sum);
        self.sum = sum;
        self.count += o.count;
        self.min = value_type.min(self.min, o.min);
        self.max = value_type.max(self.max, o.max);
        overflowed
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    pub data_packets: u64,
    pub duplicate_packets: u64,
    pub stale_packets: u64,
    pub tuples_local: u64,
    pub swaps: u64,
    pub fetch_requests: u64,
    pub entries_fetched: u64,
    /// Fetched entries that did not decode (a medium key missing a part or
    /// a bad length byte); should stay 0.
    pub undecodable: u64,
    /// Stale-epoch / active-copy refusals (late duplicates of requests).
    pub refusals: u64,
    /// Merges whose int64 sum overflowed: the key's sum saturated at the
    /// bound, and the task's result is refused (never a wrapped sum).
    pub overflowed: u64,
    /// Keys reassembled from fragments.
    pub keys_reassembled: u64,
    /// Key fragments of keys longer than `max_key_len`: those keys are not
    /// in the results, and the task's result is refused.
    pub keys_refused: u64,
    /// Datagrams refused before they were read (keyed tasks).
    pub auth: AuthStats,
    /// Data packets whose slot count is not the task's layout's: dropped
    /// unread, unacknowledged.
    pub layout_mismatch: u64,
}

/// A key arriving in fragments: the fragments so far, as they came (held
/// sparsely: memory is what arrived, never what an offset claims), and how
/// many bytes that is (each packet arrives once: deduplicated by seq).
struct Reassembly {
    total: usize,
    got: usize,
    parts: Vec<(usize, Vec<u8>)>,
}

impl Reassembly {
    /// The whole key, if the fragments tile `0..total` exactly.
    fn assemble(mut self) -> Option<Vec<u8>> {
        self.parts.sort_unstable_by_key(|(offset, _)| *offset);
        let mut key = Vec::with_capacity(self.total);
        for (offset, bytes) in self.parts {
            if offset != key.len() {
                return None;
            }
            key.extend_from_slice(&bytes);
        }
        (key.len() == self.total).then_some(key)
    }
}

/// Refusals of control requests in a row, without progress, before the
/// receiver gives up (it is out of step with the switch).
const MAX_REFUSALS_IN_ROW: u32 = 64;

/// The receive-side dedup window of one channel: slot `seq % W` remembers
/// the last seq processed there. Unlike the switch's compact `seen`, it
/// must tolerate gaps: packets the switch absorbed never arrive here.
struct DedupWindow {
    last: Vec<Option<u32>>,
    max_seq: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    Swapping { final_: bool },
    Fetching { copy: u8, final_: bool },
    Clearing { copy: u8 },
    /// Results complete; answering late FINs until `until`, then release.
    Lingering { until: Time },
    /// Results complete; repeating Release until the switch confirms.
    Releasing,
    Done,
    Failed,
}

/// Progress of reading one aggregator array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cursor {
    /// A fetch from `start` is outstanding; repeat it at `deadline`.
    Waiting { start: u32, deadline: Time },
    Done,
}

impl Cursor {
    fn deadline(&self) -> Time {
        match self {
            Cursor::Waiting { deadline, .. } => *deadline,
            Cursor::Done => Time::ZERO,
        }
    }
}

pub struct KvReceiver {
    config: ReceiverConfig,
    results: KvResults,
    windows: FastMap<u16, DedupWindow>,
    /// Keys arriving in fragments, by (channel, key id), and the bytes they hold.
    fragments: FastMap<(u16, u32), Reassembly>,
    pending_key_bytes: usize,
    fins: HashSet<u16>,
    /// Channels declared failed (no FIN will come); disjoint from `fins`.
    failed: BTreeSet<u16>,
    epoch: u32,
    phase: Phase,
    since_swap: u64,
    /// The outstanding control request and when to repeat it.
    request: Option<(Vec<u8>, Time)>,
    /// Fetched aggregators of the copy being read: (aa, index) -> entry.
    staged: FastMap<(u8, u32), FetchEntry>,
    /// Per-AA fetch progress while a copy is read.
    cursors: Vec<Cursor>,
    replies: VecDeque<Vec<u8>>,
    last_heard: Time,
    refusals_in_row: u32,
    events: VecDeque<ReceiverEvent>,
    stats: ReceiverStats,
    auth: Option<HostAuth>,
}

impl KvReceiver {
    pub fn new(config: ReceiverConfig, now: Time) -> Result<Self, ReceiverError> {
        config.layout.validate()?;
        Ok(Self {
            results: KvResults::default(),
            windows: FastMap::default(),
            fragments: FastMap::default(),
            pending_key_bytes: 0,
            fins: HashSet::new(),
            failed: BTreeSet::new(),
            epoch: 0,
            phase: Phase::Idle,
            since_swap: 0,
            request: None,
            staged: FastMap::default(),
            cursors: Vec::new(),
            replies: VecDeque::new(),
            last_heard: now,
            refusals_in_row: 0,
            events: VecDeque::new(),
            stats: ReceiverStats::default(),
            auth: config.auth_key.map(|k| HostAuth::new(k, config.seal_clock_us)),
            config,
        })
    }

    #[doc(hidden)]
    pub fn debug_phase(&self) -> String {
        format!("{:?} epoch {} fins {:?} since_swap {}", self.phase, self.epoch, self.fins, self.since_swap)
    }
    pub fn stats(&self) -> ReceiverStats {
        self.stats
    }
    /// The results are complete (`Finished` was reported).
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Lingering { .. } | Phase::Releasing | Phase::Done)
    }
    /// The region was released and the machine is idle for good.
    pub fn is_released(&self) -> bool {
        matches!(self.phase, Phase::Done | Phase::Failed)
    }
    /// The aggregated results (complete once `Finished` was reported).
    pub fn results(&self) -> &KvResults {
        &self.results
    }
    pub fn into_results(self) -> KvResults {
        self.results
    }
    /// Move the results out after `Finished` or `Incomplete` was reported,
    /// while the machine goes on (linger, then Release) to answer repeats:
    /// by then every channel's data was acknowledged and the switch is
    /// frozen, so nothing more is merged; copying 10^5 keys instead cost
    /// the daemon a visible pause at the end of every task.
    pub fn take_results(&mut self) -> KvResults {
        std::mem::take(&mut self.results)
    }
    pub fn poll_event(&mut self) -> Option<ReceiverEvent> {
        self.events.pop_front()
    }

    /// Channels declared failed, in order.
    pub fn failed_channels(&self) -> Vec<u16> {
        self.failed.iter().copied().collect()
    }

    /// The sender of `channel` is gone (the driver knows how: its daemon's
    /// control connection). The machine stops waiting for its FIN; when all
    /// other channels finished it collects and reports `Incomplete`. The
    /// caller names only channels of the task (the machine does not know
    /// the ids). Returns false, and changes nothing, when the channel's FIN
    /// already arrived (its tuples are all in: it did not fail), it was
    /// declared failed before, or the machine has stopped.
    pub fn sender_failed(&mut self, channel: u16) -> bool {
        let collecting = matches!(self.phase, Phase::Idle | Phase::Swapping { final_: false } | Phase::Fetching { final_: false, .. } | Phase::Clearing { .. });
        if !collecting || self.fins.contains(&channel) || !self.failed.insert(channel) {
            return false;
        }
        true
    }

    /// A sender reported progress (its packets are being acknowledged). The
    /// switch acknowledges fully absorbed packets itself, so a receiver can
    /// legitimately hear nothing for long; this keeps its silence timer
    /// from taking that for a dead task.
    pub fn note_sender_progress(&mut self, now: Time) {
        let collecting = matches!(self.phase, Phase::Idle | Phase::Swapping { .. } | Phase::Fetching { .. } | Phase::Clearing { .. });
        if collecting {
            self.last_heard = self.last_heard.max(now);
        }
    }

    pub fn poll_timeout(&self) -> Option<Time> {
        if matches!(self.phase, Phase::Done | Phase::Failed) {
            return None;
        }
        if let Phase::Lingering { until } = self.phase {
            return Some(until);
        }
        if self.phase == Phase::Releasing {
            let gone = self.last_heard + self.config.idle_timeout;
            return Some(self.request.as_ref().map_or(gone, |(_, t)| (*t).min(gone)));
        }
        let idle = self.last_heard + self.config.idle_timeout;
        let fetch = match self.phase {
            Phase::Fetching { .. } => self.cursors.iter().filter(|c| **c != Cursor::Done).map(|c| c.deadline()).min(),
            _ => None,
        };
        let request = self.request.as_ref().map(|(_, t)| *t);
        request.into_iter().chain(fetch).chain([idle]).min()
    }

    pub fn handle_timeout(&mut self, now: Time) {
        if matches!(self.phase, Phase::Done | Phase::Failed) {
            return;
        }
        if let Phase::Lingering { until } = self.phase {
            if now >= until {
                self.phase = Phase::Releasing;
                let release = self.control(MessageType::KvRelease, 0, 0);
                self.send_request(now, release);
            }
            return;
        }
        if self.phase == Phase::Releasing {
            // The switch is gone; its idle timer frees the region anyway.
            if now >= self.last_heard + self.config.idle_timeout {
                self.request = None;
                self.phase = Phase::Done;
            }
            return;
        }
        if now >= self.last_heard + self.config.idle_timeout {
            // The daemon numbers a task's channels 0..senders.
            let missing = (0..self.config.senders).filter(|c| !self.fins.contains(c)).collect();
            let err = ReceiverError::Silent {
                waited: self.config.idle_timeout,
                fins: self.fins.len(),
                senders: self.config.senders,
                missing,
            };
            self.fail(err);
        }
    }

    fn fail(&mut self, err: ReceiverError) {
        if matches!(self.phase, Phase::Done | Phase::Failed | Phase::Lingering { .. } | Phase::Releasing) {
            return;
        }
        self.phase = Phase::Failed;
        self.request = None;
        // Free the switch memory now rather than at the switch's idle timeout.
        self.replies.push_back(self.control(MessageType::KvRelease, 0, 0));
        self.events.push_back(ReceiverEvent::Failed(err));
    }

    pub fn handle_datagram(&mut self, now: Time, bytes: &[u8]) {
        // While releasing, the switch may no longer know the task (the first
        // ReleaseAck was lost) and so has no key: its UnknownTask Nack comes
        // unsealed. A keyed receiver takes it as the end of the release; a
        // forged one can do no more than stop the repeated Release early,
        // which the switch's idle timer makes harmless (the results are
        // already out). Nothing else unverified is read.
        if self.phase == Phase::Releasing && self.auth.is_some() && unsealed_unknown_task(bytes, self.config.task_id) {
            self.request = None;
            self.phase = Phase::Done;
            return;
        }
        let bytes = match &mut self.auth {
            Some(auth) => match auth.open(bytes, &mut self.stats.auth) {
                Some(inner) => inner,
                None => return,
            },
            None => bytes,
        };
        let Ok(p) = Packet::new_checked(bytes) else { return };
        if p.task_id() != self.config.task_id || matches!(self.phase, Phase::Done | Phase::Failed) {
            return;
        }
        self.last_heard = now;
        if self.phase == Phase::Releasing {
            let gone = match p.msg_type() {
                MessageType::KvReleaseAck => true,
                MessageType::KvNack => Nack::parse(p.body()).is_ok_and(|n| n.reason == NackReason::UnknownTask),
                _ => false,
            };
            if gone {
                self.request = None;
                self.phase = Phase::Done;
                return;
            }
        }
        if matches!(self.phase, Phase::Lingering { .. } | Phase::Releasing) {
            if p.msg_type() == MessageType::KvFin && !self.failed.contains(&p.channel()) {
                self.replies.push_back(self.control(MessageType::KvFinAck, p.channel(), p.seq()));
            }
            return;
        }
        match p.msg_type() {
            // A data packet cut to other slots than the task's layout (the
            // switch refuses these; one sent straight to this host's port
            // is not the switch's): its slots would be read past their end.
            MessageType::KvData if p.slot_count() as usize != self.config.layout.slot_count() => {
                self.stats.layout_mismatch += 1;
            }
            MessageType::KvData | MessageType::KvLongData => self.on_data(&p),
            // A channel declared failed gets no FIN-ACK: its sender was told
            // the task gave up on it, and the report names it failed.
            MessageType::KvFin if self.failed.contains(&p.channel()) => {}
            MessageType::KvFin => {
                self.fins.insert(p.channel());
                self.replies.push_back(self.control(MessageType::KvFinAck, p.channel(), p.seq()));
            }
            MessageType::KvSwapAck => self.on_swap_ack(now, &p),
            MessageType::KvFetchReply => self.on_fetch_reply(now, &p),
            MessageType::KvClearAck => {
                if let Phase::Clearing { copy } = self.phase {
                    if p.seq() == self.epoch && p.body()[0] == copy {
                        self.request = None;
                        self.phase = Phase::Idle;
                    }
                }
            }
            MessageType::KvNack => {
                let Ok(n) = Nack::parse(p.body()) else { return };
                // A delayed duplicate of an earlier swap / fetch / clear is
                // refused once the epoch moved on; that is no reason to fail.
                // Only a run of refusals without progress is.
                let benign = matches!(n.reason, NackReason::StaleEpoch | NackReason::CopyActive);
                if benign {
                    self.stats.refusals += 1;
                    self.refusals_in_row += 1;
                }
                if !benign || self.refusals_in_row > MAX_REFUSALS_IN_ROW {
                    self.fail(ReceiverError::Refused { task_id: p.task_id(), reason: n.reason, detail: n.detail });
                }
            }
            _ => {}
        }
    }

    fn on_data(&mut self, p: &Packet<&[u8]>) {
        self.stats.data_packets += 1;
        self.since_swap += 1;
        let w = self.config.window.max(1);
        let (seq, channel) = (p.seq(), p.channel());
        let win = self.windows.entry(channel).or_insert_with(|| DedupWindow { last: vec![None; w as usize], max_seq: None });
        let slot = (seq % w) as usize;
        let stale = win.max_seq.is_some_and(|m| (seq as i64) <= m as i64 - w as i64);
        if stale {
            // The sender already has this packet's ACK (it moved W past it).
            self.stats.stale_packets += 1;
            return;
        }
        let duplicate = win.last[slot] == Some(seq);
        win.last[slot] = Some(seq);
        win.max_seq = Some(win.max_seq.map_or(seq, |m| m.max(seq)));
        if duplicate {
            self.stats.duplicate_packets += 1;
        } else if let Some(f) = p.key_fragment() {
            self.on_key_fragment(channel, f);
        } else if p.msg_type() == MessageType::KvLongData {
            for (key, value) in p.long_tuples() {
                self.stats.overflowed += merge(&mut self.results, key, Aggregate::of(value), self.config.value_type);
                self.stats.tuples_local += 1;
            }
        } else {
            self.aggregate_local(p);
        }
        self.replies.push_back(self.control(MessageType::KvAck, channel, seq));
    }

    /// One fragment of a long key: merged once the key is whole. A key over
    /// `max_key_len`, fragments beyond `max_pending_key_bytes`, or fragments
    /// that do not tile their key are `keys_refused`: that key is missing,
    /// so the task's result is refused (never given without it).
    fn on_key_fragment(&mut self, channel: u16, f: KeyFragment<'_>) {
        let total = f.total_len as usize;
        if total > self.config.max_key_len
            || self.pending_key_bytes + f.bytes.len() > self.config.max_pending_key_bytes
        {
            self.stats.keys_refused += 1;
            return;
        }
        let r = self.fragments.entry((channel, f.key_id)).or_insert_with(|| Reassembly { total, got: 0, parts: Vec::new() });
        if r.total != total {
            // two keys under one id: the sender is broken
            self.stats.keys_refused += 1;
            return;
        }
        r.parts.push((f.offset as usize, f.bytes.to_vec()));
        r.got += f.bytes.len();
        self.pending_key_bytes += f.bytes.len();
        if r.got < r.total {
            return;
        }
        let r = self.fragments.remove(&(channel, f.key_id)).expect("present");
        self.pending_key_bytes -= r.got;
        match r.assemble() {
            Some(key) => {
                self.stats.overflowed += merge(&mut self.results, &key, Aggregate::of(f.value), self.config.value_type);
                self.stats.keys_reassembled += 1;
                self.stats.tuples_local += 1;
            }
            None => self.stats.keys_refused += 1,
        }
    }

    fn aggregate_local(&mut self, p: &Packet<&[u8]>) {
        let layout = self.config.layout;
        let bitmap = p.bitmap();
        for slot in 0..layout.short_slots as usize {
            if bitmap >> slot & 1 == 1 {
                match decode_short(u64::from_be_bytes(p.key_part(slot))) {
                    Some((key, len)) => self.stats.overflowed += merge(&mut self.results, &key[..len], Aggregate::of(p.value(slot)), self.config.value_type),
                    None => self.stats.undecodable += 1,
                }
                self.stats.tuples_local += 1;
            }
        }
        for g in 0..layout.medium_groups {
            let first = layout.group_first_slot(g) as usize;
            if bitmap >> first & 1 == 1 {
                let n = layout.medium_parts as usize;
                let parts: Vec<u64> = (0..n).map(|j| u64::from_be_bytes(p.key_part(first + j))).collect();
                match decode_parts(&parts) {
                    Some(key) => self.stats.overflowed += merge(&mut self.results, &key, Aggregate::of(p.value(first + n - 1)), self.config.value_type),
                    None => self.stats.undecodable += 1,
                }
                self.stats.tuples_local += 1;
            }
        }
    }

    fn control(&self, t: MessageType, channel: u16, seq: u32) -> Vec<u8> {
        let repr = Repr::new(t, self.config.task_id, channel, seq);
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
        buf
    }

    fn send_request(&mut self, now: Time, bytes: Vec<u8>) {
        self.refusals_in_row = 0;
        self.replies.push_back(bytes.clone());
        self.request = Some((bytes, now + self.config.rto));
    }

    fn start_swap(&mut self, now: Time, final_: bool) {
        let target = if final_ { self.epoch } else { self.epoch + 1 };
        let mut bytes = self.control(MessageType::KvSwap, 0, target);
        if final_ {
            bytes[4] = FLAG_FINAL;
        }
        self.phase = Phase::Swapping { final_ };
        self.since_swap = 0;
        self.send_request(now, bytes);
    }

    fn on_swap_ack(&mut self, now: Time, p: &Packet<&[u8]>) {
        let Phase::Swapping { final_ } = self.phase else { return };
        let acked_final = p.flags() & FLAG_FINAL != 0;
        let expected = if final_ { self.epoch } else { self.epoch + 1 };
        if p.seq() != expected || acked_final != final_ {
            return;
        }
        let copies = if self.config.shadow_copies { 2 } else { 1 };
        // The copy to read: after a swap, the one that was active before it;
        // after the final swap, the one that was active at the end.
        let copy = (self.epoch % copies) as u8;
        if !final_ {
            self.epoch += 1;
            self.stats.swaps += 1;
        }
        self.staged.clear();
        self.request = None;
        // Every AA is read independently: one fetch per AA in flight at once,
        // so a swap cycle takes a few round trips, not one per AA.
        let slots = self.config.layout.slot_count();
        self.cursors = vec![Cursor::Waiting { start: 0, deadline: now }; slots];
        self.phase = Phase::Fetching { copy, final_ };
        for aa in 0..slots as u8 {
            self.fetch(now, copy, aa, 0);
        }
    }

    fn fetch(&mut self, now: Time, copy: u8, aa: u8, start: u32) {
        self.stats.fetch_requests += 1;
        let repr = Repr::new(MessageType::KvFetch, self.config.task_id, 0, self.epoch);
        let mut buf = vec![0u8; repr.buffer_len()];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        repr.emit(&mut p);
        FetchRequest { copy, aa, max_entries: MAX_FETCH_ENTRIES as u16, start }.emit(p.body_mut());
        self.replies.push_back(buf);
        self.cursors[aa as usize] = Cursor::Waiting { start, deadline: now + self.config.rto };
        self.refusals_in_row = 0;
    }

    fn on_fetch_reply(&mut self, now: Time, p: &Packet<&[u8]>) {
        let Phase::Fetching { copy, final_ } = self.phase else { return };
        let Ok(head) = FetchReplyHead::parse(p.body()) else { return };
        let aa = head.aa;
        let waiting = self.cursors.get(aa as usize).is_some_and(|c| *c == Cursor::Waiting { start: head.start, deadline: c.deadline() });
        if p.seq() != self.epoch || head.copy != copy || !waiting {
            return; // a late or repeated answer
        }
        for e in FetchReplyHead::entries(p.body()) {
            self.staged.insert((aa, e.index), e);
            self.stats.entries_fetched += 1;
        }
        if head.next < self.config.aa_size && head.next > head.start {
            return self.fetch(now, copy, aa, head.next);
        }
        self.cursors[aa as usize] = Cursor::Done;
        if self.cursors.iter().any(|c| *c != Cursor::Done) {
            return;
        }
        self.merge_staged();
        if final_ {
            self.request = None;
            self.phase = Phase::Lingering { until: now + self.config.linger };
            self.events.push_back(if self.failed.is_empty() {
                ReceiverEvent::Finished
            } else {
                ReceiverEvent::Incomplete { failed: self.failed_channels() }
            });
        } else {
            // Algorithm 1, Read(): clean up the old copy after reading it.
            self.phase = Phase::Clearing { copy };
            let mut bytes = self.control(MessageType::KvClear, 0, self.epoch);
            bytes[HEADER_LEN] = copy;
            self.send_request(now, bytes);
        }
    }

    /// Rebuild keys from the fetched aggregators and merge them.
    fn merge_staged(&mut self) {
        let layout = self.config.layout;
        let staged = std::mem::take(&mut self.staged);
        for (&(aa, index), e) in staged.iter() {
            let aa_usize = aa as usize;
            if aa_usize < layout.short_slots as usize {
                let agg = Aggregate { sum: e.sum, count: e.count as u64, min: e.min, max: e.max };
                match decode_short(u64::from_be_bytes(e.key_part)) {
                    Some((key, len)) => self.stats.overflowed += merge(&mut self.results, &key[..len], agg, self.config.value_type),
                    None => self.stats.undecodable += 1,
                }
                continue;
            }
            let n = layout.medium_parts as usize;
            let offset = (aa_usize - layout.short_slots as usize) % n;
            if offset != n - 1 {
                continue; // not the value-holding last AA of its group
            }
            let first = aa - (n as u8 - 1);
            let parts: Option<Vec<u64>> =
                (0..n as u8).map(|j| staged.get(&(first + j, index)).map(|x| u64::from_be_bytes(x.key_part))).collect();
            let agg = Aggregate { sum: e.sum, count: e.count as u64, min: e.min, max: e.max };
            match parts.as_deref().and_then(decode_parts) {
                Some(key) => self.stats.overflowed += merge(&mut self.results, &key, agg, self.config.value_type),
                None => self.stats.undecodable += 1,
            }
        }
    }

    /// Write ACKs, FIN-ACKs and control requests (all to the switch); start
    /// a swap or the final collection when due.
    pub fn poll_transmit(&mut self, now: Time, out: &mut impl Transmit<()>) -> usize {
        if self.phase == Phase::Idle {
            // Failed channels send no FIN; the survivors' FINs end the task.
            let all_fins = self.fins.len() + self.failed.len() >= self.config.senders as usize;
            if all_fins {
                self.start_swap(now, true);
            } else if self.config.shadow_copies
                && self.config.swap_threshold.is_some_and(|t| self.since_swap >= t)
            {
                self.start_swap(now, false);
            }
        }
        if let Some((bytes, deadline)) = &mut self.request {
            if now >= *deadline {
                *deadline = now + self.config.rto;
                let b = bytes.clone();
                self.replies.push_back(b);
            }
        }
        if let Phase::Fetching { copy, .. } = self.phase {
            for aa in 0..self.cursors.len() {
                if let Cursor::Waiting { start, deadline } = self.cursors[aa] {
                    if now >= deadline {
                        self.fetch(now, copy, aa as u8, start);
                    }
                }
            }
        }
        let mut sent = 0;
        while sent < self.config.max_burst {
            let Some(b) = self.replies.pop_front() else { break };
            host_send_copy(self.auth.as_mut(), out, &b);
            sent += 1;
        }
        sent
    }
}

/// Merge `agg` into `key`'s aggregate; 1 if its sum overflowed int64 now
/// (it saturates, and the receiver counts it: never a wrapped sum).
fn merge(results: &mut KvResults, key: &[u8], agg: Aggregate, value_type: ValueType) -> u64 {
    match results.get_mut(key) {
        Some(a) => a.merge(&agg, value_type) as u64,
        None => {
            results.insert(key.to_vec(), agg);
            0
        }
    }
}
