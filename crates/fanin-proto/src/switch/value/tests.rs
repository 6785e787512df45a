//! Exact packet traces through one switch shard.

use super::*;
use crate::transmit::VecTransmit;
use fanin_wire::value::{read_elements, write_elements};

pub(super) type Addr = u32; // worker n lives at address 100 + n
const T0: Time = Time::ZERO;

fn switch_with(jobs: &[JobSpec]) -> ValueSwitch<Addr> {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 30));
    for j in jobs {
        sw.add_job(j.clone()).unwrap();
    }
    sw
}

pub(super) struct Pkt {
    pub(super) repr: Repr,
    pub(super) values: Vec<i32>,
}

impl Pkt {
    pub(super) fn data(job: u32, src: u16, block: u32, values: &[i32]) -> Self {
        Pkt {
            repr: Repr {
                msg_type: MessageType::Contribution,
                age_op: 0,
                final_block: false,
                degraded: false,
                exp_only: false,
                no_data: false,
                dtype: Dtype::Int32,
                src_id: src,
                src_cnt: 0,
                gen_id: 0,
                job_id: job,
                block_id: block,
                grad_cnt: values.len() as u16,
                exp: EXP_NONE,
                next_exp: EXP_NONE,
            },
            values: values.to_vec(),
        }
    }
    pub(super) fn float(mut self, exp: i8, next_exp: i8) -> Self {
        self.repr.dtype = Dtype::Float32;
        self.repr.exp = exp;
        self.repr.next_exp = next_exp;
        self
    }
    pub(super) fn exp_only(job: u32, src: u16, block: u32, exp: i8) -> Self {
        let mut p = Pkt::data(job, src, block, &[]).float(exp, EXP_NONE);
        p.repr.exp_only = true;
        p
    }
    pub(super) fn retransmission(mut self) -> Self {
        self.repr.msg_type = MessageType::Retransmission;
        self
    }
    pub(super) fn gen(mut self, gen_id: u16) -> Self {
        self.repr.gen_id = gen_id;
        self
    }
    pub(super) fn bytes(&self) -> Vec<u8> {
        let mut buf = vec![0; self.repr.buffer_len()];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        self.repr.emit(&mut p);
        write_elements(&self.values, p.payload_mut());
        buf
    }
}

fn send(sw: &mut ValueSwitch<Addr>, p: Pkt) -> Vec<(Addr, Repr, Vec<i32>)> {
    let mut out = VecTransmit::new();
    let from = 100 + p.repr.src_id as u32;
    assert_eq!(sw.handle_datagram(T0, from, &p.bytes(), &mut out), Verdict::Consumed);
    decode(out)
}

pub(super) fn decode(mut out: VecTransmit<Addr>) -> Vec<(Addr, Repr, Vec<i32>)> {
    out.drain()
        .map(|(a, bytes)| {
            let p = Packet::new_checked(&bytes[..]).expect("switch emits valid packets");
            let repr = Repr::parse(&p).unwrap();
            let mut vals = vec![0; if repr.msg_type.carries_block() { repr.grad_cnt as usize } else { 0 }];
            read_elements(p.payload(), &mut vals);
            (a, repr, vals)
        })
        .collect()
}

pub(super) fn job(id: u32, n: u16, slots: u32) -> JobSpec {
    JobSpec::with_sources(id, n, slots, 64)
}

#[test]
fn result_goes_to_every_member_when_the_last_contributes() {
    let mut sw = switch_with(&[job(1, 3, 4)]);
    assert!(send(&mut sw, Pkt::data(1, 0, 0, &[1, 2, i32::MAX])).is_empty());
    assert!(send(&mut sw, Pkt::data(1, 2, 0, &[10, 20, 1])).is_empty());
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[100, 200, 0]));
    assert_eq!(out.len(), 3);
    let dests: Vec<Addr> = out.iter().map(|o| o.0).collect();
    assert_eq!(dests, vec![100, 101, 102]);
    for (_, repr, vals) in &out {
        assert_eq!(repr.msg_type, MessageType::Result);
        assert_eq!((repr.job_id, repr.block_id, repr.src_cnt, repr.degraded), (1, 0, 3, false));
        assert_eq!(vals, &vec![111, 222, i32::MIN], "int32 sums wrap exactly");
    }
    let c = sw.counters();
    assert_eq!((c.accepted, c.blocks_completed, c.results_sent), (3, 1, 3));
}

#[test]
fn duplicate_contribution_is_never_added_twice() {
    let mut sw = switch_with(&[job(1, 2, 4)]);
    send(&mut sw, Pkt::data(1, 0, 0, &[5]));
    assert!(send(&mut sw, Pkt::data(1, 0, 0, &[5]).retransmission()).is_empty());
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[7]));
    assert_eq!(out[0].2, vec![12]);
    assert_eq!(sw.counters().duplicate, 1);
    assert_eq!(sw.counters().retransmissions, 1);
}

#[test]
fn a_retransmission_that_fills_a_hole_marks_the_result_congested_and_a_duplicate_does_not() {
    // docs/congestion.md: every member learns of a loss on one member's path
    // from the same result
    let mut sw = switch_with(&[job(1, 3, 4)]);
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    send(&mut sw, Pkt::data(1, 1, 0, &[2]));
    // member 2's first transmission was lost; its retransmission fills the hole
    let out = send(&mut sw, Pkt::data(1, 2, 0, &[3]).retransmission());
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|(_, r, v)| r.age_op == AGE_OP_CONGESTED && v == &vec![6]), "{out:?}");
    assert_eq!(sw.counters().congestion_marked, 1);
    // block 1: a spurious retransmission (a duplicate) and a straggler's
    // first transmission mark nothing
    send(&mut sw, Pkt::data(1, 0, 1, &[1]));
    send(&mut sw, Pkt::data(1, 0, 1, &[1]).retransmission());
    send(&mut sw, Pkt::data(1, 1, 1, &[2]));
    let out = send(&mut sw, Pkt::data(1, 2, 1, &[3]));
    assert!(out.iter().all(|(_, r, _)| r.age_op == 0), "{out:?}");
    // block 2: a retransmission into an empty block (nobody else arrived
    // yet: the worker's own timer, not a hole) marks nothing either
    send(&mut sw, Pkt::data(1, 0, 2, &[1]).retransmission());
    send(&mut sw, Pkt::data(1, 1, 2, &[1]));
    let out = send(&mut sw, Pkt::data(1, 2, 2, &[1]));
    assert!(out.iter().all(|(_, r, _)| r.age_op == 0), "{out:?}");
    assert_eq!(sw.counters().congestion_marked, 1);
}

#[test]
fn retransmission_for_a_completed_block_gets_the_result_again() {
    let mut sw = switch_with(&[job(1, 2, 4)]);
    send(&mut sw, Pkt::data(1, 0, 0, &[5]));
    send(&mut sw, Pkt::data(1, 1, 0, &[7]));
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[7]).retransmission());
    assert_eq!(out.len(), 1, "answered to the requester only");
    assert_eq!((out[0].0, out[0].2.clone()), (101, vec![12]));
    assert_eq!(sw.counters().results_resent, 1);
}

#[test]
fn shadow_copy_serves_a_member_whose_result_was_lost() {
    // 2 slots: block 2 reuses block 0's slot.
    let mut sw = switch_with(&[job(1, 2, 2)]);
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    send(&mut sw, Pkt::data(1, 1, 0, &[2])); // block 0 done; worker 1 loses the result
    send(&mut sw, Pkt::data(1, 0, 2, &[3])); // worker 0 moves on to block 2 (same slot)
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[2]).retransmission());
    assert_eq!(out[0].2, vec![3], "block 0's result is still there");
    // Once block 2 completes, block 0's copy is freed: everyone had it.
    let out = send(&mut sw, Pkt::data(1, 1, 2, &[4]));
    assert_eq!(out.len(), 2);
    // a request for it now is told the block expired (and which block the
    // slot holds), so a straggler stops asking
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[2]).retransmission());
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].1.msg_type, MessageType::Nack);
    assert_eq!(sw.counters().expired, 1);
}

#[test]
fn sender_ahead_of_the_slots_is_refused_until_the_slot_frees() {
    let mut sw = switch_with(&[job(1, 2, 2)]);
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    // block 2 needs slot 0, whose block 0 is still aggregating: back-pressure
    // (Trimmed, cause 2), not a silent drop
    let out = send(&mut sw, Pkt::data(1, 0, 2, &[1]));
    assert_eq!((out.len(), out[0].1.msg_type, out[0].1.block_id), (1, MessageType::Nack, 2));
    assert_eq!(sw.counters().slot_busy, 1);
    // far beyond the window of a slot in use
    assert!(send(&mut sw, Pkt::data(1, 0, 8, &[1])).is_empty());
    assert_eq!(sw.counters().out_of_window, 1);
    // an unused slot takes any block at or after the job's start: a worker
    // that joined a running job starts at the job's current offset
    assert!(send(&mut sw, Pkt::data(1, 0, 9, &[1])).is_empty());
    assert_eq!(sw.counters().out_of_window, 1);
    // the job still works
    assert_eq!(send(&mut sw, Pkt::data(1, 1, 0, &[1])).len(), 2);
}

#[test]
fn bad_sources_and_caps_are_counted_and_answered() {
    let mut sw = switch_with(&[job(1, 2, 4)]);
    assert!(send(&mut sw, Pkt::data(77, 0, 0, &[1])).is_empty());
    assert_eq!(sw.counters().unknown_job, 1);
    let out = send(&mut sw, Pkt::data(1, 5, 0, &[1]));
    assert_eq!(out[0].1.msg_type, MessageType::Nack);
    assert_eq!(sw.counters().non_member, 1);
    let big = vec![1; 65];
    let out = send(&mut sw, Pkt::data(1, 0, 0, &big));
    assert_eq!(out[0].1.msg_type, MessageType::Nack);
    assert_eq!(sw.counters().over_cap, 1);
    let mut o = VecTransmit::new();
    let _ = sw.handle_datagram(T0, 9, &[0xFA, 0x17, 1], &mut o);
    let _ = sw.handle_datagram(T0, 9, &[0xFA, 0x18, 1, 1, 0, 0, 0, 0], &mut o);
    assert!(o.is_empty());
    assert_eq!(sw.counters().malformed_total(), 2);
    assert_eq!(sw.counters().accepted, 0, "nothing was aggregated");
}

