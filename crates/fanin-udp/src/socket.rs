//! `BatchSocket`: a `std::net::UdpSocket` plus the batch syscalls and the
//! socket options that make them fast.

use std::io;
use std::mem;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::recv::{RecvBatch, GRO_SLOT_SIZE};
use crate::send::{GsoState, SendBatch};

/// Occupancy of a socket's receive queue; see [`BatchSocket::receive_queue`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiveQueue {
    /// Bytes the kernel holds for datagrams not yet read.
    pub queued_bytes: usize,
    /// The receive buffer: above it, arriving datagrams are dropped.
    pub limit_bytes: usize,
    /// Datagrams the kernel dropped on this socket since it was opened
    /// (full queue, checksum errors), as the `drops` column of /proc/net/udp.
    pub drops: u64,
}

/// A UDP socket (IPv4 or IPv6) that receives and sends in batches.
///
/// All methods take `&self`, so one socket can be shared (e.g. in an `Arc`)
/// by a receiving thread and sending threads; each thread brings its own
/// [`RecvBatch`] / [`SendBatch`]. Blocking behaviour is the socket's: by
/// default receives block, bounded by [`set_read_timeout`].
///
/// [`set_read_timeout`]: BatchSocket::set_read_timeout
#[derive(Debug)]
pub struct BatchSocket {
    socket: UdpSocket,
    /// Bound to an IPv6 address: IPv4 destinations must be v4-mapped.
    is_v6: bool,
    gso: GsoState,
    gro: AtomicBool,
    /// ICMP errors the kernel reported through a receive or a send.
    icmp_errors: AtomicU64,
}

impl BatchSocket {
    /// Binds a new socket to `addr`. An IPv6 wildcard bind is dual-stack
    /// unless the system sets `net.ipv6.bindv6only`.
    pub fn bind(addr: SocketAddr) -> io::Result<Self> {
        Self::from_std(UdpSocket::bind(addr)?)
    }

    /// Bound to an IPv6 address.
    pub(crate) fn is_v6(&self) -> bool {
        self.is_v6
    }

    /// Wraps a bound socket, keeping its blocking mode and options, and
    /// probes GSO support.
    ///
    /// The probe sets the socket-wide `UDP_SEGMENT` default to 0 (off), so
    /// a default segment size set earlier on `socket` is cleared; GSO is
    /// requested per message instead.
    pub fn from_std(socket: UdpSocket) -> io::Result<Self> {
        let is_v6 = socket.local_addr()?.is_ipv6();
        // Kernels without UDP GSO (< 4.18) reject the option; 0 is the
        // default value, so the probe changes nothing where it succeeds.
        let gso = setsockopt_int(socket.as_raw_fd(), libc::SOL_UDP, libc::UDP_SEGMENT, 0).is_ok();
        Ok(BatchSocket {
            socket,
            is_v6,
            gso: GsoState::new(gso),
            gro: AtomicBool::new(false),
            icmp_errors: AtomicU64::new(0),
        })
    }

    /// The underlying std socket, for anything not covered here (plain
    /// `send_to`, `connect`, other options).
    pub fn as_std(&self) -> &UdpSocket {
        &self.socket
    }

    /// The address the socket is bound to.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Sets the kernel receive and send buffer sizes in bytes.
    ///
    /// Bursts from many workers arriving at once are what overflow a
    /// switch's receive buffer, and the default (~200 KiB) holds only about
    /// a hundred datagrams. The `*BUFFORCE` options ignore the
    /// `net.core.{r,w}mem_max` caps but need `CAP_NET_ADMIN`; without it the
    /// plain options are used, which the kernel silently caps. The kernel
    /// doubles the value for bookkeeping; see [`buffer_sizes`].
    ///
    /// [`buffer_sizes`]: BatchSocket::buffer_sizes
    pub fn set_buffer_sizes(&self, recv: usize, send: usize) -> io::Result<()> {
        let fd = self.socket.as_raw_fd();
        let clamp = |v: usize| libc::c_int::try_from(v).unwrap_or(libc::c_int::MAX);
        for (force, plain, size) in [
            (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, recv),
            (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, send),
        ] {
            let size = clamp(size);
            if setsockopt_int(fd, libc::SOL_SOCKET, force, size).is_err() {
                setsockopt_int(fd, libc::SOL_SOCKET, plain, size)?;
            }
        }
        Ok(())
    }

