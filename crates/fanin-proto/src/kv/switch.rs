//! The key-value switch program (ASK §3.1–§3.4) for one switch.
//!
//! **Calling contract**: `add_task` / `remove_task` from the control plane;
//! `handle_datagram(now, from, bytes, out)` for every datagram;
//! `handle_timeout(now)` once `poll_timeout()` has passed (it expires idle
//! tasks and frees their memory). Every datagram is counted in
//! [`KvCounters`] under exactly one outcome.
//!
//! Per task the switch holds a memory region of `slot_count` aggregator
//! arrays x `copies` x `aa_size` aggregators, and per sender channel a
//! [`SeenWindow`]. The task's receiver is the only address allowed to swap,
//! fetch, clear or release the region (tenant isolation); other tasks'
//! memory is never reachable from a packet, since every access is indexed
//! through the packet's task id.
//!
//! A task admitted with a key ([`KvTaskSpec::key`]) accepts only sealed
//! datagrams: the tag and the member's replay window are checked before
//! anything else is looked at, and everything the switch sends for the task
//! is sealed under the destination's member key ([`super::sealing`]). A task
//! without a key runs exactly as before.

use std::mem::MaybeUninit;
use std::time::Duration;

use fanin_wire::kv::{
    FetchEntry, FetchReplyHead, FetchRequest, Nack, NackReason, Packet, Repr, FETCH_ENTRY_LEN, FETCH_REPLY_FIXED,
    FLAG_BY_SWITCH, FLAG_FINAL, HEADER_LEN, MAX_FETCH_ENTRIES,
};
use fanin_wire::{MessageType, WireError};

use super::aggregators::Aggregators;
use super::FastMap;
use super::layout::{aggregator_index, aggregator_index_of, Layout, LayoutError};
use super::sealing::{self, Peer, TaskAuth};
use crate::auth::{push_sealed, Key};
use super::window::{Observation, SeenWindow};
use super::ValueType;
use crate::time::Time;
use crate::transmit::Transmit;

/// Switch-wide limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSwitchConfig {
    /// Aggregators the switch has for all key-value tasks.
    pub memory_limit: u64,
    /// Most aggregators one tenant's tasks may hold together.
    pub tenant_limit: u64,
    /// The lane of the sequence numbers this switch seals with (its shard).
    pub seal_lane: u16,
    /// Wall clock in microseconds at start: sealed sequence numbers count
    /// up from it, so a restarted switch continues above its old ones.
    pub seal_clock_us: u64,
}

impl Default for KvSwitchConfig {
    fn default() -> Self {
        Self { memory_limit: 1 << 24, tenant_limit: 1 << 24, seal_lane: 0, seal_clock_us: 1 }
    }
}

/// A task's memory region and parameters, as the control plane allocates it.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTaskSpec<A> {
    pub task_id: u32,
    pub tenant: u32,
    /// Where data the switch cannot absorb, FINs and fetch replies go.
    pub receiver: A,
    pub layout: Layout,
    /// Aggregators per AA per copy (ASK's N).
    pub aa_size: u32,
    /// Two copies per AA and a copy indicator (§3.4), or one copy.
    pub shadow_copies: bool,
    /// W: the senders' window; `seen` has W bits, `PktState` W entries.
    pub window: u32,
    pub max_channels: u16,
    /// Free the region when no datagram of the task arrived for this long
    /// (a receiver or all senders vanished). Zero = never.
    pub idle_timeout: Duration,
    /// The task key (docs/security.md): `Some` = only sealed datagrams are
    /// accepted and everything sent is sealed, under member keys derived
    /// from it ([`super::sealing`]).
    pub key: Option<Key>,
    /// How the `sum`, `min` and `max` registers read a value's bits.
    pub value_type: ValueType,
}

