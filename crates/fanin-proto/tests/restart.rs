//! Switch restart (docs/restart.md): workers and a switch shard exchange
//! datagrams over an in-memory network; at some point the switch is replaced
//! by a fresh one (new incarnation, job re-admitted, no blocks). Every
//! allreduce must still end with the exact result, in bounded time, and no
//! worker may use a result of one incarnation for a block it contributed to
//! another.

use std::collections::VecDeque;
use std::time::Duration;

use fanin_proto::fault::SplitMix64;
use fanin_proto::host::{AllreduceSession, Event, Outcome, Prepared, SessionConfig, Tensor, TensorMut};
use fanin_proto::switch::{ShardConfig, ValueSwitch};
use fanin_proto::{JobSpec, Time, VecTransmit};
use fanin_wire::value::{Packet, JOIN_RECOVER};
use fanin_wire::MessageType;
use proptest::prelude::*;

const LATENCY: Duration = Duration::from_micros(20);

#[derive(Clone, Copy, Debug, PartialEq)]
enum To {
    Switch(usize),
    Worker(usize),
}

struct Net {
    spec: JobSpec,
    sw: ValueSwitch<usize>,
    ws: Vec<AllreduceSession>,
    /// Tensors each worker still has to reduce, in order.
    todo: Vec<VecDeque<Tensor>>,
    done: Vec<Vec<Outcome>>,
    /// When each outcome in `done` arrived.
    done_at: Vec<Vec<Time>>,
    now: Time,
    /// (delivery time, destination, datagram), unordered.
    wire: Vec<(Time, To, Vec<u8>)>,
    rng: SplitMix64,
    loss: f64,
    /// Results of blocks at or above this id to the worker are lost (to
    /// make it fall behind).
    deaf: Vec<Option<u32>>,
    /// The switch is down: datagrams to it vanish.
    down: bool,
    /// What the workers lend their sessions.
    lend: Lend,
    /// Each worker's lent output for its running allreduce (the heap
    /// buffer stays put while the `Tensor` moves).
    outs: Vec<Option<Tensor>>,
    /// Each worker's lent input for its running allreduce (`Lend::Both`).
    ins: Vec<Option<Tensor>>,
    /// Record a worker's failure here instead of panicking (tests where
    /// raising is a correct outcome).
    failures: Option<Vec<Vec<String>>>,
    /// Workers whose sessions are not driven (a process between two
    /// allreduces: nothing reads its socket or fires its timers).
    paused: Vec<bool>,
    /// A worker that has no allreduce left lingers (`set_lingering`): its
    /// driver keeps it taking part in a restart, as the torch backend does
    /// until every rank is done.
    linger: bool,
}

/// How the workers hold their tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lend {
    /// Sessions own the input; results overwrite it.
    Nothing,
    /// Sums go to lent output buffers (`begin_into`), so retained
    /// contributions are emitted from the intact input the session owns.
    Output,
    /// The input is borrowed too (`Prepared::borrow`): retained
    /// contributions are emitted from the caller's memory.
    Both,
}

fn spec(workers: u16, slots: u32) -> JobSpec {
    JobSpec::with_sources(1, workers, slots, 64)
}

fn switch(spec: &JobSpec, incarnation: u32) -> ValueSwitch<usize> {
    let mut sw = ValueSwitch::new(ShardConfig { incarnation, ..ShardConfig::single(64 << 20) });
    sw.add_job(spec.clone()).unwrap();
    sw
}

impl Net {
    fn new(workers: usize, slots: u32, window: u32, epp: u16, loss: f64, seed: u64) -> Self {
        let spec = spec(workers as u16, slots);
        let ws = (0..workers)
            .map(|w| {
                let mut cfg = SessionConfig::new(1, w as u16);
                cfg.elems_per_packet = epp;
                cfg.window = window;
                AllreduceSession::new(cfg, Time::ZERO)
            })
            .collect();
        let mut net = Net {
            sw: switch(&spec, 1),
            spec,
            ws,
            todo: vec![VecDeque::new(); workers],
            done: vec![Vec::new(); workers],
            done_at: vec![Vec::new(); workers],
            now: Time::ZERO,
            wire: Vec::new(),
            rng: SplitMix64::new(seed),
            loss,
            deaf: vec![None; workers],
            down: false,
            lend: Lend::Nothing,
            outs: vec![None; workers],
            ins: vec![None; workers],
            failures: None,
            paused: vec![false; workers],
            linger: false,
        };
        // join without loss
        let loss = std::mem::replace(&mut net.loss, 0.0);
        while net.ws.iter().any(|w| !w.is_ready()) {
            net.step();
        }
        net.loss = loss;
        net
    }

    fn send(&mut self, to: To, bytes: Vec<u8>) {
        if self.loss > 0.0 && self.rng.next_f64() < self.loss {
            return;
        }
        // a little jitter reorders datagrams
        let jitter = Duration::from_nanos(self.rng.below(10_000));
        self.wire.push((self.now + LATENCY + jitter, to, bytes));
    }

