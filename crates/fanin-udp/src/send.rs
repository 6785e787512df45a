//! Sending: `SendBatch` queues datagrams in one arena; `transmit` hands them
//! to the kernel with as few `sendmmsg` calls as possible, coalescing runs
//! into UDP GSO messages when allowed.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::sockaddr::SockAddrBuf;

/// Most segments one GSO message carries. The kernel's `UDP_MAX_SEGMENTS`
/// has been 64 since GSO appeared (4.18); newer kernels allow more, but 64
/// is accepted everywhere and already amortises the syscall well.
pub const MAX_GSO_SEGMENTS: usize = 64;

/// Most payload bytes in one GSO message: a UDP datagram may carry
/// 65535 − 8 − 40 (IPv6 header) bytes; 65000 keeps clear of that limit for
/// both families without further arithmetic.
pub const MAX_GSO_BYTES: usize = 65000;

/// Retries of one message after `EAGAIN`/`ENOBUFS` before the rest of the
/// batch is dropped. The backoff below totals about 2 ms: long enough for a
/// full device queue to drain, short enough not to stall a forwarding loop.
const MAX_TRANSIENT_RETRIES: u32 = 10;

/// Distinct destinations up to which `group_by_destination` counts instead
/// of sorting (a job's members under one switch; above it, a sort).
const REGROUP_DESTS_MAX: usize = 64;

/// Arena bytes reserved per datagram of capacity; enough for MTU-sized
/// packets without regrowth. Reserved, not touched, so unused space is free.
const ARENA_BYTES_PER_DATAGRAM: usize = 2048;

/// GSO knowledge shared by every send on one socket (hence atomics: a socket
/// may be shared by threads sending concurrently).
#[derive(Debug)]
pub(crate) struct GsoState {
    /// False when the kernel lacks UDP_SEGMENT, or after a GSO send failed
    /// with `EIO` — the route's device cannot checksum-offload, which will
    /// not change, so GSO stays off for this socket.
    enabled: AtomicBool,
    /// Largest segment size believed to work. Lowered when a GSO message
    /// fails with `EINVAL`/`EMSGSIZE` and its first datagram then goes
    /// through alone (or is too large even alone): segment + headers
    /// exceeded the path MTU. One value per socket, so a socket talking over
    /// routes of different MTUs ends up with the smallest.
    max_segment: AtomicUsize,
}

