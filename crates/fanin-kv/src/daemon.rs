//! The host daemon: data channels (threads with UDP sockets), the daemon
//! control channel (TCP, between daemons) and the local API (Unix socket,
//! for applications), around one task registry.
//!
//! Task life cycle (ASK §3.1):
//! 1. an application asks its daemon to `create` a task (it will receive);
//!    the daemon picks a task id, allocates the region on the switch through
//!    the control API and starts a receiver machine; the application gets a
//!    ticket `{task_id, control}` to hand to its senders;
//! 2. each sender application gives the ticket and a shared-memory input to
//!    *its* daemon (`send`); that daemon `join`s the task at the receiver's
//!    daemon over the control channel, learns the task's parameters and
//!    starts a sender machine;
//! 3. the receiving application `wait`s for the results; the receiver
//!    machine fetches the switch's aggregators and releases the region;
//! 4. a sender that fails (bad input: `fail`) or dies (its control
//!    connection closes, or it reports no progress: [`crate::liveness`]) is
//!    declared failed: the receiver stops waiting for it, lets the other
//!    senders finish, collects, and `wait` answers with the failed channels
//!    and the partial aggregate. A silent receiver (switch gone) fails the
//!    task; a receiving application that disconnects aborts its unfinished
//!    tasks; both release the region through the control API.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fanin_proto::auth::Key;
use fanin_proto::kv::{
    channel_key, receiver_key, ChannelReport, KvReceiver, KvSender, KvTaskSpec, Layout, ProgressRefused, ReceiverConfig,
    SenderConfig, TaskLedger, ValueType,
};
use fanin_proto::Time;
use fanin_udp::BatchSocket;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::channel::{ChannelCommand, ChannelStats, ChannelThread, Collected, Input, ReceiverOutcome, SenderOutcome};
use crate::liveness::{progress_interval, write_line, ControlSession, ProgressReport};
use crate::records::{write_results, InputFile, InputFormat};
use crate::switch_ctl::SwitchControl;

mod app;
mod peer;

use app::{serve_app, stats_json};
use peer::{notify_senders, peer_call, serve_peer, watch_senders};

/// How the daemon runs (JSON from `fanin kv daemon`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvDaemonConfig {
    /// Local API for applications.
    pub socket_path: PathBuf,
    /// The switch's gRPC control API.
    pub switch_control: SocketAddr,
    /// The switch's control token; unset = `FANIN_CONTROL_TOKEN`.
    #[serde(default)]
    pub switch_token: Option<String>,
    /// The switch's data-plane IP as this host reaches it, used when the
    /// switch binds every address (0.0.0.0) and so cannot name one (the
    /// namespace testbed). Default: the control API's IP.
    #[serde(default)]
    pub switch_data_ip: Option<IpAddr>,
    /// Daemon control channel (TCP); port 0 picks one.
    #[serde(default = "default_control")]
    pub control_addr: SocketAddr,
    /// Address the data sockets bind (the switch sends to it, so not 0.0.0.0).
    #[serde(default = "default_ip")]
    pub bind_ip: IpAddr,
    #[serde(default = "one")]
    pub receive_channels: usize,
    #[serde(default = "one")]
    pub send_channels: usize,
    /// Tenant of every task this daemon creates (switch memory isolation).
    #[serde(default)]
    pub tenant: u32,
    /// Sender retransmission timeout. ASK uses 100 us with a hardware switch;
    /// here a full window (up to 4096 packets) crosses three kernel UDP hops and a
    /// software switch on shared cores, which takes milliseconds: at 2 ms
    /// half the datagrams were spurious retransmissions, at 20 ms under 1 %
    /// (1M tuples, 2 senders, this machine). With `congestion` on, only the
    /// timeout before the first round trip is measured.
    #[serde(default = "default_rto_us")]
    pub rto_us: u64,
    /// Senders adapt their window and timeout to the path (docs/kv.md,
    /// "Congestion"); false: ASK's fixed window and `rto_us`.
    #[serde(default = "yes")]
    pub congestion: bool,
    /// With `congestion`: the shortest timeout the round-trip estimate may
    /// set (a host's UDP path on shared cores stalls now and then, and a
    /// timeout shorter than a stall resends spuriously and halves the window).
    #[serde(default = "default_min_rto_us")]
    pub min_rto_us: u64,
    /// Default of a task's `silence_ms`: a joined sender without progress
    /// this long is declared failed; a receiver hearing nothing (and no
    /// sender progressing) for twice this long fails the task. Also the
    /// senders' `dead_after` (nothing acknowledged this long).
    #[serde(default = "default_silence_ms")]
    pub silence_ms: u64,
    /// Longest key a task accepts (default 64 MiB): keys over 1 KiB travel
    /// in fragments, reassembled by the receiver (docs/kv.md).
    #[serde(default = "default_max_key_len")]
    pub max_key_len: usize,
    #[serde(default = "default_socket_buffer")]
    pub socket_buffer: usize,
}

