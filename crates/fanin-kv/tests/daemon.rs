//! The host daemon against an in-process switch daemon, over real UDP and a
//! real Unix socket: two sender channels, results equal a reference map, the
//! switch absorbs tuples, the region is released; bad requests get errors.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use fanin_kv::records::{encode_tuples, read_results};
use fanin_kv::{KvDaemon, KvDaemonConfig};
use fanin_switch::{DaemonConfig, Listen, SwitchHandle};
use serde_json::{json, Value};

fn request(stream: &mut UnixStream, msg: Value) -> Value {
    writeln!(stream, "{msg}").unwrap();
    let mut line = String::new();
    BufReader::new(stream.try_clone().unwrap()).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

fn start() -> (SwitchHandle, KvDaemon, tempdir::Dir) {
    let switch = SwitchHandle::start(DaemonConfig {
        data_addr: "127.0.0.1:0".parse().unwrap(),
        control_addr: Listen::At("127.0.0.1:0".parse().unwrap()),
        metrics_addr: Listen::Off,
        ..DaemonConfig::default()
    })
    .expect("switch starts");
    let dir = tempdir::Dir::new();
    let config: KvDaemonConfig = serde_json::from_value(json!({
        "socket_path": dir.path("kv.sock"),
        "switch_control": switch.control_addr().unwrap().to_string(),
        "silence_ms": 2000,
    }))
    .unwrap();
    let daemon = KvDaemon::start(config).expect("daemon starts");
    (switch, daemon, dir)
}

fn decode(bytes: &[u8]) -> HashMap<Vec<u8>, i64> {
    read_results(bytes).map(|r| r.map(|(key, agg)| (key.to_vec(), agg.sum)).expect("whole records")).collect()
}

#[test]
fn two_channels_through_the_switch_match_the_reference() {
    let (switch, daemon, dir) = start();
    let mut app = UnixStream::connect(daemon.socket_path()).unwrap();
    let created = request(&mut app, json!({"op": "create", "senders": 2, "aa_size": 128}));
    assert_eq!(created["ok"], json!(true), "{created}");
    let ticket = json!({"task_id": created["task_id"], "control": created["control"]});
    let mut reference: HashMap<Vec<u8>, i64> = HashMap::new();
    let mut handles = Vec::new();
    for ch in 0..2u64 {
        let tuples: Vec<(Vec<u8>, i64)> = (0..20_000u64)
            .map(|i| {
                let k = (i * 7 + ch) % 700;
                let key = if k % 50 == 0 { format!("a-rather-long-key-number-{k}") } else { format!("k{k}") };
                (key.into_bytes(), (i % 13) as i64 - 3)
            })
            .collect();
        for (k, v) in &tuples {
            *reference.entry(k.clone()).or_default() += v;
        }
        let path = dir.path(&format!("in{ch}"));
        std::fs::write(&path, encode_tuples(tuples.iter().map(|(k, v)| (&k[..], *v))).unwrap()).unwrap();
        let socket = daemon.socket_path().to_path_buf();
        let ticket = ticket.clone();
        handles.push(std::thread::spawn(move || {
            let mut s = UnixStream::connect(socket).unwrap();
            request(&mut s, json!({"op": "send", "ticket": ticket, "channel": ch, "path": path}))
        }));
    }
    let out = dir.path("results");
    let waited = request(&mut app, json!({"op": "wait", "task_id": created["task_id"], "path": out}));
    assert_eq!(waited["ok"], json!(true), "{waited}");
    let mut absorbed = 0;
    for h in handles {
        let sent = h.join().unwrap();
        assert_eq!(sent["ok"], json!(true), "{sent}");
        absorbed += sent["acks_from_switch"].as_u64().unwrap();
    }
    assert_eq!(decode(&std::fs::read(&out).unwrap()), reference);
    assert!(absorbed > 0, "the switch absorbed no packet");
    assert!(switch.core().kv_counters().tuples_aggregated > 0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !switch.core().list_kv_regions().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(switch.core().list_kv_regions().is_empty(), "the region was not released");
    assert_eq!(switch.core().kv_memory_used(), 0);
}

#[test]
fn bad_requests_get_clear_errors() {
    let (_switch, daemon, dir) = start();
    let mut app = UnixStream::connect(daemon.socket_path()).unwrap();
    let r = request(&mut app, json!({"op": "create", "senders": 0}));
    assert!(r["error"].as_str().unwrap().contains("senders must be"), "{r}");
    let path = dir.path("bad");
    std::fs::write(&path, [5u8, 0, 1]).unwrap();
    let created = request(&mut app, json!({"op": "create", "senders": 1}));
    let ticket = json!({"task_id": created["task_id"], "control": created["control"]});
    let r = request(&mut app, json!({"op": "send", "ticket": ticket, "channel": 0, "path": path}));
    assert!(r["error"].as_str().unwrap().contains("truncated record at byte 0"), "{r}");
    let r = request(&mut app, json!({"op": "wait", "task_id": created["task_id"], "path": dir.path("r")}));
    // The one sender failed: the task ends incomplete, naming it (the
    // partial aggregate is empty: nothing of the input was valid).
    assert!(r["error"].as_str().unwrap().contains("sender channel 0 (daemon "), "{r}");
    assert_eq!((r["ok"].as_bool(), r["complete"].as_bool(), r["keys"].as_u64()), (Some(false), Some(false), Some(0)), "{r}");
    assert_eq!(r["failed"][0]["channel"], json!(0));
    assert!(r["failed"][0]["reason"].as_str().unwrap().contains("truncated record at byte 0"), "{r}");
    let r = request(&mut app, json!({"op": "send", "ticket": ticket, "channel": 0, "path": path}));
    assert!(r["error"].as_str().unwrap().contains("unknown task"), "{r}");
}

/// A private directory removed at the end of the test.
mod tempdir {
    pub struct Dir(std::path::PathBuf);
    impl Dir {
        pub fn new() -> Self {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
            let p = std::env::temp_dir().join(format!("fanin-kv-test-{}-{nanos}", std::process::id()));
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
        pub fn path(&self, name: &str) -> String {
            self.0.join(name).display().to_string()
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
