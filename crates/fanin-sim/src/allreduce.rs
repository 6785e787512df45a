//! Aggregation in the simulator, minimal form: one switch running
//! `fanin_proto::switch::ValueSwitch` and N workers running
//! `fanin_proto::host::AllreduceSession` (the shipped machines, unchanged),
//! each worker on its own pair of links (rate, delay, drop-tail queue,
//! seeded loss): the adapter the larger experiments (topologies, many
//! switches, `scale.rs`) build on.
//!
//! Datagrams are real bytes: the machines emit and parse the wire format.
//! Every datagram costs `WIRE_OVERHEAD` extra bytes on a link (Ethernet,
//! IPv4, UDP headers).

use std::time::Duration;

use fanin_proto::fault::SplitMix64;
use fanin_proto::host::{AllreduceSession, Event, SessionConfig, Tensor};
use fanin_proto::switch::{ShardConfig, ValueSwitch, Verdict};
use fanin_proto::{JobSpec, Time, VecTransmit};
use fanin_wire::value::{ELEM_LEN, HEADER_LEN};
use serde::Serialize;

use crate::fabric::{Fabric, LinkParams, NetEv};
pub use crate::fabric::WIRE_OVERHEAD;
use crate::kernel::{tx_time, EventQueue, Ps, PS_PER_NS};

#[derive(Debug, Clone, Serialize)]
pub struct AllreduceConfig {
    pub workers: usize,
    /// int32 elements per worker.
    pub elements: usize,
    pub elems_per_packet: u16,
    /// Blocks in flight per worker (= the job's slots).
    pub window: u32,
    #[serde(flatten)]
    pub links: LinkParams,
    pub seed: u64,
}