impl GsoState {
    pub(crate) fn new(supported: bool) -> Self {
        GsoState {
            enabled: AtomicBool::new(supported),
            max_segment: AtomicUsize::new(MAX_GSO_BYTES),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub(crate) fn max_segment(&self) -> usize {
        self.max_segment.load(Ordering::Relaxed)
    }
}

/// One queued datagram: `len` bytes at `offset` in the arena, and the ECN
/// codepoint it leaves with ([`ECN_SOCKET`]: the socket's own).
#[derive(Clone, Copy, Debug)]
struct Entry {
    dest: SocketAddr,
    offset: usize,
    len: usize,
    ecn: u8,
}

/// [`SendBatch::set_last_ecn`]'s "no codepoint of its own": the datagram
/// leaves with the socket's (`IP_TOS`), and no control message is added.
pub const ECN_SOCKET: u8 = 0xFF;

/// A datagram's codepoint as an entry keeps it: the two ECN bits, or
/// [`ECN_SOCKET`].
fn own_codepoint(codepoint: u8) -> u8 {
    if codepoint == ECN_SOCKET {
        ECN_SOCKET
    } else {
        codepoint & 0b11
    }
}

/// One `mmsghdr` worth of work: `count` consecutive entries starting at
/// `first`, `bytes` in total, sent as GSO segments of `segment` bytes when
/// `count > 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Message {
    first: usize,
    count: usize,
    segment: usize,
    bytes: usize,
}

/// Control buffer for one sent message: the GSO segment size
/// (`CMSG_SPACE(sizeof(u16))`, 24 bytes on 64-bit targets) and the ECN
/// codepoint (`CMSG_SPACE(sizeof(int))`, 24). Aligned like `cmsghdr`, as the
/// `CMSG_*` macros require.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct SendCmsgBuf([u8; 64]);

/// Per-call syscall scratch, kept in the batch so sending never allocates
/// after warm-up.
struct SendScratch {
    plan: Vec<Message>,
    names: Vec<SockAddrBuf>,
    ctrl: Vec<SendCmsgBuf>,
    iovs: Vec<libc::iovec>,
    /// Each message's (first iovec, iovec count).
    spans: Vec<(usize, usize)>,
    hdrs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers inside `iovs` and `hdrs` are rewritten before
// every `sendmmsg`, point only into buffers owned by the same `SendBatch`,
// and are never dereferenced outside that call, which holds `&mut
// SendBatch`. Moving the batch to another thread between calls is sound.
unsafe impl Send for SendScratch {}

/// Datagrams queued for one [`BatchSocket::send_batch`] call.
///
/// Payloads live back to back in one arena that is reused across sends, so
/// after the first few batches (warm-up) queueing and sending allocate
/// nothing. Typical use in a forwarding loop:
///
/// ```no_run
/// # use fanin_udp::{BatchSocket, SendBatch};
/// # fn demo(sock: &BatchSocket, peer: std::net::SocketAddr) -> std::io::Result<()> {
/// let mut out = SendBatch::new(64);
/// out.set_gso(sock.gso_supported());
/// let buf = out.push(peer, 5);
/// buf.copy_from_slice(b"hello");
/// out.push_copy(peer, b"world");
/// sock.send_batch(&mut out)?; // sends both (as one GSO message) and clears
/// # Ok(()) }
/// ```
///
/// [`BatchSocket::send_batch`]: crate::BatchSocket::send_batch
pub struct SendBatch {
    /// Grows to the largest batch seen and stays there: `clear` only resets
    /// `used`, so later pushes reuse initialised bytes without memset.
    arena: Vec<u8>,
    used: usize,
    entries: Vec<Entry>,
    capacity: usize,
    gso: bool,
    scratch: SendScratch,
    /// Second entry list for `group_by_destination`, swapped with the live
    /// one so regrouping allocates nothing after warm-up.
    regroup_entries: Vec<Entry>,
    order: Vec<usize>,
    /// `group_by_destination`'s destinations with their counts, then places.
    regroup_dests: Vec<(SocketAddr, usize)>,
}

impl SendBatch {
    /// An empty batch sized for `capacity_datagrams` datagrams (at least 1).
    ///
    /// The capacity is what [`is_full`](Self::is_full) checks and what is
    /// preallocated; pushing beyond it still works but allocates.
    pub fn new(capacity_datagrams: usize) -> Self {
        let capacity = capacity_datagrams.max(1);
        SendBatch {
            arena: Vec::with_capacity(capacity * ARENA_BYTES_PER_DATAGRAM),
            used: 0,
            entries: Vec::with_capacity(capacity),
            capacity,
            gso: false,
            regroup_entries: Vec::new(),
            order: Vec::new(),
            regroup_dests: Vec::new(),
            scratch: SendScratch {
                plan: Vec::with_capacity(capacity),
                names: Vec::with_capacity(capacity),
                ctrl: Vec::with_capacity(capacity),
                iovs: Vec::with_capacity(capacity),
                spans: Vec::with_capacity(capacity),
                hdrs: Vec::with_capacity(capacity),
            },
        }
    }

    /// Allows coalescing into UDP GSO messages when the socket supports it
    /// (off by default). Receivers see the same datagrams either way: a
    /// socket without GRO gets them split by the kernel.
    pub fn set_gso(&mut self, on: bool) {
        self.gso = on;
    }

    /// Whether GSO coalescing is allowed for this batch.
    pub fn gso(&self) -> bool {
        self.gso
    }

