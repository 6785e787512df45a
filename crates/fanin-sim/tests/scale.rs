//! Aggregation at scale: fanin's tree and ring allreduce on a fat-tree k=4
//! (16 workers, a three-level tree rooted at a core switch). The spec is
//! what `fanin sim allreduce` writes (`fanin.sim_allreduce.build_spec` over
//! `fanin.controller.tree`); regenerate it with
//! `python3 -c "import json; from fanin.topology import generate; from fanin.sim_allreduce import build_spec; json.dump(build_spec(generate('fat-tree:4'), 16), open('crates/fanin-sim/tests/golden/fat_tree_4_allreduce_spec.json', 'w'))"`.

use fanin_sim::fabric::LinkParams;
use fanin_sim::scale::{run, Algorithm, ScaleConfig, ScaleResult, Spec};

fn spec() -> Spec {
    serde_json::from_str(include_str!("golden/fat_tree_4_allreduce_spec.json")).expect("spec")
}

fn config(loss: f64) -> ScaleConfig {
    ScaleConfig { elements: 5_000, links: LinkParams { loss, ..LinkParams::default() }, seed: 7, ..ScaleConfig::default() }
}

fn go(spec: &Spec, cfg: &ScaleConfig, a: Algorithm) -> ScaleResult {
    run(spec, cfg, a, &mut |_, _| {}).expect("run")
}

#[test]
fn spec_is_a_three_level_tree_over_every_host() {
    let s = spec();
    assert_eq!(s.workers.len(), 16);
    let roots: Vec<_> = s.tree.iter().filter(|t| t.parent.is_none()).collect();
    assert_eq!(roots.len(), 1);
    assert!(s.nodes[roots[0].node as usize].name.starts_with("core"));
    // every tree edge is a topology link: tree traffic never crosses a
    // switch that does not aggregate
    for t in &s.tree {
        if let Some(p) = t.parent {
            assert!(s.links.iter().any(|l| (l[0] == t.node && l[1] == p) || (l[1] == t.node && l[0] == p)));
        }
    }
}

#[test]
fn both_algorithms_are_exact_under_loss() {
    let s = spec();
    let cfg = config(0.01);
    for a in [Algorithm::Fanin, Algorithm::Ring] {
        let r = go(&s, &cfg, a);
        assert!(r.exact, "{a:?}: a worker's result differs from the reference sum");
        assert!(r.link_drops > 0, "{a:?}: 1% loss must drop something");
        assert!(r.retransmissions > 0, "{a:?}: losses must be repaired");
    }
}

#[test]
fn same_seed_same_result_other_seed_other_losses() {
    let s = spec();
    let cfg = config(0.02);
    for a in [Algorithm::Fanin, Algorithm::Ring] {
        let x = serde_json::to_string(&go(&s, &cfg, a)).unwrap();
        let y = serde_json::to_string(&go(&s, &cfg, a)).unwrap();
        assert_eq!(x, y, "{a:?} is not deterministic");
        let z = serde_json::to_string(&go(&s, &ScaleConfig { seed: 8, ..cfg.clone() }, a)).unwrap();
        assert_ne!(x, z, "{a:?}: the seed must matter under loss");
    }
}

#[test]
fn every_byte_is_delivered_lost_or_dropped() {
    let s = spec();
    // small queues so drop-tail drops happen too
    let mut cfg = config(0.01);
    cfg.links.queue_pkts = 4;
    for a in [Algorithm::Fanin, Algorithm::Ring] {
        let r = go(&s, &cfg, a);
        assert!(r.exact);
        assert_eq!(r.channels.len(), 2 * s.links.len());
        for (i, c) in r.channels.iter().enumerate() {
            assert_eq!(c.offered_bytes, c.sent_bytes + c.queue_dropped_bytes, "{a:?} channel {i}");
            assert_eq!(c.sent_bytes, c.delivered_bytes + c.lost_bytes, "{a:?} channel {i}");
        }
        let lost: u64 = r.channels.iter().map(|c| c.lost_bytes).sum();
        assert!(lost > 0);
    }
}

