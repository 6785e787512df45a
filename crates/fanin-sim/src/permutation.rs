//! A permutation workload on any topology: host i sends one NDP flow to
//! host (i + n/2) mod n, so every flow crosses the fabric (leaf-spine:
//! other leaf; fat-tree: other pod) and load balancing matters.

use fanin_proto::trim::TrimControlConfig;
use serde::Serialize;

use crate::kernel::{percentile, PS_PER_NS, PS_PER_US};
use crate::net::{Link, LoadBalance, NetConfig, NetStats, Sim, SwitchModel};
use crate::topo::{fat_tree, leaf_spine, single_switch};
use crate::trimming::thread_cpu_s;

#[derive(Debug, Clone, Serialize)]
pub enum Topology {
    Single { ports: usize },
    LeafSpine { leaves: usize, spines: usize, hosts_per_leaf: usize },
    FatTree { k: usize },
}

#[derive(Debug, Clone, Serialize)]
pub struct PermutationConfig {
    pub topology: Topology,
    /// "ideal", "droptail", "mod", "dod-only" or "tofino".
    pub model: String,
    pub spray: bool,
    pub rate_gbps: u64,
    pub link_delay_ns: u64,
    pub pkts_per_flow: u32,
    pub initial_window: u32,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PermutationResult {
    pub config: PermutationConfig,
    pub hosts: usize,
    pub finished: usize,
    pub fct_mean_us: f64,
    pub fct_p99_us: f64,
    pub fct_max_us: f64,
    /// Mean per-flow goodput: flow bytes / completion time.
    pub goodput_mean_gbps: f64,
    pub stats: NetStats,
    pub events_per_cpu_s: f64,
}

pub fn build(cfg: &PermutationConfig) -> Result<Sim, String> {
    let model = match cfg.model.as_str() {
        "ideal" => SwitchModel::Ideal,
        "droptail" => SwitchModel::DropTail,
        "mod" => SwitchModel::MirrorOnDrop,
        "tofino" => SwitchModel::Tofino(TrimControlConfig::default()),
        "dod-only" => SwitchModel::Tofino(TrimControlConfig { notify: fanin_proto::trim::NotifyScope::None, ..TrimControlConfig::default() }),
        m => return Err(format!("unknown switch model {m:?} (ideal, droptail, mod, dod-only, tofino)")),
    };
    let mut net = NetConfig {
        model,
        load_balance: if cfg.spray { LoadBalance::Spray } else { LoadBalance::Ecmp },
        initial_window: cfg.initial_window,
        seed: cfg.seed,
        ..NetConfig::default()
    };
    if let SwitchModel::Tofino(tc) = &mut net.model {
        tc.line_rate_bps = cfg.rate_gbps * 1_000_000_000;
    }
    let link = Link::gbps(cfg.rate_gbps, cfg.link_delay_ns);
    Ok(match cfg.topology {
        Topology::Single { ports } => single_switch(net, ports, link),
        Topology::LeafSpine { leaves, spines, hosts_per_leaf } => leaf_spine(net, leaves, spines, hosts_per_leaf, link, link),
        Topology::FatTree { k } => {
            if k < 2 || k & 1 == 1 {
                return Err(format!("fat-tree k must be even and at least 2, got {k}"));
            }
            fat_tree(net, k, link)
        }
    })
}

pub fn run(cfg: &PermutationConfig) -> Result<PermutationResult, String> {
    let mut sim = build(cfg)?;
    let n = sim.hosts() as u32;
    for h in 0..n {
        sim.add_flow(h, (h + n / 2) % n, cfg.pkts_per_flow, 0);
    }
    let c = thread_cpu_s();
    sim.run_until(1_000_000 * PS_PER_US); // 1 s of simulated time at most
    let cpu = thread_cpu_s() - c;
    let mut fct: Vec<f64> = sim.flows.iter().filter_map(|f| f.stats.finished_at_ps).map(|t| t as f64 / PS_PER_US as f64).collect();
    fct.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let k = fct.len();
    let pct = |q: f64| percentile(&fct, q);
    let bytes = cfg.pkts_per_flow as f64 * sim.config().mtu as f64;
    let _ = PS_PER_NS;
    Ok(PermutationResult {
        config: cfg.clone(),
        hosts: n as usize,
        finished: k,
        fct_mean_us: fct.iter().sum::<f64>() / k.max(1) as f64,
        fct_p99_us: pct(0.99),
        fct_max_us: pct(1.0),
        goodput_mean_gbps: fct.iter().map(|t| bytes * 8.0 / (t * 1e-6) / 1e9).sum::<f64>() / k.max(1) as f64,
        stats: sim.stats.clone(),
        events_per_cpu_s: sim.stats.events as f64 / cpu.max(1e-9),
    })
}
