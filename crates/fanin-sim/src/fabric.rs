//! A network of links that carry real datagrams (bytes), for experiments
//! that drive fanin-proto's machines: every undirected link is two channels
//! (rate, propagation delay, a drop-tail or NDP trimming queue, seeded
//! independent loss),
//! switches forward store-and-forward along shortest paths (hosts are never
//! transit; among equal-cost next hops a flow hashes to one, ECMP), and every
//! channel counts what it was offered, sent, lost and delivered.
//!
//! `net.rs` carries 40-byte `Copy` packets without payload for the trimming
//! study; aggregation needs the bytes, so it lives here. With
//! `trimming` and `tofino` the switches trim as the study's Tofino design
//! does (`fanin_proto::trim::meter`: ingress meters per egress port, deflect
//! on drop into the pipeline's recirculation port, whose dequeue is the
//! congestion notification), not as ideal NDP queues.

use std::collections::VecDeque;

use fanin_proto::fault::{DropInjector, SplitMix64};
use fanin_proto::trim::{IngressTrimmer, IngressVerdict, NdpVerdict, PortQueue, QueueConfig, TrimControlConfig, Trimmable};
use fanin_proto::Time;
use serde::Serialize;

use crate::kernel::{tx_time, EventQueue, Ps};
use crate::net::{PORTS_PER_PIPELINE, RECIRC_LATENCY};

/// Ethernet (14 + 4 FCS) + IPv4 (20) + UDP (8) bytes per datagram.
pub const WIRE_OVERHEAD: u32 = 46;

/// Fabric events; an experiment wraps them in its own event type.
#[derive(Debug, Clone, Copy)]
pub enum NetEv {
    /// Datagram `buf` reaches the far end of channel `chan`.
    Arrive { chan: u32, buf: u32 },
    TxDone { chan: u32 },
    /// Background flow `flow` sends its next datagram.
    Background { flow: u32 },
    /// The Tofino design: switch `node`'s recirculation port of `pipeline`
    /// finished sending a deflected datagram.
    RecircDone { node: u32, pipeline: u32 },
    /// A deflected datagram is back in `node`'s ingress: cut, it joins the
    /// header queue of channel `chan`.
    RecircArrive { chan: u32, buf: u32 },
}

/// Background traffic (other tenants): a flow sends datagrams of `bytes`
/// (wire overhead included) from `src` to `dst` every `interval`, from its
/// start until [`Fabric::stop_background`]; its datagrams share the queues
/// and links with the experiment's and are absorbed where they arrive.
///
/// A `responsive` flow is a congestion-controlled tenant, TCP-like in the
/// large (AIMD on its rate): `interval` is its fastest pace; each datagram
/// of its lost in a queue (dropped, or trimmed) halves its rate, at most
/// once per [`RESPONSIVE_CUT_GAP`], and each datagram sent adds 1 % of
/// the fastest rate back. The sender learns of the loss at once (as from
/// an ECN echo or a trimmed header, without the round trip), which favours
/// the background, if anything.
#[derive(Debug, Clone, Copy)]
pub struct BackgroundFlow {
    pub src: u32,
    pub dst: u32,
    pub bytes: u32,
    pub interval: Ps,
    pub responsive: bool,
}

/// A responsive background flow halves its rate at most once per this long
/// (about a round trip across a few 100 Gbit/s hops).
pub const RESPONSIVE_CUT_GAP: Ps = 10_000 * crate::kernel::PS_PER_NS;

/// A background flow's pace now (responsive flows change it).
#[derive(Debug, Clone, Copy)]
struct BackgroundPace {
    /// Datagrams per ps, at most `1 / flow.interval`.
    rate: f64,
    last_cut: Option<Ps>,
}

/// What the background flows sent and what reached its destination.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct BackgroundStats {
    pub flows: u32,
    pub sent_bytes: u64,
    pub delivered_bytes: u64,
    /// Responsive flows: times a flow halved its rate on a loss.
    #[serde(skip_serializing_if = "is_zero")]
    pub rate_cuts: u64,
}