#[test]
fn shape_and_dtype_mismatches_are_refused() {
    let mut sw = switch_with(&[job(1, 3, 4)]);
    send(&mut sw, Pkt::data(1, 0, 0, &[1, 2]));
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[1]));
    let nack = out.first().expect("nack");
    assert_eq!(nack.1.msg_type, MessageType::Nack);
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[1, 1]).float(3, EXP_NONE));
    assert_eq!(out[0].1.msg_type, MessageType::Nack);
    assert_eq!(sw.counters().mismatch, 2);
}

#[test]
fn exponent_round_then_data_with_the_negotiated_exponent() {
    let mut sw = switch_with(&[job(1, 2, 4)]);
    assert!(send(&mut sw, Pkt::exp_only(1, 0, 0, 3)).is_empty());
    let out = send(&mut sw, Pkt::exp_only(1, 1, 0, 7));
    assert_eq!(out.len(), 2);
    for (_, repr, vals) in &out {
        assert!(repr.exp_only && repr.msg_type == MessageType::Result);
        assert_eq!((repr.exp, repr.grad_cnt), (7, 0));
        assert!(vals.is_empty());
    }
    // a worker that lost the exponent result asks again
    let out = send(&mut sw, Pkt::exp_only(1, 0, 0, 3).retransmission());
    assert_eq!((out.len(), out[0].1.exp), (1, 7));
    // wrong exponent is refused
    let out = send(&mut sw, Pkt::data(1, 0, 0, &[5]).float(3, EXP_NONE));
    assert_eq!(out[0].1.msg_type, MessageType::Nack);
    assert!(send(&mut sw, Pkt::data(1, 0, 0, &[5]).float(7, 2)).is_empty());
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[6]).float(7, 4));
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].1.exp, out[0].1.next_exp, out[0].2.clone()), (7, 4, vec![11]));
}

#[test]
fn data_during_an_exponent_round_ends_it_with_the_datas_exponent() {
    // Worker 0 lacks the lookahead exponent and opens the round; worker 1
    // has it (from the block one slot-cycle earlier) and sends data with it.
    let mut sw = switch_with(&[job(1, 2, 4)]);
    send(&mut sw, Pkt::exp_only(1, 0, 0, 3));
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[5]).float(6, EXP_NONE));
    assert!(out.iter().all(|o| o.1.exp_only && o.1.exp == 6), "the round's senders learn exponent 6");
    assert_eq!(out.len(), 2);
    assert_eq!(sw.counters().protocol_violation, 0);
    let out = send(&mut sw, Pkt::data(1, 0, 0, &[2]).float(6, EXP_NONE));
    assert_eq!((out.len(), out[0].1.exp, out[0].2.clone()), (2, 6, vec![7]));
}

#[test]
fn an_abstaining_worker_counts_as_arrived_adds_nothing_and_the_result_says_it_lacks_it() {
    // protocol.md 5.5: worker 2's values exceed the block's exponent (fixed
    // without it), so it sends `degraded` and zeros; what it sends is
    // never added, whatever the payload
    let mut sw = switch_with(&[job(1, 3, 4)]);
    assert!(send(&mut sw, Pkt::data(1, 0, 0, &[5, 6]).float(7, EXP_NONE)).is_empty());
    let mut abstains = Pkt::data(1, 2, 0, &[1000, 1000]).float(7, EXP_NONE);
    abstains.repr.degraded = true;
    assert!(send(&mut sw, abstains).is_empty(), "the block still waits for worker 1");
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[1, 1]).float(7, EXP_NONE));
    assert_eq!(out.len(), 3, "the result goes to every member, the abstainer too");
    for (_, repr, vals) in &out {
        assert_eq!((repr.src_cnt, repr.degraded, vals.clone()), (2, true, vec![6, 7]));
    }
    // a block that opens with an abstention: nothing of it in the sum
    let mut first = Pkt::data(1, 2, 1, &[9, 9]).float(3, EXP_NONE);
    first.repr.degraded = true;
    send(&mut sw, first);
    send(&mut sw, Pkt::data(1, 0, 1, &[1, 2]).float(3, EXP_NONE));
    let out = send(&mut sw, Pkt::data(1, 1, 1, &[3, 4]).float(3, EXP_NONE));
    assert!(out.iter().all(|(_, r, v)| (r.src_cnt, r.degraded, v.clone()) == (2, true, vec![4, 6])), "{out:?}");
    assert_eq!(sw.counters().protocol_violation, 0);
}

#[test]
fn jobs_are_isolated_and_memory_is_reserved() {
    // what one job costs: its buffers and its record
    let mut probe = ValueSwitch::<Addr>::new(ShardConfig::single(1 << 30));
    probe.add_job(job(1, 2, 4)).unwrap();
    let one = probe.memory_used();
    assert!(one > 2 * 4 * 64 * 4, "the record is counted on top of the buffers: {one}");
    let mut sw = ValueSwitch::<Addr>::new(ShardConfig::single(2 * one));
    sw.add_job(job(1, 2, 4)).unwrap();
    sw.add_job(job(2, 2, 4)).unwrap();
    let err = sw.add_job(job(3, 2, 4)).unwrap_err();
    assert!(matches!(err, AdmitError::OutOfMemory { job_id: 3, .. }), "{err}");
    assert_eq!(sw.add_job(job(2, 2, 4)).unwrap_err(), AdmitError::Duplicate(2));
    // job 1 floods out-of-window and oversized packets; job 2 is unaffected
    for b in 0..100 {
        let _ = send(&mut sw, Pkt::data(1, 0, 1000 + b, &[1]));
        let _ = send(&mut sw, Pkt::data(1, 0, 0, &[1; 65]));
    }
    send(&mut sw, Pkt::data(2, 0, 0, &[1]));
    let out = send(&mut sw, Pkt::data(2, 1, 0, &[2]));
    assert_eq!(out[0].2, vec![3]);
    assert!(sw.remove_job(1));
    sw.add_job(job(3, 2, 4)).unwrap();
}

#[test]
fn forward_mode_reflects_without_state() {
    let mut spec = job(5, 2, 4);
    spec.mode = JobMode::Forward;
    let mut sw = switch_with(&[spec]);
    let out = send(&mut sw, Pkt::data(5, 1, 0, &[9, 8]));
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].1.msg_type, out[0].2.clone()), (101, MessageType::Result, vec![9, 8]));
    assert_eq!(sw.counters().forwarded, 1);
    let record = sw.memory_used();
    assert!(record > 0 && record < 4096, "a forward job reserves no buffers, only its record: {record}");
    assert!(sw.remove_job(5));
    assert_eq!(sw.memory_used(), 0);
}

#[test]
fn forward_mode_reflects_a_no_data_contribution_as_a_header() {
    // found by the `machines` fuzz target: a reduce-scatter worker's
    // contribution to a block it does not own (no_data, with its lanes) came
    // back as a Result with no_data *and* lanes, a packet no receiver accepts
    let mut spec = job(5, 2, 4);
    spec.mode = JobMode::Forward;
    let mut sw = switch_with(&[spec]);
    let mut p = Pkt::data(5, 1, 0, &[9, 8]);
    p.repr.no_data = true;
    let out = send(&mut sw, p);
    assert_eq!(out.len(), 1);
    let (to, repr, vals) = &out[0];
    assert_eq!((*to, repr.msg_type, repr.no_data, repr.grad_cnt, vals.len()), (101, MessageType::Result, true, 0, 0));
    assert_eq!(sw.counters().forwarded, 1);
}

