//! A keyed worker session against a keyed switch shard: forged, replayed
//! and unsealed results never reach the tensor (docs/security.md).

use super::*;
use crate::auth::{derive_member_key, Key};
use crate::job::JobSpec;
use crate::switch::{ShardConfig, ValueSwitch};
use crate::time::Time;
use crate::transmit::VecTransmit;
use fanin_wire::auth;
use fanin_wire::value::{write_elements, JoinParams, Packet, Repr, WrappedResultKey, HEADER_LEN};
use fanin_wire::MessageType;

const JOB_KEY: Key = Key([0x5a; 16]);

/// Two workers of job 1; worker 0 is the session under test, worker 1's
/// contributions are sealed by hand.
fn keyed_pair() -> (AllreduceSession, ValueSwitch<u16>) {
    keyed_pair_on(None)
}

/// [`keyed_pair`], the job with a result group worker 0 listens on.
fn keyed_pair_on(group: Option<std::net::SocketAddrV4>) -> (AllreduceSession, ValueSwitch<u16>) {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(JobSpec { key: Some(JOB_KEY), result_group: group, ..JobSpec::with_sources(1, 2, 16, 64) }).unwrap();
    let mut cfg = SessionConfig::new(1, 0);
    cfg.listens_on_group = group.is_some();
    cfg.elems_per_packet = 4;
    cfg.auth_key = Some(derive_member_key(&JOB_KEY, 1, 0));
    cfg.seal_clock_us = 1_000;
    let mut s = AllreduceSession::new(cfg, Time::ZERO);
    // worker 1 (played by hand) joins first: the round starts once both did
    let join1 = Repr { src_cnt: 7, ..Repr::new(MessageType::Join, 1, 1) };
    let mut buf = vec![0; join1.buffer_len() + auth::TRAILER_LEN];
    join1.emit(&mut Packet::new_unchecked(&mut buf[..join1.buffer_len()]));
    auth::seal(&derive_member_key(&JOB_KEY, 1, 1), 100, &mut buf).unwrap();
    let _ = to_switch(&mut sw, 1, &buf);
    let mut out = VecTransmit::new();
    s.poll_transmit(Time::ZERO, &mut out);
    for (_, join) in out.drain() {
        for (_, b) in to_switch(&mut sw, 0, &join).into_iter().filter(|(to, _)| *to == 0) {
            s.handle_datagram(Time::ZERO, &b);
        }
    }
    assert!(matches!(s.poll_event(), Some(Event::Joined(_))));
    (s, sw)
}

fn to_switch(sw: &mut ValueSwitch<u16>, from: u16, bytes: &[u8]) -> Vec<(u16, Vec<u8>)> {
    let mut reply = VecTransmit::new();
    let _ = sw.handle_datagram(Time::ZERO, from, bytes, &mut reply);
    reply.datagrams
}

fn result_block(block: u32, values: &[i32]) -> Vec<u8> {
    let repr = Repr { grad_cnt: values.len() as u16, block_id: block, src_cnt: 2, gen_id: 1, ..Repr::new(MessageType::Result, 1, 0) };
    let mut buf = vec![0; repr.buffer_len() + auth::TRAILER_LEN];
    let mut p = Packet::new_unchecked(&mut buf[..repr.buffer_len()]);
    repr.emit(&mut p);
    write_elements(values, p.payload_mut());
    buf
}

