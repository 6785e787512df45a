//! Unit tests of the session state machine, against a real switch shard
//! with datagrams moved by hand.

use super::*;
use crate::bfp::half::Half;
use fanin_wire::value::JOIN_SYNC;
use crate::job::JobSpec;
use crate::switch::{ShardConfig, ValueSwitch};
use crate::transmit::VecTransmit;

/// Move a session's Join to the switch and the answers back, by hand.
fn join_by_hand(s: &mut AllreduceSession, sw: &mut ValueSwitch<u16>) {
    join_rewriting(s, sw, |_| {})
}

/// `join_by_hand`, with each answer rewritten on its way to the worker.
fn join_rewriting(s: &mut AllreduceSession, sw: &mut ValueSwitch<u16>, rewrite: impl Fn(&mut Vec<u8>)) {
    let mut out = VecTransmit::new();
    s.poll_transmit(Time::ZERO, &mut out);
    for (_, join) in out.drain() {
        let mut reply = VecTransmit::new();
        let _ = sw.handle_datagram(Time::ZERO, 0, &join, &mut reply);
        for (_, mut b) in reply.drain() {
            rewrite(&mut b);
            s.handle_datagram(Time::ZERO, &b);
        }
    }
}

/// One worker, one switch shard, datagrams moved by hand.
fn joined(window: u32) -> (AllreduceSession, ValueSwitch<u16>) {
    joined_rewriting(window, |_| {})
}

/// `joined`, with the switch's answers to the join rewritten.
fn joined_rewriting(window: u32, rewrite: impl Fn(&mut Vec<u8>)) -> (AllreduceSession, ValueSwitch<u16>) {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(JobSpec::with_sources(1, 1, 16, 64)).unwrap();
    let mut cfg = SessionConfig::new(1, 0);
    cfg.elems_per_packet = 4;
    cfg.window = window;
    let mut s = AllreduceSession::new(cfg, Time::ZERO);
    join_rewriting(&mut s, &mut sw, rewrite);
    assert!(matches!(s.poll_event(), Some(Event::Joined(_))));
    (s, sw)
}

#[test]
fn a_worker_that_joined_with_sync_probes_with_a_plain_join() {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(JobSpec::with_sources(1, 1, 16, 64)).unwrap();
    let mut cfg = SessionConfig::new(1, 0);
    cfg.elems_per_packet = 4;
    cfg.sync_join = true;
    cfg.align_blocks = 2;
    let mut s = AllreduceSession::new(cfg, Time::ZERO);
    let mut out = VecTransmit::new();
    s.poll_transmit(Time::ZERO, &mut out);
    let joins: Vec<_> = out.drain().collect();
    assert_eq!(Packet::new_checked(&joins[0].1[..]).unwrap().age_op(), JOIN_SYNC);
    deliver(&mut s, &mut sw, Time::ZERO, joins);
    assert!(matches!(s.poll_event(), Some(Event::Joined(_))));
    // The switch goes silent: everything sent is lost.
    s.begin(Time::ZERO, Tensor::I32(vec![1; 8])).unwrap();
    let mut now = Time::ZERO;
    let mut probe = None;
    while probe.is_none() && now < Time::from_nanos(30_000_000_000) {
        now = s.poll_timeout().unwrap();
        s.handle_timeout(now);
        s.poll_transmit(now, &mut out);
        probe = out.drain().map(|(_, b)| b).find(|b| {
            Packet::new_checked(&b[..]).is_ok_and(|p| p.msg_type_code() == MessageType::Join as u8)
        });
    }
    let probe = probe.expect("a probe after three stall timeouts");
    assert_eq!(Packet::new_checked(&probe[..]).unwrap().age_op(), 0, "a plain join, not a sync join");
}

fn deliver(s: &mut AllreduceSession, sw: &mut ValueSwitch<u16>, now: Time, datagrams: Vec<(u16, Vec<u8>)>) {
    for (_, bytes) in datagrams {
        let mut reply = VecTransmit::new();
        let _ = sw.handle_datagram(now, 0, &bytes, &mut reply);
        for (_, b) in reply.drain() {
            s.handle_datagram(now, &b);
        }
    }
}