    /// The kernel's current `(receive, send)` buffer sizes, as reported by
    /// `SO_RCVBUF`/`SO_SNDBUF` (twice what was set, capped by sysctls).
    pub fn buffer_sizes(&self) -> io::Result<(usize, usize)> {
        let fd = self.socket.as_raw_fd();
        let recv = getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUF)?;
        let send = getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF)?;
        Ok((recv.max(0) as usize, send.max(0) as usize))
    }

    /// The kernel's view of the receive queue (`SO_MEMINFO`): bytes queued,
    /// the limit at which the kernel starts dropping, and how many datagrams
    /// it dropped so far. One `getsockopt`, cheap enough to call per batch.
    ///
    /// This is the daemon's processing queue: datagrams wait here until the
    /// shard thread reads them. Bytes are the kernel's accounting (each
    /// datagram's buffer "truesize", roughly its length rounded up to a page
    /// fragment plus ~0.5 KiB of metadata), the same unit as the limit.
    pub fn receive_queue(&self) -> io::Result<ReceiveQueue> {
        // SO_MEMINFO (asm-generic/socket.h; the libc crate does not export it).
        const SO_MEMINFO: libc::c_int = 55;
        let mut info = [0u32; libc::SK_MEMINFO_DROPS as usize + 1];
        let mut len = mem::size_of_val(&info) as libc::socklen_t;
        // SAFETY: `info` and `len` are live locals; `len` bounds the write.
        let r = unsafe {
            libc::getsockopt(
                self.socket.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_MEMINFO,
                info.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ReceiveQueue {
            queued_bytes: info[libc::SK_MEMINFO_RMEM_ALLOC as usize] as usize,
            limit_bytes: info[libc::SK_MEMINFO_RCVBUF as usize] as usize,
            drops: info[libc::SK_MEMINFO_DROPS as usize] as u64,
        })
    }

    /// Bounds how long [`recv_batch`](Self::recv_batch) waits for the first
    /// datagram; `None` waits forever. Like std, `Some(Duration::ZERO)` is an
    /// error: use [`set_nonblocking`](Self::set_nonblocking) to poll.
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.socket.set_read_timeout(timeout)
    }

    /// Waits until a datagram is queued or `timeout` passes, with the
    /// kernel's high-resolution timers (`ppoll`). `SO_RCVTIMEO`, which bounds
    /// [`recv_batch`](Self::recv_batch), counts in scheduler ticks (1-4 ms),
    /// too coarse for timers of tens of microseconds. Returns whether a
    /// datagram is ready; a signal counts as "not ready".
    pub fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        let mut pfd = libc::pollfd { fd: self.socket.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: one valid pollfd, a valid timespec, no signal mask.
        let n = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        if n < 0 {
            let err = io::Error::last_os_error();
            return if err.kind() == io::ErrorKind::Interrupted { Ok(false) } else { Err(err) };
        }
        Ok(n > 0)
    }

    /// Switches non-blocking mode: receives return 0 at once when nothing
    /// is queued (for use under epoll or a busy-poll loop).
    pub fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        self.socket.set_nonblocking(nonblocking)
    }

    /// Turns on UDP GRO: the kernel may hand over several datagrams of one
    /// flow as one buffer, which [`RecvBatch::iter`] splits again. Returns
    /// `Ok(false)` when the kernel does not support it (< 5.0).
    ///
    /// Once it is on, receive batches need slots of [`GRO_SLOT_SIZE`]
    /// bytes, since a coalesced buffer can be that large;
    /// [`recv_batch`](Self::recv_batch) rejects smaller ones.
    pub fn enable_gro(&self) -> io::Result<bool> {
        match setsockopt_int(self.socket.as_raw_fd(), libc::SOL_UDP, libc::UDP_GRO, 1) {
            Ok(()) => {
                self.gro.store(true, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOPROTOOPT | libc::EINVAL)) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Whether [`enable_gro`](Self::enable_gro) succeeded on this socket.
    pub fn gro_enabled(&self) -> bool {
        self.gro.load(Ordering::Relaxed)
    }

    /// Whether sends may use UDP GSO: the kernel supports it (probed once,
    /// at construction) and no send has found the route unable to offload
    /// it (after which it stays off for this socket).
    pub fn gso_supported(&self) -> bool {
        self.gso.enabled()
    }

    /// Receives what is queued into `batch` with one `recvmmsg`: waits up to
    /// the read timeout for the first datagram, then takes whatever else is
    /// already there, up to the batch capacity, without waiting further.
    ///
    /// Returns the number of datagrams [`RecvBatch::iter`] will yield (GRO
    /// segments counted singly). A timeout, a would-block on a non-blocking
    /// socket, a signal, or an ICMP error queued on a connected socket all
    /// return `Ok(0)`, so a receive loop only needs to handle real faults.
    ///
    /// Fails with `InvalidInput` when GRO is on and the batch's slots are
    /// smaller than [`GRO_SLOT_SIZE`], which would lose coalesced data.
    pub fn recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        self.recv_into(batch, true)
    }

    /// [`recv_batch`](Self::recv_batch) without waiting: only what is
    /// queued now. For a socket a poll reported ready, which a poll also
    /// does for an entry of its error queue alone (`POLLERR`), with no
    /// datagram to read.
    pub fn recv_batch_nowait(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        self.recv_into(batch, false)
    }

    fn recv_into(&self, batch: &mut RecvBatch, wait: bool) -> io::Result<usize> {
        if self.gro_enabled() && batch.slot_size() < GRO_SLOT_SIZE - 1 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "GRO is enabled: RecvBatch slots must be at least GRO_SLOT_SIZE - 1 bytes",
            ));
        }
        let before = batch.icmp_errors();
        let r = batch.recv_from_fd(self.socket.as_raw_fd(), self.gro_enabled(), wait);
        self.icmp_errors.fetch_add(batch.icmp_errors() - before, Ordering::Relaxed);
        r
    }

    /// ICMP errors (port, host or network unreachable, …) the kernel
    /// reported so far through this socket's receives and sends, concerning
    /// datagrams sent earlier (on a connected socket, or on one that asked
    /// for them: [`report_unreachable`](Self::report_unreachable)), plus the
    /// sends cut short, which may have swallowed one (sendmmsg(2) loses the
    /// error that stopped it). A socket that asked for reports reads their
    /// details with [`take_unreachable`](Self::take_unreachable) when this
    /// grows.
    pub fn icmp_errors(&self) -> u64 {
        self.icmp_errors.load(Ordering::Relaxed)
    }

    /// Sends every datagram queued in `batch`, in order, then clears it
    /// (also on error). Returns how many datagrams the kernel accepted.
    ///
    /// Uses as few `sendmmsg` calls as the kernel allows, resuming after
    /// partial sends. With [`SendBatch::set_gso`] on and GSO supported, runs
    /// of datagrams to one destination with one length (the last may be
    /// shorter) go out as single UDP GSO messages of up to
    /// [`MAX_GSO_SEGMENTS`] segments and [`MAX_GSO_BYTES`] bytes; if the
    /// kernel refuses one (no checksum offload, segment above the path MTU)
    /// it is resent plainly and the limit remembered.
    ///
    /// Failures are handled like a router would:
    /// - `EINTR` is retried at once; `EAGAIN`/`ENOBUFS` (full queue) are
    ///   retried with a backoff of about 2 ms in total, after which the rest
    ///   of the batch is dropped;
    /// - an ICMP error reported for an earlier datagram (a connected socket,
    ///   or one that asked for reports) fails the next send once: that send
    ///   is made again, and the error counted in [`icmp_errors`](Self::icmp_errors);
    /// - a datagram refused for its own reason (unreachable destination,
    ///   wrong address family, too large) is dropped and the rest still go;
    /// - the call returns `Err` (the first error seen) only if nothing at all
    ///   was sent; otherwise `len() - returned` datagrams were dropped.
    ///
    /// [`MAX_GSO_SEGMENTS`]: crate::MAX_GSO_SEGMENTS
    /// [`MAX_GSO_BYTES`]: crate::MAX_GSO_BYTES
    pub fn send_batch(&self, batch: &mut SendBatch) -> io::Result<usize> {
        batch.send_on_fd(self.socket.as_raw_fd(), self.is_v6, &self.gso, &self.icmp_errors)
    }
}

