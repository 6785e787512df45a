//! Packet traces of the job guards: rate limits, block-table exhaustion,
//! and the member timeout under both failure policies.

use std::time::Duration;

use super::*;
use crate::job::RateLimit;
use crate::transmit::VecTransmit;
use fanin_wire::value::write_elements;

type Addr = u32; // worker n lives at address 100 + n

fn ms(n: u64) -> Time {
    Time::from_nanos(n * 1_000_000)
}

fn data(job: u32, src: u16, block: u32, value: i32) -> Vec<u8> {
    let repr = Repr { grad_cnt: 1, block_id: block, ..Repr::new(MessageType::Contribution, job, src) };
    let mut buf = vec![0; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    write_elements(&[value], p.payload_mut());
    buf
}

/// What the switch sent: (destination, header, nack body if a nack).
fn send(sw: &mut ValueSwitch<Addr>, now: Time, src: u16, bytes: &[u8]) -> Vec<(Addr, Repr, Option<Nack>)> {
    let mut out = VecTransmit::new();
    let _ = sw.handle_datagram(now, 100 + src as u32, bytes, &mut out);
    decode(out)
}

fn tick(sw: &mut ValueSwitch<Addr>, now: Time) -> Vec<(Addr, Repr, Option<Nack>)> {
    let mut out = VecTransmit::new();
    sw.handle_timeout(now, &mut out);
    decode(out)
}

fn decode(mut out: VecTransmit<Addr>) -> Vec<(Addr, Repr, Option<Nack>)> {
    out.drain()
        .map(|(a, bytes)| {
            let p = Packet::new_checked(&bytes[..]).expect("valid");
            let repr = Repr::parse(&p).unwrap();
            let nack = (repr.msg_type == MessageType::Nack).then(|| Nack::parse(p.payload()).unwrap());
            (a, repr, nack)
        })
        .collect()
}

fn switch(spec: JobSpec, rate_limit: Option<RateLimit>) -> ValueSwitch<Addr> {
    let mut sw = ValueSwitch::new(ShardConfig { rate_limit, ..ShardConfig::single(1 << 30) });
    sw.add_job(spec).unwrap();
    sw
}

fn trimmed(cause: TrimCause) -> Option<Nack> {
    Some(Nack { reason: NackReason::Trimmed, detail: cause as u32 })
}

#[test]
fn a_source_over_its_rate_gets_trimmed_nacks_and_other_sources_are_untouched() {
    let spec = JobSpec { rate_limit: Some(RateLimit { pps: 1000, burst: 2 }), ..JobSpec::with_sources(1, 2, 64, 16) };
    let mut sw = switch(spec, None);
    let t = ms(100);
    // source 0 bursts 4 blocks at once: 2 pass, 2 come back trimmed
    let mut answers = Vec::new();
    for b in 0..4 {
        answers.extend(send(&mut sw, t, 0, &data(1, 0, b, 1)));
    }
    assert_eq!(answers.len(), 2, "{answers:?}");
    for (dest, repr, nack) in &answers {
        assert_eq!((*dest, repr.block_id >= 2), (100, true));
        assert_eq!(*nack, trimmed(TrimCause::RateLimited));
    }
    // source 1 has its own bucket: its first two blocks complete 0 and 1
    assert_eq!(send(&mut sw, t, 1, &data(1, 1, 0, 2)).len(), 2);
    assert_eq!(send(&mut sw, t, 1, &data(1, 1, 1, 2)).len(), 2);
    // one token per ms: a retry of block 2 after 0.5 ms is still refused,
    // silently (the nack budget, burst 2, went to the first two refusals);
    // 1 ms later it passes
    assert!(send(&mut sw, t + Duration::from_micros(500), 0, &data(1, 0, 2, 1)).is_empty());
    assert_eq!(sw.counters().rate_limited_unanswered, 1);
    assert!(send(&mut sw, t + Duration::from_millis(1), 0, &data(1, 0, 2, 1)).is_empty(), "accepted, waits for 1");
    let c = sw.counters();
    assert_eq!((c.rate_limited, c.rate_limited_unanswered, c.nacks_sent), (3, 1, 2));
    assert_eq!((c.accepted, c.blocks_completed), (5, 2));
}

#[test]
fn the_switch_wide_default_applies_to_jobs_without_a_limit_and_a_job_limit_wins() {
    let mut sw = switch(JobSpec::with_sources(1, 2, 64, 16), Some(RateLimit { pps: 10, burst: 1 }));
    sw.add_job(JobSpec { rate_limit: Some(RateLimit { pps: 10, burst: 3 }), ..JobSpec::with_sources(2, 2, 64, 16) })
        .unwrap();
    let t = ms(5);
    let limited = |sw: &mut ValueSwitch<Addr>, job| {
        let before = sw.counters().rate_limited;
        for b in 0..3 {
            send(sw, t, 0, &data(job, 0, b, 1));
        }
        sw.counters().rate_limited - before
    };
    assert_eq!(limited(&mut sw, 1), 2, "default burst 1");
    assert_eq!(limited(&mut sw, 2), 0, "job's own burst 3");
}

#[test]
fn a_full_block_table_answers_with_an_exhaustion_nack_not_silence() {
    // 2 slots; source 0 runs ahead of its window: block 2 needs slot 0,
    // which still aggregates block 0
    let mut sw = switch(JobSpec::with_sources(1, 2, 2, 16), None);
    assert!(send(&mut sw, ms(1), 0, &data(1, 0, 0, 1)).is_empty());
    let out = send(&mut sw, ms(1), 0, &data(1, 0, 2, 1));
    assert_eq!(out.len(), 1);
    let (dest, repr, nack) = &out[0];
    assert_eq!((*dest, repr.msg_type, repr.block_id, repr.src_id), (100, MessageType::Nack, 2, 0));
    assert_eq!(*nack, trimmed(TrimCause::MemoryExhausted));
    // block 0 completes; the retry of block 2 now finds the slot free
    assert_eq!(send(&mut sw, ms(2), 1, &data(1, 1, 0, 1)).len(), 2);
    assert!(send(&mut sw, ms(3), 0, &data(1, 0, 2, 1)).is_empty(), "accepted");
    assert_eq!((sw.counters().slot_busy, sw.counters().accepted), (1, 3));
}

fn policy_job(policy: FailurePolicy, timeout_ms: u32) -> JobSpec {
    JobSpec { on_failure: policy, member_timeout_ms: timeout_ms, ..JobSpec::with_sources(1, 3, 4, 16) }
}

#[test]
fn degrade_a_dead_worker_is_declared_slow_after_the_member_timeout_even_without_aging() {
    let mut sw = switch(policy_job(FailurePolicy::Degrade, 100), None);
    assert_eq!(sw.job(1).unwrap().block_exp_ms, 0, "no straggler aging");
    // sources 0 and 1 send block 0 at t = 10 ms; source 2 is dead
    for src in 0..2 {
        assert!(send(&mut sw, ms(10), src, &data(1, src, 0, 5)).is_empty());
    }
    assert_eq!(sw.poll_timeout(), Some(ms(110)), "the first look is one timeout after the block opened");
    // they keep retransmitting (heard), the block waits
    send(&mut sw, ms(90), 0, &data(1, 0, 0, 5));
    send(&mut sw, ms(90), 1, &data(1, 1, 0, 5));
    let out = tick(&mut sw, ms(110));
    // source 2: never heard, block open 100 ms: slow notice to the two
    // members with addresses, then the block completes without it
    let notices: Vec<_> = out.iter().filter(|o| o.1.msg_type == MessageType::Membership).collect();
    assert_eq!(notices.len(), 2, "{out:?}");
    assert!(notices.iter().all(|n| n.1.age_op == MEMBERSHIP_SLOW && n.1.src_id == 2 && n.1.src_cnt == 2));
    let results: Vec<_> = out.iter().filter(|o| o.1.msg_type == MessageType::Result).collect();
    assert_eq!(results.len(), 2);
    assert!(results.iter().all(|r| r.1.degraded && r.1.src_cnt == 2 && r.1.block_id == 0));
    assert_eq!(sw.slow_sources(1), vec![2]);
    assert_eq!(sw.counters().members_timed_out, 1);
    // later blocks complete with the two survivors alone
    send(&mut sw, ms(120), 0, &data(1, 0, 1, 1));
    let out = send(&mut sw, ms(120), 1, &data(1, 1, 1, 1));
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|o| o.1.degraded && o.1.src_cnt == 2));
}

