//! Workers against the real switch program's guards: a job that fails when
//! a member dies (every survivor gets an error naming the dead rank, by
//! notice or by nack), and back-pressure from rate limits and a full block
//! table (the worker backs off and still completes, with the exact sum).

use std::time::Duration;

use super::{AllreduceSession, Event, SessionConfig, SessionError, Tensor};
use crate::job::{FailurePolicy, JobSpec, RateLimit};
use crate::switch::{ShardConfig, ValueSwitch};
use crate::transmit::VecTransmit;
use crate::Time;

const STEP: Duration = Duration::from_micros(50);

/// Workers `ranks` of a job joined to one shard (worker r at address r).
/// The job's other members join too (the round starts only when all did)
/// and then say nothing more: they died right after joining.
fn joined(spec: JobSpec, ranks: &[u16], window: u32) -> (Vec<AllreduceSession>, ValueSwitch<u16>) {
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 24));
    sw.add_job(spec.clone()).unwrap();
    let mut workers = Vec::new();
    for &r in &spec.members {
        let mut cfg = SessionConfig::new(spec.job_id, r);
        cfg.elems_per_packet = 4;
        cfg.window = window;
        cfg.auth_key = spec.key.map(|k| crate::auth::derive_member_key(&k, spec.job_id, r));
        cfg.seal_clock_us = 1_000;
        workers.push(AllreduceSession::new(cfg, Time::ZERO));
    }
    step(&mut workers, &mut sw, Time::ZERO);
    for w in &mut workers {
        assert!(matches!(w.poll_event(), Some(Event::Joined(_))));
    }
    workers.retain(|w| ranks.contains(&w.config().src_id));
    (workers, sw)
}

/// Everything the workers send goes through the switch; every answer is
/// delivered at once (lossless, zero delay). The switch addresses worker r
/// as r.
fn step(workers: &mut [AllreduceSession], sw: &mut ValueSwitch<u16>, now: Time) {
    let mut replies = VecTransmit::new();
    for w in workers.iter_mut() {
        if w.poll_timeout().is_some_and(|t| t <= now) {
            w.handle_timeout(now);
        }
        let mut out = VecTransmit::new();
        while w.poll_transmit(now, &mut out) > 0 {}
        for (_, bytes) in out.drain() {
            let _ = sw.handle_datagram(now, w.config().src_id, &bytes, &mut replies);
        }
    }
    if sw.poll_timeout().is_some_and(|t| t <= now) {
        sw.handle_timeout(now, &mut replies);
    }
    for (dest, bytes) in replies.drain() {
        if let Some(w) = workers.iter_mut().find(|w| w.config().src_id == dest) {
            w.handle_datagram(now, &bytes);
        }
    }
}

#[test]
fn when_a_member_dies_under_fail_every_survivor_gets_an_error_naming_its_rank() {
    // rank 2 of 3 joins and is never heard again; member timeout 20 ms, no straggler aging
    let spec = JobSpec { on_failure: FailurePolicy::Fail, member_timeout_ms: 20, ..JobSpec::with_sources(1, 3, 8, 16) };
    let (mut workers, mut sw) = joined(spec, &[0, 1], 8);
    for w in &mut workers {
        w.begin(Time::ZERO, Tensor::I32(vec![1; 64])).unwrap();
    }
    let mut now = Time::ZERO;
    let mut errors = vec![None, None];
    while errors.iter().any(Option::is_none) {
        now = now + STEP;
        assert!(now < Time::from_nanos(100_000_000), "no error within 5 member timeouts: a hang");
        step(&mut workers, &mut sw, now);
        for (i, w) in workers.iter_mut().enumerate() {
            while let Some(e) = w.poll_event() {
                if let Event::Failed(err) = e {
                    errors[i] = Some((err, now));
                }
            }
        }
    }
    for (err, at) in errors.into_iter().flatten() {
        assert_eq!(err, SessionError::MemberFailed { job_id: 1, rank: 2 });
        assert!(err.to_string().contains("rank 2"), "{err}");
        let at = Duration::from_nanos(at.as_nanos());
        assert!(at >= Duration::from_millis(20) && at <= Duration::from_millis(26), "failed at {at:?}: timeout + a check");
    }
}

