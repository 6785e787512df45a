//! Exact packet traces through one switch shard.

use super::*;
use crate::transmit::VecTransmit;
use fanin_wire::value::{read_elements, write_elements};

type Addr = u32; // worker n lives at address 100 + n
const T0: Time = Time::ZERO;

fn switch_with(jobs: &[JobSpec]) -> ValueSwitch<Addr> {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 30));
    for j in jobs {
        sw.add_job(j.clone()).unwrap();
    }
    sw
}

struct Pkt {
    repr: Repr,
    values: Vec<i32>,
}

impl Pkt {
    fn data(job: u32, src: u16, block: u32, values: &[i32]) -> Self {
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
    fn float(mut self, exp: i8, next_exp: i8) -> Self {
        self.repr.dtype = Dtype::Float32;
        self.repr.exp = exp;
        self.repr.next_exp = next_exp;
        self
    }
    fn exp_only(job: u32, src: u16, block: u32, exp: i8) -> Self {
        let mut p = Pkt::data(job, src, block, &[]).float(exp, EXP_NONE);
        p.repr.exp_only = true;
        p
    }
    fn retransmission(mut self) -> Self {
        self.repr.msg_type = MessageType::Retransmission;
        self
    }
    fn gen(mut self, gen_id: u16) -> Self {
        self.repr.gen_id = gen_id;
        self
    }
    fn bytes(&self) -> Vec<u8> {
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

fn decode(mut out: VecTransmit<Addr>) -> Vec<(Addr, Repr, Vec<i32>)> {
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

fn job(id: u32, n: u16, slots: u32) -> JobSpec {
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

// ---- straggler mitigation: aging, partial results, classification ----

const MS: u64 = 1_000_000;

fn at(ms: u64) -> Time {
    Time::from_nanos(ms * MS)
}

/// A switch whose scanners tick every `block_exp / (scanners * checks)`.
fn aging_switch(spec: JobSpec, scanners: u16, checks: u8) -> ValueSwitch<Addr> {
    let mut cfg = ShardConfig::single(1 << 30);
    cfg.aging = AgingConfig { scanners, checks, min_tick: Duration::from_micros(1), ..AgingConfig::default() };
    let mut sw = ValueSwitch::new(cfg);
    sw.add_job(spec).unwrap();
    sw
}

fn send_at(sw: &mut ValueSwitch<Addr>, now: Time, p: Pkt) -> Vec<(Addr, Repr, Vec<i32>)> {
    let mut out = VecTransmit::new();
    let from = 100 + p.repr.src_id as u32;
    assert_eq!(sw.handle_datagram(now, from, &p.bytes(), &mut out), Verdict::Consumed);
    decode(out)
}

fn tick(sw: &mut ValueSwitch<Addr>, now: Time) -> Vec<(Addr, Repr, Vec<i32>)> {
    let mut out = VecTransmit::new();
    sw.handle_timeout(now, &mut out);
    decode(out)
}

fn aging_job(n: u16, slots: u32, exp_ms: u32, k: u32) -> JobSpec {
    let mut spec = job(1, n, slots);
    spec.block_exp_ms = exp_ms;
    spec.slow_after_windows = k;
    spec
}

#[test]
fn blocks_age_at_the_second_visit_of_their_slice_with_trios_single_flag() {
    // 2 scanners, 1 check, block_exp 10 ms: a tick every 5 ms; tick k visits
    // slice k mod 2; slice 0 = slots 0-1, slice 1 = slots 2-3.
    let mut sw = aging_switch(aging_job(3, 4, 10, 0), 2, 1);
    assert_eq!(sw.poll_timeout(), None, "no open block, no scanning");
    for src in 0..2 {
        send_at(&mut sw, at(1), Pkt::data(1, src, 0, &[1, 2]));
        send_at(&mut sw, at(1), Pkt::data(1, src, 2, &[10]));
    }
    assert_eq!(sw.poll_timeout(), Some(at(5)));
    assert!(tick(&mut sw, at(5)).is_empty(), "slice 1: block 2's flag is cleared");
    assert!(tick(&mut sw, at(10)).is_empty(), "slice 0: block 0's flag is cleared");
    let out = tick(&mut sw, at(15));
    assert_eq!(out.len(), 2, "slice 1 again: block 2 ages, result to the two known members");
    for (dest, repr, vals) in &out {
        assert!(*dest == 100 || *dest == 101);
        assert_eq!((repr.block_id, repr.src_cnt, repr.degraded, repr.age_op), (2, 2, true, AGE_OP_AGED));
        assert_eq!(vals, &vec![20]);
    }
    let out = tick(&mut sw, at(20));
    assert_eq!((out.len(), out[0].1.block_id, out[0].2.clone()), (2, 0, vec![2, 4]));
    assert_eq!(sw.poll_timeout(), None);
    let c = sw.counters();
    assert_eq!((c.blocks_aged, c.blocks_degraded, c.blocks_completed, c.scans), (2, 2, 2, 4));
}

/// What a scanner thread does at `now` for scanner `i`'s ticks up to it:
/// visit its slice of every job's board on the schedule, hand the names to
/// the shard.
fn scanner_thread_tick(sw: &mut ValueSwitch<Addr>, i: u64, from: Time, now: Time) -> Vec<(Addr, Repr, Vec<i32>)> {
    let mut out = VecTransmit::new();
    for s in sw.scan_schedules() {
        let mut k = from.as_nanos() / s.tick_ns + 1;
        while k * s.tick_ns <= now.as_nanos() {
            if k % s.slices == i {
                let (lo, hi) = s.board.slice(i, s.slices);
                let mut idle = Vec::new();
                s.board.visit(lo, hi, &mut idle);
                sw.age_idle(Time::from_nanos(k * s.tick_ns), s.job_id, &s.board, &idle, &mut out);
            }
            k += 1;
        }
    }
    decode(out)
}

#[test]
fn scanner_threads_age_the_same_blocks_at_the_same_ticks_as_inline_scanning() {
    // blocks_age_at_the_second_visit_of_their_slice_with_trios_single_flag,
    // with the two scanners outside the shard (aging.threads)
    let mut cfg = ShardConfig::single(1 << 30);
    cfg.aging = AgingConfig { scanners: 2, checks: 1, min_tick: Duration::from_micros(1), threads: true, ..AgingConfig::default() };
    let mut sw = ValueSwitch::new(cfg);
    sw.add_job(aging_job(3, 4, 10, 0)).unwrap();
    for src in 0..2 {
        send_at(&mut sw, at(1), Pkt::data(1, src, 0, &[1, 2]));
        send_at(&mut sw, at(1), Pkt::data(1, src, 2, &[10]));
    }
    assert!(!matches!(sw.poll_timeout(), Some(t) if t <= at(40)), "the shard keeps no scanner time (only the member timeout)");
    assert!(tick(&mut sw, at(40)).is_empty(), "nor visits");
    let mut outs = Vec::new();
    for t in [5, 10, 15, 20] {
        // scanner 1 ticks at 5 and 15 ms, scanner 0 at 10 and 20 ms
        let out = scanner_thread_tick(&mut sw, (t / 5) % 2, at(t - 5), at(t));
        outs.push(out);
    }
    assert!(outs[0].is_empty() && outs[1].is_empty(), "the flags are cleared first");
    assert_eq!(outs[2].len(), 2, "slice 1 again: block 2 ages");
    assert_eq!((outs[2][0].1.block_id, outs[2][0].1.age_op, outs[2][0].2.clone()), (2, AGE_OP_AGED, vec![20]));
    assert_eq!((outs[3].len(), outs[3][0].1.block_id, outs[3][0].2.clone()), (2, 0, vec![2, 4]));
    let c = sw.counters();
    assert_eq!((c.blocks_aged, c.blocks_degraded, c.blocks_completed), (2, 2, 2));
}

#[test]
fn a_contribution_after_a_scanner_thread_named_the_block_keeps_it_open() {
    let mut cfg = ShardConfig::single(1 << 30);
    cfg.aging = AgingConfig { scanners: 1, checks: 1, min_tick: Duration::from_micros(1), threads: true, ..AgingConfig::default() };
    let mut sw = ValueSwitch::new(cfg);
    sw.add_job(aging_job(3, 2, 4, 0)).unwrap();
    send_at(&mut sw, at(0), Pkt::data(1, 0, 0, &[1]));
    let s = sw.scan_schedules().pop().unwrap();
    let mut idle = Vec::new();
    s.board.visit(0, 2, &mut idle); // clears REF
    s.board.visit(0, 2, &mut idle); // names block 0
    assert_eq!(idle, [(0, 0)]);
    // member 1 contributes before the shard acts on the name: it wins
    send_at(&mut sw, at(5), Pkt::data(1, 1, 0, &[2]));
    let mut out = VecTransmit::new();
    sw.age_idle(at(5), 1, &s.board, &idle, &mut out);
    assert!(out.drain().next().is_none() && sw.counters().blocks_aged == 0, "not aged");
    // names from the board of a job removed and admitted again are ignored
    // (its slots may differ: a stale slot index must not reach them)
    assert!(sw.remove_job(1));
    sw.add_job(aging_job(3, 1, 4, 0)).unwrap();
    send_at(&mut sw, at(6), Pkt::data(1, 0, 0, &[1]));
    sw.age_idle(at(7), 1, &s.board, &[(0, 0), (5, 0)], &mut out);
    assert_eq!(sw.counters().blocks_aged, 0);
}

#[test]
fn a_contribution_refreshes_the_flag_and_delays_aging() {
    let mut sw = aging_switch(aging_job(3, 4, 10, 0), 2, 1);
    send_at(&mut sw, at(1), Pkt::data(1, 0, 0, &[1]));
    assert!(tick(&mut sw, at(10)).is_empty()); // ticks 5 (slice 1), 10 (slice 0: clear)
    send_at(&mut sw, at(12), Pkt::data(1, 1, 0, &[1])); // referenced again
    assert!(tick(&mut sw, at(20)).is_empty(), "flag was set again: cleared, not aged");
    // a duplicate does not refresh it: waiting members' retransmissions
    // must not keep a straggler's block alive forever
    send_at(&mut sw, at(22), Pkt::data(1, 1, 0, &[1]).retransmission());
    let out = tick(&mut sw, at(30));
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].1.src_cnt, out[0].1.degraded), (2, true));
}

#[test]
fn more_checks_age_within_a_fraction_of_the_timeout() {
    // 1 scanner, 4 checks, 8 ms: a visit every 2 ms; a block ages between 8
    // and 10 ms after its last contribution.
    let mut sw = aging_switch(aging_job(2, 1, 8, 0), 1, 4);
    send_at(&mut sw, at(1), Pkt::data(1, 0, 0, &[5]));
    for t in [2, 4, 6, 8] {
        assert!(tick(&mut sw, at(t)).is_empty(), "t = {t} ms");
    }
    let out = tick(&mut sw, at(10));
    assert_eq!((out.len(), out[0].1.src_cnt), (1, 1), "aged 9 ms after the contribution");
}

/// Two sources, source 1 `skew_ms` behind source 0, on block `b`, the
/// first block of its own allreduce (generation b + 1), starting at `t` ms,
/// with the scanners ticking every ms up to `until`: whether the block aged
/// (its result went out degraded).
fn skewed_block(sw: &mut ValueSwitch<Addr>, b: u32, t: u64, skew_ms: u64, until: u64) -> bool {
    let mut degraded = false;
    let gen = b as u16 + 1;
    send_at(sw, at(t), Pkt::data(1, 0, b, &[1]).gen(gen));
    for ms in t + 1..=until {
        let mut out = tick(sw, at(ms));
        if ms == t + skew_ms {
            out.extend(send_at(sw, at(ms), Pkt::data(1, 1, b, &[2]).gen(gen)));
        }
        degraded |= out.iter().any(|(_, r, _)| r.block_id == b && r.degraded);
    }
    degraded
}

#[test]
fn a_job_whose_ranks_are_always_apart_learns_to_wait_for_them() {
    // block_exp 4 ms, 1 scanner x 1 check: a visit every 4 ms. Source 1 is
    // 10 ms behind on every block (ranks sharing cores start each allreduce
    // apart): the first block ages, source 1's late arrival is a 10 ms
    // spread sample, and the expiry becomes 2 x 10 ms: the next blocks wait.
    let mut sw = aging_switch(aging_job(2, 8, 4, 0), 1, 1);
    assert!(skewed_block(&mut sw, 0, 0, 10, 20), "the first block ages at the fixed 4 ms");
    for b in 1..6u32 {
        let t = 20 * b as u64;
        assert!(!skewed_block(&mut sw, b, t, 10, t + 19), "block {b} completes with both sources");
    }
    assert_eq!((sw.counters().blocks_aged, sw.counters().late), (1, 1));
}

#[test]
fn a_straggler_far_beyond_the_learnt_skew_still_ages_and_does_not_move_it() {
    let mut sw = aging_switch(aging_job(2, 8, 4, 0), 1, 1);
    for b in 0..4u32 {
        skewed_block(&mut sw, b, 20 * b as u64, 10, 20 * b as u64 + 19);
    }
    // a 300 ms straggle: the block ages about 20-24 ms after source 0
    assert!(skewed_block(&mut sw, 4, 100, 300, 400), "the straggled block ages");
    let aged = sw.counters().blocks_aged;
    // its 300 ms late sample is one of several: the median stays 10 ms
    for b in 5..9u32 {
        let t = 400 + 20 * (b - 5) as u64;
        assert!(!skewed_block(&mut sw, b, t, 10, t + 19), "block {b}: ordinary skew, waited for");
    }
    assert!(skewed_block(&mut sw, 9, 500, 60, 600), "60 ms is beyond 2 x the median: ages");
    assert_eq!(sw.counters().blocks_aged, aged + 1);
}

#[test]
fn the_learnt_expiry_is_capped_and_max_factor_1_is_trios_fixed_timeout() {
    // a job that is always 200 ms apart: the expiry stops at 16 x 4 ms
    let mut sw = aging_switch(aging_job(2, 8, 4, 0), 1, 1);
    for b in 0..3u32 {
        assert!(skewed_block(&mut sw, b, 300 * b as u64, 200, 300 * b as u64 + 299), "block {b} ages");
    }
    // max_factor 1: the skew is never learnt
    let mut cfg = ShardConfig::single(1 << 30);
    cfg.aging = AgingConfig { scanners: 1, checks: 1, min_tick: Duration::from_micros(1), max_factor: 1, threads: false };
    let mut fixed = ValueSwitch::new(cfg);
    fixed.add_job(aging_job(2, 8, 4, 0)).unwrap();
    for b in 0..4u32 {
        assert!(skewed_block(&mut fixed, b, 20 * b as u64, 10, 20 * b as u64 + 19), "block {b} ages");
    }
}

#[test]
fn a_late_contribution_gets_the_partial_result_and_is_never_added() {
    let mut sw = aging_switch(aging_job(3, 2, 4, 0), 1, 1);
    send_at(&mut sw, at(0), Pkt::data(1, 0, 0, &[1]));
    send_at(&mut sw, at(0), Pkt::data(1, 1, 0, &[2]));
    tick(&mut sw, at(4));
    assert_eq!(tick(&mut sw, at(8)).len(), 2, "aged with sources 0 and 1");
    // the straggler arrives: answered with the partial result, not added
    let out = send_at(&mut sw, at(9), Pkt::data(1, 2, 0, &[100]));
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].1.src_cnt, out[0].1.degraded, out[0].2.clone()), (102, 2, true, vec![3]));
    assert_eq!(sw.counters().late, 1);
    // the next use of the slot (block 2) starts clean
    send_at(&mut sw, at(10), Pkt::data(1, 0, 2, &[1]));
    send_at(&mut sw, at(10), Pkt::data(1, 1, 2, &[1]));
    let out = send_at(&mut sw, at(10), Pkt::data(1, 2, 2, &[1]));
    assert_eq!((out.len(), out[0].1.src_cnt, out[0].1.degraded, out[0].2.clone()), (3, 3, false, vec![3]));
    // every member had block 0's result before contributing to block 2 (the
    // straggler got it with its late reply), so the shadow was freed: a
    // request for block 0 now learns it expired
    let out = send_at(&mut sw, at(12), Pkt::data(1, 2, 0, &[100]).retransmission());
    assert_eq!(out[0].1.msg_type, MessageType::Nack);
    let p = out[0].1;
    assert_eq!((p.block_id, sw.counters().expired), (0, 1));
}

