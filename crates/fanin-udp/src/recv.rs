//! Receiving: `RecvBatch` owns the buffers one `recvmmsg` call fills.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::ptr;

use crate::sockaddr::SockAddrBuf;

/// Slot size to use with GRO: a coalesced datagram is at most one maximal
/// UDP payload (64 KiB minus headers), and a smaller slot would make the
/// kernel truncate it, losing every segment after the cut.
pub const GRO_SLOT_SIZE: usize = 65536;

/// Control buffer for one received message. `UDP_GRO` needs
/// `CMSG_SPACE(sizeof(int))` (24 bytes on 64-bit); the rest leaves room for
/// a cmsg someone else enabled on the socket (a timestamp, say), so that one
/// does not push the GRO segment size out through `MSG_CTRUNC`.
/// Aligned like `cmsghdr`, as the `CMSG_*` macros require.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct RecvCmsgBuf([u8; 128]);

/// What the kernel told us about one filled slot.
#[derive(Clone, Copy, Debug)]
struct SlotMeta {
    source: SocketAddr,
    slot: u32,
    len: u32,
    /// GRO segment size; 0 when the slot holds a single datagram.
    segment: u32,
    /// The IP header's ECN codepoint (GRO coalesces only datagrams whose
    /// TOS bytes agree, so it is every segment's).
    ecn: u8,
}

/// Scratch for the syscall: headers pointing into `RecvBatch`'s own buffers.
struct RecvScratch {
    names: Vec<SockAddrBuf>,
    ctrl: Vec<RecvCmsgBuf>,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers inside `iovs` and `hdrs` are rewritten right
// before every `recvmmsg`, point only into buffers owned by the same
// `RecvBatch`, and are never dereferenced outside that call, which holds
// `&mut RecvBatch`. Moving the batch to another thread between calls is
// therefore sound.
unsafe impl Send for RecvScratch {}

/// Preallocated buffers for receiving up to `capacity` datagrams (or GRO
/// super-datagrams) in one `recvmmsg` call.
///
/// Nothing allocates after [`RecvBatch::new`]: a receive loop reuses one
/// batch forever. Pass it to [`BatchSocket::recv_batch`], then read the
/// datagrams with [`RecvBatch::iter`]; the next receive overwrites them.
///
/// Memory is `capacity × slot_size` bytes. With GRO on, use
/// [`GRO_SLOT_SIZE`] slots; one slot then carries up to 64 datagrams of a
/// flow, so a few dozen slots are plenty (32 × 64 KiB = 2 MiB). Without GRO,
/// a slot only needs the largest datagram you accept (e.g. 2048 for
/// MTU-sized packets); larger ones are dropped and counted in
/// [`RecvBatch::truncated`].
///
/// [`BatchSocket::recv_batch`]: crate::BatchSocket::recv_batch
pub struct RecvBatch {
    buf: Vec<u8>,
    slot_size: usize,
    capacity: usize,
    meta: Vec<SlotMeta>,
    datagrams: usize,
    truncated: usize,
    /// Receives that ended with an ICMP error (over the batch's life).
    icmp_errors: u64,
    scratch: RecvScratch,
}

impl RecvBatch {
    /// Allocates `capacity` slots of `slot_size` bytes each (both at least 1).
    ///
    /// The buffer is zero-allocated, so pages the kernel never writes (say,
    /// the tail of 64 KiB GRO slots) cost no resident memory.
    pub fn new(capacity: usize, slot_size: usize) -> Self {
        let capacity = capacity.max(1);
        // The kernel reports lengths as u32; larger slots would be pointless.
        let slot_size = slot_size.clamp(1, u32::MAX as usize);
        let total = capacity
            .checked_mul(slot_size)
            .expect("RecvBatch: capacity × slot_size overflows usize");
        RecvBatch {
            buf: vec![0; total],
            slot_size,
            capacity,
            meta: Vec::with_capacity(capacity),
            datagrams: 0,
            truncated: 0,
            icmp_errors: 0,
            scratch: RecvScratch {
                names: vec![SockAddrBuf::zeroed(); capacity],
                ctrl: vec![RecvCmsgBuf([0; 128]); capacity],
                iovs: Vec::with_capacity(capacity),
                hdrs: Vec::with_capacity(capacity),
            },
        }
    }

    /// Number of slots, i.e. the most messages one receive can return.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// Datagrams held from the last receive, counting each GRO segment
    /// separately (what [`iter`](Self::iter) yields).
    pub fn len(&self) -> usize {
        self.datagrams
    }

    /// True when the last receive yielded nothing.
    pub fn is_empty(&self) -> bool {
        self.datagrams == 0
    }

