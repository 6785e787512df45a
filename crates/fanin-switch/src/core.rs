//! Start-up, admission across shards, and shutdown.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fanin_proto::fault::{DropInjector, ReceiveFaultRates, ReceiveFaults};
use fanin_proto::kv::{KvCounters, KvSwitch, KvSwitchConfig, KvTaskSpec};
use fanin_proto::switch::{AdmitError, Counters, ShardConfig, Uplink, ValueSwitch};
use fanin_udp::BatchSocket;

use fanin_control::{
    AdmitFailure, ControlPlane, ControlServerHandle, JobEntry, KvRegion, NextHop, SwitchInfo, TreeRole,
    KV_AGGREGATOR_BYTES,
};

use crate::config::{DaemonConfig, CONTROL_PORT_OFFSET, METRICS_PORT_OFFSET};
use crate::metrics;
use crate::scanners;
use crate::handover::HandoverGate;
use crate::shard::{kv_owner, Command, ShardStats, ShardThread};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("cannot bind data port {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("cannot start metrics endpoint on {addr}: {source}")]
    Metrics { addr: SocketAddr, source: std::io::Error },
    #[error("job from the config file refused: {0}")]
    Job(AdmitFailure),
    #[error(transparent)]
    Control(#[from] fanin_control::ControlError),
    #[error("cannot start the scanner threads ([aging] threads = true): eventfd: {0}")]
    Scanners(std::io::Error),
    #[error("cannot turn ECN on for a data socket (set `ecn = false` to run without it): {0}")]
    Ecn(std::io::Error),
}

struct ShardLink {
    commands: Sender<Command>,
    stats: Arc<ShardStats>,
}

/// A bind that failed because another process holds the port: an `auto`
/// side port then takes a free one instead.
fn port_taken(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::AddrInUse
}

/// The running switch as the control plane sees it.
pub struct SwitchCore {
    data_addr: SocketAddr,
    shards: Vec<ShardLink>,
    jobs: Mutex<BTreeMap<u32, JobEntry>>,
    /// Jobs relayed for sources this switch does not aggregate (GOAT's
    /// on-path filtering), with their next hop.
    transits: Mutex<BTreeMap<u32, (NextHop, Vec<u16>)>>,
    /// Key-value regions allocated through the control plane. The shards
    /// may free one on their own (the receiver's Release, the idle timer);
    /// `list_kv_regions` prunes those.
    kv_regions: Mutex<BTreeMap<u32, KvTaskSpec<SocketAddr>>>,
    incarnation: u32,
    memory_limit: u64,
    started: Instant,
    /// The data link's MTU (configured or detected), if known.
    data_mtu: Option<u32>,
    /// Most elements per packet a job's packet size may have: one
    /// unfragmented datagram on the data link (`u32::MAX`: unknown).
    packet_elems_max: u32,
}

impl SwitchCore {
    /// Admit a job on every shard, or on none.
    pub fn admit_job(&self, job: JobEntry) -> Result<(), AdmitFailure> {
        let JobEntry { spec, tree } = job;
        spec.validate().map_err(|e| AdmitFailure::Invalid(e.to_string()))?;
        let mut jobs = self.jobs.lock().expect("jobs lock");
        if jobs.contains_key(&spec.job_id) {
            return Err(AdmitFailure::Duplicate(format!("job {} already exists", spec.job_id)));
        }
        let mut admitted = Vec::new();
        for (i, shard) in self.shards.iter().enumerate() {
            let (reply, answer) = mpsc::sync_channel(1);
            let result = shard
                .commands
                .send(Command::AddJob(spec.clone(), uplink(tree), reply))
                .ok()
                .and_then(|_| answer.recv_timeout(Duration::from_secs(5)).ok());
            match result {
                Some(Ok(())) => admitted.push(i),
                other => {
                    // A shard that did not answer in time may still add the
                    // job later: the removal queued behind the AddJob undoes
                    // it then (a shard runs its commands in order), so no
                    // orphan holds memory or refuses a later admission.
                    if other.is_none() {
                        admitted.push(i);
                    }
                    for &j in &admitted {
                        let (reply, answer) = mpsc::sync_channel(1);
                        if self.shards[j].commands.send(Command::RemoveJob(spec.job_id, false, reply)).is_ok() {
                            let _ = answer.recv_timeout(Duration::from_secs(5));
                        }
                    }
                    return Err(match other {
                        Some(Err(e @ AdmitError::OutOfMemory { .. })) => AdmitFailure::OutOfMemory(format!(
                            "{e} (shard {i}; the switch has {} MiB for all jobs, split over {} shards)",
                            self.memory_limit >> 20,
                            self.shards.len()
                        )),
                        Some(Err(e)) => e.into(),
                        Some(Ok(())) | None => AdmitFailure::Internal(format!("shard {i} did not answer")),
                    });
                }
            }
        }
        jobs.insert(spec.job_id, JobEntry { spec, tree });
        Ok(())
    }

    /// Change a job on every shard (members, workers, tree role): either
    /// every shard takes the change or none does. The spec is checked
    /// against the admitted one first, then every shard is asked whether it
    /// would take it (its share of the pooled memory), changing nothing;
    /// only then is it applied. (Applied shard by shard and undone where a
    /// later shard refused, it had already sent the results of blocks it
    /// completed without a member that left, and the undo itself could be
    /// refused, leaving the shards to disagree on the job's members.) What
    /// another job takes between the check and the change may still refuse
    /// it on a shard: then the shards that took it are given the admitted
    /// spec back.
    pub fn update_job(&self, job: JobEntry, awaiting: Vec<u16>) -> Result<(), AdmitFailure> {
        let JobEntry { spec, tree } = job;
        spec.validate().map_err(|e| AdmitFailure::Invalid(e.to_string()))?;
        let mut jobs = self.jobs.lock().expect("jobs lock");
        let Some(entry) = jobs.get_mut(&spec.job_id) else {
            return Err(AdmitFailure::NotFound(format!("job {} does not exist", spec.job_id)));
        };
        if let Some(field) = entry.spec.fixed_field_changed(&spec) {
            return Err(AdmitError::Immutable { job_id: spec.job_id, field }.into());
        }
        if entry.spec.adds_partial_results(&spec) {
            return Err(AdmitError::PartialResultsAdded { job_id: spec.job_id }.into());
        }
        // First every shard says whether it would take it, changing
        // nothing: an update taken and then undone has already sent the
        // results of blocks it completed without a member that left.
        for (i, shard) in self.shards.iter().enumerate() {
            let (reply, answer) = mpsc::sync_channel(1);
            let asked = shard.commands.send(Command::CheckUpdate(spec.clone(), uplink(tree), awaiting.clone(), reply)).ok();
            match asked.and_then(|_| answer.recv_timeout(Duration::from_secs(5)).ok()) {
                Some(Ok(())) => {}
                Some(Err(e)) => return Err(self.update_refused(i, e)),
                None => return Err(AdmitFailure::Internal(format!("shard {i} did not answer"))),
            }
        }
        let update = |shard: &ShardLink, spec: &fanin_proto::job::JobSpec, tree: Option<TreeRole>, awaiting: Vec<u16>| {
            let (reply, answer) = mpsc::sync_channel(1);
            shard
                .commands
                .send(Command::UpdateJob(spec.clone(), uplink(tree), awaiting, reply))
                .ok()
                .and_then(|_| answer.recv_timeout(Duration::from_secs(5)).ok())
        };
        for (i, shard) in self.shards.iter().enumerate() {
            // (what another job took between the check and here may still
            // refuse it: then the shards that took it are given the
            // admitted spec back)
            let failure = match update(shard, &spec, tree, awaiting.clone()) {
                Some(Ok(())) => continue,
                Some(Err(e)) => self.update_refused(i, e),
                None => AdmitFailure::Internal(format!("shard {i} did not answer")),
            };
            // Back to the admitted spec on the shards that took the change
            // (and on one that did not answer: its update, if it comes,
            // is queued ahead of this one). The admitted spec fitted them
            // before, and a smaller floor frees memory, so this does not
            // fail for memory.
            let took = if matches!(failure, AdmitFailure::Internal(_)) { i + 1 } else { i };
            let stuck: Vec<usize> = (0..took)
                .filter(|&j| !matches!(update(&self.shards[j], &entry.spec, entry.tree, Vec::new()), Some(Ok(()))))
                .collect();
            if !stuck.is_empty() {
                return Err(AdmitFailure::Internal(format!(
                    "{failure}; and shards {stuck:?} did not take the admitted spec back, so the job's shards may \
                     disagree on its members: remove job {} and admit it again",
                    spec.job_id
                )));
            }
            return Err(failure);
        }
        *entry = JobEntry { spec, tree };
        Ok(())
    }

    /// Shard `i`'s refusal of an update, as the control API reports it.
    fn update_refused(&self, i: usize, e: AdmitError) -> AdmitFailure {
        match e {
            AdmitError::OutOfMemory { .. } => AdmitFailure::OutOfMemory(format!(
                "{e} (shard {i}; the switch has {} MiB for all jobs, split over {} shards)",
                self.memory_limit >> 20,
                self.shards.len()
            )),
            e => AdmitFailure::from(e),
        }
    }

    pub fn remove_job(&self, job_id: u32) -> Result<(), String> {
        let mut jobs = self.jobs.lock().expect("jobs lock");
        if jobs.remove(&job_id).is_none() {
            return Err(format!("job {job_id} does not exist"));
        }
        for shard in &self.shards {
            let (reply, answer) = mpsc::sync_channel(1);
            if shard.commands.send(Command::RemoveJob(job_id, true, reply)).is_ok() {
                let _ = answer.recv_timeout(Duration::from_secs(5));
            }
        }
        Ok(())
    }

    /// Relay `job_id` toward `next` on every shard (docs/goat.md, "On-path
    /// filtering"); again for a job already relayed: move its next hop.
    pub fn install_transit(&self, job_id: u32, next: NextHop, sources: Vec<u16>) -> Result<(), AdmitFailure> {
        let shards = self.shards.len() as u16;
        if next.shards != shards {
            return Err(AdmitError::BadTransit { job_id, hops: next.shards as usize, shards }.into());
        }
        let mut transits = self.transits.lock().expect("transits lock");
        for i in 0..shards {
            let failure = match self.ask(i, |reply| Command::AddTransit(job_id, next.addrs(), sources.clone(), reply)) {
                Some(Ok(())) => continue,
                Some(Err(e)) => e.into(),
                None => AdmitFailure::Internal(format!("shard {i} did not answer")),
            };
            // all shards or none: the ones that took it go back to before
            for j in 0..i {
                match transits.get(&job_id) {
                    Some((p, s)) => self.ask(j, |reply| Command::AddTransit(job_id, p.addrs(), s.clone(), reply)).map(drop),
                    None => self.ask(j, |reply| Command::RemoveTransit(job_id, reply)).map(drop),
                };
            }
            return Err(failure);
        }
        transits.insert(job_id, (next, sources));
        Ok(())
    }

    /// Stop relaying `job_id` on every shard.
    pub fn remove_transit(&self, job_id: u32) -> Result<(), String> {
        let mut transits = self.transits.lock().expect("transits lock");
        if transits.remove(&job_id).is_none() {
            return Err(format!("job {job_id} is not relayed here"));
        }
        for i in 0..self.shards.len() as u16 {
            let _ = self.ask(i, |reply| Command::RemoveTransit(job_id, reply));
        }
        Ok(())
    }

    /// Ask a shard and wait for its answer (shards answer between batches).
    fn ask<T>(&self, shard: u16, make: impl FnOnce(mpsc::SyncSender<T>) -> Command) -> Option<T> {
        let (reply, answer) = mpsc::sync_channel(1);
        self.shards.get(shard as usize)?.commands.send(make(reply)).ok()?;
        answer.recv_timeout(Duration::from_secs(5)).ok()
    }

    fn kv_data_addr(&self, task_id: u32) -> SocketAddr {
        let mut addr = self.data_addr;
        addr.set_port(addr.port().wrapping_add(kv_owner(task_id, self.shards.len())));
        addr
    }

    /// Allocate a key-value task's region on the shard that owns the task
    /// (ASK step 3) and return that shard's data address.
    pub fn alloc_kv_region(&self, spec: KvTaskSpec<SocketAddr>) -> Result<SocketAddr, AdmitFailure> {
        let id = spec.task_id;
        let owner = kv_owner(id, self.shards.len());
        let mut regions = self.kv_regions.lock().expect("kv lock");
        match self.ask(owner, |r| Command::AddKvTask(Box::new(spec.clone()), r)) {
            Some(Ok(())) => {
                regions.insert(id, spec);
                Ok(self.kv_data_addr(id))
            }
            Some(Err(e)) => Err(e.into()),
            None => Err(AdmitFailure::Internal(format!("shard {owner} did not answer"))),
        }
    }

    /// Free a task's region (ASK step 12, or teardown after a failure).
    pub fn release_kv_region(&self, task_id: u32) -> Result<(), String> {
        let owner = kv_owner(task_id, self.shards.len());
        self.kv_regions.lock().expect("kv lock").remove(&task_id);
        match self.ask(owner, |r| Command::RemoveKvTask(task_id, r)) {
            Some(true) => Ok(()),
            Some(false) => Err(format!("task {task_id} has no key-value region (already released or expired)")),
            None => Err(format!("shard {owner} did not answer")),
        }
    }

    /// The regions still held, with their figures.
    pub fn list_kv_regions(&self) -> Vec<KvRegion> {
        let mut regions = self.kv_regions.lock().expect("kv lock");
        let mut out = Vec::new();
        let mut gone = Vec::new();
        for (&id, spec) in regions.iter() {
            let stats = self.ask(kv_owner(id, self.shards.len()), |r| Command::KvTaskStats(vec![id], r));
            match stats.and_then(|v| v.into_iter().next()).and_then(|(_, s)| s) {
                Some(stats) => out.push(KvRegion { spec: spec.clone(), data_addr: self.kv_data_addr(id), stats }),
                None => gone.push(id),
            }
        }
        for id in gone {
            regions.remove(&id);
        }
        out
    }

    /// Key-value counters summed over shards.
    pub fn kv_counters(&self) -> KvCounters {
        let mut total = KvCounters::default();
        for s in &self.shards {
            total.merge(&s.stats.kv_counters.lock().expect("counters lock"));
        }
        total
    }

    /// Bytes held by key-value regions over all shards.
    pub fn kv_memory_used(&self) -> u64 {
        self.shards.iter().map(|s| s.stats.kv_memory_used.load(Ordering::Relaxed)).sum::<u64>() * KV_AGGREGATOR_BYTES
    }

    pub fn list_jobs(&self) -> Vec<JobEntry> {
        self.jobs.lock().expect("jobs lock").values().cloned().collect()
    }

    /// The data link's MTU (configured or detected), if known.
    pub fn data_mtu(&self) -> Option<u32> {
        self.data_mtu
    }

    /// Most elements per packet of a job's packet size (JoinAck
    /// `packet_elems`): one datagram per frame of the data link.
    pub fn packet_elems_max(&self) -> u32 {
        self.packet_elems_max
    }

    pub fn info(&self) -> SwitchInfo {
        SwitchInfo {
            data_addr: self.data_addr,
            shard_count: self.shards.len() as u16,
            incarnation: self.incarnation,
            memory_limit: self.memory_limit,
            memory_used: self.shards.iter().map(|s| s.stats.memory_used.load(Ordering::Relaxed)).sum(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            packet_elems_max: self.packet_elems_max,
        }
    }

    /// Counters summed over shards.
    pub fn counters(&self) -> Counters {
        let mut total = Counters::default();
        for s in &self.shards {
            total.merge(&s.stats.counters.lock().expect("counters lock"));
        }
        total
    }

    /// Prometheus text exposition of every counter, per shard.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP fanin_switch_packets_total Datagrams by outcome and shard.\n");
        out.push_str("# TYPE fanin_switch_packets_total counter\n");
        for (i, s) in self.shards.iter().enumerate() {
            let c = s.stats.counters.lock().expect("counters lock").clone();
            c.visit(|name, reason, v| {
                let reason = reason.map(|r| format!(",reason=\"{r}\"")).unwrap_or_default();
                out.push_str(&format!("fanin_switch_packets_total{{shard=\"{i}\",counter=\"{name}\"{reason}}} {v}\n"));
            });
        }
        out.push_str("# HELP fanin_switch_fault_dropped_total Datagrams dropped by fault injection.\n");
        out.push_str("# TYPE fanin_switch_fault_dropped_total counter\n");
        for (i, s) in self.shards.iter().enumerate() {
            let ing = s.stats.fault_ingress_dropped.load(Ordering::Relaxed);
            let eg = s.stats.fault_egress_dropped.load(Ordering::Relaxed);
            out.push_str(&format!("fanin_switch_fault_dropped_total{{shard=\"{i}\",direction=\"ingress\"}} {ing}\n"));
            out.push_str(&format!("fanin_switch_fault_dropped_total{{shard=\"{i}\",direction=\"egress\"}} {eg}\n"));
        }
        out.push_str("# HELP fanin_switch_fault_injected_total Received datagrams duplicated or reordered by fault injection.\n");
        out.push_str("# TYPE fanin_switch_fault_injected_total counter\n");
        for (i, s) in self.shards.iter().enumerate() {
            let dup = s.stats.fault_ingress_duplicated.load(Ordering::Relaxed);
            let re = s.stats.fault_ingress_reordered.load(Ordering::Relaxed);
            out.push_str(&format!("fanin_switch_fault_injected_total{{shard=\"{i}\",fault=\"duplicate\"}} {dup}\n"));
            out.push_str(&format!("fanin_switch_fault_injected_total{{shard=\"{i}\",fault=\"reorder\"}} {re}\n"));
        }
        let per_shard: [(&str, &str, fn(&ShardStats) -> &AtomicU64); 3] = [
            ("send_errors", "Batched sends that failed outright (none of the batch went out; its datagrams count as send_dropped).", |st: &ShardStats| &st.send_errors),
            (
                "send_dropped",
                "Datagrams the kernel did not take (queue full, or a send error).",
                |st: &ShardStats| &st.send_dropped,
            ),
            (
                "handover_dropped",
                "Datagrams for another shard dropped: that shard had a full backlog of them.",
                |st: &ShardStats| &st.handover_dropped,
            ),
        ];
        for (name, help, counter) in per_shard {
            out.push_str(&format!("# HELP fanin_switch_{name}_total {help}\n# TYPE fanin_switch_{name}_total counter\n"));
            for (i, s) in self.shards.iter().enumerate() {
                let v = counter(&s.stats).load(Ordering::Relaxed);
                out.push_str(&format!("fanin_switch_{name}_total{{shard=\"{i}\"}} {v}\n"));
            }
        }
        let info = self.info();
        out.push_str("# HELP fanin_switch_kv_packets_total Key-value datagrams by outcome (all shards).\n");
        out.push_str("# TYPE fanin_switch_kv_packets_total counter\n");
        self.kv_counters().visit(|name, reason, v| {
            let reason = reason.map(|r| format!(",reason=\"{r}\"")).unwrap_or_default();
            out.push_str(&format!("fanin_switch_kv_packets_total{{counter=\"{name}\"{reason}}} {v}\n"));
        });
        out.push_str("# TYPE fanin_switch_kv_memory_used_bytes gauge\n");
        out.push_str(&format!("fanin_switch_kv_memory_used_bytes {}\n", self.kv_memory_used()));
        out.push_str("# TYPE fanin_switch_jobs gauge\n");
        out.push_str(&format!("fanin_switch_jobs {}\n", self.jobs.lock().expect("jobs lock").len()));
        out.push_str("# TYPE fanin_switch_memory_used_bytes gauge\n");
        out.push_str(&format!("fanin_switch_memory_used_bytes {}\n", info.memory_used));
        out.push_str("# TYPE fanin_switch_memory_limit_bytes gauge\n");
        out.push_str(&format!("fanin_switch_memory_limit_bytes {}\n", info.memory_limit));
        out.push_str("# TYPE fanin_switch_uptime_seconds gauge\n");
        out.push_str(&format!("fanin_switch_uptime_seconds {:.3}\n", self.started.elapsed().as_secs_f64()));
        out
    }
}

/// The gRPC control API drives the switch through the same methods the
/// config file and the Python bindings use.
impl ControlPlane for SwitchCore {
    fn admit_job(&self, job: JobEntry) -> Result<(), AdmitFailure> {
        SwitchCore::admit_job(self, job)
    }
    fn update_job(&self, job: JobEntry, awaiting: Vec<u16>) -> Result<(), AdmitFailure> {
        SwitchCore::update_job(self, job, awaiting)
    }
    fn remove_job(&self, job_id: u32) -> Result<(), String> {
        SwitchCore::remove_job(self, job_id)
    }
    fn list_jobs(&self) -> Vec<JobEntry> {
        SwitchCore::list_jobs(self)
    }
    fn install_transit(&self, job_id: u32, next: NextHop, sources: Vec<u16>) -> Result<(), AdmitFailure> {
        SwitchCore::install_transit(self, job_id, next, sources)
    }
    fn remove_transit(&self, job_id: u32) -> Result<(), String> {
        SwitchCore::remove_transit(self, job_id)
    }
    fn info(&self) -> SwitchInfo {
        SwitchCore::info(self)
    }
    fn counters(&self) -> Counters {
        SwitchCore::counters(self)
    }
    fn alloc_kv_region(&self, spec: KvTaskSpec<SocketAddr>) -> Result<SocketAddr, AdmitFailure> {
        SwitchCore::alloc_kv_region(self, spec)
    }
    fn release_kv_region(&self, task_id: u32) -> Result<(), String> {
        SwitchCore::release_kv_region(self, task_id)
    }
    fn list_kv_regions(&self) -> Vec<KvRegion> {
        SwitchCore::list_kv_regions(self)
    }
    fn kv_counters(&self) -> KvCounters {
        SwitchCore::kv_counters(self)
    }
}

/// A running switch: its shard threads, metrics endpoint and control plane.
pub struct SwitchHandle {
    core: Arc<SwitchCore>,
    shutdown: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    metrics_addr: Option<SocketAddr>,
    control: Option<ControlServerHandle>,
}

impl SwitchHandle {
    /// Bind every port, start the shard threads and the metrics endpoint,
    /// and admit the jobs of the config. Fails before anything runs if a port
    /// is taken or a job is refused.
    pub fn start(config: DaemonConfig) -> Result<Self, StartError> {
        config.validate()?;
        let sockets = bind_data_ports(config.data_addr, config.shards)?;
        let data_addr = sockets[0].local_addr().map_err(|source| StartError::Bind { addr: config.data_addr, source })?;
        let incarnation = new_incarnation();
        // Packets sized to the data link: a datagram cut into IP fragments
        // is lost whole when any fragment is (docs/protocol.md §2.2).
        let data_mtu = match config.data_mtu {
            0 => fanin_udp::bound_mtu(&data_addr).ok().flatten(),
            mtu => Some(mtu),
        };
        let packet_elems_max =
            data_mtu.map_or(u32::MAX, |mtu| fanin_wire::value::elems_fitting_mtu(mtu, data_addr.is_ipv6()));
        let memory_limit = config.memory_mb << 20;
        let per_shard = memory_limit / config.shards as u64;
        let shutdown = Arc::new(AtomicBool::new(false));
        let open = Arc::new(AtomicBool::new(false));
        let epoch = Instant::now();
        let channels: Vec<_> = (0..config.shards).map(|_| mpsc::channel::<Command>()).collect();
        let senders: Vec<Sender<Command>> = channels.iter().map(|(tx, _)| tx.clone()).collect();
        let handovers = Arc::new(HandoverGate::new(config.shards));
        // Scanner threads (`[aging] threads`): a registry of the shards'
        // scan schedules and an eventfd per shard to wake it with.
        let scanning = if config.aging.threads {
            let wakers = (0..config.shards)
                .map(|_| scanners::Waker::new().map(Arc::new))
                .collect::<std::io::Result<Vec<_>>>()
                .map_err(StartError::Scanners)?;
            let registry: scanners::Registry = Arc::new(Mutex::new(vec![Vec::new(); config.shards as usize]));
            Some((registry, wakers))
        } else {
            None
        };
        let mut links = Vec::new();
        let mut threads = Vec::new();
        for (i, ((_, rx), socket)) in channels.into_iter().zip(sockets).enumerate() {
            let stats = Arc::new(ShardStats::default());
            let _ = socket.set_buffer_sizes(config.socket_buffer, config.socket_buffer);
            let _ = socket.enable_gro();
            if config.ecn {
                socket.enable_ecn().map_err(StartError::Ecn)?;
            }
            // results to jobs' multicast groups leave by the data address's interface
            let multicast = socket.enable_multicast_send().unwrap_or(false);
            let seed = config.faults.seed.wrapping_mul(0x9E37_79B9).wrapping_add(i as u64);
            let shard = ShardThread {
                switch: ValueSwitch::new(ShardConfig {
                    shard: i as u16,
                    shard_count: config.shards,
                    incarnation,
                    memory_limit: per_shard,
                    aging: config.aging.to_config(),
                    seal_clock_us: wall_clock_us(),
                    rate_limit: config.rate_limit,
                    packet_elems_max,
                    memory_model: config.memory_model().expect("validated with the config"),
                }),
                kv: KvSwitch::new(KvSwitchConfig {
                    memory_limit: (config.kv_memory_mb << 20) / config.shards as u64 / KV_AGGREGATOR_BYTES,
                    tenant_limit: (config.kv_tenant_mb << 20) / KV_AGGREGATOR_BYTES,
                    seal_lane: i as u16,
                    seal_clock_us: wall_clock_us(),
                }),
                index: i as u16,
                socket,
                multicast,
                commands: rx,
                peers: senders.clone(),
                handovers: handovers.clone(),
                stats: stats.clone(),
                shutdown: shutdown.clone(),
                open: open.clone(),
                epoch,
                batch: config.batch,
                ingress: ReceiveFaults::new(
                    ReceiveFaultRates {
                        drop: config.faults.ingress_drop,
                        duplicate: config.faults.ingress_duplicate,
                        reorder: config.faults.ingress_reorder,
                    },
                    seed,
                ),
                ingress_order: Vec::new(),
                egress: DropInjector::new(config.faults.egress_drop, seed ^ 0x5555),
                trim: config.trim.watermark()?,
                trimmed: 0,
                not_ect: config.ecn.then(crate::shard::NotEct::default),
                mark: config.trim.mark_watermark()?,
                queue_marked: 0,
                socket_drops: 0,
                scan: scanning.as_ref().map(|(registry, wakers)| (registry.clone(), wakers[i].clone())),
            };
            threads.push(
                std::thread::Builder::new()
                    .name(format!("fanin-shard-{i}"))
                    .spawn(move || shard.run())
                    .expect("spawn shard thread"),
            );
            links.push(ShardLink { commands: senders[i].clone(), stats });
        }
        if let Some((registry, wakers)) = scanning {
            let shards = Arc::new(scanners::Shards { commands: senders.clone(), wakers });
            threads.extend(scanners::spawn(config.aging.scanners, registry, shards, epoch, shutdown.clone()));
        }
        let core = Arc::new(SwitchCore {
            data_addr,
            shards: links,
            jobs: Mutex::new(BTreeMap::new()),
            transits: Mutex::new(BTreeMap::new()),
            kv_regions: Mutex::new(BTreeMap::new()),
            incarnation,
            memory_limit,
            started: epoch,
            data_mtu,
            packet_elems_max,
        });
        let mut handle =
            Self { core: core.clone(), shutdown: shutdown.clone(), threads, metrics_addr: None, control: None };
        for job in &config.jobs {
            let spec = job.to_spec().map_err(|m| StartError::Job(AdmitFailure::Invalid(m)))?;
            if let Err(e) = core.admit_job(JobEntry { spec, tree: None }) {
                handle.stop();
                return Err(StartError::Job(e));
            }
        }
        open.store(true, Ordering::Release);
        // the configured data port: 0 (any) gives free side ports too
        let data_addr = config.data_addr;
        if let Some((addr, fallback)) = config.metrics_addr.resolve(data_addr, METRICS_PORT_OFFSET) {
            let spawned = metrics::spawn(addr, core.clone(), shutdown.clone()).or_else(|e| match fallback && port_taken(&e) {
                true => metrics::spawn(SocketAddr::new(addr.ip(), 0), core.clone(), shutdown.clone()),
                false => Err(e),
            });
            match spawned {
                Ok((thread, bound)) => {
                    handle.threads.push(thread);
                    handle.metrics_addr = Some(bound);
                }
                Err(source) => {
                    handle.stop();
                    return Err(StartError::Metrics { addr, source });
                }
            }
        }
        if let Some((addr, fallback)) = config.control_addr.resolve(data_addr, CONTROL_PORT_OFFSET) {
            let token = config.control_token.clone();
            let spawned = fanin_control::spawn(addr, core.clone(), token.clone()).or_else(|e| match &e {
                fanin_control::ControlError::Bind { source, .. } if fallback && port_taken(source) => {
                    fanin_control::spawn(SocketAddr::new(addr.ip(), 0), core.clone(), token)
                }
                _ => Err(e),
            });
            match spawned {
                Ok(server) => handle.control = Some(server),
                Err(e) => {
                    handle.stop();
                    return Err(e.into());
                }
            }
        }
        Ok(handle)
    }

    /// Address of the gRPC control API, if enabled.
    pub fn control_addr(&self) -> Option<SocketAddr> {
        self.control.as_ref().map(|c| c.local_addr())
    }

    pub fn core(&self) -> &Arc<SwitchCore> {
        &self.core
    }

    pub fn data_addr(&self) -> SocketAddr {
        self.core.data_addr
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// A flag that stops the switch when set (e.g. from a signal handler).
    pub fn shutdown_flag(&self) -> Arc<AtomicBool> {
        self.shutdown.clone()
    }

    fn stop(&mut self) {
        if let Some(control) = self.control.take() {
            let _ = control.shutdown();
        }
        self.shutdown.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Stop every thread and wait for them (graceful: in-flight batches finish).
    pub fn shutdown(mut self) {
        self.stop();
    }

    /// Block until the shutdown flag is set, then stop.
    pub fn wait(mut self) {
        while !self.shutdown.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.stop();
    }
}

impl Drop for SwitchHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Bind `shards` consecutive ports starting at `base`. With port 0, pick a
/// free ephemeral base and retry until a consecutive run is free.
fn bind_data_ports(base: SocketAddr, shards: u16) -> Result<Vec<BatchSocket>, StartError> {
    let attempts = if base.port() == 0 { 20 } else { 1 };
    let mut last_err = None;
    for _ in 0..attempts {
        let first = match BatchSocket::bind(base) {
            Ok(s) => s,
            Err(source) => return Err(StartError::Bind { addr: base, source }),
        };
        let port = first.local_addr().map_err(|source| StartError::Bind { addr: base, source })?.port();
        if !shard_ports_fit(port, shards) {
            // a kernel-chosen port too near the top for the shards' ports
            // (hosts would address past 65535): take another
            let source = std::io::Error::new(
                std::io::ErrorKind::AddrNotAvailable,
                format!(
                    "the kernel chose port {port}, and {shards} shards from it need ports past 65535 \
                     (give data_addr a port of at most {})",
                    65536 - shards as u32
                ),
            );
            last_err = Some(StartError::Bind { addr: base, source });
            continue;
        }
        let mut sockets = vec![first];
        for i in 1..shards {
            let mut addr = base;
            addr.set_port(port + i);
            match BatchSocket::bind(addr) {
                Ok(s) => sockets.push(s),
                Err(source) => {
                    last_err = Some(StartError::Bind { addr, source });
                    break;
                }
            }
        }
        if sockets.len() == shards as usize {
            return Ok(sockets);
        }
    }
    Err(last_err.expect("at least one attempt failed"))
}

/// Shard `i` listens on `first + i`: do the shards' ports all exist?
fn shard_ports_fit(first: u16, shards: u16) -> bool {
    first as u32 + shards.max(1) as u32 - 1 <= u16::MAX as u32
}

#[cfg(test)]
mod port_tests {
    use super::shard_ports_fit;

    #[test]
    fn the_shards_ports_must_stay_below_65536() {
        assert!(shard_ports_fit(65535, 1));
        assert!(shard_ports_fit(65528, 8));
        assert!(!shard_ports_fit(65529, 8), "shard 7 would be port 65536");
        assert!(!shard_ports_fit(65535, 2));
        assert!(shard_ports_fit(9000, 0));
    }
}

/// The shard programs' form of a tree role: one parent address per shard.
fn uplink(tree: Option<TreeRole>) -> Option<Uplink<SocketAddr>> {
    tree.map(|t| Uplink { parent: t.parent_addrs(), rank: t.rank })
}

/// Microseconds since the Unix epoch: where keyed jobs' sequence numbers start.
fn wall_clock_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64)
}

/// A new incarnation for this start of the daemon (odd, never 0). Its low
/// 16 bits are the tag carried in every result, nack and contribution
/// (docs/restart.md): they count 2 ms ticks of the wall clock, so two starts
/// less than 65.5 s apart (a crash loop, a quick restart) always have
/// different tags; the high 16 bits are random, and workers compare all 32
/// bits when they rejoin.
fn new_incarnation() -> u32 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let tick = (since.as_millis() / 2) as u16;
    let tag = (tick << 1) | 1;
    // From the OS's CSPRNG: the incarnation also separates the result keys
    // of one job across restarts (docs/security.md), so its high bits must
    // not be predictable from the start time. The clock and pid only where
    // /dev/urandom cannot be read.
    let mut random = [0u8; 2];
    let from_os = std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random));
    let noise = match from_os {
        Ok(()) => u16::from_ne_bytes(random),
        Err(_) => {
            let mixed = (since.as_nanos() as u64 ^ (std::process::id() as u64).rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (mixed >> 48) as u16
        }
    };
    (noise as u32) << 16 | tag as u32
}