/// Most data channels of each kind (each is a thread and a socket).
pub const MAX_CHANNELS: usize = 64;

impl KvDaemonConfig {
    /// Values the daemon would start with but could not work with, refused
    /// with the field's name: a `silence_ms` of 0 failed every task with
    /// "nothing arrived for 0ns", an `rto_us` of 0 resent without pause.
    pub fn validate(&self) -> Result<(), DaemonError> {
        let bad = |m: String| Err(DaemonError::Config(m));
        if self.socket_path.as_os_str().is_empty() {
            return bad("socket_path is empty: give the local API socket's path".into());
        }
        for (name, n) in [("receive_channels", self.receive_channels), ("send_channels", self.send_channels)] {
            if n > MAX_CHANNELS {
                return bad(format!("{name} = {n} is out of range (1 to {MAX_CHANNELS})"));
            }
        }
        if self.silence_ms == 0 {
            return bad("silence_ms = 0: give at least 1 ms (how long a task may hear nothing before it fails; \
                        default 5000)"
                .into());
        }
        if self.rto_us == 0 {
            return bad("rto_us = 0: give at least 1 us (the senders' first retransmission timeout; default 20000)".into());
        }
        if self.min_rto_us == 0 {
            return bad("min_rto_us = 0: give at least 1 us".into());
        }
        if self.bind_ip.is_unspecified() || self.bind_ip.is_multicast() {
            return bad(format!(
                "bind_ip = {}: give this host's address toward the switch (e.g. 127.0.0.1); the switch sends \
                 results to it",
                self.bind_ip
            ));
        }
        Ok(())
    }
}

/// A region's data address as senders and the receiver can use it: the
/// switch answers with the address its data socket is bound to, which is
/// unspecified when it binds 0.0.0.0.
fn reachable_switch_addr(mut addr: SocketAddr, config: &KvDaemonConfig) -> SocketAddr {
    if addr.ip().is_unspecified() {
        addr.set_ip(config.switch_data_ip.unwrap_or(config.switch_control.ip()));
    }
    addr
}

fn default_control() -> SocketAddr {
    "127.0.0.1:0".parse().expect("literal")
}
fn default_ip() -> IpAddr {
    "127.0.0.1".parse().expect("literal")
}
fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn default_min_rto_us() -> u64 {
    fanin_proto::kv::HOST_MIN_RTO.as_micros() as u64
}
fn default_rto_us() -> u64 {
    20_000
}
fn default_silence_ms() -> u64 {
    5_000
}
fn default_max_key_len() -> usize {
    fanin_proto::kv::MAX_KEY_LEN
}
fn default_socket_buffer() -> usize {
    4 << 20
}

/// A task's parameters, as the receiver's daemon tells joining senders.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskParams {
    pub task_id: u32,
    pub short_slots: u8,
    pub medium_groups: u8,
    pub medium_parts: u8,
    pub aa_size: u32,
    pub shadow_copies: bool,
    pub window: u32,
    pub senders: u16,
    /// The switch port that owns the task.
    pub switch_addr: SocketAddr,
    /// How often the sender's daemon reports progress (liveness).
    #[serde(default)]
    pub progress_ms: u64,
    /// What the values' bits mean (a daemon that does not say: int64).
    #[serde(default)]
    pub value_type: ValueType,
}

impl TaskParams {
    pub fn layout(&self) -> Layout {
        Layout { short_slots: self.short_slots, medium_groups: self.medium_groups, medium_parts: self.medium_parts }
    }
}

/// Daemon counters (`stats` on the local API).
#[derive(Default)]
pub struct DaemonStats {
    pub tasks_created: AtomicU64,
    pub tasks_finished: AtomicU64,
    pub tasks_failed: AtomicU64,
    pub sends_finished: AtomicU64,
    pub sends_failed: AtomicU64,
    pub bad_requests: AtomicU64,
    pub unknown_task: AtomicU64,
    pub regions_released: AtomicU64,
    /// Tasks whose `wait` delivered a partial aggregate (also in
    /// `tasks_failed`).
    pub tasks_incomplete: AtomicU64,
    /// Sender channels declared failed at this (receiving) daemon.
    pub senders_failed: AtomicU64,
    /// Connections open now (local API and control channel together).
    pub connections: AtomicU64,
    /// Connections refused at [`MAX_CONNECTIONS`], and requests refused
    /// past [`MAX_REQUEST_BYTES`].
    pub connections_refused: AtomicU64,
    pub oversized_requests: AtomicU64,
}

