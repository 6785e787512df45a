//! A GOAT plan at packet level: one point of the plan validated with real
//! packets (docs/goat.md).
//!
//! The spec is what `fanin sim goat` writes from the deployment's own
//! translation of a plan (`fanin.goat.deploy.plan_jobs`): one fanin job per
//! sub-model g; the parameter server is a host aggregator, the root of every
//! job, with the switches of `from_switches` and the `direct_workers` as
//! members; a switch responsible for (g, workers W) runs job g with members W
//! and the PS as its parent — the responsibility filter. Every other datagram
//! is addressed to some other node and the fabric forwards it like any
//! switch. Each worker runs one `AllreduceSession` per sub-model towards its
//! aggregation node for g; every aggregation node is one `ValueSwitch`
//! holding all its jobs. The machines are fanin-proto's, unchanged.
//!
//! The flow-level evaluator counts what travels towards the aggregation
//! nodes and the PS; here every channel counts its bytes per message class
//! ([`Class`]), so contribution bytes (workers' fragments and switches'
//! partials) are measured on the links apart from the results that come
//! back down and from the join handshake. Workers run their sub-models one
//! after the other (as `fanin bench goat-deploy` does by default); every
//! worker's result of every sub-model is checked against the exact sum.

use std::collections::HashMap;
use std::time::Duration;

use fanin_proto::fault::SplitMix64;
use fanin_proto::host::{AllreduceSession, Event, SessionConfig, Tensor};
use fanin_proto::switch::{ShardConfig, Uplink, ValueSwitch, Verdict};
use fanin_proto::{JobSpec, Time, VecTransmit};
use fanin_wire::preamble::{MessageType, Preamble};
use fanin_wire::value::{Packet, ELEM_LEN, HEADER_LEN};
use serde::{Deserialize, Serialize};

use crate::fabric::{Fabric, LinkParams, NetEv, WIRE_OVERHEAD};
use crate::kernel::{EventQueue, Ps, PS_PER_NS};
use crate::scale::SpecNode;

