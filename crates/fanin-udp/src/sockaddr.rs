//! Conversion between `std::net::SocketAddr` and the C socket address
//! structures that `recvmmsg`/`sendmmsg` read and write.
//!
//! std does this internally but does not export it, so the batch paths need
//! their own copy. Only `AF_INET` and `AF_INET6` exist for UDP, so a union of
//! the two is the whole address buffer (28 bytes instead of the 128 of
//! `sockaddr_storage`, which matters when hundreds sit in a batch).

use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// Room for one IPv4 or IPv6 socket address, as the kernel lays it out.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union SockAddrBuf {
    v4: libc::sockaddr_in,
    v6: libc::sockaddr_in6,
}

impl SockAddrBuf {
    /// Capacity handed to the kernel as `msg_namelen` when receiving.
    pub(crate) const CAPACITY: libc::socklen_t = mem::size_of::<SockAddrBuf>() as libc::socklen_t;

    pub(crate) fn zeroed() -> Self {
        // SAFETY: both members are plain C structs of integers and byte
        // arrays, for which all-zero bits are a valid value.
        unsafe { mem::zeroed() }
    }

    /// Encodes `addr` for a socket of the given family and returns the length
    /// to pass as `msg_namelen`.
    ///
    /// An IPv6 socket cannot take an `AF_INET` destination, so IPv4
    /// destinations are written as v4-mapped IPv6 (`::ffff:a.b.c.d`), which a
    /// dual-stack socket sends as plain IPv4. Conversely, a v4-mapped
    /// destination on an IPv4 socket is unmapped. Anything else is written as
    /// is and the kernel rejects it with `EAFNOSUPPORT`.
    pub(crate) fn write(&mut self, addr: SocketAddr, socket_is_v6: bool) -> libc::socklen_t {
        match addr {
            SocketAddr::V4(a) if socket_is_v6 => {
                let mapped = SocketAddrV6::new(a.ip().to_ipv6_mapped(), a.port(), 0, 0);
                self.write_v6(&mapped)
            }
            SocketAddr::V4(a) => self.write_v4(&a),
            SocketAddr::V6(a) if !socket_is_v6 => match a.ip().to_ipv4_mapped() {
                Some(ip) => self.write_v4(&SocketAddrV4::new(ip, a.port())),
                None => self.write_v6(&a),
            },
            SocketAddr::V6(a) => self.write_v6(&a),
        }
    }

    fn write_v4(&mut self, a: &SocketAddrV4) -> libc::socklen_t {
        self.v4 = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a.port().to_be(),
            // `octets` is already in network order; keep the bytes as they are.
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(a.ip().octets()),
            },
            sin_zero: [0; 8],
        };
        mem::size_of::<libc::sockaddr_in>() as libc::socklen_t
    }

    fn write_v6(&mut self, a: &SocketAddrV6) -> libc::socklen_t {
        self.v6 = libc::sockaddr_in6 {
            sin6_family: libc::AF_INET6 as libc::sa_family_t,
            sin6_port: a.port().to_be(),
            // std passes flowinfo through unconverted; do the same so that an
            // address round-trips identically through std and this crate.
            sin6_flowinfo: a.flowinfo(),
            sin6_addr: libc::in6_addr {
                s6_addr: a.ip().octets(),
            },
            sin6_scope_id: a.scope_id(),
        };
        mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t
    }

    /// Decodes an address the kernel wrote, `len` being the `msg_namelen` it
    /// reported. Returns `None` for a family other than IPv4/IPv6 or a length
    /// too short for the family.
    ///
    /// v4-mapped IPv6 sources (a dual-stack socket receiving IPv4) come back
    /// as plain IPv4, so a peer has one identity whichever socket family
    /// received from it; `write` maps it back when replying.
    pub(crate) fn read(&self, len: libc::socklen_t) -> Option<SocketAddr> {
        let len = len as usize;
        if len < mem::size_of::<libc::sa_family_t>() {
            return None;
        }
        // SAFETY: every member is plain old data, so any bit pattern is a
        // valid value; both start with the family field, at the same offset.
        let family = unsafe { self.v4.sin_family };
        match i32::from(family) {
            libc::AF_INET if len >= mem::size_of::<libc::sockaddr_in>() => {
                // SAFETY: as above; the family says this member is the live one.
                let a = unsafe { self.v4 };
                let ip = Ipv4Addr::from(a.sin_addr.s_addr.to_ne_bytes());
                Some(SocketAddr::V4(SocketAddrV4::new(
                    ip,
                    u16::from_be(a.sin_port),
                )))
            }
            libc::AF_INET6 if len >= mem::size_of::<libc::sockaddr_in6>() => {
                // SAFETY: as above; the family says this member is the live one.
                let a = unsafe { self.v6 };
                let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
                let port = u16::from_be(a.sin6_port);
                Some(match ip.to_ipv4_mapped() {
                    Some(v4) => SocketAddr::V4(SocketAddrV4::new(v4, port)),
                    None => SocketAddr::V6(SocketAddrV6::new(
                        ip,
                        port,
                        a.sin6_flowinfo,
                        a.sin6_scope_id,
                    )),
                })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(addr: SocketAddr, socket_is_v6: bool) -> Option<SocketAddr> {
        let mut buf = SockAddrBuf::zeroed();
        let len = buf.write(addr, socket_is_v6);
        buf.read(len)
    }

    #[test]
    fn v4_round_trips() {
        let a: SocketAddr = "192.0.2.7:4791".parse().unwrap();
        assert_eq!(round_trip(a, false), Some(a));
    }

    #[test]
    fn v6_round_trips_with_scope_and_flowinfo() {
        let a = SocketAddr::V6(SocketAddrV6::new(
            "fe80::1".parse().unwrap(),
            9000,
            0x12345,
            3,
        ));
        assert_eq!(round_trip(a, true), Some(a));
    }

    #[test]
    fn v4_on_v6_socket_is_mapped_and_comes_back_as_v4() {
        let a: SocketAddr = "10.1.2.3:53".parse().unwrap();
        let mut buf = SockAddrBuf::zeroed();
        let len = buf.write(a, true);
        assert_eq!(len as usize, mem::size_of::<libc::sockaddr_in6>());
        assert_eq!(buf.read(len), Some(a));
    }

    #[test]
    fn mapped_v6_on_v4_socket_is_unmapped() {
        let a: SocketAddr = "[::ffff:10.1.2.3]:53".parse().unwrap();
        let mut buf = SockAddrBuf::zeroed();
        let len = buf.write(a, false);
        assert_eq!(len as usize, mem::size_of::<libc::sockaddr_in>());
        assert_eq!(buf.read(len), Some("10.1.2.3:53".parse().unwrap()));
    }

    #[test]
    fn short_or_unknown_addresses_are_rejected() {
        let mut buf = SockAddrBuf::zeroed();
        let len = buf.write("10.0.0.1:1".parse().unwrap(), false);
        assert_eq!(buf.read(len - 1), None);
        assert_eq!(buf.read(0), None);
        // AF_UNIX, which UDP never reports, must not be misread.
        let mut buf = SockAddrBuf::zeroed();
        buf.v4.sin_family = libc::AF_UNIX as libc::sa_family_t;
        assert_eq!(buf.read(SockAddrBuf::CAPACITY), None);
    }
}
