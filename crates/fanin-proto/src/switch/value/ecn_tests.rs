//! Traces of ECN (docs/congestion.md, "ECN"): a queue on the path marked a
//! datagram Congestion Experienced instead of dropping it, and the switch
//! turns the mark into the block's congestion mark, which every member of
//! the job reads in the same result.

use super::tests::{decode, job, Pkt};
use super::*;
use crate::transmit::VecTransmit;

type Addr = u32; // worker n at 100 + n
const T0: Time = Time::ZERO;
const PARENT: Addr = 1;
const RANK: u16 = SWITCH_RANK_BASE;

/// `p` from its worker's address, its IP header's ECN field CE or not.
fn arrive(sw: &mut ValueSwitch<Addr>, p: &Pkt, ce: bool) -> Vec<(Addr, Repr, Vec<i32>)> {
    arrive_from(sw, 100 + p.repr.src_id as u32, &p.bytes(), ce)
}

fn arrive_from(sw: &mut ValueSwitch<Addr>, from: Addr, bytes: &[u8], ce: bool) -> Vec<(Addr, Repr, Vec<i32>)> {
    let mut out = VecTransmit::new();
    assert_eq!(sw.handle_datagram_ce(T0, from, bytes, ce, &mut out), Verdict::Consumed);
    decode(out)
}

fn switch_with(spec: JobSpec) -> ValueSwitch<Addr> {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 30));
    sw.add_job(spec).unwrap();
    sw
}

fn echo(mut p: Pkt) -> Pkt {
    p.repr.age_op = AGE_OP_CONGESTED;
    p
}

#[test]
fn a_contribution_marked_ce_on_its_way_up_marks_the_blocks_result_for_every_member() {
    let mut sw = switch_with(job(1, 3, 4));
    arrive(&mut sw, &Pkt::data(1, 0, 0, &[1]), false);
    // member 1's uplink queue marked its first transmission
    arrive(&mut sw, &Pkt::data(1, 1, 0, &[2]), true);
    let out = arrive(&mut sw, &Pkt::data(1, 2, 0, &[3]), false);
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|(_, r, v)| r.age_op == AGE_OP_CONGESTED && v == &vec![6]), "{out:?}");
    // an unmarked block stays unmarked
    for src in 0..3 {
        let out = arrive(&mut sw, &Pkt::data(1, src, 1, &[1]), false);
        assert!(out.iter().all(|(_, r, _)| r.age_op == 0), "{out:?}");
    }
    let c = sw.counters();
    assert_eq!((c.ecn_ce, c.ecn_echoed, c.congestion_marked, c.accepted), (1, 0, 1, 6));
}

#[test]
fn a_members_echo_of_a_ce_mark_on_its_way_down_marks_the_blocks_result() {
    let mut sw = switch_with(job(1, 2, 4));
    // member 0 saw CE on an earlier result: its next contribution echoes it
    arrive(&mut sw, &echo(Pkt::data(1, 0, 0, &[1])), false);
    let out = arrive(&mut sw, &Pkt::data(1, 1, 0, &[2]), false);
    assert!(out.len() == 2 && out.iter().all(|(_, r, _)| r.age_op == AGE_OP_CONGESTED), "{out:?}");
    let c = sw.counters();
    assert_eq!((c.ecn_ce, c.ecn_echoed, c.congestion_marked), (0, 1, 1));
}

#[test]
fn a_ce_mark_on_a_duplicate_or_on_a_finished_block_marks_nothing() {
    let mut sw = switch_with(job(1, 2, 4));
    arrive(&mut sw, &Pkt::data(1, 0, 0, &[1]), false);
    // a network duplicate of member 0's contribution, marked on the way
    assert!(arrive(&mut sw, &Pkt::data(1, 0, 0, &[1]), true).is_empty());
    let out = arrive(&mut sw, &Pkt::data(1, 1, 0, &[2]), false);
    assert!(out.iter().all(|(_, r, _)| r.age_op == 0), "{out:?}");
    // a marked retransmission of the finished block gets the result again,
    // as it was: the block's verdict does not change after it went out
    let out = arrive(&mut sw, &Pkt::data(1, 1, 0, &[2]).retransmission(), true);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].1.age_op, out[0].2.clone()), (0, vec![3]));
    let c = sw.counters();
    assert_eq!((c.ecn_ce, c.congestion_marked), (2, 0), "counted as seen, marking nothing");
}

