//! Property tests: workers and switch shards exchange datagrams over an
//! in-memory network that loses, duplicates and reorders them. Every worker
//! must end with bit-identical results equal to the reference (exact for
//! int32, within the documented block-floating-point bound for float32).

use std::collections::BinaryHeap;
use std::cmp::Reverse;
use std::time::Duration;

use fanin_proto::bfp;
use fanin_proto::bfp::half::{self, Half};
use fanin_proto::fault::SplitMix64;
use fanin_proto::host::{AllreduceSession, Event, Outcome, SessionConfig, Tensor};
use fanin_proto::job::SWITCH_RANK_BASE;
use fanin_proto::switch::{ShardConfig, Uplink, ValueSwitch, Verdict};
use fanin_proto::{JobSpec, Time, VecTransmit};
use fanin_wire::value::{Packet, EXP_NON_FINITE};
use proptest::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Node {
    Worker(usize),
    /// Shard `.1` of switch `.0`.
    Shard(usize, u16),
}

/// A datagram on the wire: (delivery time, sequence, from, to, bytes,
/// whether a queue on the way marked it ECN CE).
type InFlight = (u64, u64, Node, Node, Vec<u8>, bool);

#[derive(Clone, Debug)]
struct NetParams {
    loss: f64,
    dup: f64,
    /// Maximum extra delay; any value above the base delay reorders.
    jitter_ns: u64,
    /// Probability that a datagram arrives marked ECN Congestion
    /// Experienced (docs/congestion.md, "ECN"): marks cut windows and are
    /// echoed, and must never change a sum or stall a recovery.
    ce: f64,
}

struct Run {
    workers: usize,
    shards: u16,
    epp: u16,
    window: u32,
    slots: u32,
    net: NetParams,
    seed: u64,
    /// Straggler mitigation: the job's block timeout (0 = off) and K.
    block_exp_ms: u32,
    slow_after_windows: u32,
    /// `delays[w][k]`: worker `w` starts its `k`-th allreduce this many
    /// nanoseconds late (a straggler); missing entries mean no delay.
    delays: Vec<Vec<u64>>,
    /// Aggregation tree: `parents[i]` is switch `i`'s parent (None: the
    /// root); worker `w` hangs off switch `attach[w % attach.len()]`. The
    /// default is one switch.
    parents: Vec<Option<usize>>,
    attach: Vec<usize>,
    /// Reduce-scatter: every worker keeps only its shard of each tensor
    /// ([`shard_of_worker`]).
    scatter: bool,
    /// The block the job's stream starts at on every switch (as if it had
    /// run that long; None: the start of the block space).
    start_block: Option<u32>,
    /// Restart the switches `.0` together (every shard: a new incarnation, the job
    /// installed again, no blocks) once `.1` nanoseconds of the run passed
    /// and every worker joined (a switch that restarts before its workers
    /// joined refuses them: docs/trees.md), as the controller re-installs
    /// it: `resumed` (docs/restart.md).
    restart: Option<(Vec<usize>, u64)>,
    /// Restart even while a worker runs its last allreduce. Off: a restart
    /// that would come then does not happen, since a worker that finished
    /// its last allreduce takes no part in a recovery (docs/restart.md,
    /// "Idle members": the others fail cleanly), as a training loop's
    /// workers, which go on calling allreduce, do.
    restart_in_last: bool,
    /// The job takes complete results only (`on_failure = fail`): a block
    /// no switch can complete fails the worker instead of being reported
    /// as missed.
    complete_only: bool,    /// A worker that finished its last allreduce lingers
    /// (`set_lingering`: it probes its switch and takes part in a
    /// recovery, docs/restart.md), as the torch backend's do until every
    /// rank is done; the run ends when the switches told every worker
    /// that all are done.
    linger: bool,
    /// Until the restart, worker `.0` hears no data result of a block at
    /// or after `.1`: the others can finish their last allreduce while it
    /// still lacks results of it.
    deaf_until_restart: Option<(usize, u32)>,
}

impl Run {
    fn new(workers: usize, shards: u16, epp: u16, window: u32, slots: u32, net: NetParams, seed: u64) -> Self {
        Run {
            workers,
            shards,
            epp,
            window,
            slots,
            net,
            seed,
            block_exp_ms: 0,
            slow_after_windows: 0,
            delays: Vec::new(),
            parents: vec![None],
            attach: vec![0],
            scatter: false,
            start_block: None,
            restart: None,
            restart_in_last: false,
            complete_only: false,
            linger: false,
            deaf_until_restart: None,
        }
    }

    fn leaf(&self, w: usize) -> usize {
        self.attach[w % self.attach.len()]
    }
}

fn run(cfg: &Run, inputs: Vec<Tensor>) -> Vec<Outcome> {
    run_many(cfg, inputs.into_iter().map(|t| vec![t]).collect()).into_iter().map(|mut v| v.remove(0)).collect()
}

