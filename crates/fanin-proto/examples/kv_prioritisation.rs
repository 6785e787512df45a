//! Hot-key agnostic prioritisation (ASK §5.4, Figure 9): share of key-value
//! tuples aggregated on the switch as a function of the aggregator-to-
//! distinct-key ratio, with and without shadow copies, on Uniform, Zipf
//! (hot keys first) and Zipf-reversed (cold keys first) streams.
//!
//! It runs the real machines: a `KvSender` packetises the stream
//! (sender-assisted partition), the `KvSwitch` program aggregates, and a
//! `KvReceiver` runs Algorithm 1 (swap after `--swap-threshold` arrived
//! packets, fetch and clear the old copy), all over the in-memory loopback
//! with 1 µs links. Every run is checked against a reference count per key.
//!
//! Prints one JSON document on stdout, a human summary on stderr.
//!
//! ```text
//! cargo run --release -p fanin-proto --example kv_prioritisation -- [--quick]
//!     [--keys 65536] [--tuples 16777216] [--zipf-s 1.0] [--slots 32]
//!     [--window 256] [--swap-threshold 64] [--seed 1]
//!     [--datasets uniform,zipf,zipf-reverse,zipf-shuffled] [--ratios -12..0[:STEP]]
//! ```

use std::collections::HashMap;
use std::time::{Duration, Instant};

use fanin_proto::fault::SplitMix64;
use fanin_proto::kv::loopback::{LinkConfig, Loopback, Node, RunOutcome};
use fanin_proto::kv::{KvReceiver, KvSender, KvSwitch, KvSwitchConfig, KvTaskSpec, Layout, ReceiverConfig, SenderConfig};
use fanin_proto::Time;

struct Args {
    keys: u32,
    tuples: u64,
    zipf_s: f64,
    slots: u32,
    window: u32,
    swap_threshold: u64,
    seed: u64,
    datasets: Vec<String>,
    ratio_exps: Vec<i32>,
}