impl<A> KvTaskSpec<A> {
    pub fn new(task_id: u32, receiver: A, layout: Layout, aa_size: u32) -> Self {
        Self {
            task_id,
            tenant: 0,
            receiver,
            layout,
            aa_size,
            shadow_copies: true,
            window: 256,
            max_channels: 64,
            idle_timeout: Duration::from_secs(30),
            key: None,
            value_type: ValueType::Int64,
        }
    }
    pub fn copies(&self) -> u32 {
        if self.shadow_copies {
            2
        } else {
            1
        }
    }
    /// Aggregators the region needs.
    pub fn memory(&self) -> u64 {
        self.layout.slot_count() as u64 * self.aa_size as u64 * self.copies() as u64
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvAdmitError {
    #[error("task {0} already has a region")]
    Duplicate(u32),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("aa_size must be at least 1 and window 1..=4096 (got aa_size {aa_size}, window {window})")]
    BadSize { aa_size: u32, window: u32 },
    #[error("task needs {needed} aggregators, the switch has {free} free")]
    OutOfMemory { needed: u64, free: u64 },
    #[error("tenant {tenant} would hold {needed} aggregators, its limit is {limit}")]
    TenantLimit { tenant: u32, needed: u64, limit: u64 },
}

/// Switch counters; every datagram lands in exactly one outcome counter
/// (`rx_datagrams` = the sum of the outcomes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvCounters {
    pub rx_datagrams: u64,
    /// Outcomes.
    pub malformed: [u64; WireError::KINDS.len()],
    pub unknown_task: u64,
    pub layout_mismatch: u64,
    pub split_group: u64,
    pub too_many_channels: u64,
    pub stale: u64,
    pub beyond_window: u64,
    /// Data packets fully absorbed: answered with a switch ACK.
    pub acked: u64,
    /// Data / long-data packets forwarded to the receiver.
    pub forwarded: u64,
    /// FIN / ACK / FIN-ACK relayed between the receiver and senders.
    pub relayed: u64,
    /// Relayed messages for a channel the switch never saw.
    pub unknown_channel: u64,
    /// Swap, fetch, clear, release handled (answered or acted on).
    pub control: u64,
    /// Control messages from an address that is not the task's receiver.
    pub not_receiver: u64,
    /// Control messages refused (stale epoch, active copy, bad AA).
    pub control_refused: u64,
    /// Messages a switch never takes (a switch-to-host type sent to it).
    pub protocol_violation: u64,
    /// Keyed tasks: the tag did not verify (forged, another key, or sealed
    /// for a task without a key).
    pub auth_bad_tag: u64,
    /// Keyed tasks: a valid tag on a sequence number already seen.
    pub auth_replayed: u64,
    /// Keyed tasks: a datagram without a seal.
    pub auth_unsealed: u64,
    /// Not outcomes: detail.
    pub duplicates: u64,
    pub tuples_in: u64,
    pub tuples_aggregated: u64,
    pub swaps: u64,
    pub nacks_sent: u64,
    pub tasks_expired: u64,
    pub tasks_released: u64,
}

impl KvCounters {
    pub fn malformed_total(&self) -> u64 {
        self.malformed.iter().sum()
    }
    /// Every counter by name (malformed per reason), for metrics and the
    /// control API.
    pub fn visit(&self, mut f: impl FnMut(&'static str, Option<&'static str>, u64)) {
        f("rx_datagrams", None, self.rx_datagrams);
        for (kind, v) in WireError::KINDS.iter().zip(self.malformed) {
            f("malformed", Some(kind), v);
        }
        let named = [
            ("unknown_task", self.unknown_task),
            ("layout_mismatch", self.layout_mismatch),
            ("split_group", self.split_group),
            ("too_many_channels", self.too_many_channels),
            ("stale", self.stale),
            ("beyond_window", self.beyond_window),
            ("acked", self.acked),
            ("forwarded", self.forwarded),
            ("relayed", self.relayed),
            ("unknown_channel", self.unknown_channel),
            ("control", self.control),
            ("not_receiver", self.not_receiver),
            ("control_refused", self.control_refused),
            ("protocol_violation", self.protocol_violation),
            ("auth_bad_tag", self.auth_bad_tag),
            ("auth_replayed", self.auth_replayed),
            ("auth_unsealed", self.auth_unsealed),
            ("duplicates", self.duplicates),
            ("tuples_in", self.tuples_in),
            ("tuples_aggregated", self.tuples_aggregated),
            ("swaps", self.swaps),
            ("nacks_sent", self.nacks_sent),
            ("tasks_expired", self.tasks_expired),
            ("tasks_released", self.tasks_released),
        ];
        for (name, v) in named {
            f(name, None, v);
        }
    }
    /// Add another shard's counters.
    pub fn merge(&mut self, o: &KvCounters) {
        let mut i = 0;
        let mut theirs = Vec::new();
        o.visit(|_, _, v| theirs.push(v));
        self.rx_datagrams += theirs[i];
        i += 1;
        for m in self.malformed.iter_mut() {
            *m += theirs[i];
            i += 1;
        }
        for field in [
            &mut self.unknown_task,
            &mut self.layout_mismatch,
            &mut self.split_group,
            &mut self.too_many_channels,
            &mut self.stale,
            &mut self.beyond_window,
            &mut self.acked,
            &mut self.forwarded,
            &mut self.relayed,
            &mut self.unknown_channel,
            &mut self.control,
            &mut self.not_receiver,
            &mut self.control_refused,
            &mut self.protocol_violation,
            &mut self.auth_bad_tag,
            &mut self.auth_replayed,
            &mut self.auth_unsealed,
            &mut self.duplicates,
            &mut self.tuples_in,
            &mut self.tuples_aggregated,
            &mut self.swaps,
            &mut self.nacks_sent,
            &mut self.tasks_expired,
            &mut self.tasks_released,
        ] {
            *field += theirs[i];
            i += 1;
        }
    }
    /// Sum of the outcome counters; equals `rx_datagrams`.
    pub fn outcomes(&self) -> u64 {
        self.malformed_total()
            + self.unknown_task
            + self.layout_mismatch
            + self.split_group
            + self.too_many_channels
            + self.stale
            + self.beyond_window
            + self.acked
            + self.forwarded
            + self.relayed
            + self.unknown_channel
            + self.control
            + self.not_receiver
            + self.control_refused
            + self.protocol_violation
            + self.auth_bad_tag
            + self.auth_replayed
            + self.auth_unsealed
    }
}

