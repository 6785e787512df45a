//! Raw UDP forwarding on loopback: the ceiling for any software switch built
//! on these sockets, and the baseline its figures are quoted against.
//!
//! Three threads: a generator floods a forwarder, which sends every datagram
//! it receives on to a sink. Only the forwarder changes between modes:
//!
//! - `send_to`:  one `recv_from` + one `send_to` per datagram (std only);
//! - `batch`:    `recv_batch` + `send_batch` (recvmmsg/sendmmsg);
//! - `gso_gro`:  the same with UDP GRO on receive and GSO on send.
//!
//! The generator always sends in GSO batches (when available) so it stays
//! cheap, and the sink always receives in GRO batches. Each mode runs
//! `--reps` times for `--secs` seconds; the medians are reported.
//!
//! ```text
//! cargo run --release -p fanin-udp --example udp_forward_bench -- \
//!     [--secs 2] [--reps 3] [--size 1024] [--batch 64]
//! ```
//!
//! Prints one JSON object on stdout and a human summary on stderr.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use fanin_udp::{BatchSocket, RecvBatch, SendBatch, GRO_SLOT_SIZE};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    SendTo,
    Batch,
    GsoGro,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::SendTo => "send_to",
            Mode::Batch => "batch",
            Mode::GsoGro => "gso_gro",
        }
    }
}

struct Config {
    secs: f64,
    reps: usize,
    size: usize,
    batch: usize,
}

fn parse_args() -> Config {
    let mut cfg = Config {
        secs: 2.0,
        reps: 3,
        size: 1024,
        batch: 64,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--secs" => cfg.secs = parse(flag, value),
            "--reps" => cfg.reps = parse(flag, value),
            "--size" => cfg.size = parse(flag, value),
            "--batch" => cfg.batch = parse(flag, value),
            _ => usage(&format!("unknown flag {flag}")),
        }
    }
    if cfg.reps == 0 || cfg.batch == 0 || cfg.size == 0 || cfg.size > 65000 || cfg.secs <= 0.0 {
        usage("reps, batch and secs must be positive; size in 1..=65000");
    }
    cfg
}

fn parse<T: std::str::FromStr>(flag: &str, value: &str) -> T {
    value
        .parse()
        .unwrap_or_else(|_| usage(&format!("bad value for {flag}: {value}")))
}

fn usage(msg: &str) -> ! {
    eprintln!("{msg}\nusage: udp_forward_bench [--secs F] [--reps N] [--size BYTES] [--batch N]");
    std::process::exit(2)
}

fn socket() -> BatchSocket {
    let s = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).expect("bind 127.0.0.1");
    s.set_buffer_sizes(4 << 20, 4 << 20).expect("buffer sizes");
    // Lets every loop notice the stop flag even when traffic stops.
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    s
}

struct Run {
    forwarded_pps: f64,
    delivered_pps: f64,
    /// The forwarder thread's CPU time per datagram it handled (each
    /// forwarded datagram is one received and one sent), from its
    /// schedstat: comparable with the switch's `switch_ns_per_datagram`
    /// of `fanin bench allreduce` whether or not the thread had a core to
    /// itself.
    forwarder_cpu_ns_per_datagram: f64,
}

/// CPU nanoseconds thread `tid` of this process has run (0 if unknown).
fn thread_cpu_ns(tid: u64) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn run_once(mode: Mode, cfg: &Config) -> Run {
    let generator = socket();
    let forwarder = Arc::new(socket());
    let sink = Arc::new(socket());
    let fwd_addr = forwarder.local_addr().unwrap();
    let sink_addr = sink.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let forwarded = Arc::new(AtomicU64::new(0));
    let delivered = Arc::new(AtomicU64::new(0));

    // a receive slot holds the largest datagram (a smaller one truncates it)
    let slot = cfg.size.max(2048);
    let fwd_tid = Arc::new(AtomicU64::new(0));
    let sink_thread = {
        let (sink, stop, delivered) = (sink.clone(), stop.clone(), delivered.clone());
        thread::spawn(move || {
            let gro = sink.enable_gro().unwrap_or(false);
            let mut rx = RecvBatch::new(64, if gro { GRO_SLOT_SIZE } else { slot });
            while !stop.load(Ordering::Relaxed) {
                let n = sink.recv_batch(&mut rx).unwrap_or(0);
                delivered.fetch_add(n as u64, Ordering::Relaxed);
            }
        })
    };

    let fwd_thread = {
        let (fwd, stop, forwarded, tid) = (forwarder.clone(), stop.clone(), forwarded.clone(), fwd_tid.clone());
        let batch = cfg.batch;
        thread::spawn(move || {
            // SAFETY: gettid has no preconditions
            tid.store(unsafe { libc::gettid() } as u64, Ordering::Relaxed);
            forward(mode, &fwd, sink_addr, batch, slot, &stop, &forwarded)
        })
    };

    let gen_thread = {
        let stop = stop.clone();
        let (size, batch) = (cfg.size, cfg.batch);
        thread::spawn(move || {
            let mut tx = SendBatch::new(batch);
            tx.set_gso(generator.gso_supported());
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..batch {
                    let p = tx.push(fwd_addr, size);
                    p.fill(0);
                    let n = p.len().min(8);
                    p[..n].copy_from_slice(&seq.to_be_bytes()[..n]);
                    seq += 1;
                }
                let _ = generator.send_batch(&mut tx);
            }
        })
    };

    // Warm up (buffers, page faults, scheduler), then measure a window.
    thread::sleep(Duration::from_millis(200));
    let tid = fwd_tid.load(Ordering::Relaxed);
    let (f0, d0, c0, t0) = (
        forwarded.load(Ordering::Relaxed),
        delivered.load(Ordering::Relaxed),
        thread_cpu_ns(tid),
        Instant::now(),
    );
    thread::sleep(Duration::from_secs_f64(cfg.secs));
    let (f1, d1, c1, t1) = (
        forwarded.load(Ordering::Relaxed),
        delivered.load(Ordering::Relaxed),
        thread_cpu_ns(tid),
        Instant::now(),
    );
    stop.store(true, Ordering::Relaxed);
    for t in [gen_thread, fwd_thread, sink_thread] {
        t.join().unwrap();
    }
    let secs = (t1 - t0).as_secs_f64();
    Run {
        forwarded_pps: (f1 - f0) as f64 / secs,
        delivered_pps: (d1 - d0) as f64 / secs,
        forwarder_cpu_ns_per_datagram: if f1 > f0 { (c1 - c0) as f64 / (2 * (f1 - f0)) as f64 } else { 0.0 },
    }
}

