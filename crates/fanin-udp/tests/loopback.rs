//! Real sockets on loopback: what goes into a `SendBatch` comes out of a
//! `RecvBatch` unchanged and in order, with and without GSO/GRO.
//!
//! The GSO size fallback (segment larger than the path MTU) cannot be hit
//! on a 64 KiB-MTU loopback. To exercise it, run the suite as root in a
//! private network namespace with a small loopback MTU:
//!
//! ```text
//! cargo test -p fanin-udp --no-run   # note the tests/loopback.rs binary
//! unshare -n sh -c 'ip link set lo up mtu 1500 && target/debug/deps/loopback-<hash>'
//! ```

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use fanin_udp::{BatchSocket, RecvBatch, SendBatch, GRO_SLOT_SIZE};

const V4: &str = "127.0.0.1:0";
const V6: &str = "[::1]:0";

fn bind(addr: &str) -> Option<BatchSocket> {
    match BatchSocket::bind(addr.parse().unwrap()) {
        Ok(s) => {
            s.set_buffer_sizes(8 << 20, 8 << 20).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            Some(s)
        }
        Err(e) => {
            eprintln!("skipping: cannot bind {addr}: {e}");
            None
        }
    }
}

/// Deterministic payload for datagram `seq`, with the sequence number in
/// front when it fits, so reordering or mixing would show.
fn payload(seq: usize, len: usize) -> Vec<u8> {
    let mut p: Vec<u8> = (0..len).map(|i| (seq * 31 + i * 7) as u8).collect();
    if len >= 4 {
        p[..4].copy_from_slice(&(seq as u32).to_be_bytes());
    }
    p
}

/// Receives until `expected` datagrams arrived; panics after a 2 s timeout.
fn recv_exactly(
    sock: &BatchSocket,
    batch: &mut RecvBatch,
    expected: usize,
) -> (Vec<(SocketAddr, Vec<u8>)>, usize) {
    let mut got = Vec::new();
    let mut slots = 0;
    while got.len() < expected {
        let n = sock.recv_batch(batch).unwrap();
        assert!(
            n > 0,
            "timed out after {} of {expected} datagrams",
            got.len()
        );
        assert_eq!(batch.iter().count(), n);
        assert_eq!(batch.truncated(), 0);
        slots += batch.slots_used();
        got.extend(batch.iter().map(|(a, p)| (a, p.to_vec())));
    }
    assert_eq!(got.len(), expected, "more datagrams than sent");
    (got, slots)
}

/// Sends `sizes` in batches of `batch_len` from `tx` to `rx`, receiving each
/// batch before the next so no socket buffer can overflow, and checks every
/// datagram. Returns the total number of receive slots used.
fn exchange(
    tx: &BatchSocket,
    rx: &BatchSocket,
    rx_batch: &mut RecvBatch,
    gso: bool,
    sizes: &[usize],
    batch_len: usize,
) -> usize {
    let dest = rx.local_addr().unwrap();
    let src = tx.local_addr().unwrap();
    let mut out = SendBatch::new(batch_len);
    out.set_gso(gso);
    let mut slots = 0;
    for (chunk_index, chunk) in sizes.chunks(batch_len).enumerate() {
        let base = chunk_index * batch_len;
        for (i, &len) in chunk.iter().enumerate() {
            let p = payload(base + i, len);
            if i % 2 == 0 {
                out.push_copy(dest, &p);
            } else {
                out.push(dest, len).copy_from_slice(&p);
            }
        }
        assert_eq!(out.len(), chunk.len());
        assert_eq!(tx.send_batch(&mut out).unwrap(), chunk.len());
        assert!(out.is_empty(), "send_batch must clear the batch");
        let (got, s) = recv_exactly(rx, rx_batch, chunk.len());
        slots += s;
        for (i, (from, bytes)) in got.iter().enumerate() {
            assert_eq!(*from, src);
            assert_eq!(bytes, &payload(base + i, chunk[i]), "datagram {}", base + i);
        }
    }
    slots
}

fn varying_sizes(n: usize) -> Vec<usize> {
    (0..n).map(|i| (i * 37) % 1473).collect()
}