/// Each worker runs its list of allreduces back to back in one session.
fn run_many(cfg: &Run, inputs: Vec<Vec<Tensor>>) -> Vec<Vec<Outcome>> {
    let mut rng = SplitMix64::new(cfg.seed);
    let mut spec = JobSpec::with_sources(7, cfg.workers as u16, cfg.slots, cfg.epp as u32);
    spec.block_exp_ms = cfg.block_exp_ms;
    spec.slow_after_windows = cfg.slow_after_windows;
    spec.workers = cfg.workers as u16;
    // Heavy loss with RTO backoff can keep a live worker silent for seconds
    // of virtual time (the workers' dead_after is 30 s here): these runs
    // check exact sums, so the member timeout must not call it dead.
    spec.member_timeout_ms = 60_000;
    if cfg.complete_only {
        spec.on_failure = fanin_proto::job::FailurePolicy::Fail;
    }
    // every switch of the tree: its children are its workers and the ranks
    // of its child switches; all but the root send up
    let make_switch = |i: usize, incarnation: u32, resumed: bool| -> Vec<ValueSwitch<Node>> {
        let mut members: Vec<u16> = (0..cfg.workers).filter(|&w| cfg.leaf(w) == i).map(|w| w as u16).collect();
        members.extend((0..cfg.parents.len()).filter(|&c| cfg.parents[c] == Some(i)).map(|c| SWITCH_RANK_BASE + c as u16));
        let spec = JobSpec { members, resumed, ..spec.clone() };
        (0..cfg.shards)
            .map(|s| {
                let mut sw = ValueSwitch::new(ShardConfig {
                    shard: s,
                    shard_count: cfg.shards,
                    incarnation,
                    ..ShardConfig::single(1 << 32)
                });
                sw.add_job(spec.clone()).unwrap();
                let uplink = cfg.parents[i].map(|p| Uplink {
                    parent: (0..cfg.shards).map(|k| Node::Shard(p, k)).collect(),
                    rank: SWITCH_RANK_BASE + i as u16,
                });
                sw.set_uplink(7, uplink).unwrap();
                if let Some(start) = cfg.start_block.filter(|_| !resumed) {
                    sw.start_round(7, start);
                }
                sw
            })
            .collect()
    };
    // every switch of the tree: its children are its workers and the ranks
    // of its child switches; all but the root send up
    let mut switches: Vec<Vec<ValueSwitch<Node>>> =
        (0..cfg.parents.len()).map(|i| make_switch(i, 1 + i as u32, false)).collect();
    let mut restart = cfg.restart.clone();
    let mut joined = vec![false; cfg.workers];
    let mut sessions: Vec<AllreduceSession> = (0..cfg.workers)
        .map(|w| {
            let mut c = SessionConfig::new(7, w as u16);
            c.elems_per_packet = cfg.epp;
            c.window = cfg.window;
            c.rto_initial = Duration::from_micros(500);
            c.rto_min = Duration::from_micros(200);
            c.dead_after = Duration::from_secs(30);
            c.join_timeout = Duration::from_secs(30);
            AllreduceSession::new(c, Time::ZERO)
        })
        .collect();
    let total: Vec<usize> = inputs.iter().map(Vec::len).collect();
    let mut inputs: Vec<std::collections::VecDeque<Tensor>> = inputs.into_iter().map(Into::into).collect();
    let mut outcomes: Vec<Vec<Outcome>> = vec![Vec::new(); cfg.workers];
    // a straggler's next allreduce, waiting for its start time
    let mut pending: Vec<Option<(Time, Tensor)>> = vec![None; cfg.workers];
    let delay = |w: usize, k: usize| cfg.delays.get(w).and_then(|d| d.get(k)).copied().unwrap_or(0);
    let mut wire: BinaryHeap<Reverse<InFlight>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut now = Time::ZERO;
    let base_delay = 5_000u64;
    let mut send = |wire: &mut BinaryHeap<_>, rng: &mut SplitMix64, now: Time, from: Node, to: Node, bytes: Vec<u8>| {
        if rng.next_f64() < cfg.net.loss {
            return;
        }
        let copies = if rng.next_f64() < cfg.net.dup { 2 } else { 1 };
        for _ in 0..copies {
            let at = now.as_nanos() + base_delay + rng.below(cfg.net.jitter_ns + 1);
            seq += 1;
            let ce = cfg.net.ce > 0.0 && rng.next_f64() < cfg.net.ce;
            wire.push(Reverse((at, seq, from, to, bytes.clone(), ce)));
        }
    };
    let mut steps = 0u64;
    // LOSSY_MAX_STEPS: give up sooner when hunting a stall
    let max_steps: u64 = std::env::var("LOSSY_MAX_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(50_000_000);
    loop {
        steps += 1;
        if steps >= max_steps {
            dump_counters(&switches);
            panic!("no progress");
        }
        // workers: events, then transmit
        for (w, s) in sessions.iter_mut().enumerate() {
            if let Some((at, _)) = &pending[w] {
                if *at <= now {
                    let (_, t) = pending[w].take().unwrap();
                    if cfg.scatter {
                        s.keep_only(shard_of_worker(w, cfg.workers, tensor_len(&t)));
                    }
                    s.begin(now, t).unwrap();
                }
            }
            while let Some(ev) = s.poll_event() {
                let next = match ev {
                    Event::Joined(_) => {
                        joined[w] = true;
                        inputs[w].pop_front()
                    }
                    Event::Completed(o) => {
                        outcomes[w].push(o);
                        inputs[w].pop_front()
                    }
                    Event::Membership { .. } => None,
                    Event::Failed(e) => {
                        if std::env::var_os("LOSSY_DEBUG").is_some() {
                            eprintln!("at {now:?}: allreduces done {:?}", outcomes.iter().map(Vec::len).collect::<Vec<_>>());
                            dump_counters(&switches);
                        }
                        panic!("worker {w} failed: {e}")
                    }
                };
                if let Some(t) = next {
                    let d = delay(w, outcomes[w].len());
                    if d == 0 {
                        if cfg.scatter {
                            s.keep_only(shard_of_worker(w, cfg.workers, tensor_len(&t)));
                        }
                        s.begin(now, t).unwrap();
                    } else {
                        pending[w] = Some((now + Duration::from_nanos(d), t));
                    }
                }
            }
            if cfg.linger && outcomes[w].len() == total[w] && !s.lingering() {
                s.set_lingering(now, true);
            }
            let mut out = VecTransmit::new();
            while s.poll_transmit(now, &mut out) > 0 {}
            for (shard, bytes) in out.drain() {
                send(&mut wire, &mut rng, now, Node::Worker(w), Node::Shard(cfg.leaf(w), shard), bytes);
            }
        }
        // Re-poll events produced by begin() finishing instantly (empty tensors).
        // (Lingering workers go on until the switches said all are done.)
        if outcomes.iter().zip(&total).all(|(o, t)| o.len() == *t) && (!cfg.linger || sessions.iter().all(|s| s.all_done())) {
            break;
        }
        // next thing to happen: a delivery or a timer
        let next_timer = sessions
            .iter()
            .filter_map(|s| s.poll_timeout())
            .chain(switches.iter().flatten().filter_map(|sw| sw.poll_timeout()))
            .chain(pending.iter().flatten().map(|(at, _)| *at))
            .chain(restart.as_ref().map(|(_, at)| Time::from_nanos(*at)).filter(|&at| at > now))
            .min();
        let next_wire = wire.peek().map(|Reverse((t, ..))| Time::from_nanos(*t));
        let next = match (next_timer, next_wire) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) => a,
            (None, Some(b)) => b,
            (None, None) => {
                // sessions may have pending events only
                panic!("deadlock: nothing scheduled");
            }
        };
        now = now.max(next);
        if let Some((victims, _)) = restart.take_if(|(_, at)| now.as_nanos() >= *at && joined.iter().all(|&j| j)) {
            let in_last = outcomes.iter().zip(&total).any(|(o, t)| o.len() + 1 >= *t);
            if std::env::var_os("LOSSY_DEBUG").is_some() {
                eprintln!("restart of switches {victims:?} at {now:?}: allreduces done {:?} of {:?}", outcomes.iter().map(Vec::len).collect::<Vec<_>>(), total);
            }
            if !in_last || cfg.restart_in_last {
                for i in victims {
                    switches[i] = make_switch(i, 0x5a5a_0000 + i as u32, true);
                }
            }
        }
        while let Some(Reverse((t, ..))) = wire.peek() {
            if *t > now.as_nanos() {
                break;
            }
            let Reverse((_, _, from, to, bytes, ce)) = wire.pop().unwrap();
            match to {
                Node::Shard(i, s) => {
                    let mut out = VecTransmit::new();
                    let mut target = s;
                    loop {
                        match switches[i][target as usize].handle_datagram_ce(now, from, &bytes, ce, &mut out) {
                            Verdict::Consumed => break,
                            Verdict::WrongShard(o) => target = o,
                            verdict => {
                                for (k, sw) in switches[i].iter_mut().enumerate() {
                                    if k != target as usize {
                                        sw.learn(verdict);
                                    }
                                }
                                break;
                            }
                        }
                    }
                    for (dest, b) in out.drain() {
                        send(&mut wire, &mut rng, now, Node::Shard(i, target), dest, b);
                    }
                }
                Node::Worker(w) => {
                    let deaf = restart.is_some() && cfg.deaf_until_restart.is_some_and(|(d, from)| {
                        let data_result = bytes[3] == fanin_wire::MessageType::Result as u8 && bytes[4] & 0x02 == 0;
                        d == w && data_result && Packet::new_checked(&bytes[..]).is_ok_and(|p| p.block_id() >= from)
                    });
                    if !deaf {
                        sessions[w].handle_datagram_ce(now, &bytes, ce);
                    }
                }
            }
        }
        for s in sessions.iter_mut() {
            if s.poll_timeout().is_some_and(|t| t <= now) {
                s.handle_timeout(now);
            }
        }
        for (i, shards) in switches.iter_mut().enumerate() {
            for (k, sw) in shards.iter_mut().enumerate() {
                if sw.poll_timeout().is_some_and(|t| t <= now) {
                    let mut out = VecTransmit::new();
                    sw.handle_timeout(now, &mut out);
                    for (dest, b) in out.drain() {
                        send(&mut wire, &mut rng, now, Node::Shard(i, k as u16), dest, b);
                    }
                }
            }
        }
    }
    if std::env::var_os("LOSSY_DEBUG").is_some() {
        dump_counters(&switches);
    }
    outcomes
}

/// Every shard's counters, for a run that failed or was asked to
/// (`LOSSY_DEBUG`).
fn dump_counters(switches: &[Vec<ValueSwitch<Node>>]) {
    for (i, shards) in switches.iter().enumerate() {
        for sw in shards {
            eprintln!("switch {i}: {:?}", sw.counters());
        }
    }
}