    /// Deliver everything due, fire timers, start the next allreduce of a
    /// worker that finished one, transmit; advance the clock to the next
    /// event. False once nothing is left to happen.
    ///
    /// Transmitting last matters: a result can open the window (or end an
    /// allreduce) when nothing else is scheduled, and what it lets out must
    /// go now, as the runtime sends after every datagram it handles, not at
    /// the next timer (which may be the 10 s silence limit).
    fn step(&mut self) -> bool {
        // deliver what is due
        let now = self.now;
        let due: Vec<_> = {
            let (due, later): (Vec<_>, Vec<_>) = self.wire.drain(..).partition(|(t, _, _)| *t <= now);
            self.wire = later;
            due
        };
        for (t, to, bytes) in due {
            if let To::Worker(w) = to {
                if self.paused[w] {
                    self.wire.push((t, to, bytes)); // waits in its socket
                    continue;
                }
            }
            match to {
                To::Switch(from) => {
                    if self.down {
                        continue;
                    }
                    let mut out = VecTransmit::new();
                    let _ = self.sw.handle_datagram(self.now, from, &bytes, &mut out);
                    for (dest, b) in out.drain() {
                        // data results only: exponent rounds still finish
                        let is_result = b[3] == MessageType::Result as u8 && b[4] & 0x02 == 0;
                        let block = Packet::new_checked(&b[..]).map_or(0, |p| p.block_id());
                        if !(is_result && self.deaf[dest].is_some_and(|x| block >= x)) {
                            self.send(To::Worker(dest), b);
                        }
                    }
                }
                To::Worker(w) => self.ws[w].handle_datagram(self.now, &bytes),
            }
        }
        for w in 0..self.ws.len() {
            if self.paused[w] {
                continue;
            }
            if self.ws[w].poll_timeout().is_some_and(|t| t <= self.now) {
                self.ws[w].handle_timeout(self.now);
            }
            while let Some(ev) = self.ws[w].poll_event() {
                match ev {
                    Event::Completed(mut o) => {
                        if let Some(sum) = self.outs[w].take() {
                            o.tensor = sum; // the handed-back input is not the result
                        }
                        self.ins[w] = None; // released by the session
                        self.done[w].push(o);
                        self.done_at[w].push(self.now);
                    }
                    Event::Failed(e) if self.failures.is_some() => {
                        self.failures.as_mut().unwrap()[w].push(e.to_string());
                    }
                    Event::Failed(e) => panic!(
                        "worker {w} failed at {:?}: {e}; recovering {:?}, retained {:?}",
                        self.now,
                        self.ws.iter().map(|w| w.recovering()).collect::<Vec<_>>(),
                        self.ws.iter().map(|w| w.retained_blocks()).collect::<Vec<_>>()
                    ),
                    Event::Joined(_) | Event::Membership { .. } => {}
                }
            }
            if self.linger && self.ws[w].is_ready() && self.todo[w].is_empty() && !self.ws[w].lingering() {
                self.ws[w].set_lingering(self.now, true);
            }
            if self.ws[w].is_ready() {
                if let Some(t) = self.todo[w].pop_front() {
                    if self.lend != Lend::Nothing {
                        let out = self.outs[w].insert(match &t {
                            Tensor::I32(v) => Tensor::I32(vec![i32::MIN; v.len()]),
                            Tensor::F32(v) => Tensor::F32(vec![f32::NAN; v.len()]),
                            Tensor::Half(kind, v) => Tensor::Half(*kind, vec![0x7e00; v.len()]),
                        });
                        let out = match out {
                            Tensor::I32(v) => TensorMut::I32(v),
                            Tensor::F32(v) => TensorMut::F32(v),
                            Tensor::Half(kind, v) => TensorMut::Half(*kind, v),
                        };
                        let per = self.ws[w].config().elems_per_packet as usize;
                        let prepared = if self.lend == Lend::Both {
                            Prepared::borrow(self.ins[w].insert(t).view(), per).unwrap()
                        } else {
                            Prepared::new(t, per).unwrap()
                        };
                        // SAFETY: the buffers live in `outs[w]` and `ins[w]`
                        // (their heap memory does not move) until the
                        // allreduce completed, and the output is read only
                        // then; a failure panics the test.
                        unsafe { self.ws[w].begin_into(self.now, prepared, out) }.unwrap();
                    } else {
                        self.ws[w].begin(self.now, t).unwrap();
                    }
                }
            }
            let mut out = VecTransmit::new();
            while self.ws[w].poll_transmit(self.now, &mut out) > 0 {}
            for (_, bytes) in out.drain() {
                self.send(To::Switch(w), bytes);
            }
        }
        // the next event
        let next_wire = self.wire.iter().filter(|(_, to, _)| !matches!(to, To::Worker(w) if self.paused[*w])).map(|(t, _, _)| *t).min();
        let next_timer = self.ws.iter().zip(&self.paused).filter(|(_, p)| !**p).filter_map(|(w, _)| w.poll_timeout()).min();
        let busy = self.ws.iter().any(|w| !w.is_ready())
            || self.todo.iter().any(|t| !t.is_empty())
            || self.ws.iter().any(|w| w.lingering() && !w.all_done());
        let next = match next_wire.into_iter().chain(next_timer).min() {
            Some(t) => t,
            None => return false,
        };
        if !busy && next_wire.is_none() {
            return false;
        }
        self.now = next.max(self.now + Duration::from_nanos(1));
        true
    }

