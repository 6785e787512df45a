//! Aggregation at scale (docs/simulator.md): fanin's multi-level aggregation
//! tree against ring allreduce, on the same simulated network.
//!
//! The network and the tree come from a [`Spec`] that the Python controller
//! writes (`fanin sim allreduce`): the topology's nodes and links
//! (`fanin.topology`) and the tree `fanin.controller.tree` builds over it
//! (which switches aggregate, each one's parent, rank and members). The
//! simulator neither generates topologies nor computes trees here, so a
//! simulated tree is the tree the controller would program.
//!
//! * **fanin**: every worker runs `fanin_proto::host::AllreduceSession`,
//!   every tree switch a `fanin_proto::switch::ValueSwitch` with its uplink
//!   set (the shipped machines, unchanged; one shard per switch, except
//!   that a root spread over several switches runs one shard per share).
//! * **ring**: reduce-scatter then all-gather, 2(N-1) steps; at step s worker
//!   j sends chunk (j - s) mod N (S/N elements, packets of the same size as
//!   fanin's) to worker j + 1, which adds it (reduce-scatter) or stores it
//!   (all-gather). A worker sends step s once it holds step s - 1 from its
//!   predecessor. Every data packet is acknowledged; a sender keeps at most
//!   `window` packets unacknowledged and retransmits after an adaptive
//!   timeout (3 x smoothed RTT, at least `rto_min`, 200 µs before the first
//!   sample: the fanin sessions' initial and minimum RTO).
//!
//! Both run over [`Fabric`] with the same links, loss and routes, so their
//! completion times and per-link bytes compare directly. int32 results are
//! checked against the reference sum on every worker.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use fanin_proto::fault::SplitMix64;
use fanin_proto::host::{AllreduceSession, Event, SessionConfig, Tensor};
use fanin_proto::switch::{ShardConfig, Uplink, ValueSwitch, Verdict};
use fanin_proto::{JobSpec, Time, VecTransmit};
use fanin_wire::value::{ELEM_LEN, HEADER_LEN};
use serde::{Deserialize, Serialize};

use crate::fabric::{BackgroundFlow, BackgroundStats, ChannelStats, Fabric, LinkParams, NetEv, TofinoStats, WIRE_OVERHEAD};
use crate::kernel::{tx_time, EventQueue, Ps, PS_PER_NS};

