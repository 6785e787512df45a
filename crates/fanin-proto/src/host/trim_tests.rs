//! Exact traces of a worker's reaction to Trimmed nacks, against the real
//! switch program and the daemon's real return-to-sender reply: resend at
//! once, halve the window once per round trip, regrow it, and never act on a
//! trim twice or for a block that has its result.

use std::time::Duration;

use fanin_wire::value::Packet;
use fanin_wire::MessageType;

use super::{AllreduceSession, Event, Outcome, SessionConfig, Tensor};
use crate::job::JobSpec;
use crate::switch::{ShardConfig, ValueSwitch};
use crate::transmit::VecTransmit;
use crate::trim::{return_to_sender, TrimCause, TrimVerdict};
use crate::Time;

const RTT: Duration = Duration::from_micros(50);

type Datagrams = Vec<(u16, Vec<u8>)>;

/// One worker (the job's only source) joined to one switch shard, with
/// 4 elements per packet and a window of 8.
fn joined() -> (AllreduceSession, ValueSwitch<u16>) {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(JobSpec::with_sources(1, 1, 16, 64)).unwrap();
    let mut cfg = SessionConfig::new(1, 0);
    cfg.elems_per_packet = 4;
    cfg.window = 8;
    let mut s = AllreduceSession::new(cfg, Time::ZERO);
    let mut out = VecTransmit::new();
    s.poll_transmit(Time::ZERO, &mut out);
    let replies = through_switch(&mut sw, Time::ZERO, out.drain().collect());
    deliver(&mut s, Time::ZERO, replies);
    assert!(matches!(s.poll_event(), Some(Event::Joined(_))));
    (s, sw)
}

fn send_all(s: &mut AllreduceSession, now: Time) -> Datagrams {
    let mut out = VecTransmit::new();
    while s.poll_transmit(now, &mut out) > 0 {}
    out.drain().collect()
}

/// What the overloaded daemon does: answer each datagram with a trim.
fn trim(datagrams: &[(u16, Vec<u8>)]) -> Datagrams {
    let mut out = VecTransmit::new();
    for (_, bytes) in datagrams {
        assert_eq!(return_to_sender(0u16, bytes, TrimCause::ProcessingQueue, &mut out), TrimVerdict::Trimmed);
    }
    out.drain().collect()
}

fn through_switch(sw: &mut ValueSwitch<u16>, now: Time, datagrams: Datagrams) -> Datagrams {
    let mut out = VecTransmit::new();
    for (_, bytes) in datagrams {
        let _ = sw.handle_datagram(now, 0, &bytes, &mut out);
    }
    out.drain().collect()
}

fn deliver(s: &mut AllreduceSession, now: Time, datagrams: Datagrams) {
    for (_, bytes) in datagrams {
        s.handle_datagram(now, &bytes);
    }
}

fn blocks_and_types(datagrams: &[(u16, Vec<u8>)]) -> Vec<(u32, u8)> {
    datagrams
        .iter()
        .map(|(_, b)| {
            let p = Packet::new_checked(&b[..]).unwrap();
            (p.block_id(), p.msg_type_code())
        })
        .collect()
}

fn completed(s: &mut AllreduceSession) -> Outcome {
    match s.poll_event() {
        Some(Event::Completed(o)) => o,
        other => panic!("expected a completed allreduce, got {other:?}"),
    }
}

#[test]
fn a_trim_is_resent_at_once_and_a_burst_of_trims_halves_the_window_once() {
    let (mut s, mut sw) = joined();
    let t0 = Time::from_nanos(1_000);
    s.begin(t0, Tensor::I32((0..32).collect())).unwrap();
    let first = send_all(&mut s, t0);
    assert_eq!(first.len(), 8, "a full window of 8 blocks");
    // the switch is overloaded for blocks 0..4 and processes 4..8
    let (trimmed, processed) = first.split_at(4);
    let t1 = t0 + RTT;
    // the switch answers in order: the trims first, then the results
    deliver(&mut s, t1, trim(trimmed));
    assert_eq!(s.window(), 4, "four trims within one round trip are one congestion signal");
    deliver(&mut s, t1, through_switch(&mut sw, t1, processed.to_vec()));
    // resent at once, no timer involved
    let resent = send_all(&mut s, t1);
    let retx = MessageType::Retransmission as u8;
    assert_eq!(blocks_and_types(&resent), vec![(0, retx), (1, retx), (2, retx), (3, retx)]);
    let t2 = t1 + RTT;
    deliver(&mut s, t2, through_switch(&mut sw, t2, resent));
    let o = completed(&mut s);
    assert_eq!(o.tensor, Tensor::I32((0..32).collect()));
    assert_eq!((o.trimmed, o.retransmissions), (4, 4));
}

