//! One run-to-completion shard thread: receive a batch, run every datagram
//! through the shard's `ValueSwitch` (value packets) or its `KvSwitch`
//! (key-value packets, message types 0x20-0x3f), send the batch of replies.
//!
//! With trimming on, the thread reads its socket's receive queue just before
//! and after each batch (`SO_MEMINFO`, one syscall each): the datagrams that
//! sat beyond the watermark in that queue (`Watermark::plan`) go back to
//! their senders as Trimmed nacks (`ValueSwitch::trim_datagram`: a keyed
//! job's verified and sealed, an unkeyed job's header-only and plain)
//! instead of into aggregation, so senders slow down before the kernel
//! drops silently. (One look after the batch is not enough: with GRO a batch
//! can hold more than the whole buffer, so the queue is empty behind it.)
//!
//! Key-value tasks are sharded by task id: task `t` lives on shard
//! `t mod shards` (hosts learn that shard's port from the control API), so
//! one thread owns every aggregator and receive window of a task and the
//! hot path takes no locks. A key-value datagram that arrives on another
//! shard is handed over like a value packet for a foreign block.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fanin_proto::fault::{DropInjector, ReceiveFaults};
use fanin_proto::job::JobSpec;
use fanin_proto::kv::{KvAdmitError, KvCounters, KvSwitch, KvTaskSpec, TaskStats};
use fanin_proto::switch::{AdmitError, Counters, Idle, AgingBoard, Uplink, ValueSwitch, Verdict};
use fanin_proto::trim::{TrimCause, TrimPlan, TrimVerdict, Watermark};
use fanin_proto::{Time, Transmit};
use fanin_udp::{BatchSocket, RecvBatch, SendBatch};

use crate::handover::{hand_over, HandoverGate, HANDOVER_CAP};

/// Requests from the control plane and from sibling shards.
pub(crate) enum Command {
    AddJob(JobSpec, Option<Uplink<SocketAddr>>, SyncSender<Result<(), AdmitError>>),
    UpdateJob(JobSpec, Option<Uplink<SocketAddr>>, Vec<u16>, SyncSender<Result<(), AdmitError>>),
    /// Would this shard take the update? Changes nothing
    /// ([`ValueSwitch::check_update`]).
    CheckUpdate(JobSpec, Option<Uplink<SocketAddr>>, Vec<u16>, SyncSender<Result<(), AdmitError>>),
    /// Remove a job: true, as an operator's removal; false, to undo an
    /// admission that failed on another shard (the result-key epochs stay
    /// where they were, [`ValueSwitch::undo_add_job`]).
    RemoveJob(u32, bool, SyncSender<bool>),
    /// Relay a job toward the next hop's shard of this index (GOAT's
    /// on-path filtering): [`ValueSwitch::add_transit`].
    AddTransit(u32, Vec<SocketAddr>, Vec<u16>, SyncSender<Result<(), AdmitError>>),
    RemoveTransit(u32, SyncSender<bool>),
    /// A datagram received by another shard for a block (or key-value
    /// task) this shard owns, and whether it arrived CE-marked.
    Handover(SocketAddr, Vec<u8>, bool),
    /// What another shard's Join handling changed (a joiner's sync start,
    /// whether a member listens on the result group, a round that started
    /// or ended): [`ValueSwitch::learn`].
    Learn(Verdict),
    AddKvTask(Box<KvTaskSpec<SocketAddr>>, SyncSender<Result<(), KvAdmitError>>),
    RemoveKvTask(u32, SyncSender<bool>),
    /// Which of these tasks still hold a region, with their figures.
    KvTaskStats(Vec<u32>, SyncSender<Vec<(u32, Option<TaskStats>)>>),
    /// A scanner thread found these blocks of a job idle for enough visits
    /// (`[aging] threads`): [`ValueSwitch::age_idle`].
    AgeIdle(u32, Arc<AgingBoard>, Vec<Idle>),
}

