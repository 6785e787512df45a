//! Rounds and member incarnations (docs/protocol.md §4.12): workers that
//! restart, rejoin, start late or whose whole job restarts get their own
//! round's sums or a clear error, never another round's sums or zeros.
//!
//! The real worker machines against a two-shard switch (the shards pass
//! their verdicts on with `ValueSwitch::learn`, as the daemon does), over an
//! in-memory network with an optional loss rate. A "process" is a session
//! with its own address; killing one drops it (the address goes silent).

use std::time::Duration;

use fanin_proto::fault::SplitMix64;
use fanin_proto::host::{AllreduceSession, Event, SessionConfig, SessionError, Tensor};
use fanin_proto::job::FailurePolicy;
use fanin_proto::switch::{ShardConfig, ValueSwitch, Verdict};
use fanin_proto::{JobSpec, Time, VecTransmit};

const JOB: u32 = 1;
const STEP: Duration = Duration::from_millis(1);

struct Process {
    addr: u32,
    session: AllreduceSession,
    events: Vec<Event>,
}

struct Net {
    spec: JobSpec,
    shards: Vec<ValueSwitch<u32>>,
    now: Time,
    next_addr: u32,
    loss: f64,
    rng: SplitMix64,
    /// How long a verdict takes to reach the other shards (the daemon
    /// passes them through queues read between batches); zero: at once.
    learn_delay: Duration,
    /// Verdicts on their way: (when, to which shard, what).
    pending: Vec<(Time, usize, Verdict)>,
}

impl Net {
    fn new(spec: JobSpec, shards: u16, loss: f64, seed: u64) -> Self {
        Net {
            shards: Self::switch(&spec, shards, 1),
            spec,
            now: Time::ZERO,
            next_addr: 1,
            loss,
            rng: SplitMix64::new(seed),
            learn_delay: Duration::ZERO,
            pending: Vec::new(),
        }
    }

    /// A switch of `shards` shards that holds the job, at switch incarnation `incarnation`.
    fn switch(spec: &JobSpec, shards: u16, incarnation: u32) -> Vec<ValueSwitch<u32>> {
        (0..shards)
            .map(|s| {
                let mut sw = ValueSwitch::new(ShardConfig {
                    shard: s,
                    shard_count: shards,
                    incarnation,
                    ..ShardConfig::single(1 << 30)
                });
                sw.add_job(spec.clone()).unwrap();
                sw
            })
            .collect()
    }

    /// The switch restarts: a fresh one, job re-admitted, no blocks, no
    /// rounds (docs/restart.md); the workers recover.
    fn restart_switch(&mut self, incarnation: u32) {
        self.shards = Self::switch(&self.spec, self.shards.len() as u16, incarnation);
        self.pending.clear(); // the old life's verdicts died with it
    }

    /// A new process of `rank`: a new session (incarnation `inc`) at a new address.
    fn spawn(&mut self, rank: u16, inc: u16) -> Process {
        self.spawn_with(rank, inc, |_| {})
    }

    /// `spawn`, with `tune` applied to the session's configuration.
    fn spawn_with(&mut self, rank: u16, inc: u16, tune: impl FnOnce(&mut SessionConfig)) -> Process {
        let mut c = SessionConfig::new(JOB, rank);
        c.elems_per_packet = 4;
        c.window = 4;
        c.incarnation = inc.into();
        c.rto_initial = Duration::from_millis(5);
        c.rto_min = Duration::from_millis(2);
        c.barrier_timeout = Duration::from_secs(2);
        tune(&mut c);
        let addr = self.next_addr;
        self.next_addr += 1;
        Process {
            addr,
            session: AllreduceSession::new(c, self.now),
            events: Vec::new(),
        }
    }

    fn lost(&mut self) -> bool {
        self.loss > 0.0 && self.rng.next_f64() < self.loss
    }

    /// One millisecond: timers, every process's datagrams through the
    /// switch, every answer back to the process at its address (answers to
    /// a dead process's address are lost).
    fn tick(&mut self, procs: &mut [&mut Process]) {
        self.now = self.now + STEP;
        let now = self.now;
        let mut replies = VecTransmit::new();
        let (due, later) = std::mem::take(&mut self.pending).into_iter().partition(|(at, _, _)| *at <= now);
        self.pending = later;
        for (_, k, verdict) in due {
            self.shards[k].learn(verdict);
        }
        for p in procs.iter_mut() {
            if p.session.poll_timeout().is_some_and(|t| t <= now) {
                p.session.handle_timeout(now);
            }
            let mut out = VecTransmit::new();
            while p.session.poll_transmit(now, &mut out) > 0 {}
            for (shard, bytes) in out.drain() {
                if self.lost() {
                    continue;
                }
                let mut target = shard;
                loop {
                    match self.shards[target as usize].handle_datagram(
                        now,
                        p.addr,
                        &bytes,
                        &mut replies,
                    ) {
                        Verdict::Consumed => break,
                        Verdict::WrongShard(o) => target = o,
                        verdict => {
                            for (k, sw) in self.shards.iter_mut().enumerate() {
                                if k == target as usize {
                                } else if self.learn_delay.is_zero() {
                                    sw.learn(verdict);
                                } else {
                                    self.pending.push((now + self.learn_delay, k, verdict));
                                }
                            }
                            break;
                        }
                    }
                }
            }
        }
        for sw in &mut self.shards {
            if sw.poll_timeout().is_some_and(|t| t <= now) {
                sw.handle_timeout(now, &mut replies);
            }
        }
        let replies: Vec<(u32, Vec<u8>)> = replies.drain().collect();
        for (dest, bytes) in replies {
            if self.lost() {
                continue;
            }
            if let Some(p) = procs.iter_mut().find(|p| p.addr == dest) {
                p.session.handle_datagram(now, &bytes);
            }
        }
        for p in procs.iter_mut() {
            while let Some(e) = p.session.poll_event() {
                p.events.push(e);
            }
        }
    }

    /// Tick until `done` holds for every process (at most `limit`).
    #[track_caller]
    fn run_until(
        &mut self,
        procs: &mut [&mut Process],
        limit: Duration,
        done: impl Fn(&Process) -> bool,
    ) {
        let end = self.now + limit;
        while !procs.iter().all(|p| done(p)) {
            assert!(self.now < end, "nothing happened within {limit:?} (called at {})", std::panic::Location::caller());
            self.tick(procs);
        }
    }