#[test]
fn trims_a_round_trip_apart_halve_again_and_results_regrow_the_window() {
    let (mut s, mut sw) = joined();
    let mut now = Time::from_nanos(1_000);
    // first allreduce: everything trimmed twice, a round trip apart
    s.begin(now, Tensor::I32(vec![1; 8])).unwrap();
    let sent = send_all(&mut s, now);
    now = now + RTT;
    deliver(&mut s, now, trim(&sent));
    assert_eq!(s.window(), 4);
    let resent = send_all(&mut s, now);
    assert_eq!(resent.len(), 2);
    now = now + RTT;
    deliver(&mut s, now, trim(&resent));
    assert_eq!(s.window(), 4, "a second trim one round trip later would halve again, but 4 is the floor");
    assert_eq!(s.congestion().decreases, 2);
    let resent = send_all(&mut s, now);
    now = now + RTT;
    deliver(&mut s, now, through_switch(&mut sw, now, resent));
    assert_eq!(completed(&mut s).trimmed, 4);
    assert_eq!(s.window(), 4, "additive increase: two results are half a window, no growth yet");
    // and so on, one block per window of results, up to the configured 8
    s.begin(now, Tensor::I32((0..160).collect())).unwrap();
    let mut windows = vec![s.window()];
    loop {
        let sent = send_all(&mut s, now);
        if sent.is_empty() {
            break;
        }
        assert!(sent.len() as u32 <= *windows.last().unwrap(), "never more than the window outstanding");
        now = now + RTT;
        deliver(&mut s, now, through_switch(&mut sw, now, sent));
        windows.push(s.window());
    }
    assert_eq!(completed(&mut s).tensor, Tensor::I32((0..160).collect()));
    assert!(windows.windows(2).all(|w| w[1] >= w[0]), "only grows without trims: {windows:?}");
    assert_eq!((windows[0], *windows.last().unwrap()), (4, 8), "{windows:?}");
}

#[test]
fn stale_and_duplicate_trims_are_ignored_and_nothing_is_counted_twice() {
    let (mut s, mut sw) = joined();
    let t0 = Time::from_nanos(1_000);
    s.begin(t0, Tensor::I32((0..8).collect())).unwrap();
    let sent = send_all(&mut s, t0);
    assert_eq!(sent.len(), 2);
    let t1 = t0 + RTT;
    // block 0 gets its result; block 1 is trimmed, and the trim is duplicated
    deliver(&mut s, t1, through_switch(&mut sw, t1, vec![sent[0].clone()]));
    let trims = trim(&sent);
    deliver(&mut s, t1, vec![trims[1].clone(), trims[1].clone()]);
    // a trim for block 0, which already has its result, changes nothing
    deliver(&mut s, t1, vec![trims[0].clone()]);
    let resent = send_all(&mut s, t1);
    assert_eq!(blocks_and_types(&resent), vec![(1, MessageType::Retransmission as u8)]);
    assert_eq!(s.window(), 4, "one decrease");
    let t2 = t1 + RTT;
    deliver(&mut s, t2, through_switch(&mut sw, t2, resent));
    let o = completed(&mut s);
    assert_eq!(o.tensor, Tensor::I32((0..8).collect()));
    assert_eq!((o.trimmed, o.retransmissions), (1, 1));
    // after completion a late trim for this allreduce is ignored too
    deliver(&mut s, t2, trims);
    assert!(s.poll_event().is_none());
    assert_eq!(send_all(&mut s, t2).len(), 0);
    assert!(s.is_ready());
}

/// A trimming link (docs/protocol.md §4.14) cuts datagrams to their header.
fn cut(datagrams: &[(u16, Vec<u8>)]) -> Datagrams {
    datagrams.iter().map(|(a, b)| (*a, b[..fanin_wire::value::HEADER_LEN].to_vec())).collect()
}

#[test]
fn trims_by_the_network_either_way_are_recovered_in_one_round_trip_and_cut_the_window() {
    let (mut s, mut sw) = joined();
    let t0 = Time::from_nanos(1_000);
    s.begin(t0, Tensor::I32((0..32).collect())).unwrap();
    let first = send_all(&mut s, t0);
    assert_eq!(first.len(), 8);
    // blocks 0 and 1 are cut on their way up: the real switch program
    // answers the headers with Trimmed nacks; 2..8 arrive whole, but the
    // results of 2 and 3 are cut on their way down
    let t1 = t0 + RTT;
    let mut answers = through_switch(&mut sw, t1, cut(&first[..2]));
    assert_eq!(answers.len(), 2, "one nack per cut contribution");
    let results = through_switch(&mut sw, t1, first[2..].to_vec());
    answers.extend(cut(&results[..2]));
    answers.extend(results[2..].iter().cloned());
    deliver(&mut s, t1, answers);
    assert_eq!(s.congestion().decreases, 1, "one congestion signal for the round trip");
    assert!(s.window() < 8, "the window was cut (and regrows with the results after the trims)");
    // every lost block goes again at once: no timer, no duplicate
    let resent = send_all(&mut s, t1);
    let retx = MessageType::Retransmission as u8;
    assert_eq!(blocks_and_types(&resent), vec![(0, retx), (1, retx), (2, retx), (3, retx)]);
    let t2 = t1 + RTT;
    deliver(&mut s, t2, through_switch(&mut sw, t2, resent));
    let o = completed(&mut s);
    assert_eq!(o.tensor, Tensor::I32((0..32).collect()), "each contribution added once");
    assert_eq!((o.trimmed, o.retransmissions, o.timeouts), (4, 4, 0));
    assert_eq!(sw.counters().trimmed_in_network, 2);
}
