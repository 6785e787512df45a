//! Arbitrary datagrams into the protocol machines: the switch program (an
//! aggregating job with straggler aging, a forwarding job, and a job in which
//! the switch is a non-root tree node whose parent is address 7, with a
//! member awaiting its sync; two shards, the scanners run as time passes)
//! and a joined worker session. The aggregating and tree jobs have a result
//! group, and the sink reaches groups, so Joins that listen there (the F
//! bit) send results to it.
//! Input: a sequence of [len: u8][from: u8][bytes...] records; the high bits
//! of `from` also advance time, so blocks age and sources are declared slow.
//! Every datagram also goes through the overloaded daemon's trimming
//! (`trim::return_to_sender`), and the Trimmed nack, if any, to the worker.
//! The switch also relays job 5 (sources 3, 4 and 7 only) and job 1 (GOAT's on-path filtering) to
//! the next hop at addresses 8 and 9 (one per shard): job 1 is aggregated
//! for its members and relayed for anyone else, and what comes from 8 or 9
//! goes down.
//! The same datagrams also reach job 1 on a switch whose pooled
//! memory holds one buffer beyond its floor (refusals, recycling,
//! eviction, result acknowledgements).
//! Oracles: no panic; everything the machines emit is a valid packet (or
//! the header of one cut by the network, which a relay passes on);
//! the short switch's memory never exceeds its limit;
//! every datagram the switch saw is counted; accepted contributions never
//! exceed what arrived; trimming answers with exactly one Trimmed nack for
//! the same job, source and block, or with nothing.
#![no_main]

use fanin_proto::host::{AllreduceSession, SessionConfig, Tensor};
use fanin_proto::job::{JobMode, JobSpec};
use std::time::Duration;

use fanin_proto::job::SWITCH_RANK_BASE;
use fanin_proto::switch::{AgingConfig, MemoryModel, ShardConfig, Uplink, ValueSwitch, Verdict};
use fanin_proto::trim::{return_to_sender, TrimCause, TrimVerdict};
use fanin_proto::{Time, VecTransmit};
use fanin_wire::value::{JoinParams, Nack, NackReason, Packet, Repr};
use fanin_wire::MessageType;
use libfuzzer_sys::fuzz_target;

const GROUP: std::net::SocketAddrV4 = std::net::SocketAddrV4::new(std::net::Ipv4Addr::new(239, 1, 0, 7), 47001);

fn switch(shard: u16) -> ValueSwitch<u8> {
    let aging = AgingConfig { scanners: 2, checks: 2, min_tick: Duration::from_micros(1), ..AgingConfig::default() };
    let mut sw = ValueSwitch::new(ShardConfig {
        shard,
        shard_count: 2,
        incarnation: 9,
        memory_limit: 1 << 24,
        aging,
        seal_clock_us: 1,
        rate_limit: None,
        packet_elems_max: u32::MAX,
        memory_model: MemoryModel::Pooled,
    });
    let mut job = JobSpec::with_sources(1, 3, 4, 8);
    job.block_exp_ms = 1;
    job.slow_after_windows = 1;
    job.result_group = Some(GROUP);
    sw.add_job(job).unwrap();
    let mut fwd = JobSpec::with_sources(2, 2, 4, 8);
    fwd.mode = JobMode::Forward;
    sw.add_job(fwd).unwrap();
    // a keyed job: arbitrary bytes exercise the tag check and never get past it
    let mut keyed = JobSpec::with_sources(4, 2, 4, 8);
    keyed.key = Some(fanin_proto::auth::Key([0x4b; 16]));
    keyed.result_group = Some(GROUP); // its results sealed once for the group
    sw.add_job(keyed).unwrap();
    // a tree node: children 0, 1 and a child switch; parent at address 7
    let mut tree = JobSpec::with_sources(3, 2, 4, 8);
    tree.members.push(SWITCH_RANK_BASE + 1);
    tree.workers = 6;
    tree.block_exp_ms = 1;
    tree.result_group = Some(GROUP);
    sw.add_job(tree.clone()).unwrap();
    sw.set_uplink(3, Some(Uplink { parent: vec![7, 7], rank: SWITCH_RANK_BASE })).unwrap();
    // member 2 joins the running job: waited for only after its sync
    tree.members.push(2);
    let mut out = VecTransmit::new();
    sw.update_job(Time::ZERO, tree, Some(Uplink { parent: vec![7, 7], rank: SWITCH_RANK_BASE }), &[2], &mut out)
        .unwrap();
    sw.add_transit(5, vec![8, 9], &[3, 4, 7]).unwrap(); // only these sources pass
    sw.add_transit(1, vec![8, 9], &[]).unwrap();
    sw
}

/// Job 1 on a one-shard switch whose pooled memory holds its floor, a
/// second job's and one buffer more: new blocks are refused, recycle, evict and are
/// freed by result acknowledgements (docs/memory.md).
fn tight() -> ValueSwitch<u8> {
    let aging = AgingConfig { scanners: 2, checks: 2, min_tick: Duration::from_micros(1), ..AgingConfig::default() };
    let config = |memory_limit| ShardConfig { memory_model: MemoryModel::Pooled, aging, ..ShardConfig::single(memory_limit) };
    let mut job = JobSpec::with_sources(1, 3, 4, 8);
    job.block_exp_ms = 1;
    job.slow_after_windows = 1;
    // a second job's floor takes the rest (job 1's cap must still fit)
    let other = JobSpec::with_sources(6, 1, 1, 64);
    let mut probe = ValueSwitch::<u8>::new(config(1 << 24));
    probe.add_job(job.clone()).unwrap();
    probe.add_job(other.clone()).unwrap();
    let mut sw = ValueSwitch::new(config(probe.memory_used() + 8 * 4));
    sw.add_job(job).unwrap();
    sw.add_job(other).unwrap();
    sw
}

