//! Batched UDP socket I/O for Linux.
//!
//! Per-datagram `recvfrom`/`sendto` cap one core at a few hundred thousand
//! packets per second; almost all of that time is syscall overhead. This
//! crate moves datagrams in batches instead:
//!
//! - [`BatchSocket::recv_batch`] fills a [`RecvBatch`] with one `recvmmsg`;
//!   with [UDP GRO](BatchSocket::enable_gro) one slot may hold many
//!   datagrams of a flow, which [`RecvBatch::iter`] splits back apart.
//! - [`BatchSocket::send_batch`] drains a [`SendBatch`] with `sendmmsg`;
//!   with [UDP GSO](SendBatch::set_gso) a run of equal-sized datagrams to
//!   one destination becomes one message the kernel segments.
//!
//! Receivers see the same datagrams whether or not either side uses GSO or
//! GRO, so both are pure optimisations that can be switched independently.
//!
//! The crate knows nothing of what the datagrams carry: it is the I/O layer
//! beneath a protocol, never part of one. It is Linux-only and allocates
//! nothing per datagram; batches are allocated once and reused.
//!
//! ```no_run
//! use fanin_udp::{BatchSocket, RecvBatch, SendBatch};
//! # fn main() -> std::io::Result<()> {
//! let sock = BatchSocket::bind("127.0.0.1:9000".parse().unwrap())?;
//! sock.set_read_timeout(Some(std::time::Duration::from_millis(10)))?;
//! let mut rx = RecvBatch::new(64, 2048);
//! let mut tx = SendBatch::new(64);
//! tx.set_gso(sock.gso_supported());
//! loop {
//!     sock.recv_batch(&mut rx)?;
//!     for (from, payload) in rx.iter() {
//!         tx.push_copy(from, payload); // echo
//!     }
//!     sock.send_batch(&mut tx)?;
//! }
//! # }
//! ```

#[cfg(not(target_os = "linux"))]
compile_error!("fanin-udp uses Linux-only syscalls (recvmmsg, sendmmsg, UDP GSO/GRO)");

pub mod ecn;
mod multicast;
mod mtu;
mod recv;
mod send;
mod sockaddr;
mod socket;
mod unreachable;

pub use mtu::{bound_mtu, interfaces, Interface};
pub use recv::{RecvBatch, RecvIter, GRO_SLOT_SIZE};
pub use send::{SendBatch, ECN_SOCKET, MAX_GSO_BYTES, MAX_GSO_SEGMENTS};
pub use socket::{wait_readable_any, BatchSocket, ReceiveQueue};
pub use unreachable::Unreachable;

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket is shared between I/O threads; batches move between them.
    #[test]
    fn thread_safety_contract() {
        fn shared<T: Send + Sync>() {}
        fn movable<T: Send>() {}
        shared::<BatchSocket>();
        movable::<RecvBatch>();
        movable::<SendBatch>();
    }
}
