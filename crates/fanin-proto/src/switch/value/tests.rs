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
            let mut vals = vec![0; if repr.msg_type == MessageType::Result { repr.grad_cnt as usize } else { 0 }];
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
    assert!(send(&mut sw, Pkt::data(1, 1, 0, &[2]).retransmission()).is_empty());
    assert_eq!(sw.counters().stale, 1);
}

#[test]
fn sender_ahead_of_the_slots_is_refused_until_the_slot_frees() {
    let mut sw = switch_with(&[job(1, 2, 2)]);
    send(&mut sw, Pkt::data(1, 0, 0, &[1]));
    // block 2 needs slot 0, whose block 0 is still aggregating
    assert!(send(&mut sw, Pkt::data(1, 0, 2, &[1])).is_empty());
    assert_eq!(sw.counters().slot_busy, 1);
    // far beyond the window
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
fn data_before_exponent_negotiation_is_a_violation() {
    let mut sw = switch_with(&[job(1, 2, 4)]);
    send(&mut sw, Pkt::exp_only(1, 0, 0, 3));
    assert!(send(&mut sw, Pkt::data(1, 1, 0, &[5]).float(3, EXP_NONE)).is_empty());
    assert_eq!(sw.counters().protocol_violation, 1);
}

#[test]
fn jobs_are_isolated_and_memory_is_reserved() {
    let mut sw = ValueSwitch::<Addr>::new(ShardConfig::single(2 * 4 * 64 * 4 * 2));
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
    assert_eq!(sw.memory_used(), 0);
}

#[test]
fn blocks_of_other_shards_are_handed_over() {
    let cfg = ShardConfig { shard: 0, shard_count: 2, incarnation: 1, memory_limit: 1 << 20 };
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