/// Per-task figures (the prioritisation benchmark reads these).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaskStats {
    /// Tuples seen on a packet's first pass (a coalesced key counts once).
    pub tuples_in: u64,
    /// Of those, absorbed by an aggregator.
    pub tuples_aggregated: u64,
    pub packets_acked: u64,
    pub packets_forwarded: u64,
    pub swaps: u64,
    pub epoch: u32,
    pub frozen: bool,
}

struct Channel<A> {
    addr: A,
    window: SeenWindow,
}

struct Task<A> {
    spec: KvTaskSpec<A>,
    aggs: Aggregators,
    channels: FastMap<u16, Channel<A>>,
    /// Number of completed swaps; the copy indicator is `epoch % copies`.
    epoch: u32,
    /// After the final swap nothing is aggregated and every copy is readable.
    frozen: bool,
    last_active: Time,
    stats: TaskStats,
    /// Keys and replay windows of a keyed task.
    auth: Option<TaskAuth>,
}

impl<A> Task<A> {
    fn copy_indicator(&self) -> u32 {
        self.epoch % self.spec.copies()
    }
    fn base(&self, copy: u32, aa: usize) -> usize {
        (copy as usize * self.spec.layout.slot_count() + aa) * self.spec.aa_size as usize
    }
    fn readable(&self, copy: u8) -> bool {
        (copy as u32) < self.spec.copies() && (self.frozen || copy as u32 != self.copy_indicator())
    }
}

/// The seal of the next datagram of a task to `to` (`None`: unkeyed).
fn seal_for(auth: &mut Option<TaskAuth>, to: Peer) -> Option<(Key, u64)> {
    auth.as_mut().map(|a| a.seal_for(to))
}

/// Queue a datagram of `len` unsealed bytes written by `fill`, sealed with
/// `seal` when given.
fn send<A>(out: &mut impl Transmit<A>, to: A, len: usize, seal: Option<(Key, u64)>, fill: impl FnOnce(&mut [u8])) {
    push_sealed(out, to, len, seal.as_ref().map(|(k, q)| (k, *q)), fill)
}

/// Queue a header-only reply.
fn send_header<A>(out: &mut impl Transmit<A>, to: A, seal: Option<(Key, u64)>, repr: Repr) {
    send(out, to, HEADER_LEN, seal, |buf| repr.emit(&mut Packet::new_unchecked(buf)));
}

/// The key-value aggregation program of one switch.
pub struct KvSwitch<A> {
    config: KvSwitchConfig,
    tasks: FastMap<u32, Task<A>>,
    memory_used: u64,
    counters: KvCounters,
    /// Where the next keyed task's sealed sequence numbers start: above
    /// every number a task before it used (a re-admitted task with the same
    /// id and key must not repeat one).
    seal_floor: u64,
}

impl<A: Copy + PartialEq> KvSwitch<A> {
    pub fn new(config: KvSwitchConfig) -> Self {
        let seal_floor = fanin_wire::auth::first_seq(config.seal_lane, config.seal_clock_us);
        Self { config, tasks: FastMap::default(), memory_used: 0, counters: KvCounters::default(), seal_floor }
    }