    /// Reserves `len` bytes for a datagram to `dest` and returns them for
    /// the caller to fill.
    ///
    /// The slice's initial contents are unspecified (left over from earlier
    /// batches): write all of it.
    pub fn push(&mut self, dest: SocketAddr, len: usize) -> &mut [u8] {
        self.push_ecn(dest, len, ECN_SOCKET)
    }

    /// [`push`](Self::push) with the datagram's own ECN codepoint (see
    /// [`set_last_ecn`](Self::set_last_ecn)).
    pub fn push_ecn(&mut self, dest: SocketAddr, len: usize, codepoint: u8) -> &mut [u8] {
        let offset = self.used;
        let end = offset + len;
        if end > self.arena.len() {
            self.arena.resize(end, 0);
        }
        self.used = end;
        self.entries.push(Entry { dest, offset, len, ecn: own_codepoint(codepoint) });
        &mut self.arena[offset..end]
    }

    /// Queues a copy of `bytes` for `dest`.
    pub fn push_copy(&mut self, dest: SocketAddr, bytes: &[u8]) {
        self.push(dest, bytes.len()).copy_from_slice(bytes);
    }

    /// Queues the bytes of the last queued datagram once more, to `dest`,
    /// without copying them: the kernel reads the same arena bytes for
    /// both (a switch sending one result to every member). Returns false,
    /// queueing nothing, when the batch is empty.
    pub fn push_alias(&mut self, dest: SocketAddr) -> bool {
        let Some(&last) = self.entries.last() else { return false };
        self.entries.push(Entry { dest, ..last });
        true
    }

    /// The ECN codepoint (`crate::ecn::ECT_0`, `NOT_ECT`, ...) the last
    /// queued datagram leaves with, instead of the socket's own: one socket
    /// serving peers of which only some answer ECN marks sends the others
    /// Not-ECT (RFC 3168 §5). Sent as an `IP_TOS` control message to an
    /// IPv4 destination (a v4-mapped one from an IPv6 socket too) and as
    /// `IPV6_TCLASS` to an IPv6 one; [`ECN_SOCKET`] undoes it. A GSO
    /// message never mixes codepoints.
    pub fn set_last_ecn(&mut self, codepoint: u8) {
        if let Some(e) = self.entries.last_mut() {
            e.ecn = own_codepoint(codepoint);
        }
    }

    /// Number of queued datagrams.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The capacity given to [`new`](Self::new).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// True once `len() >= capacity()`: time to send.
    pub fn is_full(&self) -> bool {
        self.entries.len() >= self.capacity
    }

    /// Drops everything queued, keeping the memory.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.used = 0;
    }

    /// Sends everything and clears the batch. See `BatchSocket::send_batch`
    /// for the contract.
    pub(crate) fn send_on_fd(
        &mut self,
        fd: RawFd,
        socket_is_v6: bool,
        gso: &GsoState,
        icmp_errors: &AtomicU64,
    ) -> io::Result<usize> {
        if self.gso && gso.enabled() {
            self.group_by_destination();
        }
        let result = self.transmit(fd, socket_is_v6, gso, icmp_errors);
        self.clear();
        result
    }