/// Most connections served at once (each has a thread); more are answered
/// with an error line and closed. Tasks use one per sender and one for the
/// receiver's `wait`, far below this.
pub const MAX_CONNECTIONS: u64 = 256;
/// Longest request line: requests are small JSON objects (paths, not data),
/// so a longer line is refused and its connection closed instead of being
/// buffered without bound.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

struct TaskEntry {
    params: TaskParams,
    /// The task key (docs/security.md); joining senders get their
    /// channel's member key, never this.
    key: Option<Key>,
    /// The sender channels: joined, finished, failed, silent (sans-IO).
    ledger: TaskLedger,
    outcome: Option<Receiver<ReceiverOutcome>>,
    receive_channel: usize,
    started: Instant,
}

/// The daemon's clock as the sans-IO machines read it.
fn machine_time(epoch: Instant) -> Time {
    Time::from_nanos(epoch.elapsed().as_nanos() as u64)
}

struct Shared {
    config: KvDaemonConfig,
    control_addr: SocketAddr,
    switch: SwitchControl,
    tasks: Mutex<HashMap<u32, TaskEntry>>,
    receive: Vec<(Sender<ChannelCommand>, SocketAddr)>,
    send: Vec<Sender<ChannelCommand>>,
    next_send: AtomicU64,
    next_task: AtomicU64,
    stats: DaemonStats,
    channel_stats: Vec<Arc<ChannelStats>>,
    epoch: Instant,
    shutdown: Arc<AtomicBool>,
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("kv daemon: cannot bind {what} {addr}: {source}")]
    Bind { what: &'static str, addr: String, source: std::io::Error },
    /// The local API socket's path is held by something this daemon must
    /// not remove: a live daemon's socket, or a file that is no socket.
    #[error("kv daemon: {0}")]
    SocketPath(String),
    /// A config value the daemon cannot run with (named).
    #[error("kv daemon: {0}")]
    Config(String),
    #[error("kv daemon: {0}")]
    Io(#[from] std::io::Error),
}

/// Make `path` free for the local API socket without taking anything that
/// is in use: nothing there, or a stale socket (its daemon died without
/// removing it, so connecting is refused), which is removed. A socket a
/// daemon accepts on, or anything that is not a socket (a file someone
/// mistyped as `--socket`), is left as it is and refused.
pub fn claim_socket_path(path: &Path) -> Result<(), DaemonError> {
    use std::io::ErrorKind;
    use std::os::unix::fs::FileTypeExt;
    let shown = path.display();
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(DaemonError::SocketPath(format!("cannot use {shown} as the local API socket: {e}"))),
    };
    let kind = meta.file_type();
    if !kind.is_socket() {
        let what = if kind.is_dir() {
            "a directory"
        } else if kind.is_symlink() {
            "a symbolic link"
        } else if kind.is_file() {
            "a regular file"
        } else {
            "a special file"
        };
        return Err(DaemonError::SocketPath(format!(
            "{shown} exists and is {what}, not a socket: left as it is; remove it or give the daemon another \
             --socket path"
        )));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(DaemonError::SocketPath(format!(
            "another kv daemon is listening on {shown}: stop it first, or give this one another --socket path"
        ))),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => std::fs::remove_file(path).or_else(|e| match e.kind() {
            ErrorKind::NotFound => Ok(()),
            _ => Err(DaemonError::SocketPath(format!("cannot remove the stale socket {shown}: {e}"))),
        }),
        Err(e) => Err(DaemonError::SocketPath(format!(
            "{shown} is a socket, and whether a daemon listens on it cannot be told ({e}): left as it is; remove \
             it or give the daemon another --socket path"
        ))),
    }
}