    pub fn counters(&self) -> &KvCounters {
        &self.counters
    }
    pub fn memory_used(&self) -> u64 {
        self.memory_used
    }
    pub fn task_stats(&self, task_id: u32) -> Option<TaskStats> {
        self.tasks.get(&task_id).map(|t| TaskStats { epoch: t.epoch, frozen: t.frozen, ..t.stats })
    }
    pub fn has_task(&self, task_id: u32) -> bool {
        self.tasks.contains_key(&task_id)
    }

    /// Allocate a task's region (control plane, ASK step ③).
    pub fn add_task(&mut self, now: Time, spec: KvTaskSpec<A>) -> Result<(), KvAdmitError> {
        spec.layout.validate()?;
        if spec.aa_size == 0 || spec.window == 0 || spec.window > 4096 {
            return Err(KvAdmitError::BadSize { aa_size: spec.aa_size, window: spec.window });
        }
        if self.tasks.contains_key(&spec.task_id) {
            return Err(KvAdmitError::Duplicate(spec.task_id));
        }
        let needed = spec.memory();
        let free = self.config.memory_limit - self.memory_used;
        if needed > free {
            return Err(KvAdmitError::OutOfMemory { needed, free });
        }
        let tenant_used: u64 = self.tasks.values().filter(|t| t.spec.tenant == spec.tenant).map(|t| t.spec.memory()).sum();
        if tenant_used + needed > self.config.tenant_limit {
            return Err(KvAdmitError::TenantLimit { tenant: spec.tenant, needed: tenant_used + needed, limit: self.config.tenant_limit });
        }
        self.memory_used += needed;
        let auth = spec.key.map(|key| TaskAuth::new(key, spec.task_id, self.seal_floor));
        let task = Task {
            auth,
            aggs: Aggregators::new(needed as usize),
            channels: FastMap::default(),
            epoch: 0,
            frozen: false,
            last_active: now,
            stats: TaskStats::default(),
            spec,
        };
        self.tasks.insert(task.spec.task_id, task);
        Ok(())
    }

    /// Free a task's region (ASK step ⑫). Returns false if it did not exist.
    pub fn remove_task(&mut self, task_id: u32) -> bool {
        match self.tasks.remove(&task_id) {
            Some(t) => {
                self.memory_used -= t.spec.memory();
                if let Some(auth) = &t.auth {
                    self.seal_floor = self.seal_floor.max(auth.next_seq());
                }
                true
            }
            None => false,
        }
    }

    /// Earliest idle-task expiry.
    pub fn poll_timeout(&self) -> Option<Time> {
        self.tasks
            .values()
            .filter(|t| !t.spec.idle_timeout.is_zero())
            .map(|t| t.last_active + t.spec.idle_timeout)
            .min()
    }

    /// Free the regions of tasks idle past their timeout.
    pub fn handle_timeout(&mut self, now: Time) {
        let expired: Vec<u32> = self
            .tasks
            .values()
            .filter(|t| !t.spec.idle_timeout.is_zero() && now >= t.last_active + t.spec.idle_timeout)
            .map(|t| t.spec.task_id)
            .collect();
        for id in expired {
            self.remove_task(id);
            self.counters.tasks_expired += 1;
        }
    }

    /// Set the count of every occupied aggregator of `task_id` (tests).
    #[cfg(test)]
    pub(super) fn set_counts(&mut self, task_id: u32, count: u32) {
        if let Some(task) = self.tasks.get_mut(&task_id) {
            task.aggs.set_counts(count);
        }
    }

