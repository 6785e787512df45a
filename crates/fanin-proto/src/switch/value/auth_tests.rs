//! Keyed jobs through one switch shard: exact traces of what is verified,
//! counted and dropped (docs/security.md).

use super::*;
use crate::auth::{derive_member_key, Key};
use crate::transmit::VecTransmit;
use fanin_wire::auth::{self, open};
use fanin_wire::value::{read_elements, write_elements};

type Addr = u32; // worker n lives at address 100 + n
const T0: Time = Time::ZERO;
const JOB_KEY: Key = Key([0x11; 16]);
const OTHER_JOB_KEY: Key = Key([0x22; 16]);

fn keyed(id: u32, n: u16, key: Key) -> JobSpec {
    JobSpec { key: Some(key), ..JobSpec::with_sources(id, n, 4, 64) }
}

fn contribution(job: u32, src: u16, block: u32, values: &[i32]) -> Vec<u8> {
    let repr = Repr {
        grad_cnt: values.len() as u16,
        block_id: block,
        ..Repr::new(MessageType::Contribution, job, src)
    };
    let mut buf = vec![0; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    write_elements(values, p.payload_mut());
    buf
}

fn sealed(key: &Key, seq: u64, unsealed: &[u8]) -> Vec<u8> {
    let mut buf = unsealed.to_vec();
    buf.resize(unsealed.len() + auth::TRAILER_LEN, 0);
    auth::seal(key, seq, &mut buf).unwrap();
    buf
}

fn member(job: u32, src: u16) -> Key {
    derive_member_key(&JOB_KEY, job, src)
}

fn deliver(sw: &mut ValueSwitch<Addr>, src: u16, bytes: &[u8]) -> Vec<(Addr, Vec<u8>)> {
    let mut out = VecTransmit::new();
    assert_eq!(sw.handle_datagram(T0, 100 + src as u32, bytes, &mut out), Verdict::Consumed);
    out.datagrams
}

/// Everything except the three auth counters and `rx_datagrams`.
fn program_counters(sw: &ValueSwitch<Addr>) -> Counters {
    Counters { rx_datagrams: 0, auth_bad_tag: 0, auth_replayed: 0, auth_unsealed: 0, ..sw.counters().clone() }
}

#[test]
fn a_keyed_job_sums_sealed_contributions_and_seals_each_result_for_its_member() {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(keyed(1, 2, JOB_KEY)).unwrap();
    assert!(deliver(&mut sw, 0, &sealed(&member(1, 0), 1, &contribution(1, 0, 0, &[5, 6]))).is_empty());
    let out = deliver(&mut sw, 1, &sealed(&member(1, 1), 1, &contribution(1, 1, 0, &[7, 8])));
    assert_eq!(out.len(), 2);
    let mut seqs = Vec::new();
    for (addr, bytes) in &out {
        let src = (*addr - 100) as u16;
        let other = 1 - src;
        assert_eq!(open(&member(1, other), bytes), Err(auth::AuthError::BadTag), "sealed for {src} only");
        let (inner, seq) = open(&member(1, src), bytes).expect("sealed with the member's key");
        seqs.push(seq);
        let p = Packet::new_checked(inner).unwrap();
        let repr = Repr::parse(&p).unwrap();
        assert_eq!((repr.msg_type, repr.block_id, repr.src_cnt), (MessageType::Result, 0, 2));
        let mut vals = vec![0; 2];
        read_elements(p.payload(), &mut vals);
        assert_eq!(vals, vec![12, 14]);
    }
    assert_ne!(seqs[0], seqs[1], "every datagram the shard seals has its own number");
    assert_eq!(auth::lane_of(seqs[0]), 0, "lane = shard");
    let c = sw.counters();
    assert_eq!((c.accepted, c.blocks_completed, c.auth_bad_tag, c.auth_replayed, c.auth_unsealed), (2, 1, 0, 0, 0));
}

#[test]
fn forged_replayed_cross_job_and_unsealed_datagrams_change_nothing_and_are_counted() {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(keyed(1, 2, JOB_KEY)).unwrap();
    sw.add_job(keyed(2, 2, OTHER_JOB_KEY)).unwrap();
    sw.add_job(JobSpec::with_sources(3, 2, 4, 64)).unwrap(); // unkeyed
    let first = sealed(&member(1, 0), 10, &contribution(1, 0, 0, &[5]));
    assert!(deliver(&mut sw, 0, &first).is_empty());
    let before = program_counters(&sw);

    let poison = contribution(1, 1, 0, &[1000]);
    // 1. wrong key (a guess)
    assert!(deliver(&mut sw, 1, &sealed(&Key([0; 16]), 1, &poison)).is_empty());
    // 2. another job's member key: cross-job injection
    assert!(deliver(&mut sw, 1, &sealed(&derive_member_key(&OTHER_JOB_KEY, 2, 1), 1, &poison)).is_empty());
    // 3. the same job's key for another member (source 0 posing as 1)
    assert!(deliver(&mut sw, 1, &sealed(&member(1, 0), 11, &poison)).is_empty());
    // 4. a legitimate datagram of source 1 with one bit flipped: header, body, seq, tag
    let good = sealed(&member(1, 1), 1, &contribution(1, 1, 0, &[7]));
    for at in [17, 26, good.len() - 12, good.len() - 1] {
        let mut bad = good.clone();
        bad[at] ^= 0x04;
        assert!(deliver(&mut sw, 1, &bad).is_empty(), "flip at {at}");
    }
    // 5. a non-member with a key derived for its id
    assert!(deliver(&mut sw, 7, &sealed(&member(1, 7), 1, &contribution(1, 7, 0, &[1000]))).is_empty());
    // 6. a sealed datagram for a job without a key
    assert!(deliver(&mut sw, 1, &sealed(&member(3, 1), 1, &contribution(3, 1, 0, &[1000]))).is_empty());
    assert_eq!(sw.counters().auth_bad_tag, 9);
    // 7. unsealed, for the keyed job
    assert!(deliver(&mut sw, 1, &poison).is_empty());
    assert_eq!(sw.counters().auth_unsealed, 1);
    // 8. the first contribution replayed, and replayed once more
    assert!(deliver(&mut sw, 0, &first).is_empty());
    assert!(deliver(&mut sw, 0, &first).is_empty());
    assert_eq!(sw.counters().auth_replayed, 2);
    assert_eq!(program_counters(&sw), before, "nothing reached the program");

    // The honest contribution still completes the block with the true sum.
    let out = deliver(&mut sw, 1, &good);
    assert_eq!(out.len(), 2);
    let (inner, _) = open(&member(1, 1), &out[1].1).unwrap();
    let p = Packet::new_checked(inner).unwrap();
    assert_eq!(p.element(0), 12);
    // and its replay afterwards is dropped too (no resend, no duplicate)
    assert!(deliver(&mut sw, 1, &good).is_empty());
    assert_eq!((sw.counters().auth_replayed, sw.counters().duplicate), (3, 0));
}

#[test]
fn a_retransmission_with_a_fresh_number_is_answered_and_numbers_reordered_in_the_window_pass() {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(keyed(1, 2, JOB_KEY)).unwrap();
    // source 0's numbers 5 and 3 arrive out of order: both inside the window
    assert!(deliver(&mut sw, 0, &sealed(&member(1, 0), 5, &contribution(1, 0, 0, &[1]))).is_empty());
    assert!(deliver(&mut sw, 0, &sealed(&member(1, 0), 3, &contribution(1, 0, 1, &[1]))).is_empty());
    assert_eq!(sw.counters().accepted, 2);
    deliver(&mut sw, 1, &sealed(&member(1, 1), 1, &contribution(1, 1, 0, &[2])));
    // source 1 lost its result: its retransmission carries a new number
    let mut again = contribution(1, 1, 0, &[2]);
    again[3] = MessageType::Retransmission as u8;
    let out = deliver(&mut sw, 1, &sealed(&member(1, 1), 2, &again));
    assert_eq!(out.len(), 1, "the result again, to the sender");
    assert!(open(&member(1, 1), &out[0].1).is_ok());
    assert_eq!((sw.counters().results_resent, sw.counters().auth_replayed), (1, 0));
}

#[test]
fn only_a_sealed_join_is_answered_and_the_answer_is_sealed() {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(keyed(1, 2, JOB_KEY)).unwrap();
    let join = {
        let repr = Repr::new(MessageType::Join, 1, 1);
        let mut buf = vec![0; repr.buffer_len()];
        repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
        buf
    };
    assert!(deliver(&mut sw, 1, &join).is_empty(), "a non-member cannot join a keyed job");
    assert!(deliver(&mut sw, 1, &sealed(&Key([9; 16]), 1, &join)).is_empty());
    assert_eq!((sw.counters().joins, sw.counters().auth_unsealed, sw.counters().auth_bad_tag), (0, 1, 1));
    let out = deliver(&mut sw, 1, &sealed(&member(1, 1), 1, &join));
    assert_eq!(out.len(), 1);
    let (inner, _) = open(&member(1, 1), &out[0].1).expect("JoinAck sealed for the joiner");
    assert_eq!(Repr::parse(&Packet::new_checked(inner).unwrap()).unwrap().msg_type, MessageType::JoinAck);
}

#[test]
fn a_tree_child_seals_partials_with_its_rank_key_and_accepts_only_the_parents_seal() {
    const RANK: u16 = SWITCH_RANK_BASE;
    const PARENT: Addr = 900;
    let mut child = ValueSwitch::new(ShardConfig::single(1 << 20));
    child.add_job(JobSpec { workers: 3, ..keyed(1, 2, JOB_KEY) }).unwrap();
    child.set_uplink(1, Some(Uplink { parent: vec![PARENT], rank: RANK })).unwrap();
    deliver(&mut child, 0, &sealed(&member(1, 0), 1, &contribution(1, 0, 0, &[1])));
    let up = deliver(&mut child, 1, &sealed(&member(1, 1), 1, &contribution(1, 1, 0, &[2])));
    assert_eq!(up.len(), 1);
    assert_eq!(up[0].0, PARENT);
    let (inner, _) = open(&member(1, RANK), &up[0].1).expect("the partial is sealed with the child's rank key");
    assert_eq!(Packet::new_checked(inner).unwrap().element(0), 3);

    // The parent's result, sealed for the child's rank, goes down re-sealed.
    let result = {
        let repr = Repr { grad_cnt: 1, src_cnt: 3, ..Repr::new(MessageType::Result, 1, 0) };
        let mut buf = vec![0; repr.buffer_len()];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        repr.emit(&mut p);
        write_elements(&[10], p.payload_mut());
        buf
    };
    let from_parent = |sw: &mut ValueSwitch<Addr>, bytes: &[u8]| {
        let mut out = VecTransmit::new();
        let _ = sw.handle_datagram(T0, PARENT, bytes, &mut out);
        out.datagrams
    };
    assert!(from_parent(&mut child, &sealed(&member(1, 0), 1, &result)).is_empty(), "a worker's key is not the parent's");
    let genuine = sealed(&member(1, RANK), (1 << 48) | 7, &result);
    let down = from_parent(&mut child, &genuine);
    assert_eq!(down.len(), 2);
    for (addr, bytes) in &down {
        let (inner, _) = open(&member(1, (*addr - 100) as u16), bytes).unwrap();
        assert_eq!(Packet::new_checked(inner).unwrap().element(0), 10);
    }
    assert!(from_parent(&mut child, &genuine).is_empty(), "replayed result");
    assert_eq!((child.counters().auth_bad_tag, child.counters().auth_replayed), (1, 1));
}

fn trim(sw: &mut ValueSwitch<Addr>, src: u16, bytes: &[u8]) -> (crate::trim::TrimVerdict, Vec<(Addr, Vec<u8>)>) {
    let mut out = VecTransmit::new();
    let verdict = sw.trim_datagram(T0, 100 + src as u32, bytes, TrimCause::ProcessingQueue, &mut out);
    (verdict, out.datagrams)
}

#[test]
fn a_queue_trim_of_a_keyed_job_is_verified_first_and_answered_with_a_sealed_nack() {
    use crate::trim::TrimVerdict;
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(keyed(1, 2, JOB_KEY)).unwrap();
    sw.add_job(JobSpec::with_sources(3, 2, 4, 64)).unwrap(); // unkeyed
    let good = sealed(&member(1, 1), 5, &contribution(1, 1, 2, &[7, 8]));
    let (verdict, out) = trim(&mut sw, 1, &good);
    assert_eq!((verdict, out.len()), (TrimVerdict::Trimmed, 1));
    let (addr, reply) = &out[0];
    assert_eq!(*addr, 101, "back to the sender");
    assert_eq!(open(&member(1, 0), reply), Err(auth::AuthError::BadTag), "sealed for the sender only");
    let (inner, _) = open(&member(1, 1), reply).expect("sealed with the sender's key");
    let p = Packet::new_checked(inner).unwrap();
    let r = Repr::parse(&p).unwrap();
    assert_eq!((r.msg_type, r.src_id, r.block_id, r.grad_cnt), (MessageType::Nack, 1, 2, 0));
    assert_eq!(Nack::parse(p.payload()).unwrap(), Nack { reason: NackReason::Trimmed, detail: 1 });
    assert_eq!((sw.counters().accepted, sw.counters().nacks_sent), (0, 1), "trimmed, not aggregated");

    // A forgery, a replay and an unsealed datagram draw no reply: counted
    // exactly as on the normal path.
    let (v, out) = trim(&mut sw, 1, &sealed(&Key([0; 16]), 6, &contribution(1, 1, 2, &[1000])));
    assert_eq!((v, out.len(), sw.counters().auth_bad_tag), (TrimVerdict::Refused, 0, 1));
    let (v, out) = trim(&mut sw, 1, &good);
    assert_eq!((v, out.len(), sw.counters().auth_replayed), (TrimVerdict::Refused, 0, 1));
    let (v, out) = trim(&mut sw, 1, &contribution(1, 1, 2, &[1000]));
    assert_eq!((v, out.len(), sw.counters().auth_unsealed), (TrimVerdict::Refused, 0, 1));

    // What a trim saves nothing on goes the normal way, unverified here.
    let empty = contribution(1, 1, 3, &[]);
    assert_eq!(trim(&mut sw, 1, &sealed(&member(1, 1), 7, &empty)).0, TrimVerdict::Process);
    assert_eq!(sw.counters().auth_replayed + sw.counters().auth_bad_tag, 2, "not opened by the trim");

    // An unkeyed job's trim stays the plain header-only reply.
    let (v, out) = trim(&mut sw, 1, &contribution(3, 1, 0, &[1]));
    assert_eq!((v, out.len()), (TrimVerdict::Trimmed, 1));
    assert!(!auth::is_sealed(&out[0].1));
}

/// A sealed Join of `src`, saying whether it listens on the result group;
/// returns the JoinAck's parameters, opened with the member's key.
fn sealed_join(sw: &mut ValueSwitch<Addr>, job: u32, src: u16, listens: bool, seq: u64) -> JoinParams {
    let repr = Repr { final_block: listens, ..Repr::new(MessageType::Join, job, src) };
    let mut buf = vec![0; repr.buffer_len()];
    repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(T0, 100 + src as u32, &sealed(&member(job, src), seq, &buf), &mut out);
    let (inner, _) = open(&member(job, src), &out.datagrams[0].1).expect("the JoinAck is sealed for the joiner");
    JoinParams::parse(Packet::new_checked(inner).unwrap().payload()).unwrap()
}

#[test]
fn a_keyed_job_seals_a_group_result_once_under_the_result_key_its_listeners_learnt() {
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(JobSpec { result_group: Some(group), ..keyed(1, 3, JOB_KEY) }).unwrap();
    let incarnation = ShardConfig::single(1 << 20).incarnation;
    let result_key = auth::derive_result_key(&JOB_KEY, 1, incarnation, 0);
    // listeners get the result key wrapped under their own key; the member
    // not listening gets none
    for src in [0u16, 2] {
        let params = sealed_join(&mut sw, 1, src, true, 1);
        assert!(params.results_on_group);
        let rk = params.result_key.expect("a listener is told the result key");
        assert_ne!(rk.wrapped, result_key.0, "never in clear");
        assert_eq!((params.incarnation, rk.epoch), (incarnation, 0), "what the worker unwraps with");
        assert_eq!(Key(auth::wrap_result_key(&member(1, src), 1, incarnation, 0, &Key(rk.wrapped))), result_key);
    }
    let params = sealed_join(&mut sw, 1, 1, false, 1);
    assert!(!params.results_on_group && params.result_key.is_none());

    let mut out = VecTransmit::new();
    out.groups_reachable = true;
    for (src, v) in [(0u16, 1), (1, 10), (2, 100)] {
        let c = sealed(&member(1, src), 2, &contribution(1, src, 0, &[v]));
        let _ = sw.handle_datagram(T0, 100 + src as u32, &c, &mut out);
    }
    // one group datagram, sealed under the result key on the group lanes
    assert_eq!(out.group_datagrams.len(), 1);
    let (to, bytes) = &out.group_datagrams[0];
    assert_eq!(*to, group);
    for src in 0..3 {
        assert_eq!(open(&member(1, src), bytes), Err(auth::AuthError::BadTag), "no member key seals it");
    }
    let (inner, seq) = open(&result_key, bytes).expect("sealed under the result key");
    assert!(auth::is_group_seq(seq));
    let p = Packet::new_checked(inner).unwrap();
    assert_eq!((Repr::parse(&p).unwrap().msg_type, p.element(0)), (MessageType::Result, 111));
    // the member not listening: its own seal of the same bytes
    assert_eq!(out.datagrams.len(), 1);
    let (addr, unicast) = &out.datagrams[0];
    assert_eq!(*addr, 101);
    let (inner_u, seq_u) = open(&member(1, 1), unicast).unwrap();
    assert_eq!(inner_u[4..], inner[4..], "the same result (the sealed bit aside)");
    assert!(!auth::is_group_seq(seq_u));
    let c = sw.counters();
    assert_eq!((c.results_to_group, c.results_sent, c.auth_bad_tag), (1, 1, 0));
}

/// The group datagrams `sw` sends for block `block` once members `srcs`
/// contributed (sealed with sequence number `seq`).
fn group_results(sw: &mut ValueSwitch<Addr>, srcs: &[u16], block: u32, seq: u64) -> Vec<Vec<u8>> {
    let mut out = VecTransmit::new();
    out.groups_reachable = true;
    for &src in srcs {
        let c = sealed(&member(1, src), seq, &contribution(1, src, block, &[1 + src as i32]));
        let _ = sw.handle_datagram(T0, 100 + src as u32, &c, &mut out);
    }
    out.group_datagrams.into_iter().map(|(_, b)| b).collect()
}

#[test]
fn a_member_leaving_starts_a_result_key_epoch_it_cannot_open_and_the_others_learn_it() {
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let inc = ShardConfig::single(1 << 20).incarnation;
    let spec = JobSpec { result_group: Some(group), ..keyed(1, 3, JOB_KEY) };
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(spec.clone()).unwrap();
    let old_key = auth::derive_result_key(&JOB_KEY, 1, inc, 0);
    for src in 0..3 {
        assert_eq!(sealed_join(&mut sw, 1, src, true, 1).result_key.map(|rk| rk.epoch), Some(0));
    }
    let before = group_results(&mut sw, &[0, 1, 2], 0, 2);
    assert!(open(&old_key, &before[0]).is_ok(), "epoch 0: every listener opens it");

    // member 2 leaves: the two that stay are sent the new key at once
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1], ..spec.clone() }, None, &[], &mut out).unwrap();
    let new_key = auth::derive_result_key(&JOB_KEY, 1, inc, 1);
    let mut updated = Vec::new();
    for (to, bytes) in out.drain() {
        let src = (to - 100) as u16;
        let (inner, _) = open(&member(1, src), &bytes).expect("sealed for its member");
        let p = Packet::new_checked(inner).unwrap();
        let repr = Repr::parse(&p).unwrap();
        assert_eq!((repr.msg_type, repr.age_op), (MessageType::JoinAck, fanin_wire::value::JOIN_KEY_UPDATE));
        let rk = JoinParams::parse(p.payload()).unwrap().result_key.expect("carries the key");
        assert_eq!(rk.epoch, 1);
        assert_eq!(Key(auth::wrap_result_key(&member(1, src), 1, inc, 1, &Key(rk.wrapped))), new_key);
        updated.push(src);
    }
    updated.sort();
    assert_eq!(updated, [0, 1], "every listener that stays, not the one that left");
    assert_eq!(sw.counters().result_key_updates, 2);
    let after = group_results(&mut sw, &[0, 1], 1, 3);
    assert_eq!(after.len(), 1);
    assert_eq!(open(&old_key, &after[0]), Err(auth::AuthError::BadTag), "the key member 2 holds opens nothing new");
    assert!(open(&new_key, &after[0]).is_ok(), "sealed under the epoch-1 key");
    // a member that stays learns it from the answer to its probe
    let params = sealed_join(&mut sw, 1, 0, true, 4);
    let rk = params.result_key.expect("still a listener");
    assert_eq!(rk.epoch, 1);
    assert_eq!(Key(auth::wrap_result_key(&member(1, 0), 1, inc, 1, &Key(rk.wrapped))), new_key);
    // member 2 asks in vain: its key is gone, its Join is dropped unanswered
    let join2 = Repr { final_block: true, ..Repr::new(MessageType::Join, 1, 2) };
    let mut buf = vec![0; join2.buffer_len()];
    join2.emit(&mut Packet::new_unchecked(&mut buf[..]));
    let bad_before = sw.counters().auth_bad_tag;
    assert!(deliver(&mut sw, 2, &sealed(&member(1, 2), 5, &buf)).is_empty());
    assert_eq!(sw.counters().auth_bad_tag, bad_before + 1);

    // a member joining (none leaving) keeps the epoch: nobody holds a key
    // it should lose, and nobody is sent one
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1, 3], ..spec.clone() }, None, &[], &mut out).unwrap();
    assert!(out.datagrams.is_empty());
    assert_eq!(sealed_join(&mut sw, 1, 3, true, 1).result_key.map(|rk| rk.epoch), Some(1));
    // and the next one to leave starts epoch 2
    sw.update_job(T0, JobSpec { members: vec![0, 3], ..spec }, None, &[], &mut out).unwrap();
    assert_eq!(sealed_join(&mut sw, 1, 0, true, 6).result_key.map(|rk| rk.epoch), Some(2));
}