    /// Slots the last receive filled with usable data. Less than
    /// [`len`](Self::len) when GRO coalesced datagrams; useful to see whether
    /// GRO is doing anything.
    pub fn slots_used(&self) -> usize {
        self.meta.len()
    }

    /// Messages the last receive dropped because they did not fit: a
    /// datagram larger than a slot (the kernel reported `MSG_TRUNC`), or,
    /// under GRO, a message whose control data was cut short (`MSG_CTRUNC`)
    /// so that its segment size is unknown. A datagram cut short is never
    /// handed out, since its length fields would not match its bytes.
    pub fn truncated(&self) -> usize {
        self.truncated
    }

    /// Receives (over this batch's life) that the kernel ended with an ICMP
    /// error concerning an earlier send, instead of datagrams
    /// ([`BatchSocket::icmp_errors`](crate::BatchSocket::icmp_errors)).
    pub(crate) fn icmp_errors(&self) -> u64 {
        self.icmp_errors
    }

    /// The datagrams from the last receive, in arrival order, as
    /// `(source, payload)`. A GRO slot is split back into the datagrams the
    /// sender sent: every segment has the reported segment size except
    /// possibly a shorter last one.
    pub fn iter(&self) -> RecvIter<'_> {
        RecvIter {
            batch: self,
            index: 0,
            offset: 0,
        }
    }

    /// As [`iter`](Self::iter), with whether each datagram's IP header said
    /// Congestion Experienced (read when the socket
    /// [enabled ECN](crate::BatchSocket::enable_ecn); false otherwise).
    pub fn iter_ecn(&self) -> impl Iterator<Item = (SocketAddr, &[u8], bool)> + '_ {
        self.iter_codepoints().map(|(from, bytes, cp)| (from, bytes, cp == crate::ecn::CE))
    }

    /// As [`iter`](Self::iter), with each datagram's ECN codepoint
    /// ([`crate::ecn::NOT_ECT`] when the socket did not
    /// [enable ECN](crate::BatchSocket::enable_ecn)): what a peer sends
    /// says whether it is ECN-capable.
    pub fn iter_codepoints(&self) -> impl Iterator<Item = (SocketAddr, &[u8], u8)> + '_ {
        let mut it = self.iter();
        std::iter::from_fn(move || {
            // the slot `next` reads from is the one at `index` now
            let cp = self.meta.get(it.index).map_or(crate::ecn::NOT_ECT, |m| m.ecn);
            it.next().map(|(from, bytes)| (from, bytes, cp))
        })
    }

    fn clear(&mut self) {
        self.meta.clear();
        self.datagrams = 0;
        self.truncated = 0;
    }

    /// One `recvmmsg` into this batch. See `BatchSocket::recv_batch`.
    /// `wait`: block (up to SO_RCVTIMEO) for the first datagram; otherwise
    /// take only what is queued.
    pub(crate) fn recv_from_fd(&mut self, fd: RawFd, gro: bool, wait: bool) -> io::Result<usize> {
        self.clear();
        let capacity = self.capacity;
        let slot_size = self.slot_size;
        let s = &mut self.scratch;

        // Headers are rebuilt on every call: the kernel overwrites
        // `msg_namelen`, `msg_controllen` and `msg_flags`, and rebuilding is a
        // few stores per slot, negligible next to the syscall.
        s.iovs.clear();
        s.iovs.extend(
            self.buf
                .chunks_exact_mut(slot_size)
                .map(|slot| libc::iovec {
                    iov_base: slot.as_mut_ptr().cast(),
                    iov_len: slot.len(),
                }),
        );
        s.hdrs.clear();
        for i in 0..capacity {
            // SAFETY: `msghdr` is a plain C struct; all-zero (null pointers,
            // zero lengths) is a valid value.
            let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
            hdr.msg_name = ptr::from_mut(&mut s.names[i]).cast();
            hdr.msg_namelen = SockAddrBuf::CAPACITY;
            hdr.msg_iov = ptr::from_mut(&mut s.iovs[i]);
            hdr.msg_iovlen = 1;
            hdr.msg_control = ptr::from_mut(&mut s.ctrl[i]).cast();
            hdr.msg_controllen = std::mem::size_of::<RecvCmsgBuf>() as _;
            s.hdrs.push(libc::mmsghdr {
                msg_hdr: hdr,
                msg_len: 0,
            });
        }

        // SAFETY: `hdrs` holds `capacity` initialised headers whose name,
        // iovec and control pointers refer to live buffers of the stated
        // lengths (owned by `self`, not moved or resized until we return).
        // MSG_WAITFORONE makes the call block (up to SO_RCVTIMEO) for the
        // first datagram only and then take what is already queued, which is
        // the batching we want without added latency.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                s.hdrs.as_mut_ptr(),
                capacity as libc::c_uint,
                if wait { libc::MSG_WAITFORONE } else { libc::MSG_DONTWAIT } as _,
                ptr::null_mut(),
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                // Timeout (SO_RCVTIMEO), non-blocking socket, or a signal.
                Some(libc::EAGAIN | libc::EINTR) => Ok(0),
                // An ICMP error queued on the socket (a connected one, or
                // one that asked for reports) concerns an earlier send, not
                // this receive; the next call proceeds.
                Some(e) if crate::unreachable::is_icmp_errno(e) => {
                    self.icmp_errors += 1;
                    Ok(0)
                }
                _ => Err(err),
            };
        }

        for (i, h) in s.hdrs.iter().take(n as usize).enumerate() {
            if h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0 {
                self.truncated += 1;
                continue;
            }
            // Only UDP sockets reach here, but a foreign family must not
            // become a bogus address; skip it.
            let Some(source) = s.names[i].read(h.msg_hdr.msg_namelen) else {
                continue;
            };
            let len = (h.msg_len as usize).min(slot_size);
            let segment = gro_segment_size(&h.msg_hdr);
            if gro && segment == 0 && h.msg_hdr.msg_flags & libc::MSG_CTRUNC != 0 {
                // The segment size may have been cut off with the control
                // data; handing out a coalesced slot as one datagram would
                // be worse than dropping it. Only possible when other
                // cmsgs have been enabled on the socket.
                self.truncated += 1;
                continue;
            }
            self.datagrams += segment_count(len, segment);
            self.meta.push(SlotMeta {
                source,
                slot: i as u32,
                len: len as u32,
                segment: segment as u32,
                ecn: crate::ecn::ecn_codepoint(&h.msg_hdr),
            });
        }
        Ok(self.datagrams)
    }
}