#[test]
fn job_records_count_against_the_limit_so_many_large_jobs_are_bounded_and_exact() {
    // found by a user: 6 256 jobs of block_cnt_max 1 with 4 096 members took
    // the switch to 2.3 GB while memory_used stayed 0 of 1 GiB
    let limit = 64 << 20;
    let mut sw = ValueSwitch::<Addr>::new(ShardConfig::single(limit));
    let mut admitted = Vec::new();
    for id in 1..=2000u32 {
        match sw.add_job(JobSpec { members: (0..4096).collect(), ..job(id, 1, 1) }) {
            Ok(()) => admitted.push(id),
            Err(AdmitError::OutOfMemory { needed, .. }) => {
                assert!(needed > 4096 * 16, "a record of 4 096 members costs {needed} bytes");
                assert!(admitted.len() as u64 * needed <= limit, "{} jobs of {needed} bytes", admitted.len());
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(!admitted.is_empty() && admitted.len() < 2000, "refused once 64 MiB were taken");
    assert!(sw.memory_used() <= limit);
    for id in admitted {
        assert!(sw.remove_job(id));
    }
    assert_eq!(sw.memory_used(), 0, "exact after removals");
}

#[test]
fn blocks_of_other_shards_are_handed_over() {
    let cfg = ShardConfig { shard: 0, shard_count: 2, ..ShardConfig::single(1 << 20) };
    let mut sw = ValueSwitch::<Addr>::new(cfg);
    sw.add_job(job(1, 2, 4)).unwrap();
    let theirs = (0..4).find(|&b| shard_of(1, b, 4, 2) == 1).unwrap();
    let mut out = VecTransmit::new();
    let v = sw.handle_datagram(T0, 100, &Pkt::data(1, 0, theirs, &[1]).bytes(), &mut out);
    assert_eq!(v, Verdict::WrongShard(1));
}

#[test]
fn join_answers_with_parameters_or_a_reason() {
    let mut spec = job(4, 3, 16);
    spec.block_exp_ms = 10;
    let mut sw = switch_with(&[spec]);
    let mut join = Pkt::data(4, 2, 0, &[]);
    join.repr.msg_type = MessageType::Join;
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(T0, 102, &join.bytes(), &mut out);
    let (dest, bytes) = out.drain().next().unwrap();
    let p = Packet::new_checked(&bytes[..]).unwrap();
    let params = JoinParams::parse(p.payload()).unwrap();
    assert_eq!(dest, 102);
    assert_eq!(p.src_cnt(), 3);
    assert_eq!((params.block_cnt_max, params.block_grad_max, params.block_exp_ms), (16, 64, 10));
    join.repr.job_id = 99;
    let _ = sw.handle_datagram(T0, 102, &join.bytes(), &mut out);
    let (_, bytes) = out.drain().next().unwrap();
    let p = Packet::new_checked(&bytes[..]).unwrap();
    assert_eq!(Nack::parse(p.payload()).unwrap().reason, NackReason::UnknownJob);
}

/// A Join from `src` of job `job`, saying whether it listens on the
/// job's result group; returns the JoinAck's parameters.
fn join_listening(sw: &mut ValueSwitch<Addr>, job: u32, src: u16, listens: bool) -> JoinParams {
    let mut join = Pkt::data(job, src, 0, &[]);
    join.repr.msg_type = MessageType::Join;
    join.repr.final_block = listens;
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(T0, 100 + src as u32, &join.bytes(), &mut out);
    let (dest, bytes) = out.drain().next().expect("a JoinAck");
    assert_eq!(dest, 100 + src as u32);
    JoinParams::parse(Packet::new_checked(&bytes[..]).unwrap().payload()).unwrap()
}

#[test]
fn a_result_goes_once_to_the_group_and_by_unicast_to_members_not_listening() {
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let mut sw = switch_with(&[JobSpec { result_group: Some(group), ..job(1, 3, 4) }]);
    assert!(join_listening(&mut sw, 1, 0, true).results_on_group);
    assert!(!join_listening(&mut sw, 1, 1, false).results_on_group);
    assert!(join_listening(&mut sw, 1, 2, true).results_on_group);
    let mut out = VecTransmit::new();
    out.groups_reachable = true;
    for (src, v) in [(0u16, 1), (1, 10), (2, 100)] {
        let _ = sw.handle_datagram(T0, 100 + src as u32, &Pkt::data(1, src, 0, &[v]).bytes(), &mut out);
    }
    assert_eq!(out.group_datagrams.len(), 1, "one datagram for both listeners");
    let (to, bytes) = &out.group_datagrams[0];
    assert_eq!(*to, group);
    let unicast = decode(out.clone());
    assert_eq!(unicast.iter().map(|o| o.0).collect::<Vec<_>>(), vec![101], "the member not listening");
    assert_eq!(&out.datagrams[0].1, bytes, "the same result bytes both ways");
    assert_eq!(unicast[0].2, vec![111]);
    let c = sw.counters();
    assert_eq!((c.results_to_group, c.results_sent), (1, 1));

    // A retransmission after completion is answered to its sender alone.
    let again = send(&mut sw, Pkt::data(1, 2, 0, &[100]).retransmission());
    assert_eq!(again.iter().map(|o| o.0).collect::<Vec<_>>(), vec![102]);
    assert_eq!(again[0].2, vec![111]);

    // A runtime that cannot reach groups (the simulator): unicast to all.
    let mut out = VecTransmit::new();
    for (src, v) in [(0u16, 2), (1, 20), (2, 200)] {
        let _ = sw.handle_datagram(T0, 100 + src as u32, &Pkt::data(1, src, 1, &[v]).bytes(), &mut out);
    }
    assert!(out.group_datagrams.is_empty());
    assert_eq!(decode(out).iter().map(|o| o.0).collect::<Vec<_>>(), vec![100, 101, 102]);

    // Joining again without the flag (restarted without the group) turns
    // the group off for that member: nobody listens, so no group datagram.
    assert!(!join_listening(&mut sw, 1, 0, false).results_on_group);
    assert!(!join_listening(&mut sw, 1, 2, false).results_on_group);
    let mut out = VecTransmit::new();
    out.groups_reachable = true;
    for (src, v) in [(0u16, 3), (1, 30), (2, 300)] {
        let _ = sw.handle_datagram(T0, 100 + src as u32, &Pkt::data(1, src, 2, &[v]).bytes(), &mut out);
    }
    assert!(out.group_datagrams.is_empty());
    assert_eq!(decode(out).len(), 3);
}

#[test]
fn owner_only_results_give_the_sum_to_owners_and_a_header_to_the_others() {
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let mut sw = switch_with(&[JobSpec { result_group: Some(group), ..job(1, 3, 4) }]);
    for src in 0..3 {
        assert!(join_listening(&mut sw, 1, src, true).results_on_group);
    }
    let no_data = |mut p: Pkt| {
        p.repr.no_data = true;
        p
    };
    // member 1 owns block 0; members 0 and 2 do not
    let mut out = VecTransmit::new();
    out.groups_reachable = true;
    for p in [no_data(Pkt::data(1, 0, 0, &[1])), Pkt::data(1, 1, 0, &[10]), no_data(Pkt::data(1, 2, 0, &[100]))] {
        let _ = sw.handle_datagram(T0, 100 + p.repr.src_id as u32, &p.bytes(), &mut out);
    }
    assert!(out.group_datagrams.is_empty(), "a group would carry the sum to every listener");
    let got = decode(out);
    assert_eq!(got.len(), 3);
    for (to, repr, vals) in &got {
        assert_eq!((repr.msg_type, repr.src_cnt, repr.degraded), (MessageType::Result, 3, false));
        if *to == 101 {
            assert_eq!((repr.no_data, vals.as_slice()), (false, &[111][..]), "the owner gets the sum");
        } else {
            assert_eq!((repr.no_data, repr.grad_cnt), (true, 0), "to {to}: a header without the sum");
        }
    }
    let c = sw.counters();
    assert_eq!((c.results_sent, c.results_without_data, c.results_to_group), (3, 2, 0));
    // a retransmission to the completed block is answered by its own bit
    let again = send(&mut sw, no_data(Pkt::data(1, 2, 0, &[100])).retransmission());
    assert_eq!((again[0].0, again[0].1.no_data), (102, true));
    let again = send(&mut sw, Pkt::data(1, 2, 0, &[100]).retransmission());
    assert_eq!((again[0].1.no_data, again[0].2.as_slice()), (false, &[111][..]));
    assert_eq!(sw.counters().results_without_data, 3);
    // a block nobody says no_data to still goes once to the group
    let mut out = VecTransmit::new();
    out.groups_reachable = true;
    for src in 0..3u16 {
        let _ = sw.handle_datagram(T0, 100 + src as u32, &Pkt::data(1, src, 1, &[1]).bytes(), &mut out);
    }
    assert_eq!(out.group_datagrams.len(), 1);
}

#[test]
fn a_change_of_listening_is_reported_for_the_other_shards() {
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let mut sw = switch_with(&[JobSpec { result_group: Some(group), ..job(1, 2, 4) }]);
    let mut join = Pkt::data(1, 1, 0, &[]);
    join.repr.msg_type = MessageType::Join;
    join.repr.final_block = true;
    let mut out = VecTransmit::new();
    let listening = Verdict::Listening { job_id: 1, member: 1, listens: true };
    assert_eq!(sw.handle_datagram(T0, 101, &join.bytes(), &mut out), listening);
    assert_eq!(sw.handle_datagram(T0, 101, &join.bytes(), &mut out), Verdict::Consumed, "no change, nothing to tell");
    join.repr.final_block = false;
    let stopped = Verdict::Listening { job_id: 1, member: 1, listens: false };
    assert_eq!(sw.handle_datagram(T0, 101, &join.bytes(), &mut out), stopped);
    // what another shard does with it
    let mut other = switch_with(&[JobSpec { result_group: Some(group), ..job(1, 2, 4) }]);
    other.set_listening(1, 0, true);
    other.set_listening(1, 1, true);
    out.datagrams.clear();
    out.groups_reachable = true;
    for src in 0..2u16 {
        let _ = other.handle_datagram(T0, 100 + src as u32, &Pkt::data(1, src, 0, &[1]).bytes(), &mut out);
    }
    assert_eq!((out.group_datagrams.len(), out.datagrams.len()), (1, 0));
}

#[test]
fn a_job_without_a_group_ignores_the_listening_flag() {
    let mut sw = switch_with(&[job(1, 2, 4)]);
    assert!(!join_listening(&mut sw, 1, 0, true).results_on_group);
    assert!(!join_listening(&mut sw, 1, 1, true).results_on_group);
    let mut out = VecTransmit::new();
    out.groups_reachable = true;
    for src in 0..2u16 {
        let _ = sw.handle_datagram(T0, 100 + src as u32, &Pkt::data(1, src, 0, &[1]).bytes(), &mut out);
    }
    assert!(out.group_datagrams.is_empty());
    assert_eq!(decode(out).len(), 2);
}

#[test]
fn a_job_of_300_sources_completes_only_with_all_of_them() {
    let mut sw = switch_with(&[JobSpec::with_sources(9, 300, 4, 8)]);
    for src in 0..299u16 {
        assert!(send(&mut sw, Pkt::data(9, src, 0, &[src as i32, 1])).is_empty(), "source {src}");
    }
    // a repeat of source 255 (bit beyond the first 4 mask words) is a duplicate
    assert!(send(&mut sw, Pkt::data(9, 255, 0, &[1, 1])).is_empty());
    assert_eq!(sw.counters().duplicate, 1);
    let out = send(&mut sw, Pkt::data(9, 299, 0, &[299, 1]));
    assert_eq!(out.len(), 300, "the result goes to all 300 members");
    assert_eq!(out[0].2, vec![(0..300).sum::<i32>(), 300]);
    assert_eq!(out[0].1.src_cnt, 300);
}

// ---- aggregation trees (SwitchML++): a switch with a parent ----

const PARENT: Addr = 1;
const RANK: u16 = SWITCH_RANK_BASE;

fn send_from(sw: &mut ValueSwitch<Addr>, from: Addr, bytes: &[u8]) -> Vec<(Addr, Repr, Vec<i32>)> {
    let mut out = VecTransmit::new();
    assert_eq!(sw.handle_datagram(T0, from, bytes, &mut out), Verdict::Consumed);
    decode(out)
}

/// A leaf of job 1 with workers 0 and 1 under parent address 1.
fn leaf() -> ValueSwitch<Addr> {
    let mut sw = switch_with(&[JobSpec { workers: 5, ..job(1, 2, 4) }]);
    sw.set_uplink(1, Some(Uplink { parent: vec![PARENT], rank: RANK })).unwrap();
    sw
}

fn parent_result(block: u32, src_cnt: u16, values: &[i32]) -> Vec<u8> {
    let mut p = Pkt::data(1, 0, block, values);
    p.repr.msg_type = MessageType::Result;
    p.repr.src_cnt = src_cnt;
    p.bytes()
}

#[test]
fn leaf_sends_one_partial_up_and_relays_the_result_down() {
    let mut sw = leaf();
    assert!(send(&mut sw, Pkt::data(1, 0, 0, &[1, 2])).is_empty());
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[10, 20]));
    assert_eq!(out.len(), 1, "one partial, to the parent only");
    let (dest, repr, vals) = &out[0];
    assert_eq!((*dest, repr.msg_type, repr.src_id, repr.src_cnt), (PARENT, MessageType::Contribution, RANK, 2));
    assert_eq!(vals, &vec![11, 22]);
    // a child's retransmission while the parent's answer is outstanding:
    // the cached partial goes up again, nothing is added
    let out = send(&mut sw, Pkt::data(1, 0, 0, &[1, 2]).retransmission());
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].1.msg_type, out[0].2.clone()), (PARENT, MessageType::Retransmission, vec![11, 22]));
    assert_eq!(sw.counters().resent_up, 1);
    assert_eq!(sw.counters().accepted, 2);
    // the other child asking too is the same round: nothing more goes up ...
    assert!(send(&mut sw, Pkt::data(1, 1, 0, &[10, 20]).retransmission()).is_empty());
    // ... a round later (one request per child) the partial goes up again
    assert_eq!(send(&mut sw, Pkt::data(1, 0, 0, &[1, 2]).retransmission()).len(), 1);
    assert_eq!(sw.counters().resent_up, 2);
    // the parent's result goes to every child, with the tree's source count
    let out = send_from(&mut sw, PARENT, &parent_result(0, 5, &[111, 222]));
    assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), vec![100, 101]);
    assert!(out.iter().all(|o| o.1.msg_type == MessageType::Result && o.1.src_cnt == 5 && o.2 == vec![111, 222]));
    // a lost result is answered from the cache, without the parent
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[10, 20]).retransmission());
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].2.clone()), (101, vec![111, 222]));
    // the parent's duplicate answer changes nothing
    assert!(send_from(&mut sw, PARENT, &parent_result(0, 5, &[111, 222])).is_empty());
    assert_eq!(sw.counters().parent_stale, 1);
    // results from anyone but the parent are refused
    assert!(send_from(&mut sw, 77, &parent_result(1, 5, &[1, 1])).is_empty());
    assert_eq!(sw.counters().protocol_violation, 1);
}