impl AsRawFd for BatchSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

impl AsFd for BatchSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

/// Waits until one of `sockets` has a datagram queued or `timeout` passes
/// (`ppoll`, high-resolution timers). Returns a bit mask of the readable
/// ones (bit i: `sockets[i]`); a signal counts as none. At most 64 sockets.
pub fn wait_readable_any(sockets: &[&BatchSocket], timeout: Duration) -> io::Result<u64> {
    if sockets.len() > 64 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "wait_readable_any: more than 64 sockets"));
    }
    let mut fds = [libc::pollfd { fd: -1, events: libc::POLLIN, revents: 0 }; 64];
    for (pfd, s) in fds.iter_mut().zip(sockets) {
        pfd.fd = s.as_std().as_raw_fd();
    }
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: `sockets.len()` valid pollfds, a valid timespec, no signal mask.
    let n = unsafe { libc::ppoll(fds.as_mut_ptr(), sockets.len() as libc::nfds_t, &ts, std::ptr::null()) };
    if n < 0 {
        let err = io::Error::last_os_error();
        return if err.kind() == io::ErrorKind::Interrupted { Ok(0) } else { Err(err) };
    }
    Ok(fds[..sockets.len()].iter().enumerate().filter(|(_, p)| p.revents != 0).fold(0, |m, (i, _)| m | 1 << i))
}

pub(crate) fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `value` is a live c_int for the duration of the call and the
    // length passed is exactly its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            std::ptr::from_ref(&value).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn getsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` and `len` are live locals; `len` tells the kernel how
    // many bytes it may write into `value`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            level,
            name,
            std::ptr::from_mut(&mut value).cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}