/// What a shard publishes for metrics and the control API.
#[derive(Default)]
pub(crate) struct ShardStats {
    pub counters: Mutex<Counters>,
    pub kv_counters: Mutex<KvCounters>,
    pub memory_used: AtomicU64,
    /// Aggregators held by key-value tasks.
    pub kv_memory_used: AtomicU64,
    pub fault_ingress_dropped: AtomicU64,
    pub fault_ingress_duplicated: AtomicU64,
    pub fault_ingress_reordered: AtomicU64,
    pub fault_egress_dropped: AtomicU64,
    /// Batched sends that failed outright (the whole batch is counted in
    /// `send_dropped` too).
    pub send_errors: AtomicU64,
    /// Datagrams the kernel did not take (its queue stayed full, or a send
    /// to one destination failed): what `send_errors` does not count when
    /// the rest of the batch went out.
    pub send_dropped: AtomicU64,
    /// Datagrams for another shard dropped because that shard had
    /// [`HANDOVER_CAP`](crate::handover::HANDOVER_CAP) waiting already.
    pub handover_dropped: AtomicU64,
    pub batches: AtomicU64,
}

pub(crate) struct ShardThread {
    pub switch: ValueSwitch<SocketAddr>,
    pub kv: KvSwitch<SocketAddr>,
    pub index: u16,
    pub socket: BatchSocket,
    /// The socket can send to IPv4 multicast groups (jobs' result groups).
    pub multicast: bool,
    pub commands: Receiver<Command>,
    pub peers: Vec<Sender<Command>>,
    /// How many datagrams each shard has yet to take from its channel.
    pub handovers: Arc<HandoverGate>,
    pub stats: Arc<ShardStats>,
    pub shutdown: Arc<AtomicBool>,
    /// False until the jobs of the config are admitted: the data socket is
    /// bound but not read, so a worker that reaches a restarting daemon
    /// early finds its job instead of an UnknownJob nack.
    pub open: Arc<AtomicBool>,
    pub epoch: Instant,
    pub batch: usize,
    pub ingress: ReceiveFaults,
    /// The order `ingress` chose for the current batch (reused buffer).
    pub ingress_order: Vec<usize>,
    pub egress: DropInjector,
    /// Trimming on overload, if enabled.
    pub trim: Option<Watermark>,
    /// Data contributions answered with a Trimmed nack.
    pub trimmed: u64,
    /// With ECN on (`ecn`): the peers that send Not-ECT.
    pub not_ect: Option<NotEct>,
    /// Marking on a deep receive queue (`[trim] mark_watermark`), if set.
    pub mark: Option<Watermark>,
    /// Datagrams this shard's own receive queue marked.
    pub queue_marked: u64,
    /// The kernel's drop count on this shard's socket.
    pub socket_drops: u64,
    /// With scanner threads (`[aging] threads`): where this shard publishes
    /// its scan schedules, and the eventfd the scanners wake it with.
    pub scan: Option<(crate::scanners::Registry, Arc<crate::scanners::Waker>)>,
}

/// The peers whose own datagrams arrive Not-ECT: they do not answer ECN
/// marks (key-value hosts, sessions with ECN off), so what the shard sends
/// them leaves Not-ECT, and a queue drops it rather than marking it (RFC
/// 3168 §5). Everyone else, switches and ECN sessions, which send ECT(0),
/// gets the socket's ECT(0): no handshake, the codepoint a peer sends is
/// its word. Bounded, so a flood of spoofed sources cannot grow it: when
/// full it starts over (forgotten peers get ECT(0) until they send again).
#[derive(Debug, Default)]
pub struct NotEct {
    set: std::collections::HashSet<SocketAddr>,
    /// The last peer learnt from: a batch holds runs of one peer's datagrams.
    last: Option<(SocketAddr, bool)>,
}

impl NotEct {
    const MAX: usize = 4096;

    fn contains(&self, peer: &SocketAddr) -> bool {
        !self.set.is_empty() && self.set.contains(peer)
    }

    /// What a datagram from `peer` arriving with `codepoint` says.
    fn learn(&mut self, peer: SocketAddr, codepoint: u8) {
        let capable = codepoint != fanin_udp::ecn::NOT_ECT;
        if self.last == Some((peer, capable)) {
            return;
        }
        self.last = Some((peer, capable));
        if capable {
            self.set.remove(&peer);
        } else if !self.set.contains(&peer) {
            // (a peer already known is not news: only a new one may find
            // the table full)
            if self.set.len() >= Self::MAX {
                self.set.clear();
            }
            self.set.insert(peer);
        }
    }
}

#[cfg(test)]
mod not_ect_tests {
    use super::*;
    use fanin_udp::ecn::{CE, ECT_0, NOT_ECT};