/// Two workers listening on the job's result group and one not: results
/// reach the listeners through the group datagram, the other by
/// unicast, and all three get the same sum.
#[test]
fn workers_listening_on_the_group_get_their_results_from_it() {
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(JobSpec { result_group: Some(group), ..JobSpec::with_sources(1, 3, 16, 64) }).unwrap();
    let mut workers: Vec<AllreduceSession> = (0..3u16)
        .map(|src| {
            let mut cfg = SessionConfig::new(1, src);
            cfg.elems_per_packet = 4;
            cfg.listens_on_group = src != 1;
            AllreduceSession::new(cfg, Time::ZERO)
        })
        .collect();
    let now = Time::ZERO;
    // worker address = source id; a datagram to the group reaches the listeners
    let pump = |workers: &mut Vec<AllreduceSession>, sw: &mut ValueSwitch<u16>| {
        let mut moved = 0;
        for src in 0..3u16 {
            let mut out = VecTransmit::new();
            while workers[src as usize].poll_transmit(now, &mut out) > 0 {}
            for (_, bytes) in out.drain() {
                if src == 0 {
                    // every Join of a listener says so
                    let p = Packet::new_checked(&bytes[..]).unwrap();
                    if p.msg_type_code() == MessageType::Join as u8 {
                        assert!(p.listens_on_group());
                    }
                }
                let mut reply = VecTransmit::new();
                reply.groups_reachable = true;
                let _ = sw.handle_datagram(now, src, &bytes, &mut reply);
                for (to, b) in reply.drain() {
                    workers[to as usize].handle_datagram(now, &b);
                    moved += 1;
                }
                for (_, b) in reply.group_datagrams.drain(..) {
                    for w in [0, 2] {
                        workers[w].handle_datagram(now, &b);
                    }
                    moved += 1;
                }
            }
        }
        moved
    };
    while pump(&mut workers, &mut sw) > 0 {}
    for (src, w) in workers.iter_mut().enumerate() {
        match w.poll_event() {
            Some(Event::Joined(p)) => assert_eq!(p.results_on_group, src != 1, "worker {src}"),
            other => panic!("worker {src}: {other:?}"),
        }
        w.begin(now, Tensor::I32((0..10).map(|i| i * (src as i32 + 1)).collect())).unwrap();
    }
    while pump(&mut workers, &mut sw) > 0 {}
    let want: Vec<i32> = (0..10).map(|i| i * 6).collect();
    for (src, w) in workers.iter_mut().enumerate() {
        match w.poll_event() {
            Some(Event::Completed(o)) => assert_eq!(o.tensor, Tensor::I32(want.clone()), "worker {src}"),
            other => panic!("worker {src}: {other:?}"),
        }
    }
    let c = sw.counters();
    assert_eq!((c.results_to_group, c.results_sent), (3, 3), "3 blocks: one group datagram and one unicast each");
}

