//! `fanin-sim`: the simulator's command line.
//!
//! JSON on stdout (with --json), a human summary on stderr, CSV files in --out.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use fanin_sim::trimming::{fig6_pairs, figure, Design, RunSpec, Study, Variant};

const USAGE: &str = "\
usage:
  fanin-sim trimming --figure N [--quick] [--json] [--out DIR] [--seed S]
                     [--duration-us US] [--t0-us US] [--link-delay-ns NS]
                     [--burst PKTS (Fig. 5)] [--initial-window PKTS] [--notify-latency-ns NS]
      the simulation study of 'Packet trimming in programmable switches'
      (N = 5, 6, 7, 8, 9); CSV goes to DIR (default out/sim)
  fanin-sim incast [--senders N] [--pkts P] [--design ideal|tofino|tofino-2m|mod|dod-only] [--json]
      N-to-1 incast of P-packet flows: last completion vs the optimum
  fanin-sim trim-split [--senders N] [--packets P] [--design tofino|tofino-2m] [--spread] [--json]
      the paper's §6.4 table: ingress-meter vs deflect-on-drop trims in a sustained N:1 (4:1)
      incast, open loop, over P (20000) packets arriving at the receiver, senders in one ingress
      pipeline (or --spread: one per pipeline); the paper's figures beside
  fanin-sim end-to-end [--quick] [--clients 1,2,4,8] [--requests N] [--pings N]
                       [--baseline-queue-pkts 200] [--trimming-queue-pkts 12] [--incast 9]
                       [--rto-us US] [--seed S] [--json]
      the paper's §6.5 (Figs. 13, 14): ping times and closed-loop request/response
      clients against a destination that is idle or busy with a 9-flow incast; drop-tail
      200-packet buffers and TCP-like hosts vs trimming with 12 packets and NDP hosts
  fanin-sim permutation [--topology single|leaf-spine|fat-tree] [--k K] [--leaves L --spines S
                        --hosts-per-leaf H] [--ports P] [--model ideal|droptail|mod|dod-only|tofino]
                        [--lb spray|ecmp] [--pkts P] [--initial-window W] [--rate-gbps R]
                        [--delay-ns D] [--seed S] [--json]
      host i -> host (i + n/2) mod n, one NDP flow each: completion times, trims, drops
  fanin-sim allreduce [--workers N] [--elements E] [--elems-per-packet P] [--window W]
                      [--loss P] [--rate-gbps R] [--seed S] [--json]
      one ValueSwitch and N AllreduceSession workers (fanin-proto's machines), int32, checked
  fanin-sim allreduce --spec FILE [--algorithms fanin,ring] [--elements E] [--elems-per-packet P]
                      [--window W] [--loss P] [--rate-gbps R] [--delay-ns D] [--queue-pkts Q]
                      [--stragglers FRACTION --straggler-delay-us US] [--block-exp-ms MS]
                      [--seed S] [--background-load F [--responsive-background]] [--trimming [--tofino]]
                      [--ecn-pkts K] [--time-limit-ms MS] [--json]
      fanin's aggregation tree vs ring allreduce over the network and tree in FILE (written by
      `fanin sim allreduce`, which computes the tree with fanin.controller.tree); Q (1000) is
      every switch port's buffer in datagrams (a host's own queue is its socket: no drops);
      K (0: off) marks fanin's datagrams ECN CE in a switch queue at least K datagrams long
  fanin-sim port-counters --spec FILE --background-load F [--window-us US] [--rate-gbps R]
                          [--delay-ns D] [--queue-pkts Q] [--elems-per-packet P] [--seed S]
                          [--responsive-background] [--trimming [--tofino]] [--json]
      the other tenants' traffic alone on the network in FILE for US (50) µs: bytes each link
      sent and its load (a fraction of the link rate), what a controller reads from the
      switches' port counters before it places a job (`fanin sim allreduce --root-weights spare`)
  fanin-sim goat --spec FILE [--elems-per-packet P] [--window W] [--rate-gbps R] [--delay-ns D]
                 [--queue-pkts Q] [--loss P] [--seed S] [--json]
      a GOAT plan's jobs (the PS as host aggregator, switches' responsibility filters) from FILE
      (written by `fanin sim goat`): every sub-model on every worker, checked; bytes per link
      and message class
  fanin-sim bench-events [--runs R] [--json]
      event rate of the 64-sender Fig. 6 run (Tofino design), median of R runs