#[test]
fn fanin_halves_the_bytes_and_stragglers_delay_both() {
    let s = spec();
    let clean = config(0.0);
    let f = go(&s, &clean, Algorithm::Fanin);
    let r = go(&s, &clean, Algorithm::Ring);
    let bytes = |x: &ScaleResult| x.channels.iter().map(|c| c.sent_bytes).sum::<u64>();
    // ring moves 2(N-1)/N of the data per worker over its host link, fanin 1x up and 1x down
    assert!(bytes(&f) < bytes(&r), "fanin {} vs ring {}", bytes(&f), bytes(&r));
    let late = ScaleConfig { stragglers: 0.125, straggler_delay_us: 300, ..clean };
    for a in [Algorithm::Fanin, Algorithm::Ring] {
        let x = go(&s, &late, a);
        assert_eq!(x.stragglers.len(), 2);
        assert!(x.exact);
        assert!(x.completion_us >= 300.0, "{a:?}: {} µs", x.completion_us);
    }
}

/// 8 workers, one per edge switch of fat-tree:4 (`build_spec(..., 8,
/// spread=True)`), so the 8 hosts left over, one per edge switch, carry
/// background traffic.
fn spread_spec() -> Spec {
    serde_json::from_str(include_str!("golden/fat_tree_4_8_spread_spec.json")).expect("spec")
}

#[test]
fn background_traffic_shares_the_links_is_absorbed_and_slows_the_allreduce() {
    let s = spread_spec();
    assert_eq!(s.workers.len(), 8);
    let quiet = config(0.0);
    let busy = ScaleConfig { background_load: 0.5, ..quiet.clone() };
    for a in [Algorithm::Fanin, Algorithm::Ring] {
        let q = go(&s, &quiet, a);
        let b = go(&s, &busy, a);
        assert!(q.exact && b.exact, "{a:?}");
        assert_eq!((q.background.flows, q.background.sent_bytes), (0, 0));
        assert_eq!(b.background.flows, 8, "{a:?}: every host without a worker sends");
        assert!(b.background.sent_bytes > 0 && b.background.delivered_bytes > 0, "{a:?}: {:?}", b.background);
        // background datagrams are never handed to a worker or a switch
        // program, yet they cross the links: conservation still holds
        for c in &b.channels {
            assert_eq!(c.offered_bytes, c.sent_bytes + c.queue_dropped_bytes);
            assert_eq!(c.sent_bytes, c.delivered_bytes + c.lost_bytes);
        }
        let link_bytes = |x: &ScaleResult| x.channels.iter().map(|c| c.sent_bytes).sum::<u64>();
        assert!(link_bytes(&b) > link_bytes(&q), "{a:?}");
        assert_eq!(b.datagrams, go(&s, &busy, a).datagrams, "{a:?}: deterministic");
        assert!(b.completion_us >= q.completion_us, "{a:?}: {} vs {} µs", b.completion_us, q.completion_us);
    }
    // a spec whose every host runs a worker has no room for background
    let full = spec();
    let err = run(&full, &busy, Algorithm::Fanin, &mut |_, _| {}).unwrap_err();
    assert!(err.contains("at least 2 hosts that run no worker"), "{err}");
}

#[test]
fn trimming_links_turn_queue_drops_into_headers_and_fanin_recovers_sooner() {
    // docs/protocol.md §4.14, docs/simulator.md "Trimming meets aggregation":
    // shallow queues and background traffic overflow the tree's links
    let s = spread_spec();
    let shallow = |trimming| ScaleConfig {
        background_load: 0.5,
        links: LinkParams { queue_pkts: 8, trimming, ..LinkParams::default() },
        ..config(0.0)
    };
    let drop_tail = go(&s, &shallow(false), Algorithm::Fanin);
    let trimming = go(&s, &shallow(true), Algorithm::Fanin);
    assert!(drop_tail.exact && trimming.exact);
    assert!(drop_tail.queue_drops > 0 && drop_tail.trims == 0, "{} drops", drop_tail.queue_drops);
    assert!(trimming.trims > 0, "the same overflow is trimmed instead");
    assert!(trimming.queue_drops < drop_tail.queue_drops, "{} vs {}", trimming.queue_drops, drop_tail.queue_drops);
    for c in &trimming.channels {
        assert_eq!(c.offered_bytes, c.sent_bytes + c.queue_dropped_bytes + c.trimmed_bytes);
        assert_eq!(c.sent_bytes, c.delivered_bytes + c.lost_bytes);
    }
    assert!(
        trimming.completion_us < drop_tail.completion_us,
        "a cut header tells the switch or worker at once: {} vs {} µs",
        trimming.completion_us,
        drop_tail.completion_us
    );
    assert_eq!(trimming.datagrams, go(&s, &shallow(true), Algorithm::Fanin).datagrams, "deterministic");
}