/// A tree's switch has no rounds: a plain Join from a new process of a rank
/// that already joined it would be answered with the stream's start, where
/// the parent still holds the old process's results. It is refused (the
/// nack names the rank), and the rank's address stays the old process's.
/// The same process again and a deliberate sync join are answered.
#[test]
fn a_leaf_refuses_a_new_process_of_a_rank_that_already_joined_it() {
    let join = |inc: u16, age_op: u8| {
        let mut j = Pkt::data(1, 0, 0, &[]);
        j.repr.msg_type = MessageType::Join;
        j.repr.src_cnt = inc; // a Join's member incarnation
        j.repr.age_op = age_op;
        j.bytes()
    };
    let mut sw = leaf();
    for again in [false, true] {
        let out = send_from(&mut sw, 100, &join(7, 0));
        assert_eq!((out[0].0, out[0].1.msg_type), (100, MessageType::JoinAck), "{out:?}");
        // the same process's Join again is its probe, which the leaf
        // passes up as a probe of its own (the restart may be there)
        let up: Vec<_> = out[1..].iter().map(|(d, r, _)| (*d, r.msg_type, r.src_id)).collect();
        let want = if again { vec![(PARENT, MessageType::Join, SWITCH_RANK_BASE)] } else { vec![] };
        assert_eq!(up, want, "{out:?}");
    }
    // the old process runs a block with worker 1, the parent answers
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    send(&mut sw, Pkt::data(1, 1, 0, &[2]));
    send_from(&mut sw, PARENT, &parent_result(0, 2, &[3]));
    // a new process of rank 0 (from another port) is refused
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(T0, 200, &join(9, 0), &mut out);
    let (dest, bytes) = out.drain().next().expect("a nack");
    let nack = Nack::parse(Packet::new_checked(&bytes[..]).unwrap().payload()).unwrap();
    assert_eq!((dest, nack.reason, nack.detail), (200, NackReason::RerunInTree, 0));
    assert_eq!(sw.counters().rerun_in_tree, 1);
    // ... and is not taken for rank 0: block 0's result still goes to the old process
    let out = send(&mut sw, Pkt::data(1, 0, 0, &[1]).retransmission());
    assert_eq!((out[0].0, out[0].2.clone()), (100, vec![3]));
    // a sync join into the running stream is asked of the parent, and
    // the incarnation it brings is the rank's from then on
    let out = send_from(&mut sw, 200, &join(9, JOIN_SYNC));
    assert_eq!((out[0].0, out[0].1.msg_type), (PARENT, MessageType::Sync), "{out:?}");
    let out = send_from(&mut sw, 200, &join(9, 0));
    assert_eq!(out[0].1.msg_type, MessageType::JoinAck);
    assert_eq!(sw.counters().rerun_in_tree, 1);
}

/// A tree's switch tells two processes of a rank apart by all 48 bits of
/// their member incarnations: a plain Join with the same low 16 bits and
/// other high bits (a plain Join's block_id) is a new process and refused;
/// a recovery Join, which says the low bits alone, is the same process, and
/// so is its probe afterwards.
#[test]
fn a_leaf_tells_processes_apart_by_the_high_bits_of_their_incarnations() {
    use fanin_wire::value::JOIN_RECOVER;
    let join = |high: u32, age_op: u8| {
        let mut j = Pkt::data(1, 0, high, &[]);
        j.repr.msg_type = MessageType::Join;
        j.repr.src_cnt = 7;
        j.repr.age_op = age_op;
        j.bytes()
    };
    let mut sw = leaf();
    let out = send_from(&mut sw, 100, &join(1, 0));
    assert_eq!(out[0].1.msg_type, MessageType::JoinAck, "{out:?}");
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(T0, 200, &join(2, 0), &mut out);
    let (dest, bytes) = out.drain().next().expect("a nack");
    let nack = Nack::parse(Packet::new_checked(&bytes[..]).unwrap().payload()).unwrap();
    assert_eq!((dest, nack.reason), (200, NackReason::RerunInTree));
    // a recovery join (low bits only: its block_id is its lowest block)
    let _ = sw.handle_datagram(T0, 100, &join(5, JOIN_RECOVER), &mut VecTransmit::new());
    assert_eq!(sw.counters().rerun_in_tree, 1);
    // ... keeps the high bits known: the old process's probe is answered,
    // another process still refused
    let out = send_from(&mut sw, 100, &join(1, 0));
    assert_eq!(out[0].1.msg_type, MessageType::JoinAck, "{out:?}");
    let _ = sw.handle_datagram(T0, 300, &join(3, 0), &mut VecTransmit::new());
    assert_eq!(sw.counters().rerun_in_tree, 2);
}

/// A leaf that restarted while its tree ran (the control plane installed
/// the job again, `resumed`) has forgotten the processes it saw, and its
/// parent may hold results of the stream from its start: a plain Join from
/// a rank that has not joined this life is refused with the switch's
/// incarnation (a new run fails on it, a running worker probing for the
/// restart recovers on it), and is not taken for the rank. A recovery join
/// is answered and binds the rank's process, whose later probes are
/// answered; a sync join goes to the parent. A leaf that did not restart
/// answers the same plain Join.
#[test]
fn a_resumed_leaf_takes_only_recovery_and_sync_joins_from_ranks_new_to_it() {
    use fanin_wire::value::JOIN_RECOVER;
    let join = |src: u16, inc: u16, age_op: u8| {
        let mut j = Pkt::data(1, src, 0, &[]);
        j.repr.msg_type = MessageType::Join;
        j.repr.src_cnt = inc; // a Join's member incarnation
        j.repr.age_op = age_op;
        j.bytes()
    };
    let out = send_from(&mut leaf(), 100, &join(0, 7, 0));
    assert_eq!(out[0].1.msg_type, MessageType::JoinAck, "a leaf that did not restart: {out:?}");
    let mut sw = switch_with(&[JobSpec { workers: 5, resumed: true, ..job(1, 2, 4) }]);
    sw.set_uplink(1, Some(Uplink { parent: vec![PARENT], rank: RANK })).unwrap();
    for (src, inc) in [(0, 7), (1, 0)] {
        let mut out = VecTransmit::new();
        let _ = sw.handle_datagram(T0, 100 + src as u32, &join(src, inc, 0), &mut out);
        let (dest, bytes) = out.drain().next().expect("a nack");
        let nack = Nack::parse(Packet::new_checked(&bytes[..]).unwrap().payload()).unwrap();
        let incarnation = ShardConfig::single(1 << 30).incarnation;
        assert_eq!((dest, nack.reason, nack.detail), (100 + src as u32, NackReason::TreeSwitchRestarted, incarnation));
    }
    assert_eq!((sw.counters().resumed_refused, sw.counters().rerun_in_tree), (2, 0));
    // not taken for rank 0: a contribution's result would not go there
    assert!(send(&mut sw, Pkt::data(1, 1, 0, &[2])).is_empty());
    // rank 0's worker recovers (the floor waits for rank 1 as well)...
    assert!(send_from(&mut sw, 100, &join(0, 7, JOIN_RECOVER)).is_empty());
    let mut out = VecTransmit::new();
    let verdict = sw.handle_datagram(T0, 101, &join(1, 9, JOIN_RECOVER), &mut out);
    assert!(matches!(verdict, Verdict::Recovered { floor: 0, .. }), "{verdict:?}");
    let out = decode(out);
    assert!(out.len() == 2 && out.iter().all(|(_, r, _)| r.msg_type == MessageType::JoinAck && r.age_op == JOIN_RECOVER), "{out:?}");
    // ... and its probes are answered from then on; another process is not
    let out = send_from(&mut sw, 100, &join(0, 7, 0));
    assert_eq!(out[0].1.msg_type, MessageType::JoinAck, "{out:?}");
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(T0, 200, &join(0, 8, 0), &mut out);
    let (_, bytes) = out.drain().next().expect("a nack");
    assert_eq!(Nack::parse(Packet::new_checked(&bytes[..]).unwrap().payload()).unwrap().reason, NackReason::RerunInTree);
    // a sync join of a rank new to this life is asked of the parent
    let mut sw = switch_with(&[JobSpec { workers: 5, resumed: true, ..job(1, 2, 4) }]);
    sw.set_uplink(1, Some(Uplink { parent: vec![PARENT], rank: RANK })).unwrap();
    let out = send_from(&mut sw, 100, &join(0, 7, JOIN_SYNC));
    assert_eq!((out[0].0, out[0].1.msg_type), (PARENT, MessageType::Sync), "{out:?}");
}