#[test]
fn a_member_whose_contributions_are_all_queue_trimmed_is_alive_not_dead() {
    // Under overload the daemon may trim every contribution of a member for
    // longer than the member timeout; it is sending, so it is alive: the
    // block waits for it and completes exactly once it gets through.
    let mut sw = switch(policy_job(FailurePolicy::Degrade, 100), None);
    for src in 0..2 {
        assert!(send(&mut sw, ms(10), src, &data(1, src, 0, 5)).is_empty());
    }
    for t in (20..=300).step_by(40) {
        let mut out = VecTransmit::new();
        let v = sw.trim_datagram(ms(t), 102, &data(1, 2, 0, 5), TrimCause::ProcessingQueue, &mut out);
        assert_eq!(v, crate::trim::TrimVerdict::Trimmed);
        assert!(tick(&mut sw, ms(t + 10)).iter().all(|o| o.1.msg_type != MessageType::Membership), "at {t} ms");
    }
    assert_eq!((sw.counters().members_timed_out, sw.slow_sources(1)), (0, vec![]));
    let out = send(&mut sw, ms(320), 2, &data(1, 2, 0, 5));
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|o| !o.1.degraded && o.1.src_cnt == 3));
}

#[test]
fn a_worker_that_only_computes_long_is_not_dead_until_a_block_waited_the_timeout() {
    let mut sw = switch(policy_job(FailurePolicy::Fail, 100), None);
    for src in 0..3 {
        send(&mut sw, ms(1), src, &data(1, src, 0, 1));
    }
    // source 2 is silent for 500 ms (computing); the others start block 1
    // at 450 ms: nobody has waited 100 ms for it yet
    send(&mut sw, ms(450), 0, &data(1, 0, 1, 1));
    send(&mut sw, ms(450), 1, &data(1, 1, 1, 1));
    assert!(tick(&mut sw, ms(500)).is_empty());
    assert_eq!(send(&mut sw, ms(520), 2, &data(1, 2, 1, 1)).len(), 3, "block 1 completes with it");
    assert_eq!(sw.failed_member(1), None);
}