fn int_inputs(workers: usize, len: usize, seed: u64) -> Vec<Vec<i32>> {
    let mut rng = SplitMix64::new(seed ^ 0xABCD);
    (0..workers).map(|_| (0..len).map(|_| rng.next_u64() as i32).collect()).collect()
}

fn float_inputs(workers: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64::new(seed ^ 0x1234);
    (0..workers)
        .map(|_| {
            (0..len)
                .map(|i| {
                    // magnitudes vary across blocks and inside them
                    let scale = 2f32.powi((i / 97 % 40) as i32 - 20);
                    ((rng.next_f64() * 2.0 - 1.0) as f32) * scale
                })
                .collect()
        })
        .collect()
}

/// Put a NaN or an infinity (either sign) into about one block in six of
/// each worker's tensor (`as_bits` turns an f32 into the tensor's element);
/// returns how many blocks got one.
fn poison<T: Copy>(inputs: &mut [Vec<T>], epp: usize, seed: u64, as_bits: impl Fn(f32) -> T) -> usize {
    let mut rng = SplitMix64::new(seed ^ 0x0bad);
    let mut poisoned = 0;
    for v in inputs.iter_mut() {
        let len = v.len();
        for start in (0..len).step_by(epp) {
            if rng.next_f64() < 1.0 / 6.0 {
                let i = start + (rng.next_u64() as usize) % (len - start).min(epp);
                v[i] = as_bits([f32::NAN, f32::INFINITY, f32::NEG_INFINITY][(rng.next_u64() % 3) as usize]);
                poisoned += 1;
            }
        }
    }
    poisoned
}

fn tensor_len(t: &Tensor) -> usize {
    match t {
        Tensor::I32(v) => v.len(),
        Tensor::F32(v) => v.len(),
        Tensor::Half(_, v) => v.len(),
    }
}

/// Worker `w`'s shard of a reduce-scatter of `len` elements over `n`
/// workers (the last takes the remainder; shards may be empty).
fn shard_of_worker(w: usize, n: usize, len: usize) -> std::ops::Range<usize> {
    let k = len / n;
    w * k..if w + 1 == n { len } else { (w + 1) * k }
}

/// Reduce-scatter: each worker's shard is the exact sum.
fn check_int_shards(inputs: &[Vec<i32>], outcomes: &[Outcome]) {
    let len = inputs[0].len();
    let mut expected = vec![0i32; len];
    for v in inputs {
        for (e, x) in expected.iter_mut().zip(v) {
            *e = e.wrapping_add(*x);
        }
    }
    for (w, o) in outcomes.iter().enumerate() {
        let Tensor::I32(got) = &o.tensor else { panic!("int32 in, int32 out") };
        let keep = shard_of_worker(w, outcomes.len(), len);
        assert_eq!(got[keep.clone()], expected[keep], "worker {w}'s shard");
        assert!(o.degraded_blocks.is_empty());
    }
}

fn check_int(inputs: &[Vec<i32>], outcomes: &[Outcome]) {
    let len = inputs[0].len();
    let mut expected = vec![0i32; len];
    for v in inputs {
        for (e, x) in expected.iter_mut().zip(v) {
            *e = e.wrapping_add(*x);
        }
    }
    for o in outcomes {
        assert_eq!(o.tensor, Tensor::I32(expected.clone()));
        assert!(o.degraded_blocks.is_empty());
    }
}

fn check_float(inputs: &[Vec<f32>], outcomes: &[Outcome], epp: usize) {
    let n = inputs.len();
    let first = &outcomes[0].tensor;
    for o in outcomes {
        // bit-identical across workers
        let (Tensor::F32(a), Tensor::F32(b)) = (&o.tensor, first) else { panic!("dtype") };
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "workers disagree");
    }
    let Tensor::F32(got) = first else { unreachable!() };
    for (blk, chunk) in got.chunks(epp).enumerate() {
        let range = blk * epp..blk * epp + chunk.len();
        let exp = inputs.iter().map(|v| bfp::block_exponent(&v[range.clone()]).unwrap()).max().unwrap();
        if exp == EXP_NON_FINITE {
            // a NaN or an infinity from any source: NaN in every element
            assert!(chunk.iter().all(|g| g.is_nan()), "block {blk} holds a non-finite input but a finite sum");
            continue;
        }
        let bound = bfp::error_bound(exp, n);
        for (i, g) in range.clone().zip(chunk) {
            let exact: f64 = inputs.iter().map(|v| v[i] as f64).sum();
            let ulp = (g.abs() * f32::EPSILON) as f64;
            assert!((*g as f64 - exact).abs() <= bound + ulp, "element {i}: {g} vs {exact} (bound {bound})");
        }
    }
}

/// 16-bit inputs whose sums stay finite in the format (float16 tops out
/// at 65504; 16 workers of magnitudes up to 2^11 stay below 2^15).
fn half_inputs(kind: Half, workers: usize, len: usize, seed: u64) -> Vec<Vec<u16>> {
    let mut rng = SplitMix64::new(seed ^ 0x5678);
    let span = if kind == Half::F16 { 24 } else { 60 };
    (0..workers)
        .map(|_| {
            (0..len)
                .map(|i| {
                    let scale = 2f64.powi((i / 97 % span) as i32 - (span as i32 - 11));
                    kind.from_f64((rng.next_f64() * 2.0 - 1.0) * scale)
                })
                .collect()
        })
        .collect()
}

/// Bit-identical on every worker, and within the documented bound of the
/// float64 sum of the 16-bit inputs (docs/protocol.md §3.3).
fn check_half(kind: Half, inputs: &[Vec<u16>], outcomes: &[Outcome], epp: usize) {
    let n = inputs.len();
    let first = &outcomes[0].tensor;
    for o in outcomes {
        assert_eq!(&o.tensor, first, "workers disagree");
    }
    let Tensor::Half(got_kind, got) = first else { panic!("dtype") };
    assert_eq!(*got_kind, kind);
    let fraction_bits = if kind == Half::F16 { 10 } else { 7 };
    for (blk, chunk) in got.chunks(epp).enumerate() {
        let range = blk * epp..blk * epp + chunk.len();
        let exp = inputs.iter().map(|v| half::block_exponent_half(kind, &v[range.clone()]).unwrap()).max().unwrap();
        if exp == EXP_NON_FINITE {
            assert!(chunk.iter().all(|g| kind.to_f32(*g).is_nan()), "block {blk} holds a non-finite input but a finite sum");
            continue;
        }
        let bound = half::error_bound(exp, n);
        for (i, g) in range.clone().zip(chunk) {
            let exact: f64 = inputs.iter().map(|v| kind.to_f32(v[i]) as f64).sum();
            let g = kind.to_f32(*g) as f64;
            // one unit in the last place of the result (subnormals: the smallest)
            let ulp = 2f64.powi((g.abs().max(f64::MIN_POSITIVE).log2().floor() as i32).max(-14) - fraction_bits);
            assert!((g - exact).abs() <= bound + ulp, "element {i}: {g} vs {exact} (bound {bound} + {ulp})");
        }
    }
}

