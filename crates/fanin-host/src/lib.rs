//! The host runtime: a thin driver that runs `fanin_proto::host::AllreduceSession`
//! over a real UDP socket. It makes no protocol decisions; it moves datagrams
//! and time between the socket and the machine.
//!
//! ```no_run
//! use fanin_host::{Session, SessionOptions};
//! use fanin_proto::host::Tensor;
//! let mut s = Session::connect(SessionOptions::new("127.0.0.1:9000".parse().unwrap(), 1, 0)).unwrap();
//! let out = s.allreduce(Tensor::F32(vec![1.0; 1 << 20])).unwrap();
//! ```

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fanin_proto::fault::{DropInjector, ReceiveFaultRates, ReceiveFaults};
use fanin_proto::host::{AllreduceSession, Event, LingerStats, Outcome, Prepared, SessionConfig, SessionError, Tensor, TensorMut};
use fanin_proto::{Time, Transmit};
use fanin_udp::{BatchSocket, RecvBatch};
use fanin_wire::value::JoinParams;

mod lanes;
use lanes::SendLanes;
pub use lanes::MAX_LANES;

/// How to reach the switch and how to behave.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Data address of the switch's shard 0 (shard i is at port + i).
    pub switch: SocketAddr,
    pub session: SessionConfig,
    /// Probability of dropping each datagram this worker sends (fault injection).
    pub send_drop: f64,
    /// Probability of dropping each datagram this worker receives (fault
    /// injection for the switch-to-worker direction).
    pub recv_drop: f64,
    /// Probability of handing a received datagram to the machine twice.
    pub recv_duplicate: f64,
    /// Probability of handing a received datagram over after the next one.
    pub recv_reorder: f64,
    pub seed: u64,
    /// Socket buffer size requested, in bytes.
    pub socket_buffer: usize,
    /// Use UDP GSO/GRO when the kernel has them.
    pub offload: bool,
    /// Receive results on this IPv4 multicast group as well: the switch then
    /// sends each result once to the group instead of a copy to every
    /// member, if the job names the same group (its `result_group`; the
    /// JoinAck says whether it does, [`JoinParams::results_on_group`]).
    pub result_group: Option<SocketAddrV4>,
    /// Sockets (and threads) this worker's datagrams leave from: lane `k`
    /// carries those to the switch shards `s` with `s % lanes == k`, lane
    /// 0 on the caller's thread, the others on a thread each. More than one
    /// spreads the kernel's per-frame work over more cores on a fast link
    /// (1 to [`MAX_LANES`]; at most the job's shard count are used). The
    /// protocol is the same one state machine either way.
    pub lanes: usize,
    /// Explicit Congestion Notification (docs/congestion.md, "ECN"): send
    /// ECN-capable datagrams and read whether results arrived marked
    /// Congestion Experienced by a queue on their way; a marked result is
    /// echoed to the switch, which marks the next block's result for every
    /// member, and every window is cut there as on a repaired loss.
    pub ecn: bool,
}