#[test]
fn in_a_tree_a_ce_mark_on_the_parents_result_rides_up_on_the_next_partial() {
    let mut leaf = switch_with(JobSpec { workers: 5, ..job(1, 2, 4) });
    leaf.set_uplink(1, Some(Uplink { parent: vec![PARENT], rank: RANK })).unwrap();
    arrive(&mut leaf, &Pkt::data(1, 0, 0, &[1]), false);
    let up = arrive(&mut leaf, &Pkt::data(1, 1, 0, &[2]), false);
    assert_eq!((up[0].0, up[0].1.age_op), (PARENT, 0));
    // the parent's result reaches the leaf CE-marked (the link between
    // them is congested): relayed down as the root said it ...
    let mut result = Pkt::data(1, 0, 0, &[3]);
    result.repr.msg_type = MessageType::Result;
    result.repr.src_cnt = 5;
    let down = arrive_from(&mut leaf, PARENT, &result.bytes(), true);
    assert!(down.len() == 2 && down.iter().all(|(_, r, _)| r.age_op == 0), "{down:?}");
    // ... and echoed on the next partial, so the root marks that block for
    // every member of the tree, not only this subtree's
    arrive(&mut leaf, &Pkt::data(1, 0, 1, &[1]), false);
    let up = arrive(&mut leaf, &Pkt::data(1, 1, 1, &[1]), false);
    assert_eq!((up[0].0, up[0].1.age_op), (PARENT, AGE_OP_CONGESTED));
    // once: the partial after it is clean
    arrive(&mut leaf, &Pkt::data(1, 0, 2, &[1]), false);
    let up = arrive(&mut leaf, &Pkt::data(1, 1, 2, &[1]), false);
    assert_eq!(up[0].1.age_op, 0);
    assert_eq!((leaf.counters().ecn_ce, leaf.counters().congestion_marked), (1, 1));

    // at the root, a child's partial that arrives CE-marked marks the block
    let mut root = switch_with(JobSpec { members: vec![0, RANK], workers: 4, ..job(1, 2, 4) });
    arrive(&mut root, &Pkt::data(1, 0, 0, &[1]), false);
    let mut partial = Pkt::data(1, RANK, 0, &[5]);
    partial.repr.src_cnt = 3;
    let out = arrive_from(&mut root, 7, &partial.bytes(), true);
    assert!(out.len() == 2 && out.iter().all(|(_, r, _)| r.age_op == AGE_OP_CONGESTED), "{out:?}");
}

#[test]
fn handle_datagram_is_handle_datagram_ce_without_a_mark() {
    let mut a = switch_with(job(1, 2, 4));
    let mut b = switch_with(job(1, 2, 4));
    for src in 0..2 {
        let p = Pkt::data(1, src, 0, &[src as i32 + 1]);
        let mut out = VecTransmit::new();
        assert_eq!(a.handle_datagram(T0, 100 + src as u32, &p.bytes(), &mut out), Verdict::Consumed);
        assert_eq!(decode(out), arrive(&mut b, &p, false));
    }
    assert_eq!(a.counters(), b.counters());
}

#[test]
fn a_marked_result_handed_to_its_owner_shard_is_echoed_by_the_owner_alone() {
    // a leaf of two shards: a CE-marked result from the parent reaches the
    // shard that does not own its block; it hands it over (WrongShard) and
    // neither counts nor echoes it, the owner does both
    let spec = JobSpec { workers: 5, ..job(1, 2, 4) };
    let mut shards: Vec<ValueSwitch<Addr>> = (0..2)
        .map(|shard| {
            let mut sw = ValueSwitch::new(ShardConfig { shard, shard_count: 2, ..ShardConfig::single(1 << 30) });
            sw.add_job(spec.clone()).unwrap();
            sw.set_uplink(1, Some(Uplink { parent: vec![PARENT], rank: RANK })).unwrap();
            sw
        })
        .collect();
    let owner = |b: u32| crate::job::shard_of(1, b, 4, 2) as usize;
    let theirs = (0..8).find(|&b| owner(b) == 1).expect("a block of shard 1");
    let ours = (0..8).find(|&b| owner(b) == 0).expect("a block of shard 0");
    for src in 0..2 {
        arrive(&mut shards[1], &Pkt::data(1, src, theirs, &[1]), false);
    }
    let mut result = Pkt::data(1, 0, theirs, &[2]);
    result.repr.msg_type = MessageType::Result;
    result.repr.src_cnt = 5;
    let mut out = VecTransmit::new();
    assert_eq!(shards[0].handle_datagram_ce(T0, PARENT, &result.bytes(), true, &mut out), Verdict::WrongShard(1));
    assert_eq!(shards[0].counters().ecn_ce, 0, "counted where it is handled");
    assert_eq!(arrive_from(&mut shards[1], PARENT, &result.bytes(), true).len(), 2);
    // shard 0's next partial goes up unmarked; shard 1's carries the echo
    arrive(&mut shards[0], &Pkt::data(1, 0, ours, &[1]), false);
    let up = arrive(&mut shards[0], &Pkt::data(1, 1, ours, &[1]), false);
    assert_eq!((up[0].0, up[0].1.age_op), (PARENT, 0));
    let next = (theirs + 1..64).find(|&b| owner(b) == 1).unwrap();
    arrive(&mut shards[1], &Pkt::data(1, 0, next, &[1]), false);
    let up = arrive(&mut shards[1], &Pkt::data(1, 1, next, &[1]), false);
    assert_eq!((up[0].0, up[0].1.age_op), (PARENT, AGE_OP_CONGESTED));
    assert_eq!(shards[1].counters().ecn_ce, 1);
}
