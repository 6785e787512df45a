//! IPv4 multicast: a switch sends one datagram to a group instead of a copy
//! to each member; each member receives on a socket that joined the group.
//! On one host (loopback) the kernel then copies the payload once on send
//! and clones it to each listening socket, instead of copying it per member.

use std::io;
use std::mem;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::socket::{setsockopt_int, BatchSocket};

impl BatchSocket {
    /// Opens a receive-only socket on multicast `group` (address and port),
    /// joined on the interface that owns `interface` (127.0.0.1 for
    /// loopback; `UNSPECIFIED` lets the kernel pick by route).
    ///
    /// The socket is bound to the group address itself, so it sees only
    /// that group's datagrams, and with `SO_REUSEADDR`, so every process of
    /// the host that listens on the group gets its own copy. It is
    /// non-blocking: wait for it with [`wait_readable_any`].
    pub fn join_group(group: SocketAddrV4, interface: Ipv4Addr) -> io::Result<Self> {
        if !group.ip().is_multicast() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{group} is not an IPv4 multicast group (224.0.0.0/4)"),
            ));
        }
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        setsockopt_int(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: group.port().to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(*group.ip()).to_be() },
            sin_zero: [0; 8],
        };
        // SAFETY: `addr` is a live sockaddr_in and the length is its size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::from_ref(&addr).cast(),
                mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let socket = UdpSocket::from(fd);
        socket.join_multicast_v4(group.ip(), &interface)?;
        socket.set_nonblocking(true)?;
        BatchSocket::from_std(socket)
    }

    /// Prepares this (IPv4) socket to send to multicast groups: out of the
    /// interface that owns its bound address (so a switch on 127.0.0.1
    /// reaches listeners on loopback without a multicast route), looped
    /// back to listeners on this host, and kept to the local network
    /// (TTL 1). Returns `Ok(false)` for an IPv6 socket, which cannot send
    /// to an IPv4 group.
    pub fn enable_multicast_send(&self) -> io::Result<bool> {
        let SocketAddr::V4(local) = self.local_addr()? else { return Ok(false) };
        let std = self.as_std();
        std.set_multicast_loop_v4(true)?;
        std.set_multicast_ttl_v4(1)?;
        if !local.ip().is_unspecified() {
            let iface = libc::in_addr { s_addr: u32::from(*local.ip()).to_be() };
            // SAFETY: `iface` is a live in_addr and the length is its size.
            let r = unsafe {
                libc::setsockopt(
                    std.as_raw_fd(),
                    libc::IPPROTO_IP,
                    libc::IP_MULTICAST_IF,
                    std::ptr::from_ref(&iface).cast(),
                    mem::size_of::<libc::in_addr>() as libc::socklen_t,
                )
            };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::socket::wait_readable_any;
    use std::time::Duration;
    use crate::{RecvBatch, SendBatch};

    /// One datagram sent to a group on loopback reaches every socket that
    /// joined it, once each, and nothing else does.
    #[test]
    fn one_send_reaches_every_listener_on_loopback() {
        let probe = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = probe.local_addr().unwrap().port();
        drop(probe);
        let group = SocketAddrV4::new(Ipv4Addr::new(239, 77, 1, 9), port);
        let listeners: Vec<_> = (0..3).map(|_| BatchSocket::join_group(group, Ipv4Addr::LOCALHOST).unwrap()).collect();
        let bystander = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        bystander.set_nonblocking(true).unwrap();

        let sender = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        assert!(sender.enable_multicast_send().unwrap());
        let mut tx = SendBatch::new(8);
        for i in 0..5u8 {
            tx.push_copy(SocketAddr::V4(group), &[i; 100]);
        }
        assert_eq!(sender.send_batch(&mut tx).unwrap(), 5);

        for l in &listeners {
            let mut rx = RecvBatch::new(16, 2048);
            let mut got = Vec::new();
            for _ in 0..50 {
                let ready = wait_readable_any(&[&bystander, l], Duration::from_millis(100)).unwrap();
                assert_eq!(ready & 1, 0, "the bystander hears nothing");
                if ready == 2 {
                    l.recv_batch(&mut rx).unwrap();
                    got.extend(rx.iter().map(|(_, d)| d[0]));
                }
                if got.len() == 5 {
                    break;
                }
            }
            assert_eq!(got, vec![0, 1, 2, 3, 4]);
            assert_eq!(l.recv_batch(&mut rx).unwrap(), 0, "no duplicates");
        }
        let mut rx = RecvBatch::new(16, 2048);
        assert_eq!(bystander.recv_batch(&mut rx).unwrap(), 0);
    }

    #[test]
    fn a_unicast_address_is_not_a_group() {
        let err = BatchSocket::join_group("127.0.0.1:4000".parse().unwrap(), Ipv4Addr::LOCALHOST).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("not an IPv4 multicast group"));
        let v6 = BatchSocket::bind("[::1]:0".parse().unwrap()).unwrap();
        assert!(!v6.enable_multicast_send().unwrap());
    }
}