/// A network that loses, duplicates and reorders, and whose queues mark
/// as many datagrams CE as they lose (a marking queue is the same
/// congestion seen earlier).
fn net(loss: f64, dup: f64, jitter_ns: u64) -> NetParams {
    NetParams { loss, dup, jitter_ns, ce: loss }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn int32_exact_under_loss_dup_reorder(
        workers in 1usize..=16,
        len in prop_oneof![1usize..=10, 1usize..=5_000],
        epp in prop_oneof![Just(64u16), Just(100u16), Just(1024u16)],
        shards in 1u16..=3,
        slots in 1u32..=16,
        loss in 0.0f64..=0.3,
        dup in 0.0f64..=0.1,
        seed in any::<u64>(),
    ) {
        let cfg = Run::new(workers, shards, epp, slots, slots, net(loss, dup, 40_000), seed);
        let inputs = int_inputs(workers, len, seed);
        let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::I32).collect());
        check_int(&inputs, &outcomes);
    }

    #[test]
    fn float16_and_bfloat16_within_bound_under_loss_dup_reorder(
        workers in 1usize..=16,
        len in 1usize..=3_000,
        epp in prop_oneof![Just(64u16), Just(333u16), Just(1024u16)],
        shards in 1u16..=3,
        slots in 1u32..=16,
        loss in 0.0f64..=0.3,
        dup in 0.0f64..=0.1,
        bf16 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let kind = if bf16 { Half::BF16 } else { Half::F16 };
        let cfg = Run::new(workers, shards, epp, slots, slots, net(loss, dup, 40_000), seed);
        let inputs = half_inputs(kind, workers, len, seed);
        let outcomes = run(&cfg, inputs.iter().map(|v| Tensor::Half(kind, v.clone())).collect());
        check_half(kind, &inputs, &outcomes, epp as usize);
    }

    #[test]
    fn float32_within_bound_under_loss_dup_reorder(
        workers in 1usize..=16,
        len in 1usize..=5_000,
        epp in prop_oneof![Just(64u16), Just(333u16), Just(1024u16)],
        shards in 1u16..=3,
        slots in 1u32..=16,
        loss in 0.0f64..=0.3,
        dup in 0.0f64..=0.1,
        seed in any::<u64>(),
    ) {
        let cfg = Run::new(workers, shards, epp, slots, slots, net(loss, dup, 40_000), seed);
        let inputs = float_inputs(workers, len, seed);
        let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::F32).collect());
        check_float(&inputs, &outcomes, epp as usize);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// Several allreduces of different sizes and dtypes back to back: the
    /// block stream continues across generations and exponent lookahead never
    /// leaks from one tensor into the next.
    #[test]
    fn consecutive_allreduces_in_one_session(
        workers in 1usize..=6,
        lens in proptest::collection::vec(1usize..=3_000, 1..=5),
        slots in 1u32..=8,
        loss in 0.0f64..=0.2,
        seed in any::<u64>(),
    ) {
        let epp = 64u16;
        let cfg = Run::new(workers, 2, epp, slots, slots, net(loss, 0.05, 30_000), seed);
        let mut per_worker: Vec<Vec<Tensor>> = vec![Vec::new(); workers];
        let mut refs = Vec::new();
        for (k, len) in lens.iter().enumerate() {
            if k % 2 == 0 {
                let ins = float_inputs(workers, *len, seed + k as u64);
                for (w, v) in ins.iter().enumerate() { per_worker[w].push(Tensor::F32(v.clone())); }
                refs.push((true, ins.into_iter().map(|v| v.into_iter().map(|x| x.to_bits() as i32).collect()).collect::<Vec<Vec<i32>>>()));
            } else {
                let ins = int_inputs(workers, *len, seed + k as u64);
                for (w, v) in ins.iter().enumerate() { per_worker[w].push(Tensor::I32(v.clone())); }
                refs.push((false, ins));
            }
        }
        let outcomes = run_many(&cfg, per_worker);
        for (k, (is_float, ins)) in refs.iter().enumerate() {
            let these: Vec<Outcome> = outcomes.iter().map(|o| o[k].clone()).collect();
            if *is_float {
                let floats: Vec<Vec<f32>> = ins.iter().map(|v| v.iter().map(|b| f32::from_bits(*b as u32)).collect()).collect();
                check_float(&floats, &these, epp as usize);
            } else {
                check_int(ins, &these);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// NaN and infinities in some blocks of some workers, flat and through
    /// trees, float32 and 16-bit, with loss, duplication and reordering:
    /// a block with a non-finite input from any worker is NaN in every
    /// element on every worker (the exponent byte's marker wins every
    /// switch's max), every other block is within the bound, and the
    /// session's next allreduce is a clean, right sum (nothing was refused,
    /// so nobody is out of step).
    #[test]
    fn non_finite_inputs_make_their_block_nan_everywhere_and_the_session_goes_on(
        workers in 3usize..=6, // every leaf of every tree shape gets a worker
        len in 1usize..=2_000,
        shape in 0u8..=4,
        dtype in 0u8..=2,
        slots in 1u32..=8,
        loss in 0.0f64..=0.2,
        seed in any::<u64>(),
    ) {
        let epp = 64;
        let mut cfg = Run::new(workers, 2, epp as u16, slots, slots, net(loss, 0.05, 40_000), seed);
        if shape < 4 {
            (cfg.parents, cfg.attach) = tree_shape(shape);
        }
        let of_call = |out: &[Vec<Outcome>], k: usize| out.iter().map(|o| o[k].clone()).collect::<Vec<_>>();
        if dtype == 0 {
            let mut first = float_inputs(workers, len, seed);
            poison(&mut first, epp, seed, |x| x);
            let second = float_inputs(workers, len, seed + 1);
            let calls = (0..workers).map(|w| vec![Tensor::F32(first[w].clone()), Tensor::F32(second[w].clone())]).collect();
            let out = run_many(&cfg, calls);
            check_float(&first, &of_call(&out, 0), epp);
            check_float(&second, &of_call(&out, 1), epp);
        } else {
            let kind = if dtype == 1 { Half::F16 } else { Half::BF16 };
            let mut first = half_inputs(kind, workers, len, seed);
            poison(&mut first, epp, seed, |x| kind.from_f64(x as f64));
            let second = half_inputs(kind, workers, len, seed + 1);
            let calls =
                (0..workers).map(|w| vec![Tensor::Half(kind, first[w].clone()), Tensor::Half(kind, second[w].clone())]).collect();
            let out = run_many(&cfg, calls);
            check_half(kind, &first, &of_call(&out, 0), epp);
            check_half(kind, &second, &of_call(&out, 1), epp);
        }
    }
}

#[test]
fn ten_million_int32_elements_with_loss() {
    let cfg = Run::new(2, 2, 1024, 64, 64, net(0.05, 0.01, 20_000), 3);
    let inputs = int_inputs(2, 10_000_000, 3);
    let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::I32).collect());
    check_int(&inputs, &outcomes);
    assert!(outcomes[0].retransmissions > 0, "5% loss must cause retransmissions");
}

#[test]
fn ten_million_float32_elements_with_loss() {
    let cfg = Run::new(3, 1, 1024, 128, 128, net(0.05, 0.01, 20_000), 4);
    let inputs = float_inputs(3, 10_000_000, 4);
    let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::F32).collect());
    check_float(&inputs, &outcomes, 1024);
}

#[test]
fn window_larger_than_slots_still_completes() {
    // The switch refuses blocks whose slot is busy; retransmission recovers.
    let cfg = Run::new(4, 1, 64, 32, 4, net(0.0, 0.0, 1_000), 5);
    let inputs = int_inputs(4, 3_000, 5);
    let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::I32).collect());
    check_int(&inputs, &outcomes);
}

#[test]
fn empty_tensor_completes_immediately() {
    let cfg = Run::new(2, 1, 64, 4, 4, net(0.0, 0.0, 0), 6);
    let outcomes = run(&cfg, vec![Tensor::I32(vec![]), Tensor::I32(vec![])]);
    assert!(outcomes.iter().all(|o| o.blocks == 0 && o.tensor.is_empty()));
}

#[test]
#[ignore]
fn diag_retransmission_rate() {
    for loss in [0.0, 0.01, 0.05] {
        let cfg = Run::new(4, 1, 1024, 256, 256, net(loss, 0.0, 0), 9);
        let inputs = float_inputs(4, 2_000_000, 9);
        let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::F32).collect());
        let r: u64 = outcomes.iter().map(|o| o.retransmissions).sum();
        println!("float loss {loss}: blocks {} retransmissions {r}", outcomes[0].blocks);
        let inputs = int_inputs(4, 2_000_000, 9);
        let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::I32).collect());
        let r: u64 = outcomes.iter().map(|o| o.retransmissions).sum();
        println!("int loss {loss}: blocks {} retransmissions {r}", outcomes[0].blocks);
    }
}

