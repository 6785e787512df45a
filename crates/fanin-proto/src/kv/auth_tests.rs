//! Exact traces of keyed key-value tasks (docs/security.md): what does not
//! verify is dropped and counted before it touches any state, replays are
//! refused, everything the switch sends is sealed under the destination's
//! member key, and a keyed task still aggregates exactly.

use std::time::Duration;

use fanin_wire::auth::{open, seal, Key, TRAILER_LEN};
use fanin_wire::kv::{Nack, NackReason, Packet, Repr, FLAG_BY_SWITCH, HEADER_LEN};
use fanin_wire::MessageType;

use super::loopback::{LinkConfig, Loopback, Node, RunOutcome};
use super::*;
use crate::time::Time;
use crate::transmit::VecTransmit;

const TASK: u32 = 9;
const CH: u16 = 3;
const R: Node = Node::Receiver;
const S0: Node = Node::Sender(0);
const TASK_KEY: Key = Key([0x42; 16]);

fn layout() -> Layout {
    Layout::short_only(2)
}

fn keyed_switch() -> KvSwitch<Node> {
    let mut sw = KvSwitch::new(KvSwitchConfig { seal_lane: 1, seal_clock_us: 5_000, ..Default::default() });
    let mut spec = KvTaskSpec::new(TASK, R, layout(), 4);
    spec.window = 4;
    spec.key = Some(TASK_KEY);
    sw.add_task(Time::ZERO, spec).unwrap();
    sw
}