impl Default for AllreduceConfig {
    fn default() -> Self {
        AllreduceConfig { workers: 8, elements: 1 << 20, elems_per_packet: 256, window: 128, links: LinkParams::default(), seed: 1 }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct AllreduceResult {
    pub config: AllreduceConfig,
    /// Time the last worker had its result.
    pub completion_us: f64,
    /// Lower bound: one worker's datagrams serialised back to back on its
    /// uplink, plus the last result's way back.
    pub bound_us: f64,
    pub goodput_gbps_per_worker: f64,
    pub retransmissions: u64,
    pub datagrams: u64,
    pub link_drops: u64,
    pub queue_drops: u64,
    pub verified: bool,
    pub events: u64,
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    Net(NetEv),
    Timer { worker: u32 },
}

impl From<NetEv> for Ev {
    fn from(e: NetEv) -> Self {
        Ev::Net(e)
    }
}

fn ns(t: Ps) -> Time {
    Time::from_nanos(t / PS_PER_NS)
}

/// Run one allreduce of `elements` int32 values on every worker.
pub fn run(cfg: &AllreduceConfig) -> Result<AllreduceResult, String> {
    let job_id = 1;
    let n = cfg.workers;
    let spec = JobSpec::with_sources(job_id, n as u16, cfg.window, cfg.elems_per_packet as u32);
    let mut switch: ValueSwitch<u32> = ValueSwitch::new(ShardConfig::single(1 << 34));
    switch.add_job(spec).map_err(|e| e.to_string())?;
    let mut sessions: Vec<AllreduceSession> = (0..n)
        .map(|w| {
            let mut c = SessionConfig::new(job_id, w as u16);
            c.elems_per_packet = cfg.elems_per_packet;
            c.window = cfg.window;
            c.rto_initial = Duration::from_micros(200);
            c.rto_min = Duration::from_micros(50);
            AllreduceSession::new(c, Time::ZERO)
        })
        .collect();
    let mut rng = SplitMix64::new(cfg.seed);
    let inputs: Vec<Vec<i32>> = (0..n).map(|_| (0..cfg.elements).map(|_| (rng.next_u64() % 2001) as i32 - 1000).collect()).collect();
    let expected: Vec<i32> = (0..cfg.elements).map(|i| inputs.iter().fold(0i32, |a, v| a.wrapping_add(v[i]))).collect();
    let mut inputs: Vec<Option<Vec<i32>>> = inputs.into_iter().map(Some).collect();

    let dgram = (HEADER_LEN + ELEM_LEN * cfg.elems_per_packet as usize) as u32 + WIRE_OVERHEAD;
    let max_dgram = dgram as u64;
    // worker w is node w, the switch node n; link w joins them, so channel
    // 2w is w's uplink and 2w + 1 its downlink
    let mut is_switch = vec![false; n + 1];
    is_switch[n] = true;
    let links: Vec<(u32, u32)> = (0..n as u32).map(|w| (w, n as u32)).collect();
    let chans = cfg.links.channel_config(max_dgram, cfg.seed);
    let (rate_bps, delay) = (chans.rate_bps, chans.delay);
    let mut net = Fabric::new(&is_switch, &links, chans);
    let mut ev: EventQueue<Ev> = EventQueue::new();
    let mut armed: Vec<Option<Ps>> = vec![None; n];
    let mut done_at: Vec<Option<Ps>> = vec![None; n];
    let mut verified = true;
    let mut retransmissions = 0;
    let mut out = VecTransmit::new();

    // Drive worker w: events, transmissions, timer.
    let drive = |w: usize,
                 sessions: &mut [AllreduceSession],
                 ev: &mut EventQueue<Ev>,
                 net: &mut Fabric,
                 out: &mut VecTransmit<u16>,
                 armed: &mut [Option<Ps>],
                 done_at: &mut [Option<Ps>],
                 inputs: &mut [Option<Vec<i32>>],
                 verified: &mut bool,
                 retransmissions: &mut u64|
     -> Result<(), String> {
        let now = ev.now();
        let s = &mut sessions[w];
        while let Some(e) = s.poll_event() {
            match e {
                Event::Joined(_) => {
                    let t = inputs[w].take().ok_or("joined twice")?;
                    s.begin(ns(now), Tensor::I32(t)).map_err(|e| e.to_string())?;
                }
                Event::Completed(o) => {
                    done_at[w] = Some(now);
                    *retransmissions += o.retransmissions;
                    *verified &= o.tensor == Tensor::I32(expected.clone());
                }
                Event::Failed(e) => return Err(format!("worker {w}: {e}")),
                // no straggler timeout in this experiment
                Event::Membership { .. } => {}
            }
        }
        while s.poll_transmit(ns(now), out) > 0 {}
        for (_, bytes) in out.drain() {
            net.send(ev, w as u32, n as u32, bytes);
        }
        if let Some(t) = s.poll_timeout() {
            let t = (t.as_nanos() * PS_PER_NS).max(now);
            if armed[w] != Some(t) {
                armed[w] = Some(t);
                ev.schedule(t, Ev::Timer { worker: w as u32 });
            }
        }
        Ok(())
    };

    for w in 0..n {
        drive(w, &mut sessions, &mut ev, &mut net, &mut out, &mut armed, &mut done_at, &mut inputs, &mut verified, &mut retransmissions)?;
    }
    let mut sw_out: VecTransmit<u32> = VecTransmit::new();
    let limit = 10_000_000_000 * PS_PER_NS; // 10 s of simulated time
    while let Some((now, e)) = ev.pop_until(limit) {
        match e {
            Ev::Net(e) => {
                let Some(d) = net.handle(&mut ev, e) else { continue };
                if d.dst == n as u32 {
                    if let Verdict::WrongShard(s) = switch.handle_datagram(ns(now), d.src, &d.bytes, &mut sw_out) {
                        return Err(format!("single-shard switch answered WrongShard({s})"));
                    }
                    for (dest, b) in sw_out.drain() {
                        net.send(&mut ev, n as u32, dest, b);
                    }
                } else {
                    let w = d.dst as usize;
                    sessions[w].handle_datagram(ns(now), &d.bytes);
                    drive(w, &mut sessions, &mut ev, &mut net, &mut out, &mut armed, &mut done_at, &mut inputs, &mut verified, &mut retransmissions)?;
                }
            }
            Ev::Timer { worker } => {
                let w = worker as usize;
                if armed[w] != Some(now) {
                    continue; // superseded
                }
                armed[w] = None;
                sessions[w].handle_timeout(ns(now));
                drive(w, &mut sessions, &mut ev, &mut net, &mut out, &mut armed, &mut done_at, &mut inputs, &mut verified, &mut retransmissions)?;
            }
        }
        if done_at.iter().all(Option::is_some) {
            break;
        }
    }
    let last = done_at.iter().map(|t| t.ok_or("an allreduce did not finish within 10 s of simulated time")).collect::<Result<Vec<_>, _>>()?.into_iter().max().unwrap_or(0);
    let blocks = cfg.elements.div_ceil(cfg.elems_per_packet as usize) as u64;
    // Each worker's contributions serialised back to back on its uplink, the
    // last one's result coming back: one more datagram time and two delays.
    let bound = (blocks + 1) * tx_time(dgram, rate_bps) + 2 * delay;
    let secs = last as f64 * 1e-12;
    Ok(AllreduceResult {
        config: cfg.clone(),
        completion_us: last as f64 / 1e6,
        bound_us: bound as f64 / 1e6,
        goodput_gbps_per_worker: cfg.elements as f64 * 32.0 / secs / 1e9,
        retransmissions,
        datagrams: net.datagrams,
        link_drops: net.link_drops,
        queue_drops: net.queue_drops,
        verified,
        events: ev.events_handled(),
    })
}