fn session() -> AllreduceSession {
    let mut cfg = SessionConfig::new(1, 0);
    cfg.elems_per_packet = 4;
    let mut s = AllreduceSession::new(cfg, Time::ZERO);
    // feed it a JoinAck so it is in the Ready state
    let repr = Repr {
        msg_type: MessageType::JoinAck,
        age_op: 0,
        final_block: false,
        degraded: false,
        exp_only: false,
        no_data: false,
        dtype: fanin_wire::value::Dtype::Int32,
        src_id: 0,
        src_cnt: 3,
        gen_id: 0,
        job_id: 1,
        block_id: 0,
        grad_cnt: 0,
        exp: -128,
        next_exp: -128,
    };
    let mut buf = vec![0; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    JoinParams {
        block_cnt_max: 4,
        block_grad_max: 8,
        block_exp_ms: 0,
        incarnation: 9,
        shard_count: 2,
        next_block: 0,
        results_on_group: false,
        partial_results: false,
        packet_elems: 8,
        order_shards: 0,
        result_key: None,
    }
    .emit(p.payload_mut());
    s.handle_datagram(Time::ZERO, &buf);
    // a reduce-scatter keeping the first block and a half: fuzzed results
    // without data reach both the blocks it owns and those it does not
    s.keep_only(0..6);
    let _ = s.begin(Time::ZERO, Tensor::F32(vec![1.5; 13]));
    s
}

fn check_emitted(out: &mut VecTransmit<impl Copy>) {
    for (_, bytes) in out.drain() {
        assert!(
            Packet::new_checked(&bytes[..]).is_ok() || Packet::trimmed_header(&bytes[..]).is_some(),
            "machines emit only valid packets (or relay a trimmed header)"
        );
    }
    for (group, bytes) in out.group_datagrams.drain(..) {
        assert_eq!(group, GROUP);
        // (a keyed job's group result is sealed once, under its result key)
        let inner = fanin_wire::auth::Sealed::split(&bytes[..]).map_or(&bytes[..], |s| s.inner);
        let p = Packet::new_checked(inner).expect("machines emit only valid packets");
        assert_eq!(p.msg_type_code(), MessageType::Result as u8, "only results go to the group");
    }
}

fuzz_target!(|data: &[u8]| {
    let mut shards = [switch(0), switch(1)];
    let mut short = tight();
    let limit = short.memory_used() + 8 * 4;
    let mut worker = session();
    let mut out = VecTransmit::new();
    out.groups_reachable = true;
    let mut rest = data;
    let mut fed = 0u64;
    let mut t = 0u64;
    while rest.len() >= 2 {
        let (len, from) = (rest[0] as usize, rest[1]);
        rest = &rest[2..];
        let take = len.min(rest.len());
        let (dgram, tail) = rest.split_at(take);
        rest = tail;
        t += 1_000 + (from >> 4) as u64 * 50_000;
        let now = Time::from_nanos(t);
        for sw in shards.iter_mut() {
            if sw.poll_timeout().is_some_and(|d| d <= now) {
                sw.handle_timeout(now, &mut out);
            }
        }
        check_emitted(&mut out);
        let target = (from & 1) as usize;
        fed += 1;
        match shards[target].handle_datagram(now, from, dgram, &mut out) {
            Verdict::Consumed => {}
            Verdict::WrongShard(o) => {
                assert!(o < 2);
                fed += 1;
                let again = shards[o as usize].handle_datagram(now, from, dgram, &mut out);
                assert!(!matches!(again, Verdict::WrongShard(_)), "the owner shard handles what it owns");
                // (a contribution that does not line up ends the round there)
                shards[1 - o as usize].learn(again);
            }
            verdict => shards[1 - target].learn(verdict),
        }
        check_emitted(&mut out);
        if short.poll_timeout().is_some_and(|d| d <= now) {
            short.handle_timeout(now, &mut out);
        }
        let _ = short.handle_datagram(now, from, dgram, &mut out);
        assert!(short.memory_used() <= limit, "pooled memory over its limit: {} > {limit}", short.memory_used());
        check_emitted(&mut out);
        worker.handle_datagram(now, dgram);
        let mut tout = VecTransmit::new();
        let verdict = return_to_sender(from, dgram, TrimCause::ProcessingQueue, &mut tout);
        let trims: Vec<_> = tout.drain().collect();
        assert_eq!(trims.len(), usize::from(verdict == TrimVerdict::Trimmed));
        for (dest, nack) in &trims {
            let (p, q) = (Packet::new_checked(&nack[..]).expect("a valid Trimmed nack"), Packet::new_checked(dgram).unwrap());
            assert_eq!(*dest, from, "return to sender");
            assert_eq!((p.job_id(), p.src_id(), p.block_id(), p.gen_id()), (q.job_id(), q.src_id(), q.block_id(), q.gen_id()));
            assert_eq!(Nack::parse(p.payload()).unwrap().reason, NackReason::Trimmed);
            worker.handle_datagram(now, nack);
        }
        worker.handle_timeout(now);
        let mut wout = VecTransmit::new();
        worker.poll_transmit(now, &mut wout);
        check_emitted(&mut wout);
        while worker.poll_event().is_some() {}
    }
    let seen: u64 = shards.iter().map(|s| s.counters().rx_datagrams).sum();
    assert_eq!(seen, fed);
    for s in &shards {
        assert!(s.counters().accepted <= s.counters().rx_datagrams);
    }
});
