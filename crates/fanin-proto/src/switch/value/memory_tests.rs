//! Packet traces of pooled aggregation memory (Trio-ML's model,
//! docs/memory.md): records take buffers on demand, shadows wait for free
//! memory or recycle, and jobs whose caps exceed the memory run together.

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::transmit::VecTransmit;
use fanin_wire::value::{read_elements, write_elements, Dtype, Nack};

/// Member `src` of job `job` lives at address `job * 100 + src`.
type Addr = u32;

fn addr(job: u32, src: u16) -> Addr {
    job * 100 + src as u32
}

fn data(job: u32, src: u16, block: u32, values: &[i32], retransmission: bool) -> Vec<u8> {
    let t = if retransmission { MessageType::Retransmission } else { MessageType::Contribution };
    let repr = Repr { grad_cnt: values.len() as u16, block_id: block, ..Repr::new(t, job, src) };
    let mut buf = vec![0; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    write_elements(values, p.payload_mut());
    buf
}

/// What the switch sent: (destination, header, nack if one, values).
type Sent = (Addr, Repr, Option<Nack>, Vec<i32>);

fn send(sw: &mut ValueSwitch<Addr>, job: u32, src: u16, bytes: &[u8]) -> Vec<Sent> {
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(Time::ZERO, addr(job, src), bytes, &mut out);
    out.drain()
        .map(|(a, bytes)| {
            let p = Packet::new_checked(&bytes[..]).expect("valid");
            let repr = Repr::parse(&p).unwrap();
            let nack = (repr.msg_type == MessageType::Nack).then(|| Nack::parse(p.payload()).unwrap());
            let mut values = vec![0; if repr.msg_type.carries_block() { repr.grad_cnt as usize } else { 0 }];
            read_elements(p.payload(), &mut values);
            (a, repr, nack, values)
        })
        .collect()
}

fn is_memory_nack(s: &Sent) -> bool {
    s.2.is_some_and(|n| n.reason == NackReason::Trimmed && n.detail == TrimCause::MemoryExhausted as u32)
}

fn pooled(limit: u64) -> ValueSwitch<Addr> {
    ValueSwitch::new(ShardConfig { memory_model: MemoryModel::Pooled, ..ShardConfig::single(limit) })
}

/// What admitting `spec` alone costs a switch of that memory model.
fn admission_cost(model: MemoryModel, spec: &JobSpec) -> u64 {
    let mut sw = ValueSwitch::<Addr>::new(ShardConfig { memory_model: model, ..ShardConfig::single(1 << 30) });
    sw.add_job(spec.clone()).unwrap();
    sw.memory_used()
}

/// A job of `slots` slots whose members are worker 0 and a child switch:
/// child switches do not acknowledge results, so such a job keeps the
/// floor of one buffer per slot.
fn job_with_a_child_switch(job: u32, slots: u32, grad: u32) -> JobSpec {
    JobSpec { members: vec![0, SWITCH_RANK_BASE], ..JobSpec::with_sources(job, 2, slots, grad) }
}

#[test]
fn a_pooled_job_reserves_one_buffer_and_its_cap_must_fit_the_memory() {
    // (admitted for the workers it will have: a child switch joins below)
    let spec = JobSpec { workers: 8, ..JobSpec::with_sources(1, 2, 4, 64) };
    let reserved = admission_cost(MemoryModel::Reserved, &spec);
    let pooled_cost = admission_cost(MemoryModel::Pooled, &spec);
    // workers acknowledge results: one buffer of the eight is reserved
    assert_eq!(reserved - pooled_cost, 7 * 64 * 4, "only one buffer is reserved");
    // with a child switch among the members: one buffer per slot
    let tree = job_with_a_child_switch(1, 4, 64);
    let tree_cost = admission_cost(MemoryModel::Pooled, &tree);
    assert_eq!(admission_cost(MemoryModel::Reserved, &tree) - tree_cost, 4 * 64 * 4, "the shadows' buffers are not reserved");
    // a cap (two buffers per slot) beyond the whole memory is refused at once
    let mut sw = pooled(pooled_cost + 64 * 4);
    let err = sw.add_job(spec.clone()).unwrap_err();
    assert!(matches!(err, AdmitError::OutOfMemory { job_id: 1, .. }), "{err}");
    let mut sw = pooled(reserved);
    sw.add_job(spec.clone()).unwrap();
    assert_eq!(sw.memory_used(), pooled_cost);
    // a child switch joining the members raises the floor, if it fits
    let mut out = VecTransmit::new();
    let grown = JobSpec { members: vec![0, 1, SWITCH_RANK_BASE], ..spec.clone() };
    // (a second job leaves two buffers free: the floor needs three more)
    let filler = JobSpec::with_sources(2, 1, 1, 64 * 5);
    let mut tight = pooled(pooled_cost + admission_cost(MemoryModel::Pooled, &filler) + 2 * 64 * 4);
    tight.add_job(spec).unwrap();
    tight.add_job(filler).unwrap();
    let pooled_cost = tight.memory_used();
    let err = tight.update_job(Time::ZERO, grown.clone(), None, &[], &mut out).unwrap_err();
    assert!(matches!(err, AdmitError::OutOfMemory { job_id: 1, .. }), "{err}");
    assert_eq!(tight.memory_used(), pooled_cost, "a refused update changes nothing");
    assert_eq!(sw.jobs[&1].data_memory, 64 * 4);
    sw.update_job(Time::ZERO, grown, None, &[], &mut out).unwrap();
    assert_eq!(sw.jobs[&1].data_memory, 4 * 64 * 4, "four buffers reserved now");
}

fn exponent(job: u32, src: u16, block: u32, exp: i8) -> Vec<u8> {
    let repr = Repr { dtype: Dtype::Float32, exp_only: true, exp, block_id: block, ..Repr::new(MessageType::Contribution, job, src) };
    let mut buf = vec![0; repr.buffer_len()];
    repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
    buf
}

/// `spec` on a shard whose memory holds its floor and a second job's
/// (which leaves room for `spec`'s cap, but none free).
fn full_with(spec: JobSpec) -> ValueSwitch<Addr> {
    let filler = JobSpec::with_sources(99, 1, 1, 64 * 8);
    let mut sw = pooled(admission_cost(MemoryModel::Pooled, &spec) + admission_cost(MemoryModel::Pooled, &filler));
    sw.add_job(spec).unwrap();
    sw.add_job(filler).unwrap();
    sw
}

#[test]
fn a_lower_block_evicts_a_later_one_unless_its_exponent_was_negotiated() {
    // one buffer: the job's floor, and nothing else free
    let mut sw = full_with(JobSpec::with_sources(1, 2, 4, 64));
    // block 1's exponent round completes: its members were told exponent 3
    send(&mut sw, 1, 0, &exponent(1, 0, 1, 3));
    assert_eq!(send(&mut sw, 1, 1, &exponent(1, 1, 1, 2)).len(), 2, "the exponent announced");
    // block 0 finds no memory and may not take block 1's record: a reopened
    // exponent round could age into another exponent than the one announced
    let out = send(&mut sw, 1, 0, &exponent(1, 0, 0, 1));
    assert!(out.len() == 1 && is_memory_nack(&out[0]), "{out:?}");
    assert_eq!(sw.counters().records_evicted, 0);
    // an int32 block in its data phase is evicted for a lower one
    let mut sw = full_with(JobSpec::with_sources(2, 2, 4, 64));
    send(&mut sw, 2, 0, &data(2, 0, 1, &[1], false));
    let out = send(&mut sw, 2, 1, &data(2, 1, 0, &[5], false));
    assert_eq!(sw.counters().records_evicted, 1);
    assert!(out.len() == 1 && out[0].0 == addr(2, 0) && is_memory_nack(&out[0]) && out[0].1.block_id == 1, "{out:?}");
}

#[test]
fn a_job_at_a_non_root_switch_keeps_the_slot_floor() {
    // its blocks sent up hold their records until the parent answers: no
    // acknowledgement or eviction frees them, so one buffer would not do
    let spec = JobSpec::with_sources(1, 2, 4, 64);
    let up = Some(Uplink { parent: vec![9], rank: SWITCH_RANK_BASE });
    let mut sw = pooled(1 << 20);
    sw.add_job(spec.clone()).unwrap();
    assert_eq!(sw.jobs[&1].data_memory, 64 * 4);
    sw.set_uplink(1, up.clone()).unwrap();
    assert_eq!(sw.jobs[&1].data_memory, 4 * 64 * 4, "one buffer per slot below a parent");
    assert!(!sw.jobs[&1].frees_at_acknowledgement());
    sw.set_uplink(1, None).unwrap();
    assert_eq!(sw.jobs[&1].data_memory, 64 * 4, "a root again: one buffer");
    // a switch with room for the one-buffer floor only refuses the role
    let cost = admission_cost(MemoryModel::Pooled, &spec);
    let cap_room = cost + 7 * 64 * 4;
    let filler = JobSpec::with_sources(2, 1, 1, 64 * 6);
    let mut tight = pooled(cap_room + admission_cost(MemoryModel::Pooled, &filler) - 6 * 64 * 4);
    tight.add_job(spec).unwrap();
    tight.add_job(filler).unwrap();
    let before = tight.memory_used();
    let err = tight.set_uplink(1, up).unwrap_err();
    assert!(matches!(err, AdmitError::OutOfMemory { job_id: 1, .. }), "{err}");
    assert_eq!(tight.memory_used(), before);
    assert!(tight.uplink(1).is_none(), "a refused role changes nothing");
}

#[test]
fn a_shadow_waits_for_free_memory_then_recycles_once_every_member_moved_on() {
    const R: u16 = SWITCH_RANK_BASE;
    // memory for the reserved buffers of two jobs, and less than one more:
    // job 1 (2 slots) can never keep a shadow; job 2 only holds memory
    // (member 1 is a child switch: the job keeps the slot floor)
    let spec = job_with_a_child_switch(1, 2, 64);
    let filler = JobSpec::with_sources(2, 1, 1, 64);
    let floors = admission_cost(MemoryModel::Pooled, &spec) + admission_cost(MemoryModel::Pooled, &filler);
    let mut sw = pooled(floors + 100);
    sw.add_job(spec).unwrap();
    sw.add_job(filler).unwrap();
    let full = sw.memory_used();
    assert_eq!(full, floors);
    for b in 0..2 {
        send(&mut sw, 1, 0, &data(1, 0, b, &[1], false));
        assert_eq!(send(&mut sw, 1, R, &data(1, R, b, &[2], false)).len(), 2, "block {b}'s result");
    }
    // member 0 moves on to block 2 (slot 0): block 0 must stay for member
    // 1, and there is no memory for a second buffer: back-pressure
    let out = send(&mut sw, 1, 0, &data(1, 0, 2, &[10], false));
    assert!(out.len() == 1 && is_memory_nack(&out[0]) && out[0].0 == addr(1, 0), "{out:?}");
    assert_eq!(sw.counters().memory_exhausted, 1);
    // member 1 lost block 0's result: the record still answers
    let out = send(&mut sw, 1, R, &data(1, R, 0, &[2], true));
    assert_eq!((out.len(), out[0].0, out[0].3.clone()), (1, addr(1, R), vec![3]));
    // member 1 moves on too: every member has block 0, its record is reused
    let out = send(&mut sw, 1, R, &data(1, R, 2, &[20], false));
    assert!(out.is_empty(), "accepted: {out:?}");
    assert_eq!(sw.counters().records_recycled, 1);
    // member 0 retries after the nack and completes block 2
    let out = send(&mut sw, 1, 0, &data(1, 0, 2, &[10], true));
    assert_eq!(out.iter().map(|s| (s.0, s.3.clone())).collect::<Vec<_>>(), [(addr(1, 0), vec![30]), (addr(1, R), vec![30])]);
    // a late duplicate of block 0 is told the slot moved on, never added
    let out = send(&mut sw, 1, 0, &data(1, 0, 0, &[1], true));
    assert_eq!(out[0].2.map(|n| n.reason), Some(NackReason::BlockExpired));
    assert_eq!(sw.memory_used(), full, "no buffer beyond the floors was ever taken");
    // with memory free again (the filler job leaves) shadows are kept as
    // usual and charged while they live
    assert!(sw.remove_job(2));
    let before = sw.memory_used();
    send(&mut sw, 1, 0, &data(1, 0, 3, &[1], false));
    send(&mut sw, 1, R, &data(1, R, 3, &[1], false));
    send(&mut sw, 1, 0, &data(1, 0, 4, &[1], false)); // block 2 stays as 4's shadow
    assert_eq!(sw.memory_used(), before + 64 * 4);
    send(&mut sw, 1, R, &data(1, R, 4, &[1], false)); // 4 complete: the shadow is freed
    assert_eq!(sw.memory_used(), before);
}

/// Deterministic pseudo-random numbers (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) % n
    }
}