#[test]
fn an_aged_exponent_round_moves_on_with_the_exponents_it_has() {
    let mut sw = aging_switch(aging_job(3, 1, 2, 0), 1, 1);
    send_at(&mut sw, at(0), Pkt::exp_only(1, 0, 0, 3));
    send_at(&mut sw, at(0), Pkt::exp_only(1, 1, 0, 5));
    tick(&mut sw, at(2));
    let out = tick(&mut sw, at(4));
    assert_eq!(out.len(), 2);
    assert!(out[0].1.exp_only && out[0].1.exp == 5);
    // data from the two sources of the round completes the block
    send_at(&mut sw, at(5), Pkt::data(1, 0, 0, &[1]).float(5, EXP_NONE));
    let out = send_at(&mut sw, at(5), Pkt::data(1, 1, 0, &[2]).float(5, EXP_NONE));
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].1.src_cnt, out[0].1.degraded, out[0].1.age_op, out[0].2.clone()), (2, true, AGE_OP_AGED, vec![3]));
}

#[test]
fn a_source_missing_for_k_windows_is_declared_slow_then_readmitted() {
    // K = 1 window of 2 slots: missing from 2 aged blocks in a row.
    let mut sw = aging_switch(aging_job(3, 2, 4, 1), 1, 1);
    for b in 0..2 {
        send_at(&mut sw, at(0), Pkt::data(1, 0, b, &[1]));
        send_at(&mut sw, at(0), Pkt::data(1, 1, b, &[1]));
    }
    tick(&mut sw, at(4));
    let out = tick(&mut sw, at(8));
    let notices: Vec<_> = out.iter().filter(|o| o.1.msg_type == MessageType::Membership).collect();
    assert_eq!(notices.len(), 2, "both known members are told");
    assert_eq!((notices[0].1.src_id, notices[0].1.age_op, notices[0].1.src_cnt), (2, MEMBERSHIP_SLOW, 2));
    assert_eq!(sw.slow_sources(1), vec![2]);
    // new blocks no longer wait for source 2
    send_at(&mut sw, at(9), Pkt::data(1, 0, 2, &[1]));
    let out = send_at(&mut sw, at(9), Pkt::data(1, 1, 2, &[1]));
    assert_eq!(out.len(), 2, "completed at once, without waiting for the timeout");
    assert_eq!((out[0].1.src_cnt, out[0].1.degraded, out[0].1.age_op), (2, true, 0));
    // source 2 catches up: it adds to an open block and is waited for again
    send_at(&mut sw, at(10), Pkt::data(1, 0, 3, &[1]));
    let out = send_at(&mut sw, at(10), Pkt::data(1, 2, 3, &[5]));
    let notice = out.iter().find(|o| o.1.msg_type == MessageType::Membership).expect("re-admission notice");
    assert_eq!((notice.1.src_id, notice.1.age_op, notice.1.src_cnt), (2, MEMBERSHIP_READMITTED, 3));
    assert!(sw.slow_sources(1).is_empty());
    let out = send_at(&mut sw, at(10), Pkt::data(1, 1, 3, &[1]));
    assert_eq!((out.len(), out[0].1.src_cnt, out[0].1.degraded, out[0].2.clone()), (3, 3, false, vec![7]));
    let c = sw.counters();
    assert_eq!((c.declared_slow, c.readmitted), (1, 1));
}