#[test]
fn a_hosts_own_queue_is_its_socket_and_never_drops_while_switch_ports_keep_their_buffer() {
    // a worker's whole window (128 blocks) leaves at once into 8-datagram
    // queues: only switch ports may overflow; the host's queue is its
    // sender's socket, which blocks instead of dropping
    let s = spread_spec();
    let shallow = ScaleConfig { background_load: 0.5, links: LinkParams { queue_pkts: 8, ..LinkParams::default() }, ..config(0.0) };
    for a in [Algorithm::Fanin, Algorithm::Ring] {
        let r = go(&s, &shallow, a);
        assert!(r.exact, "{a:?}");
        for (i, l) in s.links.iter().enumerate() {
            for (k, from) in [l[0], l[1]].into_iter().enumerate() {
                let c = &r.channels[2 * i + k];
                if !s.nodes[from as usize].switch {
                    assert_eq!(c.queue_dropped_bytes, 0, "{a:?}: host {} dropped from its own queue", s.nodes[from as usize].name);
                }
            }
        }
    }
    assert!(go(&s, &shallow, Algorithm::Fanin).queue_drops > 0, "the switches' 8-datagram ports still overflow");
}

#[test]
fn the_tofino_design_on_the_links_trims_in_ingress_deflects_notifies_and_stays_exact() {
    // the same overflow as above, with the trimming study's Tofino design in
    // every switch instead of ideal NDP queues
    let s = spread_spec();
    let busy = |trimming, tofino| ScaleConfig {
        background_load: 0.5,
        links: LinkParams { queue_pkts: 8, trimming, tofino, ..LinkParams::default() },
        ..config(0.0)
    };
    let drop_tail = go(&s, &busy(false, false), Algorithm::Fanin);
    let ndp = go(&s, &busy(true, false), Algorithm::Fanin);
    let tofino = go(&s, &busy(true, true), Algorithm::Fanin);
    assert!(tofino.exact);
    assert_eq!(ndp.tofino, Default::default(), "ideal NDP queues have no meters");
    let t = tofino.tofino;
    assert!(t.trims_ingress > 0, "meters trim the excess in ingress: {t:?}");
    // every deflected datagram notifies when it leaves the recirculation
    // port and is cut when it comes back; hosts' queues never trim, and no
    // header queue overflowed, so the trims are exactly the two kinds
    assert_eq!(t.notifications, t.deflected, "{t:?}");
    assert_eq!(tofino.queue_drops, 0);
    assert_eq!(tofino.trims, t.trims_ingress + t.deflected, "{t:?}");
    for c in &tofino.channels {
        assert_eq!(c.offered_bytes, c.sent_bytes + c.queue_dropped_bytes + c.trimmed_bytes);
        assert_eq!(c.sent_bytes, c.delivered_bytes + c.lost_bytes);
    }
    assert!(tofino.completion_us < drop_tail.completion_us, "{} vs {} µs", tofino.completion_us, drop_tail.completion_us);
    assert_eq!(serde_json::to_string(&tofino).unwrap(), serde_json::to_string(&go(&s, &busy(true, true), Algorithm::Fanin)).unwrap(), "deterministic");
}