/// The links of an experiment, as its configuration states them.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LinkParams {
    pub rate_gbps: u64,
    pub link_delay_ns: u64,
    /// Capacity of every switch port's queue, in datagrams of the largest
    /// size (a host's own queue is its socket's: it does not drop).
    pub queue_pkts: u64,
    /// Independent loss probability on every link.
    pub loss: f64,
    /// NDP trimming in every link queue (`fanin_proto::trim::PortQueue`):
    /// a datagram that finds the data queue full is cut to its fanin header
    /// and queued with priority instead of dropped (docs/protocol.md §4.14);
    /// false: drop-tail. Same buffer either way.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub trimming: bool,
    /// With `trimming`: the switches trim as the trimming study's Tofino
    /// design (ingress meters, deflect on drop, notifications; the
    /// paper's §6.2 parameters) instead of ideal NDP queues.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub tofino: bool,
    /// ECN marking threshold of every switch port, in datagrams of the
    /// largest size (DCTCP's K): a fanin datagram that joins a data queue
    /// at least this long is marked Congestion Experienced instead of
    /// waiting to be dropped (docs/congestion.md, "ECN"). 0: no marking.
    /// Background traffic is not ECN-capable and is never marked.
    #[serde(skip_serializing_if = "is_zero")]
    pub ecn_pkts: u64,
}

impl Default for LinkParams {
    fn default() -> Self {
        LinkParams { rate_gbps: 100, link_delay_ns: 500, queue_pkts: 1000, loss: 0.0, trimming: false, tofino: false, ecn_pkts: 0 }
    }
}

impl LinkParams {
    /// Channels for datagrams of at most `max_dgram` bytes (overhead included).
    pub fn channel_config(&self, max_dgram: u64, seed: u64) -> ChannelConfig {
        ChannelConfig {
            rate_bps: self.rate_gbps * 1_000_000_000,
            delay: self.link_delay_ns * crate::kernel::PS_PER_NS,
            cap_bytes: self.queue_pkts * max_dgram,
            loss: self.loss,
            seed,
            trimming: self.trimming,
            tofino: self.trimming && self.tofino,
            ecn_bytes: self.ecn_pkts * max_dgram,
        }
    }
}

/// Every channel's parameters.
#[derive(Debug, Clone, Copy)]
pub struct ChannelConfig {
    pub rate_bps: u64,
    pub delay: Ps,
    pub cap_bytes: u64,
    /// Independent loss probability per datagram.
    pub loss: f64,
    pub seed: u64,
    /// NDP trimming instead of drop-tail when the queue is full.
    pub trimming: bool,
    /// The Tofino design's trimming in every switch (implies `trimming`'s
    /// header queues).
    pub tofino: bool,
    /// Switch ports mark fanin datagrams CE from this many queued bytes on
    /// (0: never).
    pub ecn_bytes: u64,
}

/// A switch's Tofino-design trimming: its ingress trimmer and, per
/// pipeline, the recirculation (deflect-on-drop) port, at the link rate.
struct TofinoSwitch {
    trimmer: IngressTrimmer,
    recirc: Vec<Recirc>,
}

#[derive(Default)]
struct Recirc {
    /// Deflected datagrams: (buffer, the channel it was bound for).
    queue: VecDeque<(u32, u32)>,
    busy: bool,
}

/// A queued datagram as the port queue sees it: its buffer, its length on
/// the wire, and whether a trim cut it (the bytes are cut when it is sent).
#[derive(Debug, Clone, Copy)]
struct Queued {
    buf: u32,
    wire_len: u32,
    cut: bool,
}

impl Trimmable for Queued {
    fn wire_len(&self) -> u32 {
        self.wire_len
    }
    fn trim(&mut self) {
        // what a trimming switch keeps: the fanin header (headers are
        // never cut further: a datagram that short is all header)
        self.wire_len = self.wire_len.min((fanin_wire::value::HEADER_LEN as u32) + WIRE_OVERHEAD);
        self.cut = true;
    }
}

/// One direction of a link. Bytes include `WIRE_OVERHEAD`.
/// Conservation: `offered = queue_dropped + trimmed + sent`, `sent = lost +
/// delivered` once nothing is queued or in flight.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct ChannelStats {
    pub offered_bytes: u64,
    pub queue_dropped_bytes: u64,
    /// Payload bytes a trimming queue cut off (the headers still went).
    #[serde(skip_serializing_if = "is_zero")]
    pub trimmed_bytes: u64,
    /// Serialised onto the link (the per-link traffic figure).
    pub sent_bytes: u64,
    pub sent_pkts: u64,
    pub lost_bytes: u64,
    pub delivered_bytes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A datagram between two nodes, with the bytes a machine emitted.
