//! The network: hosts and switches joined by links, driven by the kernel.
//!
//! A port is an output queue ([`PortQueue`] from `fanin_proto::trim`) feeding
//! a link with a rate and a propagation delay to a peer port (htsim's queue +
//! pipe). Switches are output-queued; what happens when a data queue is full
//! depends on the [`SwitchModel`]. Switches with recirculation (MoD, Tofino)
//! get one extra port per pipeline whose link loops back to the switch itself
//! with the recirculation latency.

use std::collections::VecDeque;

use fanin_proto::fault::SplitMix64;
use fanin_proto::trim::{IngressTrimmer, IngressVerdict, NdpVerdict, PortQueue, QueueConfig, TrimControlConfig};
use fanin_proto::Time;
use serde::Serialize;

use crate::kernel::{tx_time, EventQueue, Ps, PS_PER_NS, PS_PER_US};
use crate::ndp::{Flow, Transport};
use crate::packet::{Kind, Packet, TrimPoint};

/// What a switch does when an egress data queue is full.
#[derive(Debug, Clone)]
pub enum SwitchModel {
    /// Drop the arriving packet.
    DropTail,
    /// Ideal output-queued NDP trimming (header queue, WRR, return-to-sender).
    Ideal,
    /// Mirror-on-drop: the header of a packet that would be dropped is mirrored
    /// to the ingress pipeline's mirror port and recirculated into the header
    /// queue after the recirculation latency.
    MirrorOnDrop,
    /// The paper's Tofino design: ingress meters, deflect-on-drop into the
    /// ingress pipeline's recirculation port, notifications per
    /// `TrimControlConfig::notify` (`NotifyScope::None` = "DoD only").
    Tofino(TrimControlConfig),
}

impl SwitchModel {
    fn recirculates(&self) -> bool {
        matches!(self, SwitchModel::MirrorOnDrop | SwitchModel::Tofino(_))
    }
}

/// How a switch picks among equal-cost next hops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadBalance {
    /// Per-packet spraying (uniform random next hop).
    Spray,
    /// Per-flow hashing.
    Ecmp,
}

/// Ports per ingress pipeline of a Tofino switch (the study's default).
pub const PORTS_PER_PIPELINE: usize = 16;

/// Latency of a recirculation port (the study's default).
pub const RECIRC_LATENCY: Ps = PS_PER_US;