/// Check a run with stragglers: for every block, all workers that got a
/// result got the same one (bit for bit), it sums exactly `src_cnt` of the
/// inputs, it is flagged degraded iff `src_cnt` is below the job size, and a
/// worker without it (a straggler the job left behind) has zeros and reports
/// `src_cnt` 0. Returns (degraded blocks seen by worker 0, missed blocks).
fn check_straggler_run(inputs: &[Vec<Vec<i32>>], outcomes: &[Vec<Outcome>], epp: usize) -> (usize, usize) {
    let n = inputs.len();
    let (mut degraded_seen, mut missed_seen) = (0, 0);
    for (k, _) in inputs[0].iter().enumerate() {
        let len = inputs[0][k].len();
        let blocks = len.div_ceil(epp);
        for b in 0..blocks {
            let range = b * epp..((b + 1) * epp).min(len);
            let mut common: Option<(u16, Vec<i32>)> = None;
            for (w, o) in outcomes.iter().enumerate() {
                let o = &o[k];
                let Tensor::I32(t) = &o.tensor else { panic!("dtype") };
                let got = t[range.clone()].to_vec();
                let cnt = o.src_cnt_of(b as u32, n as u16);
                if cnt == 0 {
                    assert!(got.iter().all(|&x| x == 0), "worker {w} missed block {b} but has data");
                    missed_seen += 1;
                    continue;
                }
                match &common {
                    None => common = Some((cnt, got)),
                    Some((c, v)) => {
                        assert_eq!((*c, v), (cnt, &got), "worker {w} disagrees on block {b} of allreduce {k}");
                    }
                }
            }
            let (cnt, sum) = common.expect("someone has every block: the job never waits forever");
            if (cnt as usize) < n && k == 0 {
                degraded_seen += 1;
            }
            // the result sums exactly `cnt` of the inputs
            let found = (0u32..1 << n).filter(|m| m.count_ones() == cnt as u32).any(|mask| {
                range.clone().zip(&sum).all(|(i, s)| {
                    let e = (0..n).filter(|w| mask >> w & 1 == 1).fold(0i32, |a, w| a.wrapping_add(inputs[w][k][i]));
                    e == *s
                })
            });
            assert!(found, "block {b} of allreduce {k} is not a sum of {cnt} inputs");
        }
    }
    (degraded_seen, missed_seen)
}

fn straggler_inputs(workers: usize, lens: &[usize], seed: u64) -> Vec<Vec<Vec<i32>>> {
    let per_k: Vec<Vec<Vec<i32>>> = lens.iter().enumerate().map(|(k, &l)| int_inputs(workers, l, seed + k as u64)).collect();
    (0..workers).map(|w| per_k.iter().map(|ins| ins[w].clone()).collect()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Loss, duplication, reordering and stragglers together (the straggler
    /// starts some allreduces up to 30 ms late; the timeout is 1-5 ms).
    #[test]
    fn stragglers_with_loss_never_split_or_corrupt_results(
        workers in 2usize..=5,
        lens in proptest::collection::vec(1usize..=2_000, 1..=4),
        slots in 1u32..=8,
        shards in 1u16..=2,
        loss in 0.0f64..=0.1,
        block_exp_ms in 1u32..=5,
        slow_after_windows in 0u32..=2,
        straggles in proptest::collection::vec(prop_oneof![Just(0u64), 1_000_000u64..=30_000_000], 4),
        seed in any::<u64>(),
    ) {
        let epp = 64u16;
        let mut cfg = Run::new(workers, shards, epp, slots, slots, net(loss, 0.02, 30_000), seed);
        cfg.block_exp_ms = block_exp_ms;
        cfg.slow_after_windows = slow_after_windows;
        cfg.delays = vec![Vec::new(); workers];
        cfg.delays[workers - 1] = straggles;
        let inputs = straggler_inputs(workers, &lens, seed);
        let tensors = inputs.iter().map(|per| per.iter().cloned().map(Tensor::I32).collect()).collect();
        let outcomes = run_many(&cfg, tensors);
        check_straggler_run(&inputs, &outcomes, epp as usize);
    }
}

/// Without stragglers or loss, aging never fires: every block is complete.
/// (With loss, a block whose contribution is lost for longer than the
/// timeout ages like a straggler's; the property test above covers that.)
#[test]
fn aging_without_stragglers_changes_nothing() {
    let mut cfg = Run::new(4, 2, 64, 8, 8, net(0.0, 0.02, 200_000), 11);
    cfg.block_exp_ms = 5;
    let inputs = int_inputs(4, 20_000, 11);
    let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::I32).collect());
    check_int(&inputs, &outcomes);
}