pub struct Dgram {
    pub src: u32,
    pub dst: u32,
    pub bytes: Vec<u8>,
    /// Background traffic: absorbed at its destination, never handed on.
    pub background: bool,
    /// The background flow that sent it (`u32::MAX`: none).
    pub flow: u32,
    /// A switch port's queue marked it Congestion Experienced on the way.
    pub ce: bool,
}

struct Channel {
    to: u32,
    /// Marks fanin datagrams CE from this many queued bytes (a switch's
    /// port with ECN on; u64::MAX: never).
    ecn_bytes: u64,
    queue: PortQueue<Queued>,
    busy: bool,
    loss: DropInjector,
    stats: ChannelStats,
}

pub struct Fabric {
    chans: Vec<Channel>,
    /// Per node: (neighbour, channel towards it), by neighbour id.
    adj: Vec<Vec<(u32, u32)>>,
    /// `dist[d][v]`: hops from v to d through switches (u32::MAX: none).
    dist: Vec<Vec<u32>>,
    bufs: Vec<Option<Dgram>>,
    free: Vec<u32>,
    cfg: ChannelConfig,
    /// Optional per-class byte counts of every channel (`with_classes`).
    classify: Option<fn(&[u8]) -> usize>,
    class_sent: Vec<Vec<u64>>,
    background: Vec<BackgroundFlow>,
    pace: Vec<BackgroundPace>,
    background_on: bool,
    pub background_stats: BackgroundStats,
    pub datagrams: u64,
    pub queue_drops: u64,
    pub link_drops: u64,
    /// Datagrams a trimming queue cut to their header (`trimming` links;
    /// with `tofino`, in ingress or after a deflection).
    pub trims: u64,
    /// Fanin datagrams a switch port marked CE (`ecn_pkts`).
    pub ce_marks: u64,
    /// The Tofino design: per node (switches only), its trimmer and
    /// recirculation ports; per channel, its port number at its source.
    tofino: Vec<Option<TofinoSwitch>>,
    port_of_chan: Vec<u16>,
    pub tofino_stats: TofinoStats,
}

/// What the Tofino design's switches did (zero without it).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct TofinoStats {
    /// Datagrams an ingress meter trimmed.
    pub trims_ingress: u64,
    /// Datagrams that found their data queue full and were deflected into
    /// the recirculation port (each trimmed when it came back).
    pub deflected: u64,
    /// Congestion notifications (a deflected datagram left a recirculation
    /// port).
    pub notifications: u64,
}