#[test]
fn a_lost_contribution_is_resent_after_three_later_results_without_waiting_for_a_timeout() {
    let (mut s, mut sw) = joined(8);
    let now = Time::from_nanos(1_000);
    s.begin(now, Tensor::I32((0..20).collect())).unwrap();
    let mut out = VecTransmit::new();
    while s.poll_transmit(now, &mut out) > 0 {}
    let mut sent: Vec<_> = out.drain().collect();
    assert_eq!(sent.len(), 5, "20 elements / 4 per packet");
    sent.remove(0); // block 0's contribution is lost
    deliver(&mut s, &mut sw, now, sent);
    // results of blocks 1..4 overtook block 0: it goes out again at once
    let mut out = VecTransmit::new();
    s.poll_transmit(now, &mut out);
    let resent: Vec<_> = out.drain().collect();
    assert_eq!(resent.len(), 1);
    let p = Packet::new_checked(&resent[0].1[..]).unwrap();
    assert_eq!((p.msg_type_code(), p.block_id()), (MessageType::Retransmission as u8, 0));
    deliver(&mut s, &mut sw, now, resent);
    match s.poll_event() {
        Some(Event::Completed(o)) => {
            assert_eq!(o.tensor, Tensor::I32((0..20).collect()));
            assert_eq!(o.retransmissions, 1);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_burst_lost_at_the_tail_is_resent_after_one_stall_timeout_not_one_per_block() {
    // found on a 100 Mbit/s testbed link: 200 blocks lost at the end of a
    // window were repaired one per stall timeout, each longer than the last
    // (39 s for one allreduce). No later block is left to overtake them.
    let (mut s, mut sw) = joined(16);
    let t0 = Time::from_nanos(1_000);
    s.begin(t0, Tensor::I32((0..40).collect())).unwrap();
    let mut out = VecTransmit::new();
    while s.poll_transmit(t0, &mut out) > 0 {}
    let mut sent: Vec<_> = out.drain().collect();
    assert_eq!(sent.len(), 10, "40 elements / 4 per packet");
    sent.truncate(4); // blocks 4..9 are lost on the way
    deliver(&mut s, &mut sw, t0, sent);
    // nothing more comes back: the stall timer resends the oldest one
    let stalled = t0 + Duration::from_secs(2);
    s.handle_timeout(stalled);
    let mut out = VecTransmit::new();
    while s.poll_transmit(stalled, &mut out) > 0 {}
    let resent: Vec<_> = out.drain().collect();
    assert_eq!(resent.len(), 1, "one block per stall, as TCP");
    deliver(&mut s, &mut sw, stalled, resent);
    // its result came back first: the other five were sent before it, so
    // they are lost, and go out at once, without another timeout
    let mut out = VecTransmit::new();
    while s.poll_transmit(stalled, &mut out) > 0 {}
    let rest: Vec<_> = out.drain().collect();
    let ids: Vec<u32> = rest.iter().map(|(_, d)| Packet::new_checked(&d[..]).unwrap().block_id()).collect();
    assert_eq!(ids, vec![5, 6, 7, 8, 9]);
    deliver(&mut s, &mut sw, stalled, rest);
    match s.poll_event() {
        Some(Event::Completed(o)) => {
            assert_eq!(o.tensor, Tensor::I32((0..40).collect()));
            assert_eq!((o.retransmissions, o.timeouts), (6, 1));
        }
        other => panic!("{other:?}"),
    }
}

/// How a test's allreduce holds its tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lending {
    /// The session owns the input; results overwrite it.
    Nothing,
    /// Results go to a lent output; the session owns the input.
    Output,
    /// Results go to a lent output; the input is borrowed too.
    InputAndOutput,
}
const LENDINGS: [Lending; 3] = [Lending::Nothing, Lending::Output, Lending::InputAndOutput];

fn lossy_40_values() -> Vec<f32> {
    (0..40).map(|i| (i as f32 - 17.5) * 0.37).collect()
}

/// Runs one float allreduce of 40 elements with block 3's first data
/// transmission lost, holding its tensors as `lending` says; returns
/// the sum, the tensor the outcome handed back, the first data
/// transmission of each block and the session.
fn run_lossy_40(lending: Lending) -> (Vec<f32>, Tensor, std::collections::HashMap<u32, Vec<u8>>, AllreduceSession) {
    let (mut s, mut sw) = joined(8);
    let now = Time::from_nanos(1_000);
    let values = lossy_40_values();
    let mut out = vec![f32::NAN; 40];
    // SAFETY (both `begin_into`s): `out` and `values` outlive the
    // allreduce, which completes below (asserted) before `out` is read.
    match lending {
        Lending::Nothing => s.begin_prepared(now, Prepared::new(Tensor::F32(values.clone()), 4).unwrap()).unwrap(),
        Lending::Output => {
            let prepared = Prepared::new(Tensor::F32(values.clone()), 4).unwrap();
            unsafe { s.begin_into(now, prepared, TensorMut::F32(&mut out)) }.unwrap()
        }
        Lending::InputAndOutput => {
            let prepared = Prepared::borrow(TensorRef::F32(&values), 4).unwrap();
            unsafe { s.begin_into(now, prepared, TensorMut::F32(&mut out)) }.unwrap()
        }
    }
    let mut sent_data = std::collections::HashMap::new();
    let mut lost_once = false;
    let mut outcome = None;
    for _ in 0..100 {
        let mut tx = VecTransmit::new();
        while s.poll_transmit(now, &mut tx) > 0 {}
        let mut batch: Vec<_> = tx.drain().collect();
        for (_, b) in &batch {
            let p = Packet::new_checked(&b[..]).unwrap();
            if !p.exp_only() && p.msg_type_code() == MessageType::Contribution as u8 {
                sent_data.insert(p.block_id(), b.clone());
            }
        }
        // block 3's first data transmission is lost: its result comes
        // from a retransmission, and what is retained is still what
        // the first transmission carried
        if !lost_once {
            if let Some(i) = batch.iter().position(|(_, b)| {
                let p = Packet::new_checked(&b[..]).unwrap();
                !p.exp_only() && p.block_id() == 3
            }) {
                batch.remove(i);
                lost_once = true;
            }
        }
        deliver(&mut s, &mut sw, now, batch);
        if let Some(Event::Completed(o)) = s.poll_event() {
            outcome = Some(o);
            break;
        }
    }
    assert!(lost_once);
    let o = outcome.expect("the allreduce completes");
    assert_eq!(values, lossy_40_values(), "the input is never written");
    let sum = if lending == Lending::Nothing {
        let Tensor::F32(v) = o.tensor.clone() else { unreachable!() };
        v
    } else {
        out
    };
    (sum, o.tensor, sent_data, s)
}

#[test]
fn a_retained_contribution_is_the_very_datagram_first_sent() {
    for lending in LENDINGS {
        let (_, _, sent_data, s) = run_lossy_40(lending);
        assert_eq!(s.captured.pending(), 0, "every result took its block's capture (none emitted twice)");
        let retained = s.retained_blocks();
        assert_eq!(retained, (0..10).collect::<Vec<_>>(), "every block of the one allreduce");
        for b in retained {
            let kept = s.retained_bytes(b).expect("emitted by the time the allreduce ended");
            assert_eq!(kept, &sent_data[&b][..], "block {b}, {lending:?} lent");
            assert_eq!(Packet::new_checked(kept).unwrap().grad_cnt(), 4);
        }
    }
}

#[test]
fn a_lent_output_gets_the_same_sum_and_the_input_comes_back_unchanged() {
    let (owned_sum, _, _, _) = run_lossy_40(Lending::Nothing);
    let (lent_sum, handed_back, _, _) = run_lossy_40(Lending::Output);
    assert_eq!(lent_sum, owned_sum, "bit-identical to the owned path");
    assert_eq!(handed_back, Tensor::F32(lossy_40_values()), "the input, untouched");
    assert!(lent_sum.iter().all(|v| v.is_finite()), "every element written");
}

#[test]
fn a_borrowed_input_gets_the_same_sum_and_nothing_is_handed_back() {
    let (owned_sum, _, _, _) = run_lossy_40(Lending::Nothing);
    let (lent_sum, handed_back, _, _) = run_lossy_40(Lending::InputAndOutput);
    assert_eq!(lent_sum, owned_sum, "bit-identical to the owned path");
    assert_eq!(handed_back, Tensor::F32(Vec::new()), "the caller has the input");
}

#[test]
fn a_borrowed_input_with_a_refused_value_is_refused_with_its_index() {
    let mut values = vec![1.0f32; 10];
    values[6] = 1e38;
    let err = Prepared::borrow(TensorRef::F32(&values), 4).unwrap_err();
    assert_eq!(err.index, 6);
    // an infinity is carried: its block (elements 4..8) is marked
    values[6] = f32::INFINITY;
    let prepared = Prepared::borrow(TensorRef::F32(&values), 4).unwrap();
    assert_eq!(prepared.local_exp, [1, fanin_wire::value::EXP_NON_FINITE, 1]);
}

/// An input refused before anything was sent may leave the other ranks
/// waiting in that allreduce: this session's next allreduce would be
/// summed with their pending one (an audit saw 1 + 10 returned on both
/// ranks), so the session takes no more, however the input was prepared.
#[test]
fn a_session_that_refused_an_input_takes_no_more_allreduces() {
    let now = Time::from_nanos(1_000);
    let mut huge = vec![1.0f32; 8];
    huge[5] = 1e38;
    // refused inside begin
    let (mut s, _) = joined(8);
    let err = s.begin(now, Tensor::F32(huge.clone())).unwrap_err();
    assert!(matches!(err, SessionError::OutOfRange(e) if e.index == 5), "{err}");
    let later = s.begin(now, Tensor::F32(vec![1.0; 8])).unwrap_err();
    assert!(matches!(later, SessionError::OutOfStep(e) if e.index == 5), "{later}");
    assert!(later.to_string().contains("takes no more allreduces"), "{later}");
    // refused by a caller that prepared the input itself
    let (mut s, _) = joined(8);
    let refused = Prepared::borrow(TensorRef::F32(&huge), 4).unwrap_err();
    assert!(matches!(s.refuse_input(refused), SessionError::OutOfRange(_)));
    let later = s.begin_prepared(now, Prepared::new(Tensor::F32(vec![1.0; 8]), 4).unwrap()).unwrap_err();
    assert!(matches!(later, SessionError::OutOfStep(_)), "{later}");
    let mut tx = VecTransmit::new();
    assert_eq!(s.poll_transmit(now, &mut tx), 0, "nothing sent");
}

#[test]
fn a_lent_output_of_the_wrong_shape_or_dtype_is_refused_before_anything_is_sent() {
    let (mut s, _) = joined(8);
    let now = Time::from_nanos(1_000);
    let mut short = vec![0.0f32; 7];
    let mut ints = vec![0i32; 8];
    for out in [TensorMut::F32(&mut short), TensorMut::I32(&mut ints)] {
        let prepared = Prepared::new(Tensor::F32(vec![1.0; 8]), 4).unwrap();
        // SAFETY: refused, so the session keeps nothing.
        let err = unsafe { s.begin_into(now, prepared, out) }.unwrap_err();
        assert!(err.to_string().contains("output must match the input"), "{err}");
    }
    let mut tx = VecTransmit::new();
    assert_eq!(s.poll_transmit(now, &mut tx), 0, "nothing sent");
    assert!(s.op.is_none());
}

#[test]
fn abandoning_an_allreduce_releases_its_output_and_the_session_can_begin_again() {
    let (mut s, _) = joined(8);
    let now = Time::from_nanos(1_000);
    let mut out = vec![0i32; 8];
    // SAFETY: abandoned below, before `out` is used again.
    unsafe { s.begin_into(now, Prepared::new(Tensor::I32(vec![1; 8]), 4).unwrap(), TensorMut::I32(&mut out)) }
        .unwrap();
    let mut tx = VecTransmit::new();
    assert!(s.poll_transmit(now, &mut tx) > 0);
    s.abandon();
    assert!(s.op.is_none() && s.poll_event().is_none(), "ended without an event");
    s.begin(now, Tensor::I32(vec![1; 8])).unwrap();
}

#[test]
fn a_tensor_prepared_while_copied_equals_one_prepared_after() {
    let values: Vec<f32> = (0..5000).map(|i| ((i * 37) % 1001) as f32 * 0.5f32.powi(i % 40) - 3.0).collect();
    let copied = Prepared::copy_f32(&values, 64, vec![9.0; 10]).unwrap();
    assert_eq!(copied, Prepared::new(Tensor::F32(values.clone()), 64).unwrap());
    // a refused value is named by its index in the tensor, not its block
    let mut bad = values;
    bad[4321] = -1e38;
    let e = Prepared::copy_f32(&bad, 64, Vec::new()).unwrap_err();
    assert_eq!((e.index, e.value), (4321, -1e38));
    assert_eq!(Prepared::new(Tensor::F32(bad), 1024).unwrap_err().index, 4321);
}

#[test]
fn a_tensor_prepared_for_another_block_size_is_prepared_again() {
    let (mut s, mut sw) = joined(8);
    let now = Time::from_nanos(1_000);
    // prepared for blocks of 2; the session sends blocks of 4
    let values = vec![1.0f32, 2.0, 1000.0, 0.5, 0.25, 3.0];
    s.begin_prepared(now, Prepared::new(Tensor::F32(values.clone()), 2).unwrap()).unwrap();
    for _ in 0..10 {
        let mut out = VecTransmit::new();
        while s.poll_transmit(now, &mut out) > 0 {}
        deliver(&mut s, &mut sw, now, out.drain().collect());
    }
    match s.poll_event() {
        Some(Event::Completed(o)) => assert_eq!(o.tensor, Tensor::F32(values)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn stall_timer_resends_only_after_an_rto_without_progress() {
    let (mut s, mut sw) = joined(8);
    let t0 = Time::from_nanos(1_000);
    s.begin(t0, Tensor::I32(vec![7; 4])).unwrap();
    let mut out = VecTransmit::new();
    s.poll_transmit(t0, &mut out);
    out.drain().for_each(drop); // lost
    let deadline = s.poll_timeout().unwrap();
    assert_eq!(deadline, t0 + s.config().rto_initial);
    s.handle_timeout(Time::from_nanos(deadline.as_nanos() - 1));
    assert_eq!(s.poll_transmit(deadline, &mut out), 0, "not yet");
    s.handle_timeout(deadline);
    assert_eq!(s.poll_transmit(deadline, &mut out), 1);
    deliver(&mut s, &mut sw, deadline, out.drain().collect());
    assert!(matches!(s.poll_event(), Some(Event::Completed(_))));
}

/// What the JoinAck `packet_elems` gives a session that left its packet
/// size to the job: a 1500-byte data link's cap, or the job's block size.
fn packet_size_from(packet_elems_max: u32, block_grad_max: u32) -> u16 {
    packet_sizes_from(packet_elems_max, block_grad_max).0
}

/// (elems_per_packet, half_elems_per_packet) a session takes from the job.
fn packet_sizes_from(packet_elems_max: u32, block_grad_max: u32) -> (u16, u16) {
    let mut sw = ValueSwitch::new(ShardConfig { packet_elems_max, ..ShardConfig::single(1 << 24) });
    sw.add_job(JobSpec::with_sources(1, 1, 16, block_grad_max)).unwrap();
    let mut s = AllreduceSession::new(SessionConfig::new(1, 0), Time::ZERO);
    assert_eq!(s.elems_per_packet(), 0, "the job's, once joined");
    join_by_hand(&mut s, &mut sw);
    assert!(matches!(s.poll_event(), Some(Event::Joined(_))));
    (s.elems_per_packet(), s.half_elems_per_packet())
}

#[test]
fn a_session_takes_the_jobs_packet_size_which_fits_the_switchs_link() {
    let mtu_1500 = fanin_wire::value::elems_fitting_mtu(1500, false);
    assert_eq!(packet_size_from(mtu_1500, 1024), 358);
    assert_eq!(packet_size_from(mtu_1500, 100), 100, "never above the job's block size");
    assert_eq!(packet_size_from(u32::MAX, 1024), 1024, "no MTU known: the job's block size");
}

#[test]
fn a_16_bit_allreduce_fills_the_same_datagram_with_twice_the_elements() {
    let mtu_1500 = fanin_wire::value::elems_fitting_mtu(1500, false);
    let (per, half) = packet_sizes_from(mtu_1500, 1024);
    assert_eq!((per, half), (358, 716));
    // 716 int16 lanes: a 1456-byte UDP payload, a 1484-byte IP packet
    assert!(24 + 2 * half as usize + 8 + 20 <= 1500);
    assert_eq!(packet_sizes_from(mtu_1500, 500), (358, 500), "never above the job's block size");
    assert_eq!(packet_sizes_from(u32::MAX, 1024), (1024, 1024));
    // a session that chose its packet size keeps it for every dtype
    let mut cfg = SessionConfig::new(1, 0);
    cfg.elems_per_packet = 64;
    let mut s = AllreduceSession::new(cfg, Time::ZERO);
    let mut sw = ValueSwitch::new(ShardConfig { packet_elems_max: mtu_1500, ..ShardConfig::single(1 << 24) });
    sw.add_job(JobSpec::with_sources(1, 1, 16, 1024)).unwrap();
    join_by_hand(&mut s, &mut sw);
    assert_eq!((s.elems_per_packet(), s.half_elems_per_packet()), (64, 64));
}

#[test]
fn a_join_ack_announcing_nothing_fits_does_not_panic_the_worker() {
    // a malformed JoinAck (block_grad_max 0) from a broken switch
    let mut s = AllreduceSession::new(SessionConfig::new(1, 0), Time::ZERO);
    let repr = Repr { src_cnt: 1, ..Repr::new(MessageType::JoinAck, 1, 0) };
    let params = JoinParams {
        block_cnt_max: 16,
        block_grad_max: 0,
        block_exp_ms: 0,
        incarnation: 3,
        shard_count: 1,
        next_block: 0,
        results_on_group: false,
        partial_results: false,
        packet_elems: 0,
        order_shards: 0,
        result_key: None,
    };
    let mut buf = vec![0; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    params.emit(p.payload_mut());
    s.handle_datagram(Time::ZERO, &buf);
    assert!(s.elems_per_packet() <= 1);
}

/// Joined like `joined(8)`, but the JoinAck is rewritten to say results come
/// in order only within `order_shards` classes (what a child of a root spread
/// over several switches says, docs/protocol.md §6.3).
fn joined_with_order(order_shards: u8) -> (AllreduceSession, ValueSwitch<u16>) {
    joined_rewriting(8, |b| {
        let mut params = JoinParams::parse(Packet::new_checked(&b[..]).unwrap().payload()).unwrap();
        params.order_shards = order_shards;
        params.emit(&mut b[fanin_wire::value::HEADER_LEN..]);
    })
}

#[test]
fn results_of_another_order_class_do_not_make_a_block_look_lost() {
    for (order_shards, resent) in [(0u8, true), (2, false)] {
        let (mut s, mut sw) = joined_with_order(order_shards);
        let t0 = Time::from_nanos(1_000);
        s.begin(t0, Tensor::I32((0..32).collect())).unwrap();
        let mut out = VecTransmit::new();
        while s.poll_transmit(t0, &mut out) > 0 {}
        let sent: Vec<_> = out.drain().collect();
        assert_eq!(sent.len(), 8);
        // block 0's result is late; the results of the blocks in the other
        // of two classes (shard_of over 2) arrive: 1, 3, 5, 7 with job 1
        let other: Vec<u32> = (1..8).filter(|&b| shard_of(1, b, 16, 2) != shard_of(1, 0, 16, 2)).collect();
        assert_eq!(other, vec![1, 3, 5, 7]);
        let t1 = t0 + Duration::from_micros(20);
        for (_, bytes) in sent.iter().filter(|(_, b)| other.contains(&Packet::new_checked(&b[..]).unwrap().block_id())) {
            let mut reply = VecTransmit::new();
            let _ = sw.handle_datagram(t1, 0, bytes, &mut reply);
            for (_, r) in reply.drain() {
                s.handle_datagram(t1, &r);
            }
        }
        while s.poll_transmit(t1, &mut out) > 0 {}
        let again: Vec<u32> = out.drain().map(|(_, b)| Packet::new_checked(&b[..]).unwrap().block_id()).collect();
        assert_eq!(again.contains(&0), resent, "order_shards {order_shards}: sent {again:?}");
    }
}

#[test]
fn an_ended_rounds_notice_for_a_straggler_does_not_end_the_round_a_session_joined() {
    // A relay (docs/goat.md, on-path filtering) fans a notice meant for one
    // straggler of the ended round out to every host behind it: its next
    // round starts where this session joined, so it is not about its round.
    let (mut s, _sw) = joined(4);
    let joined_at = s.params.as_ref().unwrap().next_block;
    let notice = |block: u32| {
        let repr = Repr {
            age_op: MEMBERSHIP_RESTARTED,
            block_id: block,
            ..Repr::new(MessageType::Membership, 1, 5)
        };
        let mut b = vec![0; repr.buffer_len()];
        repr.emit(&mut Packet::new_unchecked(&mut b[..]));
        b
    };
    s.handle_datagram(Time::ZERO, &notice(joined_at));
    assert!(s.error().is_none(), "an ended round's notice is not about this one");
    // the end of this session's own round (its next round starts later) is
    s.handle_datagram(Time::ZERO, &notice(joined_at.wrapping_add(64)));
    assert!(matches!(s.error(), Some(SessionError::MemberRestarted { rank: 5, .. })), "{:?}", s.error());
}

/// `n` workers of job 1 on one shard, joined; datagrams moved by hand
/// (worker address = source id).
fn joined_workers(n: u16) -> (Vec<AllreduceSession>, ValueSwitch<u16>) {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(JobSpec::with_sources(1, n, 16, 64)).unwrap();
    let mut workers: Vec<AllreduceSession> = (0..n)
        .map(|src| {
            let mut cfg = SessionConfig::new(1, src);
            cfg.elems_per_packet = 4;
            AllreduceSession::new(cfg, Time::ZERO)
        })
        .collect();
    pump_all(&mut workers, &mut sw);
    for (src, w) in workers.iter_mut().enumerate() {
        assert!(matches!(w.poll_event(), Some(Event::Joined(_))), "worker {src}");
    }
    (workers, sw)
}

/// Move every datagram between the workers and the switch until none is left.
fn pump_all(workers: &mut [AllreduceSession], sw: &mut ValueSwitch<u16>) {
    loop {
        let mut moved = 0;
        for src in 0..workers.len() {
            let mut out = VecTransmit::new();
            while workers[src].poll_transmit(Time::ZERO, &mut out) > 0 {}
            for (_, bytes) in out.drain() {
                let mut reply = VecTransmit::new();
                let _ = sw.handle_datagram(Time::ZERO, src as u16, &bytes, &mut reply);
                for (to, b) in reply.drain() {
                    workers[to as usize].handle_datagram(Time::ZERO, &b);
                    moved += 1;
                }
            }
        }
        if moved == 0 {
            return;
        }
    }
}

/// Each worker's allreduce of `inputs[src]` (prepared by `prepare`), to its end.
fn outcomes(n: u16, inputs: impl Fn(u16) -> Prepared<'static>) -> Vec<Result<Outcome, SessionError>> {
    let (mut workers, mut sw) = joined_workers(n);
    for (src, w) in workers.iter_mut().enumerate() {
        w.begin_prepared(Time::ZERO, inputs(src as u16)).unwrap();
    }
    pump_all(&mut workers, &mut sw);
    workers
        .iter_mut()
        .map(|w| match w.poll_event() {
            Some(Event::Completed(o)) => Ok(o),
            Some(Event::Failed(e)) => Err(e),
            other => panic!("{other:?}"),
        })
        .collect()
}

/// Found by the torch audit: two ranks averaging float16 40 000 got inf,
/// since the sum (80 000, past float16's 65 504) was rounded to float16
/// before the division. The mean is divided out while the result is decoded.
#[test]
fn a_16_bit_mean_whose_sum_overflows_the_type_is_the_mean() {
    for kind in [Half::F16, Half::BF16] {
        // (bfloat16 carries values below 2^126, whose sums fit its range)
        let big = if kind == Half::F16 { 40_000.0 } else { 2f64.powi(125) * 1.5 };
        let tensor = Tensor::Half(kind, vec![kind.from_f64(big); 10]);
        for o in outcomes(2, |_| Prepared::new(tensor.clone(), 4).unwrap().averaged()) {
            assert_eq!(o.unwrap().tensor, tensor, "{kind:?}: the mean of two equal values is that value");
        }
        if kind == Half::BF16 {
            continue;
        }
        // the float16 sum itself does not fit: infinite, as the type says
        for o in outcomes(2, |_| Prepared::new(tensor.clone(), 4).unwrap()) {
            let Tensor::Half(_, sum) = o.unwrap().tensor else { unreachable!() };
            assert!(sum.iter().all(|&v| kind.to_f32(v) == f32::INFINITY), "{kind:?}: {sum:?}");
        }
    }
}

/// A mean over three workers is divided once and rounded once: float32
/// and float16 means equal the exact mean of what was summed, rounded to
/// the type (the sums below are exact in block floating point).
#[test]
fn a_mean_over_three_workers_is_rounded_once() {
    let values = |src: u16| -> Vec<f64> { (0..10).map(|i| (i as f64 + 1.0) * (src as f64 + 1.0) / 8.0).collect() };
    let mean: Vec<f64> = (0..10).map(|i| (0..3).map(|s| values(s)[i]).sum::<f64>() / 3.0).collect();
    let f32s = outcomes(3, |src| Prepared::new(Tensor::F32(values(src).iter().map(|&v| v as f32).collect()), 4).unwrap().averaged());
    for o in f32s {
        assert_eq!(o.unwrap().tensor, Tensor::F32(mean.iter().map(|&m| m as f32).collect()));
    }
    let kind = Half::F16;
    let halves = outcomes(3, |src| Prepared::new(Tensor::Half(kind, values(src).iter().map(|&v| kind.from_f64(v)).collect()), 4).unwrap().averaged());
    for o in halves {
        assert_eq!(o.unwrap().tensor, Tensor::Half(kind, mean.iter().map(|&m| kind.from_f64(m)).collect()));
    }
}

#[test]
fn an_int32_mean_is_refused_before_anything_is_sent() {
    let (mut workers, _sw) = joined_workers(2);
    let e = workers[0].begin_prepared(Time::ZERO, Prepared::new(Tensor::I32(vec![1; 8]), 4).unwrap().averaged());
    assert!(matches!(e, Err(SessionError::Config(ref m)) if m.contains("float tensor")), "{e:?}");
    let mut out = VecTransmit::new();
    assert_eq!(workers[0].poll_transmit(Time::ZERO, &mut out), 0, "nothing sent");
}

/// Reports that nothing listens on the switch's port fail the session only
/// once they went on for `switch_gone_after` with nothing from the switch
/// in between (a restarting switch answers again), and at once for zero.
#[test]
fn a_switch_whose_port_stays_closed_is_gone_after_the_configured_time() {
    let secs = |s: f64| Time::from_nanos((s * 1e9) as u64);
    let (mut s, mut sw) = joined(8);
    s.handle_port_unreachable(secs(1.0));
    s.handle_port_unreachable(secs(9.0));
    assert!(s.poll_event().is_none(), "8 s of reports: not yet gone");
    // the switch answers: the reports start over
    s.begin(secs(9.5), Tensor::I32(vec![1; 8])).unwrap();
    let mut out = VecTransmit::new();
    s.poll_transmit(secs(9.5), &mut out);
    deliver(&mut s, &mut sw, secs(9.5), out.drain().collect());
    assert!(matches!(s.poll_event(), Some(Event::Completed(_))));
    s.handle_port_unreachable(secs(12.0));
    s.handle_port_unreachable(secs(21.9));
    assert!(s.poll_event().is_none(), "9.9 s since the switch last answered");
    s.handle_port_unreachable(secs(22.0));
    match s.poll_event() {
        Some(Event::Failed(SessionError::SwitchGone { waited })) => assert_eq!(waited, Duration::from_secs(10)),
        other => panic!("{other:?}"),
    }
    // zero: the first report
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(JobSpec::with_sources(1, 1, 16, 64)).unwrap();
    let mut cfg = SessionConfig::new(1, 0);
    cfg.switch_gone_after = Duration::ZERO;
    let mut s = AllreduceSession::new(cfg, Time::ZERO);
    join_by_hand(&mut s, &mut sw);
    assert!(matches!(s.poll_event(), Some(Event::Joined(_))));
    s.handle_port_unreachable(secs(0.5));
    assert!(matches!(s.poll_event(), Some(Event::Failed(SessionError::SwitchGone { .. }))));
    // while joining, join_timeout stands (a switch may start after its
    // workers); a join that times out after such reports says so
    let mut cfg = SessionConfig::new(1, 0);
    cfg.switch_gone_after = Duration::ZERO;
    let mut s = AllreduceSession::new(cfg, Time::ZERO);
    s.handle_port_unreachable(secs(0.1));
    s.handle_port_unreachable(secs(4.0));
    assert!(s.poll_event().is_none());
    let (failed, at) = loop {
        let t = s.poll_timeout().unwrap();
        s.handle_timeout(t);
        s.poll_transmit(t, &mut VecTransmit::new());
        if let Some(e) = s.poll_event() {
            break (e, t);
        }
    };
    assert_eq!(at, secs(5.0), "at join_timeout");
    assert!(matches!(failed, Event::Failed(SessionError::SwitchGone { .. })), "{failed:?}");
}

/// A tree's switch that restarted with the job installed refuses a plain Join
/// from a rank new to its life (Nack TreeSwitchRestarted, docs/trees.md):
/// a worker bound to the switch's earlier life was probing for the restart
/// and recovers (its next Join is a recovery join), while a session still
/// joining is a new run and fails at once with the reason.
#[test]
fn a_restarted_tree_switchs_refusal_makes_a_bound_worker_recover_and_fails_a_new_one() {
    use crate::switch::Uplink;
    use fanin_wire::value::JOIN_RECOVER;
    let mut resumed = ValueSwitch::new(ShardConfig { incarnation: 3, ..ShardConfig::single(1 << 20) });
    resumed.add_job(JobSpec { resumed: true, ..JobSpec::with_sources(1, 1, 16, 64) }).unwrap();
    resumed.set_uplink(1, Some(Uplink { parent: vec![9], rank: crate::job::SWITCH_RANK_BASE })).unwrap();
    let refusal = |s: &mut AllreduceSession, sw: &mut ValueSwitch<u16>, now: Time| {
        let mut out = VecTransmit::new();
        s.poll_transmit(now, &mut out);
        let join = out.drain().map(|(_, b)| b).find(|b| {
            Packet::new_checked(&b[..]).is_ok_and(|p| p.msg_type_code() == MessageType::Join as u8)
        });
        let mut reply = VecTransmit::new();
        let _ = sw.handle_datagram(now, 0, &join.expect("a join"), &mut reply);
        let (_, nack) = reply.drain().next().expect("an answer");
        let p = Packet::new_checked(&nack[..]).unwrap();
        assert_eq!(Nack::parse(p.payload()).unwrap(), Nack { reason: NackReason::TreeSwitchRestarted, detail: 3 });
        nack
    };
    // a new process: refused, fatal
    let mut fresh = AllreduceSession::new(SessionConfig::new(1, 0), Time::ZERO);
    let nack = refusal(&mut fresh, &mut resumed, Time::ZERO);
    fresh.handle_datagram(Time::ZERO, &nack);
    match fresh.poll_event() {
        Some(Event::Failed(SessionError::Refused { reason: NackReason::TreeSwitchRestarted, .. })) => {}
        other => panic!("{other:?}"),
    }
    // a worker bound to the earlier life, whose probe the new life refuses
    let (mut s, _) = joined(8);
    s.begin(Time::ZERO, Tensor::I32(vec![1; 8])).unwrap();
    s.poll_transmit(Time::ZERO, &mut VecTransmit::new()); // lost with the old life
    let (probe_refused, now) = loop {
        let now = s.poll_timeout().unwrap();
        assert!(now < Time::from_nanos(30_000_000_000), "no probe");
        s.handle_timeout(now);
        let mut out = VecTransmit::new();
        s.poll_transmit(now, &mut out);
        let probe = out.drain().map(|(_, b)| b).find(|b| {
            Packet::new_checked(&b[..]).is_ok_and(|p| p.msg_type_code() == MessageType::Join as u8)
        });
        if let Some(probe) = probe {
            let mut reply = VecTransmit::new();
            let _ = resumed.handle_datagram(now, 0, &probe, &mut reply);
            break (reply.drain().next().expect("an answer").1, now);
        }
    };
    s.handle_datagram(now, &probe_refused);
    assert!(s.poll_event().is_none(), "not fatal for a bound worker");
    let mut out = VecTransmit::new();
    s.poll_transmit(now, &mut out);
    let joins: Vec<u8> = out
        .drain()
        .filter_map(|(_, b)| Packet::new_checked(&b[..]).ok().filter(|p| p.msg_type_code() == MessageType::Join as u8).map(|p| p.age_op()))
        .collect();
    assert_eq!(joins, vec![JOIN_RECOVER], "it recovers");
}

/// A session's member incarnation travels whole (48 bits) in a plain Join:
/// the low 16 in src_cnt, the high 32 in block_id; a sync Join puts its
/// allreduce size in block_id and says the low 16 alone.
#[test]
fn a_plain_join_carries_the_whole_member_incarnation_and_a_sync_join_the_low_bits() {
    let first_join = |sync: bool| {
        let mut cfg = SessionConfig::new(1, 0);
        cfg.incarnation = 0xABCD_1234_5678;
        cfg.sync_join = sync;
        cfg.align_blocks = 3;
        let mut s = AllreduceSession::new(cfg, Time::ZERO);
        let mut out = VecTransmit::new();
        s.poll_transmit(Time::ZERO, &mut out);
        let (_, bytes) = out.drain().next().expect("a join");
        let p = Packet::new_checked(&bytes[..]).unwrap();
        (p.age_op(), p.src_cnt(), p.block_id())
    };
    assert_eq!(first_join(false), (0, 0x5678, 0xABCD_1234));
    assert_eq!(first_join(true), (JOIN_SYNC, 0x5678, 3));
}