#[test]
fn declaring_a_source_slow_completes_the_blocks_waiting_only_for_it() {
    // K = 1 window of 4 slots; blocks 0-1 age, blocks 2-3 are open with
    // sources 0 and 1 in them when source 2 is declared slow.
    let mut sw = aging_switch(aging_job(3, 4, 4, 1), 1, 1);
    for b in 0..4 {
        send_at(&mut sw, at(0), Pkt::data(1, 0, b, &[1]));
        send_at(&mut sw, at(0), Pkt::data(1, 1, b, &[1]));
    }
    tick(&mut sw, at(4));
    let out = tick(&mut sw, at(8));
    // all four age in this visit (one scanner), source 2 reaches the limit
    // at the fourth; every result went out
    let results = out.iter().filter(|o| o.1.msg_type == MessageType::Result).count();
    assert_eq!(results, 8);
    assert_eq!(sw.slow_sources(1), vec![2]);
}

#[test]
fn a_rejoining_slow_source_is_readmitted() {
    let mut sw = aging_switch(aging_job(2, 1, 2, 1), 1, 1);
    send_at(&mut sw, at(0), Pkt::data(1, 0, 0, &[1]));
    tick(&mut sw, at(2));
    tick(&mut sw, at(4));
    assert_eq!(sw.slow_sources(1), vec![1]);
    let mut join = Pkt::data(1, 1, 0, &[]);
    join.repr.msg_type = MessageType::Join;
    let out = send_at(&mut sw, at(5), join);
    assert!(out.iter().any(|o| o.1.msg_type == MessageType::Membership && o.1.age_op == MEMBERSHIP_READMITTED));
    assert!(out.iter().any(|o| o.1.msg_type == MessageType::JoinAck));
    assert!(sw.slow_sources(1).is_empty());
}