impl Fabric {
    /// `links[i] = (a, b)` becomes channels `2i` (a -> b) and `2i + 1`
    /// (b -> a). `is_switch[v]` says which nodes may forward.
    pub fn new(is_switch: &[bool], links: &[(u32, u32)], cfg: ChannelConfig) -> Self {
        let n = is_switch.len();
        let mut adj: Vec<Vec<(u32, u32)>> = vec![Vec::new(); n];
        let mut chans = Vec::with_capacity(2 * links.len());
        for (i, &(a, b)) in links.iter().enumerate() {
            for (c, (from, to)) in [(a, b), (b, a)].into_iter().enumerate() {
                let chan = (2 * i + c) as u32;
                adj[from as usize].push((to, chan));
                let seed = cfg.seed ^ (chan as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                // NDP's port: the header queue (64 KiB) is served ten to one
                // ahead of data; with drop-tail it stays empty. A host's own
                // queue is its sender's socket, not a switch buffer: it never
                // drops (a Linux UDP socket's send buffer fills, and the
                // sender blocks, before its 1 000-packet device queue does),
                // so `cap_bytes` bounds the switches' ports only.
                let capacity = if is_switch[from as usize] { cfg.cap_bytes } else { u64::MAX };
                let queue = QueueConfig { data_capacity_bytes: capacity, ..QueueConfig::ndp(1500) };
                let ecn_bytes = if is_switch[from as usize] && cfg.ecn_bytes > 0 { cfg.ecn_bytes } else { u64::MAX };
                chans.push(Channel { to, ecn_bytes, queue: PortQueue::new(queue), busy: false, loss: DropInjector::new(cfg.loss, seed), stats: ChannelStats::default() });
            }
        }
        for a in &mut adj {
            a.sort_unstable();
        }
        let mut port_of_chan = vec![0u16; chans.len()];
        for a in &adj {
            for (port, &(_, chan)) in a.iter().enumerate() {
                port_of_chan[chan as usize] = port as u16;
            }
        }
        let tofino = (0..n)
            .map(|v| {
                (cfg.tofino && is_switch[v]).then(|| {
                    let pipelines = adj[v].len().div_ceil(PORTS_PER_PIPELINE).max(1);
                    let config = TrimControlConfig { pipelines, ports_per_pipeline: PORTS_PER_PIPELINE, line_rate_bps: cfg.rate_bps, ..TrimControlConfig::default() };
                    TofinoSwitch { trimmer: IngressTrimmer::new(config), recirc: (0..pipelines).map(|_| Recirc::default()).collect() }
                })
            })
            .collect();
        let dist = (0..n as u32)
            .map(|d| {
                let mut dist = vec![u32::MAX; n];
                dist[d as usize] = 0;
                let mut frontier = VecDeque::from([d]);
                while let Some(v) = frontier.pop_front() {
                    if v != d && !is_switch[v as usize] {
                        continue; // hosts are leaves
                    }
                    for &(u, _) in &adj[v as usize] {
                        if dist[u as usize] == u32::MAX {
                            dist[u as usize] = dist[v as usize] + 1;
                            frontier.push_back(u);
                        }
                    }
                }
                dist
            })
            .collect();
        Fabric {
            chans,
            adj,
            dist,
            bufs: Vec::new(),
            free: Vec::new(),
            cfg,
            classify: None,
            class_sent: Vec::new(),
            background: Vec::new(),
            pace: Vec::new(),
            background_on: false,
            background_stats: BackgroundStats::default(),
            datagrams: 0,
            queue_drops: 0,
            link_drops: 0,
            trims: 0,
            ce_marks: 0,
            tofino,
            port_of_chan,
            tofino_stats: TofinoStats::default(),
        }
    }

    /// Start background flows now; each sends its first datagram at a
    /// seeded offset within its interval, so the flows are not in phase.
    pub fn start_background<E: From<NetEv>>(&mut self, ev: &mut EventQueue<E>, flows: Vec<BackgroundFlow>, seed: u64) {
        let mut rng = SplitMix64::new(seed ^ 0xB6);
        for (i, f) in flows.iter().enumerate() {
            assert!(f.interval > 0 && f.bytes > WIRE_OVERHEAD && f.src != f.dst, "background flow {i}: {f:?}");
            ev.schedule(ev.now() + rng.below(f.interval), NetEv::Background { flow: i as u32 }.into());
        }
        self.background_stats.flows = flows.len() as u32;
        self.pace = flows.iter().map(|f| BackgroundPace { rate: 1.0 / f.interval as f64, last_cut: None }).collect();
        self.background = flows;
        self.background_on = true;
    }

    /// The flows send nothing more (what is queued or in flight still goes).
    pub fn stop_background(&mut self) {
        self.background_on = false;
    }

    /// Also count each channel's sent bytes per class: `classify` maps a
    /// datagram's bytes to a class below `classes` (e.g. by message type, to
    /// tell contributions from results on the same link).
    pub fn with_classes(mut self, classes: usize, classify: fn(&[u8]) -> usize) -> Self {
        self.classify = Some(classify);
        self.class_sent = vec![vec![0; classes]; self.chans.len()];
        self
    }

    /// Bytes (`WIRE_OVERHEAD` included) a channel sent per class; empty
    /// without `with_classes`.
    pub fn class_sent_bytes(&self, chan: usize) -> &[u64] {
        self.class_sent.get(chan).map_or(&[], |v| v.as_slice())
    }

    pub fn channel_stats(&self, chan: usize) -> ChannelStats {
        self.chans[chan].stats
    }

    pub fn channels(&self) -> usize {
        self.chans.len()
    }

    /// Hops between two nodes (u32::MAX: unreachable).
    pub fn hops(&self, from: u32, to: u32) -> u32 {
        self.dist[to as usize][from as usize]
    }

    /// Node `src` sends `bytes` to node `dst`.
    pub fn send<E: From<NetEv>>(&mut self, ev: &mut EventQueue<E>, src: u32, dst: u32, bytes: Vec<u8>) {
        self.datagrams += 1;
        self.inject(ev, Dgram { src, dst, bytes, background: false, flow: u32::MAX, ce: false });
    }

    fn inject<E: From<NetEv>>(&mut self, ev: &mut EventQueue<E>, d: Dgram) {
        let src = d.src;
        let buf = match self.free.pop() {
            Some(i) => {
                self.bufs[i as usize] = Some(d);
                i
            }
            None => {
                self.bufs.push(Some(d));
                self.bufs.len() as u32 - 1
            }
        };
        self.forward(ev, src, None, buf);
    }

    fn next_hop(&self, at: u32, d: &Dgram) -> u32 {
        let dist = &self.dist[d.dst as usize];
        let here = dist[at as usize];
        assert!(here != u32::MAX && here > 0, "node {at} has no route to node {}", d.dst);
        let mut cands = self.adj[at as usize].iter().filter(|&&(u, _)| dist[u as usize].saturating_add(1) == here);
        let n = cands.clone().count() as u64;
        let pick = if n == 1 { 0 } else { SplitMix64::new(((d.src as u64) << 32 | d.dst as u64) ^ ((at as u64) << 48)).below(n) };
        cands.nth(pick as usize).expect("a next hop").1
    }

    /// Datagram `buf` at node `at`, which it reached over channel
    /// `arrived_on` (None: `at` sent it), goes out on the next hop's channel.
    fn forward<E: From<NetEv>>(&mut self, ev: &mut EventQueue<E>, at: u32, arrived_on: Option<u32>, buf: u32) {
        let d = self.bufs[buf as usize].as_ref().expect("live buffer");
        let len = d.bytes.len() as u64 + WIRE_OVERHEAD as u64;
        let chan = self.next_hop(at, d);
        let flow = d.flow;
        self.chans[chan as usize].stats.offered_bytes += len;
        if self.tofino[at as usize].is_some() {
            self.forward_tofino(ev, at, arrived_on, chan, buf, len);
            return;
        }
        let c = &mut self.chans[chan as usize];
        // ECN: a queue above its threshold marks what can respond to it
        // (DCTCP's instantaneous-queue rule); it still queues or drops as
        // without marking (a dropped datagram's mark is not counted)
        let mark = c.queue.data_bytes() >= c.ecn_bytes;
        let item = Queued { buf, wire_len: len as u32, cut: false };
        let mut trimmed = false;
        let queued = if self.cfg.trimming {
            match c.queue.enqueue_ndp(item) {
                NdpVerdict::Queued => true,
                NdpVerdict::Trimmed => {
                    self.trims += 1;
                    trimmed = true;
                    true
                }
                // the header queue is full too: NDP returns the header to
                // its sender; here it is dropped (counted), and the sender
                // recovers as after any loss
                NdpVerdict::ReturnToSender(_) => false,
            }
        } else {
            c.queue.try_enqueue_data(item).is_ok()
        };
        if !queued {
            c.stats.queue_dropped_bytes += len;
            self.queue_drops += 1;
            self.release(buf);
            self.background_loss(flow, ev.now());
            return;
        }
        if trimmed {
            self.background_loss(flow, ev.now());
        }
        if mark {
            let d = self.bufs[buf as usize].as_mut().expect("live buffer");
            if !d.background && !d.ce {
                d.ce = true;
                self.ce_marks += 1;
            }
        }
        self.kick(ev, chan);
    }

    /// The Tofino design at switch `at` (the trimming study's `Tofino`
    /// model, with fanin's datagrams): the ingress pipeline's meter for the
    /// egress port trims, or the datagram is queued; one that finds the
    /// data queue full is deflected into the pipeline's recirculation port,
    /// whose dequeue notifies every pipeline (the congestion signal), and
    /// is cut when it comes back. A datagram the switch sent itself (a
    /// tree switch's partial or result) enters the egress port's pipeline.
    /// One that is all header (cut upstream, or that short) is not metered:
    /// it joins the header queue, as the study's headers and control
    /// packets do.
    fn forward_tofino<E: From<NetEv>>(&mut self, ev: &mut EventQueue<E>, at: u32, arrived_on: Option<u32>, chan: u32, buf: u32, len: u64) {
        let egress = self.port_of_chan[chan as usize] as usize;
        let now = Time::from_nanos(ev.now() / crate::kernel::PS_PER_NS);
        let sw = self.tofino[at as usize].as_mut().expect("a Tofino switch");
        let ingress = arrived_on.map_or(egress, |c| self.port_of_chan[(c ^ 1) as usize] as usize);
        let pipeline = sw.trimmer.pipeline_of(ingress);
        let d = self.bufs[buf as usize].as_ref().expect("live buffer");
        let (flow, header_only) = (d.flow, d.bytes.len() <= fanin_wire::value::HEADER_LEN);
        let mut item = Queued { buf, wire_len: len as u32, cut: false };
        if header_only {
            self.enqueue_header(ev, chan, item);
            return;
        }
        match sw.trimmer.on_data(now, pipeline, egress, len as u32) {
            IngressVerdict::Trim(_) => {
                self.background_loss(flow, ev.now());
                item.trim();
                if self.enqueue_header(ev, chan, item) {
                    self.tofino_stats.trims_ingress += 1;
                    self.trims += 1;
                }
            }
            IngressVerdict::Forward => match self.chans[chan as usize].queue.try_enqueue_data(item) {
                Ok(()) => self.kick(ev, chan),
                Err(_) => {
                    self.tofino_stats.deflected += 1;
                    let r = &mut sw.recirc[pipeline];
                    r.queue.push_back((buf, chan));
                    self.recirc_kick(ev, at, pipeline as u32);
                }
            },
        }
    }

    /// A cut datagram into channel `chan`'s header queue; false when that
    /// is full too, and the datagram is dropped (counted as a drop, not a
    /// trim, as on the NDP path).
    fn enqueue_header<E: From<NetEv>>(&mut self, ev: &mut EventQueue<E>, chan: u32, item: Queued) -> bool {
        let c = &mut self.chans[chan as usize];
        if c.queue.enqueue_header(item).is_err() {
            let d = self.bufs[item.buf as usize].as_ref().expect("live buffer");
            c.stats.queue_dropped_bytes += d.bytes.len() as u64 + WIRE_OVERHEAD as u64;
            self.queue_drops += 1;
            self.release(item.buf);
            return false;
        }
        self.kick(ev, chan);
        true
    }

    /// Switch `node`'s recirculation port of `pipeline` sends its next
    /// deflected datagram, if idle: its dequeue is the notification.
    fn recirc_kick<E: From<NetEv>>(&mut self, ev: &mut EventQueue<E>, node: u32, pipeline: u32) {
        let now = ev.now();
        let sw = self.tofino[node as usize].as_mut().expect("a Tofino switch");
        let r = &mut sw.recirc[pipeline as usize];
        if r.busy {
            return;
        }
        let Some((buf, chan)) = r.queue.pop_front() else { return };
        r.busy = true;
        sw.trimmer.on_notify(Time::from_nanos(now / crate::kernel::PS_PER_NS), pipeline as usize, self.port_of_chan[chan as usize] as usize);
        self.tofino_stats.notifications += 1;
        let len = self.bufs[buf as usize].as_ref().expect("live buffer").bytes.len() as u32 + WIRE_OVERHEAD;
        let done = now + tx_time(len, self.cfg.rate_bps);
        ev.schedule(done, NetEv::RecircDone { node, pipeline }.into());
        ev.schedule(done + RECIRC_LATENCY, NetEv::RecircArrive { chan, buf }.into());
    }

    /// A responsive background flow lost a datagram: halve its rate.
    fn background_loss(&mut self, flow: u32, now: Ps) {
        let Some(f) = self.background.get(flow as usize).filter(|f| f.responsive) else { return };
        let p = &mut self.pace[flow as usize];
        if p.last_cut.map_or(true, |t| now >= t + RESPONSIVE_CUT_GAP) {
            p.rate = (p.rate / 2.0).max(1e-3 / f.interval as f64);
            p.last_cut = Some(now);
            self.background_stats.rate_cuts += 1;
        }
    }

    fn release(&mut self, buf: u32) {
        self.bufs[buf as usize] = None;
        self.free.push(buf);
    }

    fn kick<E: From<NetEv>>(&mut self, ev: &mut EventQueue<E>, chan: u32) {
        let c = &mut self.chans[chan as usize];
        if c.busy {
            return;
        }
        let Some((Queued { buf, cut, .. }, _)) = c.queue.dequeue() else { return };
        let d = self.bufs[buf as usize].as_mut().expect("live buffer");
        if cut && d.bytes.len() > fanin_wire::value::HEADER_LEN {
            c.stats.trimmed_bytes += (d.bytes.len() - fanin_wire::value::HEADER_LEN) as u64;
            d.bytes.truncate(fanin_wire::value::HEADER_LEN);
        }
        let bytes = &d.bytes;
        let len = bytes.len() as u32 + WIRE_OVERHEAD;
        if let Some(classify) = self.classify {
            self.class_sent[chan as usize][classify(bytes)] += len as u64;
        }
        c.busy = true;
        c.stats.sent_bytes += len as u64;
        c.stats.sent_pkts += 1;
        let done = ev.now() + tx_time(len, self.cfg.rate_bps);
        ev.schedule(done, NetEv::TxDone { chan }.into());
        if c.loss.should_drop() {
            c.stats.lost_bytes += len as u64;
            self.link_drops += 1;
            self.release(buf);
        } else {
            ev.schedule(done + self.cfg.delay, NetEv::Arrive { chan, buf }.into());
        }
    }

    /// Handle a fabric event. Returns the datagram when it reached its
    /// destination node; forwards it otherwise.
    pub fn handle<E: From<NetEv>>(&mut self, ev: &mut EventQueue<E>, e: NetEv) -> Option<Dgram> {
        match e {
            NetEv::Background { flow } => {
                if self.background_on {
                    let f = self.background[flow as usize];
                    self.background_stats.sent_bytes += f.bytes as u64;
                    let bytes = vec![0xB6; (f.bytes - WIRE_OVERHEAD) as usize];
                    self.inject(ev, Dgram { src: f.src, dst: f.dst, bytes, background: true, flow, ce: false });
                    let p = &mut self.pace[flow as usize];
                    if f.responsive {
                        p.rate = (p.rate + 0.01 / f.interval as f64).min(1.0 / f.interval as f64);
                    }
                    ev.schedule(ev.now() + (1.0 / p.rate).round() as Ps, NetEv::Background { flow }.into());
                }
                None
            }
            NetEv::TxDone { chan } => {
                self.chans[chan as usize].busy = false;
                self.kick(ev, chan);
                None
            }
            NetEv::Arrive { chan, buf } => {
                let c = &mut self.chans[chan as usize];
                let len = self.bufs[buf as usize].as_ref().expect("live buffer").bytes.len() as u64 + WIRE_OVERHEAD as u64;
                c.stats.delivered_bytes += len;
                let at = c.to;
                if self.bufs[buf as usize].as_ref().is_some_and(|d| d.dst == at) {
                    let d = self.bufs[buf as usize].take();
                    self.free.push(buf);
                    if d.as_ref().is_some_and(|d| d.background) {
                        self.background_stats.delivered_bytes += len;
                        return None;
                    }
                    d
                } else {
                    self.forward(ev, at, Some(chan), buf);
                    None
                }
            }
            NetEv::RecircDone { node, pipeline } => {
                if let Some(sw) = self.tofino[node as usize].as_mut() {
                    sw.recirc[pipeline as usize].busy = false;
                }
                self.recirc_kick(ev, node, pipeline);
                None
            }
            NetEv::RecircArrive { chan, buf } => {
                // back from recirculation: cut here, into the header queue
                let d = self.bufs[buf as usize].as_ref().expect("live buffer");
                let mut item = Queued { buf, wire_len: d.bytes.len() as u32 + WIRE_OVERHEAD, cut: false };
                let flow = d.flow;
                item.trim();
                self.background_loss(flow, ev.now());
                if self.enqueue_header(ev, chan, item) {
                    self.trims += 1;
                }
                None
            }
        }
    }
}
