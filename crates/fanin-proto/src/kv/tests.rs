//! Exact traces of the key-value machines: every reliability case of ASK
//! §3.3, shadow-copy swaps (§3.4), coalesced keys (§3.2.3) and bad input.

use std::time::Duration;

use fanin_wire::kv::{
    emit_key_fragment, Nack, NackReason, Packet, Repr, FLAG_BY_SWITCH, FLAG_FINAL, FLAG_KEY_FRAGMENT, FRAGMENT_FIXED,
    HEADER_LEN, LONG_TUPLE_FIXED,
};
use fanin_wire::MessageType;

use super::loopback::{Direction, LinkConfig, Loopback, Node, RunOutcome};
use super::*;
use crate::time::Time;
use crate::transmit::VecTransmit;

const TASK: u32 = 7;
const R: Node = Node::Receiver;
const S0: Node = Node::Sender(0);

fn t(us: u64) -> Time {
    Time::from_nanos(us * 1_000)
}

/// The `n`-th key (of the form "k<i>") that the partition puts in `slot`.
fn key_in_slot(layout: &Layout, slot: u8, n: usize) -> Vec<u8> {
    (0..)
        .map(|i| format!("k{i}").into_bytes())
        .filter(|k| matches!(layout.classify(k), KeyClass::Short { slot: s, .. } if s == slot))
        .nth(n)
        .unwrap()
}