    /// Reorder the queued datagrams so each destination's datagrams are
    /// adjacent (stable: per-destination order is kept), which lets GSO
    /// coalesce a switch's fan-out (one result to N workers, many blocks per
    /// batch) into one message per destination. Only the entries move; a
    /// message's datagrams are gathered from the arena by its iovecs.
    ///
    /// A batch names few destinations (a job's members), so this is a
    /// counting sort over the destinations in first-seen order: one pass to
    /// number them, one to place each entry, no comparison sort and no
    /// allocation after warm-up (the comparison sort it replaced was ~0.5 %
    /// of a testbed allreduce's CPU). Beyond [`REGROUP_DESTS_MAX`] distinct
    /// destinations the linear lookup would cost more than it saves, and a
    /// stable sort by address does the same job.
    fn group_by_destination(&mut self) {
        let first = match self.entries.first() {
            Some(e) => e.dest,
            None => return,
        };
        if self.entries.iter().all(|e| e.dest == first) {
            return;
        }
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        let dests = &mut self.regroup_dests;
        dests.clear();
        // order[i] = the destination number of entry i, first seen first;
        // `grouped` stays true while every destination's entries are adjacent
        let mut grouped = true;
        for e in &self.entries {
            let g = match dests.iter().position(|&(d, _)| d == e.dest) {
                Some(g) => {
                    grouped &= g == dests.len() - 1;
                    g
                }
                None if dests.len() < REGROUP_DESTS_MAX => {
                    dests.push((e.dest, 0));
                    dests.len() - 1
                }
                None => {
                    // (stable: each destination's datagrams keep their order)
                    self.entries.sort_by_key(|e| e.dest);
                    self.order = order;
                    return;
                }
            };
            dests[g].1 += 1;
            order.push(g);
        }
        if grouped {
            self.order = order;
            return;
        }
        // counts -> each destination's first place
        let mut at = 0;
        for d in dests.iter_mut() {
            let n = d.1;
            d.1 = at;
            at += n;
        }
        let mut entries = std::mem::take(&mut self.regroup_entries);
        entries.clear();
        entries.resize(self.entries.len(), self.entries[0]);
        for (e, &g) in self.entries.iter().zip(order.iter()) {
            entries[dests[g].1] = *e;
            dests[g].1 += 1;
        }
        self.regroup_entries = std::mem::replace(&mut self.entries, entries);
        self.order = order;
    }