    fn peer(i: u32) -> SocketAddr {
        SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 9000))
    }

    #[test]
    fn a_peer_is_not_ect_from_its_last_word_and_a_full_table_starts_over_only_for_a_new_peer() {
        let mut t = NotEct::default();
        t.learn(peer(1), NOT_ECT);
        assert!(t.contains(&peer(1)));
        t.learn(peer(1), ECT_0);
        assert!(!t.contains(&peer(1)), "it sends ECT now");
        t.learn(peer(1), CE);
        assert!(!t.contains(&peer(1)), "a mark on the way says it sent ECT");
        // full: known peers sending again (between others) keep the table
        for i in 0..NotEct::MAX as u32 {
            t.learn(peer(i), NOT_ECT);
        }
        assert_eq!(t.set.len(), NotEct::MAX);
        for i in 0..100 {
            t.learn(peer(i), NOT_ECT);
            t.learn(peer(i + 1), NOT_ECT);
        }
        assert_eq!(t.set.len(), NotEct::MAX, "nothing new: nothing forgotten");
        // a new one starts it over (a spoofed flood cannot grow it)
        t.learn(peer(1 << 20), NOT_ECT);
        assert_eq!(t.set.len(), 1);
        assert!(t.contains(&peer(1 << 20)) && !t.contains(&peer(5)));
    }
}

/// Sends through the batch, flushing when it fills; egress faults drop here.
struct SocketTx<'a> {
    socket: &'a BatchSocket,
    multicast: bool,
    batch: &'a mut SendBatch,
    egress: &'a mut DropInjector,
    discard: &'a mut Vec<u8>,
    stats: &'a ShardStats,
    /// With ECN on: the peers whose own datagrams arrive Not-ECT (key-value
    /// hosts, sessions with ECN off), which get Not-ECT datagrams; everyone
    /// else gets the socket's ECT(0).
    not_ect: Option<&'a NotEct>,
    /// Relaying a datagram that arrived CE-marked (a GOAT on-path relay):
    /// it leaves marked to peers that answer marks.
    relaying_ce: bool,
}

impl SocketTx<'_> {
    /// The codepoint a datagram to `dest` leaves with.
    fn codepoint_for(&self, dest: SocketAddr) -> u8 {
        if self.not_ect.is_some_and(|n| n.contains(&dest)) {
            fanin_udp::ecn::NOT_ECT
        } else if self.relaying_ce {
            fanin_udp::ecn::CE
        } else {
            fanin_udp::ECN_SOCKET
        }
    }
}

impl Transmit<SocketAddr> for SocketTx<'_> {
    fn set_relaying_ce(&mut self, ce: bool) {
        // only a switch that reads marks (ECN on) is told of any
        self.relaying_ce = ce && self.not_ect.is_some();
    }

    fn push(&mut self, dest: SocketAddr, len: usize) -> &mut [u8] {
        if self.egress.should_drop() {
            self.discard.resize(len, 0);
            return &mut self.discard[..len];
        }
        if self.batch.is_full() {
            flush(self.socket, self.batch, self.stats);
        }
        let codepoint = self.codepoint_for(dest);
        self.batch.push_ecn(dest, len, codepoint)
    }

    /// One copy into the batch, aliased for the other destinations: the
    /// kernel reads the same bytes for each (egress faults still drop per
    /// destination).
    fn push_fanout(&mut self, dests: impl IntoIterator<Item = SocketAddr>, bytes: &[u8]) -> usize {
        let mut n = 0;
        let mut queued = false;
        for dest in dests {
            n += 1;
            if self.egress.should_drop() {
                continue;
            }
            if self.batch.is_full() {
                flush(self.socket, self.batch, self.stats);
                queued = false;
            }
            if !(queued && self.batch.push_alias(dest)) {
                self.batch.push_copy(dest, bytes);
                queued = true;
            }
            let codepoint = self.codepoint_for(dest);
            self.batch.set_last_ecn(codepoint);
        }
        n
    }

    /// One datagram to the group (egress faults may drop it, as they would
    /// a member's copy); refused on a socket that cannot reach IPv4 groups,
    /// so the program falls back to unicast.
    ///
    /// The one copy is ECN-capable only if every listener is known and
    /// answers marks: one that does not (or that has not been heard from)
    /// would take a CE mark on the group's path as nothing, so for it the
    /// path must drop instead (RFC 3168 §5).
    fn push_group(
        &mut self,
        group: SocketAddrV4,
        listeners: impl IntoIterator<Item = Option<SocketAddr>>,
        bytes: &[u8],
    ) -> bool {
        if !self.multicast {
            return false;
        }
        if self.egress.should_drop() {
            return true;
        }
        if self.batch.is_full() {
            flush(self.socket, self.batch, self.stats);
        }
        let codepoint = match self.not_ect {
            Some(not_ect) if !listeners.into_iter().all(|l| l.is_some_and(|a| !not_ect.contains(&a))) => {
                fanin_udp::ecn::NOT_ECT
            }
            _ => fanin_udp::ECN_SOCKET,
        };
        self.batch.push_ecn(SocketAddr::V4(group), bytes.len(), codepoint).copy_from_slice(bytes);
        true
    }
}