/// The spread spec with its root shared by every switch outside the tree
/// that is a neighbour of all the root's children (a core switch of the
/// same group in fat-tree:4).
fn multi_root_spec() -> Spec {
    let mut s = spread_spec();
    let root = s.tree.iter().find(|t| t.parent.is_none()).unwrap().node;
    let children: Vec<u32> = s.tree.iter().filter(|t| t.parent == Some(root)).map(|t| t.node).collect();
    let adjacent = |a: u32, b: u32| s.links.iter().any(|l| (l[0] == a && l[1] == b) || (l[0] == b && l[1] == a));
    let peers: Vec<u32> = (0..s.nodes.len() as u32)
        .filter(|&n| s.nodes[n as usize].switch && n != root && !s.tree.iter().any(|t| t.node == n))
        .filter(|&n| children.iter().all(|&c| adjacent(n, c)))
        .collect();
    assert!(!peers.is_empty(), "fat-tree:4 has a second core per group");
    s.root_shards = std::iter::once(root).chain(peers).collect();
    s
}

#[test]
fn a_root_spread_over_several_switches_is_exact_uses_every_uplink_and_keeps_results_in_order() {
    let one = spread_spec();
    let many = multi_root_spec();
    many.validate().unwrap();
    let busy = ScaleConfig { background_load: 0.5, ..config(0.0) };
    let (a, b) = (go(&one, &busy, Algorithm::Fanin), go(&many, &busy, Algorithm::Fanin));
    assert!(a.exact && b.exact);
    // the root's children now send to every root shard: more links carry the job
    let used = |r: &ScaleResult| r.channels.iter().filter(|c| c.sent_bytes > 0).count();
    assert!(used(&b) > used(&a), "{} vs {} channels", used(&b), used(&a));
    // results of different root shards come back on different paths; the
    // JoinAck's order_shards keeps fast retransmission to one shard's
    // results, so reordering across shards is not taken for loss
    assert_eq!(b.queue_drops, 0);
    assert_eq!(b.retransmissions, 0, "no drops, so no retransmission is needed");
    // a root shard must be the root or a switch outside the tree
    let mut bad = many.clone();
    let inner = bad.tree.iter().find(|t| t.parent.is_some()).unwrap().node;
    bad.root_shards.push(inner);
    assert!(bad.validate().unwrap_err().contains("outside the tree"));
}

#[test]
fn a_run_past_its_time_limit_fails_naming_the_workers_without_a_result() {
    // every worker starts 5 ms late; the limit is 1 ms of simulated time
    let late = ScaleConfig { stragglers: 1.0, straggler_delay_us: 5_000, time_limit_ms: 1, ..config(0.0) };
    for a in [Algorithm::Fanin, Algorithm::Ring] {
        let err = run(&spec(), &late, a, &mut |_, _| {}).unwrap_err();
        assert!(err.contains("16 of 16 workers had no result after 1 ms of simulated time"), "{err}");
        assert!(err.contains("--time-limit-ms"), "{err}");
    }
    assert!(go(&spec(), &ScaleConfig { time_limit_ms: 6, ..late }, Algorithm::Fanin).exact, "within the limit");
}

/// Bytes the job sent into `node` over all its links.
fn bytes_into(s: &Spec, r: &ScaleResult, node: u32) -> u64 {
    let mut total = 0;
    for (i, l) in s.links.iter().enumerate() {
        if l[1] == node {
            total += r.channels[2 * i].sent_bytes;
        }
        if l[0] == node {
            total += r.channels[2 * i + 1].sent_bytes;
        }
    }
    total
}

#[test]
fn a_switch_listed_k_times_among_the_root_shards_runs_k_shards_and_takes_k_shares_of_the_blocks() {
    let even = multi_root_spec();
    let (root, peer) = (even.root_shards[0], even.root_shards[1]);
    let mut weighted = even.clone();
    weighted.root_shards = vec![root, peer, peer, peer];
    weighted.validate().unwrap();
    let cfg = config(0.0);
    let (a, b) = (go(&even, &cfg, Algorithm::Fanin), go(&weighted, &cfg, Algorithm::Fanin));
    assert!(a.exact && b.exact);
    assert_eq!(b.retransmissions, 0, "results of the peer's three shards keep their order per shard");
    let ratio = |r: &ScaleResult| bytes_into(&weighted, r, peer) as f64 / bytes_into(&weighted, r, root) as f64;
    // partials come in from every child: the peer gets 3 of 4 blocks' worth
    assert!((ratio(&a) - 1.0).abs() < 0.1, "even: {}", ratio(&a));
    assert!((ratio(&b) - 3.0).abs() < 0.3, "weighted 3:1: {}", ratio(&b));
    // a switch with no share is simply not listed; the root may hold more than one
    weighted.root_shards = vec![root, root];
    let c = go(&weighted, &cfg, Algorithm::Fanin);
    assert!(c.exact);
    assert_eq!(bytes_into(&weighted, &c, peer), 0, "the peer has no share");
}