impl SessionOptions {
    pub fn new(switch: SocketAddr, job_id: u32, src_id: u16) -> Self {
        Self {
            switch,
            session: SessionConfig::new(job_id, src_id),
            send_drop: 0.0,
            recv_drop: 0.0,
            recv_duplicate: 0.0,
            recv_reorder: 0.0,
            seed: 0,
            socket_buffer: 32 << 20,
            offload: true,
            result_group: None,
            lanes: 1,
            ecn: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    #[error("invalid option: {0}")]
    Option(String),
}

/// Statistics over the session's life.
#[derive(Debug, Clone, Default)]
pub struct SessionStats {
    pub datagrams_sent: u64,
    pub datagrams_received: u64,
    /// UDP payload bytes of `datagrams_sent` / `datagrams_received`
    /// (fanin header, elements and seal; not the IP and UDP headers).
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub dropped_by_fault_injection: u64,
    pub duplicated_by_fault_injection: u64,
    pub reordered_by_fault_injection: u64,
    /// Of `datagrams_received`, those that came on the result group.
    pub datagrams_from_group: u64,
    /// Of `datagrams_sent`, those each lane carried,
    /// and of `datagrams_received`, those each lane's socket got (lane 0
    /// first; one entry without lanes).
    pub sent_by_lane: Vec<u64>,
    pub received_by_lane: Vec<u64>,
    /// ICMP port unreachable answers to this session's datagrams: nothing
    /// listened on the switch's port (a stopped or restarting switch).
    pub port_unreachable: u64,
    /// Other ICMP errors for them (host or network unreachable, …).
    pub other_icmp_errors: u64,
}

/// A worker's connection to a fanin switch for one job.
pub struct Session {
    options: SessionOptions,
    machine: AllreduceSession,
    /// Where datagrams leave from; lane 0's socket joins, and every lane's
    /// socket is read for the replies of the shards it sends to.
    lanes: SendLanes,
    /// Receive-only socket on the job's result group, if listening there.
    group: Option<BatchSocket>,
    rx: RecvBatch,
    faults: DropInjector,
    recv_faults: ReceiveFaults,
    /// The order `recv_faults` chose for the current batch (reused buffer).
    recv_order: Vec<usize>,
    epoch: Instant,
    params: JoinParams,
    stats: SessionStats,
    /// Asked between waits, at most every [`INTERRUPT_CHECK`]: true stops
    /// the session (a Python caller's Ctrl-C).
    interrupt: Option<Interrupt>,
    last_interrupt_check: Instant,
    /// Each lane socket's ICMP error count when its error queue was last
    /// read.
    icmp_errors_read: Vec<u64>,
}

/// How [`Session::linger`] ended.
#[derive(Debug, Clone, Copy)]
pub struct LingerEnd {
    /// What lingering did over the session's life.
    pub stats: LingerStats,
    /// The switch said every member is done (else the caller's signal or
    /// the bound ended it).
    pub all_done: bool,
}

/// A caller's "stop now?" (see [`Session::connect_interruptible`]).
pub type Interrupt = Box<dyn FnMut() -> bool + Send>;

/// How often a blocked call asks its [`Interrupt`]: a Ctrl-C is seen within
/// this long plus one check, and a busy allreduce asks rarely enough that
/// the check costs nothing.
pub const INTERRUPT_CHECK: Duration = Duration::from_millis(20);

/// How often [`Session::linger`] asks whether to stop.
pub const LINGER_CHECK: Duration = Duration::from_millis(20);

/// Sends through the shard's lane, flushing when full; worker-send faults
/// drop here.
struct ShardTx<'a> {
    switch: SocketAddr,
    lanes: &'a mut SendLanes,
    faults: &'a mut DropInjector,
    discard: Vec<u8>,
    sent: u64,
    sent_bytes: u64,
}

impl Transmit<u16> for ShardTx<'_> {
    fn push(&mut self, shard: u16, len: usize) -> &mut [u8] {
        if self.faults.should_drop() {
            self.discard.resize(len, 0);
            return &mut self.discard[..len];
        }
        let mut dest = self.switch;
        dest.set_port(self.switch.port().wrapping_add(shard));
        self.sent += 1;
        self.sent_bytes += len as u64;
        self.lanes.push(shard, dest, len)
    }
}

impl Session {
    /// Bind a socket, join the job and wait for the switch's answer (bounded
    /// by `session.join_timeout`).
    pub fn connect(options: SessionOptions) -> Result<Self, HostError> {
        Self::connect_interruptible(options, None)
    }