fn flush(socket: &BatchSocket, batch: &mut SendBatch, stats: &ShardStats) {
    if batch.is_empty() {
        return;
    }
    let queued = batch.len() as u64;
    match socket.send_batch(batch) {
        Ok(sent) => {
            // (a result lost here is recovered by its members' retransmissions)
            stats.send_dropped.fetch_add(queued.saturating_sub(sent as u64), Ordering::Relaxed);
        }
        Err(_) => {
            stats.send_errors.fetch_add(1, Ordering::Relaxed);
            stats.send_dropped.fetch_add(queued, Ordering::Relaxed);
            batch.clear();
        }
    }
}

#[cfg(test)]
mod flush_tests {
    use super::*;

    #[test]
    fn datagrams_the_kernel_refused_are_counted_even_when_the_rest_went_out() {
        let socket = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let sink = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let stats = ShardStats::default();
        let mut batch = SendBatch::new(8);
        // the broadcast address without SO_BROADCAST: EACCES for that one
        let refused: SocketAddr = "255.255.255.255:9".parse().unwrap();
        batch.push(sink.local_addr().unwrap(), 10).fill(1);
        batch.push(refused, 10).fill(2);
        batch.push(sink.local_addr().unwrap(), 10).fill(3);
        flush(&socket, &mut batch, &stats);
        assert_eq!(stats.send_dropped.load(Ordering::Relaxed), 1);
        assert_eq!(stats.send_errors.load(Ordering::Relaxed), 0, "the others went out");
        assert!(batch.is_empty());
        // a batch of which nothing went out: an error, every datagram dropped
        batch.push(refused, 10).fill(4);
        batch.push(refused, 10).fill(5);
        flush(&socket, &mut batch, &stats);
        assert_eq!(stats.send_errors.load(Ordering::Relaxed), 1);
        assert_eq!(stats.send_dropped.load(Ordering::Relaxed), 3);
    }
}