#[test]
fn port_counters_show_the_background_alone_at_its_load() {
    use fanin_sim::kernel::PS_PER_NS;
    use fanin_sim::scale::port_counters;
    let s = spread_spec();
    let window_us = 40;
    let window = window_us * 1_000 * PS_PER_NS;
    let idle = port_counters(&s, &config(0.0), window).unwrap();
    assert!(idle.iter().all(|c| c.sent_bytes == 0), "no tenant, no traffic");
    let busy = port_counters(&s, &ScaleConfig { background_load: 0.5, ..config(0.0) }, window).unwrap();
    // a host's own link carries its flow at half the rate (its first
    // datagram waits for the flow's phase), never more than the link can
    let capacity = 100e9 / 8.0 * window_us as f64 * 1e-6;
    let loads: Vec<f64> = busy.iter().map(|c| c.sent_bytes as f64 / capacity).collect();
    let busiest = loads.iter().copied().fold(0.0, f64::max);
    assert!(busiest > 0.45 && busiest <= 1.0, "busiest link at {busiest}");
    assert!(loads.iter().filter(|&&l| l > 0.4).count() >= 8, "every tenant's host link: {loads:?}");
}

#[test]
fn responsive_background_backs_off_on_loss_and_constant_background_does_not() {
    let s = spread_spec();
    let busy = |responsive| ScaleConfig {
        background_load: 0.9,
        background_responsive: responsive,
        links: LinkParams { queue_pkts: 8, ..LinkParams::default() },
        ..config(0.0)
    };
    let (fixed, aimd) = (go(&s, &busy(false), Algorithm::Fanin), go(&s, &busy(true), Algorithm::Fanin));
    assert!(fixed.exact && aimd.exact);
    assert_eq!(fixed.background.rate_cuts, 0);
    assert!(aimd.background.rate_cuts > 0, "{:?}", aimd.background);
    // halving on every loss episode, it offers less per microsecond
    let per_us = |r: &ScaleResult| r.background.sent_bytes as f64 / r.completion_us;
    assert!(per_us(&aimd) < per_us(&fixed), "{} vs {} bytes/us", per_us(&aimd), per_us(&fixed));
}

#[test]
fn ecn_marks_fanins_datagrams_in_a_queue_above_its_threshold_and_the_workers_act_on_them() {
    // the same busy network; switch ports mark from 2 queued datagrams on
    // (docs/congestion.md, "ECN"): the marks reach the switches and the
    // workers, and every sum stays exact
    let s = spread_spec();
    let busy = |ecn_pkts| ScaleConfig {
        elements: 100_000, // 400 blocks: more than a window in flight
        background_load: 0.5,
        links: LinkParams { queue_pkts: 32, ecn_pkts, ..LinkParams::default() },
        ..config(0.0)
    };
    let plain = go(&s, &busy(0), Algorithm::Fanin);
    let marked = go(&s, &busy(2), Algorithm::Fanin);
    assert!(plain.exact && marked.exact);
    assert_eq!(plain.ce_marks, 0);
    assert!(marked.ce_marks > 0, "a queue above 2 datagrams is met");
    assert!(marked.ce_marks <= marked.datagrams, "{} marks of {} fanin datagrams", marked.ce_marks, marked.datagrams);
    // the workers acted on the marks: apart from the count of marks the
    // runs differ (smaller windows change when each block leaves)
    assert_ne!(
        (plain.completion_us, plain.events),
        (marked.completion_us, marked.events),
        "the marks changed nothing the workers did"
    );
    assert_eq!(serde_json::to_string(&marked).unwrap(), serde_json::to_string(&go(&s, &busy(2), Algorithm::Fanin)).unwrap(), "deterministic");
}