    /// Replace the switch by a fresh one: new incarnation, the job
    /// re-admitted (as `--job` does at start), no blocks.
    fn restart(&mut self, incarnation: u32) {
        self.sw = switch(&self.spec, incarnation);
    }

    fn run_until(&mut self, deadline: Duration, mut stop: impl FnMut(&Net) -> bool) {
        let mut steps = 0u64;
        while !stop(self) {
            steps += 1;
            assert!(steps < 1_000_000, "busy at {:?}: timers {:?}", self.now, self.ws.iter().map(|w| w.poll_timeout()).collect::<Vec<_>>());
            assert!(self.now.as_nanos() < deadline.as_nanos() as u64, "no progress by {deadline:?}");
            if !self.step() {
                break;
            }
        }
    }

    fn stale_incarnation_count(&self) -> u64 {
        self.sw.counters().stale_incarnation
    }

    fn all_done(&self, ops: usize) -> bool {
        self.done.iter().all(|d| d.len() == ops)
    }
}

fn int_tensors(workers: usize, lens: &[usize], seed: u64) -> Vec<Vec<Vec<i32>>> {
    let mut rng = SplitMix64::new(seed);
    (0..workers)
        .map(|_| lens.iter().map(|&n| (0..n).map(|_| rng.below(2001) as i32 - 1000).collect()).collect())
        .collect()
}

/// Quarters of small integers: every sum is exact in block floating point
/// and in float32, so the reference is the plain sum.
fn float_tensors(workers: usize, lens: &[usize], seed: u64) -> Vec<Vec<Vec<f32>>> {
    int_tensors(workers, lens, seed).into_iter().map(|w| w.into_iter().map(|t| t.into_iter().map(|x| x as f32 / 4.0).collect()).collect()).collect()
}

fn check_int(inputs: &[Vec<Vec<i32>>], done: &[Vec<Outcome>]) {
    for (op, _) in inputs[0].iter().enumerate() {
        let len = inputs[0][op].len();
        let want: Vec<i32> = (0..len).map(|i| inputs.iter().map(|w| w[op][i]).fold(0i32, i32::wrapping_add)).collect();
        for (w, d) in done.iter().enumerate() {
            assert_eq!(d[op].tensor, Tensor::I32(want.clone()), "worker {w}, allreduce {op}");
            assert!(d[op].degraded_blocks.is_empty(), "worker {w}, allreduce {op}: {:?}", d[op].degraded_blocks);
        }
    }
}

fn check_float(inputs: &[Vec<Vec<f32>>], done: &[Vec<Outcome>]) {
    for (op, _) in inputs[0].iter().enumerate() {
        let len = inputs[0][op].len();
        let want: Vec<f32> = (0..len).map(|i| inputs.iter().map(|w| w[op][i]).sum()).collect();
        for (w, d) in done.iter().enumerate() {
            assert_eq!(d[op].tensor, Tensor::F32(want.clone()), "worker {w}, allreduce {op}");
        }
    }
}

fn load_int(net: &mut Net, inputs: &[Vec<Vec<i32>>]) {
    for (w, ops) in inputs.iter().enumerate() {
        net.todo[w] = ops.iter().map(|t| Tensor::I32(t.clone())).collect();
    }
}

fn load_float(net: &mut Net, inputs: &[Vec<Vec<f32>>]) {
    for (w, ops) in inputs.iter().enumerate() {
        net.todo[w] = ops.iter().map(|t| Tensor::F32(t.clone())).collect();
    }
}