/// A child that was in a block this switch sent up, and sends the block
/// after it in the same slot, no longer asks for the first: the switch
/// asks its parent again (the answer frees the slot) while the new block
/// is refused as "slot busy" as before. (Nothing asked the parent, and the
/// slot stayed busy for ever: see the elastic test of a partial from a
/// previous tree.)
#[test]
fn a_child_past_a_block_that_waits_for_the_parent_makes_the_switch_ask_again() {
    let mut sw = leaf();
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    assert_eq!(send(&mut sw, Pkt::data(1, 1, 0, &[2]))[0].0, PARENT);
    let out = send(&mut sw, Pkt::data(1, 0, 4, &[1]));
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!((out[0].0, out[0].1.msg_type), (100, MessageType::Nack));
    assert_eq!((out[1].0, out[1].1.msg_type, out[1].1.block_id, out[1].2.clone()), (PARENT, MessageType::Retransmission, 0, vec![3]));
    assert_eq!(sw.counters().slot_busy, 1);
    // the parent's answer frees the slot: block 4 opens
    send_from(&mut sw, PARENT, &parent_result(0, 5, &[3]));
    assert!(send(&mut sw, Pkt::data(1, 0, 4, &[1])).is_empty());
    assert_eq!(send(&mut sw, Pkt::data(1, 1, 4, &[1]))[0].2, vec![2]);
}

#[test]
fn a_contribution_cut_to_its_header_by_the_network_is_answered_with_a_trimmed_nack_and_never_added() {
    // docs/protocol.md §4.14
    let mut sw = switch_with(&[job(1, 2, 4)]);
    let whole = Pkt::data(1, 0, 0, &[5, 6, 7]).bytes();
    let out = send_from(&mut sw, 100, &whole[..HEADER_LEN]);
    assert_eq!(out.len(), 1, "one nack, to the sender");
    let (dest, repr, _) = &out[0];
    assert_eq!((*dest, repr.msg_type, repr.src_id, repr.block_id), (100, MessageType::Nack, 0, 0));
    let c = sw.counters();
    assert_eq!((c.trimmed_in_network, c.accepted, c.malformed.iter().sum::<u64>()), (1, 0, 0));
    // the nack says why: the network trimmed it
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(T0, 100, &whole[..HEADER_LEN], &mut out);
    let (_, nack) = out.drain().next().unwrap();
    let nack = Nack::parse(Packet::new_checked(&nack[..]).unwrap().payload()).unwrap();
    assert_eq!((nack.reason, TrimCause::from_detail(nack.detail)), (NackReason::Trimmed, Some(TrimCause::Network)));
    // the resent whole contribution is added once, and the block completes
    assert!(send(&mut sw, Pkt::data(1, 0, 0, &[5, 6, 7]).retransmission()).is_empty());
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[1, 1, 1]));
    assert!(out.iter().all(|o| o.2 == vec![6, 7, 8]) && out.len() == 2);
    // a cut anywhere else than the header is malformed, not a trim
    send_from(&mut sw, 100, &Pkt::data(1, 0, 1, &[5, 6, 7]).bytes()[..HEADER_LEN + 4]);
    assert_eq!(sw.counters().trimmed_in_network, 2);
    assert_eq!(sw.counters().malformed.iter().sum::<u64>(), 1);
}

#[test]
fn in_a_tree_a_trim_on_either_side_of_the_uplink_resends_the_partial_at_once() {
    let mut sw = leaf();
    send(&mut sw, Pkt::data(1, 0, 0, &[1, 2]));
    assert_eq!(send(&mut sw, Pkt::data(1, 1, 0, &[10, 20])).len(), 1, "the partial went up");
    // the parent's answer: a Trimmed nack of cause Network (the partial was
    // cut on the uplink): the cached partial goes up again at once
    let mut nack = vec![0u8; HEADER_LEN + Nack::LEN];
    let partial = Pkt::data(1, RANK, 0, &[11, 22]).bytes();
    Nack { reason: NackReason::Trimmed, detail: TrimCause::Network as u32 }
        .emit_reply(&Packet::new_checked(&partial[..]).unwrap(), true, &mut nack);
    let out = send_from(&mut sw, PARENT, &nack);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].1.msg_type, out[0].2.clone()), (PARENT, MessageType::Retransmission, vec![11, 22]));
    // an overloaded parent's own trim is not resent into the overload (the
    // children's retransmissions recover it)
    let mut busy = nack.clone();
    Nack { reason: NackReason::Trimmed, detail: TrimCause::ProcessingQueue as u32 }
        .emit_reply(&Packet::new_checked(&partial[..]).unwrap(), true, &mut busy);
    assert!(send_from(&mut sw, PARENT, &busy).is_empty());
    assert_eq!(sw.counters().parent_trimmed, 1);
    // the parent's result cut to its header on the way down: ask again
    let cut = parent_result(0, 5, &[111, 222]);
    let out = send_from(&mut sw, PARENT, &cut[..HEADER_LEN]);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].1.msg_type, out[0].2.clone()), (PARENT, MessageType::Retransmission, vec![11, 22]));
    assert_eq!((sw.counters().resent_up, sw.counters().trimmed_in_network), (2, 1));
    // the whole result then goes down; a cut copy after it is stale
    assert_eq!(send_from(&mut sw, PARENT, &cut).len(), 2);
    assert!(send_from(&mut sw, PARENT, &cut[..HEADER_LEN]).is_empty());
    assert_eq!(sw.counters().parent_stale, 1, "the late cut copy");
}

#[test]
fn an_overloaded_parents_trim_marks_the_next_partial_up_so_the_root_slows_every_member() {
    let mut sw = leaf();
    // block b through the leaf: its partial's age_op, then the parent's result
    let mut run = |sw: &mut ValueSwitch<Addr>, b: u32, trim: Option<TrimCause>| {
        send(sw, Pkt::data(1, 0, b, &[1]));
        let out = send(sw, Pkt::data(1, 1, b, &[2]));
        assert_eq!((out[0].0, out[0].1.block_id), (PARENT, b));
        if let Some(cause) = trim {
            // the parent trimmed the partial for `cause`
            let partial = Pkt::data(1, RANK, b, &[3]).bytes();
            let mut nack = vec![0u8; HEADER_LEN + Nack::LEN];
            Nack { reason: NackReason::Trimmed, detail: cause as u32 }
                .emit_reply(&Packet::new_checked(&partial[..]).unwrap(), true, &mut nack);
            assert!(send_from(sw, PARENT, &nack).is_empty(), "{cause:?}: nothing resent into the overload");
        }
        assert_eq!(send_from(sw, PARENT, &parent_result(b, 2, &[3])).len(), 2);
        out[0].1.age_op
    };
    let mut b = 0;
    for (cause, marks) in [(TrimCause::ProcessingQueue, true), (TrimCause::RateLimited, true), (TrimCause::MemoryExhausted, false)] {
        assert_eq!(run(&mut sw, b, Some(cause)), 0, "an unmarked partial");
        // the next partial carries the mark up, once
        let want = if marks { AGE_OP_CONGESTED } else { 0 };
        assert_eq!(run(&mut sw, b + 1, None), want, "{cause:?}");
        assert_eq!(run(&mut sw, b + 2, None), 0, "{cause:?}: one mark per trim");
        b += 3;
    }
    assert_eq!(sw.counters().parent_trimmed, 2);
}

#[test]
fn in_a_tree_a_mark_goes_up_with_the_partial_and_the_roots_verdict_comes_down() {
    // block 0: worker 1's first transmission was lost; its retransmission
    // fills the hole, so the partial going up carries the mark
    let mut sw = leaf();
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[2]).retransmission());
    assert_eq!((out[0].0, out[0].1.age_op), (PARENT, AGE_OP_CONGESTED));
    // the root's unmarked verdict comes down unmarked (the leaf's own mark
    // is in it already, or the root saw none), and a marked one marked, so
    // every member of the job sees the same marks
    let out = send_from(&mut sw, PARENT, &parent_result(0, 5, &[3]));
    assert!(out.iter().all(|o| o.1.age_op == 0), "{out:?}");
    send(&mut sw, Pkt::data(1, 0, 1, &[1]));
    send(&mut sw, Pkt::data(1, 1, 1, &[1]));
    let mut marked = Pkt::data(1, 0, 1, &[2]);
    marked.repr.msg_type = MessageType::Result;
    marked.repr.src_cnt = 5;
    marked.repr.age_op = AGE_OP_CONGESTED;
    let out = send_from(&mut sw, PARENT, &marked.bytes());
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|o| o.1.age_op == AGE_OP_CONGESTED), "{out:?}");
    // at the root: a child's marked partial marks the block
    let spec = JobSpec { members: vec![0, RANK], workers: 4, ..job(1, 2, 4) };
    let mut root = switch_with(&[spec]);
    send(&mut root, Pkt::data(1, 0, 0, &[1]));
    let mut partial = Pkt::data(1, RANK, 0, &[5]);
    partial.repr.src_cnt = 3;
    partial.repr.age_op = AGE_OP_CONGESTED;
    let out = send_from(&mut root, 7, &partial.bytes());
    assert!(out.len() == 2 && out.iter().all(|o| o.1.age_op == AGE_OP_CONGESTED), "{out:?}");
}

#[test]
fn root_counts_a_child_switch_as_the_workers_it_sums_and_never_twice() {
    let spec = JobSpec { members: vec![0, RANK], workers: 4, ..job(1, 2, 4) };
    let mut sw = switch_with(&[spec]);
    // a worker's src_cnt is its incarnation tag (this switch's: 1), never a
    // count: a worker counts as one
    let mut p = Pkt::data(1, 0, 0, &[1]);
    p.repr.src_cnt = 1;
    assert!(send(&mut sw, p).is_empty());
    let mut partial = Pkt::data(1, RANK, 0, &[5]);
    partial.repr.src_cnt = 3;
    let bytes = partial.bytes();
    let out = send_from(&mut sw, 7, &bytes);
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|o| o.1.src_cnt == 4 && o.2 == vec![6] && !o.1.degraded));
    // the child's partial again (its result was lost): answered, not added
    let out = send_from(&mut sw, 7, &bytes);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].2.clone()), (7, vec![6]));
    assert_eq!(sw.counters().accepted, 2);
    assert_eq!(sw.counters().duplicate, 1);
}

