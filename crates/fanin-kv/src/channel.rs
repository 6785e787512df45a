//! A data channel: one thread, one UDP socket, the key-value machines placed
//! on it. The thread is the machines' driver and makes no protocol
//! decision: it routes each datagram by the common header's task id (and
//! channel) to a machine, writes what the machines want sent to the task's
//! switch port, fires their timers, and feeds senders from their mapped
//! input a bounded number of tuples at a time.
//!
//! The daemon places receivers and senders on different channels, so a
//! socket carries one role and a Nack is never ambiguous.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fanin_proto::kv::{
    FastMap, KvReceiver, KvResults, KvSender, ReceiverEvent, ReceiverStats, SenderError, SenderEvent, SenderProgress,
    SenderStats,
};
use fanin_proto::{Time, Transmit};
use fanin_udp::{BatchSocket, RecvBatch, SendBatch};
use fanin_wire::kv::Packet;

use crate::records::{Cursor, InputFile, InputFormat};

/// Keep at least this many tuples queued in a sender (about 2k per slot of
/// a 32-slot layout) so every slot has a tuple for the next packet.
const REFILL_BELOW: usize = 1 << 16;
const REFILL_CHUNK: usize = 1 << 16;
/// The machines' `max_burst` (datagrams per `poll_transmit`); the daemon
/// configures them with it.
pub const MAX_BURST: usize = 64;

/// How often a sender's progress is published for its daemon's reports
/// (computing it scans the window).
const PROGRESS_EVERY: Duration = Duration::from_millis(20);

/// A receiver's final collection: complete, or without the `failed`
/// channels (a partial aggregate).
pub struct Collected {
    pub results: KvResults,
    pub stats: ReceiverStats,
    pub failed: Vec<u16>,
}

/// What a receiver reports when it ends.
pub type ReceiverOutcome = Result<Collected, String>;
/// A sender's latest progress, published by its channel thread.
pub type SharedProgress = Arc<Mutex<SenderProgress>>;
/// What a sender reports when it ends.
pub type SenderOutcome = Result<SenderStats, String>;

pub enum ChannelCommand {
    Receive { task: u32, switch: SocketAddr, machine: Box<KvReceiver>, done: SyncSender<ReceiverOutcome> },
    Send {
        task: u32,
        channel: u16,
        switch: SocketAddr,
        machine: Box<KvSender>,
        input: Input,
        progress: SharedProgress,
        done: SyncSender<SenderOutcome>,
    },
    /// Stop every machine of the task (teardown); their callers get `reason`.
    Abort { task: u32, reason: String },
    /// Stop the sender of one channel; its caller gets `reason`.
    AbortSender { task: u32, channel: u16, reason: String },
    /// The task's receiver stops waiting for this channel (its sender is
    /// gone) and collects a partial aggregate once the others finished.
    SenderFailed { task: u32, channel: u16 },
    /// A sender of the task reported progress: the task is alive even if
    /// its receiver hears nothing (the switch absorbs every packet).
    SenderProgress { task: u32 },
}

/// A sender's input: a mapped file read through a cursor.
pub struct Input {
    pub file: InputFile,
    pub format: InputFormat,
    pub offset: usize,
}

/// Daemon-wide counters a channel thread updates.
#[derive(Default)]
pub struct ChannelStats {
    pub rx_datagrams: AtomicU64,
    /// Not a key-value datagram (counted, dropped).
    pub malformed: AtomicU64,
    /// A key-value datagram for no machine on this channel.
    pub unroutable: AtomicU64,
    pub tx_datagrams: AtomicU64,
    pub send_errors: AtomicU64,
}

struct ReceiverSlot {
    switch: SocketAddr,
    machine: Box<KvReceiver>,
    /// `None` once the results were handed over (the machine lingers to
    /// answer repeated FINs, then releases the region).
    done: Option<SyncSender<ReceiverOutcome>>,
}

struct SenderSlot {
    switch: SocketAddr,
    machine: Box<KvSender>,
    input: Input,
    input_done: bool,
    failed: bool,
    progress: SharedProgress,
    published: Time,
    done: SyncSender<SenderOutcome>,
}