#[test]
fn forged_replayed_and_unsealed_results_are_ignored_and_the_sum_stays_exact() {
    let (mut s, mut sw) = keyed_pair();
    s.begin(Time::ZERO, Tensor::I32(vec![1, 2, 3, 4, 5, 6, 7, 8])).unwrap();
    let mut out = VecTransmit::new();
    s.poll_transmit(Time::ZERO, &mut out);
    let sent: Vec<Vec<u8>> = out.drain().map(|(_, b)| b).collect();
    assert_eq!(sent.len(), 2);
    for b in &sent {
        assert!(auth::open(&derive_member_key(&JOB_KEY, 1, 0), b).is_ok(), "the worker seals what it sends");
        assert!(to_switch(&mut sw, 0, b).is_empty());
    }

    // Before the honest results arrive, an attacker tries to complete both
    // blocks with poison: a guessed key, worker 1's key, a plain datagram.
    let mut forged = result_block(0, &[1000; 4]);
    auth::seal(&Key([0; 16]), 1 << 40, &mut forged).unwrap();
    s.handle_datagram(Time::ZERO, &forged);
    let mut posing = result_block(1, &[1000; 4]);
    auth::seal(&derive_member_key(&JOB_KEY, 1, 1), 1 << 40, &mut posing).unwrap();
    s.handle_datagram(Time::ZERO, &posing);
    let plain = result_block(0, &[1000; 4]);
    s.handle_datagram(Time::ZERO, &plain[..plain.len() - auth::TRAILER_LEN]);
    assert!(s.poll_event().is_none(), "nothing completed");
    assert_eq!(s.auth_stats(), AuthStats { bad_tag: 2, replayed: 0, unsealed: 1, before_result_key: 0, ..AuthStats::default() });

    // Worker 1 contributes; the switch's sealed results complete the tensor.
    let key1 = derive_member_key(&JOB_KEY, 1, 1);
    let mut results = Vec::new();
    for (i, block) in [[10, 20, 30, 40], [50, 60, 70, 80]].iter().enumerate() {
        // the tensor's last block is marked final, as worker 0 marks it
        let repr = Repr {
            grad_cnt: 4,
            block_id: i as u32,
            gen_id: 1,
            final_block: i == 1,
            ..Repr::new(MessageType::Contribution, 1, 1)
        };
        let mut buf = vec![0; repr.buffer_len() + auth::TRAILER_LEN];
        let mut p = Packet::new_unchecked(&mut buf[..repr.buffer_len()]);
        repr.emit(&mut p);
        write_elements(block, p.payload_mut());
        auth::seal(&key1, 1 + i as u64, &mut buf).unwrap();
        results.extend(to_switch(&mut sw, 1, &buf).into_iter().filter(|(to, _)| *to == 0).map(|(_, b)| b));
    }
    assert_eq!(results.len(), 2);
    s.handle_datagram(Time::ZERO, &results[0]);
    // the first result replayed before the second arrives: dropped
    s.handle_datagram(Time::ZERO, &results[0]);
    s.handle_datagram(Time::ZERO, &results[1]);
    let Some(Event::Completed(outcome)) = s.poll_event() else { panic!("allreduce did not complete") };
    assert_eq!(outcome.tensor, Tensor::I32(vec![11, 22, 33, 44, 55, 66, 77, 88]));
    assert_eq!(s.auth_stats(), AuthStats { bad_tag: 2, replayed: 1, unsealed: 1, before_result_key: 0, ..AuthStats::default() });
}

#[test]
fn an_unkeyed_session_refuses_sealed_datagrams() {
    let mut s = AllreduceSession::new(SessionConfig::new(1, 0), Time::ZERO);
    let mut sealed = result_block(0, &[1]);
    auth::seal(&Key([1; 16]), 1, &mut sealed).unwrap();
    s.handle_datagram(Time::ZERO, &sealed);
    assert_eq!(s.auth_stats().bad_tag, 1);
}