/// A running daemon; dropping it stops every thread.
pub struct KvDaemon {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl KvDaemon {
    pub fn start(config: KvDaemonConfig) -> Result<Self, DaemonError> {
        config.validate()?;
        // First, so that a path in use fails the start before any port is bound.
        claim_socket_path(&config.socket_path)?;
        let shutdown = Arc::new(AtomicBool::new(false));
        let epoch = Instant::now();
        let mut threads = Vec::new();
        let mut receive = Vec::new();
        let mut send = Vec::new();
        let mut channel_stats = Vec::new();
        for i in 0..config.receive_channels.max(1) + config.send_channels.max(1) {
            let addr = SocketAddr::new(config.bind_ip, 0);
            let socket = BatchSocket::bind(addr)
                .map_err(|source| DaemonError::Bind { what: "data channel", addr: addr.to_string(), source })?;
            let _ = socket.set_buffer_sizes(config.socket_buffer, config.socket_buffer);
            let local = socket.local_addr()?;
            let (tx, rx) = mpsc::channel();
            let stats = Arc::new(ChannelStats::default());
            let thread = ChannelThread { socket, commands: rx, stats: stats.clone(), shutdown: shutdown.clone(), epoch };
            threads.push(std::thread::Builder::new().name(format!("fanin-kv-data-{i}")).spawn(move || thread.run())?);
            channel_stats.push(stats);
            if i < config.receive_channels.max(1) {
                receive.push((tx, local));
            } else {
                send.push(tx);
            }
        }
        let control = TcpListener::bind(config.control_addr).map_err(|source| DaemonError::Bind {
            what: "control channel",
            addr: config.control_addr.to_string(),
            source,
        })?;
        let control_addr = control.local_addr()?;
        // (free or stale when checked above; a daemon that bound it since then makes this fail, never replaced)
        claim_socket_path(&config.socket_path)?;
        let local = UnixListener::bind(&config.socket_path).map_err(|source| DaemonError::Bind {
            what: "local API socket",
            addr: config.socket_path.display().to_string(),
            source,
        })?;
        // Owner only: a local client names files the daemon reads (inputs)
        // and writes (results) with the daemon's rights, so only the
        // daemon's own user may connect (with the umask's mode, a group
        // that may write to the socket could have it read or overwrite any
        // file its user can).
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&config.socket_path, std::fs::Permissions::from_mode(0o600))?;
        }
        let seed = (std::process::id() as u64) << 20 ^ epoch.elapsed().as_nanos() as u64 ^ control_addr.port() as u64;
        let shared = Arc::new(Shared {
            switch: SwitchControl::new(config.switch_control, fanin_control::token_or_env(config.switch_token.clone()))?,
            config,
            control_addr,
            tasks: Mutex::new(HashMap::new()),
            receive,
            send,
            next_send: AtomicU64::new(0),
            next_task: AtomicU64::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33),
            stats: DaemonStats::default(),
            channel_stats,
            epoch,
            shutdown: shutdown.clone(),
        });
        threads.push(spawn_listener("fanin-kv-control", control, shared.clone(), serve_peer)?);
        let watch = shared.clone();
        threads.push(std::thread::Builder::new().name("fanin-kv-liveness".into()).spawn(move || watch_senders(&watch))?);
        threads.push(spawn_listener("fanin-kv-local", local, shared.clone(), serve_app)?);
        Ok(Self { shared, threads })
    }

    /// The daemon control channel's address (other daemons join tasks here).
    pub fn control_addr(&self) -> SocketAddr {
        self.shared.control_addr
    }

    pub fn socket_path(&self) -> &Path {
        &self.shared.config.socket_path
    }

    pub fn shutdown_flag(&self) -> Arc<AtomicBool> {
        self.shared.shutdown.clone()
    }

    /// Block until the shutdown flag is set.
    pub fn wait(self) {
        while !self.shared.shutdown.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn stats_json(&self) -> Value {
        stats_json(&self.shared)
    }
}

impl Drop for KvDaemon {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.shared.config.socket_path);
    }
}

trait Listener: Send + 'static {
    type Stream: std::io::Read + Write + Send + 'static;
    fn set_nonblocking(&self) -> std::io::Result<()>;
    fn accept_one(&self) -> std::io::Result<Self::Stream>;
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    fn set_nonblocking(&self) -> std::io::Result<()> {
        TcpListener::set_nonblocking(self, true)
    }
    fn accept_one(&self) -> std::io::Result<TcpStream> {
        let (s, _) = self.accept()?;
        s.set_nonblocking(false)?;
        Ok(s)
    }
}

impl Listener for UnixListener {
    type Stream = UnixStream;
    fn set_nonblocking(&self) -> std::io::Result<()> {
        UnixListener::set_nonblocking(self, true)
    }
    fn accept_one(&self) -> std::io::Result<UnixStream> {
        let (s, _) = self.accept()?;
        s.set_nonblocking(false)?;
        Ok(s)
    }
}