    /// The controller reprograms the job on every shard (new members in
    /// `awaiting` sync-join, as python/fanin/controller/service.py does).
    fn update(&mut self, spec: JobSpec, awaiting: &[u16]) {
        let mut out = VecTransmit::new();
        for sw in &mut self.shards {
            sw.update_job(self.now, spec.clone(), None, awaiting, &mut out).unwrap();
        }
        assert_eq!(out.drain().count(), 0, "adding a member sends nothing");
        self.spec = spec;
    }

    fn counter(&self, f: impl Fn(&fanin_proto::switch::Counters) -> u64) -> u64 {
        self.shards.iter().map(|s| f(s.counters())).sum()
    }
}

fn joined(p: &Process) -> bool {
    p.events.iter().any(|e| matches!(e, Event::Joined(_)))
}

fn finished(p: &Process) -> bool {
    p.events
        .iter()
        .any(|e| matches!(e, Event::Completed(_) | Event::Failed(_)))
}

/// The outcome of the allreduce each process just ran (its last event).
fn take_result(p: &mut Process) -> Result<Vec<i32>, SessionError> {
    let e = p
        .events
        .drain(..)
        .rev()
        .find(|e| matches!(e, Event::Completed(_) | Event::Failed(_)))
        .expect("finished");
    match e {
        Event::Completed(o) => match o.tensor {
            Tensor::I32(v) => Ok(v),
            t => panic!("int32 in, {t:?} out"),
        },
        Event::Failed(err) => Err(err),
        _ => unreachable!(),
    }
}

/// Every process reduces `inputs[i]`; returns what each got.
fn allreduce(
    net: &mut Net,
    procs: &mut [&mut Process],
    inputs: &[Vec<i32>],
) -> Vec<Result<Vec<i32>, SessionError>> {
    for (p, x) in procs.iter_mut().zip(inputs) {
        p.events.retain(|e| !matches!(e, Event::Completed(_)));
        p.session.begin(net.now, Tensor::I32(x.clone())).unwrap();
    }
    net.run_until(procs, Duration::from_secs(20), finished);
    procs.iter_mut().map(|p| take_result(p)).collect()
}

/// `allreduce` by the first `inputs.len()` processes while the others run
/// beside them without a call (a joiner waiting for its start, say).
fn allreduce_among(
    net: &mut Net,
    procs: &mut [&mut Process],
    inputs: &[Vec<i32>],
) -> Vec<Result<Vec<i32>, SessionError>> {
    let callers: Vec<u32> = procs[..inputs.len()].iter().map(|p| p.addr).collect();
    for (p, x) in procs.iter_mut().zip(inputs) {
        p.events.retain(|e| !matches!(e, Event::Completed(_)));
        p.session.begin(net.now, Tensor::I32(x.clone())).unwrap();
    }
    net.run_until(procs, Duration::from_secs(20), |p| !callers.contains(&p.addr) || finished(p));
    procs[..inputs.len()].iter_mut().map(|p| take_result(p)).collect()
}

fn sum(inputs: &[Vec<i32>]) -> Vec<i32> {
    (0..inputs[0].len())
        .map(|i| inputs.iter().map(|x| x[i]).sum())
        .collect()
}

fn spec(members: u16) -> JobSpec {
    JobSpec {
        on_failure: FailurePolicy::Fail,
        ..JobSpec::with_sources(JOB, members, 4, 4)
    }
}

/// The shard that starts a round tells the others through the runtime,
/// which may deliver it after the members, answered at once, reached them
/// with the round's first contributions. Here the other shard learns it
/// 30 ms late, under loss: it must keep the blocks it aggregated meanwhile.
/// (It dropped them: a member that had lost one of their results sent it
/// again, which opened a record that only it contributed to, its slot was
/// never free again, and the job failed with MemberFailed after a stall.)
#[test]
fn a_shard_that_learns_late_that_the_round_started_keeps_its_first_blocks() {
    for seed in 1..=8 {
        let mut net = Net::new(spec(3), 2, 0.05, seed);
        net.learn_delay = Duration::from_millis(30);
        let mut ps: Vec<Process> = (0..3).map(|r| net.spawn(r, 40 + r)).collect();
        let mut refs: Vec<&mut Process> = ps.iter_mut().collect();
        net.run_until(&mut refs, Duration::from_secs(1), joined);
        for call in 0..3 {
            let inputs: Vec<Vec<i32>> = (0..3).map(|r| (0..64).map(|i| i * 7 + r * 1000 + call).collect()).collect();
            for (rank, r) in allreduce(&mut net, &mut refs, &inputs).into_iter().enumerate() {
                assert_eq!(r.as_ref().ok(), Some(&sum(&inputs)), "seed {seed}, call {call}, rank {rank}: {r:?}");
            }
        }
        assert_eq!(net.counter(|c| c.slot_busy), 0, "seed {seed}");
    }
}

/// The same late verdict after a rank died, was declared permanently slow
/// (aging on) and came back as a new process. The round it ended must
/// leave every shard waiting for every member again: the late shard opens
/// the next round's first blocks before it learns that round started, and
/// it opened them without the returned rank, so on learning the round it
/// dropped them (they did not wait for the members the round waits for)
/// and the members had to send them again. Now they are kept: no datagram
/// of the new round is sent twice on a loss-free network.
#[test]
fn a_late_shard_waits_for_a_rank_that_was_slow_in_the_last_round() {
    let spec = JobSpec { block_exp_ms: 10, ..JobSpec::with_sources(JOB, 3, 4, 4) };
    let mut net = Net::new(spec, 2, 0.0, 3);
    net.learn_delay = Duration::from_millis(30);
    let mut procs: Vec<Process> = (0..3).map(|r| net.spawn(r, 50 + r)).collect();
    let mut refs: Vec<&mut Process> = procs.iter_mut().collect();
    net.run_until(&mut refs, Duration::from_secs(1), joined);
    // rank 1 dies; the others go on until the switch gives up on it
    let (mut s0, _dead, mut s2) = {
        let mut it = procs.into_iter();
        (it.next().unwrap(), it.next().unwrap(), it.next().unwrap())
    };
    for _ in 0..4 {
        for (p, v) in [(&mut s0, 5), (&mut s2, 7)] {
            p.events.retain(|e| !matches!(e, Event::Completed(_) | Event::Failed(_)));
            let _ = p.session.begin(net.now, Tensor::I32(vec![v; 64]));
        }
        net.run_until(&mut [&mut s0, &mut s2], Duration::from_secs(5), finished);
    }
    assert!(net.counter(|c| c.declared_slow) > 0, "rank 1 was declared permanently slow");
    // a new process of rank 1 ends that round (every shard has learnt it
    // 100 ms later); the others start anew
    let mut new1 = net.spawn(1, 90);
    for _ in 0..100 {
        net.tick(&mut [&mut new1]);
    }
    let (mut n0, mut n2) = (net.spawn(0, 91), net.spawn(2, 92));
    let mut round = [&mut n0, &mut new1, &mut n2];
    net.run_until(&mut round, Duration::from_secs(1), joined);
    // calls before and after the late shard learns the round started
    for call in 0..6 {
        let inputs: Vec<Vec<i32>> = (0..3).map(|r| (0..64).map(|i| i + 100 * r + call).collect()).collect();
        for (p, x) in round.iter_mut().zip(&inputs) {
            p.events.clear();
            p.session.begin(net.now, Tensor::I32(x.clone())).unwrap();
        }
        net.run_until(&mut round, Duration::from_secs(5), finished);
        for (rank, p) in round.iter().enumerate() {
            match p.events.iter().find(|e| matches!(e, Event::Completed(_) | Event::Failed(_))) {
                Some(Event::Completed(o)) => {
                    assert_eq!(o.tensor, Tensor::I32(sum(&inputs)), "call {call}, rank {rank}");
                    assert_eq!(o.retransmissions, 0, "call {call}, rank {rank}: blocks of the new round were dropped");
                }
                other => panic!("call {call}, rank {rank}: {other:?}"),
            }
        }
    }
}

