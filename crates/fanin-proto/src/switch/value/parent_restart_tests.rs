//! A restarted switch and the child switches below it, datagram by
//! datagram (parent_restart.rs; the property tests in
//! `tests/lossy_network.rs` run whole trees through restarts).

use super::tests::{job, Pkt};
use super::*;
use crate::transmit::VecTransmit;

type Addr = u32;
const T0: Time = Time::ZERO;
const ROOT: Addr = 1;
const CHILD: u16 = SWITCH_RANK_BASE;
/// The child switch's data address, as the root sees it.
const CHILD_ADDR: Addr = 50;

fn shard(incarnation: u32, spec: JobSpec, uplink: Option<Uplink<Addr>>) -> ValueSwitch<Addr> {
    let mut sw = ValueSwitch::new(ShardConfig { incarnation, ..ShardConfig::single(1 << 30) });
    sw.add_job(spec).unwrap();
    sw.set_uplink(1, uplink).unwrap();
    sw
}

fn deliver(sw: &mut ValueSwitch<Addr>, from: Addr, bytes: &[u8]) -> (Verdict, Vec<(Addr, Vec<u8>)>) {
    let mut out = VecTransmit::new();
    let verdict = sw.handle_datagram(T0, from, bytes, &mut out);
    (verdict, out.drain().collect())
}

fn recovery_join(src: u16, low: u32) -> Vec<u8> {
    let repr = Repr { age_op: JOIN_RECOVER, block_id: low, src_cnt: 7, ..Repr::new(MessageType::Join, 1, src) };
    let mut buf = vec![0; repr.buffer_len()];
    let mut packet = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut packet);
    RecoverAnchor { block: 0, gen_id: 1 }.emit(packet.payload_mut());
    buf
}

fn parsed(bytes: &[u8]) -> (Repr, Option<Nack>, Option<JoinParams>) {
    let packet = Packet::new_checked(bytes).unwrap();
    let repr = Repr::parse(&packet).unwrap();
    let nack = (repr.msg_type == MessageType::Nack).then(|| Nack::parse(packet.payload()).unwrap());
    let params = (repr.msg_type == MessageType::JoinAck).then(|| JoinParams::parse(packet.payload()).unwrap());
    (repr, nack, params)
}

/// Root (worker 0 and the child switch, restarted: `resumed`) and child
/// (workers 1 and 2): the root refuses the child's partial; the child
/// restarts its stream under a new incarnation, makes its workers recover,
/// reports their lowest block up, and hands the root's floor down.
#[test]
fn a_child_switch_reports_its_subtrees_lowest_block_to_a_restarted_parent() {
    let mut root = shard(0x2000, JobSpec { members: vec![0, CHILD], workers: 3, resumed: true, ..job(1, 1, 4) }, None);
    let mut child = shard(0x1000, JobSpec { members: vec![1, 2], workers: 3, ..job(1, 2, 4) }, Some(Uplink { parent: vec![ROOT], rank: CHILD }));

    // the child's partial of block 9 (from before the root restarted)
    let (_, out) = deliver(&mut root, CHILD_ADDR, &Pkt::data(1, CHILD, 9, &[5]).bytes());
    let (repr, nack, _) = parsed(&out[0].1);
    assert_eq!((out[0].0, repr.src_id, nack.map(|n| (n.reason, n.detail))), (CHILD_ADDR, CHILD, Some((NackReason::StaleIncarnation, 0x2000))));
    assert_eq!(root.counters().child_rejoin_asked, 1);

    // the child restarts its stream: a new incarnation, once per parent life
    let (verdict, out) = deliver(&mut child, ROOT, &out[0].1);
    assert_eq!((verdict, out.len()), (Verdict::ParentRestarted { job_id: 1, parent: 0x2000 }, 0));
    assert_eq!(child.counters().parent_restarts, 1);
    // a worker's contribution tagged for the child's old life is refused
    // with the new incarnation: the worker recovers
    let mut stale = Pkt::data(1, 1, 10, &[1]);
    stale.repr.src_cnt = incarnation_tag(0x1000);
    let (_, out) = deliver(&mut child, 101, &stale.bytes());
    let new_incarnation = parsed(&out[0].1).1.unwrap().detail;
    assert_eq!(parsed(&out[0].1).1.unwrap().reason, NackReason::StaleIncarnation);
    assert_ne!(incarnation_tag(new_incarnation), incarnation_tag(0x1000));

    // its workers report; the lowest block goes up once both did
    let (_, out) = deliver(&mut child, 101, &recovery_join(1, 12));
    assert!(out.is_empty(), "{out:?}");
    let (_, out) = deliver(&mut child, 102, &recovery_join(2, 10));
    let (repr, _, _) = parsed(&out[0].1);
    assert_eq!((out[0].0, repr.msg_type, repr.age_op, repr.src_id, repr.block_id), (ROOT, MessageType::Join, JOIN_RECOVER, CHILD, 10));

    // the root's floor waits for its worker too, then goes to both members
    let (_, none) = deliver(&mut root, CHILD_ADDR, &out[0].1);
    assert!(none.is_empty());
    let (verdict, out) = deliver(&mut root, 100, &recovery_join(0, 11));
    assert!(matches!(verdict, Verdict::Recovered { floor: 10, .. }), "{verdict:?}");
    let to_child = out.iter().find(|(a, _)| *a == CHILD_ADDR).expect("the child's answer");
    let (repr, _, params) = parsed(&to_child.1);
    assert_eq!((repr.age_op, params.unwrap().next_block), (JOIN_RECOVER, 10));
    // the child's partials count again
    let (_, out) = deliver(&mut root, CHILD_ADDR, &Pkt::data(1, CHILD, 10, &[5]).bytes());
    assert!(out.is_empty() && root.counters().accepted == 1, "{out:?}");

    // the child hands the floor to its workers, under its new incarnation
    let (verdict, out) = deliver(&mut child, ROOT, &to_child.1);
    assert!(matches!(verdict, Verdict::Recovered { floor: 10, .. }), "{verdict:?}");
    let mut answered: Vec<(Addr, u32, u32)> = out
        .iter()
        .map(|(a, b)| {
            let p = parsed(b).2.unwrap();
            (*a, p.next_block, p.incarnation)
        })
        .collect();
    answered.sort();
    assert_eq!(answered, vec![(101, 10, new_incarnation), (102, 10, new_incarnation)]);
    // a second answer from the root changes nothing
    let (verdict, out) = deliver(&mut child, ROOT, &to_child.1);
    assert_eq!((verdict, out.len()), (Verdict::Consumed, 0));
}