fn round_trip(addr: &str) {
    let (Some(a), Some(b)) = (bind(addr), bind(addr)) else {
        return;
    };
    let mut rx = RecvBatch::new(64, 2048);
    let sizes = varying_sizes(2000);
    assert!(sizes.contains(&0), "zero-length datagrams are covered");
    exchange(&a, &b, &mut rx, false, &sizes, 64);
    // And back, with a different batch size.
    exchange(&b, &a, &mut rx, false, &sizes, 200);
}

#[test]
fn round_trip_ipv4() {
    round_trip(V4);
}

#[test]
fn round_trip_ipv6() {
    round_trip(V6);
}

#[test]
fn partial_batches() {
    let (Some(tx), Some(rx)) = (bind(V4), bind(V4)) else {
        return;
    };
    // Receive batch smaller than what is queued: several receives drain it.
    let mut small = RecvBatch::new(8, 2048);
    let sizes = [100; 20];
    let dest = rx.local_addr().unwrap();
    let mut out = SendBatch::new(4); // pushing beyond capacity grows it
    for (i, &len) in sizes.iter().enumerate() {
        out.push_copy(dest, &payload(i, len));
    }
    assert!(out.is_full());
    assert_eq!(tx.send_batch(&mut out).unwrap(), 20);
    let mut counts = Vec::new();
    let mut seq = 0;
    while seq < 20 {
        let n = rx.recv_batch(&mut small).unwrap();
        assert!((1..=8).contains(&n));
        counts.push(n);
        for (_, p) in &small {
            assert_eq!(p, payload(seq, 100));
            seq += 1;
        }
    }
    assert!(
        counts.len() >= 3,
        "capacity 8 cannot take 20 at once: {counts:?}"
    );

    // A batch of one, and an empty batch (a no-op).
    exchange(&tx, &rx, &mut small, false, &[5], 1);
    assert_eq!(tx.send_batch(&mut SendBatch::new(4)).unwrap(), 0);
}

#[test]
fn timeout_returns_zero_promptly() {
    let Some(s) = bind(V4) else { return };
    let mut rx = RecvBatch::new(16, 2048);
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let t = Instant::now();
    assert_eq!(s.recv_batch(&mut rx).unwrap(), 0);
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(40),
        "returned early: {waited:?}"
    );
    assert!(
        waited < Duration::from_millis(1000),
        "returned late: {waited:?}"
    );
    assert!(rx.is_empty() && rx.iter().next().is_none());

    s.set_nonblocking(true).unwrap();
    let t = Instant::now();
    assert_eq!(s.recv_batch(&mut rx).unwrap(), 0);
    assert!(t.elapsed() < Duration::from_millis(50));
}

#[test]
fn oversized_datagrams_are_dropped_and_counted() {
    let (Some(tx), Some(rx)) = (bind(V4), bind(V4)) else {
        return;
    };
    let dest = rx.local_addr().unwrap();
    let mut out = SendBatch::new(4);
    out.push_copy(dest, &payload(0, 50));
    out.push_copy(dest, &payload(1, 101));
    out.push_copy(dest, &payload(2, 100));
    assert_eq!(tx.send_batch(&mut out).unwrap(), 3);
    let mut batch = RecvBatch::new(8, 100);
    let mut got = Vec::new();
    let mut truncated = 0;
    while got.len() + truncated < 3 {
        assert!(rx.recv_batch(&mut batch).unwrap() > 0 || batch.truncated() > 0);
        truncated += batch.truncated();
        got.extend(batch.iter().map(|(_, p)| p.to_vec()));
    }
    assert_eq!(truncated, 1);
    assert_eq!(got, vec![payload(0, 50), payload(2, 100)]);
}