#[test]
fn a_keyed_job_admitted_again_never_seals_under_a_result_key_of_its_earlier_life() {
    // member 2 left epoch 0 holding its key; the job is then re-created with
    // the same key (as a controller does after `fail`): it must not start
    // over at epoch 0, whose key member 2 still has
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let inc = ShardConfig::single(1 << 20).incarnation;
    let spec = JobSpec { result_group: Some(group), ..keyed(1, 3, JOB_KEY) };
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 20));
    sw.add_job(spec.clone()).unwrap();
    assert_eq!(sealed_join(&mut sw, 1, 2, true, 1).result_key.map(|rk| rk.epoch), Some(0));
    let mut out = VecTransmit::new();
    sw.update_job(T0, JobSpec { members: vec![0, 1], ..spec.clone() }, None, &[], &mut out).unwrap();
    assert!(sw.remove_job(1));
    sw.add_job(spec).unwrap();
    let rk = sealed_join(&mut sw, 1, 0, true, 1 << 40).result_key.unwrap();
    assert_eq!(rk.epoch, 2, "after every epoch the removed job reached");
    let key = Key(auth::wrap_result_key(&member(1, 0), 1, inc, rk.epoch, &Key(rk.wrapped)));
    assert_ne!(key, auth::derive_result_key(&JOB_KEY, 1, inc, 0));
    let results = group_results(&mut sw, &[0, 1, 2], 0, 1 << 41);
    assert_eq!(open(&auth::derive_result_key(&JOB_KEY, 1, inc, 0), &results[0]), Err(auth::AuthError::BadTag));
    assert!(open(&key, &results[0]).is_ok());
}

#[test]
fn undoing_an_admission_leaves_the_result_key_epochs_where_they_were() {
    // a daemon admits a job on every shard, and undoes it on the shards that
    // took it when one refuses: those shards must not move on to another
    // epoch than the shards that never had the job
    let group: std::net::SocketAddrV4 = "239.1.0.7:47001".parse().unwrap();
    let spec = JobSpec { result_group: Some(group), ..keyed(1, 3, JOB_KEY) };
    let mut took = ValueSwitch::new(ShardConfig::single(1 << 20));
    took.add_job(spec.clone()).unwrap();
    assert!(took.undo_add_job(1));
    took.add_job(spec.clone()).unwrap();
    assert_eq!(sealed_join(&mut took, 1, 0, true, 1).result_key.map(|rk| rk.epoch), Some(0));
    // (an operator's removal of a job that ran does move them on)
    assert!(took.remove_job(1));
    took.add_job(spec).unwrap();
    assert_eq!(sealed_join(&mut took, 1, 0, true, 1 << 40).result_key.map(|rk| rk.epoch), Some(1));
}