#[test]
fn a_group_result_is_checked_under_the_result_key_from_the_join_ack_only() {
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let result_key = auth::derive_result_key(&JOB_KEY, 1, ShardConfig::single(1 << 20).incarnation, 0);
    let key0 = derive_member_key(&JOB_KEY, 1, 0);
    // before any JoinAck a worker has no result key: a group result, even
    // a genuine one, cannot be checked and is refused
    let mut early = result_block(0, &[1; 4]);
    auth::seal(&result_key, auth::group_seq(1 << 40), &mut early).unwrap();
    let mut fresh = AllreduceSession::new(SessionConfig { auth_key: Some(key0), ..SessionConfig::new(1, 0) }, Time::ZERO);
    fresh.handle_datagram(Time::ZERO, &early);
    assert_eq!(fresh.auth_stats(), AuthStats { before_result_key: 1, ..AuthStats::default() });

    let (mut s, mut sw) = keyed_pair_on(Some(group));
    s.begin(Time::ZERO, Tensor::I32(vec![1, 2, 3, 4])).unwrap();
    let mut out = VecTransmit::new();
    s.poll_transmit(Time::ZERO, &mut out);
    for (_, b) in out.drain() {
        assert!(to_switch(&mut sw, 0, &b).is_empty());
    }
    // a group-lane result sealed under the worker's own key (what a forger
    // holding a member key could make) is not a group result
    let mut posing = result_block(0, &[1000; 4]);
    auth::seal(&key0, auth::group_seq(1 << 41), &mut posing).unwrap();
    s.handle_datagram(Time::ZERO, &posing);
    assert_eq!(s.auth_stats().bad_tag, 1);

    // worker 1 completes the block: the switch sends one group datagram
    let repr = Repr { grad_cnt: 4, block_id: 0, gen_id: 1, final_block: true, ..Repr::new(MessageType::Contribution, 1, 1) };
    let mut buf = vec![0; repr.buffer_len() + auth::TRAILER_LEN];
    let mut p = Packet::new_unchecked(&mut buf[..repr.buffer_len()]);
    repr.emit(&mut p);
    write_elements(&[10, 20, 30, 40], p.payload_mut());
    auth::seal(&derive_member_key(&JOB_KEY, 1, 1), 2, &mut buf).unwrap();
    let mut reply = VecTransmit::new();
    reply.groups_reachable = true;
    let _ = sw.handle_datagram(Time::ZERO, 1, &buf, &mut reply);
    assert_eq!(reply.group_datagrams.len(), 1);
    assert!(reply.datagrams.iter().all(|(to, _)| *to != 0), "worker 0 listens: no unicast copy");
    let on_group = reply.group_datagrams[0].1.clone();
    s.handle_datagram(Time::ZERO, &on_group);
    s.handle_datagram(Time::ZERO, &on_group); // replayed on the group
    let Some(Event::Completed(outcome)) = s.poll_event() else { panic!("allreduce did not complete") };
    assert_eq!(outcome.tensor, Tensor::I32(vec![11, 22, 33, 44]));
    // (the result that failed on the group lanes asked for the current key
    // once: a new epoch looks the same to the worker)
    assert_eq!(s.auth_stats(), AuthStats { bad_tag: 1, replayed: 1, result_key_probes: 1, ..AuthStats::default() });

    // Every listener holds the result key, so a member could seal anything
    // under it: only Results on the group lanes are taken. A JoinAck that
    // would hand the worker a junk key and a failure notice are refused
    // and change nothing.
    let mut join_ack = vec![0; HEADER_LEN + JoinParams::LEN + auth::TRAILER_LEN];
    let ack = Repr { src_cnt: 2, ..Repr::new(MessageType::JoinAck, 1, 0) };
    ack.emit(&mut Packet::new_unchecked(&mut join_ack[..HEADER_LEN + JoinParams::LEN]));
    let junk = JoinParams { result_key: Some(WrappedResultKey { epoch: 0, wrapped: [0xEE; 16] }), results_on_group: true, ..*s.params().unwrap() };
    junk.emit(&mut join_ack[HEADER_LEN..HEADER_LEN + JoinParams::LEN]);
    auth::seal(&result_key, auth::group_seq(1 << 42), &mut join_ack).unwrap();
    let notice = Repr { age_op: fanin_wire::value::MEMBERSHIP_FAILED, ..Repr::new(MessageType::Membership, 1, 1) };
    let mut failed = vec![0; notice.buffer_len() + auth::TRAILER_LEN];
    notice.emit(&mut Packet::new_unchecked(&mut failed[..notice.buffer_len()]));
    auth::seal(&result_key, auth::group_seq(1 << 42) + 1, &mut failed).unwrap();
    // (the same bytes on the worker's own lanes fail too: not its key)
    let mut unicast_lane = result_block(1, &[1000; 4]);
    auth::seal(&result_key, 1 << 42, &mut unicast_lane).unwrap();
    for forged in [&join_ack, &failed, &unicast_lane] {
        s.handle_datagram(Time::ZERO, forged);
    }
    // a group Result of another job that shares the group asks nothing either
    let mut other_job = result_block(1, &[7; 4]);
    other_job[12..16].copy_from_slice(&2u32.to_be_bytes());
    auth::seal(&Key([0x77; 16]), auth::group_seq(1 << 42) + 2, &mut other_job).unwrap();
    s.handle_datagram(Time::ZERO, &other_job);
    assert!(s.poll_event().is_none(), "nothing happened");
    assert_eq!(s.auth_stats().bad_tag, 5);
    assert_eq!(s.auth_stats().result_key_probes, 1, "only a group Result of this job asks for the key");
    s.begin(Time::ZERO, Tensor::I32(vec![1, 2, 3, 4])).expect("the session still works");
    // the key it knows is still the true one
    let mut again = result_block(1, &[5; 4]);
    auth::seal(&result_key, auth::group_seq(1 << 43), &mut again).unwrap();
    s.handle_datagram(Time::ZERO, &again);
    assert_eq!(s.auth_stats().bad_tag, 5, "a true group result still verifies");
}