#[test]
fn a_silent_straggler_costs_the_others_bounded_time_and_is_declared_slow() {
    // Worker 3 starts 200 ms late; the others finish their 3 allreduces
    // without it: the first windows pay the 2 ms timeout, then worker 3 is
    // declared permanently slow (K = 1) and the rest completes at once.
    let mut cfg = Run::new(4, 1, 64, 8, 8, net(0.0, 0.0, 1_000), 12);
    cfg.block_exp_ms = 2;
    cfg.slow_after_windows = 1;
    cfg.delays = vec![vec![], vec![], vec![], vec![200_000_000]];
    let lens = [64 * 40, 64 * 40, 64 * 40];
    let inputs = straggler_inputs(4, &lens, 12);
    let tensors = inputs.iter().map(|per| per.iter().cloned().map(Tensor::I32).collect()).collect();
    let outcomes = run_many(&cfg, tensors);
    let (degraded, _missed) = check_straggler_run(&inputs, &outcomes, 64);
    assert_eq!(degraded, 40, "every block of the first allreduce excluded the straggler");
    for o in &outcomes[0] {
        assert_eq!(o.min_src_cnt, 3);
        // one window aged (about 2 ms), the rest completed without waiting
        assert!(o.latency_max < Duration::from_millis(4), "{:?}", o.latency_max);
    }
    // the straggler finds every block gone or partial, never corrupts
    assert!(outcomes[3].iter().all(|o| o.min_src_cnt <= 3));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Float tensors (exponent rounds, lookahead exponents) with stragglers
    /// and loss: every allreduce completes, and the workers that got a
    /// block's result agree on it bit for bit.
    #[test]
    fn float_stragglers_complete_and_agree(
        workers in 2usize..=4,
        lens in proptest::collection::vec(1usize..=3_000, 1..=5),
        slots in 1u32..=8,
        loss in 0.0f64..=0.05,
        block_exp_ms in 1u32..=4,
        slow_after_windows in 0u32..=2,
        straggles in proptest::collection::vec(prop_oneof![Just(0u64), 1_000_000u64..=30_000_000], 5),
        seed in any::<u64>(),
    ) {
        let epp = 64u16;
        let mut cfg = Run::new(workers, 1, epp, slots, slots, net(loss, 0.01, 20_000), seed);
        cfg.block_exp_ms = block_exp_ms;
        cfg.slow_after_windows = slow_after_windows;
        cfg.delays = vec![Vec::new(); workers];
        cfg.delays[workers - 1] = straggles;
        let per_worker: Vec<Vec<Tensor>> = (0..workers)
            .map(|w| lens.iter().enumerate().map(|(k, &l)| Tensor::F32(float_inputs(workers, l, seed + k as u64)[w].clone())).collect())
            .collect();
        let outcomes = run_many(&cfg, per_worker);
        for k in 0..lens.len() {
            let blocks = lens[k].div_ceil(epp as usize);
            for b in 0..blocks {
                let range = b * epp as usize..((b + 1) * epp as usize).min(lens[k]);
                let mut seen: Option<Vec<u32>> = None;
                for o in &outcomes {
                    let o = &o[k];
                    if o.src_cnt_of(b as u32, workers as u16) == 0 { continue; }
                    let Tensor::F32(t) = &o.tensor else { panic!() };
                    let bits: Vec<u32> = t[range.clone()].iter().map(|x| x.to_bits()).collect();
                    match &seen { None => seen = Some(bits), Some(s) => prop_assert_eq!(s, &bits) }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Float stragglers, checked for what they sum (the test above checks
    /// only agreement): worker w sends `2^w * g[i]` (g small integers), so
    /// a result is exactly `mask * g[i]` for the set of workers it summed,
    /// well within every block's precision. The straggler (the last
    /// worker) has the largest values: if its data were added to a block
    /// whose exponent it took no part in (an aged exponent round, or a
    /// lookahead exponent announced without it), it would saturate, and
    /// the result would be no such sum. Flat, and in trees (every switch
    /// ages its own blocks; with loss this found a livelock, a relayed
    /// expiry nack without the block's generation).
    #[test]
    fn float_stragglers_sum_exactly_the_sources_they_count(
        workers in 2usize..=5,
        lens in proptest::collection::vec(1usize..=2_000, 1..=4),
        shape in 0u8..=5,
        slots in 1u32..=8,
        loss in 0.0f64..=0.05,
        block_exp_ms in 1u32..=4,
        straggles in proptest::collection::vec(prop_oneof![Just(0u64), 1_000_000u64..=30_000_000], 4),
        seed in any::<u64>(),
    ) {
        let epp = 64usize;
        let mut cfg = Run::new(workers, 1, epp as u16, slots, slots, net(loss, 0.01, 20_000), seed);
        if shape < 4 && workers >= 3 {
            (cfg.parents, cfg.attach) = tree_shape(shape); // (every leaf gets a worker)
        }
        cfg.block_exp_ms = block_exp_ms;
        cfg.delays = vec![Vec::new(); workers];
        cfg.delays[workers - 1] = straggles;
        let g = |k: usize, i: usize| (1 + (31 * i + 17 * k) % 97) as f32;
        let per_worker: Vec<Vec<Tensor>> = (0..workers)
            .map(|w| lens.iter().enumerate().map(|(k, &l)| Tensor::F32((0..l).map(|i| (1u32 << w) as f32 * g(k, i)).collect())).collect())
            .collect();
        let outcomes = run_many(&cfg, per_worker);
        for (k, &len) in lens.iter().enumerate() {
            for (w, o) in outcomes.iter().enumerate() {
                let o = &o[k];
                let Tensor::F32(t) = &o.tensor else { panic!("dtype") };
                for b in 0..len.div_ceil(epp) {
                    let cnt = o.src_cnt_of(b as u32, workers as u16);
                    if cnt == 0 {
                        continue; // missed (its elements are zeros, reported)
                    }
                    let range = b * epp..((b + 1) * epp).min(len);
                    let mask = (t[range.start] / g(k, range.start)).round() as u32;
                    for i in range {
                        prop_assert_eq!(t[i], mask as f32 * g(k, i), "worker {} allreduce {} element {}: not a sum of whole inputs", w, k, i);
                    }
                    prop_assert_eq!(mask.count_ones(), cnt as u32, "worker {} allreduce {} block {}: mask {:#b}", w, k, b, mask);
                    prop_assert!(mask < 1 << workers);
                }
            }
        }
    }
}

/// Tree shapes for the multi-level tests: `(parents, attach)`.
fn tree_shape(kind: u8) -> (Vec<Option<usize>>, Vec<usize>) {
    match kind {
        // root with two leaves
        0 => (vec![None, Some(0), Some(0)], vec![1, 2]),
        // three levels: root 0, middles 1 and 2, leaves 3, 4 (under 1) and 5 (under 2)
        1 => (vec![None, Some(0), Some(0), Some(1), Some(1), Some(2)], vec![3, 4, 5]),
        // mixed children: workers on the root, a middle and a leaf
        2 => (vec![None, Some(0), Some(1)], vec![0, 1, 2]),
        // a chain of three switches with every worker at the bottom
        _ => (vec![None, Some(0), Some(1)], vec![2]),
    }
}

/// A tree, a straggler and loss (found by
/// `float_stragglers_sum_exactly_the_sources_they_count`): the root aged a
/// block without the subtree of switches 2 and 5, whose partial reached it
/// after the slot had moved on; the root's BlockExpired went down to leaf 5,
/// whose relay of it to worker 2 was lost. Leaf 5 answered each of worker
/// 2's retransmissions with a BlockExpired of `gen_id` 0, which the worker
/// does not take for its allreduce's block: it retransmitted forever.
#[test]
fn tree_with_a_straggler_and_loss_tells_a_worker_its_block_expired() {
    let (workers, lens, slots, block_exp_ms, seed) = (4usize, vec![1581usize, 1119, 1444, 1575], 4u32, 1u32, 39322985913202081u64);
    let loss = 0.027995032984614567f64;
    let mut cfg = Run::new(workers, 1, 64, slots, slots, net(loss, 0.01, 20_000), seed);
    (cfg.parents, cfg.attach) = tree_shape(1); // root 0, middles 1 and 2, leaves 3, 4 (under 1), 5 (under 2)
    cfg.block_exp_ms = block_exp_ms;
    cfg.delays = vec![Vec::new(); workers];
    cfg.delays[workers - 1] = vec![0u64, 6050368, 0, 13646487]; // the last worker straggles in allreduces 2 and 4
    let inputs: Vec<Vec<Vec<i32>>> = (0..workers)
        .map(|w| lens.iter().map(|&l| (0..l).map(|i| ((1 + i % 97) << w) as i32).collect()).collect())
        .collect();
    let tensors = inputs.iter().map(|per| per.iter().cloned().map(Tensor::I32).collect()).collect();
    let outcomes = run_many(&cfg, tensors);
    let (_, missed) = check_straggler_run(&inputs, &outcomes, 64);
    assert!(missed > 0, "worker 2 records the expired block as missed");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Stragglers and loss, duplication and reordering on every hop of a
    /// tree (every switch ages its own blocks; a subtree that is late
    /// learns from its parent that the block expired, and tells its
    /// workers): every allreduce completes, and every block a worker has
    /// is the same exact sum of as many inputs as it counts.
    #[test]
    fn tree_stragglers_with_loss_never_stall_split_or_corrupt_results(
        workers in 3usize..=8, // every leaf of every shape gets a worker
        lens in proptest::collection::vec(1usize..=2_000, 1..=4),
        shape in 0u8..=3,
        shards in 1u16..=2,
        slots in 1u32..=8,
        loss in 0.0f64..=0.1,
        block_exp_ms in 1u32..=5,
        slow_after_windows in 0u32..=2,
        straggles in proptest::collection::vec(prop_oneof![Just(0u64), 1_000_000u64..=30_000_000], 4),
        seed in any::<u64>(),
    ) {
        let epp = 64u16;
        let mut cfg = Run::new(workers, shards, epp, slots, slots, net(loss, 0.02, 30_000), seed);
        (cfg.parents, cfg.attach) = tree_shape(shape);
        cfg.block_exp_ms = block_exp_ms;
        cfg.slow_after_windows = slow_after_windows;
        cfg.delays = vec![Vec::new(); workers];
        cfg.delays[workers - 1] = straggles;
        let inputs = straggler_inputs(workers, &lens, seed);
        let tensors = inputs.iter().map(|per| per.iter().cloned().map(Tensor::I32).collect()).collect();
        let outcomes = run_many(&cfg, tensors);
        check_straggler_run(&inputs, &outcomes, epp as usize);
    }
}


proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Multi-level aggregation with loss, duplication and reordering on
    /// every hop, switch to switch included: exact sums, no block degraded,
    /// nothing counted twice at any level.
    #[test]
    fn tree_int32_exact_under_loss_on_every_hop(
        workers in 3usize..=12, // every leaf of every shape gets a worker
        len in prop_oneof![1usize..=10, 1usize..=3_000],
        shape in 0u8..=3,
        shards in 1u16..=2,
        slots in 1u32..=8,
        loss in 0.0f64..=0.3,
        dup in 0.0f64..=0.1,
        seed in any::<u64>(),
    ) {
        let mut cfg = Run::new(workers, shards, 64, slots, slots, net(loss, dup, 40_000), seed);
        (cfg.parents, cfg.attach) = tree_shape(shape);
        let inputs = int_inputs(workers, len, seed);
        let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::I32).collect());
        check_int(&inputs, &outcomes);
        for o in &outcomes {
            prop_assert_eq!(o.min_src_cnt as usize, workers, "every block sums every worker");
        }
    }

    /// A tree whose stream crosses the wrap of its block ids (at M, a
    /// multiple of the slots): every switch starts a few blocks short of
    /// it, and each worker's allreduces run through it with loss,
    /// duplication and reordering on every hop; every sum exact, every
    /// block summed over every worker, at every level.
    #[test]
    fn tree_int32_exact_across_the_wrap_of_block_ids(
        workers in 3usize..=9,
        lens in proptest::collection::vec(1usize..=700, 2..=4),
        shape in 0u8..=3,
        shards in 1u16..=2,
        slots in 1u32..=8,
        short_of_wrap in 1u32..=40,
        loss in 0.0f64..=0.2,
        dup in 0.0f64..=0.1,
        seed in any::<u64>(),
    ) {
        let mut cfg = Run::new(workers, shards, 16, slots, slots, net(loss, dup, 40_000), seed);
        (cfg.parents, cfg.attach) = tree_shape(shape);
        let m = fanin_proto::serial::BlockSpace::new(slots).size();
        cfg.start_block = Some((m - short_of_wrap as u64) as u32);
        let inputs: Vec<Vec<Vec<i32>>> = lens.iter().enumerate().map(|(k, &len)| int_inputs(workers, len, seed ^ k as u64)).collect();
        let per_worker: Vec<Vec<Tensor>> = (0..workers).map(|w| inputs.iter().map(|call| Tensor::I32(call[w].clone())).collect()).collect();
        let outcomes = run_many(&cfg, per_worker);
        for (k, call) in inputs.iter().enumerate() {
            let of_call: Vec<Outcome> = outcomes.iter().map(|o| o[k].clone()).collect();
            check_int(call, &of_call);
            for o in &of_call {
                prop_assert_eq!(o.min_src_cnt as usize, workers, "every block sums every worker");
            }
        }
    }

    /// Reduce-scatter through a tree and through a flat switch, with loss,
    /// duplication and reordering: each worker's shard is exact (a child
    /// switch sends the results without data to its own members).
    #[test]
    fn reduce_scatter_int32_exact_under_loss_flat_and_in_trees(
        workers in 3usize..=12,
        len in prop_oneof![1usize..=10, 1usize..=3_000],
        shape in 0u8..=4,
        shards in 1u16..=2,
        slots in 1u32..=8,
        loss in 0.0f64..=0.3,
        dup in 0.0f64..=0.1,
        seed in any::<u64>(),
    ) {
        let mut cfg = Run::new(workers, shards, 64, slots, slots, net(loss, dup, 40_000), seed);
        if shape < 4 {
            (cfg.parents, cfg.attach) = tree_shape(shape);
        }
        cfg.scatter = true;
        let inputs = int_inputs(workers, len, seed);
        let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::I32).collect());
        check_int_shards(&inputs, &outcomes);
    }

    /// 16-bit lanes through a tree: a child's partial sum goes up in int16
    /// lanes and the root's result comes down in them.
    #[test]
    fn tree_float16_within_bound_under_loss(
        workers in 3usize..=8,
        len in 1usize..=3_000,
        shape in 0u8..=3,
        slots in 1u32..=8,
        loss in 0.0f64..=0.2,
        bf16 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let kind = if bf16 { Half::BF16 } else { Half::F16 };
        let mut cfg = Run::new(workers, 2, 64, slots, slots, net(loss, 0.05, 40_000), seed);
        (cfg.parents, cfg.attach) = tree_shape(shape);
        let inputs = half_inputs(kind, workers, len, seed);
        let outcomes = run(&cfg, inputs.iter().map(|v| Tensor::Half(kind, v.clone())).collect());
        check_half(kind, &inputs, &outcomes, 64);
    }

    /// Float blocks negotiate their exponent through the tree (exponent
    /// rounds go up and come down, lookahead exponents ride on results).
    #[test]
    fn tree_float32_within_bound_under_loss(
        workers in 3usize..=8,
        len in 1usize..=3_000,
        shape in 0u8..=3,
        slots in 1u32..=8,
        loss in 0.0f64..=0.2,
        seed in any::<u64>(),
    ) {
        let mut cfg = Run::new(workers, 2, 64, slots, slots, net(loss, 0.05, 40_000), seed);
        (cfg.parents, cfg.attach) = tree_shape(shape);
        let inputs = float_inputs(workers, len, seed);
        let outcomes = run(&cfg, inputs.iter().cloned().map(Tensor::F32).collect());
        check_float(&inputs, &outcomes, 64);
    }
}