#[test]
fn a_degraded_partial_makes_the_root_result_degraded() {
    let spec = JobSpec { members: vec![0, RANK], workers: 4, ..job(1, 2, 4) };
    let mut sw = switch_with(&[spec]);
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    let mut partial = Pkt::data(1, RANK, 0, &[5]);
    partial.repr.src_cnt = 2;
    partial.repr.degraded = true;
    let out = send_from(&mut sw, 7, &partial.bytes());
    assert!(out.iter().all(|o| o.1.degraded && o.1.src_cnt == 3));
}

#[test]
fn sync_goes_to_the_root_and_its_answer_comes_back_down() {
    let mut leaf = leaf();
    // a worker joining with the others is answered by its own switch
    let join = Repr::new(MessageType::Join, 1, 0);
    let mut buf = vec![0; join.buffer_len()];
    join.emit(&mut Packet::new_unchecked(&mut buf[..]));
    let out = send_from(&mut leaf, 100, &buf);
    assert_eq!((out[0].0, out[0].1.msg_type, out[0].1.src_cnt), (100, MessageType::JoinAck, 5));
    // a worker joining a running job asks the root, through the leaf
    let join = Repr { age_op: JOIN_SYNC, ..Repr::new(MessageType::Join, 1, 1) };
    let mut buf = vec![0; join.buffer_len()];
    join.emit(&mut Packet::new_unchecked(&mut buf[..]));
    let mut out = VecTransmit::new();
    assert_eq!(leaf.handle_datagram(T0, 101, &buf, &mut out), Verdict::Consumed);
    let (dest, sync) = out.drain().next().unwrap();
    assert_eq!(dest, PARENT);
    let p = Packet::new_checked(&sync[..]).unwrap();
    assert_eq!((p.msg_type_code(), p.src_id()), (MessageType::Sync as u8, RANK));
    // rank 1 is a member every block already waits for: not a newcomer
    assert_eq!(SyncRequest::parse(p.payload()).unwrap(), SyncRequest { origin: 1, flags: 0, align_blocks: 0 });
    // the root has completed blocks 0..3 of its 4 slots: the offset is 4
    let spec = JobSpec { members: vec![9, RANK], workers: 5, ..job(1, 2, 4) };
    let mut root = switch_with(&[spec]);
    for b in 0..4 {
        send(&mut root, Pkt::data(1, 9, b, &[1]));
        let mut partial = Pkt::data(1, RANK, b, &[1]);
        partial.repr.src_cnt = 2;
        send_from(&mut root, 50, &partial.bytes());
    }
    let mut out = VecTransmit::new();
    assert_eq!(root.handle_datagram(T0, 50, &sync, &mut out), Verdict::Consumed);
    let (dest, ack) = out.drain().next().unwrap();
    assert_eq!(dest, 50);
    let p = Packet::new_checked(&ack[..]).unwrap();
    assert_eq!((p.msg_type_code(), p.src_id()), (MessageType::JoinAck as u8, 1));
    assert_eq!(JoinParams::parse(p.payload()).unwrap().next_block, 4);
    // a newcomer (awaiting below) starts a window (4 blocks) further on,
    // past any block another shard may have begun without it
    let newcomer = Repr::new(MessageType::Sync, 1, RANK);
    let mut buf = vec![0; newcomer.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    newcomer.emit(&mut p);
    SyncRequest { origin: 3, flags: SYNC_NEWCOMER, align_blocks: 0 }.emit(p.payload_mut());
    let mut out = VecTransmit::new();
    assert_eq!(root.handle_datagram(T0, 50, &buf, &mut out), Verdict::Consumed);
    let (_, ack3) = out.drain().next().unwrap();
    let p = Packet::new_checked(&ack3[..]).unwrap();
    assert_eq!((p.src_id(), JoinParams::parse(p.payload()).unwrap().next_block), (3, 8));
    // the leaf relays the answer to the worker that asked
    let out = send_from(&mut leaf, PARENT, &ack);
    assert_eq!((out[0].0, out[0].1.msg_type, out[0].1.src_id), (101, MessageType::JoinAck, 1));
    assert_eq!(leaf.counters().syncs_forwarded, 1);
}

/// The root's answer to a worker's sync is lost on its way to the worker's
/// leaf, whose other workers go on meanwhile: by the time the answer comes
/// again, the leaf has sent blocks from its start up without the joiner.
/// The leaf starts the joiner at the first of its allreduces a window past
/// what it still needs instead (and says so again to a repeated answer),
/// so its first results sum it. (It admitted it at the root's start: the
/// blocks it had sent up lacked the joiner, and the results said nothing.)
#[test]
fn a_leaf_that_got_a_sync_answer_late_starts_the_joiner_past_what_it_sent_up() {
    let up = Uplink { parent: vec![PARENT], rank: RANK };
    let mut leaf = leaf();
    let spec = JobSpec { members: vec![0, 1, 2], workers: 5, ..job(1, 2, 4) };
    leaf.update_job(T0, spec, Some(up), &[2], &mut VecTransmit::new()).unwrap();
    // worker 2 syncs (allreduces of 2 blocks); the leaf asks the root
    let mut join = Pkt::data(1, 2, 2, &[]);
    join.repr.msg_type = MessageType::Join;
    join.repr.age_op = JOIN_SYNC;
    let out = send(&mut leaf, join);
    assert_eq!((out.len(), out[0].0, out[0].1.msg_type), (1, PARENT, MessageType::Sync));
    // the others complete blocks 0..3 (the root's results come back) and
    // send 4 and 5 up: the root, which answered "block 4" meanwhile, has
    // its answer lost on the way
    for b in 0..6 {
        send(&mut leaf, Pkt::data(1, 0, b, &[1]));
        let out = send(&mut leaf, Pkt::data(1, 1, b, &[1]));
        assert_eq!((out.len(), out[0].0, out[0].1.src_cnt), (1, PARENT, 2), "block {b} goes up without the joiner");
        if b < 4 {
            send_from(&mut leaf, PARENT, &parent_result(b, 4, &[4]));
        }
    }
    // the answer comes again (the worker asked again): start 4, after
    // generation 2 (blocks 2 and 3)
    let mut ack = Pkt::data(1, 2, 0, &[]);
    ack.repr.msg_type = MessageType::JoinAck;
    ack.repr.gen_id = 2;
    let mut buf = ack.bytes();
    let params = JoinParams { next_block: 4, ..join_listening(&mut switch_with(&[job(1, 2, 4)]), 1, 0, false) };
    buf.resize(HEADER_LEN + JoinParams::LEN, 0);
    params.emit(&mut buf[HEADER_LEN..]);
    let mut raw = VecTransmit::new();
    assert_eq!(leaf.handle_datagram(T0, PARENT, &buf, &mut raw), Verdict::Joined { job_id: 1, member: 2, start: 8, listens: false });
    let (dest, bytes) = raw.drain().next().expect("the answer, relayed");
    let p = Packet::new_checked(&bytes[..]).unwrap();
    // block 4 (slot 0) is still open here, so a window on is block 8: two
    // allreduces later than the root said, generations and all
    assert_eq!((dest, p.msg_type_code(), p.src_id(), p.gen_id()), (102, MessageType::JoinAck as u8, 2, 4));
    assert_eq!(JoinParams::parse(p.payload()).unwrap().next_block, 8);
    assert_eq!(leaf.counters().sync_moved, 1);
    // the worker lost it and asked again: the root's same answer is relayed
    // with the same start here
    let mut join = Pkt::data(1, 2, 2, &[]);
    join.repr.msg_type = MessageType::Join;
    join.repr.age_op = JOIN_SYNC;
    assert_eq!(send(&mut leaf, join).len(), 1, "asked the root again");
    let mut raw = VecTransmit::new();
    let _ = leaf.handle_datagram(T0, PARENT, &buf, &mut raw);
    let (_, bytes) = raw.drain().next().expect("the repeated answer, relayed");
    let p = Packet::new_checked(&bytes[..]).unwrap();
    assert_eq!((p.gen_id(), JoinParams::parse(p.payload()).unwrap().next_block), (4, 8));
    // blocks 6 and 7 go up without it; block 8 waits for it and sums it
    for b in 4..6 {
        send_from(&mut leaf, PARENT, &parent_result(b, 4, &[4]));
    }
    for b in 6..8 {
        send(&mut leaf, Pkt::data(1, 0, b, &[1]));
        assert_eq!(send(&mut leaf, Pkt::data(1, 1, b, &[1])).len(), 1, "block {b}");
    }
    send(&mut leaf, Pkt::data(1, 0, 8, &[1]));
    assert!(send(&mut leaf, Pkt::data(1, 1, 8, &[1])).is_empty(), "block 8 waits for the joiner");
    let out = send(&mut leaf, Pkt::data(1, 2, 8, &[1]));
    assert_eq!((out.len(), out[0].0, out[0].1.src_cnt, out[0].2.clone()), (1, PARENT, 3, vec![3]));
}

/// A job's workers scale block floating point and divide averages by the
/// worker count their JoinAck said (`src_cnt`). A job admitted with
/// `workers` 0 counts its members then: letting an update add more made the
/// running workers divide by the old count (an AVG over 3 divided by 2)
/// and sum values scaled for fewer workers. Such an update is refused, and
/// says what to do; the members may shrink and grow back up to the count,
/// and JoinAcks keep saying the count the job was admitted for.
#[test]
fn a_job_cannot_grow_past_the_worker_count_its_workers_joined_with() {
    let mut sw = switch_with(&[job(1, 2, 4)]);
    assert_eq!(join_listening_src_cnt(&mut sw, 1, 0), 2);
    let mut out = VecTransmit::new();
    let err = sw.update_job(T0, JobSpec { members: vec![0, 1, 2], ..job(1, 2, 4) }, None, &[2], &mut out).unwrap_err();
    assert_eq!(
        err.to_string(),
        "job 1: 3 workers is more than the 2 it was admitted for (its workers scale block floating point and averages for 2): admit it with workers = the most it will ever have, or remove and re-admit it"
    );
    // an explicit count may not grow either
    let err = sw.update_job(T0, JobSpec { members: vec![0, 1], workers: 4, ..job(1, 2, 4) }, None, &[], &mut out);
    assert!(matches!(err, Err(AdmitError::WorkersGrown { job_id: 1, workers: 4, admitted: 2 })), "{err:?}");
    // shrinking and growing back is fine, and a joiner learns the admitted count
    sw.update_job(T0, JobSpec { members: vec![0], ..job(1, 2, 4) }, None, &[], &mut out).unwrap();
    sw.update_job(T0, JobSpec { members: vec![0, 5], ..job(1, 2, 4) }, None, &[], &mut out).unwrap();
    assert_eq!(join_listening_src_cnt(&mut sw, 1, 5), 2);
    // room to grow: admitted with workers = 4
    let mut sw = switch_with(&[JobSpec { workers: 4, ..job(1, 2, 4) }]);
    sw.update_job(T0, JobSpec { members: vec![0, 1, 2, 3], workers: 4, ..job(1, 2, 4) }, None, &[], &mut out).unwrap();
    assert_eq!(join_listening_src_cnt(&mut sw, 1, 3), 4);
}

fn join_listening_src_cnt(sw: &mut ValueSwitch<Addr>, job: u32, src: u16) -> u16 {
    let mut join = Pkt::data(job, src, 0, &[]);
    join.repr.msg_type = MessageType::Join;
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(T0, 100 + src as u32, &join.bytes(), &mut out);
    let (_, bytes) = out.drain().next().expect("a JoinAck");
    let p = Packet::new_checked(&bytes[..]).unwrap();
    assert_eq!(p.msg_type_code(), MessageType::JoinAck as u8);
    p.src_cnt()
}

#[test]
fn a_member_that_leaves_is_not_waited_for() {
    let mut sw = switch_with(&[job(1, 3, 4)]);
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    send(&mut sw, Pkt::data(1, 1, 0, &[2]));
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1], ..job(1, 3, 4) }, None, &[], &mut out).unwrap();
    let out = decode(out);
    assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), vec![100, 101]);
    assert!(out.iter().all(|o| o.1.src_cnt == 2 && o.2 == vec![3]));
    // a new member is waited for in new blocks
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1, 7], ..job(1, 3, 4) }, None, &[], &mut out).unwrap();
    send(&mut sw, Pkt::data(1, 0, 1, &[1]));
    assert!(send(&mut sw, Pkt::data(1, 1, 1, &[1])).is_empty());
    assert_eq!(send(&mut sw, Pkt::data(1, 7, 1, &[1])).len(), 3);
    // caps cannot change under a running job
    let mut out = VecTransmit::new();
    let err = sw.update_job(T0, job(1, 3, 8), None, &[], &mut out).unwrap_err();
    assert_eq!(err.to_string(), "job 1: block_cnt_max cannot change while the job runs (remove and re-admit it)");
    assert!(matches!(sw.update_job(T0, job(2, 3, 4), None, &[], &mut out), Err(AdmitError::Unknown(2))));
}