/// A plain Join from a worker, at the address it joined from, the second time.
fn plain_join(src: u16) -> Vec<u8> {
    let repr = Repr { src_cnt: 7, ..Repr::new(MessageType::Join, 1, src) };
    let mut buf = vec![0; repr.buffer_len()];
    repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
    buf
}

/// A subtree whose workers all finished sends nothing up, so a restarted
/// parent's floor waited for it forever. Their probes (they linger) reach
/// the child, which did not restart; the child passes them up as a probe
/// of its own (at most every PROBE_UP_INTERVAL), which a restarted parent
/// waiting for every member answers StaleIncarnation: the child restarts
/// its subtree's stream as for a refused partial. A parent with nothing to
/// ask answers nothing.
#[test]
fn a_child_passes_its_members_probes_up_and_a_recovering_parent_asks_it_to_report() {
    let spec = JobSpec { members: vec![1, 2], workers: 3, ..job(1, 2, 4) };
    let mut child = shard(0x1000, spec, Some(Uplink { parent: vec![ROOT], rank: CHILD }));
    let at = |ms: u64| Time::from_nanos(ms * 1_000_000);
    let probe = |child: &mut ValueSwitch<Addr>, ms: u64| {
        let mut out = VecTransmit::new();
        let _ = child.handle_datagram(at(ms), 101, &plain_join(1), &mut out);
        out.drain().filter(|(dest, _)| *dest == ROOT).map(|(_, b)| b).collect::<Vec<_>>()
    };
    assert!(probe(&mut child, 0).is_empty(), "a first join is no probe");
    let up = probe(&mut child, 1);
    let (repr, _, _) = parsed(&up[0]);
    assert_eq!((up.len(), repr.msg_type, repr.age_op, repr.src_id), (1, MessageType::Join, 0, CHILD));
    assert!(probe(&mut child, 50).is_empty(), "at most one probe up per interval");
    assert_eq!(probe(&mut child, 101).len(), 1);
    assert_eq!(child.counters().probes_up, 2);

    // a parent that did not restart: nothing to say
    let mut live = shard(0x2000, JobSpec { members: vec![0, CHILD], workers: 3, ..job(1, 1, 4) }, None);
    let (verdict, out) = deliver(&mut live, CHILD_ADDR, &up[0]);
    assert_eq!((verdict, out.len(), live.counters().child_probes), (Verdict::Consumed, 0, 1));
    // a restarted one, waiting for every member's report
    let mut restarted = shard(0x3000, JobSpec { members: vec![0, CHILD], workers: 3, resumed: true, ..job(1, 1, 4) }, None);
    let (_, out) = deliver(&mut restarted, CHILD_ADDR, &up[0]);
    let (_, nack, _) = parsed(&out[0].1);
    assert_eq!((out[0].0, nack.map(|n| (n.reason, n.detail))), (CHILD_ADDR, Some((NackReason::StaleIncarnation, 0x3000))));
    // ... which restarts the child's stream, as for a refused partial
    let (verdict, _) = deliver(&mut child, ROOT, &out[0].1);
    assert_eq!(verdict, Verdict::ParentRestarted { job_id: 1, parent: 0x3000 });
}