fn data_packet(layout: &Layout, seq: u32, tuples: &[(&[u8], i64)]) -> Vec<u8> {
    let repr = Repr { slot_count: layout.slot_count() as u8, ..Repr::new(MessageType::KvData, TASK, 1, seq) };
    let mut buf = vec![0u8; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    let mut bitmap = 0;
    for (key, value) in tuples {
        match layout.classify(key) {
            KeyClass::Short { slot, part } => {
                p.set_slot(slot as usize, part.to_be_bytes(), *value);
                bitmap |= 1 << slot;
            }
            KeyClass::Medium { group, first_slot } => {
                let parts = encode_parts(key, layout.medium_parts as usize);
                for (j, part) in parts.iter().enumerate() {
                    let v = if j + 1 == parts.len() { *value } else { 0 };
                    p.set_slot(first_slot as usize + j, part.to_be_bytes(), v);
                }
                bitmap |= layout.group_mask(group);
            }
            KeyClass::Long => panic!("long key in a data packet"),
        }
    }
    p.set_bitmap(bitmap);
    buf
}

fn switch_with(layout: Layout, aa_size: u32, shadow: bool) -> KvSwitch<Node> {
    let mut sw = KvSwitch::new(KvSwitchConfig::default());
    let mut spec = KvTaskSpec::new(TASK, R, layout, aa_size);
    spec.shadow_copies = shadow;
    spec.window = 4;
    sw.add_task(Time::ZERO, spec).unwrap();
    sw
}

/// What the switch emitted for one datagram: (to, type, seq, bitmap).
fn feed(sw: &mut KvSwitch<Node>, from: Node, bytes: &[u8]) -> Vec<(Node, MessageType, u32, u64)> {
    let mut out = VecTransmit::new();
    sw.handle_datagram(Time::ZERO, from, bytes, &mut out);
    out.drain()
        .map(|(to, b)| {
            let p = Packet::new_checked(&b[..]).expect("switch emits valid packets");
            let bitmap = if p.msg_type() == MessageType::KvData { p.bitmap() } else { 0 };
            (to, p.msg_type(), p.seq(), bitmap)
        })
        .collect()
}

// ---- the compact `seen` (§3.3, equation 8) ----------------------------------

#[test]
fn compact_seen_even_segment_cases_1_and_2() {
    let mut w = SeenWindow::new(4);
    assert_eq!(w.observe(1), Observation::New); // case 1: bit 0 -> set, returns 0
    assert!(w.seen_bit(1));
    w.record(1, 0b10);
    assert_eq!(w.observe(1), Observation::Duplicate { pkt_state: 0b10 }); // case 2
    assert!(w.seen_bit(1));
}

#[test]
fn compact_seen_odd_segment_cases_3_and_4() {
    let mut w = SeenWindow::new(4);
    for s in 0..4 {
        assert_eq!(w.observe(s), Observation::New);
    }
    // seq 5 is in odd segment 1, offset 1: the bit is 1 from seq 1.
    assert_eq!(w.observe(5), Observation::New); // case 3: clr_bitc returns !1 = 0
    assert!(!w.seen_bit(1));
    w.record(5, 0);
    assert_eq!(w.observe(5), Observation::Duplicate { pkt_state: 0 }); // case 4
    assert!(!w.seen_bit(1));
    // Back in an even segment, the cleared bit means "new" again.
    for s in [4, 6, 7, 8, 9] {
        assert_eq!(w.observe(s), Observation::New, "seq {s}");
    }
}

#[test]
fn stale_packet_cannot_overwrite_seen() {
    // The paper's corner case: window at [2W, 3W), a packet with seq W
    // arrives late. It maps to the same bit as 3W and would flip it.
    let mut w = SeenWindow::new(4);
    for s in 0..=10 {
        assert_eq!(w.observe(s), Observation::New);
    }
    let bit = w.seen_bit(0);
    assert_eq!(w.observe(4), Observation::Stale); // 4 <= max_seq(10) - W
    assert_eq!(w.seen_bit(0), bit);
    assert_eq!(w.observe(6), Observation::Stale);
    assert_eq!(w.observe(7), Observation::Duplicate { pkt_state: 0 }); // 7 > 10 - 4
    // Beyond the window (not in the paper): refused, bits untouched.
    assert_eq!(w.observe(15), Observation::BeyondWindow);
    assert_eq!(w.observe(12), Observation::New);
    assert_eq!(SeenWindow::new(4).observe(4), Observation::BeyondWindow);
}

// ---- §3.3's partially aggregated retransmission ----------------------------

#[test]
fn partially_aggregated_retransmission_carries_only_the_rest() {
    let layout = Layout::short_only(2);
    let (a, b, x) = (key_in_slot(&layout, 0, 0), key_in_slot(&layout, 1, 0), key_in_slot(&layout, 1, 1));
    // One aggregator per AA: x takes AA1's, so b collides there.
    let mut sw = switch_with(layout, 1, false);
    assert_eq!(feed(&mut sw, S0, &data_packet(&layout, 0, &[(&x, 5)])), vec![(S0, MessageType::KvAck, 0, 0)]);
    let pkt1 = data_packet(&layout, 1, &[(&a, 1), (&b, 1)]);
    // First pass: (a,1) absorbed, (b,1) forwarded with bitmap 0b10.
    assert_eq!(feed(&mut sw, S0, &pkt1), vec![(R, MessageType::KvData, 1, 0b10)]);
    // ... and lost. The sender retransmits the original (bitmap 0b11); the
    // switch must not add (a,1) again and must still carry (b,1) on.
    assert_eq!(feed(&mut sw, S0, &pkt1), vec![(R, MessageType::KvData, 1, 0b10)]);
    let stats = sw.task_stats(TASK).unwrap();
    assert_eq!((stats.tuples_in, stats.tuples_aggregated), (3, 2));
    assert_eq!(sw.counters().duplicates, 1);
}

#[test]
fn fully_aggregated_retransmission_is_acked_not_added() {
    let layout = Layout::short_only(2);
    let a = key_in_slot(&layout, 0, 0);
    let mut sw = switch_with(layout, 4, false);
    let pkt = data_packet(&layout, 0, &[(&a, 3)]);
    assert_eq!(feed(&mut sw, S0, &pkt), vec![(S0, MessageType::KvAck, 0, 0)]);
    assert_eq!(feed(&mut sw, S0, &pkt), vec![(S0, MessageType::KvAck, 0, 0)]);
    assert_eq!(sw.task_stats(TASK).unwrap().tuples_aggregated, 1);
}

#[test]
fn receiver_dedups_and_acks_every_copy() {
    let layout = Layout::short_only(2);
    let b = key_in_slot(&layout, 1, 0);
    let mut rx = KvReceiver::new(ReceiverConfig::new(TASK, layout, 1, 1), Time::ZERO).unwrap();
    let pkt = data_packet(&layout, 3, &[(&b, 4)]);
    rx.handle_datagram(t(1), &pkt);
    rx.handle_datagram(t(2), &pkt);
    let mut out = VecTransmit::new();
    rx.poll_transmit(t(2), &mut out);
    let acks: Vec<_> = out.drain().map(|(_, b)| Packet::new_checked(&b[..]).map(|p| (p.msg_type(), p.seq())).unwrap()).collect();
    assert_eq!(acks, vec![(MessageType::KvAck, 3), (MessageType::KvAck, 3)]);
    assert_eq!(rx.results()[&b], Aggregate::of(4));
    assert_eq!(rx.stats().duplicate_packets, 1);
}

/// A data packet cut to fewer slots than the layout, straight to the
/// receiver's port (the switch refuses these): counted and dropped unread.
/// Reading it panicked the receiver's thread (a medium group's parts past
/// the packet's end), and with it every task of that daemon.
#[test]
fn a_data_packet_of_another_layout_is_counted_and_dropped_by_the_receiver() {
    let layout = Layout { short_slots: 16, medium_groups: 8, medium_parts: 2 };
    let mut rx = KvReceiver::new(ReceiverConfig::new(TASK, layout, 1, 1), Time::ZERO).unwrap();
    let repr = Repr { slot_count: 17, ..Repr::new(MessageType::KvData, TASK, 1, 0) };
    let mut pkt = vec![0u8; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut pkt[..]);
    repr.emit(&mut p);
    p.set_bitmap(1 << 16); // the first part of medium group 0, whose second is cut off
    rx.handle_datagram(t(1), &pkt);
    let mut out = VecTransmit::new();
    rx.poll_transmit(t(2), &mut out);
    assert!(out.datagrams.is_empty(), "no ACK: it was not read");
    assert_eq!(rx.stats().layout_mismatch, 1);
    assert_eq!(rx.stats().data_packets, 0);
    assert!(rx.results().is_empty());
}

#[test]
fn sender_does_not_retransmit_on_out_of_order_acks() {
    let layout = Layout::short_only(1);
    let mut cfg = SenderConfig::new(TASK, 1, layout);
    cfg.rto = Duration::from_micros(100);
    let mut tx = KvSender::new(cfg, Time::ZERO).unwrap();
    for i in 0..3 {
        tx.push(format!("k{i}").as_bytes(), 1).unwrap();
    }
    tx.finish();
    let mut out = VecTransmit::new();
    assert_eq!(tx.poll_transmit(Time::ZERO, &mut out), 3);
    out.drain();
    let ack = |seq: u32| {
        let mut b = vec![0u8; HEADER_LEN];
        Repr { flags: FLAG_BY_SWITCH, ..Repr::new(MessageType::KvAck, TASK, 1, seq) }.emit(&mut Packet::new_unchecked(&mut b[..]));
        b
    };
    tx.handle_datagram(t(10), &ack(2));
    tx.handle_datagram(t(11), &ack(1));
    assert_eq!(tx.poll_transmit(t(50), &mut out), 0, "out-of-order ACKs trigger nothing");
    assert_eq!(tx.poll_timeout(), Some(t(100)));
    assert_eq!(tx.poll_transmit(t(100), &mut out), 1, "seq 0's own timeout does");
    assert_eq!(Packet::new_checked(&out.datagrams[0].1[..]).unwrap().seq(), 0);
    assert_eq!(tx.stats().retransmissions, 1);
}

fn ack_by_switch(seq: u32) -> Vec<u8> {
    let mut b = vec![0u8; HEADER_LEN];
    Repr { flags: FLAG_BY_SWITCH, ..Repr::new(MessageType::KvAck, TASK, 1, seq) }.emit(&mut Packet::new_unchecked(&mut b[..]));
    b
}

/// docs/kv.md "Congestion": a channel starts with INITIAL_CWND packets
/// unacknowledged, not ASK's W; each ack opens one more (slow start); the
/// timeout follows the measured round trip; a packet whose timeout expires
/// halves the window once for its episode and is resent with a doubled
/// timeout; with congestion off the sender is ASK's (W at once, fixed rto).
#[test]
fn a_sender_opens_its_window_with_acks_and_halves_it_on_a_timeout() {
    let layout = Layout::short_only(1);
    let mut cfg = SenderConfig::new(TASK, 1, layout);
    cfg.window = 1024;
    cfg.rto = Duration::from_millis(20);
    cfg.max_burst = 4096;
    let mut tx = KvSender::new(cfg.clone(), Time::ZERO).unwrap();
    for i in 0..2000 {
        tx.push(format!("k{i}").as_bytes(), 1).unwrap();
    }
    tx.finish();
    let mut out = VecTransmit::new();
    assert_eq!(tx.poll_transmit(Time::ZERO, &mut out), INITIAL_CWND as usize, "the initial window, not W");
    out.drain();
    // 5 ms round trips: every ack opens one more packet and one for itself
    for seq in 0..INITIAL_CWND {
        tx.handle_datagram(t(5_000), &ack_by_switch(seq));
    }
    assert_eq!(tx.poll_transmit(t(5_000), &mut out), 2 * INITIAL_CWND as usize);
    out.drain();
    assert_eq!(tx.stats().cwnd, 2 * INITIAL_CWND);
    assert!(tx.stats().rto_us >= 5_000 && tx.stats().rto_us < 20_000, "measured: {}", tx.stats().rto_us);
    // seqs 32..96 are out; all but 40 are acknowledged at 10 ms
    for seq in INITIAL_CWND..3 * INITIAL_CWND {
        if seq != 40 {
            tx.handle_datagram(t(10_000), &ack_by_switch(seq));
        }
    }
    let sent = tx.poll_transmit(t(10_000), &mut out) as u32;
    out.drain();
    assert_eq!(tx.stats().cwnd, 4 * INITIAL_CWND - 1);
    assert_eq!(sent, 4 * INITIAL_CWND - 2, "the window counts unacknowledged packets, 40 among them");
    let acked_all = |tx: &mut KvSender, from: u32, to: u32, at: Time| {
        for seq in from..to {
            tx.handle_datagram(at, &ack_by_switch(seq));
        }
    };
    acked_all(&mut tx, 3 * INITIAL_CWND, 3 * INITIAL_CWND + sent, t(12_000));
    let w = tx.stats().cwnd;
    // 40's timeout: one resend, the window halved once, new packets up to it
    let deadline = tx.poll_timeout().unwrap();
    assert!(deadline <= t(5_000 + 20_000));
    let n = tx.poll_transmit(deadline, &mut out) as u32;
    assert_eq!(Packet::new_checked(&out.datagrams[0].1[..]).unwrap().seq(), 40);
    out.drain();
    assert_eq!(tx.stats().cwnd, w / 2);
    assert_eq!(n, w / 2, "the resend and new packets up to the halved window");
    assert_eq!(tx.stats().congestion.window_cuts, 1);
    // the resend waits twice the timeout (itself doubled until a new sample)
    let rto = Duration::from_micros(tx.stats().rto_us);
    let next = 3 * INITIAL_CWND + sent;
    acked_all(&mut tx, next, next + n - 1, deadline + Duration::from_millis(1));
    let seqs = |out: &mut VecTransmit<()>| -> Vec<u32> {
        out.drain().map(|(_, b)| Packet::new_checked(&b[..]).unwrap().seq()).collect()
    };
    tx.poll_transmit(deadline + (rto * 2 - Duration::from_micros(1)), &mut out);
    assert!(!seqs(&mut out).contains(&40), "not yet");
    tx.poll_transmit(deadline + rto * 2, &mut out);
    assert_eq!(seqs(&mut out)[0], 40);
    assert_eq!(tx.stats().retransmissions, 2);

    // ASK as it was: the whole window at once, the fixed timeout
    cfg.congestion = false;
    let mut ask = KvSender::new(cfg, Time::ZERO).unwrap();
    for i in 0..2000 {
        ask.push(format!("k{i}").as_bytes(), 1).unwrap();
    }
    ask.finish();
    assert_eq!(ask.poll_transmit(Time::ZERO, &mut out), 1024);
    assert_eq!(ask.poll_timeout(), Some(t(20_000)));
}

// ---- end to end over the loopback ------------------------------------------

struct Setup {
    layout: Layout,
    aa_size: u32,
    shadow: bool,
    senders: usize,
    swap_threshold: Option<u64>,
    window: u32,
    value_type: ValueType,
}

impl Setup {
    fn new(layout: Layout, aa_size: u32) -> Self {
        Self { layout, aa_size, shadow: true, senders: 1, swap_threshold: Some(4), window: 8, value_type: ValueType::Int64 }
    }

    fn build(&self, link: LinkConfig) -> Loopback {
        let mut sw = KvSwitch::new(KvSwitchConfig::default());
        let mut spec = KvTaskSpec::new(TASK, R, self.layout, self.aa_size);
        spec.shadow_copies = self.shadow;
        spec.window = self.window;
        spec.value_type = self.value_type;
        sw.add_task(Time::ZERO, spec).unwrap();
        let senders = (0..self.senders)
            .map(|i| {
                let mut c = SenderConfig::new(TASK, i as u16 + 1, self.layout);
                c.window = self.window;
                c.rto = Duration::from_micros(50);
                KvSender::new(c, Time::ZERO).unwrap()
            })
            .collect();
        let mut rc = ReceiverConfig::new(TASK, self.layout, self.aa_size, self.senders as u16);
        rc.shadow_copies = self.shadow;
        rc.swap_threshold = self.swap_threshold;
        rc.window = self.window;
        rc.rto = Duration::from_micros(50);
        rc.linger = Duration::from_millis(1);
        rc.value_type = self.value_type;
        Loopback::new(sw, senders, KvReceiver::new(rc, Time::ZERO).unwrap(), link)
    }
}

fn reference(streams: &[Vec<(Vec<u8>, i64)>]) -> KvResults {
    let mut m = KvResults::default();
    for s in streams {
        for (k, v) in s {
            m.entry(k.clone()).and_modify(|a| _ = a.merge(&Aggregate::of(*v), ValueType::Int64)).or_insert(Aggregate::of(*v));
        }
    }
    m
}

fn run(setup: &Setup, link: LinkConfig, streams: &[Vec<(Vec<u8>, i64)>]) -> Loopback {
    let mut lb = setup.build(link);
    lb.wait_for_release = true;
    for (s, stream) in lb.senders.iter_mut().zip(streams) {
        for (k, v) in stream {
            s.push(k, *v).unwrap();
        }
        s.finish();
    }
    assert_eq!(lb.run(Time::from_secs_f64(10.0)), RunOutcome::Finished);
    assert_eq!(lb.receiver.results(), &reference(streams));
    assert_eq!(lb.switch.memory_used(), 0, "the receiver released the region");
    assert_eq!(lb.switch.counters().rx_datagrams, lb.switch.counters().outcomes());
    lb
}

/// A float64 task over a lossy, duplicating link: every key class, swaps,
/// negative values. The values are multiples of 1/4 under 2^20, so every
/// sum is exact in any order and the result can be compared exactly with
/// the sums in f64; min and max must follow float order, not the order of
/// the bits (negative floats have larger bit patterns as integers).
#[test]
fn float64_tasks_sum_floats_in_the_switch_and_the_receiver() {
    let layout = Layout { short_slots: 3, medium_groups: 2, medium_parts: 2 };
    let mut setup = Setup::new(layout, 4);
    setup.value_type = ValueType::Float64;
    setup.senders = 2;
    let mut streams = vec![Vec::new(), Vec::new()];
    let mut expected: std::collections::HashMap<Vec<u8>, (f64, u64, f64, f64)> = Default::default();
    for i in 0..600i64 {
        let key = match i % 5 {
            0 | 1 => format!("s{}", i % 17),
            2 | 3 => format!("medium-{:04}", i % 23),
            _ => format!("a-long-key-that-bypasses-the-switch-{}", i % 7),
        }
        .into_bytes();
        let v = (i - 300) as f64 * 0.25;
        let e = expected.entry(key.clone()).or_insert((0.0, 0, f64::INFINITY, f64::NEG_INFINITY));
        *e = (e.0 + v, e.1 + 1, e.2.min(v), e.3.max(v));
        streams[(i % 2) as usize].push((key, float_bits(v)));
    }
    let link = LinkConfig { delay_ns: 2_000, jitter_ns: 30_000, loss: 0.05, duplicate: 0.05, seed: 11 };
    let mut lb = setup.build(link);
    lb.wait_for_release = true;
    for (s, stream) in lb.senders.iter_mut().zip(&streams) {
        for (k, v) in stream {
            s.push(k, *v).unwrap();
        }
        s.finish();
    }
    assert_eq!(lb.run(Time::from_secs_f64(10.0)), RunOutcome::Finished);
    assert!(lb.switch.counters().tuples_aggregated > 100, "the switch summed floats too");
    let got = lb.receiver.results();
    assert_eq!(got.len(), expected.len());
    for (key, &(sum, count, min, max)) in &expected {
        let a = got[key];
        let shown = String::from_utf8_lossy(key);
        assert_eq!((as_float(a.sum), a.count, as_float(a.min), as_float(a.max)), (sum, count, min, max), "{shown}");
    }
    assert_eq!(lb.receiver.stats().overflowed, 0);
}

#[test]
fn end_to_end_lossless_with_swaps_and_all_key_classes() {
    let layout = Layout { short_slots: 3, medium_groups: 2, medium_parts: 2 };
    let mut stream = Vec::new();
    for i in 0..400i64 {
        let key = match i % 5 {
            0 | 1 => format!("s{}", i % 17),
            2 | 3 => format!("medium-{:04}", i % 23),
            _ => format!("a-long-key-that-bypasses-the-switch-{}", i % 7),
        };
        stream.push((key.into_bytes(), i - 100));
    }
    let lb = run(&Setup::new(layout, 4), LinkConfig::perfect(), &[stream]);
    assert!(lb.receiver.stats().swaps >= 2, "swaps: {}", lb.receiver.stats().swaps);
    assert!(lb.switch.counters().tuples_aggregated > 0);
    assert_eq!(lb.receiver.stats().undecodable, 0);
}

/// Keys longer than `whole_key_len` in fragments, beside whole long keys
/// and switch-aggregated ones, under loss, duplication and reordering:
/// two senders, the same giant keys from both.
fn keys_of_any_length(link: LinkConfig) {
    let layout = Layout { short_slots: 3, medium_groups: 2, medium_parts: 2 };
    let giant = |n: usize, b: u8| -> Vec<u8> { (0..n).map(|i| b.wrapping_add((i % 251) as u8)).collect() };
    let mut streams = vec![Vec::new(), Vec::new()];
    for (c, stream) in streams.iter_mut().enumerate() {
        for i in 0..120i64 {
            let key = match i % 6 {
                0 => format!("s{}", i % 11).into_bytes(),
                1 => format!("medium-{:04}", i % 13).into_bytes(),
                2 => format!("a-long-key-that-bypasses-the-switch-{}", i % 5).into_bytes(),
                3 => giant(1_025 + (i as usize % 3), b'a'), // just over whole_key_len
                4 => giant(70_000 + 1_000 * (i as usize % 2), b'z'), // beyond one datagram and a u16
                _ => giant(5_000, c as u8), // each sender's own
            };
            stream.push((key, i * 3 - 50));
        }
    }
    let mut setup = Setup::new(layout, 4);
    setup.senders = 2;
    let lb = run(&setup, link, &streams);
    let fragmented: u64 = lb.senders.iter().map(|s| s.stats().fragmented_keys).sum();
    assert_eq!(fragmented, 2 * 60);
    assert_eq!(lb.receiver.stats().keys_reassembled, 2 * 60);
    assert_eq!(lb.receiver.stats().keys_refused, 0);
}

#[test]
fn keys_of_any_length_travel_in_fragments_and_sum_exactly() {
    keys_of_any_length(LinkConfig::perfect());
}

#[test]
fn keys_of_any_length_survive_loss_duplication_and_reordering() {
    keys_of_any_length(LinkConfig { delay_ns: 2_000, jitter_ns: 30_000, loss: 0.05, duplicate: 0.05, seed: 7 });
}

#[test]
fn a_key_fragment_beyond_the_receivers_limit_is_refused_and_counted() {
    let layout = Layout::short_only(2);
    let mut rc = ReceiverConfig::new(TASK, layout, 1, 1);
    rc.max_key_len = 2_000;
    let mut rx = KvReceiver::new(rc, Time::ZERO).unwrap();
    let repr = Repr { flags: FLAG_KEY_FRAGMENT, slot_count: 1, ..Repr::new(MessageType::KvLongData, TASK, 1, 0) };
    let piece = [b'k'; 100];
    let mut bytes = vec![0u8; HEADER_LEN + FRAGMENT_FIXED + LONG_TUPLE_FIXED + piece.len()];
    let mut p = Packet::new_unchecked(&mut bytes[..]);
    repr.emit(&mut p);
    emit_key_fragment(9, 5_000, 0, &piece, 1, p.body_mut());
    rx.handle_datagram(t(1), &bytes);
    assert_eq!(rx.stats().keys_refused, 1);
    assert!(rx.results().is_empty());
    // two fragments that add up to the key's length but overlap (a broken
    // or hostile sender) do not make a key: refused, not merged
    let fragment = |seq: u32, id: u32, total: u32, offset: u32, piece: &[u8]| {
        let repr = Repr { flags: FLAG_KEY_FRAGMENT, slot_count: 1, ..Repr::new(MessageType::KvLongData, TASK, 1, seq) };
        let mut bytes = vec![0u8; HEADER_LEN + FRAGMENT_FIXED + LONG_TUPLE_FIXED + piece.len()];
        let mut p = Packet::new_unchecked(&mut bytes[..]);
        repr.emit(&mut p);
        emit_key_fragment(id, total, offset, piece, 1, p.body_mut());
        bytes
    };
    rx.handle_datagram(t(2), &fragment(1, 3, 200, 0, &[b'a'; 100]));
    rx.handle_datagram(t(2), &fragment(2, 3, 200, 50, &[b'b'; 100]));
    assert_eq!((rx.stats().keys_refused, rx.stats().keys_reassembled), (2, 0));
    // memory held is what arrived, and bounded: a fragment past the bound is refused
    let mut rc = ReceiverConfig::new(TASK, layout, 1, 1);
    rc.max_pending_key_bytes = 150;
    let mut rx = KvReceiver::new(rc, Time::ZERO).unwrap();
    rx.handle_datagram(t(1), &fragment(1, 4, 1_000_000, 999_900, &[b'z'; 100]));
    rx.handle_datagram(t(1), &fragment(2, 5, 1_000_000, 0, &[b'z'; 100]));
    assert_eq!(rx.stats().keys_refused, 1, "the second would hold 200 bytes");
    // and the pieces of a key in any order make it
    let mut rx = KvReceiver::new(ReceiverConfig::new(TASK, layout, 1, 1), Time::ZERO).unwrap();
    rx.handle_datagram(t(1), &fragment(1, 6, 6, 4, b"ef"));
    rx.handle_datagram(t(1), &fragment(2, 6, 6, 0, b"abcd"));
    assert_eq!(rx.results()[&b"abcdef"[..]].sum, 1);
    // a fragment that does not lie within its key is malformed on the wire
    let mut bad = bytes.clone();
    bad[HEADER_LEN + 8..HEADER_LEN + 12].copy_from_slice(&4_950u32.to_be_bytes());
    assert!(matches!(Packet::new_checked(&bad[..]), Err(fanin_wire::WireError::FragmentOutOfRange { .. })));
}

#[test]
fn lost_forward_of_partial_packet_end_to_end() {
    let layout = Layout::short_only(2);
    let (a, b, x) = (key_in_slot(&layout, 0, 0), key_in_slot(&layout, 1, 0), key_in_slot(&layout, 1, 1));
    let mut setup = Setup::new(layout, 1);
    setup.shadow = false;
    let mut lb = setup.build(LinkConfig::perfect());
    lb.wait_for_release = true;
    // Drop the first forwarded copy of seq 1 on its way to the receiver.
    let mut dropped = false;
    lb.filter = Some(Box::new(move |dir, bytes| {
        let p = Packet::new_checked(bytes).unwrap();
        let hit = !dropped && *dir == Direction::Down(R) && p.msg_type() == MessageType::KvData && p.seq() == 1;
        dropped |= hit;
        hit
    }));
    let s = &mut lb.senders[0];
    s.push(&x, 5).unwrap();
    s.push(&a, 1).unwrap();
    s.push(&b, 1).unwrap();
    s.finish();
    assert_eq!(lb.run(Time::from_secs_f64(1.0)), RunOutcome::Finished);
    let r = lb.receiver.results();
    assert_eq!((r[&a].sum, r[&b].sum, r[&x].sum), (1, 1, 5));
    assert_eq!(lb.senders[0].stats().retransmissions, 1);
}

#[test]
fn shadow_copy_swap_lets_a_hot_key_reclaim_the_aggregator() {
    let layout = Layout::short_only(1);
    let (cold, hot) = (key_in_slot(&layout, 0, 0), key_in_slot(&layout, 0, 1));
    let mut sw = switch_with(layout, 1, true);
    let mut seq = 0;
    let mut send = |sw: &mut KvSwitch<Node>, k: &[u8]| {
        let r = feed(sw, S0, &data_packet(&layout, seq, &[(k, 1)]));
        seq += 1;
        r[0].1
    };
    assert_eq!(send(&mut sw, &cold), MessageType::KvAck); // the cold key takes the only aggregator
    assert_eq!(send(&mut sw, &hot), MessageType::KvData); // the hot key is forwarded
    // Algorithm 1: the receiver swaps; the hot key gets the fresh copy.
    let swap = {
        let mut b = vec![0u8; HEADER_LEN];
        Repr::new(MessageType::KvSwap, TASK, 0, 1).emit(&mut Packet::new_unchecked(&mut b[..]));
        b
    };
    assert_eq!(feed(&mut sw, R, &swap), vec![(R, MessageType::KvSwapAck, 1, 0)]);
    assert_eq!(feed(&mut sw, R, &swap), vec![(R, MessageType::KvSwapAck, 1, 0)], "a repeated swap is idempotent");
    assert_eq!(send(&mut sw, &hot), MessageType::KvAck);
    assert_eq!(send(&mut sw, &hot), MessageType::KvAck);
    let stats = sw.task_stats(TASK).unwrap();
    assert_eq!((stats.epoch, stats.swaps, stats.tuples_aggregated), (1, 1, 3));
    // The active copy (1) can be neither read nor cleared; copy 0 can.
    let clear = |copy: u8, epoch: u32| {
        let mut b = vec![0u8; HEADER_LEN + 4];
        let mut p = Packet::new_unchecked(&mut b[..]);
        Repr::new(MessageType::KvClear, TASK, 0, epoch).emit(&mut p);
        p.body_mut()[0] = copy;
        b
    };
    assert_eq!(feed(&mut sw, R, &clear(1, 1))[0].1, MessageType::KvNack);
    assert_eq!(feed(&mut sw, R, &clear(0, 0))[0].1, MessageType::KvNack, "stale epoch");
    assert_eq!(feed(&mut sw, R, &clear(0, 1))[0].1, MessageType::KvClearAck);
    // Only the receiver may do this.
    assert!(feed(&mut sw, S0, &swap).is_empty());
    assert_eq!(sw.counters().not_receiver, 1);
}

#[test]
fn receiver_runs_algorithm_1_and_merges_old_copies() {
    let layout = Layout::short_only(1);
    let (cold, hot) = (key_in_slot(&layout, 0, 0), key_in_slot(&layout, 0, 1));
    let mut setup = Setup::new(layout, 1);
    setup.swap_threshold = Some(2);
    setup.window = 1; // one packet at a time: an exact order
    let mut stream = vec![(cold.clone(), 1)];
    stream.extend(std::iter::repeat_n((hot.clone(), 2), 20));
    let lb = run(&setup, LinkConfig::perfect(), &[stream]);
    let stats = lb.switch.counters();
    // Without the swap, every hot tuple would have been forwarded.
    assert!(stats.tuples_aggregated > 10, "aggregated {}", stats.tuples_aggregated);
    assert!(lb.receiver.stats().swaps >= 1);
    assert_eq!(lb.receiver.results()[&hot], Aggregate { sum: 40, count: 20, min: 2, max: 2 });
}

// ---- coalesced medium keys (§3.2.3) ------------------------------------------

#[test]
fn coalesced_keys_never_match_across_keys_x1y2() {
    let layout = Layout { short_slots: 0, medium_groups: 1, medium_parts: 2 };
    // 15-byte keys: part 1 = bytes 0..8, part 2 = bytes 8..15 + length.
    let (x1x2, y1y2, x1y2) = (b"XXXXXXXX1111111", b"YYYYYYYY2222222", b"XXXXXXXX2222222");
    let y2x2 = b"YYYYYYYY1111111";
    let mut sw = switch_with(layout, 1, false); // one unified index for all
    let mut seq = 0;
    let mut send = |sw: &mut KvSwitch<Node>, k: &[u8]| {
        let r = feed(sw, S0, &data_packet(&layout, seq, &[(k, 1)]));
        seq += 1;
        (r[0].1, r[0].3)
    };
    assert_eq!(send(&mut sw, x1x2), (MessageType::KvAck, 0));
    assert_eq!(send(&mut sw, y1y2), (MessageType::KvData, 0b11));
    assert_eq!(send(&mut sw, x1y2), (MessageType::KvData, 0b11), "first part matches X1X2 only");
    assert_eq!(send(&mut sw, y2x2), (MessageType::KvData, 0b11), "last part matches X1X2 only");
    assert_eq!(send(&mut sw, x1x2), (MessageType::KvAck, 0));
    // End to end with several groups and parts: results stay exact.
    let layout = Layout { short_slots: 1, medium_groups: 2, medium_parts: 2 };
    let keys: Vec<&[u8]> = vec![x1x2, y1y2, x1y2, y2x2, b"XXXXXXXX", b"XXXXXXXX\0"];
    let stream: Vec<_> = (0..200).map(|i| (keys[i % keys.len()].to_vec(), i as i64)).collect();
    run(&Setup::new(layout, 2), LinkConfig::perfect(), &[stream]);
}

#[test]
fn coalesced_keys_compare_every_part_of_a_wide_group() {
    // A group of 10 parts holds keys up to 79 bytes. Two keys equal in their
    // first 64 bytes (8 parts) and different after must not share an
    // aggregator: the switch compares all 10 parts, not a prefix of them.
    let layout = Layout { short_slots: 0, medium_groups: 1, medium_parts: 10 };
    let x = vec![b'x'; 70];
    let mut y = x.clone();
    y[66] = b'y';
    let mut sw = switch_with(layout, 1, false); // one unified index for all
    let all = (1u64 << 10) - 1;
    let out = feed(&mut sw, S0, &data_packet(&layout, 0, &[(&x, 1)]));
    assert_eq!((out[0].1, out[0].3), (MessageType::KvAck, 0));
    let out = feed(&mut sw, S0, &data_packet(&layout, 1, &[(&y, 1)]));
    assert_eq!((out[0].1, out[0].3), (MessageType::KvData, all), "differs in part 9 only: forwarded");
    let out = feed(&mut sw, S0, &data_packet(&layout, 2, &[(&x, 1)]));
    assert_eq!((out[0].1, out[0].3), (MessageType::KvAck, 0));
    // End to end, with short slots beside the wide groups: exact results.
    let layout = Layout { short_slots: 3, medium_groups: 2, medium_parts: 10 };
    let keys: Vec<Vec<u8>> = vec![x.clone(), y.clone(), b"short".to_vec(), vec![b'z'; 79], vec![b'z'; 40]];
    let stream: Vec<_> = (0..300).map(|i| (keys[i % keys.len()].clone(), i as i64)).collect();
    run(&Setup::new(layout, 2), LinkConfig::perfect(), &[stream]);
}

#[test]
fn key_encoding_is_injective() {
    let keys: [&[u8]; 5] = [b"", b"\0", b"a", b"a\0", b"\0a"];
    let enc: Vec<_> = keys.iter().map(|k| encode_parts(k, 1)).collect();
    for i in 0..keys.len() {
        assert_eq!(decode_parts(&enc[i]).unwrap(), keys[i]);
        for j in 0..i {
            assert_ne!(enc[i], enc[j]);
        }
    }
    assert_eq!(decode_parts(&[0x0000_0000_0000_0009]), None, "length byte beyond the width");
}

// ---- bad input ---------------------------------------------------------------

#[test]
fn unknown_task_is_nacked_and_the_sender_fails_clearly() {
    let layout = Layout::short_only(2);
    let mut sw: KvSwitch<Node> = KvSwitch::new(KvSwitchConfig::default());
    let out = feed(&mut sw, S0, &data_packet(&layout, 0, &[(b"a", 1)]));
    assert_eq!(out, vec![(S0, MessageType::KvNack, 0, 0)]);
    assert_eq!(sw.counters().unknown_task, 1);
    let mut tx = KvSender::new(SenderConfig::new(TASK, 1, layout), Time::ZERO).unwrap();
    let mut o = VecTransmit::new();
    sw.handle_datagram(Time::ZERO, S0, &data_packet(&layout, 0, &[(b"a", 1)]), &mut o);
    tx.handle_datagram(Time::ZERO, &o.datagrams[0].1);
    let Some(SenderEvent::Failed(e)) = tx.poll_event() else { panic!("no failure") };
    assert_eq!(e, SenderError::Refused { task_id: TASK, reason: NackReason::UnknownTask, detail: TASK });
    assert!(e.to_string().contains("no switch memory is allocated"));
}

#[test]
fn malformed_and_mismatched_packets_are_counted_by_reason() {
    let layout = Layout { short_slots: 1, medium_groups: 1, medium_parts: 2 };
    let mut sw = switch_with(layout, 4, false);
    assert!(feed(&mut sw, S0, &[0xFA, 0x17, 0x01]).is_empty());
    assert!(feed(&mut sw, S0, b"not a fanin packet at all").is_empty());
    let mut pkt = data_packet(&layout, 0, &[(b"a", 1)]);
    pkt.pop();
    assert!(feed(&mut sw, S0, &pkt).is_empty());
    assert_eq!(sw.counters().malformed_total(), 3);
    // slot count of another layout
    let out = feed(&mut sw, S0, &data_packet(&Layout::short_only(2), 0, &[(b"a", 1)]));
    assert_eq!(out[0].1, MessageType::KvNack);
    // half a coalesced group
    let mut split = data_packet(&layout, 0, &[(b"medium-key-1", 1)]);
    Packet::new_unchecked(&mut split[..]).set_bitmap(0b010);
    assert_eq!(feed(&mut sw, S0, &split)[0].1, MessageType::KvNack);
    // a host-bound message sent to the switch
    let mut ack = vec![0u8; HEADER_LEN];
    Repr::new(MessageType::KvSwapAck, TASK, 0, 0).emit(&mut Packet::new_unchecked(&mut ack[..]));
    assert!(feed(&mut sw, S0, &ack).is_empty());
    let c = sw.counters();
    assert_eq!((c.layout_mismatch, c.split_group, c.protocol_violation), (1, 1, 1));
    assert_eq!(c.rx_datagrams, c.outcomes());
    assert_eq!(c.tuples_in, 0, "nothing was aggregated from bad packets");
}

#[test]
fn oversized_keys_are_refused_at_push() {
    assert_eq!(SenderConfig::new(TASK, 1, Layout::short_only(2)).max_key_len, 64 << 20);
    let mut cfg = SenderConfig::new(TASK, 1, Layout::short_only(2));
    cfg.max_key_len = 64;
    let mut tx = KvSender::new(cfg, Time::ZERO).unwrap();
    assert_eq!(tx.push(&[b'x'; 65], 1), Err(SenderError::KeyTooLong { len: 65, max: 64 }));
    assert!(tx.push(&[b'x'; 64], 1).is_ok());
    tx.finish();
    assert_eq!(tx.push(b"late", 1), Err(SenderError::Finished));
}

#[test]
fn admission_limits_memory_and_tenants() {
    let layout = Layout::short_only(4);
    let mut sw: KvSwitch<Node> = KvSwitch::new(KvSwitchConfig { memory_limit: 100, tenant_limit: 40, ..Default::default() });
    let spec = |id, tenant| {
        let mut s = KvTaskSpec::new(id, R, layout, 5); // 4 * 5 * 2 = 40 aggregators
        s.tenant = tenant;
        s
    };
    sw.add_task(Time::ZERO, spec(1, 1)).unwrap();
    assert!(matches!(sw.add_task(Time::ZERO, spec(2, 1)), Err(KvAdmitError::TenantLimit { .. })));
    assert_eq!(sw.add_task(Time::ZERO, spec(1, 2)), Err(KvAdmitError::Duplicate(1)));
    sw.add_task(Time::ZERO, spec(2, 2)).unwrap();
    assert!(matches!(sw.add_task(Time::ZERO, spec(3, 3)), Err(KvAdmitError::OutOfMemory { needed: 40, free: 20 })));
    assert_eq!(sw.memory_used(), 80);
    assert!(sw.remove_task(1));
    assert_eq!(sw.memory_used(), 40);
}

#[test]
fn vanished_receiver_fails_the_sender_and_the_switch_frees_memory() {
    let layout = Layout::short_only(2);
    let mut lb = Setup::new(layout, 4).build(LinkConfig::perfect());
    lb.senders[0] = {
        let mut c = SenderConfig::new(TASK, 1, layout);
        c.dead_after = Duration::from_millis(5);
        KvSender::new(c, Time::ZERO).unwrap()
    };
    // The receiver is gone: nothing reaches it.
    lb.filter = Some(Box::new(|dir, _| *dir == Direction::Down(R) || *dir == Direction::Up(R)));
    lb.receiver = KvReceiver::new(
        ReceiverConfig { idle_timeout: Duration::from_secs(3600), ..ReceiverConfig::new(TASK, layout, 4, 1) },
        Time::ZERO,
    )
    .unwrap();
    let s = &mut lb.senders[0];
    for i in 0..50 {
        s.push(format!("key{}", i % 40).as_bytes(), 1).unwrap();
    }
    s.finish();
    let outcome = lb.run(Time::from_secs_f64(1.0));
    assert!(matches!(outcome, RunOutcome::SenderFailed(0, SenderError::PeerSilent(_))), "{outcome:?}");
    // The switch's idle timer releases the region.
    assert!(lb.switch.has_task(TASK));
    lb.switch.handle_timeout(lb.now() + Duration::from_secs(31));
    assert!(!lb.switch.has_task(TASK));
    assert_eq!((lb.switch.memory_used(), lb.switch.counters().tasks_expired), (0, 1));
}

#[test]
fn vanished_sender_fails_the_receiver_which_releases_the_region() {
    let layout = Layout::short_only(2);
    let mut setup = Setup::new(layout, 4);
    setup.senders = 2;
    let mut lb = setup.build(LinkConfig::perfect());
    lb.receiver = KvReceiver::new(
        ReceiverConfig { idle_timeout: Duration::from_millis(20), ..ReceiverConfig::new(TASK, layout, 4, 2) },
        Time::ZERO,
    )
    .unwrap();
    lb.senders[0].push(b"a", 1).unwrap();
    lb.senders[0].finish(); // sender 1 never finishes: it vanished
    let outcome = lb.run(Time::from_secs_f64(1.0));
    let RunOutcome::ReceiverFailed(e) = outcome else { panic!("{outcome:?}") };
    assert!(matches!(e, ReceiverError::Silent { fins: 1, senders: 2, .. }), "{e}");
    // Its Release is on the wire; let it arrive.
    assert!(lb.switch.has_task(TASK));
    assert_eq!(lb.run(lb.now() + Duration::from_millis(1)), RunOutcome::Stalled, "no timer left: the task is gone");
    assert_eq!((lb.switch.memory_used(), lb.switch.counters().tasks_released), (0, 1));
}

#[test]
fn final_swap_freezes_the_region() {
    let layout = Layout::short_only(1);
    let a = key_in_slot(&layout, 0, 0);
    let mut sw = switch_with(layout, 2, true);
    let mut fin = vec![0u8; HEADER_LEN];
    Repr { flags: FLAG_FINAL, ..Repr::new(MessageType::KvSwap, TASK, 0, 0) }.emit(&mut Packet::new_unchecked(&mut fin[..]));
    assert_eq!(feed(&mut sw, R, &fin), vec![(R, MessageType::KvSwapAck, 0, 0)]);
    // A late data packet is forwarded untouched: nothing is written any more.
    assert_eq!(feed(&mut sw, S0, &data_packet(&layout, 0, &[(&a, 1)])), vec![(R, MessageType::KvData, 0, 1)]);
    assert_eq!(sw.task_stats(TASK).unwrap().tuples_aggregated, 0);
    // No swap after the freeze.
    let mut swap = vec![0u8; HEADER_LEN];
    Repr::new(MessageType::KvSwap, TASK, 0, 1).emit(&mut Packet::new_unchecked(&mut swap[..]));
    let out = feed(&mut sw, R, &swap);
    assert_eq!(out[0].1, MessageType::KvNack);
    let _ = Nack::parse;
}


/// ASK Figure 5: two AAs, three packets. pkt1 (a, b) is absorbed and acked by
/// the switch; pkt2 (c, f) is partially aggregated: c takes a new
/// aggregator, f collides with b and goes on to the receiver, which acks it;
/// pkt3 (c, b) is absorbed. Finally the receiver fetches and merges.
#[test]
fn figure_5_example_trace() {
    let layout = Layout::short_only(2);
    let aa_size = 4u32;
    let index = |k: &[u8]| match layout.classify(k) {
        KeyClass::Short { part, .. } => aggregator_index(&[part], aa_size),
        _ => unreachable!(),
    };
    let slot0: Vec<Vec<u8>> = (0..40).map(|n| key_in_slot(&layout, 0, n)).collect();
    let slot1: Vec<Vec<u8>> = (0..40).map(|n| key_in_slot(&layout, 1, n)).collect();
    let a = slot0[0].clone();
    let c = slot0.iter().find(|k| index(k) != index(&a)).unwrap().clone();
    let b = slot1[0].clone();
    let f = slot1.iter().skip(1).find(|k| index(k) == index(&b)).unwrap().clone();

    let mut sw = switch_with(layout, aa_size, false);
    let pkt = |seq, t: &[(&[u8], i64)]| data_packet(&layout, seq, t);
    assert_eq!(feed(&mut sw, S0, &pkt(0, &[(&a, 1), (&b, 1)])), vec![(S0, MessageType::KvAck, 0, 0)]);
    let fwd = feed(&mut sw, S0, &pkt(1, &[(&c, 1), (&f, 1)]));
    assert_eq!(fwd, vec![(R, MessageType::KvData, 1, 0b10)]);
    assert_eq!(feed(&mut sw, S0, &pkt(2, &[(&c, 1), (&b, 1)])), vec![(S0, MessageType::KvAck, 2, 0)]);

    // The receiver aggregates (f, 1) from the forwarded packet and acks it
    // through the switch to the sender.
    let mut rc = ReceiverConfig::new(TASK, layout, aa_size, 1);
    rc.shadow_copies = false;
    let mut rx = KvReceiver::new(rc, Time::ZERO).unwrap();
    let mut forwarded = VecTransmit::new();
    sw.handle_datagram(Time::ZERO, S0, &pkt(1, &[(&c, 1), (&f, 1)]), &mut forwarded); // a duplicate now
    let (to, bytes) = forwarded.drain().next().unwrap();
    assert_eq!(to, R);
    rx.handle_datagram(t(1), &bytes);
    let mut out = VecTransmit::new();
    rx.poll_transmit(t(1), &mut out);
    let (_, ack) = out.drain().next().unwrap();
    assert_eq!(feed(&mut sw, R, &ack), vec![(S0, MessageType::KvAck, 1, 0)]);
    assert_eq!(rx.results().len(), 1);

    // FIN, final swap, fetch of both AAs, merge: a=1, b=2, c=2, f=1.
    let mut fin = vec![0u8; HEADER_LEN];
    Repr::new(MessageType::KvFin, TASK, 1, 3).emit(&mut Packet::new_unchecked(&mut fin[..]));
    let mut o = VecTransmit::new();
    sw.handle_datagram(t(2), S0, &fin, &mut o);
    for (_, b) in o.drain() {
        rx.handle_datagram(t(2), &b);
    }
    for step in 0..10 {
        let now = t(3 + step);
        rx.poll_transmit(now, &mut out);
        for (_, b) in out.drain().collect::<Vec<_>>() {
            sw.handle_datagram(now, R, &b, &mut o);
        }
        for (to, b) in o.drain().collect::<Vec<_>>() {
            if to == R {
                rx.handle_datagram(now, &b);
            }
        }
    }
    assert!(rx.is_done());
    let sums: Vec<i64> = [&a, &b, &c, &f].iter().map(|k| rx.results()[*k].sum).collect();
    assert_eq!(sums, vec![1, 2, 2, 1]);
    assert_eq!(rx.stats().fetch_requests, 2, "one fetch per AA, in parallel");
}

#[test]
fn counters_merge_adds_every_field_that_visit_reports() {
    let mut a = super::KvCounters { rx_datagrams: 3, unknown_task: 1, tasks_released: 2, ..Default::default() };
    a.malformed[1] = 4;
    let mut values = Vec::new();
    a.visit(|_, _, v| values.push(v));
    let mut total = a.clone();
    total.merge(&a);
    let mut doubled = Vec::new();
    total.visit(|_, _, v| doubled.push(v));
    assert_eq!(doubled, values.iter().map(|v| v * 2).collect::<Vec<_>>());
    assert_eq!(total.outcomes(), 2 * a.outcomes());
}

// ---- failed senders (the driver declares them) -----------------------------

fn fin(channel: u16, seq: u32) -> Vec<u8> {
    let mut b = vec![0u8; HEADER_LEN];
    Repr::new(MessageType::KvFin, TASK, channel, seq).emit(&mut Packet::new_unchecked(&mut b[..]));
    b
}

fn sent_types(rx: &mut KvReceiver, now: Time) -> Vec<(MessageType, u16)> {
    let mut out = VecTransmit::new();
    while rx.poll_transmit(now, &mut out) > 0 {}
    out.drain().map(|(_, b)| Packet::new_checked(&b[..]).map(|p| (p.msg_type(), p.channel())).unwrap()).collect()
}

#[test]
fn a_failed_channel_ends_the_wait_for_fins_and_its_late_fin_is_not_acknowledged() {
    let layout = Layout::short_only(2);
    let mut rx = KvReceiver::new(ReceiverConfig::new(TASK, layout, 4, 2), Time::ZERO).unwrap();
    rx.handle_datagram(t(1), &fin(0, 0));
    assert_eq!(sent_types(&mut rx, t(1)), vec![(MessageType::KvFinAck, 0)], "waits for channel 1");
    assert!(!rx.sender_failed(0), "channel 0 finished: it did not fail");
    assert!(rx.sender_failed(1));
    assert!(!rx.sender_failed(1), "declared once");
    assert_eq!(rx.failed_channels(), vec![1]);
    // Channel 1's FIN after the declaration: no FIN-ACK (its sender was told).
    rx.handle_datagram(t(2), &fin(1, 0));
    let sent = sent_types(&mut rx, t(2));
    assert_eq!(sent, vec![(MessageType::KvSwap, 0)], "the final collection starts, channel 1 gets nothing");
}

#[test]
fn a_killed_sender_yields_an_incomplete_report_naming_it() {
    let layout = Layout::short_only(2);
    let mut setup = Setup::new(layout, 4);
    setup.senders = 2;
    let mut lb = setup.build(LinkConfig::perfect());
    lb.wait_for_release = true;
    lb.senders[0].push(b"a", 1).unwrap();
    lb.senders[0].finish();
    for i in 0..40 {
        lb.senders[1].push(format!("b{i}").as_bytes(), 1).unwrap();
    }
    // Sender 1 (channel 2) never finishes its input: it dies.
    assert_eq!(lb.run(t(200)), RunOutcome::TimedOut);
    let acked = lb.senders[1].progress().tuples_acked;
    assert!(acked > 0);
    lb.kill_sender(1);
    assert!(lb.receiver.sender_failed(2));
    assert_eq!(lb.run(Time::from_secs_f64(1.0)), RunOutcome::Finished);
    assert_eq!(lb.incomplete, Some(vec![2]));
    let r = lb.receiver.results();
    assert_eq!(r[b"a".as_slice()], Aggregate::of(1));
    let from_dead: u64 = r.iter().filter(|(k, _)| k.starts_with(b"b")).map(|(_, a)| a.count).sum();
    assert_eq!(from_dead, acked, "everything it had sent was acknowledged before it died");
    assert_eq!(lb.switch.memory_used(), 0, "the region is released");
}

#[test]
fn silence_names_the_channels_without_fin() {
    let layout = Layout::short_only(2);
    let cfg = ReceiverConfig { idle_timeout: Duration::from_millis(10), ..ReceiverConfig::new(TASK, layout, 4, 3) };
    let mut rx = KvReceiver::new(cfg, Time::ZERO).unwrap();
    rx.handle_datagram(t(1), &fin(1, 0));
    rx.handle_timeout(t(10_001));
    let Some(ReceiverEvent::Failed(e)) = rx.poll_event() else { panic!("silent receiver must fail") };
    assert!(matches!(&e, ReceiverError::Silent { fins: 1, senders: 3, missing, .. } if missing == &[0, 2]), "{e:?}");
    assert!(e.to_string().contains("none from channels 0, 2"), "{e}");
}

#[test]
fn sender_progress_keeps_a_receiver_that_hears_nothing_from_failing() {
    // The switch acknowledges fully absorbed packets itself: the receiver may
    // hear nothing while its senders progress.
    let layout = Layout::short_only(2);
    let cfg = ReceiverConfig { idle_timeout: Duration::from_millis(10), ..ReceiverConfig::new(TASK, layout, 4, 1) };
    let mut rx = KvReceiver::new(cfg, Time::ZERO).unwrap();
    rx.note_sender_progress(t(8_000));
    assert_eq!(rx.poll_timeout(), Some(t(18_000)));
    rx.handle_timeout(t(12_000));
    assert_eq!(rx.poll_event(), None);
    rx.handle_timeout(t(18_000));
    assert!(matches!(rx.poll_event(), Some(ReceiverEvent::Failed(ReceiverError::Silent { .. }))));
}

#[test]
fn sender_progress_counts_acknowledged_tuples_and_the_acknowledged_prefix() {
    // Two short slots: the packets carry push indices {0,1}, {2,3}, {4}.
    let layout = Layout::short_only(2);
    let (a, b) = (key_in_slot(&layout, 0, 0), key_in_slot(&layout, 1, 0));
    let mut tx = KvSender::new(SenderConfig::new(TASK, 1, layout), Time::ZERO).unwrap();
    for k in [&a, &b, &a, &b, &a] {
        tx.push(k, 1).unwrap();
    }
    tx.finish();
    let mut out = VecTransmit::new();
    assert_eq!(tx.poll_transmit(Time::ZERO, &mut out), 3);
    let ack = |seq: u32| {
        let mut b = vec![0u8; HEADER_LEN];
        Repr::new(MessageType::KvAck, TASK, 1, seq).emit(&mut Packet::new_unchecked(&mut b[..]));
        b
    };
    let p = tx.progress();
    assert_eq!((p.tuples_pushed, p.tuples_acked, p.acked_prefix, p.packets_sent, p.packets_acked), (5, 0, 0, 3, 0));
    tx.handle_datagram(t(1), &ack(1));
    let p = tx.progress();
    assert_eq!((p.tuples_acked, p.acked_prefix, p.packets_acked), (2, 0, 1), "seq 0 (tuples 0, 1) is still open");
    tx.handle_datagram(t(2), &ack(0));
    assert_eq!((tx.progress().tuples_acked, tx.progress().acked_prefix), (4, 4));
    tx.handle_datagram(t(3), &ack(2));
    assert_eq!((tx.progress().tuples_acked, tx.progress().acked_prefix), (5, 5));
    assert!(!tx.progress().finished);
}

// ---- int64 overflow (never a wrapped sum) ------------------------------------

#[test]
fn a_sum_that_overflows_int64_saturates_and_is_reported_never_wrapped() {
    // three values of 2^62 (the old switch summed them to -2^62 in its
    // register), with the hot key absorbed on the switch and a small key
    // beside it that must stay exact
    let layout = Layout::short_only(2);
    let (big, small) = (key_in_slot(&layout, 0, 0), key_in_slot(&layout, 1, 0));
    let setup = Setup::new(layout, 1);
    let stream = vec![(big.clone(), 1i64 << 62), (small.clone(), 5), (big.clone(), 1 << 62), (big.clone(), 1 << 62)];
    let lb = run(&setup, LinkConfig::perfect(), &[stream]);
    assert!(lb.receiver.stats().overflowed >= 1);
    assert_eq!(lb.receiver.results()[&big].sum, i64::MAX, "saturated, not wrapped");
    assert_eq!(lb.receiver.results()[&big].count, 3);
    assert_eq!(lb.receiver.results()[&small], Aggregate { sum: 5, count: 1, min: 5, max: 5 });
    let mut a = Aggregate::of(i64::MIN + 1);
    assert!(a.merge(&Aggregate::of(-2), ValueType::Int64) && a.sum == i64::MIN);
    assert!(a.merge(&Aggregate::of(-2), ValueType::Int64) && a.sum == i64::MIN, "every overflow is reported");
    assert!(!a.merge(&Aggregate::of(7), ValueType::Int64) && a.sum == i64::MIN + 7);
}

// ---- the edges of the layout and of the registers (found by an audit) ----

/// `medium_parts = 64`, one group filling the packet (a valid layout the
/// daemon accepts): the group's bitmap mask was `(1 << 64) - 1`, which a
/// release build wraps to 0, so the sender sent Data packets with an empty
/// bitmap, the switch acknowledged them, and the task finished with none of
/// the keys (a debug build panicked).
#[test]
fn a_group_of_64_parts_carries_its_keys() {
    let layout = Layout { short_slots: 0, medium_groups: 1, medium_parts: 64 };
    layout.validate().unwrap();
    assert_eq!(layout.group_mask(0), u64::MAX, "the one group is all 64 slots");
    let stream = vec![(b"apple".to_vec(), 5), (b"pear".to_vec(), 2), (b"apple".to_vec(), 1)];
    run(&Setup::new(layout, 4), LinkConfig::perfect(), &[stream]);
}

/// Groups wider than 32 parts hold more than 255 key bytes, but a medium
/// key's length travels in one byte: a 300-byte key was classed medium,
/// its length spilled into the key's bytes, the receiver could not decode
/// it and the key was missing from a finished task, and two 319-byte keys
/// that differ in one bit shared an encoding (one aggregator). Such keys
/// now travel as long keys.
#[test]
fn medium_keys_never_exceed_what_their_length_byte_carries() {
    let layout = Layout { short_slots: 0, medium_groups: 1, medium_parts: 40 };
    assert_eq!(layout.max_medium_key(), 255);
    assert!(matches!(layout.classify(&[b'k'; 255]), KeyClass::Medium { .. }));
    assert!(matches!(layout.classify(&[b'k'; 256]), KeyClass::Long));
    let (a, mut b) = (vec![b'a'; 319], vec![b'a'; 319]);
    b[318] = b'`'; // 0x60 against 0x61: the bit a length of 0x13F would set
    let stream = vec![(vec![b'k'; 300], 5), (b"small".to_vec(), 1), (vec![b'k'; 300], 7), (vec![b'm'; 255], 2), (a, 3), (b, 4)];
    run(&Setup::new(layout, 4), LinkConfig::perfect(), &[stream]);
}

/// The receiver's duplicate window started every slot at u32::MAX, so the
/// first forwarded packet whose seq is u32::MAX (a channel's 2^32-th, when
/// the switch absorbed the earlier ones of its slot) was taken for a
/// duplicate: acknowledged, its tuples never added.
#[test]
fn the_receiver_takes_a_first_packet_with_seq_u32_max_as_new() {
    let layout = Layout::short_only(2);
    let mut r = KvReceiver::new(ReceiverConfig::new(TASK, layout, 4, 1), Time::ZERO).unwrap();
    let key = key_in_slot(&layout, 0, 0);
    r.handle_datagram(Time::ZERO, &data_packet(&layout, u32::MAX, &[(&key, 5)]));
    let mut out = VecTransmit::new();
    r.poll_transmit(Time::ZERO, &mut out);
    let acked = out.drain().any(|(_, b)| {
        let p = Packet::new_checked(&b[..]).unwrap();
        p.msg_type() == MessageType::KvAck && p.seq() == u32::MAX
    });
    assert!(acked, "the packet is acknowledged to its sender");
    assert_eq!(r.stats().duplicate_packets, 0, "it was never seen before");
    assert_eq!(r.results().get(&key), Some(&Aggregate::of(5)), "so its tuple is in the results");
}

/// A switch aggregator's count is a u32 (so is a fetched entry's): a hot
/// key absorbed 2^32 times in one copy, which nothing prevents while the
/// switch absorbs every packet and no swap comes, was fetched with count
/// 4294967295 (it saturated) and a right sum, and `count(*)` of a Spark
/// aggregation reads that count. A full register now leaves the tuple in
/// the packet for the receiver, whose count is a u64, as a full sum does.
/// The registers are set near the limit instead of adding 2^32 tuples;
/// a short key and a medium key's group (whose last part holds the count).
#[test]
fn a_key_counted_past_the_switch_registers_limit_keeps_its_exact_count() {
    let layout = Layout { short_slots: 1, medium_groups: 1, medium_parts: 2 };
    let (short, medium) = (b"hot".to_vec(), b"a-medium-key".to_vec());
    assert!(matches!(layout.classify(&short), KeyClass::Short { .. }));
    assert!(matches!(layout.classify(&medium), KeyClass::Medium { .. }));
    let mut setup = Setup::new(layout, 4);
    setup.swap_threshold = None; // no swap: one copy absorbs everything
    let mut lb = setup.build(LinkConfig::perfect());
    lb.wait_for_release = true;
    for _ in 0..2 {
        lb.senders[0].push(&short, 1).unwrap();
        lb.senders[0].push(&medium, 10).unwrap();
    }
    assert_eq!(lb.run(Time::from_secs_f64(0.01)), RunOutcome::TimedOut, "the sender has not finished");
    // the packets sent so far (the sender keeps its last one open), each
    // with one tuple of each key, all absorbed
    let absorbed = lb.switch.counters().tuples_aggregated;
    assert!(absorbed > 0 && absorbed % 2 == 0, "{absorbed}");
    // as if each key had been absorbed u32::MAX - 1 times so far
    lb.switch.set_counts(TASK, u32::MAX - 1);
    for _ in 0..3 {
        lb.senders[0].push(&short, 1).unwrap();
        lb.senders[0].push(&medium, 10).unwrap();
    }
    lb.senders[0].finish();
    assert_eq!(lb.run(Time::from_secs_f64(10.0)), RunOutcome::Finished);
    let expected_count = (u32::MAX - 1) as u64 + 5 - absorbed / 2;
    let results = lb.receiver.results();
    assert_eq!(results[&short], Aggregate { sum: 5, count: expected_count, min: 1, max: 1 });
    assert_eq!(results[&medium], Aggregate { sum: 50, count: expected_count, min: 10, max: 10 });
}

/// A channel's datagrams are numbered in 32 bits and never reused within a
/// task: at the last number the sender fails with what to do, instead of
/// wrapping to numbers the switch and the receiver take for stale ones
/// (it failed later with a misleading PeerSilent; a debug build panicked).
#[test]
fn a_channel_that_ran_out_of_sequence_numbers_fails_saying_what_to_do() {
    let layout = Layout::short_only(1);
    let mut sender = KvSender::new(SenderConfig::new(TASK, 3, layout), Time::ZERO).unwrap();
    sender.set_next_seq(u32::MAX - 2);
    for i in 0..5 {
        sender.push(format!("k{i}").as_bytes(), 1).unwrap(); // one slot: a datagram each
    }
    let mut out = VecTransmit::new();
    sender.poll_transmit(Time::ZERO, &mut out);
    let seqs: Vec<u32> = out.drain().map(|(_, b)| Packet::new_checked(&b[..]).unwrap().seq()).collect();
    assert_eq!(seqs, [u32::MAX - 2, u32::MAX - 1], "the last two numbers, then no more");
    match sender.poll_event() {
        Some(SenderEvent::Failed(e @ SenderError::SequenceExhausted { task_id: TASK, channel: 3 })) => {
            assert!(e.to_string().contains("split the input over more channels or tasks"), "{e}")
        }
        other => panic!("expected SequenceExhausted, got {other:?}"),
    }
}