/// The worst case of the retained set: worker 0 got every result of the
/// first allreduce and runs a full window (S = 4 blocks) into the second;
/// worker 1 lacks the last four results of the first. The restarted switch
/// must recompute those four from worker 0's retained contributions.
fn worst_case(float: bool, lend: Lend) {
    let lens = [6usize, 6, 6];
    let mut net = Net::new(2, 4, 4, 1, 0.0, 7);
    net.lend = lend;
    let (ints, floats) = (int_tensors(2, &lens, 1), float_tensors(2, &lens, 1));
    if float {
        load_float(&mut net, &floats);
    } else {
        load_int(&mut net, &ints);
    }
    // worker 1 hears results of blocks 0 and 1 only ...
    net.deaf[1] = Some(2);
    // ... while worker 0 finishes the first allreduce and sends blocks 6..9
    // of the second
    net.run_until(Duration::from_secs(1), |n| n.done[0].len() == 1);
    let t = net.now + Duration::from_millis(1);
    net.run_until(Duration::from_secs(1), |n| n.now >= t);
    assert!(net.done[1].is_empty(), "worker 1 must lack results");
    assert_eq!(net.ws[0].retained_blocks(), vec![2, 3, 4, 5], "one window behind worker 0's lowest block without a result");
    let restart_at = net.now;
    net.restart(3);
    net.deaf[1] = None;
    net.run_until(Duration::from_secs(10), |n| n.all_done(lens.len()));
    if float {
        check_float(&floats, &net.done);
    } else {
        check_int(&ints, &net.done);
    }
    let recovered = net.done.iter().flatten().filter(|o| o.recoveries > 0).count();
    assert!(recovered >= 2, "both workers recovered within an allreduce ({recovered})");
    assert_eq!(net.sw.counters().recoveries, 1);
    assert!(net.sw.counters().stale_incarnation > 0, "old-incarnation contributions were refused");
    // bounded: detection takes at most a few (backed-off) RTOs
    let took = net.now.saturating_since(restart_at);
    assert!(took < Duration::from_secs(2), "recovery took {took:?}");
}

#[test]
fn worst_case_fast_worker_a_full_window_ahead_across_an_allreduce_boundary_int32() {
    worst_case(false, Lend::Nothing);
}

/// The same with lent outputs: worker 0's retained blocks of the first
/// allreduce were emitted from its input when that allreduce ended.
#[test]
fn worst_case_with_lent_outputs_int32() {
    worst_case(false, Lend::Output);
}

#[test]
fn worst_case_with_lent_outputs_float32() {
    worst_case(true, Lend::Output);
}

/// And with the input borrowed as well: emitted from the caller's memory.
#[test]
fn worst_case_with_lent_inputs_and_outputs_int32() {
    worst_case(false, Lend::Both);
}

#[test]
fn worst_case_with_lent_inputs_and_outputs_float32() {
    worst_case(true, Lend::Both);
}

#[test]
fn worst_case_fast_worker_a_full_window_ahead_across_an_allreduce_boundary_float32() {
    worst_case(true, Lend::Nothing);
}

#[test]
fn a_result_from_another_incarnation_is_never_used() {
    let mut net = Net::new(1, 4, 4, 2, 0.0, 1);
    net.ws[0].begin(net.now, Tensor::I32(vec![5, 6])).unwrap();
    let mut out = VecTransmit::new();
    net.ws[0].poll_transmit(net.now, &mut out);
    let (_, contribution) = out.drain().next().unwrap();
    // the same block's result, from incarnation 3 (another switch life)
    let mut other = switch(&net.spec, 3);
    let mut tagged = contribution.clone();
    tagged[8..10].copy_from_slice(&3u16.to_be_bytes());
    let mut replies = VecTransmit::new();
    let _ = other.handle_datagram(net.now, 0, &tagged, &mut replies);
    let (_, foreign) = replies.drain().next().unwrap();
    assert_eq!(Packet::new_checked(&foreign[..]).unwrap().src_id(), 3, "results carry the incarnation tag");
    net.ws[0].handle_datagram(net.now, &foreign);
    assert!(net.ws[0].poll_event().is_none(), "a result of incarnation 3 was used by a worker bound to 1");
    // the bound incarnation's own result is used
    let _ = net.sw.handle_datagram(net.now, 0, &contribution, &mut replies);
    let (_, own) = replies.drain().next().unwrap();
    net.ws[0].handle_datagram(net.now, &own);
    assert!(matches!(net.ws[0].poll_event(), Some(Event::Completed(o)) if o.tensor == Tensor::I32(vec![5, 6])));
}

#[test]
fn a_stale_contribution_is_refused_and_the_worker_reports_its_lowest_block_to_recover() {
    let mut net = Net::new(2, 4, 4, 1, 0.0, 1);
    net.ws[0].begin(net.now, Tensor::I32(vec![1, 2, 3])).unwrap();
    let mut out = VecTransmit::new();
    net.ws[0].poll_transmit(net.now, &mut out);
    let sent: Vec<_> = out.drain().collect();
    assert_eq!(sent.len(), 3);
    net.restart(5);
    let mut replies = VecTransmit::new();
    let _ = net.sw.handle_datagram(net.now, 0, &sent[0].1, &mut replies);
    assert_eq!(net.sw.counters().stale_incarnation, 1);
    assert_eq!(net.sw.counters().accepted, 0, "never aggregated");
    let (_, nack) = replies.drain().next().unwrap();
    net.ws[0].handle_datagram(net.now, &nack);
    assert!(net.ws[0].recovering());
    // it now sends only recovery joins, naming block 0 (no result yet)
    let mut out = VecTransmit::new();
    net.ws[0].poll_transmit(net.now, &mut out);
    let sent: Vec<_> = out.drain().collect();
    assert_eq!(sent.len(), 1);
    let p = Packet::new_checked(&sent[0].1[..]).unwrap();
    assert_eq!((p.msg_type_code(), p.age_op(), p.block_id()), (MessageType::Join as u8, JOIN_RECOVER, 0));
    // the switch waits for every member before answering
    let _ = net.sw.handle_datagram(net.now, 0, &sent[0].1, &mut replies);
    assert!(replies.is_empty());
    assert_eq!(net.sw.counters().recover_waiting, 1);
}