#[test]
fn a_new_run_against_a_job_that_already_ran_gets_its_own_sums() {
    let mut net = Net::new(spec(2), 2, 0.0, 1);
    // the first run: two processes, ten allreduces of 3 blocks each
    let (mut a, mut b) = (net.spawn(0, 11), net.spawn(1, 12));
    net.run_until(&mut [&mut a, &mut b], Duration::from_secs(1), joined);
    for call in 0..10 {
        let inputs = [vec![call; 12], vec![100 + call; 12]];
        for r in allreduce(&mut net, &mut [&mut a, &mut b], &inputs) {
            assert_eq!(r.unwrap(), sum(&inputs));
        }
    }
    drop((a, b));
    // a second run, fresh processes with the same ranks: their own sums
    // from the first call on (the old code answered the old run's)
    let (mut c, mut d) = (net.spawn(0, 21), net.spawn(1, 22));
    net.run_until(&mut [&mut c, &mut d], Duration::from_secs(1), joined);
    for call in 0..12 {
        let inputs = [vec![1000 + call; 12], vec![3000 + call; 12]];
        for r in allreduce(&mut net, &mut [&mut c, &mut d], &inputs) {
            assert_eq!(r.unwrap(), sum(&inputs), "call {call} of the second run");
        }
    }
    assert_eq!(net.counter(|c| c.rounds_started), 2);
    assert_eq!(net.counter(|c| c.rounds_ended), 1);
}

/// Member incarnations are 48 bits: a second run whose processes drew the
/// same low 16 bits as the first run's (what a 16-bit number did once in
/// 65 535 draws per process) is still a new run, not the old processes
/// probing. (With 16 bits they were answered with the old round's start,
/// and their blocks met the old round's slots.)
#[test]
fn a_new_run_whose_incarnations_share_the_low_16_bits_is_still_a_new_run() {
    let mut net = Net::new(spec(2), 2, 0.0, 5);
    let inc = |run: u64, rank: u64| (run << 16) | (11 + rank);
    let (mut a, mut b) = (
        net.spawn_with(0, 0, |c| c.incarnation = inc(1, 0)),
        net.spawn_with(1, 0, |c| c.incarnation = inc(1, 1)),
    );
    net.run_until(&mut [&mut a, &mut b], Duration::from_secs(1), joined);
    for call in 0..3 {
        let inputs = [vec![call; 12], vec![100 + call; 12]];
        for r in allreduce(&mut net, &mut [&mut a, &mut b], &inputs) {
            assert_eq!(r.unwrap(), sum(&inputs));
        }
    }
    drop((a, b));
    let (mut c, mut d) = (
        net.spawn_with(0, 0, |c| c.incarnation = inc(2, 0)),
        net.spawn_with(1, 0, |c| c.incarnation = inc(2, 1)),
    );
    net.run_until(&mut [&mut c, &mut d], Duration::from_secs(1), joined);
    for call in 0..3 {
        let inputs = [vec![1000 + call; 12], vec![3000 + call; 12]];
        for r in allreduce(&mut net, &mut [&mut c, &mut d], &inputs) {
            assert_eq!(r.unwrap(), sum(&inputs), "call {call} of the second run");
        }
    }
    assert_eq!((net.counter(|c| c.rounds_started), net.counter(|c| c.rounds_ended)), (2, 1));
}

#[test]
fn a_rank_restarted_mid_round_makes_every_survivor_raise_and_the_next_round_is_exact() {
    let mut net = Net::new(spec(3), 2, 0.0, 2);
    let mut procs: Vec<Process> = (0..3).map(|r| net.spawn(r, 10 + r)).collect();
    let mut refs: Vec<&mut Process> = procs.iter_mut().collect();
    net.run_until(&mut refs, Duration::from_secs(1), joined);
    let inputs: Vec<Vec<i32>> = (0..3).map(|r| vec![r + 1; 40]).collect();
    for r in allreduce(&mut net, &mut refs, &inputs) {
        assert_eq!(r.unwrap(), sum(&inputs));
    }
    // ranks 0 and 2 start an allreduce; rank 1 crashes before it sends
    // anything and torchrun-style starts a new process for it
    let (mut s0, _dead, mut s2) = {
        let mut it = procs.into_iter();
        (it.next().unwrap(), it.next().unwrap(), it.next().unwrap())
    };
    for (p, v) in [(&mut s0, 5), (&mut s2, 7)] {
        p.session.begin(net.now, Tensor::I32(vec![v; 40])).unwrap();
    }
    for _ in 0..5 {
        net.tick(&mut [&mut s0, &mut s2]);
    }
    let mut new1 = net.spawn(1, 99);
    let new_addr = new1.addr;
    net.run_until(
        &mut [&mut s0, &mut s2, &mut new1],
        Duration::from_secs(1),
        |p| p.addr == new_addr || finished(p),
    );
    for p in [&mut s0, &mut s2] {
        let err = take_result(p).unwrap_err();
        assert_eq!(
            err,
            SessionError::MemberRestarted {
                job_id: JOB,
                rank: 1
            }
        );
        assert!(
            err.to_string().contains("rank 1") && err.to_string().contains("new session"),
            "{err}"
        );
    }
    assert!(
        !joined(&new1),
        "the new process waits at the barrier for the others"
    );
    // the survivors start new sessions, as a user (or torchrun) would
    let (mut n0, mut n2) = (net.spawn(0, 40), net.spawn(2, 42));
    net.run_until(
        &mut [&mut n0, &mut new1, &mut n2],
        Duration::from_secs(1),
        joined,
    );
    let inputs: Vec<Vec<i32>> = (0..3).map(|r| vec![1000 * (r + 1); 40]).collect();
    for r in allreduce(&mut net, &mut [&mut n0, &mut new1, &mut n2], &inputs) {
        assert_eq!(r.unwrap(), sum(&inputs));
    }
}