#[test]
fn bad_destination_is_dropped_but_the_rest_are_sent() {
    let (Some(tx), Some(rx)) = (bind(V4), bind(V4)) else {
        return;
    };
    let dest = rx.local_addr().unwrap();
    let v6_dest: SocketAddr = "[2001:db8::1]:9".parse().unwrap();
    let mut out = SendBatch::new(4);
    out.push_copy(dest, b"first");
    out.push_copy(v6_dest, b"cannot go out of an IPv4 socket");
    out.push_copy(dest, b"third");
    assert_eq!(tx.send_batch(&mut out).unwrap(), 2);
    let mut batch = RecvBatch::new(8, 2048);
    let (got, _) = recv_exactly(&rx, &mut batch, 2);
    assert_eq!(got[0].1, b"first");
    assert_eq!(got[1].1, b"third");

    // Nothing sendable at all: the error comes back.
    out.push_copy(v6_dest, b"x");
    assert!(tx.send_batch(&mut out).is_err());
    assert!(out.is_empty());
}

#[test]
fn dual_stack_socket_speaks_plain_ipv4_addresses() {
    let Some(v6) = bind("[::]:0") else { return };
    let Some(v4) = bind(V4) else { return };
    let v6_port = v6.local_addr().unwrap().port();
    let v6_dest: SocketAddr = ([127, 0, 0, 1], v6_port).into();
    let mut out = SendBatch::new(1);
    out.push_copy(v6_dest, b"ping");
    if v4.send_batch(&mut out).is_err() {
        eprintln!("skipping: IPv6 socket is not dual-stack here");
        return;
    }
    let mut batch = RecvBatch::new(4, 2048);
    let (got, _) = recv_exactly(&v6, &mut batch, 1);
    // Source comes back as plain IPv4, not ::ffff:127.0.0.1 ...
    assert_eq!(got[0].0, v4.local_addr().unwrap());
    // ... and replying to it from the IPv6 socket works.
    out.push_copy(got[0].0, b"pong");
    assert_eq!(v6.send_batch(&mut out).unwrap(), 1);
    let (got, _) = recv_exactly(&v4, &mut batch, 1);
    assert_eq!(got[0], (v6_dest, b"pong".to_vec()));
}

/// Sizes that exercise GSO runs: equal lengths with a short tail, runs longer
/// than 64 segments, runs hitting the byte limit, lone and empty datagrams.
fn gso_sizes() -> Vec<usize> {
    let mut sizes = Vec::new();
    sizes.extend(std::iter::repeat(1000).take(40));
    sizes.push(300);
    sizes.extend(std::iter::repeat(1200).take(10));
    sizes.extend(std::iter::repeat(500).take(150));
    sizes.extend(std::iter::repeat(8000).take(20));
    sizes.push(0);
    sizes.push(7);
    sizes.extend(std::iter::repeat(1472).take(33));
    sizes.extend(varying_sizes(60));
    sizes
}

fn gso_pair(addr: &str) -> Option<(BatchSocket, BatchSocket)> {
    let (tx, rx) = (bind(addr)?, bind(addr)?);
    if !tx.gso_supported() {
        eprintln!("skipping: kernel lacks UDP GSO");
        return None;
    }
    Some((tx, rx))
}

fn gso_to_gro(addr: &str) {
    let Some((tx, rx)) = gso_pair(addr) else {
        return;
    };
    if !rx.enable_gro().unwrap() {
        eprintln!("skipping: kernel lacks UDP GRO");
        return;
    }
    let mut small = RecvBatch::new(8, 2048);
    assert!(
        rx.recv_batch(&mut small).is_err(),
        "small slots rejected under GRO"
    );
    let mut batch = RecvBatch::new(32, GRO_SLOT_SIZE);
    let sizes = gso_sizes();
    let slots = exchange(&tx, &rx, &mut batch, true, &sizes, 256);
    assert!(
        slots < sizes.len() / 2,
        "GRO should coalesce: {slots} slots for {} datagrams",
        sizes.len()
    );
}

#[test]
fn gso_send_gro_receive_ipv4() {
    gso_to_gro(V4);
}

#[test]
fn gso_send_gro_receive_ipv6() {
    gso_to_gro(V6);
}

#[test]
fn gso_send_to_socket_without_gro_delivers_single_datagrams() {
    let Some((tx, rx)) = gso_pair(V4) else { return };
    let mut batch = RecvBatch::new(64, 9000);
    let sizes = gso_sizes();
    let slots = exchange(&tx, &rx, &mut batch, true, &sizes, 256);
    assert_eq!(
        slots,
        sizes.len(),
        "without GRO each datagram has its own slot"
    );
}