    /// [`connect`](Self::connect), and every later blocking call of the
    /// session asks `interrupt` every [`INTERRUPT_CHECK`] whether to stop
    /// (also while joining: the barrier may hold a Join for minutes).
    pub fn connect_interruptible(options: SessionOptions, interrupt: Option<Interrupt>) -> Result<Self, HostError> {
        for (name, p) in [
            ("send_drop", options.send_drop),
            ("recv_drop", options.recv_drop),
            ("recv_duplicate", options.recv_duplicate),
            ("recv_reorder", options.recv_reorder),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(HostError::Option(format!("{name} {p} is not a probability (0.0..=1.0)")));
            }
        }
        let bind_ip: IpAddr = match options.switch.ip() {
            IpAddr::V4(ip) if ip.is_loopback() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(ip) if ip.is_loopback() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        if !(1..=MAX_LANES).contains(&options.lanes) {
            return Err(HostError::Option(format!("lanes {} is not 1 to {MAX_LANES}", options.lanes)));
        }
        // Lane 0 carries the joins and shard 0's blocks: what the switch's
        // host says of them tells whether anything listens there.
        let lane0 = bind_lane_socket(bind_ip, &options)?;
        lane0.report_unreachable()?;
        let lanes = SendLanes::new(lane0, options.offload);
        let group = match options.result_group {
            Some(g) => Some(listen_on_group(g, options.switch, &options)?),
            None => None,
        };
        let epoch = Instant::now();
        let mut options = options;
        options.session.listens_on_group = group.is_some();
        // Sequence numbers of a keyed session start at the wall clock, so a
        // restarted worker continues above what it sent before.
        options.session.seal_clock_us =
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64);
        // Each session is a new incarnation of its rank (docs/protocol.md
        // §4.12): a new process (or a new Session in the same one) of a rank
        // is never mistaken for the one before it.
        options.session.incarnation = draw_incarnation();
        let machine = AllreduceSession::new(options.session.clone(), Time::ZERO);
        let mut session = Self {
            faults: DropInjector::new(options.send_drop, options.seed),
            // a different stream than the send side's, same seed
            recv_faults: ReceiveFaults::new(
                ReceiveFaultRates { drop: options.recv_drop, duplicate: options.recv_duplicate, reorder: options.recv_reorder },
                options.seed ^ 0x005e_ed0f_4ecf,
            ),
            recv_order: Vec::new(),
            rx: RecvBatch::new(64, fanin_udp::GRO_SLOT_SIZE),
            lanes,
            group,
            machine,
            epoch,
            params: JoinParams {
                block_cnt_max: 0,
                block_grad_max: 0,
                block_exp_ms: 0,
                incarnation: 0,
                shard_count: 0,
                next_block: 0,
                results_on_group: false,
                partial_results: false,
                packet_elems: 0,
                order_shards: 0,
                result_key: None,
            },
            stats: SessionStats { received_by_lane: vec![0], ..SessionStats::default() },
            options,
            interrupt,
            last_interrupt_check: epoch,
            icmp_errors_read: vec![0],
        };
        loop {
            session.step(Duration::MAX)?;
            while let Some(ev) = session.machine.poll_event() {
                match ev {
                    Event::Joined(p) => {
                        // Lanes beyond the shard count would carry nothing.
                        let wanted = session.options.lanes.min(usize::from(p.shard_count.max(1)));
                        while session.lanes.count() < wanted {
                            let socket = bind_lane_socket(bind_ip, &session.options)?;
                            session.lanes.add_threaded(socket, session.options.offload)?;
                        }
                        session.icmp_errors_read.resize(session.lanes.count(), 0);
                        session.stats.received_by_lane.resize(session.lanes.count(), 0);
                        session.params = p;
                        return Ok(session);
                    }
                    Event::Failed(e) => return Err(e.into()),
                    Event::Completed(_) | Event::Membership { .. } => {}
                }
            }
        }
    }

    /// The job parameters the switch announced.
    pub fn params(&self) -> &JoinParams {
        &self.params
    }

    /// Number of sources in the job.
    pub fn n_sources(&self) -> u16 {
        self.machine.n_sources()
    }

    /// Sources the switch currently reports as permanently slow.
    pub fn slow_sources(&self) -> &[u16] {
        self.machine.slow_sources()
    }

    /// Lanes this session sends on: the option's, at most the job's
    /// shard count.
    pub fn lanes(&self) -> usize {
        self.lanes.count()
    }

    pub fn stats(&self) -> &SessionStats {
        &self.stats
    }

    /// Datagrams refused before they were looked at (keyed jobs: forged,
    /// replayed or unsealed).
    pub fn auth_stats(&self) -> fanin_proto::host::AuthStats {
        self.machine.auth_stats()
    }

    pub fn options(&self) -> &SessionOptions {
        &self.options
    }

    /// Elements per packet this session sends (the job's packet size unless
    /// the options override it).
    pub fn elems_per_packet(&self) -> u16 {
        self.machine.elems_per_packet()
    }

    /// Elements per block of a float16/bfloat16 allreduce.
    pub fn half_elems_per_packet(&self) -> u16 {
        self.machine.half_elems_per_packet()
    }

    /// Make the next allreduce call (whether it starts or is refused) a
    /// reduce-scatter: only the elements in `keep` (indices into the
    /// flattened tensor) come back summed; the rest of the output is left
    /// as it was, and the switch sends this worker a header instead of the
    /// sum of every block outside `keep`
    /// ([`AllreduceSession::keep_only`](fanin_proto::host::AllreduceSession::keep_only)).
    pub fn keep_only(&mut self, keep: std::ops::Range<usize>) {
        self.machine.keep_only(keep);
    }

    /// Drop a `keep_only` range that no allreduce call has taken.
    pub fn keep_all(&mut self) {
        self.machine.keep_all();
    }

    /// The caller refused its input before sending any of it (preparing
    /// it failed: [`Prepared::new`], `borrow`, `copy_f32`): the session
    /// takes no more allreduces, since the other ranks may be waiting in
    /// that one ([`AllreduceSession::refuse_input`](fanin_proto::host::AllreduceSession::refuse_input)).
    /// Returns the error for the refused call.
    pub fn refuse_input(&mut self, e: fanin_proto::bfp::OutOfRange) -> HostError {
        HostError::Session(self.machine.refuse_input(e))
    }

    /// Reduce `tensor` with every other member of the job; blocks until done
    /// or failed (a silent switch fails after `session.dead_after`).
    pub fn allreduce(&mut self, tensor: Tensor) -> Result<Outcome, HostError> {
        let now = self.now();
        self.machine.begin(now, tensor)?;
        self.run_to_completion()
    }

    /// [`allreduce`](Self::allreduce) of a tensor whose block exponents
    /// were computed while it was staged ([`Prepared::copy_f32`]).
    pub fn allreduce_prepared(&mut self, prepared: Prepared<'_>) -> Result<Outcome, HostError> {
        let now = self.now();
        self.machine.begin_prepared(now, prepared)?;
        self.run_to_completion()
    }

    /// [`allreduce_prepared`](Self::allreduce_prepared) writing the sum into
    /// `out` (same dtype and length) instead of over the input, which comes
    /// back unchanged as the outcome's `tensor` (to reuse its memory), or,
    /// borrowed ([`Prepared::borrow`]; it must not overlap `out`), is only
    /// read. For an output the caller owns (a numpy `out=` array): no copy
    /// of the result, and none of the contributions retained for a switch
    /// restart; with a borrowed input, no copy of the input either.
    pub fn allreduce_into(&mut self, prepared: Prepared<'_>, out: TensorMut<'_>) -> Result<Outcome, HostError> {
        let now = self.now();
        // SAFETY: `out` and a borrowed input are borrowed for this whole
        // call (the input immutably: nothing safe can write it meanwhile),
        // and the allreduce ends before the call returns: it completes or
        // fails inside `run_to_completion`, and on any other way out (an
        // I/O error, a panic) `abandon` ends it.
        unsafe { self.machine.begin_into(now, prepared, out)? };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_to_completion()));
        self.machine.abandon(); // (nothing left to end after a result)
        result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    fn run_to_completion(&mut self) -> Result<Outcome, HostError> {
        loop {
            while let Some(ev) = self.machine.poll_event() {
                match ev {
                    Event::Completed(outcome) => return Ok(outcome),
                    Event::Failed(e) => return Err(e.into()),
                    // the machine keeps the current set (slow_sources)
                    Event::Joined(_) | Event::Membership { .. } => {}
                }
            }
            self.step(Duration::MAX)?;
        }
    }

    /// Keep taking part in the job with no allreduce running, until the
    /// switch says every member is done at the end of this session's
    /// stream, `done` says so (asked every [`LINGER_CHECK`]) or `bound`
    /// has passed: a member that finished its last allreduce holds
    /// contributions the others need if the switch restarts before they
    /// finish theirs (docs/restart.md, "Idle members"). While it lingers
    /// the session probes the switch every
    /// [`LINGER_PROBE_INTERVAL`](fanin_proto::host::LINGER_PROBE_INTERVAL)
    /// and, finding a restart, takes part in the recovery. Each probe says
    /// the session is done (a `JOIN_DONE` Join), and once every member
    /// said so at the same block the switch answers that all are
    /// ([`LingerEnd::all_done`]); `done` is for a caller that knows sooner,
    /// `bound` for members that never finish. Returns how it ended; an
    /// error if the session failed meanwhile (a recovery that stalled:
    /// another member was idle and did not linger), which leaves every
    /// result this member already has as it was.
    pub fn linger(&mut self, bound: Duration, mut done: impl FnMut() -> bool) -> Result<LingerEnd, HostError> {
        if let Some(e) = self.machine.error() {
            return Err(e.clone().into());
        }
        let start = Instant::now();
        let now = self.now();
        self.machine.set_lingering(now, true);
        let ended = loop {
            if let Some(e) = self.machine.error() {
                break Err(e.clone().into());
            }
            // (events of no allreduce: membership notices, a failure above)
            while self.machine.poll_event().is_some() {}
            if self.machine.all_done() || done() || start.elapsed() >= bound {
                break Ok(());
            }
            if let Err(e) = self.step(LINGER_CHECK.min(bound.saturating_sub(start.elapsed()))) {
                break Err(e);
            }
        };
        let all_done = self.machine.all_done();
        let now = self.now();
        self.machine.set_lingering(now, false);
        ended.map(|()| LingerEnd { stats: self.machine.linger_stats(), all_done })
    }

    /// The error that ended this session, if one did (every later call
    /// returns it).
    pub fn error(&self) -> Option<&SessionError> {
        self.machine.error()
    }

    fn now(&self) -> Time {
        Time::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    /// One turn of the driver loop: transmit, wait for datagrams or the next
    /// deadline (at most `max_wait`), feed them in, fire timers.
    fn step(&mut self, max_wait: Duration) -> Result<(), HostError> {
        if let Some(stop) = self.interrupt.as_mut() {
            if self.last_interrupt_check.elapsed() >= INTERRUPT_CHECK {
                self.last_interrupt_check = Instant::now();
                if stop() {
                    self.machine.interrupt();
                    return Err(SessionError::Interrupted.into());
                }
            }
        }
        let now = self.now();
        let mut out = ShardTx {
            switch: self.options.switch,
            lanes: &mut self.lanes,
            faults: &mut self.faults,
            discard: Vec::new(),
            sent: 0,
            sent_bytes: 0,
        };
        // Send everything the window allows, in bounded bursts.
        while self.machine.poll_transmit(now, &mut out) > 0 {}
        let (sent, sent_bytes) = (out.sent, out.sent_bytes);
        self.lanes.flush_all()?;
        self.stats.datagrams_sent += sent;
        self.stats.bytes_sent += sent_bytes;
        self.stats.sent_by_lane.clear();
        self.stats.sent_by_lane.extend(self.lanes.queued());
        let recv = self.recv_faults.counts();
        self.stats.dropped_by_fault_injection = self.faults.dropped() + recv.dropped;
        self.stats.duplicated_by_fault_injection = recv.duplicated;
        self.stats.reordered_by_fault_injection = recv.reordered;

        let mut timeout = match self.machine.poll_timeout() {
            Some(deadline) => deadline.saturating_since(self.now()),
            None => Duration::from_millis(100),
        };
        if self.interrupt.is_some() {
            timeout = timeout.min(INTERRUPT_CHECK);
        }
        timeout = timeout.min(max_wait);
        if self.group.is_none() && self.lanes.count() == 1 {
            // A zero timeout would make the socket block forever.
            self.lanes.socket(0).set_read_timeout(Some(timeout.max(Duration::from_micros(50))))?;
            self.receive(ReadFrom::Lane(0), true)?;
            self.read_icmp_errors(0, false)?;
        } else {
            // Wait for any; a socket reported readable is read at once (the
            // group's is non-blocking; the lanes', which nothing else
            // reads, stay blocking so sends keep blocking on a full buffer
            // rather than failing). Bit i: lane i; the group's is last.
            let ready = {
                let mut all = [self.lanes.socket(0); MAX_LANES + 1];
                let mut n = 0;
                for socket in self.lanes.sockets().chain(self.group.as_ref()) {
                    all[n] = socket;
                    n += 1;
                }
                fanin_udp::wait_readable_any(&all[..n], timeout)?
            };
            let lanes = self.lanes.count();
            if ready >> lanes & 1 == 1 {
                self.receive(ReadFrom::Group, false)?;
            }
            // (without waiting: a poll also reports an error-queue entry
            // alone, and a blocking lane socket would then wait forever)
            for lane in 0..lanes {
                let ready = ready >> lane & 1 == 1;
                let got = if ready { self.receive(ReadFrom::Lane(lane), false)? } else { 0 };
                // a lane ready with nothing to read: an entry of its error
                // queue, whose error a send may have swallowed; read it, or
                // every poll returns at once
                self.read_icmp_errors(lane, ready && got == 0)?;
            }
        }
        let now = self.now();
        if self.machine.poll_timeout().is_some_and(|t| t <= now) {
            self.machine.handle_timeout(now);
        }
        Ok(())
    }

    /// A lane socket's queued ICMP errors, if a send or a receive met one
    /// since the last read, or `anyway` (reading frees the receive buffer
    /// they are charged to); a port unreachable goes to the machine (a
    /// shard that does not listen, whichever lane's shard it is).
    fn read_icmp_errors(&mut self, lane: usize, anyway: bool) -> Result<(), HostError> {
        let socket = self.lanes.socket(lane);
        let seen = socket.icmp_errors();
        if seen == self.icmp_errors_read[lane] && !anyway {
            return Ok(());
        }
        self.icmp_errors_read[lane] = seen;
        let errors = socket.take_unreachable()?;
        self.stats.port_unreachable += errors.port;
        self.stats.other_icmp_errors += errors.other;
        if errors.port > 0 {
            self.machine.handle_port_unreachable(self.now());
        }
        Ok(())
    }

    /// One batch from the unicast socket or the group's into the machine
    /// (through the receive-side fault injection, if any).
    /// Returns the datagrams read; `wait`: block (up to the socket's read
    /// timeout) for the first.
    fn receive(&mut self, from: ReadFrom, wait: bool) -> Result<usize, HostError> {
        let socket = match (&self.group, from) {
            (Some(group), ReadFrom::Group) => group,
            (_, ReadFrom::Lane(lane)) => self.lanes.socket(lane),
            (None, ReadFrom::Group) => return Ok(0),
        };
        let got = if wait { socket.recv_batch(&mut self.rx)? } else { socket.recv_batch_nowait(&mut self.rx)? };
        if got == 0 {
            return Ok(0);
        }
        let now = self.now();
        self.stats.datagrams_received += self.rx.len() as u64;
        self.stats.bytes_received += self.rx.iter().map(|(_, d)| d.len() as u64).sum::<u64>();
        match from {
            ReadFrom::Group => self.stats.datagrams_from_group += self.rx.len() as u64,
            ReadFrom::Lane(lane) => self.stats.received_by_lane[lane] += self.rx.len() as u64,
        }
        if self.recv_faults.is_enabled() {
            let all: Vec<_> = self.rx.iter_ecn().collect();
            self.recv_faults.schedule(all.len(), &mut self.recv_order);
            for &i in &self.recv_order {
                self.machine.handle_datagram_ce(now, all[i].1, all[i].2);
            }
        } else {
            for (_, bytes, ce) in self.rx.iter_ecn() {
                self.machine.handle_datagram_ce(now, bytes, ce);
            }
        }
        Ok(got)
    }
}