pub struct ChannelThread {
    pub socket: BatchSocket,
    pub commands: Receiver<ChannelCommand>,
    pub stats: Arc<ChannelStats>,
    pub shutdown: Arc<AtomicBool>,
    pub epoch: Instant,
}

/// Writes a machine's datagrams into the batch, addressed to its switch port.
struct ToSwitch<'a> {
    socket: &'a BatchSocket,
    batch: &'a mut SendBatch,
    dest: SocketAddr,
    stats: &'a ChannelStats,
}

impl Transmit<()> for ToSwitch<'_> {
    fn push(&mut self, _: (), len: usize) -> &mut [u8] {
        if self.batch.is_full() {
            flush(self.socket, self.batch, self.stats);
        }
        self.batch.push(self.dest, len)
    }
}

fn flush(socket: &BatchSocket, batch: &mut SendBatch, stats: &ChannelStats) {
    if batch.is_empty() {
        return;
    }
    let n = batch.len() as u64;
    match socket.send_batch(batch) {
        Ok(sent) => {
            stats.tx_datagrams.fetch_add(sent as u64, Ordering::Relaxed);
            stats.send_errors.fetch_add(n - sent as u64, Ordering::Relaxed);
        }
        Err(_) => {
            stats.send_errors.fetch_add(n, Ordering::Relaxed);
            batch.clear();
        }
    }
}

impl ChannelThread {
    pub fn run(self) {
        let mut receivers: FastMap<u32, ReceiverSlot> = FastMap::default();
        let mut senders: FastMap<(u32, u16), SenderSlot> = FastMap::default();
        // Batched I/O as in the switch: a sender's data packets have one
        // length and one destination, so GSO sends a window in a few calls;
        // GRO coalesces the switch's ACK bursts.
        let gro = self.socket.enable_gro().unwrap_or(false);
        let mut rx = RecvBatch::new(64, if gro { fanin_udp::GRO_SLOT_SIZE } else { 2048 });
        let mut tx = SendBatch::new(256);
        tx.set_gso(self.socket.gso_supported());
        let _ = self.socket.set_nonblocking(true);
        // The machines' poll_timeout and poll_transmit scan their windows
        // (O(W)), so each is called once per iteration: transmit, learn the
        // next deadline, wait for datagrams, run timers only when that
        // deadline has passed.
        while !self.shutdown.load(Ordering::Relaxed) {
            self.drain_commands(&mut receivers, &mut senders);
            let now = self.now();
            self.transmit(now, &mut receivers, &mut senders, &mut tx);
            let idle = receivers.is_empty() && senders.is_empty();
            let deadline = receivers
                .values()
                .filter_map(|r| r.machine.poll_timeout())
                .chain(senders.values().filter_map(|s| s.machine.poll_timeout()))
                .min();
            let wait = match deadline {
                Some(d) => Duration::from_nanos(d.as_nanos().saturating_sub(now.as_nanos())).min(Duration::from_millis(2)),
                None if idle => Duration::from_millis(10),
                None => Duration::from_millis(2),
            };
            if self.socket.wait_readable(wait).unwrap_or(true) {
                let n = self.socket.recv_batch(&mut rx).unwrap_or(0);
                if n > 0 {
                    let now = self.now();
                    for (_, bytes) in rx.iter() {
                        self.route(now, bytes, &mut receivers, &mut senders);
                    }
                }
            }
            let now = self.now();
            if deadline.is_some_and(|d| d <= now) {
                for r in receivers.values_mut() {
                    if r.machine.poll_timeout().is_some_and(|t| t <= now) {
                        r.machine.handle_timeout(now);
                    }
                }
                for s in senders.values_mut() {
                    if s.machine.poll_timeout().is_some_and(|t| t <= now) {
                        s.machine.handle_timeout(now);
                    }
                }
            }
            collect_events(&mut receivers, &mut senders);
            publish_progress(self.now(), &mut senders);
        }
        for (_, r) in receivers {
            if let Some(done) = r.done {
                let _ = done.send(Err("the daemon is shutting down".into()));
            }
        }
        for (_, s) in senders {
            let _ = s.done.send(Err("the daemon is shutting down".into()));
        }
    }