impl fmt::Debug for RecvBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvBatch")
            .field("capacity", &self.capacity)
            .field("slot_size", &self.slot_size)
            .field("datagrams", &self.datagrams)
            .field("slots_used", &self.meta.len())
            .field("truncated", &self.truncated)
            .finish()
    }
}

/// Datagrams in a slot of `len` bytes with GRO segment size `segment`.
fn segment_count(len: usize, segment: usize) -> usize {
    if segment == 0 || len == 0 {
        1
    } else {
        len.div_ceil(segment)
    }
}

/// The `UDP_GRO` segment size in a received message's control data, or 0.
fn gro_segment_size(hdr: &libc::msghdr) -> usize {
    if hdr.msg_controllen == 0 {
        return 0;
    }
    // SAFETY: `hdr` is a header the kernel just filled: `msg_control` points
    // to our control buffer and `msg_controllen` is the length it wrote,
    // within that buffer. CMSG_FIRSTHDR/CMSG_NXTHDR only return headers that
    // lie entirely inside that length (or null), and the payload is read
    // unaligned after checking `cmsg_len` covers it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(hdr);
        while !cmsg.is_null() {
            let c = &*cmsg;
            if c.cmsg_level == libc::SOL_UDP
                && c.cmsg_type == libc::UDP_GRO
                && c.cmsg_len as usize
                    >= libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as _) as usize
            {
                let size = ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>());
                return usize::try_from(size).unwrap_or(0);
            }
            cmsg = libc::CMSG_NXTHDR(hdr, cmsg);
        }
    }
    0
}

/// Iterator over the datagrams of a [`RecvBatch`]; see [`RecvBatch::iter`].
#[derive(Clone, Debug)]
pub struct RecvIter<'a> {
    batch: &'a RecvBatch,
    index: usize,
    offset: usize,
}

impl<'a> Iterator for RecvIter<'a> {
    type Item = (SocketAddr, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let m = *self.batch.meta.get(self.index)?;
        let len = m.len as usize;
        let segment = match m.segment as usize {
            0 => len,
            s => s,
        };
        let start = m.slot as usize * self.batch.slot_size + self.offset;
        // An empty datagram is still a datagram: yield it once.
        let take = segment.min(len - self.offset);
        self.offset += take;
        if self.offset >= len {
            self.index += 1;
            self.offset = 0;
        }
        Some((m.source, &self.batch.buf[start..start + take]))
    }
}

impl std::iter::FusedIterator for RecvIter<'_> {}

impl<'a> IntoIterator for &'a RecvBatch {
    type Item = (SocketAddr, &'a [u8]);
    type IntoIter = RecvIter<'a>;

    fn into_iter(self) -> RecvIter<'a> {
        self.iter()
    }
}