#[test]
fn a_survivor_that_missed_the_notice_learns_from_the_nack_to_its_retransmission() {
    let spec = JobSpec { on_failure: FailurePolicy::Fail, member_timeout_ms: 20, ..JobSpec::with_sources(1, 2, 8, 16) };
    let (mut workers, mut sw) = joined(spec, &[0], 8);
    workers[0].begin(Time::ZERO, Tensor::I32(vec![1; 16])).unwrap();
    step(&mut workers, &mut sw, Time::ZERO);
    // the switch fails the job; its notice is lost
    let mut lost = VecTransmit::new();
    sw.handle_timeout(Time::from_nanos(20_000_000), &mut lost);
    assert_eq!(lost.drain().count(), 2, "the notices to rank 0 and to the dead rank 1's address");
    assert_eq!(sw.failed_member(1), Some(1));
    // the worker's stall timer resends; the nack names the dead rank
    let mut now = Time::from_nanos(20_000_000);
    let err = loop {
        now = now + Duration::from_millis(1);
        assert!(now < Time::from_nanos(2_000_000_000), "no error: a hang");
        step(&mut workers, &mut sw, now);
        if let Some(Event::Failed(e)) = workers[0].poll_event() {
            break e;
        }
    };
    assert_eq!(err, SessionError::MemberFailed { job_id: 1, rank: 1 });
}

/// One worker, 64 blocks, through a switch that pushes back; the result
/// must be exact and the worker must have backed off.
fn completes_under_back_pressure(spec: JobSpec, window: u32) -> (u64, u32, u64) {
    let (mut workers, mut sw) = joined(spec, &[0], window);
    let data: Vec<i32> = (0..256).collect();
    workers[0].begin(Time::ZERO, Tensor::I32(data.clone())).unwrap();
    let mut now = Time::ZERO;
    let mut min_window = u32::MAX;
    loop {
        now = now + STEP;
        assert!(now < Time::from_nanos(1_000_000_000), "no progress: a hang");
        step(&mut workers, &mut sw, now);
        min_window = min_window.min(workers[0].window());
        match workers[0].poll_event() {
            Some(Event::Completed(o)) => {
                assert_eq!(o.tensor, Tensor::I32(data));
                return (o.trimmed, min_window, sw.counters().rate_limited);
            }
            Some(Event::Failed(e)) => panic!("{e}"),
            _ => {}
        }
    }
}

#[test]
fn rate_limited_nacks_make_the_worker_back_off_and_it_still_completes_exactly() {
    // 20 000 pps = one token per 50 us step; burst 4 against a window of 16
    let spec = JobSpec { rate_limit: Some(RateLimit { pps: 20_000, burst: 4 }), ..JobSpec::with_sources(1, 1, 16, 16) };
    let (trimmed, min_window, rate_limited) = completes_under_back_pressure(spec, 16);
    assert!(trimmed > 0 && rate_limited >= trimmed, "trimmed {trimmed}, rate_limited {rate_limited}");
    assert!(min_window < 16, "the window shrank (to {min_window})");
}

#[test]
fn a_keyed_worker_backs_off_on_the_sealed_back_pressure_nacks() {
    // The rate-limit trace above with a keyed job: the switch seals its
    // Trimmed nacks (a keyed worker ignores unsealed datagrams, so an
    // unsealed nack would never slow it down).
    let spec = JobSpec {
        rate_limit: Some(RateLimit { pps: 20_000, burst: 4 }),
        key: Some(crate::auth::Key([9; 16])),
        ..JobSpec::with_sources(1, 1, 16, 16)
    };
    let (trimmed, min_window, rate_limited) = completes_under_back_pressure(spec, 16);
    assert!(trimmed > 0 && rate_limited >= trimmed, "trimmed {trimmed}, rate_limited {rate_limited}");
    assert!(min_window < 16, "the window shrank (to {min_window})");
}

#[test]
fn an_unlimited_worker_is_never_trimmed() {
    let (trimmed, min_window, rate_limited) = completes_under_back_pressure(JobSpec::with_sources(1, 1, 16, 16), 16);
    assert_eq!((trimmed, min_window, rate_limited), (0, 16, 0));
}
