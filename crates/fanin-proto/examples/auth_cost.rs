//! CPU cost of authentication in the protocol machines alone, without
//! sockets or other processes: `cargo run --release -p fanin-proto
//! --example auth_cost [workers] [MiB] [elements per packet]` (1024 unless
//! given; 358 is what a 1500-byte link gets). One thread runs a `ValueSwitch`
//! and `workers` `AllreduceSession`s in memory and moves their datagrams
//! by hand, for an unkeyed and a keyed job in turn (interleaved, best of
//! several rounds), and prints one JSON object: µs of CPU per block for
//! each and their ratio. On a real run the same work is spread over the
//! switch and worker processes, plus the kernel's share.

use std::time::Instant;

use fanin_proto::auth::{derive_member_key, Key};
use fanin_proto::host::{AllreduceSession, Event, Prepared, SessionConfig, TensorMut, TensorRef};
use fanin_proto::switch::{ShardConfig, ValueSwitch};
use fanin_proto::{JobSpec, Time, VecTransmit};

fn run(workers: u16, elems: usize, per_packet: u16, key: Option<Key>) -> f64 {
    let job = 1;
    let mut sw = ValueSwitch::new(ShardConfig::single(1 << 28));
    sw.add_job(JobSpec { key, ..JobSpec::with_sources(job, workers, 64, per_packet.into()) }).expect("job admitted");
    let now = Time::ZERO;
    let mut sessions: Vec<AllreduceSession> = (0..workers)
        .map(|r| {
            let mut cfg = SessionConfig::new(job, r);
            cfg.elems_per_packet = per_packet;
            cfg.window = 32;
            cfg.auth_key = key.map(|k| derive_member_key(&k, job, r));
            cfg.seal_clock_us = 1_000;
            AllreduceSession::new(cfg, now)
        })
        .collect();
    let mut out = VecTransmit::new();
    let mut reply = VecTransmit::new();
    // Join.
    for (r, s) in sessions.iter_mut().enumerate() {
        s.poll_transmit(now, &mut out);
        for (_, b) in out.drain() {
            let _ = sw.handle_datagram(now, r as u16, &b, &mut reply);
        }
    }
    for (dest, b) in reply.drain() {
        sessions[dest as usize].handle_datagram(now, &b);
    }
    for s in &mut sessions {
        assert!(matches!(s.poll_event(), Some(Event::Joined(_))));
    }
    let tensor: Vec<f32> = (0..elems).map(|i| ((i % 1000) as f32 - 500.0) / 64.0).collect();
    // As a numpy call with `out=` does: the input borrowed, the sum written
    // into the caller's buffer (fanin_host::Session::allreduce_into).
    let mut outs: Vec<Vec<f32>> = vec![vec![0.0; elems]; workers as usize];
    let start = Instant::now();
    for (s, out) in sessions.iter_mut().zip(outs.iter_mut()) {
        let prepared = Prepared::borrow(TensorRef::F32(&tensor), per_packet.into()).expect("finite");
        // SAFETY: `tensor` and `out` outlive the allreduce, which completes
        // below before either is touched again.
        unsafe { s.begin_into(now, prepared, TensorMut::F32(out)) }.expect("begin");
    }
    let mut done = 0;
    while done < workers {
        for (r, s) in sessions.iter_mut().enumerate() {
            s.poll_transmit(now, &mut out);
            for (_, b) in out.drain() {
                let _ = sw.handle_datagram(now, r as u16, &b, &mut reply);
            }
        }
        for (dest, b) in reply.drain() {
            let s = &mut sessions[dest as usize];
            s.handle_datagram(now, &b);
            while let Some(ev) = s.poll_event() {
                match ev {
                    Event::Completed(_) => done += 1,
                    Event::Failed(e) => panic!("allreduce failed: {e}"),
                    _ => {}
                }
            }
        }
    }
    let blocks = elems.div_ceil(per_packet as usize) as f64;
    start.elapsed().as_secs_f64() * 1e6 / blocks
}

fn main() {
    let mut args = std::env::args().skip(1);
    let workers: u16 = args.next().map_or(4, |a| a.parse().expect("workers"));
    let mib: usize = args.next().map_or(4, |a| a.parse().expect("MiB"));
    let per_packet: u16 = args.next().map_or(1024, |a| a.parse().expect("elements per packet"));
    let elems = mib << 18;
    let key = Key([0x42; 16]);
    let (mut plain, mut keyed) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        plain = plain.min(run(workers, elems, per_packet, None));
        keyed = keyed.min(run(workers, elems, per_packet, Some(key)));
    }
    println!(
        "{{\"workers\": {workers}, \"elems_per_packet\": {per_packet}, \"unkeyed_us_per_block\": {plain:.2}, \
         \"keyed_us_per_block\": {keyed:.2}, \"keyed_cpu_ratio\": {:.3}}}",
        keyed / plain
    );
}