#[test]
fn the_old_rounds_retransmissions_are_told_the_round_ended_and_never_summed() {
    let mut net = Net::new(spec(2), 2, 0.0, 3);
    let (mut a, mut b) = (net.spawn(0, 1), net.spawn(1, 2));
    net.run_until(&mut [&mut a, &mut b], Duration::from_secs(1), joined);
    // rank 0 sends its blocks; rank 1 restarts before sending; rank 0 only
    // learns it from the answer to its retransmissions (the notice is lost:
    // rank 0 is not ticked while rank 1's new process joins)
    a.session.begin(net.now, Tensor::I32(vec![1; 16])).unwrap();
    net.tick(&mut [&mut a]);
    let mut b2 = net.spawn(1, 3);
    net.tick(&mut [&mut b2]);
    drop(b);
    net.run_until(&mut [&mut a], Duration::from_secs(2), finished);
    assert_eq!(
        take_result(&mut a).unwrap_err(),
        SessionError::MemberRestarted {
            job_id: JOB,
            rank: 1
        }
    );
    assert!(
        net.counter(|c| c.stale_round) >= 1,
        "answered from the ended round's state"
    );
    assert_eq!(net.counter(|c| c.blocks_completed), 0);
}

#[test]
fn no_round_starts_until_every_member_joined_so_aging_never_begins_early() {
    // the README's straggler example: block_exp_ms 10
    let spec = JobSpec {
        block_exp_ms: 10,
        ..JobSpec::with_sources(JOB, 3, 4, 4)
    };
    let mut net = Net::new(spec, 2, 0.0, 4);
    let mut p0 = net.spawn(0, 1);
    for _ in 0..1500 {
        net.tick(&mut [&mut p0]);
    }
    assert!(
        !joined(&p0) && !finished(&p0),
        "held at the barrier, not failed: {:?}",
        p0.events
    );
    let (mut p1, mut p2) = (net.spawn(1, 2), net.spawn(2, 3));
    net.run_until(
        &mut [&mut p0, &mut p1, &mut p2],
        Duration::from_secs(1),
        joined,
    );
    let inputs: Vec<Vec<i32>> = (0..3).map(|r| vec![r * 10 + 1; 64]).collect();
    for r in allreduce(&mut net, &mut [&mut p0, &mut p1, &mut p2], &inputs) {
        assert_eq!(
            r.unwrap(),
            sum(&inputs),
            "every block summed all three, none aged out"
        );
    }
    assert_eq!(net.counter(|c| c.blocks_aged), 0);
}