#[test]
fn aging_configuration_is_validated() {
    let ok = AgingConfig::default();
    assert!(ok.validate().is_ok());
    let bad = AgingConfig { scanners: 0, ..ok };
    assert!(bad.validate().unwrap_err().contains("aging.scanners 0"));
    let bad = AgingConfig { checks: 16, ..ok };
    assert!(bad.validate().unwrap_err().contains("aging.checks 16"));
    // 1 ms with 100 scanners x 4 checks is a 2.5 us tick: refused, clearly
    let mut cfg = ShardConfig::single(1 << 30);
    cfg.aging = AgingConfig { scanners: 100, checks: 4, min_tick: Duration::from_micros(20), ..AgingConfig::default() };
    let mut sw = ValueSwitch::<Addr>::new(cfg);
    let err = sw.add_job(aging_job(2, 4, 1, 1)).unwrap_err();
    assert!(matches!(err, AdmitError::AgingTooFine { .. }));
    assert!(err.to_string().contains("block_exp_ms 1 with 100 scanners x 4 checks"), "{err}");
}

#[test]
fn a_slow_source_one_step_behind_the_others_is_readmitted() {
    // Declared slow, it then sends the current block of its slot just after
    // the others completed it: it is within a window, so it caught up.
    let mut sw = aging_switch(aging_job(3, 2, 4, 1), 1, 1);
    for b in 0..2 {
        send_at(&mut sw, at(0), Pkt::data(1, 0, b, &[1]));
        send_at(&mut sw, at(0), Pkt::data(1, 1, b, &[1]));
    }
    tick(&mut sw, at(4));
    tick(&mut sw, at(8));
    assert_eq!(sw.slow_sources(1), vec![2]);
    send_at(&mut sw, at(9), Pkt::data(1, 0, 2, &[1]));
    send_at(&mut sw, at(9), Pkt::data(1, 1, 2, &[1])); // block 2 done without source 2
    let out = send_at(&mut sw, at(9), Pkt::data(1, 2, 2, &[1]));
    assert!(out.iter().any(|o| o.1.msg_type == MessageType::Result && o.1.src_cnt == 2), "late: the partial result");
    assert!(out.iter().any(|o| o.1.msg_type == MessageType::Membership && o.1.age_op == MEMBERSHIP_READMITTED));
    // but a contribution for a shadow (two steps behind) does not re-admit
    let mut sw = aging_switch(aging_job(3, 2, 4, 1), 1, 1);
    for b in 0..2 {
        send_at(&mut sw, at(0), Pkt::data(1, 0, b, &[1]));
        send_at(&mut sw, at(0), Pkt::data(1, 1, b, &[1]));
    }
    tick(&mut sw, at(4));
    tick(&mut sw, at(8));
    for s in 0..2 {
        send_at(&mut sw, at(9), Pkt::data(1, s, 2, &[1]));
    }
    let out = send_at(&mut sw, at(9), Pkt::data(1, 2, 0, &[1]));
    assert!(out.iter().all(|o| o.1.msg_type != MessageType::Membership));
    assert_eq!(sw.slow_sources(1), vec![2]);
}

