//! The trimming paper's end-to-end experiments (§6.5, Figs. 13 and 14) at
//! packet level: what small switch buffers do for latency-sensitive
//! requests that share a destination with a long-lived incast.
//!
//! One switch, 25 Gbit/s links (the paper's testbed rate). Host 0 is the
//! destination; hosts 1..=`incast` send it endless flows when it is busy;
//! host `incast + 1` pings it; the next `clients` hosts run closed-loop
//! request/response clients against it (memcslap's pattern: a client sends
//! its next request when the previous response arrived).
//!
//! * **baseline** ("vanilla"): drop-tail switch with a `baseline_queue_pkts`
//!   buffer (the paper's 200 packets), TCP-like window senders (Reno on
//!   per-packet ACKs, fast retransmit, `rto` timeout) for everything.
//! * **trimming**: NDP trimming switch with a `trimming_queue_pkts` data
//!   queue (the paper's 12 packets) and NDP hosts (the paper's EQDS).
//!
//! Deviations (docs/simulator.md): one switch instead of the leaf-spine
//! testbed; no host stack delay; control packets (ACKs) use the switch's
//! priority header queue in both systems; a ping is a one-packet request
//! answered by a one-packet reply of the same transport (ICMP would not be
//! resent; a lost one is counted in `resent`).

use serde::Serialize;
use serde_json::{json, Value};

use crate::kernel::{percentile, Ps, PS_PER_NS, PS_PER_US};
use crate::ndp::{Transport, WindowState};
use crate::net::{Link, NetConfig, Sim, SwitchModel};
use crate::topo::single_switch;
use fanin_proto::trim::QueueConfig;

/// The two systems of Figs. 13 and 14.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum System {
    Baseline,
    Trimming,
}

impl System {
    pub fn name(self) -> &'static str {
        match self {
            System::Baseline => "baseline",
            System::Trimming => "trimming",
        }
    }
}

/// Parameters (defaults: the paper's §6.5 where it gives them).
#[derive(Debug, Clone, Serialize)]
pub struct EndToEnd {
    pub rate_gbps: u64,
    pub link_delay_ns: u64,
    pub mtu: u32,
    /// Drop-tail buffer of the baseline switch, per port (packets).
    pub baseline_queue_pkts: u32,
    /// Data queue of the trimming switch, per port (packets).
    pub trimming_queue_pkts: u32,
    /// Long-lived flows into the destination when it is busy ("nine other
    /// TCP connections").
    pub incast: u32,
    /// Retransmission timeout of both systems' hosts.
    pub rto_us: u64,
    /// Incast time before the first request, so the queue has built.
    pub warmup_us: u64,
    pub pings: u32,
    pub ping_interval_us: u64,
    pub ping_bytes: u32,
    pub requests_per_client: u32,
    pub request_bytes: u32,
    pub response_bytes: u32,
    pub seed: u64,
}

impl Default for EndToEnd {
    fn default() -> Self {
        Self {
            rate_gbps: 25,
            link_delay_ns: 1000,
            mtu: 1500,
            baseline_queue_pkts: 200,
            trimming_queue_pkts: 12,
            incast: 9,
            rto_us: 1000,
            warmup_us: 500,
            pings: 200,
            ping_interval_us: 20,
            ping_bytes: 64,
            requests_per_client: 1000,
            request_bytes: 100,
            response_bytes: 1100,
            seed: 1,
        }
    }
}

impl EndToEnd {
    fn sim(&self, system: System, clients: u32) -> Sim {
        let queue = match system {
            System::Baseline => QueueConfig { data_capacity_bytes: self.baseline_queue_pkts as u64 * self.mtu as u64, ..QueueConfig::ndp(self.mtu) },
            System::Trimming => QueueConfig { data_capacity_bytes: self.trimming_queue_pkts as u64 * self.mtu as u64, ..QueueConfig::ndp(self.mtu) },
        };
        let cfg = NetConfig {
            mtu: self.mtu,
            switch_queue: queue,
            model: match system {
                System::Baseline => SwitchModel::DropTail,
                System::Trimming => SwitchModel::Ideal,
            },
            // NDP's unsolicited burst: about a bandwidth-delay product here
            initial_window: 12,
            rto: self.rto_us * PS_PER_US,
            seed: self.seed,
            ..NetConfig::default()
        };
        let hosts = 1 + self.incast as usize + 1 + clients as usize;
        single_switch(cfg, hosts, Link::gbps(self.rate_gbps, self.link_delay_ns))
    }

