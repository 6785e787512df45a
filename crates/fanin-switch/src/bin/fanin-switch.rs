//! `fanin-switch`: run the switch daemon from a config file.
//! (Python users run the same daemon as `fanin switch`.)

use std::process::ExitCode;
use std::sync::atomic::Ordering;

use fanin_switch::{DaemonConfig, SwitchHandle};

const USAGE: &str = "usage: fanin-switch [--config FILE.toml|FILE.json]

Runs the fanin software switch until SIGINT or SIGTERM.
Without --config: data port 127.0.0.1:9000, control API 127.0.0.1:9100,
metrics http://127.0.0.1:9101/metrics, no jobs (admit them over the control API).
The control API and metrics default to \"auto\": the data port + 100 and + 101
on 127.0.0.1 (a free port if that one is taken; the line printed at start
says where), so a second switch on one machine needs only another data_addr.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let config = match args.as_slice() {
        [] => DaemonConfig::default(),
        [flag, path] if flag == "--config" => match DaemonConfig::from_file(path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("fanin-switch: {e}");
                return ExitCode::from(2);
            }
        },
        [h] if h == "--help" || h == "-h" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let handle = match SwitchHandle::start(config) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("fanin-switch: {e}");
            return ExitCode::from(1);
        }
    };
    let flag = handle.shutdown_flag();
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(e) = signal_hook::flag::register(sig, flag.clone()) {
            eprintln!("fanin-switch: cannot install signal handler: {e}");
            return ExitCode::from(1);
        }
    }
    let info = handle.core().info();
    let mtu = match handle.core().data_mtu() {
        Some(mtu) => format!("MTU {mtu}, packets of up to {} elements", handle.core().packet_elems_max()),
        None => "MTU unknown".to_string(),
    };
    eprintln!(
        "fanin-switch: data {} ({} shards, {mtu}), incarnation {:08x}, control API {}, metrics {}",
        info.data_addr,
        info.shard_count,
        info.incarnation,
        handle.control_addr().map(|a| a.to_string()).unwrap_or_else(|| "off".into()),
        handle.metrics_addr().map(|a| format!("http://{a}/metrics")).unwrap_or_else(|| "off".into())
    );
    handle.wait();
    let _ = flag.load(Ordering::SeqCst);
    eprintln!("fanin-switch: stopped");
    ExitCode::SUCCESS
}