#[test]
fn a_data_phase_without_contributions_is_never_emitted_empty() {
    // Block 0's exponent round ages with only source 0; source 0 is then
    // declared slow (missing from blocks 1 and 3). Block 0's data phase now
    // waits for nobody, but has nothing to emit: it stays open until data
    // arrives, and its result then sums that data.
    let mut sw = aging_switch(aging_job(3, 2, 2, 1), 1, 1);
    let mut all = Vec::new();
    send_at(&mut sw, at(0), Pkt::exp_only(1, 0, 0, 4));
    for s in 1..3 {
        send_at(&mut sw, at(0), Pkt::data(1, s, 1, &[1]));
    }
    for t in [2, 4] {
        all.extend(tick(&mut sw, at(t)));
    }
    for s in 1..3 {
        all.extend(send_at(&mut sw, at(5), Pkt::data(1, s, 3, &[1])));
    }
    for t in [6, 8, 10] {
        all.extend(tick(&mut sw, at(t)));
    }
    assert_eq!(sw.slow_sources(1), vec![0]);
    all.extend(send_at(&mut sw, at(11), Pkt::data(1, 1, 0, &[7]).float(4, EXP_NONE)));
    for t in [12, 14, 16] {
        all.extend(tick(&mut sw, at(t)));
    }
    let results: Vec<_> = all.iter().filter(|o| o.1.msg_type == MessageType::Result && !o.1.exp_only).collect();
    assert!(results.iter().all(|o| o.1.src_cnt > 0), "no result sums zero sources");
    let block0: Vec<_> = results.iter().filter(|o| o.1.block_id == 0).collect();
    assert!(!block0.is_empty(), "block 0 was emitted once data arrived");
    assert_eq!((block0[0].1.src_cnt, block0[0].2.clone()), (1, vec![7]));
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
    // an overloaded parent's own trim is left to the children's pace
    let mut busy = nack.clone();
    Nack { reason: NackReason::Trimmed, detail: TrimCause::ProcessingQueue as u32 }
        .emit_reply(&Packet::new_checked(&partial[..]).unwrap(), true, &mut busy);
    assert!(send_from(&mut sw, PARENT, &busy).is_empty());
    // the parent's result cut to its header on the way down: ask again
    let cut = parent_result(0, 5, &[111, 222]);
    let out = send_from(&mut sw, PARENT, &cut[..HEADER_LEN]);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].1.msg_type, out[0].2.clone()), (PARENT, MessageType::Retransmission, vec![11, 22]));
    assert_eq!((sw.counters().resent_up, sw.counters().trimmed_in_network), (2, 1));
    // the whole result then goes down; a cut copy after it is stale
    assert_eq!(send_from(&mut sw, PARENT, &cut).len(), 2);
    assert!(send_from(&mut sw, PARENT, &cut[..HEADER_LEN]).is_empty());
    assert_eq!(sw.counters().parent_stale, 2, "the overloaded parent's trim and the late cut copy");
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
    let mut sw = switch_with(&[job(1, 2, 4)]);
    for b in 0..4 {
        send(&mut sw, Pkt::data(1, 0, b, &[1]));
        send(&mut sw, Pkt::data(1, 1, b, &[1]));
    }
    send(&mut sw, Pkt::data(1, 0, 4, &[1])); // block 4 open
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1, 2], ..job(1, 2, 4) }, None, &[2], &mut out).unwrap();
    // before its sync, the new member is waited for nowhere
    assert_eq!(send(&mut sw, Pkt::data(1, 1, 4, &[1])).len(), 2);
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
        assert_eq!(send(&mut sw, Pkt::data(1, 1, b, &[1])).len(), 3, "block {b}");
    }
    // ... blocks from its start wait for it
    send(&mut sw, Pkt::data(1, 0, 16, &[1]));
    assert!(send(&mut sw, Pkt::data(1, 1, 16, &[1])).is_empty());
    let out = send(&mut sw, Pkt::data(1, 2, 16, &[1]));
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|o| o.1.src_cnt == 3 && o.2 == vec![3]));
}