/// One run of [`tree_restart_run`].
#[derive(Clone, Copy, Debug)]
struct RestartCase {
    workers: usize,
    /// [`tree_shape`]
    shape: u8,
    shards: u16,
    /// The switch that restarts (modulo the switch count)...
    victim: usize,
    /// ...with every switch whose bit is set here, at the same time.
    also: u8,
    at_ns: u64,
    loss: f64,
    float: bool,
    /// [`Run::restart_in_last`]
    in_last: bool,
    /// [`Run::linger`]
    linger: bool,
    /// [`Run::deaf_until_restart`]: worker `seed % workers` lacks the
    /// results of the run's last this-many blocks until the restart (0:
    /// none).
    deaf_tail: u32,
    seed: u64,
}

impl RestartCase {
    fn new(workers: usize, shape: u8, shards: u16, victim: usize, at_ns: u64, loss: f64, seed: u64) -> Self {
        RestartCase { workers, shape, shards, victim, also: 0, at_ns, loss, float: false, in_last: false, linger: false, deaf_tail: 0, seed }
    }
}

/// A switch of a tree restarted mid-run, every tree shape, under loss: the
/// workers below it recover (docs/restart.md), and a switch whose parent
/// restarted takes part in the parent's recovery for its whole subtree.
/// Every int32 result is the exact sum of every worker, every float32 one
/// within the block floating-point bound and the same on every worker.
/// Returns how many restarts each worker recovered from.
fn tree_restart_run(case: RestartCase) -> Vec<u32> {
    let RestartCase { workers, shape, shards, victim, also, at_ns, loss, float, in_last, linger, deaf_tail, seed } = case;
    let mut cfg = Run::new(workers, shards, 64, 8, 8, net(loss, 0.01, 20_000), seed);
    (cfg.parents, cfg.attach) = tree_shape(shape);
    let n = cfg.parents.len();
    let victims: Vec<usize> = (0..n).filter(|&i| i == victim % n || also >> i & 1 == 1).collect();
    cfg.restart = Some((victims, at_ns));
    cfg.restart_in_last = in_last || linger;
    cfg.linger = linger;
    cfg.complete_only = true;
    let lens = [3_000usize, 2_000, 3_000, 1_000, 2_500];
    if deaf_tail > 0 {
        // (within the last allreduce, and within the window: the others'
        // last blocks need this worker's contributions, which it sends
        // only while its window allows)
        let blocks: usize = lens.iter().map(|n| n.div_ceil(64)).sum();
        cfg.deaf_until_restart = Some((seed as usize % workers, (blocks - deaf_tail as usize) as u32));
    }
    let case = format!("{case:?}");
    let outcomes = if float {
        let inputs: Vec<Vec<Vec<f32>>> = lens.iter().enumerate().map(|(k, &len)| float_inputs(workers, len, seed ^ k as u64)).collect();
        let outcomes = run_many(&cfg, (0..workers).map(|w| inputs.iter().map(|call| Tensor::F32(call[w].clone())).collect()).collect());
        for (k, call) in inputs.iter().enumerate() {
            check_float(call, &outcomes.iter().map(|o| o[k].clone()).collect::<Vec<_>>(), 64);
        }
        outcomes
    } else {
        let inputs: Vec<Vec<Vec<i32>>> = lens.iter().enumerate().map(|(k, &len)| int_inputs(workers, len, seed ^ k as u64)).collect();
        let outcomes = run_many(&cfg, (0..workers).map(|w| inputs.iter().map(|call| Tensor::I32(call[w].clone())).collect()).collect());
        for (k, call) in inputs.iter().enumerate() {
            let want: Vec<i32> = (0..call[0].len()).map(|i| call.iter().fold(0i32, |a, v| a.wrapping_add(v[i]))).collect();
            for (w, o) in outcomes.iter().enumerate() {
                let Tensor::I32(got) = &o[k].tensor else { panic!("dtype") };
                if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                    let b = (i / 64) as u32;
                    panic!("worker {w} allreduce {k} element {i} (block {b}, src_cnt {}): {} != {}; {case}", o[k].src_cnt_of(b, workers as u16), got[i], want[i]);
                }
            }
        }
        outcomes
    };
    for (w, per) in outcomes.iter().enumerate() {
        for (k, o) in per.iter().enumerate() {
            assert_eq!(o.min_src_cnt as usize, workers, "worker {w} allreduce {k}: every block sums every worker; {case}");
        }
    }
    outcomes.iter().map(|o| o.iter().map(|x| x.recoveries).sum()).collect()
}