fn parse_args() -> Args {
    let mut a = Args {
        keys: 1 << 16,
        tuples: 1 << 24,
        zipf_s: 1.0,
        slots: 32,
        window: 256,
        swap_threshold: 64,
        seed: 1,
        datasets: ["uniform", "zipf", "zipf-reverse", "zipf-shuffled"].map(String::from).to_vec(),
        ratio_exps: (-12..=0).collect(),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    let next = |i: &mut usize| -> String {
        *i += 1;
        argv.get(*i).cloned().unwrap_or_else(|| die(&format!("{} needs a value", argv[*i - 1])))
    };
    while i < argv.len() {
        match argv[i].as_str() {
            "--quick" => {
                a.tuples = 1 << 20;
                a.ratio_exps = vec![-12, -10, -8, -6, -4, -2, 0];
            }
            "--keys" => a.keys = num(&next(&mut i)),
            "--tuples" => a.tuples = num(&next(&mut i)),
            "--zipf-s" => a.zipf_s = num(&next(&mut i)),
            "--slots" => a.slots = num(&next(&mut i)),
            "--window" => a.window = num(&next(&mut i)),
            "--swap-threshold" => a.swap_threshold = num(&next(&mut i)),
            "--seed" => a.seed = num(&next(&mut i)),
            "--datasets" => a.datasets = next(&mut i).split(',').map(String::from).collect(),
            "--ratios" => {
                let v = next(&mut i);
                let (range, step) = v.split_once(':').unwrap_or((&v, "1"));
                let (lo, hi) = range.split_once("..").unwrap_or_else(|| die("--ratios wants LO..HI[:STEP] exponents, e.g. -12..0:2"));
                a.ratio_exps = (num::<i32>(lo)..=num::<i32>(hi)).step_by(num::<usize>(step).max(1)).collect();
            }
            "-h" | "--help" => {
                eprintln!("see the header of crates/fanin-proto/examples/kv_prioritisation.rs");
                std::process::exit(0);
            }
            other => die(&format!("unknown argument {other}")),
        }
        i += 1;
    }
    a
}

fn die(msg: &str) -> ! {
    eprintln!("kv_prioritisation: {msg}");
    std::process::exit(2)
}

fn num<T: std::str::FromStr>(s: &str) -> T {
    s.parse().unwrap_or_else(|_| die(&format!("not a number: {s}")))
}

/// Per-key tuple counts, by rank (index 0 = rank 1).
fn counts(dataset: &str, a: &Args) -> Vec<u64> {
    let k = a.keys as usize;
    if dataset == "uniform" {
        return vec![(a.tuples / k as u64).max(1); k];
    }
    let h: f64 = (1..=k).map(|r| 1.0 / (r as f64).powf(a.zipf_s)).sum();
    (1..=k).map(|r| ((a.tuples as f64 / (h * (r as f64).powf(a.zipf_s))).round() as u64).max(1)).collect()
}

/// The stream as key ids. Zipf: hot keys first (each key's tuples in one
/// run, keys by descending frequency), as ASK's "hot keys appear in the
/// front"; zipf-reverse: cold keys first; uniform and zipf-shuffled: iid
/// order (Fisher-Yates with the seed).
fn stream(dataset: &str, a: &Args) -> Vec<u32> {
    let c = counts(dataset, a);
    let mut s: Vec<u32> = Vec::with_capacity(c.iter().sum::<u64>() as usize);
    for (rank, &n) in c.iter().enumerate() {
        s.extend(std::iter::repeat_n(rank as u32, n as usize));
    }
    match dataset {
        "zipf" => {}
        "zipf-reverse" => s.reverse(),
        "uniform" | "zipf-shuffled" => {
            let mut rng = SplitMix64::new(a.seed);
            for i in (1..s.len()).rev() {
                s.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        other => die(&format!("unknown dataset {other}")),
    }
    s
}

struct Row {
    dataset: String,
    shadow: bool,
    ratio_exp: i32,
    aggregators: u64,
    slots: u32,
    aa_size: u32,
    tuples: u64,
    on_switch: u64,
    swaps: u64,
    packets: u64,
    switch_acked: u64,
    seconds: f64,
}

fn run_one(a: &Args, dataset: &str, keys: &[u32], shadow: bool, ratio_exp: i32) -> Row {
    const TASK: u32 = 1;
    let aggregators = ((a.keys as f64) * 2f64.powi(ratio_exp)).round().max(2.0) as u64;
    // Each copy of each AA needs at least one aggregator.
    let slots = (a.slots as u64).min(aggregators / 2).max(1) as u32;
    let copies = if shadow { 2 } else { 1 };
    let aa_size = (aggregators / (slots as u64 * copies)).max(1) as u32;
    let layout = Layout::short_only(slots as u8);

    let mut sw = KvSwitch::new(KvSwitchConfig { memory_limit: u64::MAX / 2, tenant_limit: u64::MAX / 2, ..Default::default() });
    let mut spec = KvTaskSpec::new(TASK, Node::Receiver, layout, aa_size);
    spec.shadow_copies = shadow;
    spec.window = a.window;
    spec.idle_timeout = Duration::ZERO;
    sw.add_task(Time::ZERO, spec).unwrap();
    let mut sc = SenderConfig::new(TASK, 1, layout);
    sc.window = a.window;
    sc.rto = Duration::from_millis(10);
    sc.max_burst = a.window as usize;
    let mut sender = KvSender::new(sc, Time::ZERO).unwrap();
    for &k in keys {
        sender.push(&k.to_be_bytes(), 1).unwrap();
    }
    sender.finish();
    let mut rc = ReceiverConfig::new(TASK, layout, aa_size, 1);
    rc.shadow_copies = shadow;
    rc.swap_threshold = shadow.then_some(a.swap_threshold);
    rc.window = a.window;
    rc.rto = Duration::from_millis(10);
    rc.linger = Duration::from_micros(10);
    rc.max_burst = 1 << 20;
    let receiver = KvReceiver::new(rc, Time::ZERO).unwrap();

    let started = Instant::now();
    let mut lb = Loopback::new(sw, vec![sender], receiver, LinkConfig::perfect());
    let outcome = lb.run(Time::from_secs_f64(1e6));
    if outcome != RunOutcome::Finished {
        die(&format!("{dataset} shadow={shadow} 2^{ratio_exp}: run ended with {outcome:?}"));
    }
    // Exactly once: every key's count equals its number of tuples.
    let mut expected: HashMap<u32, u64> = HashMap::new();
    for &k in keys {
        *expected.entry(k).or_default() += 1;
    }
    let results = lb.receiver.results();
    let ok = results.len() == expected.len()
        && expected.iter().all(|(k, &n)| results.get(&k.to_be_bytes()[..]).is_some_and(|r| r.count == n && r.sum == n as i64));
    if !ok {
        die(&format!("{dataset} shadow={shadow} 2^{ratio_exp}: results differ from the reference"));
    }
    let c = lb.switch.counters();
    Row {
        dataset: dataset.into(),
        shadow,
        ratio_exp,
        aggregators: slots as u64 * aa_size as u64 * copies,
        slots,
        aa_size,
        tuples: c.tuples_in,
        on_switch: c.tuples_aggregated,
        swaps: c.swaps,
        packets: lb.senders[0].stats().packets,
        switch_acked: c.acked,
        seconds: started.elapsed().as_secs_f64(),
    }
}

fn main() {
    let a = parse_args();
    let mut rows = Vec::new();
    for dataset in &a.datasets {
        let keys = stream(dataset, &a);
        // The two modes of a point run side by side (2 threads).
        let pairs: Vec<(Row, Row)> = a
            .ratio_exps
            .iter()
            .map(|&e| {
                std::thread::scope(|s| {
                    let with = s.spawn(|| run_one(&a, dataset, &keys, true, e));
                    let without = run_one(&a, dataset, &keys, false, e);
                    (without, with.join().expect("run panicked"))
                })
            })
            .collect();
        let (without, with): (Vec<Row>, Vec<Row>) = pairs.into_iter().unzip();
        for rows_of_mode in [without, with] {
            for r in rows_of_mode {
                eprintln!(
                    "{:<14} shadow={:<5} ratio=2^{:<3} aggregators={:<6} on-switch {:6.2}%  swaps {:<5} ({:.1} s)",
                    r.dataset,
                    r.shadow,
                    r.ratio_exp,
                    r.aggregators,
                    100.0 * r.on_switch as f64 / r.tuples.max(1) as f64,
                    r.swaps,
                    r.seconds
                );
                rows.push(r);
            }
        }
    }
    let rows_json: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                concat!(
                    "{{\"dataset\":\"{}\",\"shadow_copies\":{},\"ratio_exp\":{},\"ratio\":{},\"aggregators\":{},",
                    "\"slots\":{},\"aa_size_per_copy\":{},\"tuples\":{},\"on_switch_tuples\":{},\"on_switch_ratio\":{:.6},",
                    "\"swaps\":{},\"packets\":{},\"switch_acked_packets\":{},\"seconds\":{:.3},\"verified\":true}}"
                ),
                r.dataset,
                r.shadow,
                r.ratio_exp,
                2f64.powi(r.ratio_exp),
                r.aggregators,
                r.slots,
                r.aa_size,
                r.tuples,
                r.on_switch,
                r.on_switch as f64 / r.tuples.max(1) as f64,
                r.swaps,
                r.packets,
                r.switch_acked,
                r.seconds
            )
        })
        .collect();
    println!(
        "{{\"bench\":\"kv-prioritisation\",\"params\":{{\"keys\":{},\"tuples\":{},\"zipf_s\":{},\"slots\":{},\"window\":{},\"swap_threshold\":{},\"seed\":{}}},\"rows\":[{}]}}",
        a.keys,
        a.tuples,
        a.zipf_s,
        a.slots,
        a.window,
        a.swap_threshold,
        a.seed,
        rows_json.join(",")
    );
}