impl ShardThread {
    pub fn run(mut self) {
        let mut rx = RecvBatch::new(self.batch, fanin_udp::GRO_SLOT_SIZE);
        let mut tx = SendBatch::new(self.batch * 8);
        tx.set_gso(self.socket.gso_supported());
        let mut discard = Vec::new();
        // Short timeout so commands and shutdown are noticed promptly.
        const IDLE: Duration = Duration::from_millis(5);
        let _ = self.socket.set_read_timeout(Some(IDLE));
        // The straggler scanners need wake-ups tens of microseconds apart:
        // ask the kernel for 1 us timer slack on this thread (default 50 us).
        // SAFETY: prctl with an integer argument has no memory effects.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong, 0, 0, 0) };
        while !self.shutdown.load(Ordering::Relaxed) {
            self.drain_commands(&mut tx, &mut discard);
            if !self.open.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            // When a scanner tick is due before the idle timeout, wait for it
            // with ppoll (high-resolution) and receive only what is queued.
            let ready = match (self.switch.poll_timeout(), &self.scan) {
                // scanner threads wake this shard through its eventfd: wait
                // for the socket or a wake-up, whichever comes first
                (deadline, Some((_, waker))) => {
                    let wait = deadline.map_or(IDLE, |d| {
                        Duration::from_nanos(d.as_nanos().saturating_sub(self.now().as_nanos())).min(IDLE)
                    });
                    let (readable, woken) = wait_socket_or(&self.socket, waker.raw_fd(), wait);
                    if woken {
                        waker.clear();
                    }
                    readable
                }
                (Some(deadline), None) => {
                    let wait = Duration::from_nanos(deadline.as_nanos().saturating_sub(self.now().as_nanos()));
                    wait >= IDLE || self.socket.wait_readable(wait).unwrap_or(true)
                }
                (None, None) => true,
            };
            // The backlog the batch is taken from (only needed to trim).
            let before = if ready && (self.trim.is_some() || self.mark.is_some()) { self.queued_bytes() } else { 0 };
            // A receive error (e.g. ICMP feedback) is not fatal: try again.
            let n = if ready { self.socket.recv_batch(&mut rx).unwrap_or_default() } else { 0 };
            // The queue behind the batch, read before anything else runs
            // (the trim plan compares it with `before`).
            let queue = if n > 0 { Some(self.socket.receive_queue()) } else { None };
            if n > 0 {
                // What another shard passed on before its answers left (a
                // round started: its members were told to go) is applied
                // before anything those answers caused: a peer tells the
                // others before it flushes, so whatever in this batch a
                // verdict caused was sent after the verdict was queued
                // (one that arrives first anyway, past a batch that filled
                // and flushed early, is still kept: ValueSwitch::start_round).
                self.drain_commands(&mut tx, &mut discard);
            }
            let now = self.now();
            if let Some(not_ect) = self.not_ect.as_mut() {
                // what each sender's codepoint says of it, before anything
                // in this batch is answered
                for (from, _, codepoint) in rx.iter_codepoints() {
                    not_ect.learn(from, codepoint);
                }
            }
            let mut out = SocketTx {
                socket: &self.socket,
                multicast: self.multicast,
                batch: &mut tx,
                egress: &mut self.egress,
                discard: &mut discard,
                stats: &self.stats,
                not_ect: self.not_ect.as_ref(),
                relaying_ce: false,
            };
            if let Some(queue) = queue {
                // (the same walk over the batch for the marking watermark)
                let (mut plan, mut mark_plan) = match queue {
                    Ok(q) => {
                        self.socket_drops = q.drops;
                        let batch_len = || rx.iter().map(|(_, b)| b.len()).sum();
                        let plan = |w: Option<Watermark>| {
                            w.map_or(TrimPlan::NEVER, |w| w.plan(before, q.queued_bytes, q.limit_bytes, batch_len()))
                        };
                        (plan(self.trim), plan(self.mark))
                    }
                    Err(_) => (TrimPlan::NEVER, TrimPlan::NEVER),
                };
                // With ingress faults on, process the batch in the order they
                // chose (drops left out, duplicates twice, some swapped).
                let faulty = self.ingress.is_enabled().then(|| {
                    let all: Vec<_> = rx.iter_ecn().collect();
                    self.ingress.schedule(all.len(), &mut self.ingress_order);
                    self.ingress_order.iter().map(|&i| all[i]).collect::<Vec<_>>()
                });
                let plain = faulty.is_none().then(|| rx.iter_ecn());
                // `ce`: a queue on the way marked the datagram (ECN)
                for (from, bytes, ce) in faulty.into_iter().flatten().chain(plain.into_iter().flatten()) {
                    let mut queue_mark = false;
                    let owner = match kv_task_of(bytes) {
                        Some(task) => {
                            let owner = kv_owner(task, self.peers.len());
                            if owner == self.index {
                                self.kv.handle_datagram(now, from, bytes, &mut out);
                                continue;
                            }
                            owner
                        }
                        None => {
                            // the shard's own queue above the marking
                            // watermark: as if a queue on the path marked it
                            queue_mark = mark_plan.trims(bytes.len());
                            if plan.trims(bytes.len()) {
                                match self.switch.trim_datagram(now, from, bytes, TrimCause::ProcessingQueue, &mut out) {
                                    TrimVerdict::Trimmed => {
                                        self.trimmed += 1;
                                        continue;
                                    }
                                    TrimVerdict::Refused => continue,
                                    TrimVerdict::Process => {}
                                }
                            }
                            if queue_mark {
                                self.queue_marked += 1;
                            }
                            match self.switch.handle_datagram_ce(now, from, bytes, ce || queue_mark, &mut out) {
                                Verdict::Consumed => continue,
                                Verdict::WrongShard(owner) => owner,
                                // What a Join changed that every shard must know:
                                // each holds some of the job's blocks and sends
                                // their results.
                                verdict => {
                                    tell_peers(&self.peers, self.index, verdict);
                                    continue;
                                }
                            }
                        }
                    };
                    hand_over(&self.peers, &self.handovers, &self.stats, owner, from, bytes, ce || queue_mark);
                }
                self.stats.batches.fetch_add(1, Ordering::Relaxed);
            }
            // The straggler scanners (Trio's timer threads) run on the shard
            // that owns the blocks, between batches: no locks.
            if self.switch.poll_timeout().is_some_and(|t| t <= now) {
                self.switch.handle_timeout(now, &mut out);
            }
            // Idle key-value tasks (a receiver or every sender vanished)
            // lose their region here.
            if self.kv.poll_timeout().is_some_and(|t| t <= now) {
                self.kv.handle_timeout(now);
            }
            flush(&self.socket, &mut tx, &self.stats);
            self.publish();
        }
        self.publish();
    }