    fn transmit(&mut self, fd: RawFd, socket_is_v6: bool, gso: &GsoState, icmp_errors: &AtomicU64) -> io::Result<usize> {
        let mut sent = 0;
        let mut first_error: Option<io::Error> = None;
        // Entry where the current plan starts; a GSO failure replans from
        // the failed message onwards.
        let mut start = 0;
        // Entries before this index go out without GSO (size fallback).
        let mut plain_until = 0;
        // After a size error, the segment size under suspicion. The replan's
        // first message is the same datagram sent alone: if it goes through,
        // GSO at this size was at fault and the size is recorded as too
        // large. (A different error there clears the suspicion, so that an
        // odd destination cannot disable GSO for everyone.)
        let mut suspect_segment: Option<usize> = None;

        'plan: while start < self.entries.len() {
            let policy = GsoPolicy {
                enabled: self.gso && gso.enabled(),
                max_segment: gso.max_segment(),
                plain_until,
            };
            plan_messages(&self.entries, start, policy, &mut self.scratch.plan);
            self.build_headers(socket_is_v6);
            let plan = &self.scratch.plan;
            let total = plan.len();
            let mut k = 0;
            let mut retries = 0;
            // Times message k was sent again after an ICMP-like error.
            let mut icmp_retries = (0, 0u32);
            while k < total {
                // SAFETY: `hdrs[k..total]` are initialised headers whose
                // name, iovec and control pointers refer to live buffers of
                // the stated lengths, owned by `self` and neither moved nor
                // resized until this loop ends (it holds `&mut self`).
                let r = unsafe {
                    libc::sendmmsg(
                        fd,
                        self.scratch.hdrs[k..].as_mut_ptr(),
                        (total - k) as libc::c_uint,
                        0,
                    )
                };
                if r > 0 {
                    let r = r as usize;
                    if k == 0 {
                        if let Some(segment) = suspect_segment.take() {
                            gso.max_segment.fetch_min(segment - 1, Ordering::Relaxed);
                        }
                    }
                    sent += plan[k..k + r].iter().map(|m| m.count).sum::<usize>();
                    if k + r < total {
                        // Cut short: the error that stopped the call is lost
                        // (sendmmsg(2)), and it may have been the socket's
                        // pending ICMP error, whose error-queue entry a
                        // socket that asked for reports must now read.
                        icmp_errors.fetch_add(1, Ordering::Relaxed);
                    }
                    k += r;
                    retries = 0;
                    continue;
                }
                let err = if r == 0 {
                    // Not expected for vlen > 0; treat like a full queue.
                    io::Error::from_raw_os_error(libc::EAGAIN)
                } else {
                    io::Error::last_os_error()
                };
                let msg = plan[k];
                match err.raw_os_error() {
                    Some(libc::EINTR) => {}
                    // The socket's pending error: an ICMP port unreachable
                    // for an earlier datagram (never a send's own error on
                    // an unconnected socket), reported and cleared by this
                    // call instead of sending. Send this one again (more
                    // may come in between while a peer's port is closed).
                    Some(libc::ECONNREFUSED) if retried(&mut icmp_retries, k, MAX_REFUSED_RETRIES) => {
                        icmp_errors.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(libc::EAGAIN | libc::ENOBUFS) => {
                        if retries < MAX_TRANSIENT_RETRIES {
                            backoff(retries);
                            retries += 1;
                        } else {
                            // The queue is not draining; what is left of
                            // this batch is dropped, as a router would.
                            first_error.get_or_insert(err);
                            break 'plan;
                        }
                    }
                    // The route's device cannot offload UDP checksums, so
                    // GSO can never work on it: stop using it and replan.
                    Some(libc::EIO) if msg.count > 1 => {
                        gso.enabled.store(false, Ordering::Relaxed);
                        start = msg.first;
                        continue 'plan;
                    }
                    // Segment + headers > path MTU (EINVAL before Linux
                    // 6.9 or so, EMSGSIZE after). Send this run plain and
                    // learn from the outcome (see suspect_segment).
                    Some(libc::EINVAL | libc::EMSGSIZE) if msg.count > 1 => {
                        plain_until = msg.first + msg.count;
                        suspect_segment = Some(msg.segment);
                        start = msg.first;
                        continue 'plan;
                    }
                    // Perhaps the socket's pending error for an earlier
                    // datagram (another ICMP error), perhaps this one's
                    // own (no route): send it again once, and if it comes
                    // back it was its own.
                    Some(e) if crate::unreachable::is_icmp_errno(e) && retried(&mut icmp_retries, k, 1) => {
                        icmp_errors.fetch_add(1, Ordering::Relaxed);
                    }
                    // Specific to this message (unreachable destination,
                    // wrong family, too large): drop it, keep the others.
                    _ => {
                        if k == 0 {
                            // Too large even alone: no use trying GSO at
                            // this size again. Otherwise GSO was not at fault.
                            if let Some(segment) = suspect_segment.take() {
                                if err.raw_os_error() == Some(libc::EMSGSIZE) {
                                    gso.max_segment.fetch_min(segment - 1, Ordering::Relaxed);
                                }
                            }
                        }
                        first_error.get_or_insert(err);
                        k += 1;
                        retries = 0;
                    }
                }
            }
            break;
        }

        match first_error {
            Some(err) if sent == 0 => Err(err),
            _ => Ok(sent),
        }
    }