    /// Process one datagram from `from`.
    pub fn handle_datagram(&mut self, now: Time, from: A, bytes: &[u8], out: &mut impl Transmit<A>) {
        self.counters.rx_datagrams += 1;
        let Some(bytes) = self.authenticate(bytes) else { return };
        let packet = match Packet::new_checked(bytes) {
            Ok(p) => p,
            Err(err) => {
                let kind = err.kind();
                if let Some(i) = WireError::KINDS.iter().position(|k| *k == kind) {
                    self.counters.malformed[i] += 1;
                }
                return;
            }
        };
        let c = &mut self.counters;
        let Some(task) = self.tasks.get_mut(&packet.task_id()) else {
            c.unknown_task += 1;
            // No task, no key: the answer goes out unsealed (a keyed host
            // ignores it and finds out through its own timers).
            nack(c, out, from, &packet, None, NackReason::UnknownTask, packet.task_id());
            return;
        };
        task.last_active = now;
        match packet.msg_type() {
            MessageType::KvData => on_data(c, task, from, &packet, bytes, out),
            MessageType::KvLongData => on_long(c, task, from, &packet, bytes, out),
            MessageType::KvFin => {
                // A sender without data packets is first seen here; the
                // channel's address is needed to relay the FIN-ACK.
                if channel(c, task, from, &packet, out).is_some() {
                    c.relayed += 1;
                    let seal = seal_for(&mut task.auth, Peer::Receiver);
                    send(out, task.spec.receiver, bytes.len(), seal, |buf| buf.copy_from_slice(bytes));
                }
            }
            MessageType::KvAck | MessageType::KvFinAck => {
                if from != task.spec.receiver {
                    c.not_receiver += 1;
                } else if let Some(ch) = task.channels.get(&packet.channel()) {
                    c.relayed += 1;
                    let seal = seal_for(&mut task.auth, Peer::Channel(packet.channel()));
                    send(out, ch.addr, bytes.len(), seal, |buf| buf.copy_from_slice(bytes));
                } else {
                    c.unknown_channel += 1;
                }
            }
            MessageType::KvSwap | MessageType::KvFetch | MessageType::KvClear | MessageType::KvRelease => {
                if from != task.spec.receiver {
                    c.not_receiver += 1;
                    return;
                }
                if packet.msg_type() == MessageType::KvRelease {
                    c.control += 1;
                    c.tasks_released += 1;
                    let id = packet.task_id();
                    let seal = seal_for(&mut task.auth, Peer::Receiver);
                    self.remove_task(id);
                    send_header(out, from, seal, Repr::new(MessageType::KvReleaseAck, id, 0, 0));
                    return;
                }
                on_control(c, task, from, &packet, out)
            }
            _ => c.protocol_violation += 1,
        }
    }
}

impl<A> KvSwitch<A> {
    /// The check before the program: a datagram of a keyed task is verified
    /// under its member's key and passed through the member's replay window;
    /// a sealed datagram of a task without a key cannot be verified. Returns
    /// the datagram without its trailer, or `None` when it was counted and
    /// must be dropped. Datagrams that name no task (too short, not
    /// key-value) are returned as they are, for the parser to count.
    fn authenticate<'a>(&mut self, bytes: &'a [u8]) -> Option<&'a [u8]> {
        let Some(task_id) = sealing::task_of(bytes) else { return Some(bytes) };
        let sealed = fanin_wire::auth::is_sealed(bytes);
        match self.tasks.get_mut(&task_id) {
            Some(Task { auth: Some(auth), .. }) => auth.admit(bytes, &mut self.counters),
            Some(_) if sealed => {
                // A task without a key has nothing to verify it with.
                self.counters.auth_bad_tag += 1;
                None
            }
            // Unverifiable but harmless: the program counts the unknown task.
            None if sealed => Some(fanin_wire::auth::Sealed::split(bytes).map_or(bytes, |s| s.inner)),
            _ => Some(bytes),
        }
    }
}

/// Refuse `p`, answering its sender (sealed with `seal` when keyed).
fn nack<A>(
    c: &mut KvCounters,
    out: &mut impl Transmit<A>,
    to: A,
    p: &Packet<&[u8]>,
    seal: Option<(Key, u64)>,
    reason: NackReason,
    detail: u32,
) {
    c.nacks_sent += 1;
    send(out, to, HEADER_LEN + Nack::LEN, seal, |buf| {
        let mut reply = Packet::new_unchecked(buf);
        Repr::new(MessageType::KvNack, p.task_id(), p.channel(), p.seq()).emit(&mut reply);
        Nack { reason, detail }.emit(reply.body_mut());
    });
}

/// The seal of an answer to the sender of `p`.
fn reply_seal<A>(task: &mut Task<A>, p: &Packet<&[u8]>) -> Option<(Key, u64)> {
    seal_for(&mut task.auth, Peer::sender_of(p))
}