#[test]
fn a_switch_that_becomes_the_root_finishes_what_it_sent_up() {
    let mut sw = leaf();
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    assert_eq!(send(&mut sw, Pkt::data(1, 1, 0, &[2]))[0].0, PARENT);
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { workers: 2, ..job(1, 2, 4) }, None, &[], &mut out).unwrap();
    let out = decode(out);
    assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), vec![100, 101]);
    assert!(out.iter().all(|o| o.1.msg_type == MessageType::Result && o.2 == vec![3] && o.1.src_cnt == 2));
}

#[test]
fn an_expired_block_at_the_parent_is_passed_down() {
    let mut sw = leaf();
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    send(&mut sw, Pkt::data(1, 1, 0, &[2]));
    let nack = Repr { block_id: 0, ..Repr::new(MessageType::Nack, 1, RANK) };
    let mut buf = vec![0; HEADER_LEN + Nack::LEN];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    nack.emit(&mut p);
    Nack { reason: NackReason::BlockExpired, detail: 4 }.emit(p.payload_mut());
    let out = send_from(&mut sw, PARENT, &buf);
    assert_eq!(out.iter().map(|o| (o.0, o.1.msg_type)).collect::<Vec<_>>(), vec![(100, MessageType::Nack), (101, MessageType::Nack)]);
    // a child asking again is told the same, and the slot moves on
    let out = send(&mut sw, Pkt::data(1, 0, 0, &[1]).retransmission());
    assert_eq!(out[0].1.msg_type, MessageType::Nack);
    assert!(send(&mut sw, Pkt::data(1, 0, 4, &[1])).is_empty());
    assert_eq!(sw.counters().slot_busy, 0);
}

#[test]
fn a_worker_joining_a_running_job_is_waited_for_from_its_start_block_only() {
    // (admitted for the 3 workers it will have)
    let mut sw = switch_with(&[JobSpec { workers: 3, ..job(1, 2, 4) }]);
    for b in 0..4 {
        send(&mut sw, Pkt::data(1, 0, b, &[1]));
        send(&mut sw, Pkt::data(1, 1, b, &[1]));
    }
    send(&mut sw, Pkt::data(1, 0, 4, &[1])); // block 4 open
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1, 2], ..job(1, 2, 4) }, None, &[2], &mut out).unwrap();
    // before its sync, the new member is waited for nowhere, and a block
    // without it lacks no member it should have had
    let out = send(&mut sw, Pkt::data(1, 1, 4, &[1]));
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|o| o.1.src_cnt == 2 && !o.1.degraded), "{out:?}");
    // it syncs on allreduces of 8 blocks: the first boundary a window (4
    // blocks) beyond block 5, the lowest block still needed; another shard
    // may already have begun blocks up to 8, never 9 or later
    let join = Repr { age_op: JOIN_SYNC, block_id: 8, ..Repr::new(MessageType::Join, 1, 2) };
    let mut buf = vec![0; join.buffer_len()];
    join.emit(&mut Packet::new_unchecked(&mut buf[..]));
    let mut out = VecTransmit::new();
    // the runtime is told, so its other shards admit the joiner too
    assert_eq!(sw.handle_datagram(T0, 102, &buf, &mut out), Verdict::Joined { job_id: 1, member: 2, start: 16, listens: false });
    let (_, ack) = out.drain().next().unwrap();
    let p = Packet::new_checked(&ack[..]).unwrap();
    assert_eq!(JoinParams::parse(p.payload()).unwrap().next_block, 16);
    // the same request again (its answer was lost) gets the same start
    let mut out = VecTransmit::new();
    assert_eq!(sw.handle_datagram(T0, 102, &buf, &mut out), Verdict::Consumed);
    let (_, again) = out.drain().next().unwrap();
    assert_eq!(again, ack);
    // blocks before its start complete without it ...
    send(&mut sw, Pkt::data(1, 0, 5, &[1]));
    assert_eq!(send(&mut sw, Pkt::data(1, 1, 5, &[1])).len(), 3);
    for b in 6..16 {
        send(&mut sw, Pkt::data(1, 0, b, &[1]));
        let out = send(&mut sw, Pkt::data(1, 1, b, &[1]));
        assert_eq!(out.len(), 3, "block {b}");
        // ... and are complete: the joiner was not in the job yet
        assert!(out.iter().all(|o| o.1.src_cnt == 2 && !o.1.degraded), "block {b}: {out:?}");
    }
    // ... blocks from its start wait for it
    send(&mut sw, Pkt::data(1, 0, 16, &[1]));
    assert!(send(&mut sw, Pkt::data(1, 1, 16, &[1])).is_empty());
    let out = send(&mut sw, Pkt::data(1, 2, 16, &[1]));
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|o| o.1.src_cnt == 3 && o.2 == vec![3] && !o.1.degraded));
    // and one of them that completes without it (a quorum of 2 here) lacks it
    send(&mut sw, Pkt::data(1, 0, 17, &[1]));
    send(&mut sw, Pkt::data(1, 1, 17, &[1]));
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1, 2], quorum: 2, ..job(1, 2, 4) }, None, &[], &mut out).unwrap();
    let out = decode(out);
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|o| o.1.block_id == 17 && o.1.src_cnt == 2 && o.1.degraded), "{out:?}");
    assert_eq!(sw.counters().blocks_degraded, 1);
}

#[test]
fn a_child_of_a_root_spread_over_switches_tells_its_workers_the_order_classes() {
    // one parent: results come in this switch's own order
    assert_eq!(join_listening(&mut leaf(), 1, 0, false).order_shards, 0);
    // five root shards (a root per spine): results of different parents come
    // on different paths, in order only per parent (shard_of over 5)
    let mut sw = switch_with(&[JobSpec { workers: 5, ..job(1, 2, 4) }]);
    sw.set_uplink(1, Some(Uplink { parent: vec![1, 2, 3, 4, 5], rank: RANK })).unwrap();
    let params = join_listening(&mut sw, 1, 0, false);
    assert_eq!((params.shard_count, params.order_shards, params.order_classes()), (1, 5, Some(5)));
}

#[test]
fn a_quorum_completes_a_block_with_the_first_k_members_and_can_change_while_the_job_runs() {
    // GOAT's K_t (docs/goat.md): 4 members, K = 3
    let mut sw = switch_with(&[JobSpec { quorum: 3, ..job(1, 4, 4) }]);
    for src in 0..4 {
        assert!(join_listening(&mut sw, 1, src, false).partial_results, "members accept partial results");
    }
    assert!(send(&mut sw, Pkt::data(1, 0, 0, &[1])).is_empty());
    assert!(send(&mut sw, Pkt::data(1, 2, 0, &[10])).is_empty());
    let out = send(&mut sw, Pkt::data(1, 3, 0, &[100]));
    // the third completes it: the result goes to all four, summing three
    assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), vec![100, 101, 102, 103]);
    assert!(out.iter().all(|o| o.2 == vec![111] && o.1.src_cnt == 3 && o.1.degraded));
    // the fourth arrives late: never added, answered with the result
    let late = send(&mut sw, Pkt::data(1, 1, 0, &[1000]));
    assert_eq!((late.len(), late[0].0, late[0].2.clone()), (1, 101, vec![111]));
    assert_eq!(sw.counters().late, 1);
    // the controller installs K = 0 (every member): block 1 waits for all
    let mut out = VecTransmit::new();
    sw.update_job(T0, job(1, 4, 4), None, &[], &mut out).unwrap();
    for src in 0..3 {
        assert!(send(&mut sw, Pkt::data(1, src, 1, &[1])).is_empty());
    }
    // lowering K to 2 completes the open block that already has three
    sw.update_job(T0, JobSpec { quorum: 2, ..job(1, 4, 4) }, None, &[], &mut out).unwrap();
    let done = decode(out);
    assert_eq!(done.len(), 4);
    assert!(done.iter().all(|o| o.2 == vec![3] && o.1.src_cnt == 3));
    // a quorum above the members is refused at admission
    let err = ValueSwitch::<Addr>::new(ShardConfig::single(1 << 20)).add_job(JobSpec { quorum: 5, ..job(2, 4, 4) });
    assert!(err.unwrap_err().to_string().contains("quorum 5"));
}