#[test]
fn fail_the_job_fails_within_the_bounded_time_and_every_member_hears_who_died() {
    let mut sw = switch(policy_job(FailurePolicy::Fail, 100), None);
    for src in [0, 2] {
        send(&mut sw, ms(0), src, &data(1, src, 0, 1));
    }
    assert!(tick(&mut sw, ms(99)).is_empty());
    let out = tick(&mut sw, ms(100));
    assert_eq!(out.len(), 2, "{out:?}");
    for (dest, repr, _) in &out {
        assert!(*dest == 100 || *dest == 102);
        assert_eq!((repr.msg_type, repr.age_op, repr.src_id), (MessageType::Membership, MEMBERSHIP_FAILED, 1));
    }
    assert_eq!(sw.failed_member(1), Some(1));
    assert_eq!(sw.poll_timeout(), None, "nothing left to wait for");
    // a member whose notice was lost retransmits, a restarted one joins:
    // both are told the job failed and who died
    for bytes in [data(1, 0, 0, 1), Repr::new(MessageType::Join, 1, 2).emit_vec()] {
        let out = send(&mut sw, ms(150), 0, &bytes);
        assert_eq!(out[0].2, Some(Nack { reason: NackReason::JobFailed, detail: 1 }));
    }
    let c = sw.counters();
    assert_eq!((c.jobs_failed, c.members_timed_out, c.blocks_completed), (1, 1, 0));
}

