//! ECN on real sockets (loopback): a receiver that enabled ECN reads each
//! datagram's codepoint, with and without GRO, whatever mix of marked and
//! unmarked datagrams one batch holds. A sender standing for a path that
//! marked its datagrams sets CE itself.

use std::net::SocketAddr;
use std::time::Duration;

use fanin_udp::ecn::{CE, ECT_0, NOT_ECT};
use fanin_udp::{BatchSocket, RecvBatch, SendBatch, GRO_SLOT_SIZE};

fn bind(addr: &str) -> Option<BatchSocket> {
    match BatchSocket::bind(addr.parse().unwrap()) {
        Ok(s) => {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            Some(s)
        }
        Err(e) => {
            eprintln!("skipping: cannot bind {addr}: {e}");
            None
        }
    }
}

/// Sends `count` datagrams of `len` bytes (byte 0 = their index) with
/// `codepoint`, GSO on, from `tx` to `dest`.
fn send(tx: &BatchSocket, dest: SocketAddr, codepoint: u8, first: u8, count: u8, len: usize) {
    tx.set_ecn_codepoint(codepoint).unwrap();
    let mut batch = SendBatch::new(64);
    batch.set_gso(tx.gso_supported());
    for i in first..first + count {
        batch.push(dest, len).fill(i);
    }
    tx.send_batch(&mut batch).unwrap();
}

/// Receives `count` datagrams: (first byte, CE?), and the receive slots
/// they took (fewer than `count` when GRO coalesced some).
fn receive(rx: &BatchSocket, batch: &mut RecvBatch, count: usize) -> (Vec<(u8, bool)>, usize) {
    let (mut got, mut slots) = (Vec::new(), 0);
    while got.len() < count {
        assert!(rx.recv_batch(batch).unwrap() > 0, "timed out after {} of {count}", got.len());
        slots += batch.slots_used();
        got.extend(batch.iter_ecn().map(|(_, bytes, ce)| (bytes[0], ce)));
    }
    (got, slots)
}

fn marks_are_read(addr: &str, gro: bool) {
    let (Some(tx), Some(rx)) = (bind(addr), bind(addr)) else { return };
    rx.enable_ecn().unwrap();
    if gro {
        assert!(rx.enable_gro().unwrap(), "GRO on this kernel");
    }
    let mut batch = RecvBatch::new(16, if gro { GRO_SLOT_SIZE } else { 2048 });
    let dest = rx.local_addr().unwrap();
    // unmarked (ECT(0), what an ECN sender sends), marked, not ECN-capable,
    // marked again: queued together, read in one or two batches
    send(&tx, dest, ECT_0, 0, 4, 1000);
    send(&tx, dest, CE, 4, 4, 1000);
    send(&tx, dest, NOT_ECT, 8, 2, 1000);
    send(&tx, dest, CE, 10, 1, 1000);
    let (got, slots) = receive(&rx, &mut batch, 11);
    let expected: Vec<(u8, bool)> = (0..11).map(|i| (i, (4..8).contains(&i) || i == 10)).collect();
    assert_eq!(got, expected);
    if gro {
        // each run of one codepoint was one GSO send, handed over whole: a
        // slot's mark stands for several datagrams
        assert!(slots < 11, "GRO coalesced nothing ({slots} slots)");
    }
    // the plain iterator sees the same datagrams
    assert_eq!(batch.iter().count(), batch.iter_ecn().count());
}

#[test]
fn a_receiver_reads_which_datagrams_arrived_ce_marked_v4() {
    marks_are_read("127.0.0.1:0", false);
}

#[test]
fn a_receiver_reads_which_datagrams_arrived_ce_marked_v4_with_gro() {
    marks_are_read("127.0.0.1:0", true);
}

#[test]
fn a_receiver_reads_which_datagrams_arrived_ce_marked_v6() {
    marks_are_read("[::1]:0", false);
}

#[test]
fn without_enable_ecn_nothing_reads_as_marked() {
    let (Some(tx), Some(rx)) = (bind("127.0.0.1:0"), bind("127.0.0.1:0")) else { return };
    let mut batch = RecvBatch::new(16, 2048);
    send(&tx, rx.local_addr().unwrap(), CE, 0, 3, 100);
    assert_eq!(receive(&rx, &mut batch, 3).0, vec![(0, false), (1, false), (2, false)]);
}