#[test]
fn recovery_fails_cleanly_when_a_member_never_rejoins() {
    let mut net = Net::new(2, 4, 4, 1, 0.0, 1);
    net.todo[0].push_back(Tensor::I32(vec![1, 2, 3]));
    net.restart(5);
    // worker 1 never starts the allreduce, so it never recovers
    let mut failed = None;
    for _ in 0..100_000 {
        let w = &mut net.ws[0];
        if w.is_ready() {
            if let Some(t) = net.todo[0].pop_front() {
                w.begin(net.now, t).unwrap();
            }
        }
        let mut out = VecTransmit::new();
        while w.poll_transmit(net.now, &mut out) > 0 {}
        for (_, b) in out.drain() {
            let mut r = VecTransmit::new();
            let _ = net.sw.handle_datagram(net.now, 0, &b, &mut r);
            for (_, reply) in r.drain() {
                w.handle_datagram(net.now, &reply);
            }
        }
        if let Some(Event::Failed(e)) = w.poll_event() {
            failed = Some((e, net.now));
            break;
        }
        net.now = w.poll_timeout().unwrap();
        w.handle_timeout(net.now);
    }
    let (e, at) = failed.expect("must fail, not hang");
    assert!(e.to_string().contains("recovery did not finish"), "{e}");
    assert!(at.as_nanos() <= (net.ws[0].config().dead_after + Duration::from_secs(1)).as_nanos() as u64);
}

/// A fresh `loaded()` network run to `at` (0..1) of the steps the same run
/// without a restart takes until a worker finished its last of `ops`
/// allreduces: a restart there happens before any worker stopped calling
/// allreduce (one that stopped cannot take part in a recovery,
/// docs/restart.md; `recovery_fails_cleanly_when_a_member_never_rejoins`
/// covers that).
fn at_fraction(loaded: impl Fn() -> Net, ops: usize, at: f64) -> Net {
    let mut net = loaded();
    let mut total = 0u64;
    net.run_until(Duration::from_secs(300), |n| {
        total += 1;
        n.done.iter().any(|d| d.len() == ops)
    });
    let stop_after = (total as f64 * at) as u64;
    let mut net = loaded();
    let mut steps = 0;
    net.run_until(Duration::from_secs(300), |_| {
        steps += 1;
        steps > stop_after
    });
    net
}