#[test]
fn from_std_keeps_the_socket() {
    let std_sock = UdpSocket::bind(V4).unwrap();
    let addr = std_sock.local_addr().unwrap();
    let s = BatchSocket::from_std(std_sock).unwrap();
    assert_eq!(s.local_addr().unwrap(), addr);
    assert_eq!(s.as_std().local_addr().unwrap(), addr);
    s.set_buffer_sizes(1 << 20, 1 << 20).unwrap();
    let (r, w) = s.buffer_sizes().unwrap();
    assert!(r >= 1 << 20 && w >= 1 << 20, "got {r}/{w}");
}

/// SO_MEMINFO sees datagrams waiting, and the kernel's drops once the
/// (small) receive buffer is full: the two signals the switch daemon uses.
#[test]
fn receive_queue_reports_backlog_and_drops() {
    let rx = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    rx.set_buffer_sizes(64 * 1024, 64 * 1024).unwrap();
    let empty = rx.receive_queue().unwrap();
    assert_eq!((empty.queued_bytes, empty.drops), (0, 0));
    assert!(empty.limit_bytes >= 4096, "{empty:?}");
    let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let dest = rx.local_addr().unwrap();
    tx.send_to(&[7u8; 1000], dest).unwrap();
    let one = rx.receive_queue().unwrap();
    assert!(one.queued_bytes >= 1000, "{one:?}");
    // far more than the buffer holds: the kernel must drop some
    for _ in 0..(empty.limit_bytes / 1000 + 64) {
        tx.send_to(&[7u8; 1000], dest).unwrap();
    }
    let full = rx.receive_queue().unwrap();
    assert!(full.drops > 0, "{full:?}");
    assert!(full.queued_bytes <= full.limit_bytes + 4096, "{full:?}");
}

/// A switch's fan-out: each "result" is pushed once and aliased to the
/// other receivers, interleaved as a switch queues them (result 0 to every
/// member, then result 1, ...). Regrouping by destination for GSO moves
/// entries, not bytes, so every receiver must still get exactly its
/// datagrams, in order, with the right bytes; with and without GSO.
fn fan_out(gso: bool) {
    let Some(tx) = bind(V4) else { return };
    let rxs: Vec<BatchSocket> = (0..3).filter_map(|_| bind(V4)).collect();
    if gso && !tx.gso_supported() {
        eprintln!("skipping: kernel lacks UDP GSO");
        return;
    }
    let dests: Vec<SocketAddr> = rxs.iter().map(|r| r.local_addr().unwrap()).collect();
    let mut out = SendBatch::new(512);
    out.set_gso(gso);
    assert!(!out.push_alias(dests[0]), "nothing to alias in an empty batch");
    // 100 results of equal size, a short one, then mixed sizes (a GSO run
    // ends at the short one, aliases included).
    let sizes: Vec<usize> = (0..100).map(|_| 4120).chain([333]).chain((0..40).map(|i| 100 + i * 13)).collect();
    for (seq, &len) in sizes.iter().enumerate() {
        out.push_copy(dests[0], &payload(seq, len));
        for d in &dests[1..] {
            assert!(out.push_alias(*d));
        }
    }
    assert_eq!(out.len(), sizes.len() * dests.len());
    assert_eq!(tx.send_batch(&mut out).unwrap(), sizes.len() * dests.len());
    for rx in &rxs {
        let mut batch = RecvBatch::new(64, 9000);
        let (got, _) = recv_exactly(rx, &mut batch, sizes.len());
        for (seq, (_, bytes)) in got.iter().enumerate() {
            assert_eq!(bytes, &payload(seq, sizes[seq]), "datagram {seq}");
        }
    }
}

#[test]
fn fan_out_of_aliased_datagrams_with_gso() {
    fan_out(true);
}

#[test]
fn fan_out_of_aliased_datagrams_without_gso() {
    fan_out(false);
}
