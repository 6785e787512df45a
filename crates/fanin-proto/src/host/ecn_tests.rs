//! Exact traces of ECN (docs/congestion.md, "ECN"): two workers and the real
//! switch program, a path whose queues mark datagrams Congestion
//! Experienced instead of dropping them. A mark on the way up is the
//! switch's to read; one on the way down is the worker's, echoed on its next
//! contribution. Either way every member reads the mark in the same result
//! and cuts its window there, and no datagram is lost or resent.

use std::time::Duration;

use fanin_wire::value::{Packet, AGE_OP_CONGESTED};

use super::{AllreduceSession, Event, Outcome, SessionConfig, Tensor};
use crate::job::JobSpec;
use crate::switch::{ShardConfig, ValueSwitch};
use crate::transmit::VecTransmit;
use crate::Time;

const RTT: Duration = Duration::from_micros(50);
const WORKERS: u16 = 2;
const ELEMS: i32 = 4 * 400; // 400 blocks of 4 elements

/// Which datagrams a queue marks: (worker, block) on the way up, and
/// (worker, block of the result) on the way down.
struct Marks {
    up: fn(u16, u32) -> bool,
    down: fn(u16, u32) -> bool,
}

struct Run {
    outcomes: Vec<Outcome>,
    /// Every contribution's (worker, block, age_op), in sending order.
    sent: Vec<(u16, u32, u8)>,
    switch: ValueSwitch<u16>,
    windows: Vec<u32>,
    sessions: Vec<AllreduceSession>,
}

fn input(w: u16) -> Vec<i32> {
    (0..ELEMS).map(|i| i * (w as i32 + 1)).collect()
}

/// Two workers through one switch shard, one round trip per step, until
/// both finished one allreduce of `ELEMS` elements.
fn run(marks: Marks) -> Run {
    let mut switch = ValueSwitch::new(ShardConfig::single(1 << 24));
    switch.add_job(JobSpec::with_sources(1, WORKERS, 256, 64)).unwrap();
    let mut sessions: Vec<AllreduceSession> = (0..WORKERS)
        .map(|w| {
            let mut cfg = SessionConfig::new(1, w);
            cfg.elems_per_packet = 4;
            cfg.window = 256;
            AllreduceSession::new(cfg, Time::ZERO)
        })
        .collect();
    let mut now = Time::from_nanos(1_000);
    let mut begun = [false; WORKERS as usize];
    let mut outcomes: Vec<Option<Outcome>> = vec![None; WORKERS as usize];
    let mut sent = Vec::new();
    for _ in 0..10_000 {
        if outcomes.iter().all(Option::is_some) {
            break;
        }
        let mut to_switch = Vec::new();
        for (w, s) in sessions.iter_mut().enumerate() {
            while let Some(e) = s.poll_event() {
                match e {
                    Event::Joined(_) => {}
                    Event::Completed(o) => outcomes[w] = Some(o),
                    other => panic!("worker {w}: {other:?}"),
                }
            }
            if !begun[w] && s.is_ready() {
                s.begin(now, Tensor::I32(input(w as u16))).unwrap();
                begun[w] = true;
            }
            let mut out = VecTransmit::new();
            while s.poll_transmit(now, &mut out) > 0 {}
            for (_, bytes) in out.drain() {
                to_switch.push((w as u16, bytes));
            }
        }
        now = now + RTT / 2;
        let mut to_workers = VecTransmit::new();
        for (w, bytes) in to_switch {
            let p = Packet::new_checked(&bytes[..]).unwrap();
            let block = p.block_id();
            if p.msg_type_code() != fanin_wire::MessageType::Join as u8 {
                sent.push((w, block, p.age_op()));
            }
            let ce = p.msg_type_code() != fanin_wire::MessageType::Join as u8 && (marks.up)(w, block);
            let _ = switch.handle_datagram_ce(now, w, &bytes, ce, &mut to_workers);
        }
        now = now + RTT / 2;
        for (w, bytes) in to_workers.drain() {
            let p = Packet::new_checked(&bytes[..]).unwrap();
            let ce = p.msg_type_code() == fanin_wire::MessageType::Result as u8 && (marks.down)(w, p.block_id());
            sessions[w as usize].handle_datagram_ce(now, &bytes, ce);
        }
        for s in &mut sessions {
            s.handle_timeout(now);
        }
    }
    let outcomes: Vec<Outcome> = outcomes.into_iter().map(|o| o.expect("both workers finish")).collect();
    for o in &outcomes {
        let sum: Vec<i32> = (0..ELEMS).map(|i| i * 3).collect();
        assert_eq!(o.tensor, Tensor::I32(sum), "every sum exact");
        assert_eq!((o.retransmissions, o.timeouts), (0, 0), "a mark loses nothing");
    }
    let windows = sessions.iter().map(AllreduceSession::window).collect();
    Run { outcomes, sent, switch, windows, sessions }
}

fn never(_: u16, _: u32) -> bool {
    false
}

#[test]
fn a_ce_mark_on_one_members_result_is_echoed_once_and_every_member_cuts_at_the_same_result() {
    let clean = run(Marks { up: never, down: never });
    assert_eq!(clean.outcomes.iter().map(|o| o.marked_results).collect::<Vec<_>>(), [0, 0]);
    // the queue on worker 1's downlink marks the result of block 100
    let marked = run(Marks { up: never, down: |w, b| w == 1 && b == 100 });
    let echoes: Vec<_> = marked.sent.iter().filter(|s| s.2 == AGE_OP_CONGESTED).collect();
    assert_eq!(echoes.len(), 1, "echoed on one contribution: {echoes:?}");
    assert_eq!(echoes[0].0, 1, "by the worker that saw the mark");
    assert!(echoes[0].1 > 100, "on a contribution sent after the marked result");
    let c = marked.switch.counters();
    assert_eq!((c.ecn_ce, c.ecn_echoed, c.congestion_marked), (0, 1, 1));
    let o = &marked.outcomes;
    assert_eq!((o[0].ecn_ce, o[1].ecn_ce), (0, 1));
    assert_eq!((o[0].marked_results, o[1].marked_results), (1, 1), "the switch's mark reaches both");
    assert_eq!(marked.windows[0], marked.windows[1], "both cut at the same result");
    assert!(marked.windows[0] < clean.windows[0], "cut: {:?} against {:?}", marked.windows, clean.windows);
    // the contribution kept for a recovery after a switch restart is the
    // one sent without the echo: resent then, it would report a queue
    // long gone
    let echoed_block = echoes[0].1;
    let kept = marked.sessions[1].retained_bytes(echoed_block).expect("the echoed block's contribution is retained");
    assert_eq!(Packet::new_checked(kept).unwrap().age_op(), 0);
}

#[test]
fn a_persistently_marked_uplink_holds_every_members_window_down_without_a_loss() {
    let clean = run(Marks { up: never, down: never });
    // every contribution of worker 0 crosses a queue above its marking
    // threshold
    let marked = run(Marks { up: |w, _| w == 0, down: never });
    let c = marked.switch.counters();
    assert!(c.ecn_ce > 300 && c.congestion_marked > 300, "{c:?}");
    assert_eq!(marked.windows[0], marked.windows[1]);
    assert!(
        marked.windows[0] < clean.windows[0],
        "{:?} against {:?}",
        marked.windows,
        clean.windows
    );
    assert!(marked.outcomes.iter().all(|o| o.marked_results > 300));
}
