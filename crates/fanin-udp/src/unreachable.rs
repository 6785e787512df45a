//! What the network said of the datagrams a socket sent: the ICMP errors
//! (port unreachable and the others) the kernel queues on a socket that
//! asked for them ([`BatchSocket::report_unreachable`]).
//!
//! A UDP sender learns nothing when its peer's process is gone, unless it
//! asks: the peer's host answers each datagram to a closed port with an
//! ICMP port unreachable, and Linux hands that to an unconnected socket
//! only with `IP_RECVERR` (`IPV6_RECVERR`). The error then arrives twice:
//! once as the socket's pending error (the next `recvmmsg` or `sendmmsg`
//! fails with it, once), and as an entry of the socket's error queue, which
//! is charged to its receive buffer until read. [`BatchSocket::take_unreachable`]
//! reads that queue; a socket that asked for reports must call it whenever
//! [`BatchSocket::icmp_errors`] grows, or the queue fills the buffer that
//! datagrams need.

use std::io;
use std::os::fd::AsRawFd;

use crate::socket::{setsockopt_int, BatchSocket};

/// ICMP errors read from a socket's error queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unreachable {
    /// Port unreachable: the destination host runs nothing on that port.
    pub port: u64,
    /// Any other (host or network unreachable, fragmentation needed, …).
    pub other: u64,
}

/// The errors an ICMP message becomes as a socket's pending error (Linux's
/// `icmp_err_convert`, and `EMSGSIZE` for "fragmentation needed"). A
/// receive can fail with nothing else of these; a send may also fail with
/// some for reasons of its own (no route).
pub(crate) fn is_icmp_errno(e: i32) -> bool {
    matches!(
        e,
        libc::ECONNREFUSED
            | libc::EHOSTUNREACH
            | libc::ENETUNREACH
            | libc::EMSGSIZE
            | libc::ENOPROTOOPT
            | libc::EOPNOTSUPP
            | libc::ENONET
            | libc::EHOSTDOWN
            | libc::EACCES
            | libc::EPROTO
    )
}

/// Entries read per call at most, so a flood cannot hold the caller.
const MAX_ENTRIES: usize = 1024;

impl BatchSocket {
    /// Ask the kernel to report ICMP errors for what this socket sends:
    /// see [`take_unreachable`](Self::take_unreachable).
    pub fn report_unreachable(&self) -> io::Result<()> {
        let fd = self.as_std().as_raw_fd();
        if self.local_addr()?.is_ipv6() {
            setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVERR, 1)
        } else {
            setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_RECVERR, 1)
        }
    }

    /// Read (and so free) every ICMP error queued on this socket since the
    /// last call, without waiting.
    pub fn take_unreachable(&self) -> io::Result<Unreachable> {
        let fd = self.as_std().as_raw_fd();
        let mut seen = Unreachable::default();
        // the offending datagram's head comes back too; none of it is needed
        let mut head = [0u8; 64];
        // room for one IP(V6)_RECVERR message and its offender's address
        let mut control = [0u64; 64];
        for _ in 0..MAX_ENTRIES {
            let mut iov = libc::iovec { iov_base: head.as_mut_ptr().cast(), iov_len: head.len() };
            // SAFETY: an all-zero msghdr is valid; the pointers set below
            // refer to the live buffers above, of the lengths given.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = std::mem::size_of_val(&control) as _;
            // SAFETY: `msg` describes buffers that live through the call.
            let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
            if n < 0 {
                let err = io::Error::last_os_error();
                return match err.raw_os_error() {
                    Some(libc::EAGAIN) => Ok(seen),
                    Some(libc::EINTR) => continue,
                    _ => Err(err),
                };
            }
            match extended_errno(&msg) {
                Some(libc::ECONNREFUSED) => seen.port += 1,
                _ => seen.other += 1,
            }
        }
        Ok(seen)
    }
}