#[test]
fn under_fail_a_source_already_declared_slow_that_dies_still_fails_the_job() {
    let mut spec = policy_job(FailurePolicy::Fail, 100);
    spec.block_exp_ms = 10;
    spec.slow_after_windows = 1;
    let mut sw = ValueSwitch::new(ShardConfig {
        aging: AgingConfig { scanners: 1, checks: 1, min_tick: Duration::from_micros(1), ..AgingConfig::default() },
        ..ShardConfig::single(1 << 30)
    });
    sw.add_job(spec).unwrap();
    // sources 0 and 1 run blocks; 2 never comes: aging declares it slow
    let mut now = 0;
    for b in 0..8u32 {
        for src in 0..2 {
            send(&mut sw, ms(now), src, &data(1, src, b, 1));
        }
        now += 25;
        tick(&mut sw, ms(now));
    }
    assert_eq!(sw.slow_sources(1), vec![2]);
    assert_eq!(sw.failed_member(1), None, "blocks no longer wait for it, so none waited 100 ms yet");
    // a block open 100 ms while 2 is silent (1 is alive, it just started
    // the next block): that is death, not slowness
    send(&mut sw, ms(now), 0, &data(1, 0, 8, 1));
    send(&mut sw, ms(now + 100), 1, &data(1, 1, 9, 1));
    let out = tick(&mut sw, ms(now + 130));
    assert!(out.iter().any(|o| o.1.age_op == MEMBERSHIP_FAILED && o.1.src_id == 2), "{out:?}");
}

trait EmitVec {
    fn emit_vec(&self) -> Vec<u8>;
}

impl EmitVec for Repr {
    fn emit_vec(&self) -> Vec<u8> {
        let mut buf = vec![0; self.buffer_len()];
        self.emit(&mut Packet::new_unchecked(&mut buf[..]));
        buf
    }
}

#[test]
fn a_keyed_job_seals_its_exhaustion_and_rate_limit_nacks() {
    use crate::auth::{derive_member_key, Key};
    use fanin_wire::auth;
    let job_key = Key([7; 16]);
    let spec = JobSpec {
        key: Some(job_key),
        rate_limit: Some(RateLimit { pps: 1, burst: 2 }),
        ..JobSpec::with_sources(1, 2, 2, 16)
    };
    let mut sw = switch(spec, None);
    let key0 = derive_member_key(&job_key, 1, 0);
    let mut seq = 1u64 << 20;
    let mut sealed = |block: u32| {
        let plain = data(1, 0, block, 1);
        let mut buf = vec![0; plain.len() + auth::TRAILER_LEN];
        buf[..plain.len()].copy_from_slice(&plain);
        seq += 1;
        auth::seal(&key0, seq, &mut buf).unwrap();
        buf
    };
    let mut replies = Vec::new();
    for block in [0, 2, 3] {
        // block 0 opens slot 0; block 2 needs slot 0 (exhausted, cause 2);
        // block 3 is over the burst of 2 (rate limited, cause 3)
        let mut out = VecTransmit::new();
        let _ = sw.handle_datagram(ms(1), 100, &sealed(block), &mut out);
        replies.extend(out.drain().map(|(_, b)| b));
    }
    assert_eq!(replies.len(), 2, "two nacks");
    for (reply, cause) in replies.iter().zip([TrimCause::MemoryExhausted, TrimCause::RateLimited]) {
        let (inner, _) = auth::open(&key0, reply).expect("sealed under the member's key");
        let p = Packet::new_checked(inner).unwrap();
        assert_eq!(Nack::parse(p.payload()).unwrap(), Nack { reason: NackReason::Trimmed, detail: cause as u32 });
    }
    assert_eq!((sw.counters().slot_busy, sw.counters().rate_limited), (1, 1));
}
