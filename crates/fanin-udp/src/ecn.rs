//! Explicit Congestion Notification (RFC 3168): the two low bits of the IP
//! header's TOS (IPv4) or traffic class (IPv6) byte. A sender marks its
//! datagrams ECN-capable (ECT); a queue on the path that would otherwise
//! drop one, or that runs above its marking threshold (RED, CoDel, a
//! datacenter switch's DCTCP threshold), rewrites the field to Congestion
//! Experienced (CE) and forwards it. The receiver reads the field from the
//! control data `recvmmsg` returns once [`BatchSocket::enable_ecn`] asked
//! for it.

use std::io;
use std::os::fd::AsRawFd;
use std::ptr;

use crate::socket::{setsockopt_int, BatchSocket};

/// The ECN codepoints.
pub const NOT_ECT: u8 = 0b00;
pub const ECT_1: u8 = 0b01;
pub const ECT_0: u8 = 0b10;
pub const CE: u8 = 0b11;

impl BatchSocket {
    /// Sends every datagram ECN-capable (ECT(0)) and reads the ECN field of
    /// every datagram received: [`RecvBatch::iter_ecn`](crate::RecvBatch::iter_ecn)
    /// then says which arrived CE-marked. Whoever enables it must answer a
    /// CE mark as it would a loss (RFC 3168 §5): a path that marks instead
    /// of dropping relies on it.
    pub fn enable_ecn(&self) -> io::Result<()> {
        self.set_ecn_codepoint(ECT_0)?;
        let fd = self.as_std().as_raw_fd();
        if self.is_v6() {
            setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 1)?;
            // a dual-stack socket receives IPv4 datagrams too; a v6-only
            // one refuses this, which is fine
            let _ = setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_RECVTOS, 1);
        } else {
            setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_RECVTOS, 1)?;
        }
        Ok(())
    }

    /// The ECN codepoint (the low two bits; DSCP 0) of every datagram sent
    /// from now on: [`ECT_0`] by [`enable_ecn`](Self::enable_ecn); [`CE`]
    /// makes this socket stand for a path that marked its datagrams (a
    /// relay in a test).
    pub fn set_ecn_codepoint(&self, codepoint: u8) -> io::Result<()> {
        let fd = self.as_std().as_raw_fd();
        let value = libc::c_int::from(codepoint & 0b11);
        if self.is_v6() {
            setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_TCLASS, value)?;
            let _ = setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TOS, value);
            Ok(())
        } else {
            setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TOS, value)
        }
    }
}

/// The ECN codepoint in a received message's control data ([`NOT_ECT`]
/// when the socket did not ask for it).
pub(crate) fn ecn_codepoint(hdr: &libc::msghdr) -> u8 {
    if hdr.msg_controllen == 0 {
        return NOT_ECT;
    }
    // SAFETY: as in `recv::gro_segment_size`: a header the kernel just
    // filled; CMSG_FIRSTHDR/CMSG_NXTHDR stay within `msg_controllen`, and
    // the payload is read unaligned after checking `cmsg_len` covers it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(hdr);
        while !cmsg.is_null() {
            let c = &*cmsg;
            let data = libc::CMSG_DATA(cmsg);
            // IPv4: IP_TOS, one byte; IPv6: IPV6_TCLASS, an int
            if c.cmsg_level == libc::IPPROTO_IP
                && c.cmsg_type == libc::IP_TOS
                && c.cmsg_len as usize >= libc::CMSG_LEN(1) as usize
            {
                return ptr::read(data) & 0b11;
            }
            if c.cmsg_level == libc::IPPROTO_IPV6
                && c.cmsg_type == libc::IPV6_TCLASS
                && c.cmsg_len as usize >= libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as _) as usize
            {
                return (ptr::read_unaligned(data.cast::<libc::c_int>()) & 0b11) as u8;
            }
            cmsg = libc::CMSG_NXTHDR(hdr, cmsg);
        }
    }
    NOT_ECT
}