    fn transport(system: System) -> Transport {
        match system {
            System::Baseline => Transport::Window(WindowState::reno()),
            System::Trimming => Transport::Ndp,
        }
    }

    fn start_incast(&self, sim: &mut Sim, system: System, busy: bool) {
        if busy {
            for h in 1..=self.incast {
                sim.add_flow_with(h, 0, u32::MAX, Some(h as Ps * 97 * PS_PER_NS), Self::transport(system), None);
            }
        }
    }

    /// Fig. 13: ping round-trip times to the destination, idle or busy.
    pub fn ping(&self, system: System, busy: bool) -> Value {
        let mut sim = self.sim(system, 0);
        self.start_incast(&mut sim, system, busy);
        let pinger = self.incast + 1;
        let t = Self::transport(system);
        let mut pairs = Vec::new();
        for i in 0..self.pings {
            let start = (self.warmup_us + i as u64 * self.ping_interval_us) * PS_PER_US;
            let request = sim.add_flow_with(pinger, 0, 1, Some(start), t, Some(self.ping_bytes));
            let reply = sim.add_flow_with(0, pinger, 1, None, t, Some(self.ping_bytes));
            sim.flows[request as usize].then = Some((reply, 0));
            pairs.push((request, reply));
        }
        let end = (self.warmup_us + self.pings as u64 * self.ping_interval_us) * PS_PER_US + 100 * self.rto_us * PS_PER_US;
        sim.run_until(end);
        let mut rtts = Vec::new();
        let (mut lost, mut resent) = (0, 0);
        for (req, rep) in pairs {
            let (q, p) = (&sim.flows[req as usize], &sim.flows[rep as usize]);
            resent += (q.stats.retransmissions + p.stats.retransmissions > 0) as u32;
            match p.stats.finished_at_ps {
                Some(done) => rtts.push((done - q.start) as f64 / PS_PER_US as f64),
                None => lost += 1,
            }
        }
        json!({"system": system.name(), "busy": busy, "pings": self.pings, "answered": rtts.len(), "unanswered": lost,
               "resent": resent, "rtt_us": summary(&mut rtts), "switch": sim.stats})
    }

    /// Fig. 14: `clients` closed-loop clients, `requests_per_client` each;
    /// the time until the last response, idle or busy.
    pub fn requests(&self, system: System, busy: bool, clients: u32) -> Value {
        let mut sim = self.sim(system, clients);
        self.start_incast(&mut sim, system, busy);
        let t = Self::transport(system);
        let first = self.incast + 2;
        let mut chains = Vec::new();
        let t0 = self.warmup_us * PS_PER_US;
        for c in 0..clients {
            let host = first + c;
            let mut prev: Option<u32> = None;
            let mut chain = Vec::new();
            for _ in 0..self.requests_per_client {
                let start = if prev.is_none() { Some(t0 + c as Ps * 13 * PS_PER_NS) } else { None };
                let request = sim.add_flow_with(host, 0, 1, start, t, Some(self.request_bytes));
                let response = sim.add_flow_with(0, host, 1, None, t, Some(self.response_bytes));
                sim.flows[request as usize].then = Some((response, 0));
                if let Some(p) = prev {
                    sim.flows[p as usize].then = Some((request, 0));
                }
                prev = Some(response);
                chain.push((request, response));
            }
            chains.push(chain);
        }
        // generous: every request may meet a timeout
        let end = t0 + self.requests_per_client as u64 * (200 + 2 * self.rto_us) * PS_PER_US;
        sim.run_until(end);
        let mut done_at = 0;
        let (mut completed, mut resent) = (0u64, 0u64);
        let mut latencies = Vec::new();
        for chain in &chains {
            for &(req, rep) in chain {
                let (q, p) = (&sim.flows[req as usize], &sim.flows[rep as usize]);
                resent += (q.stats.retransmissions + p.stats.retransmissions > 0) as u64;
                if let Some(d) = p.stats.finished_at_ps {
                    completed += 1;
                    done_at = done_at.max(d);
                    latencies.push((d - q.start) as f64 / PS_PER_US as f64);
                }
            }
        }
        let total = completed as u32 == clients * self.requests_per_client;
        json!({"system": system.name(), "busy": busy, "clients": clients, "requests": clients * self.requests_per_client,
               "completed": completed, "all_completed": total, "resent": resent,
               "total_ms": total.then(|| (done_at - t0) as f64 / 1e9), "latency_us": summary(&mut latencies),
               "switch": sim.stats})
    }
}