/// False if the case does not apply: a worker finished its last allreduce
/// before the switch came back and does not `linger` (it stopped calling
/// allreduce, so it cannot take part in a recovery;
/// `recovery_fails_cleanly_when_a_member_never_rejoins`).
#[allow(clippy::too_many_arguments)]
fn restart_run(
    workers: usize,
    lens: &[usize],
    float: bool,
    lend: Lend,
    loss: f64,
    restart_at: f64,
    seed: u64,
    linger: bool,
    deaf_tail: Option<u32>,
) -> bool {
    let (ints, floats) = (int_tensors(workers, lens, seed), float_tensors(workers, lens, seed));
    let loaded = || {
        let mut net = Net::new(workers, 4, 4, 4, loss, seed);
        net.lend = lend;
        net.linger = linger;
        if let Some(k) = deaf_tail {
            // One worker hears no result of the last k blocks of the run
            // until the restart: the others can finish before it. (Under
            // loss only the last: congestion control may cut its window
            // to 1, and then it sends no block past the first it lacks.)
            // Within the last allreduce: it starts one only once it has
            // every result of the one before.
            let k = if loss > 0.0 { 1 } else { k.min(lens[lens.len() - 1].div_ceil(4) as u32) };
            let blocks: usize = lens.iter().map(|n| n.div_ceil(4)).sum();
            net.deaf[seed as usize % workers] = Some(blocks.saturating_sub(k as usize) as u32);
        }
        if float {
            load_float(&mut net, &floats);
        } else {
            load_int(&mut net, &ints);
        }
        net
    };
    let mut net = at_fraction(loaded, lens.len(), restart_at);
    // the switch dies for a while, then comes back empty
    net.down = true;
    let t = net.now + Duration::from_millis(30);
    // a deadline relative to now: with loss, reaching a late restart
    // point can itself take more than 30 simulated seconds
    let deadline = Duration::from_nanos(net.now.as_nanos()) + Duration::from_secs(30);
    net.run_until(deadline, |n| n.now >= t);
    if !linger && net.done.iter().any(|d| d.len() == lens.len()) && !net.all_done(lens.len()) {
        return false;
    }
    net.restart(0x1234_5677);
    net.down = false;
    net.deaf.fill(None);
    let restarted = net.now;
    // every worker rebinds (detection and the floor) within a few RTOs ...
    let mut rebound = None;
    let until = Duration::from_nanos(net.now.as_nanos()) + Duration::from_secs(300);
    net.run_until(until, |n| {
        let bound = n.ws.iter().all(|w| w.params().is_some_and(|p| p.incarnation == 0x1234_5677));
        if bound && rebound.is_none() {
            rebound = Some(n.now);
        }
        n.all_done(lens.len())
    });
    if float {
        check_float(&floats, &net.done);
    } else {
        check_int(&ints, &net.done);
    }
    // ... unless every worker finished before it noticed anything
    let recovered = net.done.iter().flatten().any(|o| o.recoveries > 0);
    let rebound = rebound.map(|t| t.saturating_since(restarted));
    assert!(rebound.is_some() || !recovered);
    if let Some(t) = rebound {
        assert!(t < Duration::from_secs(5), "rebinding took {t:?}");
    }
    // Finishing the interrupted allreduce after that is ordinary loss
    // recovery (its tail can take a few rto_max under 10% loss); the whole
    // run is bounded by run_until.
    let took = (0..workers)
        .filter_map(|w| net.done[w].iter().position(|o| o.recoveries > 0).map(|i| net.done_at[w][i]))
        .max()
        .map_or(Duration::ZERO, |t| t.saturating_since(restarted));
    if std::env::var_os("RESTART_TRACE").is_some() {
        let rec = net.done.iter().flatten().filter(|o| o.recoveries > 0).count();
        eprintln!("workers {workers} lens {lens:?} float {float} loss {loss:.3} at {restart_at:.3}: recovered ops {rec}, took {took:?}, switch {:?}", (net.sw.counters().recoveries, net.stale_incarnation_count()));
    }
    true
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A restart at a random point, under loss and reordering: every result
    /// of every allreduce is exact.
    #[test]
    fn every_result_exact_with_a_restart_at_a_random_point(
        workers in 2usize..=4,
        lens in proptest::collection::vec(1usize..=80, 1..=4),
        float in any::<bool>(),
        lend in prop_oneof![Just(Lend::Nothing), Just(Lend::Output), Just(Lend::Both)],
        loss in prop_oneof![Just(0.0), 0.0f64..0.1],
        restart_after in 0.0f64..1.0,
        seed in any::<u64>(),
    ) {
        prop_assume!(restart_run(workers, &lens, float, lend, loss, restart_after, seed, false, None));
    }

    /// The same with the workers that finished lingering, one worker deaf
    /// to the results of the run's last blocks until the restart (so the
    /// others finish before it), and restarts also after the first worker
    /// finished its last allreduce (up to 1.5 times that point): no case
    /// is left out, every result exact.
    #[test]
    fn every_result_exact_with_a_restart_at_any_point_when_finished_members_linger(
        workers in 2usize..=4,
        lens in proptest::collection::vec(1usize..=80, 1..=4),
        float in any::<bool>(),
        lend in prop_oneof![Just(Lend::Nothing), Just(Lend::Output), Just(Lend::Both)],
        loss in prop_oneof![Just(0.0), 0.0f64..0.1],
        restart_after in 0.0f64..1.5,
        deaf_tail in 1u32..=4,
        seed in any::<u64>(),
    ) {
        prop_assert!(restart_run(workers, &lens, float, lend, loss, restart_after, seed, true, Some(deaf_tail)));
    }
}

/// Two restarts: the second one comes `gap_steps` network steps after the
/// first, typically while the workers are still recovering from the first
/// (waiting for the floor, or resending retained blocks behind the gate).
fn double_restart_run(workers: usize, lens: &[usize], loss: f64, restart_at: f64, gap_steps: u64, seed: u64) -> bool {
    let ints = int_tensors(workers, lens, seed);
    let loaded = || {
        let mut net = Net::new(workers, 4, 4, 4, loss, seed);
        load_int(&mut net, &ints);
        net
    };
    let mut net = at_fraction(loaded, lens.len(), restart_at);
    for (incarnation, gap) in [(0x1234_5677, gap_steps), (0x2345_6788, 0)] {
        net.down = true;
        let t = net.now + Duration::from_millis(30);
        let deadline = Duration::from_nanos(net.now.as_nanos()) + Duration::from_secs(30);
        net.run_until(deadline, |n| n.now >= t);
        if net.done.iter().any(|d| d.len() == lens.len()) && !net.all_done(lens.len()) {
            return false;
        }
        net.restart(incarnation);
        net.down = false;
        let mut steps = 0;
        net.run_until(Duration::from_secs(300), |n| {
            steps += 1;
            steps > gap || n.all_done(lens.len())
        });
        if net.all_done(lens.len()) {
            break; // finished before the second restart: still checked below
        }
    }
    let until = Duration::from_nanos(net.now.as_nanos()) + Duration::from_secs(120);
    net.run_until(until, |n| n.all_done(lens.len()));
    check_int(&ints, &net.done);
    true
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A second restart while the workers recover from the first: every
    /// result exact, nobody hangs.
    #[test]
    fn every_result_exact_with_a_second_restart_during_recovery(
        workers in 2usize..=4,
        lens in proptest::collection::vec(20usize..=200, 1..=4),
        loss in prop_oneof![Just(0.0), 0.0f64..0.05],
        restart_after in 0.0f64..0.8,
        gap_steps in 1u64..100,
        seed in any::<u64>(),
    ) {
        prop_assume!(double_restart_run(workers, &lens, loss, restart_after, gap_steps, seed));
    }
}