    /// Fills the syscall scratch for `scratch.plan`.
    fn build_headers(&mut self, socket_is_v6: bool) {
        let s = &mut self.scratch;
        let n = s.plan.len();
        // Size every array first: pointers into them are taken below and
        // must not be invalidated by a later reallocation.
        s.names.resize(n, SockAddrBuf::zeroed());
        s.ctrl.resize(n, SendCmsgBuf([0; 64]));
        s.iovs.clear();
        s.hdrs.clear();
        // One iovec per stretch of a message's datagrams that lie back to
        // back in the arena: usually one per message, more after regrouping
        // or for aliased datagrams (the same bytes to several members).
        // `spans[j]` is message j's (first iovec, count).
        let mut spans = std::mem::take(&mut s.spans);
        spans.clear();
        for m in &s.plan {
            let first_iov = s.iovs.len();
            let mut end = usize::MAX;
            for e in &self.entries[m.first..m.first + m.count] {
                let extends = s.iovs.len() > first_iov && e.offset == end;
                match s.iovs.last_mut() {
                    Some(iov) if extends => iov.iov_len += e.len,
                    _ => s.iovs.push(libc::iovec {
                        // The kernel only reads through this pointer.
                        iov_base: self.arena[e.offset..].as_ptr().cast_mut().cast(),
                        iov_len: e.len,
                    }),
                }
                end = e.offset + e.len;
            }
            spans.push((first_iov, s.iovs.len() - first_iov));
        }
        for (j, m) in s.plan.iter().enumerate() {
            let namelen = s.names[j].write(self.entries[m.first].dest, socket_is_v6);
            // SAFETY: `msghdr` is a plain C struct; all-zero (null pointers,
            // zero lengths) is a valid value.
            let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
            hdr.msg_name = ptr::from_mut(&mut s.names[j]).cast();
            hdr.msg_namelen = namelen;
            // `iovs` is complete: these pointers stay valid until the send.
            hdr.msg_iov = ptr::from_mut(&mut s.iovs[spans[j].0]);
            hdr.msg_iovlen = spans[j].1 as _;
            let segment = m.count > 1;
            // (every entry of a message has its first entry's codepoint)
            let ecn = self.entries[m.first].ecn;
            // The control message the kernel reads for the destination's
            // IP version: IP_TOS for IPv4 (from an IPv6 socket too, whose
            // v4-mapped sends take the IPv4 path), IPV6_TCLASS for IPv6.
            let dest_is_v4 = match self.entries[m.first].dest {
                SocketAddr::V4(_) => true,
                SocketAddr::V6(a) => a.ip().to_ipv4_mapped().is_some(),
            };
            let (tos_level, tos_type) =
                if dest_is_v4 { (libc::IPPROTO_IP, libc::IP_TOS) } else { (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) };
            let tos = ecn != ECN_SOCKET;
            if segment || tos {
                hdr.msg_control = ptr::from_mut(&mut s.ctrl[j]).cast();
                // SAFETY: CMSG_SPACE is pure arithmetic.
                hdr.msg_controllen = unsafe {
                    (if segment { libc::CMSG_SPACE(2) } else { 0 })
                        + (if tos { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as _) } else { 0 })
                } as _;
                // SAFETY: `msg_control` points to our 8-aligned 64-byte
                // buffer and `msg_controllen` (at most 48 on 64-bit) fits in
                // it. CMSG_FIRSTHDR, and CMSG_NXTHDR after a first header
                // whose CMSG_SPACE leaves room for the second, return
                // non-null, aligned headers within `msg_controllen`, with
                // room for their payloads, written unaligned.
                unsafe {
                    let mut c = libc::CMSG_FIRSTHDR(&hdr);
                    if segment {
                        (*c).cmsg_level = libc::SOL_UDP;
                        (*c).cmsg_type = libc::UDP_SEGMENT;
                        (*c).cmsg_len = libc::CMSG_LEN(2) as _;
                        // plan_messages keeps segments <= MAX_GSO_BYTES < 2^16.
                        ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), m.segment as u16);
                        if tos {
                            c = libc::CMSG_NXTHDR(&hdr, c);
                        }
                    }
                    if tos {
                        (*c).cmsg_level = tos_level;
                        (*c).cmsg_type = tos_type;
                        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as _) as _;
                        ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>(), libc::c_int::from(ecn));
                    }
                }
            }
            s.hdrs.push(libc::mmsghdr {
                msg_hdr: hdr,
                msg_len: 0,
            });
        }
        s.spans = spans;
    }
}

impl fmt::Debug for SendBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendBatch")
            .field("len", &self.entries.len())
            .field("bytes", &self.used)
            .field("capacity", &self.capacity)
            .field("gso", &self.gso)
            .finish()
    }
}

/// Sleeps a little longer on each retry: yield twice (another thread on this
/// core may be the one draining), then 10 µs doubling up to 1 ms.
fn backoff(retry: u32) {
    if retry < 2 {
        std::thread::yield_now();
    } else {
        let micros = (10u64 << (retry - 2).min(7)).min(1000);
        std::thread::sleep(Duration::from_micros(micros));
    }
}