/// Parameters shared by all switches and hosts of a network.
#[derive(Debug, Clone)]
pub struct NetConfig {
    pub mtu: u32,
    pub switch_queue: QueueConfig,
    pub model: SwitchModel,
    pub ports_per_pipeline: usize,
    pub recirc_rate_bps: u64,
    pub recirc_latency: Ps,
    pub dod_capacity_bytes: u64,
    pub mirror_capacity_bytes: u64,
    /// Delay from the moment a deflected packet leaves the DoD queue to the
    /// moment its congestion notification takes effect in the ingress
    /// pipelines. §6.2: notifications go "to all pipelines at once" when the
    /// packet is dequeued, so 0 by default.
    pub notify_latency: Ps,
    pub load_balance: LoadBalance,
    pub initial_window: u32,
    pub rto: Ps,
    pub seed: u64,
    /// Record the arrival time of every first-transmission header at its receiver.
    pub record_headers: bool,
    /// Record every congestion notification (time, egress port).
    pub record_notifications: bool,
    /// Host control packets (ACK, NACK, PULL) share the host's uplink with its
    /// data. `false` (default) gives them their own channel of the same rate
    /// and delay, as htsim's separate source and sink routes do.
    pub shared_host_link: bool,
    /// Record every packet arriving at a host (tests, debugging).
    pub record_trace: bool,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            mtu: 1500,
            switch_queue: QueueConfig::ndp(1500),
            model: SwitchModel::Ideal,
            ports_per_pipeline: PORTS_PER_PIPELINE,
            recirc_rate_bps: 100_000_000_000,
            recirc_latency: RECIRC_LATENCY,
            dod_capacity_bytes: u64::MAX,
            mirror_capacity_bytes: u64::MAX,
            notify_latency: 0,
            load_balance: LoadBalance::Spray,
            initial_window: 1000,
            rto: 1000 * PS_PER_US,
            seed: 1,
            record_headers: false,
            record_notifications: false,
            shared_host_link: false,
            record_trace: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Link {
    pub rate_bps: u64,
    pub delay: Ps,
}

impl Link {
    pub fn gbps(gbps: u64, delay_ns: u64) -> Self {
        Link { rate_bps: gbps * 1_000_000_000, delay: delay_ns * PS_PER_NS }
    }
}

struct Port {
    queue: PortQueue<Packet>,
    busy: bool,
    link: Link,
    peer: (u32, u16),
}

struct Switch {
    ports: Vec<Port>,
    front: usize,
    /// For each destination host, the egress ports on shortest paths.
    routes: Vec<Vec<u16>>,
    trimmer: Option<IngressTrimmer>,
    rng: SplitMix64,
    id: u32,
}

struct Host {
    /// Port 0: data (and control when `shared_host_link`).
    nic: Port,
    /// Port 1: control packets when the host link is not shared.
    ctl: Port,
    sending: Vec<u32>,
    rr: usize,
    pulls: VecDeque<u32>,
    pacer_next: Ps,
    pacer_armed: bool,
    rto_armed: bool,
}

// Nodes live in one Vec indexed on every event; boxing would add a pointer
// chase per event to save memory we do not miss.
#[allow(clippy::large_enum_variant)]
enum Node {
    Host(Host),
    Switch(Switch),
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    TxDone { node: u32, port: u16 },
    Arrive { node: u32, port: u16, pkt: Packet },
    Pull { node: u32 },
    Rto { node: u32 },
    Start { flow: u32 },
    Notify { node: u32, pipeline: u16, egress: u16 },
}

/// Switch-side counters of a run (all switches together).
#[derive(Debug, Clone, Default, Serialize)]
pub struct NetStats {
    pub trims_queue: u64,
    pub trims_ingress: u64,
    pub trims_dod: u64,
    pub trims_mirror: u64,
    pub deflected: u64,
    pub returned_to_sender: u64,
    pub drops_data_queue: u64,
    pub drops_dod_overflow: u64,
    pub drops_mirror_overflow: u64,
    /// Data-derived headers lost because a header queue was full (a returned
    /// header that meets a full queue on its way back).
    pub drops_header_queue: u64,
    /// ACK, NACK and PULL packets lost to a full header queue.
    pub drops_control: u64,
    pub notifications: u64,
    /// Most events pending at once in the kernel.
    pub max_pending_events: u64,
    pub max_dod_queue_pkts: u64,
    pub max_data_queue_pkts: u64,
    /// Data-derived packets (whole or trimmed) that reached an end host.
    pub data_arrivals: u64,
    pub header_arrivals: u64,
    pub bounced_arrivals: u64,
    pub events: u64,
}

impl NetStats {
    pub fn trims(&self) -> u64 {
        self.trims_queue + self.trims_ingress + self.trims_dod + self.trims_mirror
    }
    pub fn data_drops(&self) -> u64 {
        self.drops_data_queue + self.drops_dod_overflow + self.drops_mirror_overflow + self.drops_header_queue
    }
}

/// A built network, ready to simulate.
pub struct Sim {
    cfg: NetConfig,
    events: EventQueue<Ev>,
    nodes: Vec<Node>,
    hosts: Vec<u32>,
    pub flows: Vec<Flow>,
    pub stats: NetStats,
    pub header_arrivals: Vec<Ps>,
    pub notifications: Vec<(Ps, u16)>,
    /// (time, host, packet) of every arrival at a host, with `record_trace`.
    pub trace: Vec<(Ps, u32, Packet)>,
    pull_interval: Ps,
}

/// A topology under construction: nodes and links, no routes yet.
pub struct Builder {
    cfg: NetConfig,
    nodes: Vec<Node>,
    hosts: Vec<u32>,
}

impl Builder {
    pub fn new(cfg: NetConfig) -> Self {
        Builder { cfg, nodes: Vec::new(), hosts: Vec::new() }
    }