/// A member as the host library runs it: a window of `block_cnt_max`
/// blocks past the lowest one without a result, every block without a
/// result sent again until its result arrives.
struct Member {
    job: u32,
    src: u16,
    results: BTreeMap<u32, Vec<i32>>,
    sent: BTreeSet<u32>,
}

fn value_of(job: u32, src: u16, block: u32) -> Vec<i32> {
    (0..4).map(|i| (job * 1000 + src as u32 * 100 + block * 7 + i) as i32 % 997).collect()
}

fn result_ack(job: u32, src: u16, base: u32, words: u16, holds: impl Fn(u32) -> bool) -> Vec<u8> {
    let repr = Repr { block_id: base, grad_cnt: words, ..Repr::new(MessageType::ResultAck, job, src) };
    let mut buf = vec![0; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    fanin_wire::value::write_result_ack(p.payload_mut(), holds);
    buf
}

/// What a run of [`run_jobs`] showed.
struct Run {
    counters: Counters,
    /// The buffers the jobs may hold (their caps) over the buffer memory.
    overcommit: f64,
    lost: u64,
}

/// `jobs` jobs of three members and `slots` slots run `blocks` blocks each
/// on one pooled shard with room for their floors and `spare` buffers
/// more, members picking blocks of their windows at random and 5 % of
/// results lost; every result must be exact and `memory_used` never above
/// the limit. Members acknowledge the results they hold when refused for
/// memory, as the host library does (`ack`), or not.
fn run_jobs(jobs: u32, slots: u32, blocks: u32, spare: u64, ack: bool) -> Run {
    let members = 3u16;
    let specs: Vec<JobSpec> = (1..=jobs).map(|j| JobSpec::with_sources(j, members, slots, 256)).collect();
    let floors: u64 = specs.iter().map(|s| admission_cost(MemoryModel::Pooled, s)).sum();
    let buffer = 256 * 4;
    let limit = floors + spare * buffer;
    let mut sw = pooled(limit);
    for s in &specs {
        sw.add_job(s.clone()).unwrap();
    }
    let reserved = jobs as u64 * sw.jobs[&1].pool_floor.unwrap() as u64;
    let overcommit = (jobs as u64 * 2 * slots as u64) as f64 / (reserved + spare) as f64;
    let mut all: Vec<Member> = (1..=jobs)
        .flat_map(|job| (0..members).map(move |src| Member { job, src, results: BTreeMap::new(), sent: BTreeSet::new() }))
        .collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (mut steps, mut lost) = (0u64, 0u64);
    while all.iter().any(|m| m.results.len() < blocks as usize) {
        steps += 1;
        assert!(steps < 2_000_000, "no progress: {:?}", sw.counters());
        let i = rng.below(jobs as u64 * members as u64) as usize;
        let m = &mut all[i];
        let base = (0..blocks).find(|b| !m.results.contains_key(b)).unwrap_or(blocks);
        let window: Vec<u32> = (base..(base + slots).min(blocks)).filter(|b| !m.results.contains_key(b)).collect();
        if window.is_empty() {
            continue;
        }
        let b = window[rng.below(window.len() as u64) as usize];
        let again = !m.sent.insert(b);
        let (job, src) = (m.job, m.src);
        let mut replies = send(&mut sw, job, src, &data(job, src, b, &value_of(job, src, b), again));
        while let Some((to, repr, nack, values)) = replies.pop() {
            assert!(sw.memory_used() <= limit, "{} of {limit}", sw.memory_used());
            let receiver = all.iter_mut().find(|x| addr(x.job, x.src) == to).expect("a member");
            if let Some(n) = nack {
                assert!(n.reason == NackReason::Trimmed, "{n:?} for {}", repr.block_id);
                if ack && is_memory_nack(&(to, repr, nack, values)) {
                    let base = (0..blocks).find(|b| !receiver.results.contains_key(b)).unwrap_or(blocks);
                    let words = slots.div_ceil(64) as u16;
                    let held = |i: u32| receiver.results.contains_key(&(base + i));
                    let ack = result_ack(receiver.job, receiver.src, base, words, held);
                    let (job, src) = (receiver.job, receiver.src);
                    replies.extend(send(&mut sw, job, src, &ack));
                }
                continue;
            }
            // a result: 5 % of deliveries are lost (the member resends)
            if rng.below(100) < 5 {
                lost += 1;
                continue;
            }
            receiver.results.insert(repr.block_id, values);
        }
    }
    for m in &all {
        for b in 0..blocks {
            let want: Vec<i32> = (0..4)
                .map(|i| (0..members).map(|s| value_of(m.job, s, b)[i]).sum())
                .collect();
            assert_eq!(m.results[&b], want, "job {} member {} block {b}", m.job, m.src);
        }
    }
    let counters = sw.counters().clone();
    assert_eq!(counters.blocks_degraded, 0);
    Run { counters, overcommit, lost }
}

#[test]
fn jobs_whose_caps_add_up_to_four_times_the_memory_all_finish_exactly_under_loss() {
    // eight jobs of 8 slots: caps of 128 buffers on a shard of 32
    let run = run_jobs(8, 8, 60, 24, true);
    assert!(run.overcommit >= 4.0, "caps {:.1}x the buffer memory", run.overcommit);
    let c = &run.counters;
    assert!(c.memory_exhausted > 0 && c.result_acks > 0 && c.records_acked > 0, "memory was short: {c:?}");
    assert!(run.lost > 0);
}

#[test]
fn jobs_on_a_memory_of_their_floors_alone_still_finish_by_eviction_and_acknowledgement() {
    // no buffer beyond one per job: every later block must evict or wait
    // for acknowledgements (caps 16x the memory)
    let run = run_jobs(4, 8, 40, 0, true);
    assert!(run.overcommit >= 16.0, "caps {:.1}x", run.overcommit);
    let c = &run.counters;
    assert!(c.records_evicted > 0 && c.records_acked > 0, "{c:?}");
}

#[test]
#[should_panic(expected = "no progress")]
fn without_acknowledgements_jobs_over_their_floors_stall() {
    // what the acknowledgements are for: the same run with members that
    // never say which results they hold holds done blocks forever
    run_jobs(4, 8, 40, 0, false);
}
