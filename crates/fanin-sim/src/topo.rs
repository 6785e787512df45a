//! Topologies: one switch, leaf-spine, fat-tree k. Hosts are numbered
//! 0..n in the order given in each builder's documentation.

use crate::net::{Builder, Link, NetConfig, Sim};

/// One switch with `ports` hosts; host i on port i.
pub fn single_switch(cfg: NetConfig, ports: usize, link: Link) -> Sim {
    let mut b = Builder::new(cfg);
    let sw = b.switch();
    for _ in 0..ports {
        let h = b.host();
        b.connect_host(h, sw, link);
    }
    b.build()
}

/// `leaves` leaf switches with `hosts_per_leaf` hosts each, every leaf linked
/// to every one of `spines` spine switches. Host `l * hosts_per_leaf + i` is
/// the i-th host of leaf l.
pub fn leaf_spine(cfg: NetConfig, leaves: usize, spines: usize, hosts_per_leaf: usize, host_link: Link, fabric_link: Link) -> Sim {
    let mut b = Builder::new(cfg);
    let leaf_ids: Vec<u32> = (0..leaves).map(|_| b.switch()).collect();
    let spine_ids: Vec<u32> = (0..spines).map(|_| b.switch()).collect();
    for &l in &leaf_ids {
        for _ in 0..hosts_per_leaf {
            let h = b.host();
            b.connect_host(h, l, host_link);
        }
    }
    for &l in &leaf_ids {
        for &s in &spine_ids {
            b.connect_switches(l, s, fabric_link);
        }
    }
    b.build()
}

/// The k-ary fat-tree (Al-Fares et al.): k pods of k/2 edge and k/2
/// aggregation switches, (k/2)^2 core switches, k^3/4 hosts. Host
/// `pod * k^2/4 + edge * k/2 + i`.
pub fn fat_tree(cfg: NetConfig, k: usize, link: Link) -> Sim {
    assert!(k >= 2 && k & 1 == 0, "fat-tree k must be even");
    let half = k / 2;
    let mut b = Builder::new(cfg);
    let mut edges = Vec::new();
    let mut aggs = Vec::new();
    for _ in 0..k {
        edges.push((0..half).map(|_| b.switch()).collect::<Vec<_>>());
        aggs.push((0..half).map(|_| b.switch()).collect::<Vec<_>>());
    }
    let cores: Vec<u32> = (0..half * half).map(|_| b.switch()).collect();
    for pod_edges in &edges {
        for &e in pod_edges {
            for _ in 0..half {
                let h = b.host();
                b.connect_host(h, e, link);
            }
        }
    }
    for pod in 0..k {
        for &e in &edges[pod] {
            for &a in &aggs[pod] {
                b.connect_switches(e, a, link);
            }
        }
        for (j, &a) in aggs[pod].iter().enumerate() {
            for c in 0..half {
                b.connect_switches(a, cores[j * half + c], link);
            }
        }
    }
    b.build()
}