    fn queued_bytes(&self) -> usize {
        self.socket.receive_queue().map_or(0, |q| q.queued_bytes)
    }

    fn now(&self) -> Time {
        Time::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    fn drain_commands(&mut self, tx: &mut SendBatch, discard: &mut Vec<u8>) {
        // Handovers taken this time: at most as many as can wait, so peers
        // that keep handing over cannot keep this shard from its socket.
        let mut handovers = 0;
        while handovers < HANDOVER_CAP {
            match self.commands.try_recv() {
                Ok(Command::AddJob(spec, uplink, reply)) => {
                    let job_id = spec.job_id;
                    let result = self.switch.add_job(spec).and_then(|()| {
                        self.switch.set_uplink(job_id, uplink).inspect_err(|_| {
                            self.switch.undo_add_job(job_id);
                        })
                    });
                    self.publish_memory();
                    self.publish_schedules();
                    let _ = reply.send(result);
                }
                Ok(Command::UpdateJob(spec, uplink, awaiting, reply)) => {
                    let result =
                        self.with_out(tx, discard, |sw, _, now, out| sw.update_job(now, spec, uplink, &awaiting, out));
                    self.publish_memory();
                    self.publish_schedules();
                    let _ = reply.send(result);
                }
                Ok(Command::CheckUpdate(spec, uplink, awaiting, reply)) => {
                    let _ = reply.send(self.switch.check_update(&spec, uplink.as_ref(), &awaiting).map(|_| ()));
                }
                Ok(Command::RemoveJob(id, ran, reply)) => {
                    let removed = if ran { self.switch.remove_job(id) } else { self.switch.undo_add_job(id) };
                    self.publish_memory();
                    self.publish_schedules();
                    let _ = reply.send(removed);
                }
                Ok(Command::AddTransit(job_id, next, sources, reply)) => {
                    let _ = reply.send(self.switch.add_transit(job_id, next, &sources));
                }
                Ok(Command::RemoveTransit(job_id, reply)) => {
                    let _ = reply.send(self.switch.remove_transit(job_id));
                }
                Ok(Command::AgeIdle(job, board, idle)) => {
                    self.with_out(tx, discard, |sw, _, now, out| sw.age_idle(now, job, &board, &idle, out));
                }
                Ok(Command::Learn(verdict)) => self.switch.learn(verdict),
                Ok(Command::AddKvTask(spec, reply)) => {
                    let now = self.now();
                    let _ = reply.send(self.kv.add_task(now, *spec));
                }
                Ok(Command::RemoveKvTask(id, reply)) => {
                    let _ = reply.send(self.kv.remove_task(id));
                }
                Ok(Command::KvTaskStats(ids, reply)) => {
                    let _ = reply.send(ids.into_iter().map(|id| (id, self.kv.task_stats(id))).collect());
                }
                Ok(Command::Handover(from, bytes, ce)) => {
                    self.handovers.taken(self.index);
                    handovers += 1;
                    // A handed-over datagram is ours by construction; a second
                    // hop cannot happen. A contribution that does not line
                    // up with its block ends the round here: the others
                    // must learn it.
                    // (the peers are told before the answers leave: see run)
                    let verdict = self.without_flush(tx, discard, |sw, kv, now, out| {
                        if kv_task_of(&bytes).is_some() {
                            kv.handle_datagram(now, from, &bytes, out);
                            Verdict::Consumed
                        } else {
                            sw.handle_datagram_ce(now, from, &bytes, ce, out)
                        }
                    });
                    if !matches!(verdict, Verdict::Consumed | Verdict::WrongShard(_)) {
                        tell_peers(&self.peers, self.index, verdict);
                    }
                    flush(&self.socket, tx, &self.stats);
                }
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return,
            }
        }
    }

    /// Run `f` on the shard's programs with a sink into the send batch, then flush it.
    fn with_out<R>(
        &mut self,
        tx: &mut SendBatch,
        discard: &mut Vec<u8>,
        f: impl FnOnce(&mut ValueSwitch<SocketAddr>, &mut KvSwitch<SocketAddr>, Time, &mut SocketTx<'_>) -> R,
    ) -> R {
        let result = self.without_flush(tx, discard, f);
        flush(&self.socket, tx, &self.stats);
        result
    }

    /// [`with_out`](Self::with_out), leaving what `f` sent in the batch
    /// (what it changed can be passed on before its answers leave).
    fn without_flush<R>(
        &mut self,
        tx: &mut SendBatch,
        discard: &mut Vec<u8>,
        f: impl FnOnce(&mut ValueSwitch<SocketAddr>, &mut KvSwitch<SocketAddr>, Time, &mut SocketTx<'_>) -> R,
    ) -> R {
        let now = self.now();
        let mut out =
            SocketTx { socket: &self.socket, multicast: self.multicast, batch: tx, egress: &mut self.egress, discard, stats: &self.stats, not_ect: self.not_ect.as_ref(), relaying_ce: false };
        f(&mut self.switch, &mut self.kv, now, &mut out)
    }

    /// What the jobs cost, published before a job command is answered, so
    /// a caller that reads it after admitting or removing a job sees the
    /// change (it lagged until the shard's next batch).
    /// Tell the scanner threads this shard's jobs' scan schedules.
    fn publish_schedules(&self) {
        if let Some((registry, _)) = &self.scan {
            if let Ok(mut r) = registry.lock() {
                r[self.index as usize] = self.switch.scan_schedules();
            }
        }
    }

    fn publish_memory(&self) {
        self.stats.memory_used.store(self.switch.memory_used(), Ordering::Relaxed);
    }

    fn publish(&self) {
        if let Ok(mut c) = self.stats.counters.lock() {
            c.clone_from(self.switch.counters());
            c.trimmed = self.trimmed;
            c.queue_marked = self.queue_marked;
            c.socket_drops = self.socket_drops;
        }
        if let Ok(mut c) = self.stats.kv_counters.lock() {
            c.clone_from(self.kv.counters());
        }
        self.publish_memory();
        self.stats.kv_memory_used.store(self.kv.memory_used(), Ordering::Relaxed);
        let ingress = self.ingress.counts();
        self.stats.fault_ingress_dropped.store(ingress.dropped, Ordering::Relaxed);
        self.stats.fault_ingress_duplicated.store(ingress.duplicated, Ordering::Relaxed);
        self.stats.fault_ingress_reordered.store(ingress.reordered, Ordering::Relaxed);
        self.stats.fault_egress_dropped.store(self.egress.dropped(), Ordering::Relaxed);
    }
}

/// The task id of a key-value datagram (message types 0x20-0x3f after a
/// valid preamble), `None` for anything else. Only the bytes needed to route
/// are read; the key-value program validates the rest and counts what it
/// refuses.
pub(crate) fn kv_task_of(bytes: &[u8]) -> Option<u32> {
    let preamble = fanin_wire::Preamble::parse(bytes).ok()?;
    if !preamble.msg_type.is_kv() {
        return None;
    }
    // A key-value header cut before its task id still belongs to the
    // key-value program, which counts it as truncated (shard 0 does that).
    Some(bytes.get(8..12).map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
}

/// The shard that owns a key-value task.
pub(crate) fn kv_owner(task_id: u32, shards: usize) -> u16 {
    (task_id as usize % shards.max(1)) as u16
}

/// Pass what a Join (or a round's end) changed on to every shard but `index`.
fn tell_peers(peers: &[Sender<Command>], index: u16, verdict: Verdict) {
    for (i, peer) in peers.iter().enumerate() {
        if i != index as usize {
            let _ = peer.send(Command::Learn(verdict));
        }
    }
}

/// Wait up to `timeout` for the socket to be readable or the eventfd `wake`
/// to be signalled: (readable, woken). An error or a signal: readable, so
/// the loop goes round.
fn wait_socket_or(socket: &BatchSocket, wake: i32, timeout: Duration) -> (bool, bool) {
    use std::os::fd::AsRawFd;
    let mut fds = [
        libc::pollfd { fd: socket.as_std().as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: wake, events: libc::POLLIN, revents: 0 },
    ];
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: two valid pollfds, a valid timespec, no signal mask.
    let n = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
    if n < 0 {
        return (true, false);
    }
    (fds[0].revents != 0, fds[1].revents != 0)
}