/// The errno of the `sock_extended_err` an error-queue message carries.
fn extended_errno(msg: &libc::msghdr) -> Option<i32> {
    // SAFETY: `msg` was filled by recvmsg; the CMSG macros walk its control
    // buffer within `msg_controllen`, and a RECVERR message's data is a
    // sock_extended_err (read unaligned: the buffer promises no alignment).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            let h = &*c;
            let recverr = (h.cmsg_level == libc::IPPROTO_IP && h.cmsg_type == libc::IP_RECVERR)
                || (h.cmsg_level == libc::IPPROTO_IPV6 && h.cmsg_type == libc::IPV6_RECVERR);
            if recverr && h.cmsg_len as usize >= libc::CMSG_LEN(std::mem::size_of::<libc::sock_extended_err>() as _) as usize {
                let ee = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::sock_extended_err>());
                return Some(ee.ee_errno as i32);
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RecvBatch, SendBatch};
    use std::net::UdpSocket;
    use std::time::Duration;

    /// A port nothing listens on (bound, then closed).
    fn closed_port() -> std::net::SocketAddr {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap()
    }

    #[test]
    fn datagrams_to_a_closed_port_are_reported_and_the_socket_still_receives() {
        let dead = closed_port();
        let me = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        me.report_unreachable().unwrap();
        me.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut rx = RecvBatch::new(8, 2048);
        let mut tx = SendBatch::new(8);
        // far more errors than a small receive buffer holds, read as they come
        let _ = me.set_buffer_sizes(4096, 4096);
        let mut port = 0;
        for _ in 0..200 {
            // the first send's refusal is pending at the second, which
            // fails once with it and is made again
            for _ in 0..2 {
                tx.push_copy(dead, b"anyone?");
                assert_eq!(me.send_batch(&mut tx).unwrap(), 1);
            }
            me.recv_batch(&mut rx).unwrap();
            port += me.take_unreachable().unwrap().port;
        }
        let errors = me.icmp_errors();
        assert!(errors > 0, "a receive or a send reported the refusal");
        assert!(port >= 200, "most of the 400 refusals were read from the error queue: {port}");
        // the error queue never filled the receive buffer
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
        peer.send_to(b"hello", me.local_addr().unwrap()).unwrap();
        assert_eq!(me.recv_batch(&mut rx).unwrap(), 1);
        assert_eq!(rx.iter().next().unwrap().1, b"hello");
    }

    /// Found by review: sendmmsg loses the error that stops it after its
    /// first message (sendmmsg(2)), so the refusal of the first datagram,
    /// pending when the second goes out, was never counted, the queue never
    /// read, and every poll returned at once (POLLERR) into a receive with
    /// nothing to read. A send cut short now counts, and a receive after a
    /// poll does not wait.
    #[test]
    fn an_error_a_batch_send_swallowed_is_counted_and_a_poll_woken_receive_does_not_wait() {
        let dead = closed_port();
        let live = UdpSocket::bind("127.0.0.1:0").unwrap();
        let me = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        me.report_unreachable().unwrap();
        let mut tx = SendBatch::new(8);
        tx.push_copy(dead, b"anyone?");
        tx.push_copy(live.local_addr().unwrap(), b"hi");
        assert_eq!(me.send_batch(&mut tx).unwrap(), 2, "both sent");
        assert!(me.icmp_errors() > 0, "the swallowed error is counted");
        assert_eq!(crate::wait_readable_any(&[&me], Duration::from_millis(100)).unwrap(), 1, "POLLERR: the queue entry");
        me.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rx = RecvBatch::new(8, 2048);
        let started = std::time::Instant::now();
        assert_eq!(me.recv_batch_nowait(&mut rx).unwrap(), 0);
        assert!(started.elapsed() < Duration::from_secs(1), "it did not wait for the read timeout");
        assert_eq!(me.take_unreachable().unwrap().port, 1);
        assert_eq!(crate::wait_readable_any(&[&me], Duration::ZERO).unwrap(), 0, "nothing left to report");
    }

    #[test]
    fn a_socket_that_did_not_ask_hears_nothing() {
        let me = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        me.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut tx = SendBatch::new(1);
        tx.push_copy(closed_port(), b"x");
        me.send_batch(&mut tx).unwrap();
        let mut rx = RecvBatch::new(1, 2048);
        me.recv_batch(&mut rx).unwrap();
        assert_eq!((me.icmp_errors(), me.take_unreachable().unwrap()), (0, Unreachable::default()));
    }
}