/// A plan's jobs on a network (written by `fanin sim goat`).
#[derive(Debug, Clone, Deserialize)]
pub struct GoatSpec {
    pub name: String,
    pub nodes: Vec<SpecNode>,
    /// Undirected links `[a, b]`; link i is channels 2i (a -> b), 2i + 1.
    pub links: Vec<[u32; 2]>,
    /// Host node of worker rank r.
    pub workers: Vec<u32>,
    /// The parameter server's node.
    pub ps: u32,
    /// One job per sub-model, in sub-model order.
    pub jobs: Vec<GoatJob>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct GoatJob {
    pub job_id: u32,
    /// int32 elements of this sub-model.
    pub elements: usize,
    /// The PS (no parent) and the responsible switches (parent = the PS).
    pub aggregators: Vec<GoatAggregator>,
    /// Aggregation node of every worker rank for this sub-model.
    pub targets: Vec<u32>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct GoatAggregator {
    pub node: u32,
    pub parent: Option<u32>,
    /// Rank at the parent (switches only).
    pub rank: Option<u16>,
    pub members: Vec<u16>,
}

impl GoatSpec {
    pub fn validate(&self) -> Result<(), String> {
        let n = self.nodes.len() as u32;
        if let Some(l) = self.links.iter().find(|l| l[0] >= n || l[1] >= n || l[0] == l[1]) {
            return Err(format!("spec {}: bad link {l:?}", self.name));
        }
        if self.workers.is_empty() || self.jobs.is_empty() {
            return Err("spec: no workers or no jobs".into());
        }
        let host = |v: u32| v < n && !self.nodes[v as usize].switch;
        if !host(self.ps) || self.workers.iter().any(|&w| !host(w) || w == self.ps) {
            return Err("spec: the PS and the workers must be distinct host nodes".into());
        }
        for j in &self.jobs {
            if j.targets.len() != self.workers.len() || j.elements == 0 {
                return Err(format!("spec: job {} needs elements > 0 and one target per worker", j.job_id));
            }
            if j.aggregators.iter().filter(|a| a.parent.is_none()).count() != 1 {
                return Err(format!("spec: job {} needs exactly one root", j.job_id));
            }
            if let Some(t) = j.targets.iter().find(|&&t| !j.aggregators.iter().any(|a| a.node == t)) {
                return Err(format!("spec: job {}: a worker sends to node {t}, which does not run the job", j.job_id));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct GoatConfig {
    pub elems_per_packet: u16,
    /// Blocks in flight per session.
    pub window: u32,
    #[serde(flatten)]
    pub links: LinkParams,
    pub rto_min_us: u64,
    pub seed: u64,
}

impl Default for GoatConfig {
    fn default() -> Self {
        GoatConfig { elems_per_packet: 256, window: 32, links: LinkParams::default(), rto_min_us: 1000, seed: 1 }
    }
}

/// Message classes counted on every channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Contribution: a worker's fragment or a switch's partial aggregate.
    Contribution = 0,
    Retransmission = 1,
    /// The aggregate coming back down.
    Result = 2,
    /// Join, JoinAck, Sync, Nack, Membership.
    Control = 3,
}

const CLASSES: usize = 4;

fn classify(bytes: &[u8]) -> usize {
    (match Preamble::parse(bytes).map(|p| p.msg_type) {
        Ok(MessageType::Contribution) => Class::Contribution,
        Ok(MessageType::Retransmission) => Class::Retransmission,
        Ok(MessageType::Result) => Class::Result,
        _ => Class::Control,
    }) as usize
}

/// Bytes every packet adds to its payload: fanin's header and
/// Ethernet/IPv4/UDP.
pub const PACKET_OVERHEAD: u64 = HEADER_LEN as u64 + WIRE_OVERHEAD as u64;

/// Wire bytes (overhead included) of one copy of an `elements`-int32
/// sub-model in packets of `epp`: the packetisation the flow-level model
/// leaves out.
pub fn wire_bytes(elements: usize, epp: u16) -> u64 {
    let packets = elements.div_ceil(epp as usize) as u64;
    packets * PACKET_OVERHEAD + (elements * ELEM_LEN) as u64
}

#[derive(Debug, Clone, Serialize)]
pub struct GoatResult {
    /// From the common start (every session joined) to the last result.
    pub completion_us: f64,
    pub join_us: f64,
    /// Every worker's result of every sub-model equals the exact sum.
    pub exact: bool,
    pub retransmissions: u64,
    pub queue_drops: u64,
    pub link_drops: u64,
    pub datagrams: u64,
    pub events: u64,
    /// Per channel (2i: link i a -> b, 2i + 1: b -> a): bytes per [`Class`].
    pub class_bytes: Vec<Vec<u64>>,
    /// Per channel: every byte sent.
    pub sent_bytes: Vec<u64>,
    /// Contribution bytes the PS received (its ingress, per class 0 + 1).
    pub ps_contribution_bytes: u64,
    /// Contribution bytes the workers put on their first link.
    pub worker_contribution_bytes: u64,
    /// Per job: contributions the PS's `ValueSwitch` received, in packets.
    pub ps_packets_per_job: Vec<u64>,
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    Net(NetEv),
    WorkerTimer(u32, u32),
    AggTimer(u32),
}

impl From<NetEv> for Ev {
    fn from(e: NetEv) -> Self {
        Ev::Net(e)
    }
}

/// Simulated time after which a run is abandoned.
const LIMIT: Ps = 60_000_000_000 * PS_PER_NS;

fn ns(t: Ps) -> Time {
    Time::from_nanos(t / PS_PER_NS)
}

fn ps(t: Time) -> Ps {
    t.as_nanos() * PS_PER_NS
}

struct Run<'a> {
    spec: &'a GoatSpec,
    ev: EventQueue<Ev>,
    net: Fabric,
    /// Aggregation nodes (the PS and responsible switches) and node -> index.
    aggs: Vec<(u32, ValueSwitch<u32>)>,
    agg_of_node: HashMap<u32, usize>,
    agg_armed: Vec<Option<Ps>>,
    /// sessions[w][g]
    sessions: Vec<Vec<AllreduceSession>>,
    armed: Vec<Vec<Option<Ps>>>,
    worker_of_node: HashMap<u32, usize>,
    job_index: HashMap<u32, usize>,
    inputs: Vec<Vec<Option<Vec<i32>>>>,
    expected: Vec<Vec<i32>>,
    /// Next sub-model each worker begins (sub-models run one after the other).
    next: Vec<usize>,
    joined: usize,
    start: Option<Ps>,
    done: usize,
    last: Ps,
    exact: bool,
    retransmissions: u64,
    ps_packets: Vec<u64>,
}

/// Run every sub-model's allreduce on every worker once.
pub fn run(spec: &GoatSpec, cfg: &GoatConfig, progress: &mut dyn FnMut(usize, usize)) -> Result<GoatResult, String> {
    spec.validate()?;
    let mut r = Run::new(spec, cfg)?;
    r.go(progress)
}

impl<'a> Run<'a> {
    fn new(spec: &'a GoatSpec, cfg: &GoatConfig) -> Result<Self, String> {
        let n = spec.workers.len();
        let is_switch: Vec<bool> = spec.nodes.iter().map(|v| v.switch).collect();
        let links: Vec<(u32, u32)> = spec.links.iter().map(|l| (l[0], l[1])).collect();
        let max_dgram = (HEADER_LEN + ELEM_LEN * cfg.elems_per_packet as usize) as u64 + WIRE_OVERHEAD as u64;
        let net = Fabric::new(&is_switch, &links, cfg.links.channel_config(max_dgram, cfg.seed)).with_classes(CLASSES, classify);
        let name = |v: u32| spec.nodes[v as usize].name.clone();
        let mut aggs: Vec<(u32, ValueSwitch<u32>)> = Vec::new();
        let mut agg_of_node = HashMap::new();
        for j in &spec.jobs {
            let mut job = JobSpec::with_sources(j.job_id, 1, cfg.window, cfg.elems_per_packet as u32);
            job.workers = n as u16;
            for a in &j.aggregators {
                let i = *agg_of_node.entry(a.node).or_insert_with(|| {
                    aggs.push((a.node, ValueSwitch::new(ShardConfig::single(1 << 34))));
                    aggs.len() - 1
                });
                let sw = &mut aggs[i].1;
                sw.add_job(JobSpec { members: a.members.clone(), ..job.clone() }).map_err(|e| format!("{} job {}: {e}", name(a.node), j.job_id))?;
                let uplink = match (a.parent, a.rank) {
                    (Some(p), Some(rank)) => Some(Uplink { parent: vec![p], rank }),
                    (None, _) => None,
                    (Some(_), None) => return Err(format!("{} job {}: a parent but no rank", name(a.node), j.job_id)),
                };
                sw.set_uplink(j.job_id, uplink).map_err(|e| e.to_string())?;
            }
        }
        let mut rng = SplitMix64::new(cfg.seed ^ 0x60A7);
        let mut inputs = vec![Vec::new(); n];
        let mut expected = Vec::new();
        for j in &spec.jobs {
            let mut sum = vec![0i32; j.elements];
            for input in inputs.iter_mut() {
                let v: Vec<i32> = (0..j.elements).map(|_| rng.next_u64() as i32).collect();
                for (s, x) in sum.iter_mut().zip(&v) {
                    *s = s.wrapping_add(*x);
                }
                input.push(Some(v));
            }
            expected.push(sum);
        }
        let sessions = (0..n)
            .map(|w| {
                spec.jobs
                    .iter()
                    .map(|j| {
                        let mut c = SessionConfig::new(j.job_id, w as u16);
                        c.elems_per_packet = cfg.elems_per_packet;
                        c.window = cfg.window;
                        c.rto_initial = Duration::from_micros(cfg.rto_min_us.max(200));
                        c.rto_min = Duration::from_micros(cfg.rto_min_us);
                        c.dead_after = Duration::from_secs(60);
                        c.join_timeout = Duration::from_secs(60);
                        AllreduceSession::new(c, Time::ZERO)
                    })
                    .collect()
            })
            .collect();
        let g = spec.jobs.len();
        Ok(Run {
            spec,
            ev: EventQueue::new(),
            net,
            agg_armed: vec![None; aggs.len()],
            aggs,
            agg_of_node,
            sessions,
            armed: vec![vec![None; g]; n],
            worker_of_node: spec.workers.iter().enumerate().map(|(i, &h)| (h, i)).collect(),
            job_index: spec.jobs.iter().enumerate().map(|(i, j)| (j.job_id, i)).collect(),
            inputs,
            expected,
            next: vec![0; n],
            joined: 0,
            start: None,
            done: 0,
            last: 0,
            exact: true,
            retransmissions: 0,
            ps_packets: vec![0; g],
        })
    }

    fn go(&mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<GoatResult, String> {
        let n = self.sessions.len();
        for w in 0..n {
            for g in 0..self.spec.jobs.len() {
                self.drive(w, g, progress)?;
            }
        }
        while self.done < n {
            let Some((now, e)) = self.ev.pop_until(LIMIT) else { break };
            match e {
                Ev::Net(e) => {
                    let Some(d) = self.net.handle(&mut self.ev, e) else { continue };
                    if let Some(&a) = self.agg_of_node.get(&d.dst) {
                        if d.dst == self.spec.ps && classify(&d.bytes) <= Class::Retransmission as usize {
                            if let Some(&g) = Packet::new_checked(&d.bytes[..]).ok().and_then(|p| self.job_index.get(&p.job_id())) {
                                self.ps_packets[g] += 1;
                            }
                        }
                        let mut out = VecTransmit::new();
                        // one shard: a Join's effects need passing on to no other
                        if let Verdict::WrongShard(k) = self.aggs[a].1.handle_datagram(ns(now), d.src, &d.bytes, &mut out) {
                            return Err(format!("single-shard aggregator answered WrongShard({k})"));
                        }
                        self.agg_sent(a, out);
                    } else {
                        let w = *self.worker_of_node.get(&d.dst).ok_or_else(|| format!("datagram for node {}, which runs nothing", d.dst))?;
                        let job = Packet::new_checked(&d.bytes[..]).map_err(|e| format!("worker {w}: undecodable datagram: {e}"))?.job_id();
                        let g = *self.job_index.get(&job).ok_or_else(|| format!("worker {w}: datagram of unknown job {job}"))?;
                        self.sessions[w][g].handle_datagram(ns(now), &d.bytes);
                        self.drive(w, g, progress)?;
                    }
                }
                Ev::WorkerTimer(w, g) => {
                    let (w, g) = (w as usize, g as usize);
                    if self.armed[w][g] == Some(now) {
                        self.armed[w][g] = None;
                        self.sessions[w][g].handle_timeout(ns(now));
                        self.drive(w, g, progress)?;
                    }
                }
                Ev::AggTimer(a) => {
                    let a = a as usize;
                    if self.agg_armed[a] == Some(now) {
                        self.agg_armed[a] = None;
                        let mut out = VecTransmit::new();
                        self.aggs[a].1.handle_timeout(ns(now), &mut out);
                        self.agg_sent(a, out);
                    }
                }
            }
        }
        if self.done < n {
            return Err("the allreduces did not finish within 60 s of simulated time".into());
        }
        // let what is still queued or in flight arrive, so every channel's bytes add up
        while let Some((_, e)) = self.ev.pop_until(LIMIT * 2) {
            if let Ev::Net(e) = e {
                self.net.handle(&mut self.ev, e);
            }
        }
        let start = self.start.unwrap_or(0);
        let chans = self.net.channels();
        let class_bytes: Vec<Vec<u64>> = (0..chans).map(|c| self.net.class_sent_bytes(c).to_vec()).collect();
        let contrib = |c: usize| class_bytes[c][Class::Contribution as usize] + class_bytes[c][Class::Retransmission as usize];
        // channel 2i carries link i from a to b, 2i + 1 from b to a
        let into = |v: u32| -> u64 { self.spec.links.iter().enumerate().map(|(i, l)| if l[1] == v { contrib(2 * i) } else if l[0] == v { contrib(2 * i + 1) } else { 0 }).sum() };
        let out_of = |v: u32| -> u64 { self.spec.links.iter().enumerate().map(|(i, l)| if l[0] == v { contrib(2 * i) } else if l[1] == v { contrib(2 * i + 1) } else { 0 }).sum() };
        Ok(GoatResult {
            completion_us: (self.last - start) as f64 / 1e6,
            join_us: start as f64 / 1e6,
            exact: self.exact,
            retransmissions: self.retransmissions,
            queue_drops: self.net.queue_drops,
            link_drops: self.net.link_drops,
            datagrams: self.net.datagrams,
            events: self.ev.events_handled(),
            ps_contribution_bytes: into(self.spec.ps),
            worker_contribution_bytes: self.spec.workers.iter().map(|&w| out_of(w)).sum(),
            sent_bytes: (0..chans).map(|c| self.net.channel_stats(c).sent_bytes).collect(),
            class_bytes,
            ps_packets_per_job: std::mem::take(&mut self.ps_packets),
        })
    }

    fn agg_sent(&mut self, a: usize, mut out: VecTransmit<u32>) {
        let node = self.aggs[a].0;
        for (dest, b) in out.drain() {
            self.net.send(&mut self.ev, node, dest, b);
        }
        if let Some(t) = self.aggs[a].1.poll_timeout() {
            let t = ps(t).max(self.ev.now());
            if self.agg_armed[a] != Some(t) {
                self.agg_armed[a] = Some(t);
                self.ev.schedule(t, Ev::AggTimer(a as u32));
            }
        }
    }

    /// Begin worker w's next sub-model if its session has joined.
    fn begin_next(&mut self, w: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<(), String> {
        let g = self.next[w];
        if g < self.spec.jobs.len() {
            let t = self.inputs[w][g].take().ok_or("began twice")?;
            self.sessions[w][g].begin(ns(self.ev.now()), Tensor::I32(t)).map_err(|e| e.to_string())?;
            self.drive(w, g, progress)?;
        }
        Ok(())
    }

    /// The session's calling contract: events, transmissions, timer.
    fn drive(&mut self, w: usize, g: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<(), String> {
        let now = self.ev.now();
        while let Some(e) = self.sessions[w][g].poll_event() {
            match e {
                Event::Joined(_) => {
                    // all sessions join first; the allreduces start together once they have
                    self.joined += 1;
                    if self.joined == self.sessions.len() * self.spec.jobs.len() {
                        self.start = Some(now);
                        for v in 0..self.sessions.len() {
                            self.begin_next(v, progress)?;
                        }
                    }
                }
                Event::Completed(o) => {
                    self.retransmissions += o.retransmissions;
                    self.exact &= matches!(&o.tensor, Tensor::I32(v) if *v == self.expected[g]);
                    self.next[w] += 1;
                    if self.next[w] == self.spec.jobs.len() {
                        self.done += 1;
                        self.last = self.last.max(now);
                        progress(self.done, self.sessions.len());
                    } else {
                        self.begin_next(w, progress)?;
                    }
                }
                Event::Failed(e) => return Err(format!("worker {w} sub-model {g}: {e}")),
                Event::Membership { .. } => {}
            }
        }
        let mut out = VecTransmit::new();
        while self.sessions[w][g].poll_transmit(ns(now), &mut out) > 0 {}
        let (host, target) = (self.spec.workers[w], self.spec.jobs[g].targets[w]);
        for (_, bytes) in out.drain() {
            self.net.send(&mut self.ev, host, target, bytes);
        }
        if let Some(t) = self.sessions[w][g].poll_timeout() {
            let t = ps(t).max(now);
            if self.armed[w][g] != Some(t) {
                self.armed[w][g] = Some(t);
                self.ev.schedule(t, Ev::WorkerTimer(w as u32, g as u32));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scale::SpecNode;

    fn node(name: &str, switch: bool) -> SpecNode {
        SpecNode { name: name.into(), switch }
    }

    /// Two racks under one spine; the PS hangs off the spine. Sub-model 0
    /// is aggregated by rack switch r0 for its two workers, the others send
    /// it straight to the PS; sub-model 1 goes to the PS from everyone.
    fn spec() -> GoatSpec {
        let nodes = vec![node("w0", false), node("w1", false), node("w2", false), node("w3", false), node("ps", false),
                         node("r0", true), node("r1", true), node("sp", true)];
        GoatSpec {
            name: "two-racks".into(),
            nodes,
            links: vec![[0, 5], [1, 5], [2, 6], [3, 6], [5, 7], [6, 7], [4, 7]],
            workers: vec![0, 1, 2, 3],
            ps: 4,
            jobs: vec![
                GoatJob { job_id: 100, elements: 1000, targets: vec![5, 5, 4, 4], aggregators: vec![
                    GoatAggregator { node: 4, parent: None, rank: None, members: vec![2, 3, 2053] },
                    GoatAggregator { node: 5, parent: Some(4), rank: Some(2053), members: vec![0, 1] },
                ] },
                GoatJob { job_id: 101, elements: 700, targets: vec![4; 4], aggregators: vec![
                    GoatAggregator { node: 4, parent: None, rank: None, members: vec![0, 1, 2, 3] },
                ] },
            ],
        }
    }

    #[test]
    fn responsibility_filter_counts_match_the_plan() {
        let s = spec();
        let cfg = GoatConfig::default();
        let r = run(&s, &cfg, &mut |_, _| {}).unwrap();
        assert!(r.exact);
        assert_eq!(r.retransmissions, 0);
        let (b0, b1) = (wire_bytes(1000, cfg.elems_per_packet), wire_bytes(700, cfg.elems_per_packet));
        // PS: sub-model 0 once from r0 and from w2, w3; sub-model 1 from all four
        assert_eq!(r.ps_contribution_bytes, 3 * b0 + 4 * b1);
        assert_eq!(r.ps_packets_per_job, vec![3 * 4, 4 * 3]);
        assert_eq!(r.worker_contribution_bytes, 4 * (b0 + b1));
        // bytes x hops: w0, w1 -> r0 (1 hop each), r0 -> ps (2), w2, w3 -> ps (3 each); sub-model 1: 3 hops x 4
        let total: u64 = r.class_bytes.iter().map(|c| c[Class::Contribution as usize]).sum();
        assert_eq!(total, (2 + 2 + 6) * b0 + 12 * b1);
        // results come back down to every worker
        assert!(r.class_bytes.iter().map(|c| c[Class::Result as usize]).sum::<u64>() > 0);
    }

    #[test]
    fn a_target_without_the_job_is_refused() {
        let mut s = spec();
        s.jobs[1].targets[0] = 5;
        assert!(run(&s, &GoatConfig::default(), &mut |_, _| {}).unwrap_err().contains("does not run the job"));
    }
}