/// Find (or admit) the channel's window; `None` after a nack.
fn channel<'t, A: Copy>(
    c: &mut KvCounters,
    task: &'t mut Task<A>,
    from: A,
    p: &Packet<&[u8]>,
    out: &mut impl Transmit<A>,
) -> Option<&'t mut Channel<A>> {
    let n = task.channels.len();
    let max = task.spec.max_channels;
    let w = task.spec.window;
    match task.channels.entry(p.channel()) {
        std::collections::hash_map::Entry::Occupied(e) => {
            let ch = e.into_mut();
            ch.addr = from;
            Some(ch)
        }
        std::collections::hash_map::Entry::Vacant(e) => {
            if n >= max as usize {
                c.too_many_channels += 1;
                let seal = seal_for(&mut task.auth, Peer::sender_of(p));
                nack(c, out, from, p, seal, NackReason::TooManyChannels, max as u32);
                return None;
            }
            Some(e.insert(Channel { addr: from, window: SeenWindow::new(w) }))
        }
    }
}

fn on_data<A: Copy>(
    c: &mut KvCounters,
    task: &mut Task<A>,
    from: A,
    p: &Packet<&[u8]>,
    bytes: &[u8],
    out: &mut impl Transmit<A>,
) {
    let layout = task.spec.layout;
    if p.slot_count() as usize != layout.slot_count() {
        c.layout_mismatch += 1;
        let seal = reply_seal(task, p);
        nack(c, out, from, p, seal, NackReason::LayoutMismatch, layout.slot_count() as u32);
        return;
    }
    let bitmap = p.bitmap();
    for g in 0..layout.medium_groups {
        let mask = layout.group_mask(g);
        if bitmap & mask != 0 && bitmap & mask != mask {
            c.split_group += 1;
            let seal = reply_seal(task, p);
            nack(c, out, from, p, seal, NackReason::SplitGroup, layout.group_first_slot(g) as u32);
            return;
        }
    }
    let seq = p.seq();
    let Some(ch) = channel(c, task, from, p, out) else { return };
    let remaining = match ch.window.observe(seq) {
        Observation::Stale => {
            c.stale += 1;
            return;
        }
        Observation::BeyondWindow => {
            c.beyond_window += 1;
            return;
        }
        Observation::Duplicate { pkt_state } => {
            c.duplicates += 1;
            pkt_state
        }
        Observation::New => {
            let remaining = aggregate(c, task, p, bitmap);
            let ch = task.channels.get_mut(&p.channel()).expect("admitted above");
            ch.window.record(seq, remaining);
            remaining
        }
    };
    if remaining == 0 {
        c.acked += 1;
        task.stats.packets_acked += 1;
        let repr = Repr { flags: FLAG_BY_SWITCH, ..Repr::new(MessageType::KvAck, p.task_id(), p.channel(), seq) };
        send_header(out, from, seal_for(&mut task.auth, Peer::Channel(p.channel())), repr);
    } else {
        c.forwarded += 1;
        task.stats.packets_forwarded += 1;
        let seal = seal_for(&mut task.auth, Peer::Receiver);
        send(out, task.spec.receiver, bytes.len(), seal, |buf| {
            buf.copy_from_slice(bytes);
            Packet::new_unchecked(buf).set_bitmap(remaining);
        });
    }
}