/// Timers walk the jobs in job_id order, so a switch holding several jobs
/// emits the same datagrams in the same order every run (the simulator is
/// reproducible from its seed). Two switches fed the same datagrams, with
/// the jobs admitted in opposite orders, age out their blocks in one order:
/// with a hash map of jobs, each map's own random state ordered them.
#[test]
fn aging_emits_in_job_order_whatever_the_admission_order() {
    let specs: Vec<JobSpec> = (1..=24).map(|id| JobSpec { job_id: id, ..aging_job(2, 4, 10, 0) }).collect();
    let run = |order: &mut dyn Iterator<Item = &JobSpec>| {
        let mut cfg = ShardConfig::single(1 << 30);
        cfg.aging = AgingConfig { scanners: 1, checks: 1, min_tick: Duration::from_micros(1), ..AgingConfig::default() };
        let mut sw = ValueSwitch::new(cfg);
        for spec in order {
            sw.add_job(spec.clone()).unwrap();
        }
        for spec in &specs {
            send_at(&mut sw, at(1), Pkt::data(spec.job_id, 0, 0, &[spec.job_id as i32]));
        }
        let mut out = Vec::new();
        for ms in [10, 20, 30] {
            out.extend(tick(&mut sw, at(ms)).into_iter().map(|(a, r, v)| (a, r.job_id, r.block_id, v)));
        }
        out
    };
    let forward = run(&mut specs.iter());
    let backward = run(&mut specs.iter().rev());
    assert_eq!(forward.len(), 24, "every job's block aged once: {forward:?}");
    assert_eq!(forward, backward);
    let jobs: Vec<u32> = forward.iter().map(|o| o.1).collect();
    assert!(jobs.windows(2).all(|w| w[0] < w[1]), "in job_id order: {jobs:?}");
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