fn done_join(src: u16, block: u32) -> Vec<u8> {
    let repr = Repr { age_op: JOIN_DONE, block_id: block, src_cnt: 7, ..Repr::new(MessageType::Join, 1, src) };
    let mut buf = vec![0; repr.buffer_len()];
    repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
    buf
}

/// Lingering members say they are done (JOIN_DONE, the end of their
/// stream); the root answers JOIN_ALL_DONE once every member did at the
/// same block, a child switch's report for its members included, and the
/// child hands it down to its own members' next JOIN_DONE.
#[test]
fn every_member_done_is_answered_down_the_tree_and_only_then() {
    let mut root = shard(0x2000, JobSpec { members: vec![0, CHILD], workers: 3, ..job(1, 1, 4) }, None);
    let mut child = shard(0x1000, JobSpec { members: vec![1, 2], workers: 3, ..job(1, 2, 4) }, Some(Uplink { parent: vec![ROOT], rank: CHILD }));
    let age = |out: &[(Addr, Vec<u8>)], to: Addr| out.iter().filter(|(d, _)| *d == to).map(|(_, b)| parsed(b).0.age_op).collect::<Vec<_>>();
    // worker 0 (on the root) is done at 40: answered as a probe
    let (_, out) = deliver(&mut root, 100, &done_join(0, 40));
    assert_eq!(age(&out, 100), vec![0]);
    // worker 1 done at 40, worker 2 at 39 (it ran less): the child's
    // members are not all done at one block, so it only probes up
    let (_, out) = deliver(&mut child, 101, &done_join(1, 40));
    assert_eq!((age(&out, 101), age(&out, ROOT)), (vec![0], vec![0]));
    let at = |ms: u64| Time::from_nanos(ms * 1_000_000);
    let mut out = VecTransmit::new();
    let _ = child.handle_datagram(at(200), 102, &done_join(2, 39), &mut out);
    let out: Vec<_> = out.drain().collect();
    assert_eq!((age(&out, 102), age(&out, ROOT)), (vec![0], vec![0]));
    // worker 2 at 40 too: the child says its members are done, up
    let mut out = VecTransmit::new();
    let _ = child.handle_datagram(at(400), 102, &done_join(2, 40), &mut out);
    let out: Vec<_> = out.drain().collect();
    let up: Vec<_> = out.iter().filter(|(d, _)| *d == ROOT).map(|(_, b)| b.clone()).collect();
    let (repr, _, _) = parsed(&up[0]);
    assert_eq!((repr.age_op, repr.src_id, repr.block_id), (JOIN_DONE, CHILD, 40));
    assert_eq!(age(&out, 102), vec![0], "the child does not know the rest of the tree yet");
    // the root: every member done at 40, the child's subtree included
    let (_, out) = deliver(&mut root, CHILD_ADDR, &up[0]);
    let (repr, _, params) = parsed(&out[0].1);
    assert_eq!((out[0].0, repr.age_op, repr.src_id, params.unwrap().next_block), (CHILD_ADDR, JOIN_ALL_DONE, CHILD, 40));
    let (_, back) = deliver(&mut root, 100, &done_join(0, 40));
    assert_eq!(age(&back, 100), vec![JOIN_ALL_DONE]);
    // down the tree: the child's members learn it at their next JOIN_DONE
    let (verdict, _) = deliver(&mut child, ROOT, &out[0].1);
    assert_eq!(verdict, Verdict::Consumed);
    let mut again = VecTransmit::new();
    let _ = child.handle_datagram(at(600), 101, &done_join(1, 40), &mut again);
    let again: Vec<_> = again.drain().collect();
    assert_eq!(age(&again, 101), vec![JOIN_ALL_DONE]);
    assert!(root.counters().done_joins >= 3 && child.counters().done_joins >= 4);
}