/// A recovery floor completed by a stale member's report must not bind a
/// *new process* of another rank to the old stream. Worker 1 is idle (not
/// driven) while the switch restarts; worker 0 (in an allreduce) reports its
/// lowest block in a recovery join and is then replaced by a new process
/// (another member incarnation) that joins for a new run and waits at the
/// fresh job's barrier. Then worker 1 calls allreduce again: its recovery
/// join completes the floor with rank 0's report from the dead process, and
/// the floor's JoinAck goes to rank 0's current address. Audit guard (it
/// passes today: the new process does not take that answer, its next Join
/// ends the round and both raise `MemberRestarted`); what must never happen
/// is a sum mixing the new run's tensor with the old run's contribution.
#[test]
fn a_recovery_floor_from_a_dead_process_never_binds_its_replacement() {
    let mut net = Net::new(2, 4, 4, 4, 0.0, 1);
    net.failures = Some(vec![Vec::new(); 2]);
    let first: Vec<Vec<i32>> = (0..2).map(|w| (0..16).map(|i| 1000 * w + i).collect()).collect();
    for w in 0..2 {
        net.todo[w].push_back(Tensor::I32(first[w].clone()));
    }
    net.run_until(Duration::from_secs(10), |n| n.all_done(1));
    // worker 0 starts its second allreduce; worker 1 does not (yet)
    net.paused[1] = true;
    net.todo[0].push_back(Tensor::I32(vec![7; 16]));
    net.run_until(Duration::from_secs(20), |n| !n.ws[0].is_ready());
    net.restart(5);
    // worker 0 detects the restart and reports its lowest block
    net.run_until(Duration::from_secs(20), |n| n.sw.counters().recover_waiting > 0);
    // ... then its process dies; a new one (another member incarnation)
    // joins for a new run and is held at the barrier
    let mut cfg = net.ws[0].config().clone();
    cfg.incarnation = 0x4242;
    net.ws[0] = AllreduceSession::new(cfg, net.now);
    let fresh = vec![100_000; 16];
    net.todo[0].push_back(Tensor::I32(fresh.clone()));
    let joins = net.sw.counters().joins;
    net.run_until(Duration::from_secs(30), |n| n.sw.counters().joins > joins);
    assert!(!net.ws[0].is_ready());
    // worker 1, still the old process, calls allreduce again
    let old1 = vec![3; 16];
    net.todo[1].push_back(Tensor::I32(old1.clone()));
    net.paused[1] = false;
    let deadline = Duration::from_nanos(net.now.as_nanos()) + Duration::from_secs(60);
    net.run_until(deadline, |n| {
        n.failures.as_ref().unwrap().iter().all(|f| !f.is_empty()) || n.done[0].len() == 2 || n.done[1].len() == 2
    });
    if let Some(o) = net.done[0].get(1) {
        // the new process of rank 0 got a sum: it can only be wrong (rank 1
        // never contributed to the new run)
        panic!("the new process of rank 0 was handed {:?}: its tensor plus the old process's contribution of rank 1", o.tensor);
    }
    if let Some(o) = net.done[1].get(1) {
        panic!("the old process of rank 1 was handed {:?}: a mix of two runs", o.tensor);
    }
}

/// Every member of a fresh job joins with `sync` at once (each worker of a
/// job gave up and rejoined, e.g. after a restart it could not recover
/// from): someone must be answered, or they all wait for each other.
#[test]
fn members_that_all_rejoin_with_sync_are_answered() {
    let spec = spec(3, 4);
    let mut sw = switch(&spec, 7);
    let mut ws: Vec<AllreduceSession> = (0..3)
        .map(|w| {
            let mut cfg = SessionConfig::new(1, w);
            cfg.elems_per_packet = 4;
            cfg.sync_join = true;
            cfg.align_blocks = 4;
            AllreduceSession::new(cfg, Time::ZERO)
        })
        .collect();
    let mut now = Time::ZERO;
    let mut done: Vec<Option<Tensor>> = vec![None; 3];
    for _ in 0..200 {
        let mut replies = VecTransmit::new();
        for (r, w) in ws.iter_mut().enumerate() {
            if w.poll_timeout().is_some_and(|t| t <= now) {
                w.handle_timeout(now);
            }
            let mut out = VecTransmit::new();
            w.poll_transmit(now, &mut out);
            for (_, b) in out.drain() {
                let _ = sw.handle_datagram(now, r, &b, &mut replies);
            }
        }
        for (dest, b) in replies.drain() {
            ws[dest].handle_datagram(now, &b);
        }
        for (r, w) in ws.iter_mut().enumerate() {
            while let Some(ev) = w.poll_event() {
                match ev {
                    // the first one answered opens the stream for the others
                    Event::Joined(_) => w.begin(now, Tensor::I32(vec![r as i32 + 1; 16])).unwrap(),
                    Event::Completed(o) => done[r] = Some(o.tensor),
                    Event::Failed(e) => panic!("rank {r}: {e}"),
                    _ => {}
                }
            }
        }
        if done.iter().all(Option::is_some) {
            assert!(done.iter().all(|t| t == &Some(Tensor::I32(vec![6; 16]))), "{done:?}");
            return;
        }
        now = now + Duration::from_millis(10);
    }
    panic!("after 2 s: ready {:?}, done {:?}", ws.iter().map(|w| w.is_ready()).collect::<Vec<_>>(), done);
}