/// Median, 99th percentile, mean and max of `v` (µs), or null if empty.
fn summary(v: &mut [f64]) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    json!({"median": round2(percentile(v, 0.5)), "p99": round2(percentile(v, 0.99)), "mean": round2(mean),
           "max": round2(percentile(v, 1.0))})
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Both figures: ping RTTs and closed-loop request times, each system idle
/// and busy; `clients` the client counts of Fig. 14.
pub fn figures(e: &EndToEnd, clients: &[u32]) -> Value {
    let mut pings = Vec::new();
    let mut requests = Vec::new();
    for system in [System::Baseline, System::Trimming] {
        for busy in [false, true] {
            pings.push(e.ping(system, busy));
            for &c in clients {
                requests.push(e.requests(system, busy, c));
            }
        }
    }
    json!({"params": e, "pings": pings, "requests": requests})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick() -> EndToEnd {
        EndToEnd { pings: 40, requests_per_client: 40, ..EndToEnd::default() }
    }

    #[test]
    fn idle_pings_take_a_few_microseconds_in_both_systems() {
        for system in [System::Baseline, System::Trimming] {
            let r = quick().ping(system, false);
            assert_eq!(r["unanswered"], 0);
            let median = r["rtt_us"]["median"].as_f64().unwrap();
            // 4 hops of 1 µs and two 64 B packets: about 4 µs
            assert!((3.0..6.0).contains(&median), "{}: {median}", system.name());
        }
    }

    #[test]
    fn a_busy_destination_delays_pings_by_its_queue_and_small_buffers_keep_that_small() {
        let e = quick();
        let base = e.ping(System::Baseline, true);
        let trim = e.ping(System::Trimming, true);
        let (b, t) = (base["rtt_us"]["median"].as_f64().unwrap(), trim["rtt_us"]["median"].as_f64().unwrap());
        // 200 packets of 1500 B at 25 Gbit/s: 96 µs of queue; 12 packets: 5.8 µs
        assert!(b > 60.0, "baseline {b} µs");
        assert!(t < 20.0, "trimming {t} µs");
        assert!(base["switch"]["drops_data_queue"].as_u64().unwrap() > 0, "the incast overflows the drop-tail buffer");
        assert!(trim["switch"]["trims_queue"].as_u64().unwrap() > 0);
    }

    #[test]
    fn closed_loop_requests_complete_and_slow_down_far_less_with_trimming() {
        let e = quick();
        let total = |s, busy| e.requests(s, busy, 2)["total_ms"].as_f64().expect("all completed");
        let (bi, bb) = (total(System::Baseline, false), total(System::Baseline, true));
        let (ti, tb) = (total(System::Trimming, false), total(System::Trimming, true));
        assert!(bb / bi > 5.0, "baseline idle {bi} ms, busy {bb} ms");
        assert!(tb / ti < bb / bi / 2.0, "trimming idle {ti} ms, busy {tb} ms; baseline {bi} / {bb}");
    }
}