/// A sender whose socket sends ECT(0) gives some datagrams Not-ECT and
/// one CE of their own (set_last_ecn): in one sendmmsg, GSO on, the
/// receiver reads each datagram's codepoint (CE alone is visible as a
/// mark; Not-ECT datagrams would not be marked by a queue). `dest` is the
/// receiver's address as the sender names it.
fn own_codepoints(tx_addr: &str, rx_addr: &str, dest: impl Fn(SocketAddr) -> SocketAddr) {
    let (Some(tx), Some(rx)) = (bind(tx_addr), bind(rx_addr)) else { return };
    tx.enable_ecn().unwrap();
    rx.enable_ecn().unwrap();
    let dest = dest(rx.local_addr().unwrap());
    let mut batch = SendBatch::new(64);
    batch.set_gso(tx.gso_supported());
    let codepoints = [None, None, Some(NOT_ECT), Some(NOT_ECT), Some(CE), None, Some(ECT_0)];
    for (i, cp) in codepoints.iter().enumerate() {
        batch.push(dest, 500).fill(i as u8);
        if let Some(cp) = cp {
            batch.set_last_ecn(*cp);
        }
    }
    tx.send_batch(&mut batch).unwrap();
    let mut rb = RecvBatch::new(16, 2048);
    let (got, _) = receive(&rx, &mut rb, codepoints.len());
    assert_eq!(got, (0..7u8).map(|i| (i, i == 4)).collect::<Vec<_>>());
    // and the codepoints themselves, from a second send read raw
    let mut batch = SendBatch::new(8);
    batch.push(dest, 10).fill(9);
    batch.set_last_ecn(NOT_ECT);
    batch.push(dest, 10).fill(8);
    tx.send_batch(&mut batch).unwrap();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        assert!(rx.recv_batch(&mut rb).unwrap() > 0);
        seen.extend(rb.iter_codepoints().map(|(_, b, cp)| (b[0], cp)));
    }
    assert_eq!(seen, vec![(9, NOT_ECT), (8, ECT_0)], "set per datagram, else the socket's ECT(0)");
}

#[test]
fn each_datagram_of_one_batch_leaves_with_its_own_codepoint_v4() {
    own_codepoints("127.0.0.1:0", "127.0.0.1:0", |a| a);
}

#[test]
fn each_datagram_of_one_batch_leaves_with_its_own_codepoint_v6() {
    // IPV6_TCLASS control messages
    own_codepoints("[::1]:0", "[::1]:0", |a| a);
}

#[test]
fn a_dual_stack_socket_gives_ipv4_peers_their_own_codepoints() {
    // an IPv6 socket bound to [::] sending to an IPv4 peer: the kernel takes
    // the IPv4 path and reads IP_TOS, not IPV6_TCLASS; named plainly and
    // v4-mapped
    own_codepoints("[::]:0", "127.0.0.1:0", |a| SocketAddr::new([127, 0, 0, 1].into(), a.port()));
    own_codepoints("[::]:0", "127.0.0.1:0", |a| {
        SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped().into(), a.port())
    });
}

#[test]
fn a_dual_stack_receiver_reads_the_marks_of_ipv4_datagrams() {
    // bound to [::], it gets IPv4 datagrams with an IP_TOS control message
    // (not IPV6_TCLASS): enable_ecn asks for both
    let (Some(tx), Some(rx)) = (bind("127.0.0.1:0"), bind("[::]:0")) else { return };
    rx.enable_ecn().unwrap();
    let dest = SocketAddr::new([127, 0, 0, 1].into(), rx.local_addr().unwrap().port());
    send(&tx, dest, ECT_0, 0, 2, 300);
    send(&tx, dest, CE, 2, 2, 300);
    let mut batch = RecvBatch::new(16, 2048);
    let (got, _) = receive(&rx, &mut batch, 4);
    assert_eq!(got, vec![(0, false), (1, false), (2, true), (3, true)]);
}