";

struct Args {
    rest: Vec<String>,
}

impl Args {
    fn flag(&mut self, name: &str) -> bool {
        if let Some(i) = self.rest.iter().position(|a| a == name) {
            self.rest.remove(i);
            true
        } else {
            false
        }
    }
    fn value<T: std::str::FromStr>(&mut self, name: &str) -> Result<Option<T>, String> {
        let Some(i) = self.rest.iter().position(|a| a == name) else { return Ok(None) };
        if i + 1 >= self.rest.len() {
            return Err(format!("{name} needs a value"));
        }
        let v = self.rest.remove(i + 1);
        self.rest.remove(i);
        v.parse().map(Some).map_err(|_| format!("{name}: cannot parse {v:?}"))
    }
    fn finish(&self) -> Result<(), String> {
        match self.rest.first() {
            Some(a) => Err(format!("unexpected argument {a:?}")),
            None => Ok(()),
        }
    }
}

fn progress_bar(label: String) -> impl FnMut(usize, usize) {
    let tty = std::io::stderr().is_terminal();
    let start = Instant::now();
    move |done, total| {
        let width = 30;
        let filled = done * width / total.max(1);
        let line = format!(
            "{label} [{}{}] {done}/{total} {:.0} s",
            "#".repeat(filled),
            " ".repeat(width - filled),
            start.elapsed().as_secs_f64()
        );
        if tty {
            eprint!("\r{line}");
            if done == total {
                eprintln!();
            }
        } else if done == total || done % 10 == 0 {
            eprintln!("{line}");
        }
        let _ = std::io::stderr().flush();
    }
}

fn study_from(args: &mut Args) -> Result<Study, String> {
    let mut s = Study::default();
    if let Some(v) = args.value("--seed")? {
        s.seed = v;
    }
    if let Some(v) = args.value("--duration-us")? {
        s.duration_us = v;
    }
    if let Some(v) = args.value("--t0-us")? {
        s.t0_us = v;
    }
    if let Some(v) = args.value("--link-delay-ns")? {
        s.link_delay_ns = v;
    }
    if let Some(v) = args.value("--notify-latency-ns")? {
        s.notify_latency_ns = v;
    }
    if let Some(v) = args.value("--burst")? {
        s.fig5_burst_pkts = v;
    }
    if let Some(v) = args.value("--initial-window")? {
        s.initial_window = v;
    }
    Ok(s)
}

fn trimming(mut args: Args) -> Result<(), String> {
    let n: u32 = args.value("--figure")?.ok_or("trimming needs --figure N (5-9)")?;
    let quick = args.flag("--quick");
    let as_json = args.flag("--json");
    let out: PathBuf = args.value::<String>("--out")?.unwrap_or_else(|| "out/sim".into()).into();
    let study = study_from(&mut args)?;
    args.finish()?;
    let mut bar = progress_bar(format!("fig{n}"));
    let t = Instant::now();
    let fig = figure(n, &study, quick, &mut bar).ok_or(format!("no figure {n}: choose 5, 6, 7, 8 or 9"))?;
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut files = Vec::new();
    for (name, text) in &fig.csv {
        let path = out.join(name);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        files.push(path.display().to_string());
    }
    let mut json = fig.json;
    json["csv"] = serde_json::json!(files);
    json["quick"] = serde_json::json!(quick);
    json["wall_s"] = serde_json::json!(t.elapsed().as_secs_f64());
    let json_path = out.join(format!("{}.json", fig.name));
    std::fs::write(&json_path, serde_json::to_string_pretty(&json).expect("json")).map_err(|e| format!("{}: {e}", json_path.display()))?;
    if as_json {
        println!("{}", serde_json::to_string(&json).expect("json"));
    }
    eprint!("{}", fig.summary);
    eprintln!("wrote {} and {} ({:.1} s)", files.join(", "), json_path.display(), t.elapsed().as_secs_f64());
    Ok(())
}