fn forward(
    mode: Mode,
    sock: &BatchSocket,
    to: SocketAddr,
    batch: usize,
    slot: usize,
    stop: &AtomicBool,
    forwarded: &AtomicU64,
) {
    match mode {
        Mode::SendTo => {
            let std_sock = sock.as_std();
            let mut buf = vec![0u8; 65536];
            while !stop.load(Ordering::Relaxed) {
                if let Ok((n, _)) = std_sock.recv_from(&mut buf) {
                    if std_sock.send_to(&buf[..n], to).is_ok() {
                        forwarded.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        Mode::Batch | Mode::GsoGro => {
            let gso = mode == Mode::GsoGro;
            let gro = gso && sock.enable_gro().unwrap_or(false);
            let mut rx = RecvBatch::new(batch, if gro { GRO_SLOT_SIZE } else { slot });
            // With GRO one slot holds up to 64 datagrams.
            let mut tx = SendBatch::new(if gro { batch * 64 } else { batch });
            tx.set_gso(gso && sock.gso_supported());
            while !stop.load(Ordering::Relaxed) {
                if sock.recv_batch(&mut rx).unwrap_or(0) == 0 {
                    continue;
                }
                for (_, payload) in rx.iter() {
                    tx.push_copy(to, payload);
                }
                let sent = sock.send_batch(&mut tx).unwrap_or(0);
                forwarded.fetch_add(sent as u64, Ordering::Relaxed);
            }
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn json_list(v: &[f64]) -> String {
    let items: Vec<String> = v.iter().map(|x| format!("{x:.0}")).collect();
    format!("[{}]", items.join(","))
}

fn main() {
    let cfg = parse_args();
    let probe = socket();
    let gso = probe.gso_supported();
    let gro = probe.enable_gro().unwrap_or(false);
    drop(probe);

    let modes = [Mode::SendTo, Mode::Batch, Mode::GsoGro];
    let mut fwd: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut del: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    // Interleave modes across repetitions so slow drift in machine load
    // hits them all alike.
    for _ in 0..cfg.reps {
        for (i, &mode) in modes.iter().enumerate() {
            let r = run_once(mode, &cfg);
            fwd[i].push(r.forwarded_pps);
            del[i].push(r.delivered_pps);
            cpu[i].push(r.forwarder_cpu_ns_per_datagram);
        }
    }

    let med: Vec<f64> = fwd.iter().map(|v| median(v.clone())).collect();
    let mode_json: Vec<String> = modes
        .iter()
        .enumerate()
        .map(|(i, m)| {
            format!(
                "{{\"mode\":\"{}\",\"forwarded_pps_median\":{:.0},\"delivered_pps_median\":{:.0},\"forwarder_cpu_ns_per_datagram_median\":{:.1},\"forwarded_pps\":{},\"delivered_pps\":{}}}",
                m.name(),
                med[i],
                median(del[i].clone()),
                median(cpu[i].clone()),
                json_list(&fwd[i]),
                json_list(&del[i]),
            )
        })
        .collect();
    let ratio = |i: usize| if med[0] > 0.0 { med[i] / med[0] } else { 0.0 };
    println!(
        "{{\"bench\":\"udp_forward\",\"transport\":\"loopback\",\"payload_bytes\":{},\"batch\":{},\"secs\":{},\"reps\":{},\"cpus\":{},\"gso\":{},\"gro\":{},\"modes\":[{}],\"speedup_batch_vs_send_to\":{:.2},\"speedup_gso_gro_vs_send_to\":{:.2}}}",
        cfg.size,
        cfg.batch,
        cfg.secs,
        cfg.reps,
        thread::available_parallelism().map_or(0, |n| n.get()),
        gso,
        gro,
        mode_json.join(","),
        ratio(1),
        ratio(2),
    );
    eprintln!(
        "udp_forward on loopback, {} B payload, batch {}, median of {} × {} s:",
        cfg.size, cfg.batch, cfg.reps, cfg.secs
    );
    for (i, m) in modes.iter().enumerate() {
        eprintln!(
            "  {:8} {:>10.0} datagrams/s forwarded ({:.2}× send_to), forwarder {:.0} ns of CPU per datagram in or out",
            m.name(),
            med[i],
            ratio(i),
            median(cpu[i].clone())
        );
    }
}