/// The case docs/restart.md left open: a root with a worker of its own
/// and a child switch (worker 0 on the root, worker 1 on the middle switch,
/// worker 2 on the leaf) restarts mid-run. Its recovery floor waits for a
/// recovery Join from every member, the child switch included.
#[test]
fn a_root_with_workers_and_child_switches_recovers_from_its_restart() {
    for at_us in [100, 300, 600, 1200, 2400] {
        let recovered = tree_restart_run(RestartCase { in_last: true, ..RestartCase::new(3, 2, 1, 0, at_us * 1_000, 0.0, 5) });
        assert_eq!(recovered, [1, 1, 1], "restart at {at_us} µs: every worker recovered once, the child switches' too");
    }
}

proptest! {
    // TREE_RESTART_CASES=20000 for a longer hunt
    #![proptest_config(ProptestConfig {
        cases: std::env::var("TREE_RESTART_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(48),
        ..ProptestConfig::default()
    })]

    /// Any switch of any tree shape (or several at once) restarts at a
    /// random point of a run of five allreduces (int32, or float32:
    /// exponent rounds go up and come down through the restarted tree, and
    /// the retained contributions carry the exponents the earlier life
    /// negotiated), with loss, duplication and reordering on every hop.
    #[test]
    fn a_tree_recovers_exactly_from_any_switch_restarted_at_any_point(
        shape in 0u8..=3,
        workers in 3usize..=6,
        shards in 1u16..=2,
        victim in 0usize..6,
        // other switches restarted at the same time: none in half the cases
        also in prop_oneof![Just(0u8), 0u8..64],
        at_us in 20u64..2_500,
        loss in 0.0f64..=0.05,
        float in any::<bool>(),
        seed in any::<u64>(),
    ) {
        tree_restart_run(RestartCase { also, float, ..RestartCase::new(workers, shape, shards, victim, at_us * 1_000, loss, seed) });
    }

    /// The same with the workers that finished lingering, one worker deaf
    /// to the results of the run's last blocks until the restart (so the
    /// others finish before it), and restarts also while some worker runs
    /// its last allreduce or has finished it: no case left out.
    /// A subtree whose workers all finished takes part through its switch,
    /// which probes its parent when its members probe it.
    #[test]
    fn a_tree_recovers_exactly_from_any_restart_when_finished_workers_linger(
        shape in 0u8..=3,
        workers in 3usize..=6,
        shards in 1u16..=2,
        victim in 0usize..6,
        also in prop_oneof![Just(0u8), 0u8..64],
        at_us in 20u64..4_000,
        loss in prop_oneof![Just(0.0), 0.0f64..=0.05],
        float in any::<bool>(),
        deaf_tail in 0u32..=8,
        seed in any::<u64>(),
    ) {
        // (under loss congestion control may cut the window to one block:
        // only the last result can be missing while the others finish)
        let deaf_tail = if loss > 0.0 { deaf_tail.min(1) } else { deaf_tail };
        let case = RestartCase { also, float, linger: true, deaf_tail, ..RestartCase::new(workers, shape, shards, victim, at_us * 1_000, loss, seed) };
        tree_restart_run(case);
    }
}

/// A root whose members are child switches alone restarts while one of
/// its results was lost on the way to one child only (found by the
/// property test above): the other child moved on and opened the slot's
/// next block at the fresh root, so the lagging child's block was answered
/// as expired and its workers missed it. The children now take part in
/// the restarted root's recovery floor and resend from it.
#[test]
fn a_restarted_root_of_switches_alone_recovers_a_result_lost_to_one_child() {
    assert_eq!(tree_restart_run(RestartCase::new(3, 0, 1, 3, 648_000, 0.03960679137949959, 14779726376318474318)), [1, 1, 1]);
}

/// An inner switch with a worker and a child switch restarts (found by the
/// property test above): the root's result of a block, earned by the
/// partial the inner switch's earlier life sent, reached the new life
/// while it collected that block again, and went down marked degraded
/// (its new record lacked members), failing a job that takes complete
/// results only. Such a result is now left alone: the block completes here
/// and its partial finds the parent's result.
#[test]
fn a_restarted_inner_switch_never_marks_a_result_its_earlier_life_earned_degraded() {
    tree_restart_run(RestartCase::new(3, 2, 1, 4, 1_770_000, 0.04848202200553471, 209143326722343532));
}

/// The root restarts during the last allreduce, its last results on their
/// way down (found by the property test above): one leaf restarted its
/// stream on the root's refusal and dropped its blocks, losing the results
/// that reached it after that, while the other leaf relayed them and its
/// worker finished its last allreduce. That worker never reported again,
/// and the first leaf's workers waited for the floor until they failed. A
/// leaf now keeps its blocks until the floor comes and hands the earlier
/// root's results down under its earlier tag.
#[test]
fn a_subtree_done_on_the_earlier_roots_last_results_does_not_strand_the_others() {
    assert_eq!(tree_restart_run(RestartCase { float: true, in_last: true, ..RestartCase::new(3, 0, 2, 0, 2_165_000, 0.0, 8613170313969113347) }), [0, 0, 0]);
}


/// The root and one leaf restart while the workers of the other leaf have
/// all finished their last allreduce and one worker still lacks results of
/// it (found by the property test above with the probe up disabled). The
/// finished workers linger, but they probe their leaf, which did not
/// restart; the restarted root waits for that leaf's report and knows no
/// address to ask. The leaf now passes its members' probes up as a probe
/// of its own, the root answers it StaleIncarnation, and the subtree
/// restarts its stream and reports like any.
#[test]
fn a_subtree_whose_workers_all_finished_takes_part_through_its_switchs_probe() {
    let case = RestartCase { also: 4, linger: true, deaf_tail: 1, ..RestartCase::new(3, 0, 1, 3, 2_166_000, 0.0, 17482755878699043244) };
    // worker 1 (on the restarted leaf 2, deaf to its last result) recovers
    // within its last allreduce from both restarts; workers 0 and 2 (on
    // leaf 1) had finished and took part lingering, which no outcome counts
    assert_eq!(tree_restart_run(case), [0, 2, 0]);
}