/// A member that finished its last allreduce before the switch restarted,
/// while another still lacks results of it (they were lost on the way):
/// the restarted switch's floor waits for every member's report. Idle, the
/// finished member never reports and the other fails with
/// `RecoveryStalled` (cleanly); lingering, it probes, finds the restart,
/// reports the end of its stream and resends its retained contributions,
/// and the other completes with the exact sum.
fn finished_member_and_a_restart(linger: bool) -> Net {
    let lens = [6usize, 6];
    let mut net = Net::new(2, 4, 4, 1, 0.0, 3);
    net.linger = linger;
    net.failures = Some(vec![Vec::new(); 2]);
    let ints = int_tensors(2, &lens, 5);
    load_int(&mut net, &ints);
    // worker 1 hears no result from block 8 on (the last four of the
    // second allreduce); worker 0 hears every result and finishes
    net.deaf[1] = Some(8);
    net.run_until(Duration::from_secs(5), |n| n.done[0].len() == 2);
    assert_eq!(net.done[1].len(), 1, "worker 1 must still lack results");
    assert_eq!(net.ws[0].retained_blocks(), vec![8, 9, 10, 11], "the finished member keeps one slot-cycle");
    let t = net.now + Duration::from_millis(50);
    net.run_until(Duration::from_secs(5), |n| n.now >= t);
    net.restart(9);
    net.deaf[1] = None;
    let deadline = Duration::from_nanos(net.now.as_nanos()) + Duration::from_secs(60);
    net.run_until(deadline, |n| n.all_done(2) || n.failures.as_ref().unwrap()[1].len() == 1);
    if linger {
        assert!(net.failures.as_ref().unwrap().iter().all(|f| f.is_empty()), "{:?}", net.failures);
        check_int(&ints, &net.done);
    }
    net
}

#[test]
fn a_finished_member_that_does_not_linger_leaves_the_others_stalled() {
    let net = finished_member_and_a_restart(false);
    let failures = net.failures.as_ref().unwrap();
    assert!(failures[1].len() == 1 && failures[1][0].contains("recovery did not finish"), "{failures:?}");
    assert_eq!(net.done[1].len(), 1, "never a result without the finished member's contributions");
}

#[test]
fn a_finished_member_that_lingers_lets_the_others_recover() {
    let net = finished_member_and_a_restart(true);
    let stats = net.ws[0].linger_stats();
    assert_eq!(stats.idle_recoveries, 1);
    assert!(stats.probes >= 1);
    assert_eq!(net.sw.counters().recoveries, 1);
    assert!(net.done[1][1].recoveries > 0);
}

/// Lingering members say they are done; the switch says every member is
/// once all did at the same block, and not before: here worker 1 still
/// lacks results of the last allreduce (lost on the way) while 0 and 2
/// finished and linger.
#[test]
fn lingering_members_learn_that_every_member_is_done_and_not_before() {
    let mut net = Net::new(3, 4, 4, 1, 0.0, 3);
    net.linger = true;
    let ints = int_tensors(3, &[6, 6], 5);
    load_int(&mut net, &ints);
    net.deaf[1] = Some(10);
    net.run_until(Duration::from_secs(5), |n| n.done[0].len() == 2 && n.done[2].len() == 2);
    let t = net.now + Duration::from_secs(1);
    net.run_until(Duration::from_secs(10), |n| n.now >= t);
    assert_eq!(net.done[1].len(), 1);
    assert!(net.ws.iter().all(|w| !w.all_done()), "a member still lacks results: nobody is told all are done");
    assert!(net.ws[0].linger_stats().probes >= 4);
    net.deaf[1] = None;
    let t = net.now;
    net.run_until(Duration::from_secs(20), |n| n.ws.iter().all(|w| w.all_done()));
    check_int(&ints, &net.done);
    let took = net.now.saturating_since(t);
    assert!(took < Duration::from_millis(1500), "all done {took:?} after the results flowed again");
    assert!(net.sw.counters().done_joins >= 3);
}