/// Three keyed workers listening on the job's result group; worker 2
/// leaves after the first allreduce. The switch starts a new result-key
/// epoch: the two that stay find their key stale at the next group result,
/// probe, learn the new key and finish with exact sums (the stale results
/// fetched again by retransmission), and the allreduce after that runs on
/// the group again without a probe. Worker 2, still on the group's
/// address, opens none of the results sealed after it left.
#[test]
fn members_that_stay_learn_the_new_result_key_after_one_leaves_and_it_reads_no_more_results() {
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let spec = JobSpec { key: Some(JOB_KEY), result_group: Some(group), ..JobSpec::with_sources(1, 3, 16, 64) };
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(spec.clone()).unwrap();
    let mut workers: Vec<AllreduceSession> = (0..3u16)
        .map(|src| {
            let mut cfg = SessionConfig::new(1, src);
            cfg.elems_per_packet = 4;
            cfg.listens_on_group = true;
            cfg.auth_key = Some(derive_member_key(&JOB_KEY, 1, src));
            cfg.seal_clock_us = 1_000;
            AllreduceSession::new(cfg, Time::ZERO)
        })
        .collect();
    // Run until nobody sends anything, moving time to the next timer when
    // the network is quiet; `active` workers send, every worker hears the
    // group. Returns the time reached.
    let run = |workers: &mut Vec<AllreduceSession>, sw: &mut ValueSwitch<u16>, active: &[usize], mut now: Time| {
        for _ in 0..10_000 {
            let mut moved = 0;
            for &src in active {
                let mut out = VecTransmit::new();
                while workers[src].poll_transmit(now, &mut out) > 0 {}
                for (_, bytes) in out.drain() {
                    let mut reply = VecTransmit::new();
                    reply.groups_reachable = true;
                    let _ = sw.handle_datagram(now, src as u16, &bytes, &mut reply);
                    for (to, b) in reply.drain() {
                        workers[to as usize].handle_datagram(now, &b);
                    }
                    for (_, b) in reply.group_datagrams.drain(..) {
                        for w in workers.iter_mut() {
                            w.handle_datagram(now, &b);
                        }
                    }
                    moved += 1;
                }
            }
            if moved > 0 {
                continue;
            }
            let busy: Vec<usize> = active.iter().copied().filter(|&w| workers[w].poll_timeout().is_some()).collect();
            let Some(next) = busy.iter().filter_map(|&w| workers[w].poll_timeout()).min() else { return now };
            now = next.max(now);
            for &w in &busy {
                workers[w].handle_timeout(now);
            }
        }
        panic!("did not settle");
    };
    let tensor = |src: usize, n: usize| Tensor::I32((0..n as i32).map(|i| i * (src as i32 + 1)).collect());
    let mut now = run(&mut workers, &mut sw, &[0, 1, 2], Time::ZERO);
    for (src, w) in workers.iter_mut().enumerate() {
        assert!(matches!(w.poll_event(), Some(Event::Joined(p)) if p.results_on_group), "worker {src}");
        w.begin(now, tensor(src, 12)).unwrap();
    }
    now = run(&mut workers, &mut sw, &[0, 1, 2], now);
    for w in workers.iter_mut() {
        let Some(Event::Completed(o)) = w.poll_event() else { panic!("first allreduce") };
        assert_eq!(o.tensor, Tensor::I32((0..12).map(|i| i * 6).collect()));
    }
    let to_group_before = sw.counters().results_to_group;
    assert_eq!(to_group_before, 3, "3 blocks, one group datagram each");

    // Before it leaves, worker 2 (holding the epoch-0 key) seals a group
    // Result with a number far ahead, for a block nobody waits for: it
    // passes the tag and moves the listeners' group window up.
    let old_key = auth::derive_result_key(&JOB_KEY, 1, ShardConfig::single(1 << 20).incarnation, 0);
    let mut ahead = result_block(999, &[0; 4]);
    auth::seal(&old_key, auth::group_seq((1 << 47) + 12_345), &mut ahead).unwrap();
    for w in [0, 1] {
        workers[w].handle_datagram(now, &ahead);
    }

    // worker 2 leaves; the switch sends the two that stay the new key, and
    // worker 1's copy is lost: it learns the key by its probe instead
    let mut out = VecTransmit::new();
    sw.update_job(now, JobSpec { members: vec![0, 1], ..spec }, None, &[], &mut out).unwrap();
    let updates: Vec<(u16, Vec<u8>)> = out.drain().collect();
    assert_eq!(updates.iter().map(|(to, _)| *to).collect::<Vec<_>>(), [0, 1]);
    workers[0].handle_datagram(now, &updates[0].1);
    assert_eq!(workers[0].auth_stats().result_key_changes, 1, "the pushed key is taken at once");
    // an older epoch's JoinAck (held back, then released) changes nothing
    let stale_ack = {
        let mut buf = vec![0; HEADER_LEN + JoinParams::LEN + auth::TRAILER_LEN];
        let ack = Repr { src_cnt: 3, ..Repr::new(MessageType::JoinAck, 1, 0) };
        ack.emit(&mut Packet::new_unchecked(&mut buf[..HEADER_LEN + JoinParams::LEN]));
        let key0 = derive_member_key(&JOB_KEY, 1, 0);
        let inc = ShardConfig::single(1 << 20).incarnation;
        let wrapped = auth::wrap_result_key(&key0, 1, inc, 0, &old_key);
        let params = JoinParams {
            result_key: Some(WrappedResultKey { epoch: 0, wrapped }),
            results_on_group: true,
            ..*workers[0].params().unwrap()
        };
        params.emit(&mut buf[HEADER_LEN..HEADER_LEN + JoinParams::LEN]);
        auth::seal(&key0, 1 << 44, &mut buf).unwrap();
        buf
    };
    workers[0].handle_datagram(now, &stale_ack);
    assert_eq!(workers[0].auth_stats().result_key_changes, 1, "no way back to the old epoch");
    let bad_tags_of_2 = workers[2].auth_stats().bad_tag;
    for src in [0, 1] {
        workers[src].begin(now, tensor(src, 12)).unwrap();
    }
    now = run(&mut workers, &mut sw, &[0, 1], now);
    for src in [0, 1] {
        let Some(Event::Completed(o)) = workers[src].poll_event() else { panic!("worker {src}: second allreduce") };
        assert_eq!(o.tensor, Tensor::I32((0..12).map(|i| i * 3).collect()), "worker {src}");
        let a = workers[src].auth_stats();
        assert_eq!(a.result_key_changes, 1, "worker {src} learnt the new key once");
        assert_eq!(a.replayed, 0, "worker {src}: the new key's window is its own: {a:?}");
    }
    assert_eq!(workers[0].auth_stats().result_key_probes, 0, "told in time, no probe");
    assert!((1..=3).contains(&workers[1].auth_stats().result_key_probes), "{:?}", workers[1].auth_stats());
    assert!(sw.counters().results_to_group > to_group_before, "results went to the group under the new key");
    assert!(workers[2].auth_stats().bad_tag > bad_tags_of_2, "worker 2 hears them and can open none");
    assert!(workers[2].poll_event().is_none());

    // the next allreduce runs on the group without asking again
    let probes: Vec<u64> = [0, 1].iter().map(|&w| workers[w].auth_stats().result_key_probes).collect();
    let to_group = sw.counters().results_to_group;
    for src in [0, 1] {
        workers[src].begin(now, tensor(src, 12)).unwrap();
    }
    run(&mut workers, &mut sw, &[0, 1], now);
    for src in [0, 1] {
        let Some(Event::Completed(o)) = workers[src].poll_event() else { panic!("worker {src}: third allreduce") };
        assert_eq!(o.tensor, Tensor::I32((0..12).map(|i| i * 3).collect()));
        assert_eq!(workers[src].auth_stats().result_key_probes, probes[src]);
    }
    assert_eq!(sw.counters().results_to_group, to_group + 3);
}