#[test]
fn a_member_that_never_comes_fails_the_others_at_the_barrier_with_a_clear_error() {
    let mut net = Net::new(spec(3), 1, 0.0, 5);
    let (mut p0, mut p1) = (net.spawn(0, 1), net.spawn(1, 2));
    net.run_until(&mut [&mut p0, &mut p1], Duration::from_secs(5), finished);
    for p in [&mut p0, &mut p1] {
        let err = take_result(p).unwrap_err();
        assert!(
            matches!(
                err,
                SessionError::JoinBarrier {
                    job_id: JOB,
                    joined: 2,
                    members: 3,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("only 2 of the job's 3 members joined"),
            "{err}"
        );
    }
}

#[test]
fn a_whole_job_restart_heals_a_job_that_failed() {
    // rank 1 dies mid-allreduce under `fail`; everyone restarts: the job
    // runs again without the control plane re-admitting it
    let spec = JobSpec {
        member_timeout_ms: 50,
        ..spec(2)
    };
    let mut net = Net::new(spec, 2, 0.0, 6);
    let (mut a, mut b) = (net.spawn(0, 1), net.spawn(1, 2));
    net.run_until(&mut [&mut a, &mut b], Duration::from_secs(1), joined);
    drop(b);
    a.session.begin(net.now, Tensor::I32(vec![1; 8])).unwrap();
    net.run_until(&mut [&mut a], Duration::from_secs(2), finished);
    assert_eq!(
        take_result(&mut a).unwrap_err(),
        SessionError::MemberFailed {
            job_id: JOB,
            rank: 1
        }
    );
    let (mut a2, mut b2) = (net.spawn(0, 3), net.spawn(1, 4));
    net.run_until(&mut [&mut a2, &mut b2], Duration::from_secs(1), joined);
    let inputs = [vec![2; 8], vec![5; 8]];
    for r in allreduce(&mut net, &mut [&mut a2, &mut b2], &inputs) {
        assert_eq!(r.unwrap(), vec![7; 8]);
    }
}

/// The property: processes are killed and restarted at random (one rank,
/// or the whole job, between or during allreduces), with loss; every
/// allreduce that returns carries exactly the sum of its round's
/// contributions, and every other one raised a restart (or a failure, if
/// the job's member timeout found a killed rank first).
fn joined_at(p: &Process) -> u32 {
    p.events
        .iter()
        .find_map(|e| match e {
            Event::Joined(params) => Some(params.next_block),
            _ => None,
        })
        .expect("joined")
}

/// A rank that comes back with a sync join (SwitchML++) into a round that
/// did not start at block 0 gets a start on one of the round's allreduce
/// boundaries, and its sums line up with the others'. The old answer
/// aligned to multiples of the allreduce length from block 0: after a
/// restart the joiner's allreduces straddled the others' (the chaos soak's
/// job stalled on it).
#[test]
fn a_sync_join_into_a_later_round_lines_up_with_the_rounds_allreduces() {
    sync_join_into_a_later_round(false);
}

/// The same after the switch itself restarted within the round: the fresh
/// switch knows nothing of the round's start, and learns the boundaries
/// from the members' recovery joins (their `RecoverAnchor`).
#[test]
fn a_sync_join_after_a_switch_restart_lines_up_with_the_rounds_allreduces() {
    sync_join_into_a_later_round(true);
}

fn sync_join_into_a_later_round(restart_switch: bool) {
    let spec = JobSpec {
        block_exp_ms: 20,
        on_failure: FailurePolicy::Degrade,
        ..JobSpec::with_sources(JOB, 3, 4, 4)
    };
    let mut net = Net::new(spec, 2, 0.0, 7);
    let input = |r: i32, k: u32| vec![(r + 1) * 100 + k as i32; 12]; // 3 blocks: one allreduce
    // the first run, then a whole-job restart: the next round starts at F
    let mut first: Vec<Process> = (0..3).map(|r| net.spawn(r, 1 + r)).collect();
    {
        let mut refs: Vec<&mut Process> = first.iter_mut().collect();
        net.run_until(&mut refs, Duration::from_secs(1), joined);
        for k in 0..2 {
            let inputs: Vec<Vec<i32>> = (0..3).map(|r| input(r, k)).collect();
            for got in allreduce(&mut net, &mut refs, &inputs) {
                assert_eq!(got.unwrap(), sum(&inputs));
            }
        }
    }
    drop(first);
    let (mut s0, mut s1, mut s2) = (net.spawn(0, 20), net.spawn(1, 21), net.spawn(2, 22));
    net.run_until(&mut [&mut s0, &mut s1, &mut s2], Duration::from_secs(1), joined);
    let f = joined_at(&s0);
    assert!(f % 3 != 0, "the round starts at {f}, a multiple of S = 4 that is not one of 3: the case to test");
    for k in 0..2 {
        let inputs: Vec<Vec<i32>> = (0..3).map(|r| input(r, k)).collect();
        for got in allreduce(&mut net, &mut [&mut s0, &mut s1, &mut s2], &inputs) {
            assert_eq!(got.unwrap(), sum(&inputs));
        }
    }
    if restart_switch {
        net.restart_switch(0x1234_5677);
        // the members find out with their next call and recover into the fresh switch
        let inputs: Vec<Vec<i32>> = (0..3).map(|r| input(r, 2)).collect();
        for got in allreduce(&mut net, &mut [&mut s0, &mut s1, &mut s2], &inputs) {
            assert_eq!(got.unwrap(), sum(&inputs));
        }
        assert_eq!(net.counter(|c| c.recoveries), 1);
    }
    let next = if restart_switch { 3 } else { 2 };
    // rank 2 dies; the others go on with partial sums (aging), then it
    // comes back with a sync join
    drop(s2);
    let partial = |k: u32| sum(&[input(0, k), input(1, k)]);
    for got in allreduce(&mut net, &mut [&mut s0, &mut s1], &[input(0, next), input(1, next)]) {
        assert_eq!(got.unwrap(), partial(next));
    }
    let mut j = net.spawn_with(2, 23, |c| {
        c.sync_join = true;
        c.align_blocks = 3;
    });
    let joiner = j.addr;
    net.run_until(&mut [&mut s0, &mut s1, &mut j], Duration::from_secs(1), |p| p.addr != joiner || joined(p));
    let start = joined_at(&j);
    assert!(start >= f + 3 * (next + 1), "past the round's allreduces so far: {start}");
    assert_eq!((start - f) % 3, 0, "start {start} is not an allreduce boundary of the round from {f}");
    let first_call = (start - f) / 3;
    for k in next + 1..first_call {
        for got in allreduce(&mut net, &mut [&mut s0, &mut s1], &[input(0, k), input(1, k)]) {
            assert_eq!(got.unwrap(), partial(k), "call {k}");
        }
    }
    for k in first_call..first_call + 3 {
        let inputs: Vec<Vec<i32>> = (0..3).map(|r| input(r, k)).collect();
        for got in allreduce(&mut net, &mut [&mut s0, &mut s1, &mut j], &inputs) {
            assert_eq!(got.unwrap(), sum(&inputs), "call {k}, with the joiner");
        }
    }
}

#[test]
fn random_kills_and_restarts_never_return_a_wrong_sum() {
    for seed in 0..24u64 {
        let mut rng = SplitMix64::new(seed);
        let n = 2 + (seed % 3) as u16;
        let shards = 1 + (seed % 2) as u16;
        let loss = if seed % 4 == 3 { 0.03 } else { 0.0 };
        let spec = JobSpec {
            member_timeout_ms: 2_000,
            ..spec(n)
        };
        let mut net = Net::new(spec, shards, loss, seed);
        let mut next_inc = 1u16;
        let mut spawn = |net: &mut Net, r: u16| {
            next_inc += 1;
            net.spawn(r, next_inc)
        };
        let mut procs: Vec<Process> = (0..n).map(|r| spawn(&mut net, r)).collect();
        // per process: its round (the block the round starts at, which the
        // switch answers every member of the round) and calls done
        let mut round: Vec<Option<u32>> = vec![None; n as usize];
        let mut calls: Vec<i32> = vec![0; n as usize];
        let value = |inc: u16, r: u16, k: i32| inc as i32 * 7 + r as i32 * 1000 + k;
        let mut incs_of_round: std::collections::HashMap<u32, Vec<(u16, u16)>> = Default::default();
        let (mut completed, mut raised) = (0, 0);
        let end = net.now + Duration::from_secs(20);
        while net.now < end {
            {
                let mut refs: Vec<&mut Process> = procs.iter_mut().collect();
                net.tick(&mut refs);
            }
            for r in 0..n as usize {
                let p = &mut procs[r];
                let inc = p.session.config().incarnation as u16;
                if round[r].is_none() {
                    if let Some(start) = p.events.iter().find_map(|e| match e {
                        Event::Joined(params) => Some(params.next_block),
                        _ => None,
                    }) {
                        round[r] = Some(start);
                        incs_of_round
                            .entry(start)
                            .or_default()
                            .push((inc, r as u16));
                    }
                }
                if let Some(e) = p
                    .events
                    .iter()
                    .position(|e| matches!(e, Event::Completed(_) | Event::Failed(_)))
                {
                    match p.events.remove(e) {
                        Event::Completed(o) => {
                            let k = calls[r];
                            let members = &incs_of_round[&round[r].unwrap()];
                            assert_eq!(
                                members.len(),
                                n as usize,
                                "seed {seed}: a round of every member"
                            );
                            let want: i32 =
                                members.iter().map(|&(i, rank)| value(i, rank, k)).sum();
                            assert_eq!(
                                o.tensor,
                                Tensor::I32(vec![want; 24]),
                                "seed {seed}: rank {r} call {k}"
                            );
                            calls[r] += 1;
                            completed += 1;
                        }
                        Event::Failed(err) => {
                            assert!(
                                matches!(
                                    err,
                                    SessionError::MemberRestarted { .. }
                                        | SessionError::MemberFailed { .. }
                                ),
                                "seed {seed}: rank {r}: {err:?}"
                            );
                            raised += 1;
                            // the user starts a new session
                            procs[r] = spawn(&mut net, r as u16);
                            round[r] = None;
                            calls[r] = 0;
                        }
                        _ => unreachable!(),
                    }
                }
                let p = &mut procs[r];
                if round[r].is_some() && p.session.is_ready() {
                    let inc = p.session.config().incarnation as u16;
                    p.session
                        .begin(
                            net.now,
                            Tensor::I32(vec![value(inc, r as u16, calls[r]); 24]),
                        )
                        .unwrap();
                }
            }
            // now and then, kill: one rank, or the whole job
            if rng.next_f64() < 0.002 {
                let victims: Vec<usize> = if rng.next_f64() < 0.3 {
                    (0..n as usize).collect()
                } else {
                    vec![rng.next_u64() as usize % n as usize]
                };
                for r in victims {
                    procs[r] = spawn(&mut net, r as u16);
                    round[r] = None;
                    calls[r] = 0;
                }
            }
        }
        assert!(
            completed > 20 && raised > 0,
            "seed {seed}: {completed} completed, {raised} raised: too little happened"
        );
    }
}

/// Block ids wrap (at a multiple of `block_cnt_max`, so a block and the one
/// a slot-cycle later share a slot across the wrap); a stream started just
/// before the wrap runs through it with exact sums. The old code compared
/// ids with `checked_add` and `<`: after the wrap every result was zero.
#[test]
fn a_stream_runs_across_the_wrap_of_its_block_ids_with_exact_sums() {
    for slots in [6u32, 4] {
        let spec = JobSpec {
            block_cnt_max: slots,
            ..spec(3)
        };
        let mut net = Net::new(spec, 2, 0.02, 9);
        let m = fanin_proto::serial::BlockSpace::new(slots).size();
        let start = (m - 23) as u32;
        for sw in &mut net.shards {
            sw.start_round(JOB, start); // as if the job had run that long
        }
        let mut procs: Vec<Process> = (0..3).map(|r| net.spawn(r, 50 + r)).collect();
        let mut refs: Vec<&mut Process> = procs.iter_mut().collect();
        net.run_until(&mut refs, Duration::from_secs(1), joined);
        for call in 0..12 {
            // 5 blocks of 4 elements: 60 blocks in all, 37 past the wrap
            let inputs: Vec<Vec<i32>> = (0..3)
                .map(|r| (0..20).map(|i| r * 100 + i + call).collect())
                .collect();
            for r in allreduce(&mut net, &mut refs, &inputs) {
                assert_eq!(r.unwrap(), sum(&inputs), "S {slots}, call {call}");
            }
        }
        assert_eq!(net.counter(|c| c.expired), 0);
    }
}

/// A switch restart while the stream crosses the wrap of its block ids:
/// the workers' retained contributions straddle the wrap (ids near M and
/// near 0), and recovery must resend them in stream order and finish every
/// call with exact sums. Free-running workers (each starts its next call
/// when its last one ends), 10 % loss so that their positions differ,
/// restarted once at each of the first ticks of a call that crosses the
/// wrap, against a switch of one and of two shards, the second also with
/// its verdicts passed on 30 ms late (as the daemon's queues may).
///
/// The old code failed it three ways, each with a clear error (never a
/// wrong sum): the workers kept their retained contributions in a map
/// ordered by id, which put the blocks past the wrap first (and never
/// pruned those short of it); the switch took the lowest of the members'
/// lows as the floor by value, not in stream order; and the restarted
/// switch resumed its empty slots at the fresh job's start (0), before
/// which every resent block short of the wrap was answered as expired
/// (MissedBlocks). The same test started at block 1000 passed. With the
/// floor passed to the other shard late, that shard answered the blocks
/// resent to it before it learnt the floor as expired; it now holds them
/// until its start is settled (`start_settled`).
#[test]
fn a_switch_restart_across_the_wrap_recovers_with_exact_sums() {
    let slots = 4u32;
    let m = fanin_proto::serial::BlockSpace::new(slots).size();
    let inputs = |call: i32| -> Vec<Vec<i32>> { (0..2).map(|r| (0..20).map(|i| r * 100 + i + call).collect()).collect() };
    let (mut restarts, mut recovered) = (0, 0);
    // (shards, how late the other shard learns the floor, seed, restart tick)
    let cases = [(1u16, 0u64), (2, 0), (2, 30)]
        .into_iter()
        .flat_map(|(shards, delay)| (0..30u64).flat_map(move |seed| (1..8u32).map(move |t| (shards, delay, seed, t))));
    for (shards, delay, seed, restart_tick) in cases {
        let spec = JobSpec { block_cnt_max: slots, member_timeout_ms: 60_000, ..spec(2) };
        let mut net = Net::new(spec, shards, if seed == 0 { 0.0 } else { 0.1 }, seed);
        net.learn_delay = Duration::from_millis(delay);
        // call 0: blocks m-7 .. m-3; call 1 (5 blocks of 4): m-2, m-1, 0, 1, 2; then on
        let start = (m - 7) as u32;
        for sw in &mut net.shards {
            sw.start_round(JOB, start); // as if the job had run that long
        }
        let mut procs = [net.spawn(0, 70), net.spawn(1, 71)];
        net.run_until(&mut procs.iter_mut().collect::<Vec<_>>(), Duration::from_secs(1), joined);
        let mut calls = [0i32; 2];
        for (r, p) in procs.iter_mut().enumerate() {
            p.events.clear();
            p.session.begin(net.now, Tensor::I32(inputs(0)[r].clone())).unwrap();
        }
        let (mut ticks, mut restarted) = (0u32, false);
        let end = net.now + Duration::from_secs(30);
        let case = format!("{shards} shards, verdicts {delay} ms late, seed {seed}, restart at tick {restart_tick}");
        while calls.iter().any(|&c| c < 5) {
            assert!(net.now < end, "{case}: calls {calls:?}");
            net.tick(&mut procs.iter_mut().collect::<Vec<_>>());
            ticks += 1;
            // the restart lands inside call 1, whose blocks cross the wrap;
            // once (the switch's incarnations are odd, their 16-bit tags
            // differ from the first life's, 1, as a real restart's do)
            if calls.contains(&1) && ticks == 1000 + restart_tick && !restarted {
                net.restart_switch(0x5151_8001 + 2 * restart_tick);
                restarts += 1;
                restarted = true;
            }
            for (r, p) in procs.iter_mut().enumerate() {
                if calls[r] < 5 && finished(p) {
                    let got = take_result(p).unwrap_or_else(|e| panic!("{case}, rank {r}, call {}: {e:?}", calls[r]));
                    assert_eq!(got, sum(&inputs(calls[r])), "{case}, call {}", calls[r]);
                    calls[r] += 1;
                    if calls[r] == 1 {
                        ticks = 1000; // count from the start of call 1
                    }
                    if calls[r] < 5 {
                        p.session.begin(net.now, Tensor::I32(inputs(calls[r])[r].clone())).unwrap();
                    }
                }
            }
        }
        recovered += net.counter(|c| c.recoveries).min(1);
    }
    // most cases restart inside call 1 (with no loss it is over in two ticks)
    assert!(restarts > 450 && recovered == restarts, "{restarts} restarts, {recovered} recovered");
}

/// Ranks that disagree on an allreduce's length all raise the same error at
/// once (the old code refused one of them and left the other to get its own
/// values back after the member timeout), and new sessions run exactly.
#[test]
fn ranks_that_disagree_on_the_length_all_raise_the_same_error() {
    // 10 vs 12 elements: the last block has 2 elements at one rank, 4 at the
    // other; 8 vs 16: the same element counts, but one rank's last block is
    // the other's second
    for (a_len, b_len) in [(10usize, 12usize), (8, 16)] {
        let mut net = Net::new(spec(2), 2, 0.0, 11);
        let (mut a, mut b) = (net.spawn(0, 1), net.spawn(1, 2));
        net.run_until(&mut [&mut a, &mut b], Duration::from_secs(1), joined);
        let started = net.now;
        a.session.begin(net.now, Tensor::I32(vec![1; a_len])).unwrap();
        b.session.begin(net.now, Tensor::I32(vec![2; b_len])).unwrap();
        net.run_until(&mut [&mut a, &mut b], Duration::from_secs(5), finished);
        for p in [&mut a, &mut b] {
            let err = take_result(p).unwrap_err();
            assert!(matches!(err, SessionError::LengthMismatch { job_id: JOB, .. }), "{a_len} vs {b_len}: {err:?}");
            assert!(err.to_string().contains("disagree on this allreduce's length"), "{err}");
        }
        assert!(net.now.saturating_since(started) < Duration::from_millis(200), "raised at once, not after a timeout");
        let (mut a2, mut b2) = (net.spawn(0, 3), net.spawn(1, 4));
        net.run_until(&mut [&mut a2, &mut b2], Duration::from_secs(1), joined);
        let inputs = [vec![3; 12], vec![4; 12]];
        for r in allreduce(&mut net, &mut [&mut a2, &mut b2], &inputs) {
            assert_eq!(r.unwrap(), vec![7; 12]);
        }
    }
}

/// A worker that sync-joins a running job whose workers accept only
/// complete results (on_failure = "fail", no aging, no quorum: their
/// JoinAck says `partial_results` false): the blocks the others complete
/// while it awaits its join and before its start sum every member those
/// blocks had, and their results say so. (They said `degraded`: the switch
/// counted the joiner among every block's members, and the running workers
/// failed with PartialResult, "block N completed with 2 of 3 sources".)
#[test]
fn a_sync_join_into_a_job_without_partial_results_leaves_the_running_workers_exact() {
    // (admitted for the 3 workers it will have)
    let mut net = Net::new(JobSpec { workers: 3, ..spec(2) }, 2, 0.0, 11);
    assert!(!net.spec.partial_results());
    let input = |r: i32, k: u32| vec![(r + 1) * 100 + k as i32; 12]; // 3 blocks: one allreduce
    let (mut s0, mut s1) = (net.spawn(0, 1), net.spawn(1, 1));
    net.run_until(&mut [&mut s0, &mut s1], Duration::from_secs(1), joined);
    let f = joined_at(&s0);
    let pair = |k: u32| vec![input(0, k), input(1, k)];
    for got in allreduce(&mut net, &mut [&mut s0, &mut s1], &pair(0)) {
        assert_eq!(got.unwrap(), sum(&pair(0)));
    }
    // the controller adds rank 2, awaiting its join: the others' next call
    // completes without it
    net.update(JobSpec { members: vec![0, 1, 2], ..spec(2) }, &[2]);
    for got in allreduce(&mut net, &mut [&mut s0, &mut s1], &pair(1)) {
        assert_eq!(got.unwrap(), sum(&pair(1)), "awaiting the joiner");
    }
    // it sync-joins while the others stream
    let mut j = net.spawn_with(2, 1, |c| {
        c.sync_join = true;
        c.align_blocks = 3;
    });
    let mut k = 2;
    while !joined(&j) || k == 2 {
        for got in allreduce_among(&mut net, &mut [&mut s0, &mut s1, &mut j], &pair(k)) {
            assert_eq!(got.unwrap(), sum(&pair(k)), "call {k}, the joiner joining");
        }
        k += 1;
    }
    let start = joined_at(&j);
    let params = j.events.iter().find_map(|e| match e {
        Event::Joined(p) => Some(p.partial_results),
        _ => None,
    });
    assert_eq!(params, Some(false), "the joiner accepts only complete results too");
    assert_eq!((start - f) % 3, 0, "start {start} is not an allreduce boundary");
    let first_call = (start - f) / 3;
    assert!(first_call >= k, "start {start} is a call the others began already ({k} done)");
    // the others' calls up to its start: blocks it is not part of
    for k in k..first_call {
        for got in allreduce_among(&mut net, &mut [&mut s0, &mut s1, &mut j], &pair(k)) {
            assert_eq!(got.unwrap(), sum(&pair(k)), "call {k}, before the joiner's start");
        }
    }
    for k in first_call..first_call + 2 {
        let inputs: Vec<Vec<i32>> = (0..3).map(|r| input(r, k)).collect();
        for got in allreduce(&mut net, &mut [&mut s0, &mut s1, &mut j], &inputs) {
            assert_eq!(got.unwrap(), sum(&inputs), "call {k}, with the joiner");
        }
    }
    assert_eq!(net.counter(|c| c.blocks_degraded), 0);
}


/// Fewer slots than shards (block_cnt_max < shard_count): shard 0, which
/// answers every Join, used to own no slot of some jobs, and a sync join was
/// never answered. A job's blocks now spread over at most block_cnt_max
/// shards, so shard 0 always owns one.
#[test]
fn a_sync_join_is_answered_when_the_job_has_fewer_slots_than_shards() {
    let mut net = Net::new(JobSpec { workers: 3, ..JobSpec { block_cnt_max: 1, ..spec(2) } }, 2, 0.0, 11);
    let (mut s0, mut s1) = (net.spawn(0, 1), net.spawn(1, 1));
    net.run_until(&mut [&mut s0, &mut s1], Duration::from_secs(1), joined);
    let pair = |k: i32| vec![vec![k; 12], vec![k + 1; 12]];
    for k in 0..3 {
        for got in allreduce(&mut net, &mut [&mut s0, &mut s1], &pair(k)) {
            assert_eq!(got.unwrap(), sum(&pair(k)));
        }
    }
    net.update(JobSpec { members: vec![0, 1, 2], workers: 3, ..JobSpec { block_cnt_max: 1, ..spec(2) } }, &[2]);
    let mut j = net.spawn_with(2, 1, |c| {
        c.sync_join = true;
        c.align_blocks = 3;
    });
    for k in 3..40 {
        if joined(&j) { break; }
        let _ = allreduce_among(&mut net, &mut [&mut s0, &mut s1, &mut j], &pair(k));
    }
    for _ in 0..5000 { if joined(&j) { break; } net.tick(&mut [&mut s0, &mut s1, &mut j]); }
    eprintln!("sync_deferred = {} after {:?}", net.counter(|c| c.sync_deferred), net.now);
    assert!(joined(&j), "the joiner was never answered");
}

/// Fewer slots than shards: with shard 0 owning no slot, a new process of
/// a rank ended the round with a next start computed from start_block,
/// below the running stream; the old round's retransmissions were
/// aggregated, not told, and the new round's first block was expired.
#[test]
fn a_round_restarts_above_the_stream_when_the_job_has_fewer_slots_than_shards() {
    let spec1 = JobSpec { block_cnt_max: 1, ..spec(2) };
    let mut net = Net::new(spec1, 2, 0.0, 3);
    let (mut a, mut b) = (net.spawn(0, 1), net.spawn(1, 2));
    net.run_until(&mut [&mut a, &mut b], Duration::from_secs(1), joined);
    for k in 0..4 {
        let inputs = vec![vec![k; 16], vec![k + 1; 16]];
        for got in allreduce(&mut net, &mut [&mut a, &mut b], &inputs) {
            assert_eq!(got.unwrap(), sum(&inputs));
        }
    }
    // stream is at block 16 now (4 calls x 4 blocks)
    a.session.begin(net.now, Tensor::I32(vec![1; 16])).unwrap();
    net.tick(&mut [&mut a]);
    let mut b2 = net.spawn(1, 3);
    net.tick(&mut [&mut b2]);
    drop(b);
    let end = net.now + Duration::from_secs(2);
    while !finished(&a) && net.now < end {
        net.tick(&mut [&mut a]);
    }
    eprintln!(
        "finished={} stale_round={} duplicate={} accepted={}",
        finished(&a),
        net.counter(|c| c.stale_round),
        net.counter(|c| c.duplicate),
        net.counter(|c| c.accepted)
    );
    eprintln!("a: {:?}", take_result(&mut a));
    drop(a);
    let mut a2 = net.spawn(0, 4);
    net.run_until(&mut [&mut a2, &mut b2], Duration::from_secs(2), joined);
    eprintln!("new round starts at {}", joined_at(&a2));
    let inputs = vec![vec![1000; 16], vec![2000; 16]];
    let res = allreduce(&mut net, &mut [&mut a2, &mut b2], &inputs);
    eprintln!("new round: {:?} expired={}", res, net.counter(|c| c.expired));
    for got in res {
        assert_eq!(got.unwrap(), sum(&inputs));
    }
}

/// A rank that left and is added back is a new member of the running
/// round: its new process's plain Join ends nothing. The switch kept the
/// old process's incarnation, took the Join for a restart of a running
/// rank, and ended the round for everyone (MemberRestarted).
#[test]
fn a_rank_added_back_after_it_left_joins_without_ending_the_round() {
    let mut net = Net::new(JobSpec { workers: 3, ..spec(3) }, 1, 0.0, 5);
    let (mut s0, mut s1, mut s2) = (net.spawn(0, 1), net.spawn(1, 1), net.spawn(2, 1));
    net.run_until(&mut [&mut s0, &mut s1, &mut s2], Duration::from_secs(1), joined);
    let trio: Vec<Vec<i32>> = (0..3).map(|r| vec![r + 1; 12]).collect();
    for got in allreduce(&mut net, &mut [&mut s0, &mut s1, &mut s2], &trio) {
        assert_eq!(got.unwrap(), sum(&trio));
    }
    drop(s2);
    net.update(JobSpec { members: vec![0, 1], workers: 2, ..spec(2) }, &[]);
    let pair = vec![vec![5; 12], vec![7; 12]];
    for got in allreduce(&mut net, &mut [&mut s0, &mut s1], &pair) {
        assert_eq!(got.unwrap(), sum(&pair));
    }
    net.update(JobSpec { members: vec![0, 1, 2], workers: 3, ..spec(3) }, &[]);
    let mut back = net.spawn(2, 9);
    for _ in 0..2000 {
        if joined(&back) {
            break;
        }
        net.tick(&mut [&mut s0, &mut s1, &mut back]);
    }
    assert!(joined(&back));
    assert_eq!(net.counter(|c| c.rounds_ended), 0, "a new member's Join is no restart");
    for p in [&mut s0, &mut s1] {
        assert!(!p.events.iter().any(|e| matches!(e, Event::Failed(_))), "{:?}", p.events);
    }
}