#[test]
fn a_quorum_cannot_be_added_to_a_job_whose_workers_joined_refusing_partial_results() {
    // Found wiring GOAT-Async (docs/goat.md): a deployment admitted without
    // a quorum, then given K_t by the controller, handed sums of K members
    // to workers whose JoinAck said every result sums every member, and
    // they failed with PartialResult. The update is refused instead, with
    // what to do; a job admitted with quorum = members may change K freely.
    let complete = JobSpec { on_failure: FailurePolicy::Fail, ..job(1, 4, 4) };
    let mut sw = switch_with(&[complete.clone()]);
    assert!(!join_listening(&mut sw, 1, 0, false).partial_results);
    let mut out = VecTransmit::new();
    let err = sw.update_job(T0, JobSpec { quorum: 2, ..complete.clone() }, None, &[], &mut out).unwrap_err();
    assert_eq!(err, AdmitError::PartialResultsAdded { job_id: 1 });
    assert!(err.to_string().contains("quorum = its member count"), "{err}");
    let mut sw = switch_with(&[JobSpec { quorum: 4, ..complete.clone() }]);
    assert!(join_listening(&mut sw, 1, 0, false).partial_results);
    sw.update_job(T0, JobSpec { quorum: 2, ..complete.clone() }, None, &[], &mut out).unwrap();
    sw.update_job(T0, JobSpec { quorum: 4, ..complete.clone() }, None, &[], &mut out).unwrap();
    // dropping the quorum drops partial results, for good: a joiner now refuses them
    sw.update_job(T0, complete.clone(), None, &[], &mut out).unwrap();
    assert!(!join_listening(&mut sw, 1, 1, false).partial_results);
    assert!(sw.update_job(T0, JobSpec { quorum: 2, ..complete }, None, &[], &mut out).is_err());
}

/// The recovery join that completes the floor may also change whether its
/// member listens on the result group (a restarted job starts with none
/// listening): the verdict that passes the floor to the other shards
/// carries that too, so they send the member's results to the group.
/// (The first `Verdict::Recovered` carried the floor alone: the other
/// shard sent member 1 a unicast copy beside the group datagram.)
#[test]
fn the_floor_verdict_also_passes_on_whether_its_member_listens() {
    use fanin_wire::value::JOIN_RECOVER;
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let mut sw = switch_with(&[JobSpec { result_group: Some(group), ..job(1, 2, 4) }]);
    let mut verdicts = Vec::new();
    for src in 0..2u16 {
        let mut join = Pkt::data(1, src, 5, &[]);
        join.repr.msg_type = MessageType::Join;
        join.repr.age_op = JOIN_RECOVER;
        join.repr.final_block = true;
        let mut out = VecTransmit::new();
        verdicts.push(sw.handle_datagram(T0, 100 + src as u32, &join.bytes(), &mut out));
    }
    assert!(matches!(verdicts[1], Verdict::Recovered { floor: 5, member: 1, listens: true, .. }), "{verdicts:?}");
    let mut other = switch_with(&[JobSpec { result_group: Some(group), ..job(1, 2, 4) }]);
    for v in &verdicts {
        other.learn(*v);
    }
    let mut out = VecTransmit::new();
    out.groups_reachable = true;
    for src in 0..2u16 {
        let _ = other.handle_datagram(T0, 100 + src as u32, &Pkt::data(1, src, 5, &[1]).bytes(), &mut out);
    }
    assert_eq!((out.group_datagrams.len(), out.datagrams.len()), (1, 0), "every member's result on the group");
}

/// A member that left after contributing to a block stays in its sum; a
/// member added (not awaiting a sync join) in its place starts at the
/// stream's start, so the open block waits for it too. Completeness was a
/// count: the leaver's contribution stood in for the newcomer's, and the
/// block went to every member, the newcomer too, as complete without it.
/// (The reviewer's reproduction.)
#[test]
fn a_departed_members_contribution_does_not_stand_in_for_a_new_member() {
    let mut sw = switch_with(&[JobSpec { workers: 3, ..job(1, 3, 4) }]);
    assert!(send(&mut sw, Pkt::data(1, 2, 0, &[100])).is_empty());
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1, 3], workers: 3, ..job(1, 3, 4) }, None, &[], &mut out).unwrap();
    assert!(decode(out).is_empty());
    send(&mut sw, Pkt::data(1, 3, 1, &[0])); // rank 3 is alive (address known)
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    assert!(send(&mut sw, Pkt::data(1, 1, 0, &[10])).is_empty(), "block 0 waits for rank 3");
    let out = send(&mut sw, Pkt::data(1, 3, 0, &[1000]));
    let to3: Vec<_> = out.iter().filter(|o| o.0 == 103).collect();
    assert_eq!(to3.len(), 1);
    // the leaver's 100 is in the sum (it cannot be taken out), and says so
    assert_eq!(to3[0].2, vec![1111]);
    assert!(!to3[0].1.degraded, "every current member is in it");
    assert_eq!(to3[0].1.src_cnt, 4, "four contributions summed");
}

/// Members are compared, not counted, both ways: a block without a current
/// member is degraded even when a departed member's contribution makes the
/// count look full.
#[test]
fn a_block_without_a_current_member_is_degraded_whatever_the_count() {
    let mut sw = switch_with(&[JobSpec { workers: 3, block_exp_ms: 0, ..job(1, 3, 4) }]);
    assert!(send(&mut sw, Pkt::data(1, 2, 0, &[100])).is_empty());
    // rank 2 leaves; the quorum of 2 then completes block 0 with ranks 0 and 2 only
    let mut out = VecTransmit::new();
    let spec = JobSpec { members: vec![0, 1], workers: 2, quorum: 1, ..job(1, 3, 4) };
    sw.update_job(T0, spec, None, &[], &mut out).unwrap();
    let out = send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    let to0: Vec<_> = out.iter().filter(|o| o.0 == 100).collect();
    assert_eq!(to0.len(), 1, "{out:?}");
    assert!(to0[0].1.degraded, "rank 1 is missing, though two contributions are in: {:?}", to0[0].1);
}

/// A rank removed and added back while a block still holds what its old
/// process sent: that contribution stands for nobody now (it cannot be
/// taken out, and the new process's cannot be added), so the block's result
/// says it lacks the member. It went out as complete, summed from the old
/// process's data. (A reviewer's reproduction.)
#[test]
fn a_rank_added_back_does_not_take_its_old_processs_contribution_for_its_own() {
    let mut sw = switch_with(&[JobSpec { workers: 3, ..job(1, 3, 4) }]);
    assert!(send(&mut sw, Pkt::data(1, 2, 0, &[100])).is_empty());
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1], workers: 3, ..job(1, 3, 4) }, None, &[], &mut out).unwrap();
    sw.update_job(T0, JobSpec { members: vec![0, 1, 2], workers: 3, ..job(1, 3, 4) }, None, &[], &mut out).unwrap();
    assert!(decode(out).is_empty());
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    let out = send(&mut sw, Pkt::data(1, 1, 0, &[10]));
    assert!(!out.is_empty(), "the block completes: rank 2 is in it, as its old process");
    for (_, repr, sum) in &out {
        assert_eq!(sum, &vec![111]);
        assert!(repr.degraded, "it lacks rank 2's new process: {repr:?}");
    }
}

/// A tree's switch has no rounds: once its stream ran, a member added
/// active would be answered from the stream's start, where this switch and
/// those above hold results summed without it, or with an earlier process
/// of its rank (a rank that left and comes back under a fresh leaf: those
/// results look complete, and the new run takes them for its own sums).
/// Such an update is refused, changing nothing; the same member as awaiting
/// (a sync join) is taken; and before the stream ran, a member added active
/// starts with the others.
#[test]
fn a_tree_switch_whose_stream_ran_takes_new_members_only_as_sync_joiners() {
    let up = Uplink { parent: vec![PARENT], rank: RANK };
    let grown = JobSpec { members: vec![0, 1, 2], workers: 5, ..job(1, 2, 4) };
    // not run yet: taken
    let mut idle = leaf();
    idle.update_job(T0, grown.clone(), Some(up.clone()), &[], &mut VecTransmit::new()).unwrap();
    // run: block 0 opened and sent up
    let mut sw = leaf();
    assert!(send(&mut sw, Pkt::data(1, 0, 0, &[1, 2])).is_empty());
    assert_eq!(send(&mut sw, Pkt::data(1, 1, 0, &[10, 20])).len(), 1);
    let err = sw.update_job(T0, grown.clone(), Some(up.clone()), &[], &mut VecTransmit::new()).unwrap_err();
    assert!(matches!(err, AdmitError::PlainMemberIntoRunningTree { job_id: 1, member: 2 }), "{err:?}");
    assert!(err.to_string().contains("sync_join=True"), "{err}");
    // nothing changed: worker 2 is no member
    assert_eq!(sw.check_update(&grown, Some(&up), &[]).unwrap_err(), err);
    // a root with child switches is a tree's switch too (a fresh leaf's rank added plainly)
    let mut root = switch_with(&[JobSpec { members: vec![RANK], workers: 5, ..job(1, 1, 4) }]);
    let mut p = Pkt::data(1, RANK, 0, &[1, 2]);
    p.repr.src_cnt = 2;
    assert_eq!(send(&mut root, p).len(), 1, "the root's result goes down");
    let with_leaf = JobSpec { members: vec![RANK, RANK + 1], workers: 5, ..job(1, 2, 4) };
    let err = root.check_update(&with_leaf, None, &[]).unwrap_err();
    assert!(matches!(err, AdmitError::PlainMemberIntoRunningTree { member, .. } if member == RANK + 1), "{err:?}");
    root.check_update(&with_leaf, None, &[RANK + 1]).unwrap();
    // as a sync joiner: taken
    sw.update_job(T0, grown, Some(up), &[2], &mut VecTransmit::new()).unwrap();
    // a single switch's job (rounds) takes a member added plainly: its Join starts a round
    let mut single = switch_with(&[JobSpec { workers: 3, ..job(1, 2, 4) }]);
    assert!(send(&mut single, Pkt::data(1, 0, 0, &[1])).is_empty());
    single.update_job(T0, JobSpec { members: vec![0, 1, 2], workers: 3, ..job(1, 2, 4) }, None, &[], &mut VecTransmit::new()).unwrap();
}