/// One thread accepting connections, one thread per connection: requests
/// block (a `send` lasts as long as the stream), and there are few clients.
/// The listener polls (5 ms) so that stopping never depends on waking a
/// blocked accept() (the socket file may already be gone).
fn spawn_listener<L: Listener>(
    name: &str,
    listener: L,
    shared: Arc<Shared>,
    serve: fn(&Arc<Shared>, L::Stream),
) -> std::io::Result<JoinHandle<()>> {
    listener.set_nonblocking()?;
    std::thread::Builder::new().name(name.into()).spawn(move || {
        while !shared.shutdown.load(Ordering::SeqCst) {
            match listener.accept_one() {
                Ok(mut stream) => {
                    if shared.stats.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                        shared.stats.connections.fetch_sub(1, Ordering::SeqCst);
                        shared.stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                        let why = format!("too many connections (at most {MAX_CONNECTIONS} at once); close idle clients");
                        let _ = write_line(&mut stream, &error(why));
                        continue;
                    }
                    let shared = shared.clone();
                    let _ = std::thread::Builder::new().name("fanin-kv-conn".into()).spawn(move || {
                        serve(&shared, stream);
                        shared.stats.connections.fetch_sub(1, Ordering::SeqCst);
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    })
}

/// Read JSON requests line by line and answer each with one JSON line.
fn serve_lines<S: std::io::Read + Write>(
    shared: &Arc<Shared>,
    stream: S,
    mut handle: impl FnMut(&Arc<Shared>, &Value) -> Value,
    writer: &mut dyn Write,
) {
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        // at most one byte past the limit: enough to know it was passed
        match std::io::Read::take(&mut reader, MAX_REQUEST_BYTES as u64 + 1).read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if buf.len() > MAX_REQUEST_BYTES {
            shared.stats.oversized_requests.fetch_add(1, Ordering::Relaxed);
            let why = format!("request longer than {MAX_REQUEST_BYTES} bytes (requests are one JSON object per line; data goes by file path)");
            let _ = write_line(writer, &error(why));
            break; // the rest of the line would be read as requests
        }
        let Ok(line) = std::str::from_utf8(&buf) else {
            shared.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            let _ = write_line(writer, &error("request is not UTF-8"));
            continue;
        };
        if line.trim().is_empty() {
            continue;
        }
        let reply = match serde_json::from_str::<Value>(line) {
            Ok(req) if req.is_object() => handle(shared, &req),
            _ => {
                shared.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
                error("request is not a JSON object")
            }
        };
        if write_line(writer, &reply).is_err() {
            break;
        }
    }
}


fn error(message: impl std::fmt::Display) -> Value {
    json!({"ok": false, "error": message.to_string()})
}


/// Wall-clock microseconds: where a machine's sealed sequence numbers
/// start, so a restarted daemon continues above its old ones.
fn wall_clock_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64)
}

#[cfg(test)]
mod socket_path_tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fanin-kv-claim-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn only_a_free_path_or_a_stale_socket_is_claimed() {
        let d = dir("paths");
        // free
        assert!(claim_socket_path(&d.join("free.sock")).is_ok());
        // a regular file is never removed
        let file = d.join("notes.txt");
        std::fs::write(&file, "keep").unwrap();
        let err = claim_socket_path(&file).unwrap_err().to_string();
        assert!(err.contains("is a regular file, not a socket") && err.contains("notes.txt"), "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
        let err = claim_socket_path(&d).unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
        // a live socket is refused and left working
        let live = d.join("live.sock");
        let listener = UnixListener::bind(&live).unwrap();
        let err = claim_socket_path(&live).unwrap_err().to_string();
        assert!(err.contains("another kv daemon is listening on") && err.contains("live.sock"), "{err}");
        assert!(UnixStream::connect(&live).is_ok());
        // once nobody accepts on it, it is stale: removed
        drop(listener);
        assert!(claim_socket_path(&live).is_ok());
        assert!(!live.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn values_the_daemon_cannot_work_with_are_named() {
        let config = |extra: &str| -> KvDaemonConfig {
            serde_json::from_str(&format!(r#"{{"socket_path": "/tmp/x.sock", "switch_control": "127.0.0.1:9100"{extra}}}"#))
                .unwrap()
        };
        assert!(config("").validate().is_ok());
        for (extra, says) in [
            (r#", "silence_ms": 0"#, "silence_ms = 0"),
            (r#", "rto_us": 0"#, "rto_us = 0"),
            (r#", "receive_channels": 1000"#, "receive_channels = 1000 is out of range"),
            (r#", "bind_ip": "0.0.0.0""#, "bind_ip = 0.0.0.0"),
        ] {
            let err = config(extra).validate().unwrap_err().to_string();
            assert!(err.contains(says), "{extra}: {err}");
        }
    }
}