/// The network and the aggregation tree (written by `fanin sim allreduce`).
#[derive(Debug, Clone, Deserialize)]
pub struct Spec {
    pub name: String,
    /// Node id = index.
    pub nodes: Vec<SpecNode>,
    /// Undirected links `[a, b]`; link i is channels 2i (a -> b), 2i + 1.
    pub links: Vec<[u32; 2]>,
    /// Workers in rank order (rank i is `workers[i]`).
    pub workers: Vec<SpecWorker>,
    /// Every switch of the aggregation tree.
    pub tree: Vec<SpecSwitch>,
    /// A root spread over several switches (docs/simulator.md, "One job,
    /// many roots"): the tree's root first, then the switches that share
    /// its role, each the root of the blocks `shard_of` gives its index,
    /// as the shards of one switch daemon are; the root's children send
    /// each block's partial to its root. A switch may be listed more than
    /// once: it then runs that many shards of the root, and takes that
    /// share of the blocks (weighted roots, `--root-weights spare`). Empty:
    /// one root.
    #[serde(default)]
    pub root_shards: Vec<u32>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SpecNode {
    pub name: String,
    pub switch: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SpecWorker {
    pub rank: u16,
    pub host: u32,
    /// The tree switch it sends to.
    pub switch: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SpecSwitch {
    pub node: u32,
    /// None at the root.
    pub parent: Option<u32>,
    /// Rank at the parent (SWITCH_RANK_BASE + topology index).
    pub rank: Option<u16>,
    /// Worker ranks and child switches' ranks.
    pub members: Vec<u16>,
}

impl Spec {
    pub fn validate(&self) -> Result<(), String> {
        let n = self.nodes.len() as u32;
        if let Some(l) = self.links.iter().find(|l| l[0] >= n || l[1] >= n || l[0] == l[1]) {
            return Err(format!("spec {}: bad link {l:?}", self.name));
        }
        if self.workers.is_empty() {
            return Err("spec: no workers".into());
        }
        for (i, w) in self.workers.iter().enumerate() {
            if w.rank as usize != i || w.host >= n || self.nodes[w.host as usize].switch {
                return Err(format!("spec: worker {i} must have rank {i} and a host node (got {w:?})"));
            }
        }
        let roots: Vec<&SpecSwitch> = self.tree.iter().filter(|s| s.parent.is_none()).collect();
        if roots.len() != 1 {
            return Err("spec: the tree needs exactly one root".into());
        }
        if let Some(&first) = self.root_shards.first() {
            if first != roots[0].node || self.root_shards.len() > u16::MAX as usize {
                return Err(format!("spec: root_shards must start with the tree's root (node {})", roots[0].node));
            }
            for &r in &self.root_shards[1..] {
                if r >= n || !self.nodes[r as usize].switch || (r != first && self.tree.iter().any(|s| s.node == r)) {
                    return Err(format!("spec: root shard {r} must be the root or a switch outside the tree"));
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleConfig {
    /// int32 elements per worker.
    pub elements: usize,
    pub elems_per_packet: u16,
    /// Packets (fanin: blocks) in flight per worker.
    pub window: u32,
    #[serde(flatten)]
    pub links: LinkParams,
    /// Fraction of workers that start late, by `straggler_delay_us`.
    pub stragglers: f64,
    pub straggler_delay_us: u64,
    /// fanin's block aging (0 = off): the switch completes a block without
    /// the late sources after this long (results are then degraded).
    pub block_exp_ms: u32,
    pub rto_min_us: u64,
    pub seed: u64,
    /// Background traffic: every host that runs no worker sends full-size
    /// datagrams at this fraction of its link rate to another such host (a
    /// seeded derangement), for the whole run (0 = none).
    pub background_load: f64,
    /// The background flows are congestion-controlled (AIMD on their rate,
    /// `fabric::BackgroundFlow::responsive`), not constant-rate.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub background_responsive: bool,
    /// Simulated time after which a run is abandoned with an error (a
    /// hop that background traffic starves can hold a run for simulated
    /// seconds, hours of wall time with background events).
    pub time_limit_ms: u64,
}

impl Default for ScaleConfig {
    fn default() -> Self {
        ScaleConfig {
            elements: 1 << 18,
            elems_per_packet: 256,
            window: 128,
            links: LinkParams::default(),
            stragglers: 0.0,
            straggler_delay_us: 0,
            block_exp_ms: 0,
            rto_min_us: 50,
            seed: 1,
            background_load: 0.0,
            background_responsive: false,
            time_limit_ms: 60_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    Fanin,
    Ring,
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fanin" => Ok(Algorithm::Fanin),
            "ring" => Ok(Algorithm::Ring),
            _ => Err(format!("unknown algorithm {s:?} (fanin, ring)")),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleResult {
    pub algorithm: Algorithm,
    /// fanin: time until every session had joined the job (the one-time
    /// handshake, not part of the allreduce; its retry interval is 50 ms,
    /// so one lost join message costs 50 ms). 0 for ring.
    pub join_us: f64,
    /// Time from the common start until the last worker had its result.
    pub completion_us: f64,
    pub mean_completion_us: f64,
    /// Every worker's result equals the reference sum.
    pub exact: bool,
    /// fanin with aging: blocks that completed without every source.
    pub degraded_blocks: u64,
    pub retransmissions: u64,
    pub datagrams: u64,
    pub queue_drops: u64,
    pub link_drops: u64,
    /// Datagrams a trimming link queue cut to their header (`--trimming`).
    #[serde(skip_serializing_if = "is_zero")]
    pub trims: u64,
    /// Datagrams a switch queue marked ECN CE (`--ecn-pkts`); the ring's
    /// flows ignore the marks, fanin's workers and switches act on them.
    #[serde(skip_serializing_if = "is_zero")]
    pub ce_marks: u64,
    /// The Tofino design's ingress trims, deflections and notifications
    /// (`--trimming --tofino`).
    #[serde(skip_serializing_if = "is_default")]
    pub tofino: TofinoStats,
    pub events: u64,
    /// Ranks that started late.
    pub stragglers: Vec<u16>,
    /// The background flows and what they carried during the run.
    pub background: BackgroundStats,
    /// Per channel (2i: link i a -> b, 2i + 1: b -> a).
    pub channels: Vec<ChannelStats>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_default(t: &TofinoStats) -> bool {
    *t == TofinoStats::default()
}

/// Progress callback: (workers done, workers).
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize);

fn ns(t: Ps) -> Time {
    Time::from_nanos(t / PS_PER_NS)
}

fn ps(t: Time) -> Ps {
    t.as_nanos() * PS_PER_NS
}

/// Inputs, reference sum and the late-start delay of every worker: the
/// same for both algorithms.
struct Workload {
    inputs: Vec<Vec<i32>>,
    expected: Vec<i32>,
    delay: Vec<Ps>,
    /// Other tenants' flows (`background_load`), started with the run.
    background: Vec<BackgroundFlow>,
}

impl Workload {
    fn new(n: usize, cfg: &ScaleConfig) -> Self {
        let mut rng = SplitMix64::new(cfg.seed ^ 0x5CA1E);
        let inputs: Vec<Vec<i32>> = (0..n).map(|_| (0..cfg.elements).map(|_| rng.next_u64() as i32).collect()).collect();
        let mut expected = vec![0i32; cfg.elements];
        for v in &inputs {
            for (e, x) in expected.iter_mut().zip(v) {
                *e = e.wrapping_add(*x);
            }
        }
        // a seeded partial shuffle picks the stragglers
        let count = ((cfg.stragglers * n as f64).round() as usize).min(n);
        let mut order: Vec<usize> = (0..n).collect();
        for i in 0..count {
            let j = i + rng.below((n - i) as u64) as usize;
            order.swap(i, j);
        }
        let mut delay = vec![0; n];
        for &w in &order[..count] {
            delay[w] = cfg.straggler_delay_us * 1_000 * PS_PER_NS;
        }
        Workload { inputs, expected, delay, background: Vec::new() }
    }

    fn stragglers(&self) -> Vec<u16> {
        (0..self.delay.len()).filter(|&w| self.delay[w] > 0).map(|w| w as u16).collect()
    }
}

/// The background flows of `cfg.background_load`: every host without a
/// worker sends to another (a seeded shuffle, each to the next in it).
fn background_flows(spec: &Spec, cfg: &ScaleConfig) -> Result<Vec<BackgroundFlow>, String> {
    if cfg.background_load <= 0.0 {
        return Ok(Vec::new());
    }
    if cfg.background_load.is_nan() || cfg.background_load > 1.0 {
        return Err(format!("background load {} is not a fraction of the link rate in (0, 1]", cfg.background_load));
    }
    let busy: std::collections::HashSet<u32> = spec.workers.iter().map(|w| w.host).collect();
    let mut free: Vec<u32> =
        (0..spec.nodes.len() as u32).filter(|&v| !spec.nodes[v as usize].switch && !busy.contains(&v)).collect();
    if free.len() < 2 {
        return Err(format!(
            "background traffic needs at least 2 hosts that run no worker ({} on {}): use fewer workers or a larger topology",
            free.len(),
            spec.name
        ));
    }
    let mut rng = SplitMix64::new(cfg.seed ^ 0xBAC6);
    for i in (1..free.len()).rev() {
        free.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let bytes = (HEADER_LEN + ELEM_LEN * cfg.elems_per_packet as usize) as u32 + WIRE_OVERHEAD;
    let interval = (tx_time(bytes, cfg.links.rate_gbps * 1_000_000_000) as f64 / cfg.background_load) as Ps;
    Ok((0..free.len()).map(|i| BackgroundFlow { src: free[i], dst: free[(i + 1) % free.len()], bytes, interval, responsive: cfg.background_responsive }).collect())
}

fn fabric(spec: &Spec, cfg: &ScaleConfig) -> Fabric {
    let is_switch: Vec<bool> = spec.nodes.iter().map(|n| n.switch).collect();
    let links: Vec<(u32, u32)> = spec.links.iter().map(|l| (l[0], l[1])).collect();
    let max_dgram = (HEADER_LEN + ELEM_LEN * cfg.elems_per_packet as usize) as u64 + WIRE_OVERHEAD as u64;
    Fabric::new(&is_switch, &links, cfg.links.channel_config(max_dgram, cfg.seed))
}

/// Run one allreduce of `cfg.elements` int32 values per worker.
pub fn run(spec: &Spec, cfg: &ScaleConfig, algorithm: Algorithm, progress: Progress) -> Result<ScaleResult, String> {
    spec.validate()?;
    let load = Workload { background: background_flows(spec, cfg)?, ..Workload::new(spec.workers.len(), cfg) };
    match algorithm {
        Algorithm::Fanin => FaninRun::new(spec, cfg, load)?.run(progress),
        Algorithm::Ring => RingRun::new(spec, cfg, load).run(progress),
    }
}

/// What every link's port counters show after `window` of the other
/// tenants' traffic alone (`cfg.background_load`), before the job starts:
/// the view a controller has when it places the job (`fanin sim allreduce
/// --root-weights spare` weighs the root's shards by it). Per channel, as
/// [`ScaleResult::channels`].
pub fn port_counters(spec: &Spec, cfg: &ScaleConfig, window: Ps) -> Result<Vec<ChannelStats>, String> {
    spec.validate()?;
    let mut c: Common<NetEv> = Common::new(spec, cfg, background_flows(spec, cfg)?);
    while let Some((_, e)) = c.ev.pop_until(window) {
        c.net.handle(&mut c.ev, e);
    }
    Ok((0..c.net.channels()).map(|i| c.net.channel_stats(i)).collect())
}

/// What both runs share: the clock, the network, completion bookkeeping.
struct Common<E> {
    ev: EventQueue<E>,
    net: Fabric,
    done_at: Vec<Option<Ps>>,
    done: usize,
    exact: bool,
    retransmissions: u64,
    /// When the allreduce began (fanin: once every session has joined);
    /// completion times count from here.
    start: Ps,
    /// `ScaleConfig::time_limit_ms`.
    limit: Ps,
}

impl<E: From<NetEv>> Common<E> {
    fn new(spec: &Spec, cfg: &ScaleConfig, flows: Vec<BackgroundFlow>) -> Self {
        let limit = cfg.time_limit_ms.saturating_mul(1_000_000).saturating_mul(PS_PER_NS);
        let mut c = Common { ev: EventQueue::new(), net: fabric(spec, cfg), done_at: vec![None; spec.workers.len()], done: 0, exact: true, retransmissions: 0, start: 0, limit };
        if !flows.is_empty() {
            c.net.start_background(&mut c.ev, flows, cfg.seed);
        }
        c
    }

    fn complete(&mut self, w: usize, exact: bool, progress: &mut dyn FnMut(usize, usize)) {
        if self.done_at[w].is_none() {
            self.done_at[w] = Some(self.ev.now());
            self.done += 1;
            self.exact &= exact;
            progress(self.done, self.done_at.len());
        }
    }

    /// After the last completion: let what is still queued or in flight
    /// reach its end (delivered datagrams are discarded, timers ignored), so
    /// every channel's bytes add up.
    fn drain(&mut self, net_ev: impl Fn(E) -> Option<NetEv>) {
        self.net.stop_background();
        while let Some((_, e)) = self.ev.pop_until(self.limit.saturating_mul(2)) {
            if let Some(n) = net_ev(e) {
                self.net.handle(&mut self.ev, n);
            }
        }
    }

    fn result(self, algorithm: Algorithm, degraded_blocks: u64, stragglers: Vec<u16>) -> Result<ScaleResult, String> {
        let unfinished = self.done_at.iter().filter(|t| t.is_none()).count();
        if unfinished > 0 {
            return Err(format!(
                "{}: {unfinished} of {} workers had no result after {} ms of simulated time (a hop starved by background traffic, or more loss than the transport repairs in time); --time-limit-ms sets the limit",
                format!("{algorithm:?}").to_lowercase(),
                self.done_at.len(),
                self.limit / (1_000_000 * PS_PER_NS)
            ));
        }
        let times: Vec<Ps> = self.done_at.iter().flatten().copied().collect();
        let last = times.iter().copied().max().unwrap_or(0) - self.start;
        let mean = times.iter().map(|&t| (t - self.start) as f64).sum::<f64>() / times.len() as f64;
        Ok(ScaleResult {
            algorithm,
            join_us: self.start as f64 / 1e6,
            completion_us: last as f64 / 1e6,
            mean_completion_us: mean / 1e6,
            exact: self.exact,
            degraded_blocks,
            retransmissions: self.retransmissions,
            datagrams: self.net.datagrams,
            queue_drops: self.net.queue_drops,
            link_drops: self.net.link_drops,
            trims: self.net.trims,
            ce_marks: self.net.ce_marks,
            tofino: self.net.tofino_stats,
            events: self.ev.events_handled(),
            stragglers,
            background: self.net.background_stats,
            channels: (0..self.net.channels()).map(|c| self.net.channel_stats(c)).collect(),
        })
    }
}

// ---------------------------------------------------------------- fanin

#[derive(Debug, Clone, Copy)]
enum FEv {
    Net(NetEv),
    WorkerTimer(u32),
    SwitchTimer(u32),
    Begin(u32),
}

impl From<NetEv> for FEv {
    fn from(e: NetEv) -> Self {
        FEv::Net(e)
    }
}

struct FaninRun<'a> {
    spec: &'a Spec,
    c: Common<FEv>,
    sessions: Vec<AllreduceSession>,
    /// Tree switches, and node id -> index into them (a switch that runs
    /// several root shards: its first; the others are reached through
    /// `WrongShard`, as a daemon's shards pass a datagram to its owner).
    switches: Vec<ValueSwitch<u32>>,
    switch_of_node: HashMap<u32, usize>,
    /// The node each switch runs on.
    switch_nodes: Vec<u32>,
    /// A root spread over several switches: their indices, by shard.
    root_shards: Vec<usize>,
    worker_of_node: HashMap<u32, usize>,
    worker_armed: Vec<Option<Ps>>,
    switch_armed: Vec<Option<Ps>>,
    load: Workload,
    inputs: Vec<Option<Vec<i32>>>,
    degraded: u64,
    joined: usize,
}

impl<'a> FaninRun<'a> {
    fn new(spec: &'a Spec, cfg: &ScaleConfig, mut load: Workload) -> Result<Self, String> {
        let job_id = 1;
        let n = spec.workers.len();
        let mut job = JobSpec::with_sources(job_id, n as u16, cfg.window, cfg.elems_per_packet as u32);
        job.workers = n as u16;
        job.block_exp_ms = cfg.block_exp_ms;
        let mut switches = Vec::new();
        let mut switch_of_node = HashMap::new();
        let mut switch_nodes = Vec::new();
        let shards = spec.root_shards.len().max(1) as u16;
        let root = spec.tree.iter().find(|s| s.parent.is_none()).ok_or("spec: no root")?;
        // the root's extra shards: the root's members, no parent
        let extra = spec.root_shards.iter().skip(1).map(|&node| SpecSwitch { node, parent: None, rank: None, members: root.members.clone() });
        for (i, s) in spec.tree.iter().cloned().chain(extra).enumerate() {
            // shard k of the root is the k-th entry of root_shards: the tree's
            // root (shard 0) where the tree lists it, the extra ones in order
            let shard = if s.parent.is_some() || spec.root_shards.is_empty() {
                None
            } else if i < spec.tree.len() {
                Some(0)
            } else {
                Some(i - spec.tree.len() + 1)
            };
            let config = match shard {
                Some(i) => ShardConfig { shard: i as u16, shard_count: shards, ..ShardConfig::single(1 << 34) },
                None => ShardConfig::single(1 << 34),
            };
            let mut sw: ValueSwitch<u32> = ValueSwitch::new(config);
            sw.add_job(JobSpec { members: s.members.clone(), ..job.clone() }).map_err(|e| format!("switch {}: {e}", spec.nodes[s.node as usize].name))?;
            let uplink = match (s.parent, s.rank) {
                // the root's children send each block to the root shard of its shard
                (Some(p), Some(rank)) if p == root.node && !spec.root_shards.is_empty() => Some(Uplink { parent: spec.root_shards.clone(), rank }),
                (Some(p), Some(rank)) => Some(Uplink { parent: vec![p], rank }),
                (None, _) => None,
                (Some(_), None) => return Err(format!("switch {}: a parent but no rank", spec.nodes[s.node as usize].name)),
            };
            sw.set_uplink(job_id, uplink).map_err(|e| e.to_string())?;
            switch_of_node.entry(s.node).or_insert(switches.len());
            switch_nodes.push(s.node);
            switches.push(sw);
        }
        // the root's shards, by shard index, as indices into `switches`:
        // the tree's root, then the extra ones in the order they were added
        let root_index = switch_of_node[&root.node];
        let root_shards = if spec.root_shards.is_empty() {
            Vec::new()
        } else {
            std::iter::once(root_index).chain(spec.tree.len()..switches.len()).collect()
        };
        let sessions = (0..n)
            .map(|w| {
                let mut c = SessionConfig::new(job_id, w as u16);
                c.elems_per_packet = cfg.elems_per_packet;
                c.window = cfg.window;
                c.rto_initial = Duration::from_micros(200);
                c.rto_min = Duration::from_micros(cfg.rto_min_us);
                c.dead_after = Duration::from_secs(60);
                c.join_timeout = Duration::from_secs(60);
                AllreduceSession::new(c, Time::ZERO)
            })
            .collect();
        let inputs = std::mem::take(&mut load.inputs).into_iter().map(Some).collect();
        Ok(FaninRun {
            spec,
            c: Common::new(spec, cfg, std::mem::take(&mut load.background)),
            sessions,
            switch_armed: vec![None; switches.len()],
            switches,
            switch_of_node,
            switch_nodes,
            root_shards,
            worker_of_node: spec.workers.iter().enumerate().map(|(i, w)| (w.host, i)).collect(),
            worker_armed: vec![None; n],
            load,
            inputs,
            degraded: 0,
            joined: 0,
        })
    }

    fn run(mut self, progress: Progress) -> Result<ScaleResult, String> {
        for w in 0..self.sessions.len() {
            self.drive_worker(w, progress)?;
        }
        while self.c.done < self.sessions.len() {
            let Some((now, e)) = self.c.ev.pop_until(self.c.limit) else { break };
            match e {
                FEv::Net(e) => {
                    let Some(d) = self.c.net.handle(&mut self.c.ev, e) else { continue };
                    if let Some(&s) = self.switch_of_node.get(&d.dst) {
                        let mut out = VecTransmit::new();
                        let mut verdict = self.switches[s].handle_datagram_ce(ns(now), d.src, &d.bytes, d.ce, &mut out);
                        // a switch that runs several root shards: the one
                        // that owns the block takes it
                        let mut s = s;
                        if let Verdict::WrongShard(k) = verdict {
                            match self.root_shards.get(k as usize) {
                                Some(&t) if self.switch_nodes[t] == d.dst && t != s => {
                                    s = t;
                                    verdict = self.switches[s].handle_datagram_ce(ns(now), d.src, &d.bytes, d.ce, &mut out);
                                }
                                _ => {}
                            }
                        }
                        match verdict {
                            Verdict::Consumed => {}
                            Verdict::WrongShard(k) => {
                                return Err(format!("switch {s} answered WrongShard({k}): children route by shard"));
                            }
                            // A root spread over several switches: what a
                            // Join changed reaches the other root shards as
                            // the daemon passes it between its shards (here
                            // at once: the controller's relay, idealised).
                            verdict => {
                                for &t in self.root_shards.iter().filter(|&&t| t != s) {
                                    self.switches[t].learn(verdict);
                                }
                            }
                        }
                        self.switch_sent(s, out);
                    } else {
                        let w = self.worker_at(d.dst)?;
                        self.sessions[w].handle_datagram_ce(ns(now), &d.bytes, d.ce);
                        self.drive_worker(w, progress)?;
                    }
                }
                FEv::WorkerTimer(w) => {
                    let w = w as usize;
                    if self.worker_armed[w] == Some(now) {
                        self.worker_armed[w] = None;
                        self.sessions[w].handle_timeout(ns(now));
                        self.drive_worker(w, progress)?;
                    }
                }
                FEv::SwitchTimer(s) => {
                    let s = s as usize;
                    if self.switch_armed[s] == Some(now) {
                        self.switch_armed[s] = None;
                        let mut out = VecTransmit::new();
                        self.switches[s].handle_timeout(ns(now), &mut out);
                        self.switch_sent(s, out);
                    }
                }
                FEv::Begin(w) => {
                    let w = w as usize;
                    let t = self.inputs[w].take().ok_or("began twice")?;
                    self.sessions[w].begin(ns(now), Tensor::I32(t)).map_err(|e| e.to_string())?;
                    self.drive_worker(w, progress)?;
                }
            }
        }
        self.c.drain(|e| if let FEv::Net(n) = e { Some(n) } else { None });
        let stragglers = self.load.stragglers();
        self.c.result(Algorithm::Fanin, self.degraded, stragglers)
    }

    fn worker_at(&self, host: u32) -> Result<usize, String> {
        self.worker_of_node.get(&host).copied().ok_or_else(|| format!("datagram for node {host}, which runs nothing"))
    }

    fn switch_sent(&mut self, s: usize, mut out: VecTransmit<u32>) {
        let node = self.switch_nodes[s];
        for (dest, b) in out.drain() {
            self.c.net.send(&mut self.c.ev, node, dest, b);
        }
        if let Some(t) = self.switches[s].poll_timeout() {
            let t = ps(t).max(self.c.ev.now());
            if self.switch_armed[s] != Some(t) {
                self.switch_armed[s] = Some(t);
                self.c.ev.schedule(t, FEv::SwitchTimer(s as u32));
            }
        }
    }

    /// The session's calling contract: events, transmissions, timer.
    fn drive_worker(&mut self, w: usize, progress: Progress) -> Result<(), String> {
        let now = self.c.ev.now();
        while let Some(e) = self.sessions[w].poll_event() {
            match e {
                Event::Joined(_) => {
                    // Sessions join once and then run allreduces: the
                    // allreduce starts when the last one has joined.
                    self.joined += 1;
                    if self.joined == self.sessions.len() {
                        self.c.start = now;
                        for v in 0..self.sessions.len() {
                            self.c.ev.schedule(now + self.load.delay[v], FEv::Begin(v as u32));
                        }
                    }
                }
                Event::Completed(o) => {
                    self.c.retransmissions += o.retransmissions;
                    self.degraded += o.degraded_blocks.len() as u64;
                    let exact = matches!(&o.tensor, Tensor::I32(v) if *v == self.load.expected);
                    self.c.complete(w, exact, progress);
                }
                Event::Failed(e) => return Err(format!("worker {w}: {e}")),
                Event::Membership { .. } => {}
            }
        }
        let mut out = VecTransmit::new();
        while self.sessions[w].poll_transmit(ns(now), &mut out) > 0 {}
        let (host, switch) = (self.spec.workers[w].host, self.spec.workers[w].switch);
        for (_, bytes) in out.drain() {
            self.c.net.send(&mut self.c.ev, host, switch, bytes);
        }
        if let Some(t) = self.sessions[w].poll_timeout() {
            let t = ps(t).max(now);
            if self.worker_armed[w] != Some(t) {
                self.worker_armed[w] = Some(t);
                self.c.ev.schedule(t, FEv::WorkerTimer(w as u32));
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- ring

#[derive(Debug, Clone, Copy)]
enum REv {
    Net(NetEv),
    Timer(u32),
    Begin(u32),
}

impl From<NetEv> for REv {
    fn from(e: NetEv) -> Self {
        REv::Net(e)
    }
}

const RING_DATA: u8 = 0;
const RING_ACK: u8 = 1;

/// The ring's packet header, padded to fanin's header length so both pay
/// the same bytes per packet: kind, step, sequence number in the step.
fn ring_header(kind: u8, step: u16, seq: u32, payload: usize) -> Vec<u8> {
    let mut b = vec![0u8; HEADER_LEN];
    b.reserve(payload);
    b[0] = kind;
    b[2..4].copy_from_slice(&step.to_be_bytes());
    b[4..8].copy_from_slice(&seq.to_be_bytes());
    b
}

struct RingWorker {
    buf: Vec<i32>,
    started: bool,
    /// Steps fully received from the predecessor (a prefix).
    complete: u32,
    received: Vec<Vec<bool>>,
    received_count: Vec<u32>,
    /// Next packet to send for the first time.
    cursor: (u32, u32),
    /// Unacknowledged (step, seq) -> (first send time, retransmitted).
    unacked: HashMap<(u32, u32), (Ps, bool)>,
    /// Retransmission deadlines in arming order (stale entries skipped).
    rtx: VecDeque<(Ps, u32, u32)>,
    armed: Option<Ps>,
    srtt: Option<Ps>,
}

struct RingRun<'a> {
    spec: &'a Spec,
    cfg: &'a ScaleConfig,
    c: Common<REv>,
    workers: Vec<RingWorker>,
    worker_of_node: HashMap<u32, usize>,
    load: Workload,
}

impl<'a> RingRun<'a> {
    fn new(spec: &'a Spec, cfg: &'a ScaleConfig, mut load: Workload) -> Self {
        let n = spec.workers.len();
        let steps = 2 * (n - 1);
        let workers = std::mem::take(&mut load.inputs)
            .into_iter()
            .map(|buf| RingWorker {
                buf,
                started: false,
                complete: 0,
                received: vec![Vec::new(); steps],
                received_count: vec![0; steps],
                cursor: (0, 0),
                unacked: HashMap::new(),
                rtx: VecDeque::new(),
                armed: None,
                srtt: None,
            })
            .collect();
        let worker_of_node = spec.workers.iter().enumerate().map(|(i, w)| (w.host, i)).collect();
        RingRun { spec, cfg, c: Common::new(spec, cfg, std::mem::take(&mut load.background)), workers, worker_of_node, load }
    }

    fn n(&self) -> usize {
        self.workers.len()
    }

    fn steps(&self) -> u32 {
        2 * (self.n() as u32 - 1)
    }

    /// Element range of chunk c.
    fn chunk(&self, c: usize) -> std::ops::Range<usize> {
        let (s, n) = (self.cfg.elements, self.n());
        c * s / n..(c + 1) * s / n
    }

    /// Worker j sends chunk (j - s) mod N at step s and receives (j - s - 1).
    fn chunk_sent(&self, j: usize, step: u32) -> usize {
        let n = self.n();
        (j + n * 2 - step as usize % n) % n
    }

    fn packets(&self, chunk: usize) -> u32 {
        self.chunk(chunk).len().div_ceil(self.cfg.elems_per_packet as usize) as u32
    }

    fn rto(&self, j: usize) -> Ps {
        let min = self.cfg.rto_min_us * 1_000 * PS_PER_NS;
        match self.workers[j].srtt {
            Some(s) => (3 * s).max(min),
            None => 200_000 * PS_PER_NS,
        }
    }

    fn run(mut self, progress: Progress) -> Result<ScaleResult, String> {
        let n = self.n();
        for j in 0..n {
            let at = self.load.delay[j];
            self.c.ev.schedule(at, REv::Begin(j as u32));
        }
        if n == 1 {
            let exact = self.workers[0].buf == self.load.expected;
            self.c.complete(0, exact, progress);
        }
        while self.c.done < n {
            let Some((now, e)) = self.c.ev.pop_until(self.c.limit) else { break };
            match e {
                REv::Net(e) => {
                    let Some(d) = self.c.net.handle(&mut self.c.ev, e) else { continue };
                    let j = *self.worker_of_node.get(&d.dst).ok_or("datagram for a node that runs nothing")?;
                    let step = u16::from_be_bytes([d.bytes[2], d.bytes[3]]) as u32;
                    let seq = u32::from_be_bytes([d.bytes[4], d.bytes[5], d.bytes[6], d.bytes[7]]);
                    if d.bytes[0] == RING_ACK {
                        self.on_ack(j, step, seq, now);
                    } else if d.bytes.len() <= HEADER_LEN {
                        // a data packet a trimming link cut to its header:
                        // the ring's transport has no trim path, so it is
                        // lost (no ack; the sender's timeout resends it), as
                        // a cut TCP segment fails its checksum
                        continue;
                    } else {
                        self.on_data(j, step, seq, &d.bytes[HEADER_LEN..], progress);
                        let ack = ring_header(RING_ACK, step as u16, seq, 0);
                        self.c.net.send(&mut self.c.ev, d.dst, d.src, ack);
                    }
                    self.pump(j);
                }
                REv::Timer(j) => {
                    let j = j as usize;
                    if self.workers[j].armed == Some(now) {
                        self.workers[j].armed = None;
                        self.on_timer(j, now);
                        self.pump(j);
                    }
                }
                REv::Begin(j) => {
                    self.workers[j as usize].started = true;
                    self.advance(j as usize, progress); // steps with empty chunks (fewer elements than workers)
                    self.pump(j as usize);
                }
            }
        }
        self.c.drain(|e| if let REv::Net(n) = e { Some(n) } else { None });
        let stragglers = self.load.stragglers();
        self.c.result(Algorithm::Ring, 0, stragglers)
    }

    fn on_data(&mut self, j: usize, step: u32, seq: u32, payload: &[u8], progress: Progress) {
        let n = self.n();
        let chunk = self.chunk_sent(j + n - 1, step);
        let total = self.packets(chunk);
        let range = self.chunk(chunk);
        let epp = self.cfg.elems_per_packet as usize;
        let w = &mut self.workers[j];
        let got = &mut w.received[step as usize];
        if got.is_empty() {
            *got = vec![false; total as usize];
        }
        if std::mem::replace(&mut got[seq as usize], true) {
            return; // a duplicate (retransmission of an acknowledged packet)
        }
        let start = range.start + seq as usize * epp;
        let dst = &mut w.buf[start..(start + epp).min(range.end)];
        let reduce = step < n as u32 - 1;
        for (x, b) in dst.iter_mut().zip(payload.chunks_exact(4)) {
            let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            *x = if reduce { x.wrapping_add(v) } else { v };
        }
        w.received_count[step as usize] += 1;
        self.advance(j, progress);
    }

    /// Move the prefix of fully received steps; complete at the last one.
    fn advance(&mut self, j: usize, progress: Progress) {
        let n = self.n();
        while self.workers[j].complete < self.steps() {
            let s = self.workers[j].complete;
            let need = self.packets(self.chunk_sent(j + n - 1, s));
            if self.workers[j].received_count[s as usize] < need {
                break;
            }
            self.workers[j].complete += 1;
        }
        if self.workers[j].complete == self.steps() {
            let exact = self.workers[j].buf == self.load.expected;
            self.c.complete(j, exact, progress);
        }
    }

    fn on_ack(&mut self, j: usize, step: u32, seq: u32, now: Ps) {

        let w = &mut self.workers[j];
        if let Some((sent, retransmitted)) = w.unacked.remove(&(step, seq)) {
            if !retransmitted {
                let sample = now - sent;
                w.srtt = Some(w.srtt.map_or(sample, |s| (7 * s + sample) / 8));
            }
        }
    }

    fn send_packet(&mut self, j: usize, step: u32, seq: u32) {
        let chunk = self.chunk_sent(j, step);
        let range = self.chunk(chunk);
        let epp = self.cfg.elems_per_packet as usize;
        let start = range.start + seq as usize * epp;
        let elems = &self.workers[j].buf[start..(start + epp).min(range.end)];
        let mut b = ring_header(RING_DATA, step as u16, seq, elems.len() * 4);
        for x in elems {
            b.extend_from_slice(&x.to_le_bytes());
        }
        let next = self.spec.workers[(j + 1) % self.n()].host;
        self.c.net.send(&mut self.c.ev, self.spec.workers[j].host, next, b);
    }

    /// Send new packets while the window allows and the step is ready.
    fn pump(&mut self, j: usize) {
        let now = self.c.ev.now();
        let rto = self.rto(j);
        while self.workers[j].started && self.workers[j].unacked.len() < self.cfg.window as usize {
            let (step, seq) = self.workers[j].cursor;
            if step >= self.steps() || step > self.workers[j].complete {
                break;
            }
            if seq >= self.packets(self.chunk_sent(j, step)) {
                self.workers[j].cursor = (step + 1, 0);
                continue;
            }
            self.send_packet(j, step, seq);
            let w = &mut self.workers[j];
            w.unacked.insert((step, seq), (now, false));
            w.rtx.push_back((now + rto, step, seq));
            w.cursor = (step, seq + 1);
        }
        self.arm(j);
    }

    fn on_timer(&mut self, j: usize, now: Ps) {
        let rto = self.rto(j);
        while let Some(&(at, step, seq)) = self.workers[j].rtx.front() {
            if at > now {
                break;
            }
            self.workers[j].rtx.pop_front();
            let Some(entry) = self.workers[j].unacked.get_mut(&(step, seq)) else { continue };
            entry.1 = true;
            self.c.retransmissions += 1;
            self.send_packet(j, step, seq);
            self.workers[j].rtx.push_back((now + rto, step, seq));
        }
    }

    fn arm(&mut self, j: usize) {
        let w = &mut self.workers[j];
        while let Some(&(_, step, seq)) = w.rtx.front() {
            if w.unacked.contains_key(&(step, seq)) {
                break;
            }
            w.rtx.pop_front();
        }
        // deadlines are armed in order but the RTO moves, so the front may
        // already be due
        if let Some(&(at, ..)) = w.rtx.front() {
            let at = at.max(self.c.ev.now());
            if w.armed != Some(at) {
                w.armed = Some(at);
                self.c.ev.schedule(at, REv::Timer(j as u32));
            }
        }
    }
}