#[derive(Clone, Copy, Debug)]
struct GsoPolicy {
    enabled: bool,
    max_segment: usize,
    plain_until: usize,
}

/// Groups `entries[start..]` into messages, replacing `plan`.
///
/// With GSO, a message is a run of datagrams to one destination, all of the
/// first one's length except possibly a shorter last one (the kernel cuts
/// the payload into equal segments, so only the tail may differ), bounded by
/// `MAX_GSO_SEGMENTS` and `MAX_GSO_BYTES`. A run's datagrams need not be
/// adjacent in the arena (regrouped or aliased): its iovecs gather them.
fn plan_messages(entries: &[Entry], start: usize, policy: GsoPolicy, plan: &mut Vec<Message>) {
    plan.clear();
    let mut i = start;
    while i < entries.len() {
        let head = entries[i];
        let mut count = 1;
        let mut bytes = head.len;
        // Empty datagrams cannot be segments: GSO needs a segment size > 0.
        let coalesce = policy.enabled
            && i >= policy.plain_until
            && head.len > 0
            && head.len <= policy.max_segment;
        if coalesce {
            while let Some(next) = entries.get(i + count) {
                if count == MAX_GSO_SEGMENTS
                    || next.dest != head.dest
                    || next.ecn != head.ecn
                    || next.len == 0
                    || next.len > head.len
                    || bytes + next.len > MAX_GSO_BYTES
                {
                    break;
                }
                count += 1;
                bytes += next.len;
                if next.len < head.len {
                    break; // a short segment must be the last one
                }
            }
        }
        plan.push(Message {
            first: i,
            count,
            segment: head.len,
            bytes,
        });
        i += count;
    }
}

/// Sends of one message repeated after the socket's pending errors.
const MAX_REFUSED_RETRIES: u32 = 8;