/// Which socket a batch is read from.
#[derive(Clone, Copy)]
enum ReadFrom {
    Lane(usize),
    Group,
}

/// A socket for one lane: bound to `ip` on a free port, buffers and GRO
/// as the options say.
fn bind_lane_socket(ip: IpAddr, options: &SessionOptions) -> Result<BatchSocket, HostError> {
    let socket = BatchSocket::bind(SocketAddr::new(ip, 0))?;
    let _ = socket.set_buffer_sizes(options.socket_buffer, options.socket_buffer);
    if options.offload {
        let _ = socket.enable_gro();
    }
    if options.ecn {
        socket.enable_ecn().map_err(|e| {
            HostError::Option(format!("ecn: cannot mark this session's datagrams ECN-capable ({e}); pass ecn=False"))
        })?;
    }
    Ok(socket)
}

/// Opens the receive socket on `group`, joined on the interface this host
/// reaches `switch` through (127.0.0.1 for a switch on loopback).
fn listen_on_group(group: SocketAddrV4, switch: SocketAddr, options: &SessionOptions) -> Result<BatchSocket, HostError> {
    let refuse = |why: String| HostError::Option(format!("result_group {group}: {why}"));
    if !group.ip().is_multicast() {
        return Err(refuse("not an IPv4 multicast group (224.0.0.0/4)".into()));
    }
    let SocketAddr::V4(switch_v4) = switch else {
        return Err(refuse(format!("the switch {switch} is IPv6; result groups are IPv4")));
    };
    // The kernel's choice of source address toward the switch names the
    // interface (no datagram is sent by connecting a UDP socket).
    let interface = (|| {
        let probe = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        probe.connect(switch_v4)?;
        match probe.local_addr()? {
            SocketAddr::V4(a) => Ok(*a.ip()),
            SocketAddr::V6(_) => Ok(Ipv4Addr::UNSPECIFIED),
        }
    })()
    .map_err(|e: io::Error| refuse(format!("no route to the switch {switch}: {e}")))?;
    let listener = BatchSocket::join_group(group, interface)
        .map_err(|e| refuse(format!("cannot listen on it from {interface}: {e}")))?;
    let _ = listener.set_buffer_sizes(options.socket_buffer, options.socket_buffer);
    if options.offload {
        let _ = listener.enable_gro();
    }
    if options.ecn {
        listener.enable_ecn().map_err(|e| refuse(format!("cannot read ECN marks on it: {e}")))?;
    }
    Ok(listener)
}

/// A random member incarnation (48 bits, the low 16 non-zero): the
/// standard library's per-map random keys (seeded from the OS) hashed with
/// the clock and a counter, so two sessions of one process differ as well
/// as two processes.
fn draw_incarnation() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static DRAWN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(DRAWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    let x = h.finish() & ((1 << 48) - 1);
    if x & 0xFFFF == 0 {
        x | 1
    } else {
        x
    }
}