/// A Data packet of channel `CH` with the key "a" (slot of "a") and `value`.
fn data(seq: u32, value: i64) -> Vec<u8> {
    let l = layout();
    let KeyClass::Short { slot, part } = l.classify(b"a") else { panic!("short key") };
    let repr = Repr { slot_count: l.slot_count() as u8, ..Repr::new(MessageType::KvData, TASK, CH, seq) };
    let mut buf = vec![0u8; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    p.set_slot(slot as usize, part.to_be_bytes(), value);
    p.set_bitmap(1 << slot);
    buf
}

fn sealed(key: &Key, seq: u64, plain: &[u8]) -> Vec<u8> {
    let mut buf = plain.to_vec();
    buf.resize(plain.len() + TRAILER_LEN, 0);
    seal(key, seq, &mut buf).unwrap();
    buf
}

fn feed(sw: &mut KvSwitch<Node>, now: Time, from: Node, bytes: &[u8]) -> Vec<(Node, Vec<u8>)> {
    let mut out = VecTransmit::new();
    sw.handle_datagram(now, from, bytes, &mut out);
    out.drain().collect()
}

fn ch_key() -> Key {
    channel_key(&TASK_KEY, TASK, CH)
}

fn rx_key() -> Key {
    receiver_key(&TASK_KEY, TASK)
}

/// What a refused datagram must leave untouched: the outputs, the task's
/// figures, its idle deadline (a forgery must not keep a task alive).
fn assert_untouched(sw: &KvSwitch<Node>, out: &[(Node, Vec<u8>)], before: (Option<TaskStats>, Option<Time>)) {
    assert!(out.is_empty(), "a refused datagram caused output");
    assert_eq!((sw.task_stats(TASK), sw.poll_timeout()), before);
    assert_eq!(sw.counters().rx_datagrams, sw.counters().outcomes());
}

#[test]
fn forged_tag_is_dropped_and_counted_before_any_state() {
    let mut sw = keyed_switch();
    let before = (sw.task_stats(TASK), sw.poll_timeout());
    let later = Time::from_secs_f64(1.0);
    // Sealed with a random key, with another task's key for the same
    // channel (cross-task), with the receiver's key, and a valid seal with
    // one body byte flipped.
    let other_task = channel_key(&TASK_KEY, TASK + 1, CH);
    let mut flipped = sealed(&ch_key(), 10, &data(0, 5));
    flipped[HEADER_LEN + 9] ^= 1;
    for bytes in [sealed(&Key([7; 16]), 10, &data(0, 5)), sealed(&other_task, 11, &data(0, 5)), sealed(&rx_key(), 12, &data(0, 5)), flipped] {
        let out = feed(&mut sw, later, S0, &bytes);
        assert_untouched(&sw, &out, before);
    }
    assert_eq!(sw.counters().auth_bad_tag, 4);
    assert_eq!(sw.counters().tuples_in, 0);
    // The forgeries did not move the channel's window: the honest datagram
    // with a lower seq than the forged ones is accepted.
    let out = feed(&mut sw, later, S0, &sealed(&ch_key(), 5, &data(0, 5)));
    assert_eq!(out.len(), 1);
    assert_eq!(sw.counters().acked, 1);
}

#[test]
fn replay_is_dropped_and_counted() {
    let mut sw = keyed_switch();
    let first = sealed(&ch_key(), 100, &data(0, 5));
    let out = feed(&mut sw, Time::ZERO, S0, &first);
    assert_eq!(out.len(), 1, "the switch acknowledges the packet");
    let before = (sw.task_stats(TASK), sw.poll_timeout());
    let out = feed(&mut sw, Time::from_secs_f64(1.0), S0, &first);
    assert_untouched(&sw, &out, before);
    assert_eq!(sw.counters().auth_replayed, 1);
    assert_eq!(sw.counters().duplicates, 0, "the replay never reached the kv window");
    // A retransmission of the same kv packet under a fresh auth seq is not
    // a replay: it reaches the kv window as a duplicate and is acked again.
    let out = feed(&mut sw, Time::ZERO, S0, &sealed(&ch_key(), 101, &data(0, 5)));
    assert_eq!(out.len(), 1);
    assert_eq!(sw.counters().duplicates, 1);
    assert_eq!(sw.task_stats(TASK).unwrap().tuples_aggregated, 1, "aggregated once");
    // Too old for the replay window: also a replay.
    let out = feed(&mut sw, Time::ZERO, S0, &sealed(&ch_key(), 101 + crate::auth::REPLAY_WINDOW + 5, &data(1, 5)));
    assert_eq!(out.len(), 1);
    let out = feed(&mut sw, Time::ZERO, S0, &sealed(&ch_key(), 102, &data(2, 5)));
    assert!(out.is_empty());
    assert_eq!(sw.counters().auth_replayed, 2);
}

#[test]
fn unsealed_datagram_of_a_keyed_task_is_dropped_and_counted() {
    let mut sw = keyed_switch();
    let before = (sw.task_stats(TASK), sw.poll_timeout());
    // Data from a sender, and a Release "from the receiver": neither acts.
    let release = {
        let mut b = vec![0u8; HEADER_LEN];
        Repr::new(MessageType::KvRelease, TASK, 0, 0).emit(&mut Packet::new_unchecked(&mut b[..]));
        b
    };
    for bytes in [data(0, 5), release, vec![0xFA, 0x17, 0x01, 0x20, 0, 2, 0, 3, 0, 0, 0, TASK as u8, 0, 0, 0, 0]] {
        let out = feed(&mut sw, Time::from_secs_f64(1.0), R, &bytes);
        assert_untouched(&sw, &out, before);
    }
    assert_eq!(sw.counters().auth_unsealed, 3);
    assert!(sw.has_task(TASK), "an unsealed Release freed nothing");
}

#[test]
fn sealed_datagram_of_an_unkeyed_task_counts_as_bad_tag() {
    let mut sw = KvSwitch::new(KvSwitchConfig::default());
    sw.add_task(Time::ZERO, KvTaskSpec::new(TASK, R, layout(), 4)).unwrap();
    let out = feed(&mut sw, Time::ZERO, S0, &sealed(&ch_key(), 10, &data(0, 5)));
    assert!(out.is_empty());
    assert_eq!(sw.counters().auth_bad_tag, 1);
    // Unsealed, the task works as it always did.
    let out = feed(&mut sw, Time::ZERO, S0, &data(0, 5));
    assert_eq!(out.len(), 1);
    assert!(!fanin_wire::auth::is_sealed(&out[0].1));
    assert_eq!(sw.counters().acked, 1);
}

#[test]
fn receiver_member_id_is_no_sender_channel() {
    let mut sw = keyed_switch();
    let mut plain = data(0, 5);
    plain[6..8].copy_from_slice(&RECEIVER_MEMBER.to_be_bytes());
    // Even sealed under the receiver's key (the key that id derives to),
    // a sender's message on channel 0xffff is refused.
    let out = feed(&mut sw, Time::ZERO, S0, &sealed(&rx_key(), 10, &plain));
    assert!(out.is_empty());
    assert_eq!(sw.counters().auth_bad_tag, 1);
}

#[test]
fn switch_seals_under_the_destination_key() {
    let mut sw = keyed_switch();
    // Fully absorbed: a switch ACK to the sender, under the channel's key.
    let out = feed(&mut sw, Time::ZERO, S0, &sealed(&ch_key(), 10, &data(0, 5)));
    let (to, ack) = &out[0];
    assert_eq!(*to, S0);
    assert!(open(&rx_key(), ack).is_err());
    let (inner, seq) = open(&ch_key(), ack).unwrap();
    assert_eq!(fanin_wire::auth::lane_of(seq), 1, "the switch's lane");
    let p = Packet::new_checked(inner).unwrap();
    assert_eq!((p.msg_type(), p.flags(), p.seq()), (MessageType::KvAck, FLAG_BY_SWITCH, 0));
    // A Fin: forwarded to the receiver under the receiver's key.
    let mut fin = vec![0u8; HEADER_LEN];
    Repr::new(MessageType::KvFin, TASK, CH, 1).emit(&mut Packet::new_unchecked(&mut fin[..]));
    let out = feed(&mut sw, Time::ZERO, S0, &sealed(&ch_key(), 11, &fin));
    let (to, fwd) = &out[0];
    assert_eq!(*to, R);
    assert!(open(&ch_key(), fwd).is_err());
    let (inner, seq2) = open(&rx_key(), fwd).unwrap();
    assert!(seq2 > seq, "one counter for all destinations, counting up");
    assert_eq!(Packet::new_checked(inner).unwrap().msg_type(), MessageType::KvFin);
    // The receiver's FinAck, relayed to the sender under the channel's key.
    let mut fin_ack = vec![0u8; HEADER_LEN];
    Repr::new(MessageType::KvFinAck, TASK, CH, 1).emit(&mut Packet::new_unchecked(&mut fin_ack[..]));
    let out = feed(&mut sw, Time::ZERO, R, &sealed(&rx_key(), 1, &fin_ack));
    assert_eq!(out[0].0, S0);
    assert!(open(&ch_key(), &out[0].1).is_ok());
    // A Nack for the receiver's bad request, under the receiver's key.
    let mut swap = vec![0u8; HEADER_LEN];
    Repr::new(MessageType::KvSwap, TASK, 0, 7).emit(&mut Packet::new_unchecked(&mut swap[..]));
    let out = feed(&mut sw, Time::ZERO, R, &sealed(&rx_key(), 2, &swap));
    let (inner, _) = open(&rx_key(), &out[0].1).unwrap();
    let p = Packet::new_checked(inner).unwrap();
    assert_eq!(Nack::parse(p.body()).unwrap().reason, NackReason::StaleEpoch);
    // Release: the ReleaseAck is sealed although the task is gone after it.
    let mut release = vec![0u8; HEADER_LEN];
    Repr::new(MessageType::KvRelease, TASK, 0, 0).emit(&mut Packet::new_unchecked(&mut release[..]));
    let out = feed(&mut sw, Time::ZERO, R, &sealed(&rx_key(), 3, &release));
    assert!(!sw.has_task(TASK));
    let (inner, _) = open(&rx_key(), &out[0].1).unwrap();
    assert_eq!(Packet::new_checked(inner).unwrap().msg_type(), MessageType::KvReleaseAck);
}

#[test]
fn readmitted_task_does_not_reuse_sequence_numbers() {
    let mut sw = keyed_switch();
    let out = feed(&mut sw, Time::ZERO, S0, &sealed(&ch_key(), 10, &data(0, 5)));
    let (_, first) = open(&ch_key(), &out[0].1).unwrap();
    assert!(sw.remove_task(TASK));
    let mut spec = KvTaskSpec::new(TASK, R, layout(), 4);
    spec.key = Some(TASK_KEY);
    sw.add_task(Time::ZERO, spec).unwrap();
    let out = feed(&mut sw, Time::ZERO, S0, &sealed(&ch_key(), 11, &data(0, 5)));
    let (_, second) = open(&ch_key(), &out[0].1).unwrap();
    assert!(second > first, "the same key never sees a sequence number twice");
}

fn keyed_sender() -> KvSender {
    let mut c = SenderConfig::new(TASK, CH, layout());
    c.auth_key = Some(ch_key());
    c.seal_clock_us = 1_000;
    KvSender::new(c, Time::ZERO).unwrap()
}

fn header(t: MessageType, channel: u16, seq: u32) -> Vec<u8> {
    let mut b = vec![0u8; HEADER_LEN];
    Repr::new(t, TASK, channel, seq).emit(&mut Packet::new_unchecked(&mut b[..]));
    b
}

#[test]
fn keyed_sender_seals_every_transmission_and_ignores_what_does_not_verify() {
    let mut s = keyed_sender();
    s.push(b"a", 1).unwrap();
    s.finish();
    let mut out = VecTransmit::new();
    s.poll_transmit(Time::ZERO, &mut out);
    let first = out.drain().next().unwrap().1;
    let (_, seq0) = open(&ch_key(), &first).unwrap();
    // The retransmission carries the same packet under a fresh seq.
    let t1 = Time::from_nanos(200_000);
    s.poll_transmit(t1, &mut out);
    let again = out.drain().next().unwrap().1;
    let (inner, seq1) = open(&ch_key(), &again).unwrap();
    assert!(seq1 > seq0);
    assert_eq!(inner, &first[..first.len() - TRAILER_LEN]);
    assert_eq!(s.stats().retransmissions, 1);
    // Forged, unsealed and replayed answers change nothing.
    let nack = {
        let mut b = header(MessageType::KvNack, CH, 0);
        b.resize(HEADER_LEN + Nack::LEN, 0);
        Nack { reason: NackReason::UnknownTask, detail: TASK }.emit(&mut b[HEADER_LEN..]);
        b
    };
    s.handle_datagram(t1, &nack);
    // The unsealed UnknownTask is a hint for the daemon to check (a
    // restarted switch cannot seal it), never a failure by itself; one
    // about another task, or sealed under a wrong key, is not even that.
    assert_eq!(s.progress().unknown_task_hints, 1);
    let mut other_task = nack.clone();
    other_task[8..12].copy_from_slice(&(TASK + 1).to_be_bytes());
    s.handle_datagram(t1, &other_task);
    assert_eq!(s.progress().unknown_task_hints, 1);
    assert_eq!(s.stats().auth.unsealed, 2);
    s.handle_datagram(t1, &sealed(&rx_key(), 50, &nack));
    assert_eq!(s.progress().unknown_task_hints, 1);
    let ack = sealed(&ch_key(), 60, &header(MessageType::KvAck, CH, 0));
    s.handle_datagram(t1, &ack);
    assert_eq!(s.stats().acks_from_receiver, 1);
    s.handle_datagram(t1, &ack);
    assert_eq!(s.stats().auth, AuthStats { bad_tag: 1, replayed: 1, unsealed: 2 });
    assert_eq!(s.stats().duplicate_acks, 0, "the replayed ack never reached the machine");
    assert!(s.poll_event().is_none(), "the unverified Nack did not fail the sender");
    // The FIN goes out sealed.
    s.poll_transmit(t1, &mut out);
    let fin = out.drain().next().unwrap().1;
    let (inner, _) = open(&ch_key(), &fin).unwrap();
    assert_eq!(Packet::new_checked(inner).unwrap().msg_type(), MessageType::KvFin);
}

#[test]
fn keyed_receiver_aggregates_only_what_verifies() {
    let mut rc = ReceiverConfig::new(TASK, layout(), 4, 1);
    rc.auth_key = Some(rx_key());
    rc.swap_threshold = None;
    let mut r = KvReceiver::new(rc, Time::ZERO).unwrap();
    r.handle_datagram(Time::ZERO, &data(0, 100)); // unsealed
    r.handle_datagram(Time::ZERO, &sealed(&ch_key(), 5, &data(1, 100))); // the sender's key, not the switch's
    let honest = sealed(&rx_key(), 5, &data(2, 1));
    r.handle_datagram(Time::ZERO, &honest);
    r.handle_datagram(Time::ZERO, &honest);
    assert_eq!(r.stats().auth, AuthStats { bad_tag: 1, replayed: 1, unsealed: 1 });
    assert_eq!(r.stats().data_packets, 1);
    let mut out = VecTransmit::new();
    r.poll_transmit(Time::ZERO, &mut out);
    let acks: Vec<_> = out.drain().map(|(_, b)| b).collect();
    assert_eq!(acks.len(), 1);
    let (inner, _) = open(&rx_key(), &acks[0]).unwrap();
    assert_eq!(Packet::new_checked(inner).unwrap().seq(), 2);
}

#[test]
fn keyed_task_end_to_end_exact_and_every_datagram_sealed() {
    let layout = Layout { short_slots: 3, medium_groups: 2, medium_parts: 2 };
    let mut sw = KvSwitch::new(KvSwitchConfig::default());
    let mut spec = KvTaskSpec::new(TASK, R, layout, 4);
    spec.key = Some(TASK_KEY);
    sw.add_task(Time::ZERO, spec).unwrap();
    let streams: Vec<Vec<(Vec<u8>, i64)>> = (0..2)
        .map(|s| {
            (0..300i64)
                .map(|i| {
                    let k = match i % 3 {
                        0 => format!("s{}", i % 11),
                        1 => format!("medium-{:04}", i % 13),
                        _ => format!("a-long-key-that-bypasses-the-switch-{}", (i + s) % 5),
                    };
                    (k.into_bytes(), i - 50)
                })
                .collect()
        })
        .collect();
    let senders = streams
        .iter()
        .enumerate()
        .map(|(i, stream)| {
            let mut c = SenderConfig::new(TASK, i as u16, layout);
            c.rto = Duration::from_micros(50);
            c.auth_key = Some(channel_key(&TASK_KEY, TASK, i as u16));
            let mut s = KvSender::new(c, Time::ZERO).unwrap();
            for (k, v) in stream {
                s.push(k, *v).unwrap();
            }
            s.finish();
            s
        })
        .collect();
    let mut rc = ReceiverConfig::new(TASK, layout, 4, 2);
    rc.swap_threshold = Some(4);
    rc.rto = Duration::from_micros(50);
    rc.linger = Duration::from_millis(1);
    rc.auth_key = Some(rx_key());
    let mut lb = Loopback::new(sw, senders, KvReceiver::new(rc, Time::ZERO).unwrap(), LinkConfig::perfect());
    lb.wait_for_release = true;
    let unsealed = std::rc::Rc::new(std::cell::Cell::new(0u64));
    let seen = unsealed.clone();
    lb.filter = Some(Box::new(move |_, bytes| {
        if !fanin_wire::auth::is_sealed(bytes) {
            seen.set(seen.get() + 1);
        }
        false
    }));
    assert_eq!(lb.run(Time::from_secs_f64(10.0)), RunOutcome::Finished);
    let mut expected = super::KvResults::default();
    for (k, v) in streams.iter().flatten() {
        expected.entry(k.clone()).and_modify(|a| _ = a.merge(&Aggregate::of(*v), ValueType::Int64)).or_insert(Aggregate::of(*v));
    }
    assert_eq!(lb.receiver.results(), &expected);
    assert_eq!(unsealed.get(), 0, "a keyed task sends nothing unsealed");
    let c = lb.switch.counters();
    assert_eq!(c.auth_bad_tag + c.auth_replayed + c.auth_unsealed, 0);
    assert!(c.swaps >= 1 && c.tuples_aggregated > 0, "{c:?}");
    assert_eq!(lb.switch.memory_used(), 0);
}