/// First pass of a data packet: Algorithm 1's `Write` for every tuple.
/// Returns the bitmap of the tuples left in the packet.
///
/// Two steps: first every tuple's aggregator is located and prefetched,
/// then each is compared and written. The aggregators are megabytes of
/// random accesses, and perf annotate put ~45 % of this function on the
/// first load of an aggregator; issuing a packet's loads together overlaps
/// those cache misses instead of taking them one after another.
fn aggregate<A>(c: &mut KvCounters, task: &mut Task<A>, p: &Packet<&[u8]>, bitmap: u64) -> u64 {
    let layout = task.spec.layout;
    let short_mask = if layout.short_slots >= 64 { !0 } else { (1u64 << layout.short_slots) - 1 };
    let groups_present = (0..layout.medium_groups).filter(|&g| bitmap >> layout.group_first_slot(g) & 1 != 0).count();
    let tuples = (bitmap & short_mask).count_ones() as u64 + groups_present as u64;
    c.tuples_in += tuples;
    task.stats.tuples_in += tuples;
    if task.frozen {
        return bitmap;
    }
    let copy = task.copy_indicator();
    let aa_size = task.spec.aa_size;
    let value_type = task.spec.value_type;
    let parts_n = layout.medium_parts as usize;
    // Step 1: where each tuple goes (short slots by slot, medium groups by
    // group), with a prefetch of every aggregator it will read. The
    // positions are kept in uninitialised arrays: zero-filling four 512-byte
    // arrays was a memset call per packet (2 % of the switch thread); step 2
    // reads exactly the entries step 1 wrote, walking the same bitmap.
    let mut short_at = [MaybeUninit::<usize>::uninit(); 64];
    let mut present = bitmap & short_mask;
    while present != 0 {
        let slot = present.trailing_zeros() as usize;
        present &= present - 1;
        let key = u64::from_be_bytes(p.key_part(slot));
        let at = task.base(copy, slot) + aggregator_index(&[key], aa_size);
        task.aggs.prefetch(at);
        short_at[slot].write(at);
    }
    let mut group_index = [MaybeUninit::<usize>::uninit(); 32];
    for g in 0..layout.medium_groups {
        let first = layout.group_first_slot(g) as usize;
        if bitmap >> first & 1 == 0 {
            continue;
        }
        let index = aggregator_index_of(parts_n, |j| u64::from_be_bytes(p.key_part(first + j)), aa_size);
        for j in 0..parts_n {
            task.aggs.prefetch(task.base(copy, first + j) + index);
        }
        group_index[g as usize].write(index);
    }
    // Step 2: Algorithm 1's compare-and-write, in slot order.
    let mut remaining = bitmap;
    let mut absorbed = 0u64;
    let mut present = bitmap & short_mask;
    while present != 0 {
        let slot = present.trailing_zeros() as usize;
        present &= present - 1;
        // SAFETY: step 1 wrote `short_at[slot]` for every slot of this bitmap.
        let at = unsafe { short_at[slot].assume_init() };
        let key = u64::from_be_bytes(p.key_part(slot));
        let agg = task.aggs.get(at);
        // A value whose sum would overflow the register is left for the
        // receiver, which saturates and reports it (never a wrapped sum).
        if agg.count == 0
            || (agg.key == key && agg.count < u32::MAX && value_type.checked_add(agg.sum, p.value(slot)).is_some())
        {
            task.aggs.add(at, key, p.value(slot), value_type);
            remaining &= !(1 << slot);
            absorbed += 1;
        }
    }
    for g in 0..layout.medium_groups {
        let first = layout.group_first_slot(g) as usize;
        if bitmap >> first & 1 == 0 {
            continue;
        }
        // SAFETY: step 1 wrote `group_index[g]` for every group present in
        // this bitmap (the same test as here).
        let index = unsafe { group_index[g as usize].assume_init() };
        let last = first + parts_n - 1;
        let part = |j: usize| u64::from_be_bytes(p.key_part(first + j));
        // The coalesced key matches only if every part matches at the one
        // unified index; the last AA holds the value and speaks for the group.
        let blank = task.aggs.get(task.base(copy, last) + index).count == 0;
        let same = (0..parts_n).all(|j| {
            let a = task.aggs.get(task.base(copy, first + j) + index);
            a.count > 0 && a.key == part(j)
        });
        let last_agg = task.aggs.get(task.base(copy, last) + index);
        let fits = blank || (last_agg.count < u32::MAX && value_type.checked_add(last_agg.sum, p.value(last)).is_some());
        if (blank || same) && fits {
            for j in 0..parts_n {
                let at = task.base(copy, first + j) + index;
                let value = if first + j == last { p.value(last) } else { 0 };
                task.aggs.add(at, part(j), value, value_type);
            }
            remaining &= !layout.group_mask(g);
            absorbed += 1;
        }
    }
    c.tuples_aggregated += absorbed;
    task.stats.tuples_aggregated += absorbed;
    remaining
}

fn on_long<A: Copy>(
    c: &mut KvCounters,
    task: &mut Task<A>,
    from: A,
    p: &Packet<&[u8]>,
    bytes: &[u8],
    out: &mut impl Transmit<A>,
) {
    // Long keys bypass the aggregators, but the packet still takes its seq
    // in the channel's `seen`: the compact array needs every seq observed.
    let seq = p.seq();
    let Some(ch) = channel(c, task, from, p, out) else { return };
    match ch.window.observe(seq) {
        Observation::Stale => c.stale += 1,
        Observation::BeyondWindow => c.beyond_window += 1,
        obs => {
            if obs == Observation::New {
                ch.window.record(seq, 0);
            } else {
                c.duplicates += 1;
            }
            c.forwarded += 1;
            task.stats.packets_forwarded += 1;
            let seal = seal_for(&mut task.auth, Peer::Receiver);
            send(out, task.spec.receiver, bytes.len(), seal, |buf| buf.copy_from_slice(bytes));
        }
    }
}