    /// Add a host; returns its host index (0, 1, ...).
    pub fn host(&mut self) -> u32 {
        let node = self.nodes.len() as u32;
        self.nodes.push(Node::Host(Host {
            nic: Port { queue: PortQueue::new(QueueConfig::unbounded()), busy: false, link: Link::gbps(100, 0), peer: (u32::MAX, 0) },
            ctl: Port { queue: PortQueue::new(QueueConfig::unbounded()), busy: false, link: Link::gbps(100, 0), peer: (u32::MAX, 0) },
            sending: Vec::new(),
            rr: 0,
            pulls: VecDeque::new(),
            pacer_next: 0,
            pacer_armed: false,
            rto_armed: false,
        }));
        self.hosts.push(node);
        self.hosts.len() as u32 - 1
    }

    /// Add a switch with no ports yet; returns its node id.
    pub fn switch(&mut self) -> u32 {
        let id = self.nodes.len() as u32;
        let seed = self.cfg.seed ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.nodes.push(Node::Switch(Switch { ports: Vec::new(), front: 0, routes: Vec::new(), trimmer: None, rng: SplitMix64::new(seed), id }));
        id
    }

    fn add_switch_port(&mut self, sw: u32, link: Link, peer: (u32, u16)) -> u16 {
        let q = self.cfg.switch_queue;
        let Node::Switch(s) = &mut self.nodes[sw as usize] else { panic!("node {sw} is not a switch") };
        s.ports.push(Port { queue: PortQueue::new(q), busy: false, link, peer });
        s.front = s.ports.len();
        (s.ports.len() - 1) as u16
    }

    /// Connect host `h` to switch `sw` (both directions).
    pub fn connect_host(&mut self, h: u32, sw: u32, link: Link) {
        let hn = self.hosts[h as usize];
        let port = self.add_switch_port(sw, link, (hn, 0));
        let Node::Host(host) = &mut self.nodes[hn as usize] else { unreachable!() };
        host.nic.link = link;
        host.nic.peer = (sw, port);
        host.ctl.link = link;
        host.ctl.peer = (sw, port);
    }

    /// Connect two switches (both directions).
    pub fn connect_switches(&mut self, a: u32, b: u32, link: Link) {
        assert_ne!(a, b, "a switch is not linked to itself");
        let pa = self.port_count(a) as u16;
        let pb = self.port_count(b) as u16;
        self.add_switch_port(a, link, (b, pb));
        self.add_switch_port(b, link, (a, pa));
    }

    fn port_count(&self, sw: u32) -> usize {
        match &self.nodes[sw as usize] {
            Node::Switch(s) => s.ports.len(),
            Node::Host(_) => 1,
        }
    }