    fn now(&self) -> Time {
        Time::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    fn drain_commands(&self, receivers: &mut FastMap<u32, ReceiverSlot>, senders: &mut FastMap<(u32, u16), SenderSlot>) {
        loop {
            match self.commands.try_recv() {
                Ok(ChannelCommand::Receive { task, switch, machine, done }) => {
                    receivers.insert(task, ReceiverSlot { switch, machine, done: Some(done) });
                }
                Ok(ChannelCommand::Send { task, channel, switch, machine, input, progress, done }) => {
                    let slot = SenderSlot { switch, machine, input, input_done: false, failed: false, progress, published: Time::ZERO, done };
                    senders.insert((task, channel), slot);
                }
                Ok(ChannelCommand::AbortSender { task, channel, reason }) => {
                    if let Some(s) = senders.remove(&(task, channel)) {
                        let _ = s.done.send(Err(reason));
                    }
                }
                Ok(ChannelCommand::SenderFailed { task, channel }) => {
                    if let Some(r) = receivers.get_mut(&task) {
                        r.machine.sender_failed(channel);
                    }
                }
                Ok(ChannelCommand::SenderProgress { task }) => {
                    if let Some(r) = receivers.get_mut(&task) {
                        r.machine.note_sender_progress(self.now());
                    }
                }
                Ok(ChannelCommand::Abort { task, reason }) => {
                    if let Some(r) = receivers.remove(&task) {
                        if let Some(done) = r.done {
                            let _ = done.send(Err(reason.clone()));
                        }
                    }
                    let keys: Vec<_> = senders.keys().filter(|(t, _)| *t == task).copied().collect();
                    for k in keys {
                        if let Some(s) = senders.remove(&k) {
                            let _ = s.done.send(Err(reason.clone()));
                        }
                    }
                }
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return,
            }
        }
    }

    fn route(&self, now: Time, bytes: &[u8], receivers: &mut FastMap<u32, ReceiverSlot>, senders: &mut FastMap<(u32, u16), SenderSlot>) {
        self.stats.rx_datagrams.fetch_add(1, Ordering::Relaxed);
        // A sealed datagram is routed by the header inside its trailer; the
        // machine verifies it (and counts it if it does not verify).
        let header = fanin_wire::auth::Sealed::split(bytes).map_or(bytes, |s| s.inner);
        let Ok(p) = Packet::new_checked(header) else {
            self.stats.malformed.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if let Some(r) = receivers.get_mut(&p.task_id()) {
            r.machine.handle_datagram(now, bytes);
        } else if let Some(s) = senders.get_mut(&(p.task_id(), p.channel())) {
            s.machine.handle_datagram(now, bytes);
        } else {
            self.stats.unroutable.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn transmit(&self, now: Time, receivers: &mut FastMap<u32, ReceiverSlot>, senders: &mut FastMap<(u32, u16), SenderSlot>, tx: &mut SendBatch) {
        for r in receivers.values_mut() {
            let mut out = ToSwitch { socket: &self.socket, batch: tx, dest: r.switch, stats: &self.stats };
            while r.machine.poll_transmit(now, &mut out) >= MAX_BURST {}
        }
        for s in senders.values_mut() {
            let mut out = ToSwitch { socket: &self.socket, batch: tx, dest: s.switch, stats: &self.stats };
            // A full burst means there may be more; fewer means the window
            // is full or everything is sent (the refill before each call
            // keeps the queues from running dry).
            loop {
                refill(s);
                if s.machine.poll_transmit(now, &mut out) < MAX_BURST {
                    break;
                }
            }
        }
        flush(&self.socket, tx, &self.stats);
    }
}

/// Push input into the sender until enough is queued; close it at the end.
fn refill(s: &mut SenderSlot) {
    if s.input_done || s.machine.queued() >= REFILL_BELOW {
        return;
    }
    // Resuming is positional: a cursor over the file's bytes from the
    // record or word boundary where the previous one stopped. A record the
    // bytes read so far cut (or a word that touches their end: it may go
    // on) is read again from a longer window.
    enum Stop {
        Refilled,
        More,
        End,
        Failed(String),
    }
    let mut want = 1 << 16;
    let mut pushed = 0;
    loop {
        let (bytes, at_end) = match s.input.file.window(s.input.offset as u64, want) {
            Ok(window) => window,
            Err(e) => {
                fail_input(s, format!("cannot read the input: {e}"));
                return;
            }
        };
        let mut cursor = Cursor::at(bytes, s.input.format, 0);
        let mut consumed = 0;
        let stop = loop {
            if pushed >= REFILL_CHUNK {
                break Stop::Refilled;
            }
            match cursor.next_tuple() {
                Ok(Some((key, value))) if at_end || cursor.offset() < bytes.len() => {
                    if let Err(e) = s.machine.push(key, value) {
                        break Stop::Failed(format!("{e} (input record at byte {})", s.input.offset + consumed));
                    }
                    consumed = cursor.offset();
                    pushed += 1;
                }
                Ok(None) if at_end => break Stop::End,
                Err(e) if at_end => break Stop::Failed(e.offset_by(s.input.offset).to_string()),
                // cut by the window's end: a longer one
                _ => break Stop::More,
            }
        };
        let window_len = bytes.len();
        s.input.offset += consumed;
        match stop {
            Stop::Refilled => return,
            Stop::More => want = if consumed > 0 { want } else { window_len.saturating_mul(2).max(want) },
            Stop::End => {
                s.machine.finish();
                s.input_done = true;
                return;
            }
            Stop::Failed(why) => {
                fail_input(s, why);
                return;
            }
        }
    }
}

/// Bad input ends the sender: its caller gets the error and the machine is
/// dropped (the daemon then tells the task's receiver, which tears down).
fn fail_input(s: &mut SenderSlot, message: String) {
    s.input_done = true;
    s.failed = true;
    let _ = s.done.send(Err(message));
}

/// Report finished and failed machines and drop the ones that are over.
fn collect_events(receivers: &mut FastMap<u32, ReceiverSlot>, senders: &mut FastMap<(u32, u16), SenderSlot>) {
    receivers.retain(|_, r| {
        while let Some(ev) = r.machine.poll_event() {
            match ev {
                ReceiverEvent::Finished | ReceiverEvent::Incomplete { .. } => {
                    let failed = match ev {
                        ReceiverEvent::Incomplete { failed } => failed,
                        _ => Vec::new(),
                    };
                    if let Some(done) = r.done.take() {
                        // The machine keeps running a while (linger, then
                        // Release) without them.
                        let collected = Collected { results: r.machine.take_results(), stats: r.machine.stats(), failed };
                        let _ = done.send(Ok(collected));
                    }
                }
                ReceiverEvent::Failed(e) => {
                    if let Some(done) = r.done.take() {
                        let _ = done.send(Err(e.to_string()));
                    }
                    return false;
                }
            }
        }
        !(r.machine.is_released() && r.done.is_none())
    });
    senders.retain(|_, s| {
        if s.failed {
            return false;
        }
        let mut keep = true;
        while let Some(ev) = s.machine.poll_event() {
            let outcome = match ev {
                SenderEvent::Finished => Ok(s.machine.stats()),
                SenderEvent::Failed(e) => Err(describe_sender_error(&e)),
            };
            let _ = s.done.send(outcome);
            keep = false;
        }
        keep
    });
}

/// Publish each sender's progress for its daemon's reports, at most every
/// `PROGRESS_EVERY`.
fn publish_progress(now: Time, senders: &mut FastMap<(u32, u16), SenderSlot>) {
    for s in senders.values_mut() {
        if now.as_nanos() >= s.published.as_nanos() + PROGRESS_EVERY.as_nanos() as u64 {
            s.published = now;
            if let Ok(mut p) = s.progress.lock() {
                *p = s.machine.progress();
            }
        }
    }
}

fn describe_sender_error(e: &SenderError) -> String {
    match e {
        SenderError::PeerSilent(_) => format!("{e} (the receiver or the switch disappeared)"),
        _ => e.to_string(),
    }
}