fn bench_events(mut args: Args) -> Result<(), String> {
    let runs: usize = args.value("--runs")?.unwrap_or(3);
    let as_json = args.flag("--json");
    let study = study_from(&mut args)?;
    args.finish()?;
    let spec = RunSpec { design: Design::Tofino, variant: Variant::Full, pairs: fig6_pairs(64), flow_pkts: u32::MAX, t0_us: study.t0_us, record: false };
    let mut rates = Vec::new();
    let mut wall_rates = Vec::new();
    let mut events = 0;
    for _ in 0..runs.max(1) {
        let r = study.run(&spec);
        events = r.stats.events;
        rates.push(r.events_per_cpu_s);
        wall_rates.push(r.events_per_s);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (cpu_median, wall_median) = (median(&mut rates), median(&mut wall_rates));
    let out = serde_json::json!({"experiment": "fig6 64 senders, tofino", "events_per_run": events,
        "runs": rates.len(), "events_per_cpu_s_median": cpu_median, "events_per_cpu_s_all": rates,
        "events_per_wall_s_median": wall_median, "target_events_per_s": 5e6, "target_met": cpu_median >= 5e6});
    if as_json {
        println!("{out}");
    }
    eprintln!(
        "bench-events: {events} events per run, median {:.2} M events per CPU second ({:.2} M per wall second) over {} runs (target 5 M/s on one core: {})",
        cpu_median / 1e6,
        wall_median / 1e6,
        rates.len(),
        if cpu_median >= 5e6 { "met" } else { "NOT met" }
    );
    Ok(())
}

fn incast(mut args: Args) -> Result<(), String> {
    let senders: usize = args.value("--senders")?.unwrap_or(64);
    let pkts: u32 = args.value("--pkts")?.unwrap_or(100);
    let as_json = args.flag("--json");
    let design = match args.value::<String>("--design")?.as_deref().unwrap_or("ideal") {
        "ideal" => Design::Ideal,
        "tofino" => Design::Tofino,
        "mod" => Design::Mod,
        "dod-only" => Design::DodOnly,
        "tofino-2m" => Design::TofinoTwoMeters,
        d => return Err(format!("unknown design {d:?} (ideal, tofino, tofino-2m, mod, dod-only)")),
    };
    let study = study_from(&mut args)?;
    args.finish()?;
    let r = fanin_sim::trimming::incast_check(&study, design, senders, pkts);
    if as_json {
        println!("{r}");
    }
    eprintln!(
        "incast {senders} x {pkts} packets -> 1 ({}): last flow done at {:.1} µs, optimum {:.1} µs (x{:.3}), first at {:.1} µs; {} trims, {} returned to sender, {} timeouts",
        r["design"].as_str().unwrap_or(""),
        r["last_completion_us"].as_f64().unwrap_or(f64::NAN),
        r["optimal_us"].as_f64().unwrap_or(f64::NAN),
        r["last_over_optimal"].as_f64().unwrap_or(f64::NAN),
        r["first_completion_us"].as_f64().unwrap_or(f64::NAN),
        r["trims"],
        r["returned_to_sender"],
        r["timeouts"]
    );
    Ok(())
}

fn allreduce(mut args: Args) -> Result<(), String> {
    if let Some(spec) = args.value::<String>("--spec")? {
        return allreduce_at_scale(args, &spec);
    }
    let mut c = fanin_sim::allreduce::AllreduceConfig::default();
    if let Some(v) = args.value("--workers")? {
        c.workers = v;
    }
    if let Some(v) = args.value("--elements")? {
        c.elements = v;
    }
    if let Some(v) = args.value("--elems-per-packet")? {
        c.elems_per_packet = v;
    }
    if let Some(v) = args.value("--window")? {
        c.window = v;
    }
    if let Some(v) = args.value("--loss")? {
        c.links.loss = v;
    }
    if let Some(v) = args.value("--rate-gbps")? {
        c.links.rate_gbps = v;
    }
    if let Some(v) = args.value("--seed")? {
        c.seed = v;
    }
    let as_json = args.flag("--json");
    args.finish()?;
    let r = fanin_sim::allreduce::run(&c)?;
    if as_json {
        println!("{}", serde_json::to_string(&r).expect("json"));
    }
    eprintln!(
        "allreduce {} workers x {} int32 ({} per packet, window {}, loss {}): {:.1} µs (bound {:.1} µs), {:.1} Gbit/s per worker, {} retransmissions, {} link drops, {} queue drops, verified={}",
        c.workers, c.elements, c.elems_per_packet, c.window, c.links.loss, r.completion_us, r.bound_us, r.goodput_gbps_per_worker,
        r.retransmissions, r.link_drops, r.queue_drops, r.verified
    );
    if r.verified {
        Ok(())
    } else {
        Err("a worker's result differs from the reference sum".into())
    }
}

fn read_scale_spec(spec_path: &str) -> Result<fanin_sim::scale::Spec, String> {
    let text = std::fs::read_to_string(spec_path).map_err(|e| format!("{spec_path}: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("{spec_path}: {e}"))
}

/// The network and traffic options `allreduce --spec` and `port-counters` share.
fn scale_config(args: &mut Args) -> Result<fanin_sim::scale::ScaleConfig, String> {
    let mut c = fanin_sim::scale::ScaleConfig::default();
    macro_rules! opt {
        ($flag:literal, $($field:ident).+) => {
            if let Some(v) = args.value($flag)? {
                c.$($field).+ = v;
            }
        };
    }
    opt!("--elements", elements);
    opt!("--elems-per-packet", elems_per_packet);
    opt!("--window", window);
    opt!("--loss", links.loss);
    opt!("--rate-gbps", links.rate_gbps);
    opt!("--delay-ns", links.link_delay_ns);
    opt!("--queue-pkts", links.queue_pkts);
    opt!("--ecn-pkts", links.ecn_pkts);
    opt!("--stragglers", stragglers);
    opt!("--straggler-delay-us", straggler_delay_us);
    opt!("--block-exp-ms", block_exp_ms);
    opt!("--seed", seed);
    opt!("--background-load", background_load);
    opt!("--time-limit-ms", time_limit_ms);
    if c.time_limit_ms == 0 {
        return Err("--time-limit-ms must be at least 1".into());
    }
    c.links.trimming = args.flag("--trimming");
    c.links.tofino = args.flag("--tofino");
    if c.links.tofino && !c.links.trimming {
        return Err("--tofino is a trimming design: give --trimming with it".into());
    }
    c.background_responsive = args.flag("--responsive-background");
    Ok(c)
}

fn allreduce_at_scale(mut args: Args, spec_path: &str) -> Result<(), String> {
    use fanin_sim::scale::{run, Algorithm};
    let spec = read_scale_spec(spec_path)?;
    let c = scale_config(&mut args)?;
    let algorithms: Vec<Algorithm> =
        args.value::<String>("--algorithms")?.unwrap_or_else(|| "fanin,ring".into()).split(',').map(str::parse).collect::<Result<_, _>>()?;
    let as_json = args.flag("--json");
    args.finish()?;
    let mut results = Vec::new();
    for a in algorithms {
        let mut bar = progress_bar(format!("{a:?} ({} workers)", spec.workers.len()).to_lowercase());
        let r = run(&spec, &c, a, &mut bar)?;
        eprintln!(
            "{} on {}: {} workers x {} int32, loss {}, {} stragglers: {:.1} µs (mean {:.1}), exact={}, {} retransmissions, {} link drops, {} queue drops, {} trims, {:.2} MB on links",
            format!("{:?}", r.algorithm).to_lowercase(), spec.name, spec.workers.len(), c.elements, c.links.loss, r.stragglers.len(), r.completion_us, r.mean_completion_us, r.exact,
            r.retransmissions, r.link_drops, r.queue_drops, r.trims, r.channels.iter().map(|s| s.sent_bytes).sum::<u64>() as f64 / 1e6
        );
        results.push(r);
    }
    if as_json {
        let out = serde_json::json!({ "topology": spec.name, "workers": spec.workers.len(), "config": c, "results": results });
        println!("{}", serde_json::to_string(&out).expect("json"));
    }
    if results.iter().all(|r| r.exact || c.block_exp_ms > 0) {
        Ok(())
    } else {
        Err("a worker's result differs from the reference sum".into())
    }
}

fn port_counters(mut args: Args) -> Result<(), String> {
    let spec_path: String = args.value("--spec")?.ok_or("port-counters needs --spec FILE (written by `fanin sim allreduce`)")?;
    let spec = read_scale_spec(&spec_path)?;
    let c = scale_config(&mut args)?;
    let window_us: u64 = args.value("--window-us")?.unwrap_or(50);
    let as_json = args.flag("--json");
    args.finish()?;
    if window_us == 0 {
        return Err("--window-us must be at least 1".into());
    }
    let window = window_us * 1_000 * fanin_sim::kernel::PS_PER_NS;
    let channels = fanin_sim::scale::port_counters(&spec, &c, window)?;
    // bytes a link can send in the window, wire overhead included
    let capacity = c.links.rate_gbps as f64 * 1e9 / 8.0 * window_us as f64 * 1e-6;
    let load: Vec<f64> = channels.iter().map(|ch| ch.sent_bytes as f64 / capacity).collect();
    let busiest = load.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "port counters on {} after {window_us} µs of background at {}: {} of {} channels carry traffic, the busiest at {busiest:.2} of its rate",
        spec.name, c.background_load, load.iter().filter(|&&l| l > 0.0).count(), load.len()
    );
    if as_json {
        let out = serde_json::json!({ "topology": spec.name, "window_us": window_us, "config": c, "load": load, "channels": channels });
        println!("{}", serde_json::to_string(&out).expect("json"));
    }
    Ok(())
}

fn goat(mut args: Args) -> Result<(), String> {
    use fanin_sim::goat::{run, GoatConfig, GoatSpec, PACKET_OVERHEAD};
    let spec_path: String = args.value("--spec")?.ok_or("goat needs --spec FILE (written by `fanin sim goat`)")?;
    let text = std::fs::read_to_string(&spec_path).map_err(|e| format!("{spec_path}: {e}"))?;
    let spec: GoatSpec = serde_json::from_str(&text).map_err(|e| format!("{spec_path}: {e}"))?;
    let mut c = GoatConfig::default();
    macro_rules! opt {
        ($flag:literal, $($field:ident).+) => {
            if let Some(v) = args.value($flag)? {
                c.$($field).+ = v;
            }
        };
    }
    opt!("--elems-per-packet", elems_per_packet);
    opt!("--window", window);
    opt!("--loss", links.loss);
    opt!("--rate-gbps", links.rate_gbps);
    opt!("--delay-ns", links.link_delay_ns);
    opt!("--queue-pkts", links.queue_pkts);
    opt!("--rto-min-us", rto_min_us);
    opt!("--seed", seed);
    let as_json = args.flag("--json");
    args.finish()?;
    let mut bar = progress_bar(format!("goat {} ({} workers, {} sub-models)", spec.name, spec.workers.len(), spec.jobs.len()));
    let r = run(&spec, &c, &mut bar)?;
    eprintln!(
        "goat on {}: {:.1} µs, exact={}, {} retransmissions, {} queue drops, {:.3} MB of contributions into the PS",
        spec.name, r.completion_us, r.exact, r.retransmissions, r.queue_drops, r.ps_contribution_bytes as f64 / 1e6
    );
    if as_json {
        let out = serde_json::json!({ "topology": spec.name, "workers": spec.workers.len(), "config": c, "packet_overhead_bytes": PACKET_OVERHEAD, "result": r });
        println!("{}", serde_json::to_string(&out).expect("json"));
    }
    if r.exact {
        Ok(())
    } else {
        Err("a worker's result differs from the reference sum".into())
    }
}

fn permutation(mut args: Args) -> Result<(), String> {
    use fanin_sim::permutation::{run, PermutationConfig, Topology};
    let topo: String = args.value("--topology")?.unwrap_or_else(|| "fat-tree".into());
    let topology = match topo.as_str() {
        "single" => Topology::Single { ports: args.value("--ports")?.unwrap_or(16) },
        "leaf-spine" => Topology::LeafSpine {
            leaves: args.value("--leaves")?.unwrap_or(4),
            spines: args.value("--spines")?.unwrap_or(4),
            hosts_per_leaf: args.value("--hosts-per-leaf")?.unwrap_or(4),
        },
        "fat-tree" => Topology::FatTree { k: args.value("--k")?.unwrap_or(4) },
        t => return Err(format!("unknown topology {t:?} (single, leaf-spine, fat-tree)")),
    };
    let lb: String = args.value("--lb")?.unwrap_or_else(|| "spray".into());
    if lb != "spray" && lb != "ecmp" {
        return Err(format!("--lb must be spray or ecmp, got {lb:?}"));
    }
    let cfg = PermutationConfig {
        topology,
        model: args.value("--model")?.unwrap_or_else(|| "ideal".into()),
        spray: lb == "spray",
        rate_gbps: args.value("--rate-gbps")?.unwrap_or(100),
        link_delay_ns: args.value("--delay-ns")?.unwrap_or(500),
        pkts_per_flow: args.value("--pkts")?.unwrap_or(1000),
        initial_window: args.value("--initial-window")?.unwrap_or(100),
        seed: args.value("--seed")?.unwrap_or(1),
    };
    let as_json = args.flag("--json");
    args.finish()?;
    let r = run(&cfg)?;
    if as_json {
        println!("{}", serde_json::to_string(&r).expect("json"));
    }
    eprintln!(
        "permutation on {topo} ({} hosts, {}, {lb}): {}/{} flows done, FCT mean {:.1} µs p99 {:.1} µs max {:.1} µs, goodput {:.1} Gbit/s per flow, {} trims, {} drops, {:.1} M events per CPU second",
        r.hosts, cfg.model, r.finished, r.hosts, r.fct_mean_us, r.fct_p99_us, r.fct_max_us, r.goodput_mean_gbps,
        r.stats.trims(), r.stats.data_drops(), r.events_per_cpu_s / 1e6
    );
    Ok(())
}

/// The lines of [`USAGE`] about `cmd` (each command's entries start with
/// "  fanin-sim CMD" and run to the next command's).
fn command_usage(cmd: &str) -> Option<String> {
    let start = format!("  fanin-sim {cmd} ");
    let mut out = String::new();
    let mut inside = false;
    for line in USAGE.lines() {
        if line.starts_with("  fanin-sim ") {
            inside = line.starts_with(&start);
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    (!out.is_empty()).then_some(out)
}

fn end_to_end(mut args: Args) -> Result<(), String> {
    use fanin_sim::e2e::{figures, EndToEnd};
    let quick = args.flag("--quick");
    let d = EndToEnd::default();
    let e = EndToEnd {
        pings: args.value("--pings")?.unwrap_or(if quick { 50 } else { d.pings }),
        requests_per_client: args.value("--requests")?.unwrap_or(if quick { 50 } else { d.requests_per_client }),
        baseline_queue_pkts: args.value("--baseline-queue-pkts")?.unwrap_or(d.baseline_queue_pkts),
        trimming_queue_pkts: args.value("--trimming-queue-pkts")?.unwrap_or(d.trimming_queue_pkts),
        incast: args.value("--incast")?.unwrap_or(d.incast),
        rto_us: args.value("--rto-us")?.unwrap_or(d.rto_us),
        seed: args.value("--seed")?.unwrap_or(d.seed),
        ..d
    };
    let clients: String = args.value("--clients")?.unwrap_or_else(|| if quick { "1,4".into() } else { "1,2,4,8".into() });
    let clients: Vec<u32> = clients
        .split(',')
        .map(|c| c.trim().parse().map_err(|_| format!("--clients is a comma list of counts, got {c:?}")))
        .collect::<Result<_, _>>()?;
    if e.baseline_queue_pkts == 0 || e.trimming_queue_pkts == 0 || clients.contains(&0) {
        return Err("queues and client counts must be at least 1".into());
    }
    let as_json = args.flag("--json");
    args.finish()?;
    let r = figures(&e, &clients);
    if as_json {
        println!("{r}");
    }
    let num = |v: &serde_json::Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.1}"));
    eprintln!("ping RTT (µs, median / p99), {} pings every {} µs:", e.pings, e.ping_interval_us);
    for p in r["pings"].as_array().into_iter().flatten() {
        eprintln!(
            "  {:9} {:5}  {:>7} / {:>7}  (resent {}, unanswered {})",
            p["system"].as_str().unwrap_or(""),
            if p["busy"] == true { "busy" } else { "idle" },
            num(&p["rtt_us"]["median"]),
            num(&p["rtt_us"]["p99"]),
            p["resent"],
            p["unanswered"]
        );
    }
    eprintln!("closed-loop requests, {} per client (total ms; paper Fig. 14):", e.requests_per_client);
    for q in r["requests"].as_array().into_iter().flatten() {
        eprintln!(
            "  {:9} {:5} {:2} clients  {:>8} ms  (median {} µs per request, resent {})",
            q["system"].as_str().unwrap_or(""),
            if q["busy"] == true { "busy" } else { "idle" },
            q["clients"],
            num(&q["total_ms"]),
            num(&q["latency_us"]["median"]),
            q["resent"]
        );
    }
    Ok(())
}

fn trim_split(mut args: Args) -> Result<(), String> {
    let senders: usize = args.value("--senders")?.unwrap_or(4);
    let packets: u64 = args.value("--packets")?.unwrap_or(20_000);
    let design = match args.value::<String>("--design")?.as_deref().unwrap_or("tofino") {
        "tofino" => Design::Tofino,
        "tofino-2m" => Design::TofinoTwoMeters,
        d => return Err(format!("unknown design {d:?} (tofino, tofino-2m: the designs with ingress meters)")),
    };
    let as_json = args.flag("--json");
    let spread = args.flag("--spread");
    let study = study_from(&mut args)?;
    args.finish()?;
    let r = fanin_sim::trimming::trim_split(&study, design, senders, packets, spread);
    if as_json {
        println!("{r}");
    }
    eprintln!(
        "{senders}:1 incast, open loop, {packets} packets at the receiver ({}, senders {}): {} ingress trims, {} DoD \
         trims (paper: simulator 13.49 K / 682, Tofino 13.5 K / 678)",
        r["design"].as_str().unwrap_or(""),
        r["senders_placed"].as_str().unwrap_or(""),
        r["ingress_trims"],
        r["dod_trims"]
    );
    Ok(())
}

fn main() -> ExitCode {
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.is_empty() || argv[0] == "-h" || argv[0] == "--help" {
        eprint!("{USAGE}");
        return if argv.is_empty() { ExitCode::from(2) } else { ExitCode::SUCCESS };
    }
    let cmd = argv.remove(0);
    if argv.iter().any(|a| a == "-h" || a == "--help") {
        // `fanin-sim CMD --help`: that command's part of the usage
        return match command_usage(&cmd) {
            Some(text) => {
                print!("usage:\n{text}");
                ExitCode::SUCCESS
            }
            None => {
                eprint!("fanin-sim: unknown command {cmd:?}\n{USAGE}");
                ExitCode::from(2)
            }
        };
    }
    let args = Args { rest: argv };
    let r = match cmd.as_str() {
        "trimming" => trimming(args),
        "bench-events" => bench_events(args),
        "incast" => incast(args),
        "trim-split" => trim_split(args),
        "end-to-end" => end_to_end(args),
        "allreduce" => allreduce(args),
        "permutation" => permutation(args),
        "goat" => goat(args),
        "port-counters" => port_counters(args),
        _ => Err(format!("unknown command {cmd:?}\n{USAGE}")),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fanin-sim: {e}");
            ExitCode::from(2)
        }
    }
}