    /// Add recirculation ports, compute shortest-path routes, build the trimmers.
    pub fn build(mut self) -> Sim {
        let n_hosts = self.hosts.len();
        // Shortest paths towards each host: BFS over switches only.
        let mut adj: Vec<Vec<(u16, u32)>> = vec![Vec::new(); self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            match n {
                Node::Switch(s) => adj[i] = s.ports.iter().enumerate().map(|(p, port)| (p as u16, port.peer.0)).collect(),
                Node::Host(h) => adj[i] = vec![(0, h.nic.peer.0)],
            }
        }
        let mut routes: Vec<Vec<Vec<u16>>> = vec![vec![Vec::new(); n_hosts]; self.nodes.len()];
        for (h, &hn) in self.hosts.iter().enumerate() {
            let mut dist = vec![u32::MAX; self.nodes.len()];
            dist[hn as usize] = 0;
            let mut frontier = VecDeque::from([hn]);
            while let Some(v) = frontier.pop_front() {
                // Expand from the destination host itself and from switches only.
                if v != hn && matches!(self.nodes[v as usize], Node::Host(_)) {
                    continue;
                }
                for (i, n) in self.nodes.iter().enumerate() {
                    if dist[i] != u32::MAX || !matches!(n, Node::Switch(_)) {
                        continue;
                    }
                    if adj[i].iter().any(|&(_, peer)| peer == v) {
                        dist[i] = dist[v as usize] + 1;
                        frontier.push_back(i as u32);
                    }
                }
            }
            for (i, n) in self.nodes.iter().enumerate() {
                if let Node::Switch(_) = n {
                    if dist[i] == u32::MAX {
                        continue;
                    }
                    routes[i][h] = adj[i].iter().filter(|&&(_, peer)| dist[peer as usize].saturating_add(1) == dist[i]).map(|&(p, _)| p).collect();
                }
            }
        }
        let cfg = self.cfg.clone();
        for (i, n) in self.nodes.iter_mut().enumerate() {
            let Node::Switch(s) = n else { continue };
            s.routes = std::mem::take(&mut routes[i]);
            s.front = s.ports.len();
            let pipelines = s.front.div_ceil(cfg.ports_per_pipeline).max(1);
            if cfg.model.recirculates() {
                let capacity = match cfg.model {
                    SwitchModel::MirrorOnDrop => cfg.mirror_capacity_bytes,
                    _ => cfg.dod_capacity_bytes,
                };
                for p in 0..pipelines {
                    let q = QueueConfig { data_capacity_bytes: capacity, ..QueueConfig::unbounded() };
                    let port = (s.front + p) as u16;
                    s.ports.push(Port { queue: PortQueue::new(q), busy: false, link: Link { rate_bps: cfg.recirc_rate_bps, delay: cfg.recirc_latency }, peer: (i as u32, port) });
                }
            }
            if let SwitchModel::Tofino(tc) = &cfg.model {
                let tc = TrimControlConfig { pipelines, ports_per_pipeline: cfg.ports_per_pipeline, ..tc.clone() };
                s.trimmer = Some(IngressTrimmer::new(tc));
            }
        }
        let pull_interval = {
            let rate = self.hosts.first().and_then(|&h| match &self.nodes[h as usize] {
                Node::Host(h) => Some(h.nic.link.rate_bps),
                _ => None,
            });
            tx_time(cfg.mtu, rate.unwrap_or(100_000_000_000))
        };
        Sim {
            cfg,
            events: EventQueue::new(),
            nodes: self.nodes,
            hosts: self.hosts,
            flows: Vec::new(),
            stats: NetStats::default(),
            header_arrivals: Vec::new(),
            notifications: Vec::new(),
            trace: Vec::new(),
            pull_interval,
        }
    }
}

fn ns(t: Ps) -> Time {
    Time::from_nanos(t / PS_PER_NS)
}

impl Sim {
    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }
    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }
    pub fn now(&self) -> Ps {
        self.events.now()
    }
    pub fn events_handled(&self) -> u64 {
        self.events.events_handled()
    }

    /// Add an NDP flow of `size_pkts` MTU packets (`u32::MAX`: endless).
    pub fn add_flow(&mut self, src: u32, dst: u32, size_pkts: u32, start: Ps) -> u32 {
        self.add_flow_with(src, dst, size_pkts, Some(start), Transport::Ndp, None)
    }

    /// Add a flow with its transport and packet size (None: the MTU). With
    /// `start` None it waits until another flow's `then` starts it.
    pub fn add_flow_with(
        &mut self,
        src: u32,
        dst: u32,
        size_pkts: u32,
        start: Option<Ps>,
        transport: Transport,
        pkt_size: Option<u32>,
    ) -> u32 {
        let id = self.flows.len() as u32;
        let mut flow = Flow::new(src, dst, size_pkts, start.unwrap_or(0), self.cfg.initial_window);
        flow.transport = transport;
        flow.pkt_size = pkt_size;
        flow.triggered = start.is_none();
        self.flows.push(flow);
        // a flow another starts joins its host's senders when it starts
        // (Ev::Start) and leaves once complete: closed loops chain
        // thousands of them on one host
        if start.is_some() {
            let hn = self.hosts[src as usize];
            if let Node::Host(h) = &mut self.nodes[hn as usize] {
                h.sending.push(id);
            }
        }
        if let Some(start) = start {
            self.events.schedule(start, Ev::Start { flow: id });
        }
        id
    }

    /// Run until no event is left or the next one is later than `until`.
    pub fn run_until(&mut self, until: Ps) {
        while let Some((now, ev)) = self.events.pop_until(until) {
            match ev {
                Ev::TxDone { node, port } => {
                    self.port_mut(node, port).busy = false;
                    self.try_send(node, port, now);
                }
                Ev::Arrive { node, port, pkt } => match self.nodes[node as usize] {
                    Node::Host(_) => self.host_arrive(node, pkt, now),
                    Node::Switch(_) => self.switch_arrive(node, port, pkt, now),
                },
                Ev::Pull { node } => self.pull_tick(node, now),
                Ev::Rto { node } => self.rto_tick(node, now),
                Ev::Notify { node, pipeline, egress } => self.notify(node, pipeline, egress, now),
                Ev::Start { flow } => {
                    let f = &mut self.flows[flow as usize];
                    f.started = true;
                    f.start = now; // a flow another one started begins now
                    let hn = self.hosts[f.src as usize];
                    if let Node::Host(h) = &mut self.nodes[hn as usize] {
                        if !h.sending.contains(&flow) {
                            h.sending.push(flow);
                        }
                    }
                    self.try_send(hn, 0, now);
                }
            }
        }
        self.stats.events = self.events.events_handled();
        self.stats.max_pending_events = self.events.max_len() as u64;
        for n in &self.nodes {
            if let Node::Switch(s) = n {
                for (i, p) in s.ports.iter().enumerate() {
                    let st = p.queue.stats();
                    if i >= s.front {
                        self.stats.max_dod_queue_pkts = self.stats.max_dod_queue_pkts.max(st.max_data_packets);
                    } else {
                        self.stats.max_data_queue_pkts = self.stats.max_data_queue_pkts.max(st.max_data_packets);
                    }
                }
            }
        }
    }

    /// Data-derived packets still queued or on a link.
    pub fn in_flight_data(&mut self) -> u64 {
        let mut n = 0;
        for node in &mut self.nodes {
            if let Node::Switch(s) = node {
                for p in &mut s.ports {
                    let mut keep = Vec::new();
                    while let Some((pkt, _)) = p.queue.dequeue() {
                        keep.push(pkt);
                    }
                    n += keep.iter().filter(|p| p.is_data_derived()).count() as u64;
                }
            }
        }
        while let Some((_, ev)) = self.events.pop_until(u64::MAX) {
            if let Ev::Arrive { pkt, .. } = ev {
                n += pkt.is_data_derived() as u64;
            }
        }
        n
    }

    fn port_mut(&mut self, node: u32, port: u16) -> &mut Port {
        match &mut self.nodes[node as usize] {
            Node::Host(h) => {
                if port == 1 {
                    &mut h.ctl
                } else {
                    &mut h.nic
                }
            }
            Node::Switch(s) => &mut s.ports[port as usize],
        }
    }

    /// Start serialising the next packet of an idle port.
    fn try_send(&mut self, node: u32, port: u16, now: Ps) {
        let pkt = match &mut self.nodes[node as usize] {
            Node::Switch(s) => {
                let front = s.front;
                let has_trimmer = s.trimmer.is_some();
                let p = &mut s.ports[port as usize];
                if p.busy {
                    return;
                }
                let pkt = match p.queue.dequeue() {
                    Some((pkt, _)) => pkt,
                    None => return,
                };
                if has_trimmer && port as usize >= front && pkt.kind == Kind::Data {
                    // A deflected packet leaves the DoD queue: congestion signal.
                    let (pipeline, egress) = ((port as usize - front) as u16, pkt.egress);
                    if self.cfg.notify_latency == 0 {
                        self.notify(node, pipeline, egress, now);
                    } else {
                        self.events.schedule(now + self.cfg.notify_latency, Ev::Notify { node, pipeline, egress });
                    }
                }
                pkt
            }
            Node::Host(h) if port == 1 => {
                if h.ctl.busy {
                    return;
                }
                match h.ctl.queue.dequeue() {
                    Some((pkt, _)) => pkt,
                    None => return,
                }
            }
            Node::Host(h) => {
                if h.nic.busy {
                    return;
                }
                if let Some((pkt, _)) = h.nic.queue.dequeue() {
                    pkt
                } else {
                    match next_data(h, &mut self.flows, now, self.cfg.mtu) {
                        Some(pkt) => {
                            if !h.rto_armed {
                                h.rto_armed = true;
                                self.events.schedule(now + self.cfg.rto, Ev::Rto { node });
                            }
                            pkt
                        }
                        None => return,
                    }
                }
            }
        };
        let p = self.port_mut(node, port);
        p.busy = true;
        let (link, peer) = (p.link, p.peer);
        let done = now + tx_time(pkt.size, link.rate_bps);
        self.events.schedule(done, Ev::TxDone { node, port });
        self.events.schedule(done + link.delay, Ev::Arrive { node: peer.0, port: peer.1, pkt });
    }

    fn send_control(&mut self, from_host: u32, pkt: Packet, now: Ps) {
        let hn = self.hosts[from_host as usize];
        let Node::Host(h) = &mut self.nodes[hn as usize] else { unreachable!() };
        let port = if self.cfg.shared_host_link { 0 } else { 1 };
        let q = if port == 0 { &mut h.nic.queue } else { &mut h.ctl.queue };
        // Unbounded queue: cannot fail.
        let _ = q.enqueue_header(pkt);
        self.try_send(hn, port, now);
    }

    fn host_arrive(&mut self, node: u32, pkt: Packet, now: Ps) {
        let f = pkt.flow as usize;
        if self.cfg.record_trace {
            let host = self.hosts.iter().position(|&h| h == node).expect("host") as u32;
            self.trace.push((now, host, pkt));
        }
        match (pkt.kind, pkt.bounced) {
            (Kind::Data, _) => {
                self.stats.data_arrivals += 1;
                let flow = &mut self.flows[f];
                let was_finished = flow.is_finished();
                flow.on_receive(pkt.seq, pkt.size, now);
                let then = if !was_finished && flow.is_finished() { flow.then } else { None };
                let pulled = flow.transport == Transport::Ndp;
                let ack = Packet::control(Kind::Ack, pkt.flow, pkt.seq, flow.dst, flow.src, now);
                let dst = flow.dst;
                self.send_control(dst, ack, now);
                if pulled {
                    self.pull_request(node, pkt.flow, now);
                }
                if let Some((next, delay)) = then {
                    self.events.schedule(now + delay, Ev::Start { flow: next });
                }
                if self.flows[f].triggered && self.flows[f].is_finished() && !was_finished {
                    // the receiver has it all: the sender has nothing left to do
                    let src = self.hosts[self.flows[f].src as usize];
                    if let Node::Host(h) = &mut self.nodes[src as usize] {
                        h.sending.retain(|&x| x != pkt.flow);
                        h.rr = 0;
                    }
                }
            }
            (Kind::Header, false) => {
                self.stats.header_arrivals += 1;
                if self.cfg.record_headers && !pkt.retransmit {
                    self.header_arrivals.push(now);
                }
                let flow = &mut self.flows[f];
                flow.stats.headers_received += 1;
                let nack = Packet::control(Kind::Nack, pkt.flow, pkt.seq, flow.dst, flow.src, now);
                let dst = flow.dst;
                self.send_control(dst, nack, now);
                self.pull_request(node, pkt.flow, now);
            }
            (Kind::Header, true) => {
                self.stats.bounced_arrivals += 1;
                let flow = &mut self.flows[f];
                flow.stats.bounces += 1;
                flow.on_loss(pkt.seq);
                // The receiver never saw it, so no pull will come for it: resend now.
                flow.credit += 1;
                self.try_send(node, 0, now);
            }
            (Kind::Ack, _) => {
                let flow = &mut self.flows[f];
                flow.on_ack(pkt.seq);
                if flow.transport != Transport::Ndp {
                    self.try_send(node, 0, now); // the window opened
                }
            }
            (Kind::Nack, _) => {
                let flow = &mut self.flows[f];
                flow.stats.nacks += 1;
                flow.on_loss(pkt.seq);
            }
            (Kind::Pull, _) => {
                let flow = &mut self.flows[f];
                flow.stats.pulls += 1;
                flow.credit += 1;
                self.try_send(node, 0, now);
            }
        }
    }

    fn pull_request(&mut self, node: u32, flow: u32, now: Ps) {
        let Node::Host(h) = &mut self.nodes[node as usize] else { unreachable!() };
        h.pulls.push_back(flow);
        if !h.pacer_armed {
            h.pacer_armed = true;
            self.events.schedule(h.pacer_next.max(now), Ev::Pull { node });
        }
    }

    /// The pull pacer: one PULL per MTU time at the receiver's link rate.
    fn pull_tick(&mut self, node: u32, now: Ps) {
        let interval = self.pull_interval;
        let Node::Host(h) = &mut self.nodes[node as usize] else { unreachable!() };
        let mut pull = None;
        while let Some(f) = h.pulls.pop_front() {
            if !self.flows[f as usize].is_finished() {
                pull = Some(f);
                break;
            }
        }
        match pull {
            Some(f) => {
                h.pacer_next = now + interval;
                if h.pulls.is_empty() {
                    h.pacer_armed = false;
                } else {
                    self.events.schedule(h.pacer_next, Ev::Pull { node });
                }
                let flow = &self.flows[f as usize];
                let pkt = Packet::control(Kind::Pull, f, 0, flow.dst, flow.src, now);
                let dst = flow.dst;
                self.send_control(dst, pkt, now);
            }
            None => h.pacer_armed = false,
        }
    }

    fn rto_tick(&mut self, node: u32, now: Ps) {
        let rto = self.cfg.rto;
        let Node::Host(h) = &mut self.nodes[node as usize] else { unreachable!() };
        let mut next: Option<Ps> = None;
        for &f in &h.sending {
            if let Some(t) = self.flows[f as usize].on_rto_check(now, rto) {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        h.rto_armed = next.is_some();
        if let Some(t) = next {
            self.events.schedule(t, Ev::Rto { node });
        }
        self.try_send(node, 0, now);
    }

    fn route(&mut self, sw: u32, dest: u32, flow: u32) -> u16 {
        let lb = self.cfg.load_balance;
        let Node::Switch(s) = &mut self.nodes[sw as usize] else { unreachable!() };
        let r = &s.routes[dest as usize];
        match r.len() {
            0 => panic!("switch {sw} has no route to host {dest}"),
            1 => r[0],
            n => match lb {
                LoadBalance::Spray => r[s.rng.below(n as u64) as usize],
                LoadBalance::Ecmp => {
                    let mut x = SplitMix64::new(((flow as u64) << 32) ^ s.id as u64);
                    r[x.below(n as u64) as usize]
                }
            },
        }
    }

    fn switch_arrive(&mut self, node: u32, in_port: u16, mut pkt: Packet, now: Ps) {
        let (front, ppp) = match &self.nodes[node as usize] {
            Node::Switch(s) => (s.front, self.cfg.ports_per_pipeline),
            Node::Host(_) => unreachable!(),
        };
        if in_port as usize >= front {
            // Back from recirculation: DoD packets are cut by the mirror
            // session here (their notification left when they were dequeued).
            let pipeline = in_port as usize - front;
            let _ = pipeline;
            if pkt.kind == Kind::Data {
                pkt.cut(TrimPoint::Dod);
                self.stats.trims_dod += 1;
            }
            let out = pkt.egress;
            self.enqueue_header_or_bounce(node, out, pkt, now);
            return;
        }
        let out = self.route(node, pkt.destination(), pkt.flow);
        if pkt.kind != Kind::Data {
            self.enqueue_header_or_bounce(node, out, pkt, now);
            return;
        }
        let pipeline = (in_port as usize / ppp) as u16;
        let model = &self.cfg.model;
        let Node::Switch(s) = &mut self.nodes[node as usize] else { unreachable!() };
        match model {
            SwitchModel::DropTail => {
                if s.ports[out as usize].queue.try_enqueue_data(pkt).is_err() {
                    self.stats.drops_data_queue += 1;
                }
            }
            SwitchModel::Ideal => match s.ports[out as usize].queue.enqueue_ndp(pkt) {
                NdpVerdict::Queued => {}
                NdpVerdict::Trimmed => self.stats.trims_queue += 1,
                NdpVerdict::ReturnToSender(p) => {
                    self.stats.trims_queue += 1;
                    self.bounce(node, p, now);
                }
            },
            SwitchModel::MirrorOnDrop => {
                if let Err(mut p) = s.ports[out as usize].queue.try_enqueue_data(pkt) {
                    p.cut(TrimPoint::Mirror);
                    p.egress = out;
                    self.stats.trims_mirror += 1;
                    let mirror = (front + pipeline as usize) as u16;
                    if s.ports[mirror as usize].queue.try_enqueue_data(p).is_err() {
                        self.stats.drops_mirror_overflow += 1;
                    }
                    self.try_send(node, mirror, now);
                }
            }
            SwitchModel::Tofino(_) => {
                let tr = s.trimmer.as_mut().expect("Tofino switch has a trimmer");
                match tr.on_data(ns(now), pipeline as usize, out as usize, pkt.size) {
                    IngressVerdict::Trim(_) => {
                        pkt.cut(TrimPoint::Ingress);
                        self.stats.trims_ingress += 1;
                        self.enqueue_header_or_bounce(node, out, pkt, now);
                        return;
                    }
                    IngressVerdict::Forward => {
                        if let Err(mut p) = s.ports[out as usize].queue.try_enqueue_data(pkt) {
                            p.egress = out;
                            self.stats.deflected += 1;
                            let dod = (front + pipeline as usize) as u16;
                            if s.ports[dod as usize].queue.try_enqueue_data(p).is_err() {
                                self.stats.drops_dod_overflow += 1;
                            }
                            self.try_send(node, dod, now);
                        }
                    }
                }
            }
        }
        self.try_send(node, out, now);
    }

    fn enqueue_header_or_bounce(&mut self, node: u32, out: u16, pkt: Packet, now: Ps) {
        let Node::Switch(s) = &mut self.nodes[node as usize] else { unreachable!() };
        match s.ports[out as usize].queue.enqueue_header(pkt) {
            Ok(()) => self.try_send(node, out, now),
            Err(p) if p.kind == Kind::Header && !p.bounced => self.bounce(node, p, now),
            Err(p) if p.is_data_derived() => self.stats.drops_header_queue += 1,
            Err(_) => self.stats.drops_control += 1,
        }
    }

    fn notify(&mut self, node: u32, pipeline: u16, egress: u16, now: Ps) {
        let Node::Switch(s) = &mut self.nodes[node as usize] else { unreachable!() };
        let Some(tr) = &mut s.trimmer else { return };
        let before = tr.notifications();
        tr.on_notify(ns(now), pipeline as usize, egress as usize);
        if tr.notifications() > before {
            self.stats.notifications += 1;
            if self.cfg.record_notifications {
                self.notifications.push((now, egress));
            }
        }
    }

    /// Return-to-sender: the header goes back towards its source.
    fn bounce(&mut self, node: u32, mut pkt: Packet, now: Ps) {
        self.stats.returned_to_sender += 1;
        pkt.bounced = true;
        let out = self.route(node, pkt.src, pkt.flow);
        let Node::Switch(s) = &mut self.nodes[node as usize] else { unreachable!() };
        if s.ports[out as usize].queue.enqueue_header(pkt).is_err() {
            self.stats.drops_header_queue += 1;
            return;
        }
        self.try_send(node, out, now);
    }
}

/// Round robin over the host's flows that may send.
fn next_data(h: &mut Host, flows: &mut [Flow], now: Ps, mtu: u32) -> Option<Packet> {
    let n = h.sending.len();
    for i in 0..n {
        let f = h.sending[(h.rr + i) % n];
        let flow = &mut flows[f as usize];
        if let Some((seq, retransmit)) = flow.next_to_send() {
            h.rr = (h.rr + i + 1) % n;
            flow.on_sent(seq, retransmit, now);
            return Some(Packet {
                kind: Kind::Data,
                trim: TrimPoint::None,
                bounced: false,
                retransmit,
                size: flow.pkt_size.unwrap_or(mtu),
                flow: f,
                seq,
                src: flow.src,
                dst: flow.dst,
                egress: 0,
                sent: now,
            });
        }
    }
    None
}