fn on_control<A: Copy>(c: &mut KvCounters, task: &mut Task<A>, from: A, p: &Packet<&[u8]>, out: &mut impl Transmit<A>) {
    let epoch = p.seq();
    macro_rules! refuse {
        ($reason:expr, $detail:expr) => {{
            c.control_refused += 1;
            let seal = seal_for(&mut task.auth, Peer::Receiver);
            nack(c, out, from, p, seal, $reason, $detail);
            return;
        }};
    }
    match p.msg_type() {
        MessageType::KvSwap => {
            let final_ = p.flags() & FLAG_FINAL != 0;
            if final_ && epoch == task.epoch {
                task.frozen = true;
            } else if !final_ && epoch == task.epoch + 1 && task.spec.shadow_copies && !task.frozen {
                // Algorithm 1, Switch(): flip the copy indicator.
                task.epoch = epoch;
                task.stats.swaps += 1;
                c.swaps += 1;
            } else if final_ || epoch != task.epoch {
                // Anything but a repeated swap the switch already did.
                refuse!(NackReason::StaleEpoch, task.epoch);
            }
            c.control += 1;
            let flags = if task.frozen { FLAG_FINAL } else { 0 };
            let repr = Repr { flags, ..Repr::new(MessageType::KvSwapAck, task.spec.task_id, 0, task.epoch) };
            send_header(out, from, seal_for(&mut task.auth, Peer::Receiver), repr);
        }
        MessageType::KvFetch => {
            let Ok(req) = FetchRequest::parse(p.body()) else { refuse!(NackReason::NoSuchArray, 0) };
            if epoch != task.epoch {
                refuse!(NackReason::StaleEpoch, task.epoch);
            }
            if !task.readable(req.copy) {
                refuse!(NackReason::CopyActive, req.copy as u32);
            }
            if req.aa as usize >= task.spec.layout.slot_count() {
                refuse!(NackReason::NoSuchArray, req.aa as u32);
            }
            c.control += 1;
            // Algorithm 1, Read(): scan the inactive copy from `start`.
            let base = task.base(req.copy as u32, req.aa as usize);
            let size = task.spec.aa_size;
            let max = (req.max_entries as usize).clamp(1, MAX_FETCH_ENTRIES);
            let mut entries = Vec::with_capacity(max);
            let mut next = req.start.min(size);
            while entries.len() < max {
                let Some(at) = task.aggs.next_occupied(base + next as usize, base + size as usize) else {
                    next = size;
                    break;
                };
                let a = task.aggs.get(at);
                let index = (at - base) as u32;
                entries.push(FetchEntry { index, count: a.count, key_part: a.key.to_be_bytes(), sum: a.sum, min: a.min, max: a.max });
                next = index + 1;
            }
            let len = HEADER_LEN + FETCH_REPLY_FIXED + entries.len() * FETCH_ENTRY_LEN;
            let (task_id, epoch) = (task.spec.task_id, task.epoch);
            send(out, from, len, seal_for(&mut task.auth, Peer::Receiver), |buf| {
                let mut reply = Packet::new_unchecked(buf);
                Repr::new(MessageType::KvFetchReply, task_id, 0, epoch).emit(&mut reply);
                let head = FetchReplyHead { copy: req.copy, aa: req.aa, entry_count: entries.len() as u16, start: req.start, next };
                head.emit(reply.body_mut());
                for (i, e) in entries.iter().enumerate() {
                    let at = FETCH_REPLY_FIXED + i * FETCH_ENTRY_LEN;
                    e.emit(&mut reply.body_mut()[at..at + FETCH_ENTRY_LEN]);
                }
            });
        }
        MessageType::KvClear => {
            let copy = p.body()[0];
            if epoch != task.epoch {
                refuse!(NackReason::StaleEpoch, task.epoch);
            }
            if !task.readable(copy) || task.frozen {
                refuse!(NackReason::CopyActive, copy as u32);
            }
            c.control += 1;
            let start = task.base(copy as u32, 0);
            let end = task.base(copy as u32 + 1, 0);
            task.aggs.clear(start, end);
            let (task_id, epoch) = (task.spec.task_id, task.epoch);
            send(out, from, HEADER_LEN + 4, seal_for(&mut task.auth, Peer::Receiver), |buf| {
                let mut reply = Packet::new_unchecked(buf);
                Repr::new(MessageType::KvClearAck, task_id, 0, epoch).emit(&mut reply);
                reply.body_mut().copy_from_slice(&[copy, 0, 0, 0]);
            });
        }
        _ => c.protocol_violation += 1,
    }
}
