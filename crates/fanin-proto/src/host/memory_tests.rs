//! Real host sessions against the real switch program on pooled memory
//! (docs/memory.md): many jobs whose caps add up to many times the shard's
//! memory run at once with results lost on the way, every sum exact, the
//! shard never over its limit. The hosts answer memory refusals with
//! result acknowledgements; the shard frees what every member holds and
//! moves records from a job's later blocks to its lower ones.

use std::time::Duration;

use super::{AllreduceSession, Event, SessionConfig, Tensor};
use crate::job::JobSpec;
use crate::switch::{MemoryModel, ShardConfig, ValueSwitch};
use crate::transmit::VecTransmit;
use crate::Time;

const STEP: Duration = Duration::from_micros(50);

/// Worker `r` of job `j` lives at address `j * 100 + r`.
fn address(w: &AllreduceSession) -> u32 {
    w.config().job_id * 100 + w.config().src_id as u32
}

fn input(job: u32, rank: u16, len: usize) -> Vec<i32> {
    (0..len).map(|i| ((job * 7919 + rank as u32 * 131 + i as u32 * 17) % 1000) as i32 - 500).collect()
}

#[test]
fn jobs_whose_caps_are_many_times_the_memory_finish_exactly_with_results_lost() {
    let (jobs, members, slots, elems, blocks) = (6u32, 3u16, 16u32, 64u32, 40usize);
    let specs: Vec<JobSpec> = (1..=jobs).map(|j| JobSpec::with_sources(j, members, slots, elems)).collect();
    let buffer = elems as u64 * 4;
    let floors: u64 = specs
        .iter()
        .map(|s| {
            let mut alone = ValueSwitch::<u32>::new(ShardConfig { memory_model: MemoryModel::Pooled, ..ShardConfig::single(1 << 30) });
            alone.add_job(s.clone()).unwrap();
            alone.memory_used()
        })
        .sum();
    // the floors (one buffer a job) and 8 buffers more; each job may hold 32
    let limit = floors + 8 * buffer;
    let caps = jobs as u64 * 2 * slots as u64;
    assert!(caps as f64 / (jobs as f64 + 8.0) > 4.0);
    let mut sw = ValueSwitch::<u32>::new(ShardConfig { memory_model: MemoryModel::Pooled, ..ShardConfig::single(limit) });
    let mut workers = Vec::new();
    for spec in &specs {
        sw.add_job(spec.clone()).unwrap();
        for &r in &spec.members {
            let mut cfg = SessionConfig::new(spec.job_id, r);
            cfg.elems_per_packet = elems as u16;
            cfg.window = slots;
            workers.push(AllreduceSession::new(cfg, Time::ZERO));
        }
    }
    let len = blocks * elems as usize;
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut lose = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % 100 < 3
    };
    let mut now = Time::ZERO;
    let mut started = vec![false; workers.len()];
    let mut done: Vec<Option<Tensor>> = vec![None; workers.len()];
    let (mut lost, mut peak) = (0u64, 0u64);
    while done.iter().any(Option::is_none) {
        now = now + STEP;
        assert!(now < Time::from_nanos(20_000_000_000), "no progress: {:?}", sw.counters());
        let mut replies = VecTransmit::new();
        for (i, w) in workers.iter_mut().enumerate() {
            if w.poll_timeout().is_some_and(|t| t <= now) {
                w.handle_timeout(now);
            }
            while let Some(event) = w.poll_event() {
                match event {
                    Event::Joined(_) if !started[i] => {
                        started[i] = true;
                        let (job, rank) = (w.config().job_id, w.config().src_id);
                        w.begin(now, Tensor::I32(input(job, rank, len))).unwrap();
                    }
                    Event::Completed(o) => done[i] = Some(o.tensor),
                    Event::Failed(e) => panic!("{e}"),
                    _ => {}
                }
            }
            let mut out = VecTransmit::new();
            while w.poll_transmit(now, &mut out) > 0 {}
            for (_, bytes) in out.drain() {
                let _ = sw.handle_datagram(now, address(w), &bytes, &mut replies);
                peak = peak.max(sw.memory_used());
            }
        }
        if sw.poll_timeout().is_some_and(|t| t <= now) {
            sw.handle_timeout(now, &mut replies);
        }
        for (dest, bytes) in replies.drain() {
            if lose() {
                lost += 1;
                continue;
            }
            if let Some(w) = workers.iter_mut().find(|w| address(w) == dest) {
                w.handle_datagram(now, &bytes);
            }
        }
    }
    for (w, got) in workers.iter().zip(&done) {
        let job = w.config().job_id;
        let want: Vec<i32> = (0..len).map(|i| (0..members).map(|r| input(job, r, len)[i]).sum()).collect();
        assert_eq!(got.as_ref(), Some(&Tensor::I32(want)), "job {job} rank {}", w.config().src_id);
    }
    let c = sw.counters();
    assert!(peak <= limit, "memory_used {peak} over {limit}");
    assert!(lost > 0);
    assert!(c.memory_exhausted > 0 && c.result_acks > 0 && c.records_acked > 0, "memory was short: {c:?}");
    assert_eq!(c.blocks_degraded, 0);
}