/// Whether message `k` may be sent again after an ICMP-like error, at most
/// `limit` times in a row (`state`: the message and its count so far).
fn retried(state: &mut (usize, u32), k: usize, limit: u32) -> bool {
    if state.0 != k {
        *state = (k, 0);
    }
    state.1 += 1;
    state.1 <= limit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(items: &[(u16, usize)]) -> Vec<Entry> {
        let mut offset = 0;
        items
            .iter()
            .map(|&(port, len)| {
                let e = Entry {
                    dest: SocketAddr::from(([127, 0, 0, 1], port)),
                    offset,
                    len,
                    ecn: ECN_SOCKET,
                };
                offset += len;
                e
            })
            .collect()
    }

    fn plan(entries: &[Entry], policy: GsoPolicy) -> Vec<(usize, usize, usize)> {
        let mut plan = Vec::new();
        plan_messages(entries, 0, policy, &mut plan);
        plan.iter().map(|m| (m.first, m.count, m.segment)).collect()
    }

    const GSO: GsoPolicy = GsoPolicy {
        enabled: true,
        max_segment: MAX_GSO_BYTES,
        plain_until: 0,
    };

    #[test]
    fn without_gso_every_datagram_is_a_message() {
        let e = batch(&[(1, 100), (1, 100), (1, 100)]);
        let off = GsoPolicy {
            enabled: false,
            ..GSO
        };
        assert_eq!(plan(&e, off), vec![(0, 1, 100), (1, 1, 100), (2, 1, 100)]);
    }

    #[test]
    fn runs_split_where_the_ecn_codepoint_changes() {
        let mut e = batch(&[(1, 100), (1, 100), (1, 100), (1, 100)]);
        e[2].ecn = crate::ecn::ECT_0;
        e[3].ecn = crate::ecn::ECT_0;
        assert_eq!(plan(&e, GSO), vec![(0, 2, 100), (2, 2, 100)]);
    }

    #[test]
    fn runs_split_on_destination_and_length() {
        let e = batch(&[
            (1, 100),
            (1, 100),
            (1, 60),
            (1, 100),
            (2, 100),
            (2, 100),
            (2, 200),
        ]);
        // The short 60 ends the first run; 200 is longer so starts anew.
        assert_eq!(
            plan(&e, GSO),
            vec![(0, 3, 100), (3, 1, 100), (4, 2, 100), (6, 1, 200)]
        );
    }

    #[test]
    fn runs_respect_segment_and_byte_limits() {
        let e = batch(&vec![(1, 10); 150]);
        assert_eq!(
            plan(&e, GSO),
            vec![(0, 64, 10), (64, 64, 10), (128, 22, 10)]
        );
        let e = batch(&[(1, 30_000); 5]);
        assert_eq!(
            plan(&e, GSO),
            vec![(0, 2, 30_000), (2, 2, 30_000), (4, 1, 30_000)]
        );
    }

    #[test]
    fn empty_datagrams_and_plain_ranges_are_not_coalesced() {
        let e = batch(&[(1, 0), (1, 0), (1, 8), (1, 0), (1, 8), (1, 8), (1, 8)]);
        let policy = GsoPolicy {
            plain_until: 5,
            ..GSO
        };
        assert_eq!(
            plan(&e, policy),
            vec![
                (0, 1, 0),
                (1, 1, 0),
                (2, 1, 8),
                (3, 1, 0),
                (4, 1, 8),
                (5, 2, 8)
            ]
        );
    }

    #[test]
    fn segments_above_the_learned_limit_go_plain() {
        let e = batch(&[(1, 1600), (1, 1600), (1, 1000), (1, 1000)]);
        let policy = GsoPolicy {
            max_segment: 1499,
            ..GSO
        };
        assert_eq!(
            plan(&e, policy),
            vec![(0, 1, 1600), (1, 1, 1600), (2, 2, 1000)]
        );
    }

    /// (destination port, first byte) of each queued datagram, in order.
    fn queued(b: &SendBatch) -> Vec<(u16, u8)> {
        b.entries.iter().map(|e| (e.dest.port(), b.arena[e.offset])).collect()
    }

    #[test]
    fn regrouping_makes_each_destination_adjacent_and_keeps_its_order() {
        let to = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let mut b = SendBatch::new(16);
        // a switch's fan-out: block k's result to members 7, 3, 5 in turn
        for k in 0..4u8 {
            for port in [7, 3, 5] {
                b.push_copy(to(port), &[k]);
            }
        }
        b.group_by_destination();
        let want: Vec<(u16, u8)> = [7u16, 3, 5].iter().flat_map(|&p| (0..4u8).map(move |k| (p, k))).collect();
        assert_eq!(queued(&b), want);
        // already grouped (or one destination): left as it is
        b.group_by_destination();
        assert_eq!(queued(&b), want);
        // more destinations than the counting path takes: sorted by address,
        // still stable per destination
        let mut b = SendBatch::new(4 * REGROUP_DESTS_MAX);
        for k in 0..2u8 {
            for port in (1..=REGROUP_DESTS_MAX as u16 + 3).rev() {
                b.push_copy(to(port), &[k]);
            }
        }
        b.group_by_destination();
        let want: Vec<(u16, u8)> =
            (1..=REGROUP_DESTS_MAX as u16 + 3).flat_map(|p| (0..2u8).map(move |k| (p, k))).collect();
        assert_eq!(queued(&b), want);
    }

    #[test]
    fn push_reuses_the_arena_after_clear() {
        let mut b = SendBatch::new(4);
        let dest = SocketAddr::from(([127, 0, 0, 1], 9));
        b.push_copy(dest, b"abc");
        b.push(dest, 5).copy_from_slice(b"defgh");
        assert_eq!(b.len(), 2);
        assert_eq!(&b.arena[..b.used], b"abcdefgh");
        let ptr = b.arena.as_ptr();
        b.clear();
        assert!(b.is_empty());
        b.push_copy(dest, b"xy");
        assert_eq!(b.arena.as_ptr(), ptr);
        assert_eq!(b.entries[0].offset, 0);
    }
}
