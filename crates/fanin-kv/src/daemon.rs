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
use fanin_proto::kv::{channel_key, receiver_key, KvReceiver, KvSender, KvTaskSpec, Layout, ReceiverConfig, SenderConfig};
use fanin_proto::Time;
use fanin_udp::BatchSocket;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::channel::{ChannelCommand, ChannelStats, ChannelThread, Collected, Input, ReceiverOutcome, SenderOutcome};
use crate::liveness::{progress_interval, write_line, ControlSession, LinkState, ProgressReport, SenderLink};
use crate::records::{write_results, InputFormat, Mapped};
use crate::switch_ctl::SwitchControl;

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
    /// (1M tuples, 2 senders, this machine).
    #[serde(default = "default_rto_us")]
    pub rto_us: u64,
    /// Default of a task's `silence_ms`: a joined sender without progress
    /// this long is declared failed; a receiver hearing nothing (and no
    /// sender progressing) for twice this long fails the task. Also the
    /// senders' `dead_after` (nothing acknowledged this long).
    #[serde(default = "default_silence_ms")]
    pub silence_ms: u64,
    #[serde(default = "default_max_key_len")]
    pub max_key_len: usize,
    #[serde(default = "default_socket_buffer")]
    pub socket_buffer: usize,
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
fn one() -> usize {
    1
}
fn default_rto_us() -> u64 {
    20_000
}
fn default_silence_ms() -> u64 {
    5_000
}
fn default_max_key_len() -> usize {
    1024
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
    /// Channel id -> its sender's daemon and liveness.
    joined: HashMap<u16, SenderLink>,
    /// A joined sender without progress this long is declared failed.
    silence: Duration,
    outcome: Option<Receiver<ReceiverOutcome>>,
    receive_channel: usize,
    started: Instant,
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
    #[error("kv daemon: {0}")]
    Io(#[from] std::io::Error),
}

/// A running daemon; dropping it stops every thread.
pub struct KvDaemon {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl KvDaemon {
    pub fn start(config: KvDaemonConfig) -> Result<Self, DaemonError> {
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
        let _ = std::fs::remove_file(&config.socket_path);
        let local = UnixListener::bind(&config.socket_path).map_err(|source| DaemonError::Bind {
            what: "local API socket",
            addr: config.socket_path.display().to_string(),
            source,
        })?;
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
        let reply = match serde_json::from_str::<Value>(&line) {
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

fn field<'a>(req: &'a Value, name: &str) -> Result<&'a Value, Value> {
    req.get(name).ok_or_else(|| error(format!("missing field {name:?}")))
}

fn uint(req: &Value, name: &str) -> Result<u64, Value> {
    field(req, name)?.as_u64().ok_or_else(|| error(format!("field {name:?} must be a non-negative integer")))
}

fn opt_uint(req: &Value, name: &str, default: u64) -> Result<u64, Value> {
    match req.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(_) => uint(req, name),
    }
}

// ---------------------------------------------------------------- local API

fn serve_app(shared: &Arc<Shared>, stream: UnixStream) {
    let Ok(mut writer) = stream.try_clone() else { return };
    // Tasks this connection created and has not collected: aborted if the
    // application goes away.
    let mut owned: Vec<u32> = Vec::new();
    serve_lines(shared, stream, |s, req| app_request(s, req, &mut owned), &mut writer);
    for task in owned {
        abort_task(shared, task, "the application that created the task disconnected", true);
    }
}

fn app_request(shared: &Arc<Shared>, req: &Value, owned: &mut Vec<u32>) -> Value {
    let op = req.get("op").and_then(Value::as_str).unwrap_or("");
    let result = match op {
        "create" => create_task(shared, req).inspect(|v| owned.extend(v["task_id"].as_u64().map(|t| t as u32))),
        "send" => send(shared, req),
        "wait" => {
            let task = req.get("task_id").and_then(Value::as_u64).unwrap_or(u64::MAX) as u32;
            owned.retain(|&t| t != task);
            wait_task(shared, req)
        }
        "abort" => uint(req, "task_id").map(|t| {
            owned.retain(|&o| o as u64 != t);
            let found = abort_task(shared, t as u32, "aborted by the application", true);
            json!({"ok": found})
        }),
        "status" => task_status(shared, req),
        "stats" => Ok(stats_json(shared)),
        other => Err(error(format!("unknown op {other:?} (create, send, wait, status, abort, stats)"))),
    };
    result.unwrap_or_else(|e| {
        shared.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
        e
    })
}

fn create_task(shared: &Arc<Shared>, req: &Value) -> Result<Value, Value> {
    let senders = uint(req, "senders")?;
    if senders == 0 || senders > 1024 {
        return Err(error(format!("senders must be 1..=1024, got {senders}")));
    }
    let layout = Layout {
        short_slots: opt_uint(req, "short_slots", 16)?.min(255) as u8,
        medium_groups: opt_uint(req, "medium_groups", 8)?.min(255) as u8,
        medium_parts: opt_uint(req, "medium_parts", 2)?.min(255) as u8,
    };
    layout.validate().map_err(error)?;
    let aa_size = opt_uint(req, "aa_size", 4096)?.min(u32::MAX as u64) as u32;
    // 2048, not 256, 1024 or the switch's largest (4096): see docs/kv.md
    // "decision — window" (a full window's round trip here includes waiting
    // for one of 2 shared cores; a 4096 burst overflows socket buffers).
    let window = opt_uint(req, "window", 2048)?.min(u32::MAX as u64) as u32;
    let shadow_copies = req.get("shadow_copies").and_then(Value::as_bool).unwrap_or(true);
    let swap_threshold = opt_uint(req, "swap_threshold", 1024)?;
    let silence = Duration::from_millis(opt_uint(req, "silence_ms", shared.config.silence_ms)?);
    let key = task_key(req)?;
    let idx = (shared.next_send.fetch_add(1, Ordering::Relaxed) as usize) % shared.receive.len();
    let (commands, receiver_addr) = shared.receive[idx].clone();
    // Task ids are unique at the switch across daemons: a random start,
    // then the next free one.
    let mut last = None;
    for _ in 0..8 {
        let task_id = shared.next_task.fetch_add(1, Ordering::Relaxed) as u32;
        let mut spec = KvTaskSpec::new(task_id, receiver_addr, layout, aa_size);
        spec.tenant = shared.config.tenant;
        spec.shadow_copies = shadow_copies;
        spec.window = window;
        spec.max_channels = senders.min(u16::MAX as u64) as u16;
        // The switch frees the region of a task nobody talks to any more.
        spec.idle_timeout = silence * 2;
        spec.key = key;
        match shared.switch.alloc(&spec) {
            Ok(switch_addr) => {
                let switch_addr = reachable_switch_addr(switch_addr, &shared.config);
                let progress_ms = progress_interval(silence).as_millis() as u64;
                let params = TaskParams { task_id, short_slots: layout.short_slots, medium_groups: layout.medium_groups, medium_parts: layout.medium_parts, aa_size, shadow_copies, window, senders: senders as u16, switch_addr, progress_ms };
                let mut rc = ReceiverConfig::new(task_id, layout, aa_size, senders as u16);
                rc.shadow_copies = shadow_copies;
                rc.window = window;
                rc.swap_threshold = (swap_threshold > 0).then_some(swap_threshold);
                // Twice the senders' liveness timeout: a dead sender is found
                // (and named) by its control connection first; this timer is
                // for the switch or the whole path going silent, and for
                // channels that never join.
                rc.idle_timeout = silence * 2;
                rc.max_burst = crate::channel::MAX_BURST;
                rc.rto = Duration::from_micros(shared.config.rto_us.max(1_000));
                rc.auth_key = key.map(|k| receiver_key(&k, task_id));
                rc.seal_clock_us = wall_clock_us();
                let now = Time::from_nanos(shared.epoch.elapsed().as_nanos() as u64);
                let machine = match KvReceiver::new(rc, now) {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = shared.switch.release(task_id);
                        return Err(error(e));
                    }
                };
                let (done, outcome) = mpsc::sync_channel(1);
                let _ = commands.send(ChannelCommand::Receive { task: task_id, switch: switch_addr, machine: Box::new(machine), done });
                shared.tasks.lock().expect("tasks").insert(
                    task_id,
                    TaskEntry { params, key, joined: HashMap::new(), silence, outcome: Some(outcome), receive_channel: idx, started: Instant::now() },
                );
                shared.stats.tasks_created.fetch_add(1, Ordering::Relaxed);
                return Ok(json!({"ok": true, "task_id": task_id, "control": shared.control_addr.to_string(),
                                  "switch_addr": switch_addr.to_string(), "keyed": key.is_some()}));
            }
            Err(e) if e.already_exists() => last = Some(e),
            Err(e) => return Err(error(e)),
        }
    }
    Err(error(last.map(|e| e.to_string()).unwrap_or_default()))
}

/// The task key of a `create` request: `key` (32 hex digits) if the
/// application passes one, 16 random bytes from the OS with `"auth": true`,
/// else none. Opt-in because sealing costs about 20 % of a word count's time
/// on 2 cores (docs/results.md#security-authentication-cost).
fn task_key(req: &Value) -> Result<Option<Key>, Value> {
    if let Some(hex) = req.get("key").filter(|v| !v.is_null()) {
        let hex = hex.as_str().ok_or_else(|| error("key must be a string of 32 hex digits"))?;
        return Key::from_hex(hex).map(Some).map_err(|e| error(format!("key: {e}")));
    }
    // Keyed unless the application opts out (docs/security.md: safe by
    // default; `"auth": false` is for trusted networks and measurements).
    match req.get("auth") {
        None | Some(Value::Null) | Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => return Ok(None),
        Some(_) => return Err(error("auth must be true or false")),
    }
    let mut key = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
        .map_err(|e| error(format!("cannot draw a task key from /dev/urandom: {e}")))?;
    Ok(Some(Key(key)))
}

/// Wall-clock microseconds: where a machine's sealed sequence numbers
/// start, so a restarted daemon continues above its old ones.
fn wall_clock_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64)
}

fn wait_task(shared: &Arc<Shared>, req: &Value) -> Result<Value, Value> {
    let task_id = uint(req, "task_id")? as u32;
    let path = field(req, "path")?.as_str().ok_or_else(|| error("path must be a string"))?;
    let outcome = {
        let mut tasks = shared.tasks.lock().expect("tasks");
        let Some(t) = tasks.get_mut(&task_id) else {
            shared.stats.unknown_task.fetch_add(1, Ordering::Relaxed);
            return Err(error(format!("unknown task {task_id}")));
        };
        t.outcome.take().ok_or_else(|| error(format!("task {task_id} is already being waited for")))?
    };
    let result = outcome.recv().unwrap_or_else(|_| Err("the receiver's data channel stopped".into()));
    let entry = shared.tasks.lock().expect("tasks").remove(&task_id);
    let seconds = entry.as_ref().map_or(0.0, |e| e.started.elapsed().as_secs_f64());
    let now = Instant::now();
    // The channels the daemon declared failed, as the application sees them.
    let report = |channels: &mut dyn Iterator<Item = u16>| -> Vec<Value> {
        let links = entry.as_ref().map(|e| &e.joined);
        channels
            .map(|c| match links.and_then(|l| l.get(&c)) {
                Some(link) => link.to_json(c, now),
                None => json!({"channel": c, "sender": null, "state": "failed", "reason": "never joined"}),
            })
            .collect()
    };
    match result {
        Ok(Collected { results, stats, failed }) => {
            let keys = write_results(Path::new(path), results.iter()).map_err(|e| error(format!("cannot write {path}: {e}")))?;
            let receiver = json!({"data_packets": stats.data_packets, "duplicate_packets": stats.duplicate_packets,
                                  "tuples_local": stats.tuples_local, "swaps": stats.swaps,
                                  "entries_fetched": stats.entries_fetched, "fetch_requests": stats.fetch_requests,
                                  "overflowed": stats.overflowed});
            if failed.is_empty() {
                shared.stats.tasks_finished.fetch_add(1, Ordering::Relaxed);
                return Ok(json!({"ok": true, "complete": true, "task_id": task_id, "keys": keys, "path": path,
                                 "seconds": seconds, "receiver": receiver}));
            }
            shared.stats.tasks_failed.fetch_add(1, Ordering::Relaxed);
            shared.stats.tasks_incomplete.fetch_add(1, Ordering::Relaxed);
            let failed = report(&mut failed.into_iter());
            let message = format!(
                "task {task_id} is incomplete: {}; the partial aggregate ({keys} keys: every tuple of the finished \
                 channels, part of the failed ones') is in {path}",
                describe_failed(&failed)
            );
            // Not an error of the request: the reply carries the outcome.
            Ok(json!({"ok": false, "complete": false, "error": message, "task_id": task_id, "failed": failed,
                      "keys": keys, "path": path, "seconds": seconds, "receiver": receiver}))
        }
        Err(reason) => {
            shared.stats.tasks_failed.fetch_add(1, Ordering::Relaxed);
            release_region(shared, task_id);
            let mut failed = Vec::new();
            if let Some(e) = &entry {
                notify_senders(&e.joined, task_id, &reason);
                let mut declared = e.joined.iter().filter(|(_, l)| matches!(l.state, LinkState::Failed { .. })).map(|(c, _)| *c).collect::<Vec<_>>();
                declared.sort_unstable();
                failed = report(&mut declared.into_iter());
            }
            let also = if failed.is_empty() { String::new() } else { format!(" (earlier: {})", describe_failed(&failed)) };
            Err(json!({"ok": false, "error": format!("task {task_id} failed: {reason}{also}"), "failed": failed}))
        }
    }
}

/// "sender channel 1 (daemon 10.0.0.2:4000) failed: reason; ..."
fn describe_failed(failed: &[Value]) -> String {
    let one = |f: &Value| {
        format!("sender channel {} (daemon {}) failed: {}", f["channel"], f["sender"].as_str().unwrap_or("unknown"),
                f["reason"].as_str().unwrap_or("unknown"))
    };
    failed.iter().map(one).collect::<Vec<_>>().join("; ")
}

/// `status`: the task's joined channels and their liveness (receiver side).
fn task_status(shared: &Arc<Shared>, req: &Value) -> Result<Value, Value> {
    let task_id = uint(req, "task_id")? as u32;
    let tasks = shared.tasks.lock().expect("tasks");
    let Some(t) = tasks.get(&task_id) else {
        shared.stats.unknown_task.fetch_add(1, Ordering::Relaxed);
        return Err(error(format!("unknown task {task_id}")));
    };
    let now = Instant::now();
    let mut channels: Vec<_> = t.joined.iter().collect();
    channels.sort_by_key(|(c, _)| **c);
    let channels: Vec<Value> = channels.into_iter().map(|(c, l)| l.to_json(*c, now)).collect();
    Ok(json!({"ok": true, "task_id": task_id, "senders": t.params.senders, "channels": channels}))
}

/// Release the region through the control API (the receiver machine may
/// have released it already; NOT_FOUND is then expected).
fn release_region(shared: &Shared, task_id: u32) {
    if shared.switch.release(task_id).is_ok() {
        shared.stats.regions_released.fetch_add(1, Ordering::Relaxed);
    }
}

/// Abort a task this daemon receives: the receiver machine stops and its
/// waiter gets `reason` (now, or from a later `wait`: the outcome stays
/// buffered), the region is released, the senders' daemons are told. With
/// `forget` (nobody will ever wait: the application is gone) the entry goes
/// too. False if the task is unknown here.
fn abort_task(shared: &Arc<Shared>, task_id: u32, reason: &str, forget: bool) -> bool {
    let joined = {
        let mut tasks = shared.tasks.lock().expect("tasks");
        let Some(entry) = tasks.get_mut(&task_id) else { return false };
        let _ = shared.receive[entry.receive_channel].0.send(ChannelCommand::Abort { task: task_id, reason: reason.into() });
        let joined = std::mem::take(&mut entry.joined);
        if forget && entry.outcome.is_some() {
            tasks.remove(&task_id);
            shared.stats.tasks_failed.fetch_add(1, Ordering::Relaxed);
        }
        joined
    };
    release_region(shared, task_id);
    notify_senders(&joined, task_id, reason);
    true
}

/// Tell the daemons of the still active senders that the task is gone.
fn notify_senders(joined: &HashMap<u16, SenderLink>, task_id: u32, reason: &str) {
    for (channel, link) in joined.iter().filter(|(_, l)| l.is_active()) {
        let msg = json!({"op": "abort", "task_id": task_id, "channel": channel, "reason": reason});
        let _ = peer_call(&link.control, &msg);
    }
}

/// Declare a joined sender failed (receiver side): the receiver machine
/// stops waiting for its FIN and the sender's daemon, should it still be
/// there, is told to stop. False if the channel was not active (it finished,
/// failed before, or the task is gone).
fn sender_failed(shared: &Arc<Shared>, task_id: u32, channel: u16, reason: String) -> bool {
    let control = {
        let mut tasks = shared.tasks.lock().expect("tasks");
        let Some(t) = tasks.get_mut(&task_id) else { return false };
        let Some(link) = t.joined.get_mut(&channel) else { return false };
        if !link.fail(reason.clone(), Instant::now()) {
            return false;
        }
        let _ = shared.receive[t.receive_channel].0.send(ChannelCommand::SenderFailed { task: task_id, channel });
        link.control.clone()
    };
    shared.stats.senders_failed.fetch_add(1, Ordering::Relaxed);
    // Usually the daemon is dead and this fails fast; a hung one may take
    // the connect timeout, so not on the caller's thread.
    let msg = json!({"op": "abort", "task_id": task_id, "channel": channel,
                     "reason": format!("the receiver declared this sender failed: {reason}")});
    let _ = std::thread::Builder::new().name("fanin-kv-notify".into()).spawn(move || peer_call(&control, &msg));
    true
}

/// Every active sender without progress for its task's silence timeout is
/// declared failed. Checks five times per shortest timeout (50 ms at most).
fn watch_senders(shared: &Arc<Shared>) {
    while !shared.shutdown.load(Ordering::SeqCst) {
        let now = Instant::now();
        let mut overdue = Vec::new();
        let mut tick = Duration::from_millis(50);
        for (task, t) in shared.tasks.lock().expect("tasks").iter() {
            tick = tick.min(t.silence / 5).max(Duration::from_millis(5));
            for (channel, link) in &t.joined {
                if let Some(why) = link.overdue(now, t.silence) {
                    overdue.push((*task, *channel, why));
                }
            }
        }
        for (task, channel, why) in overdue {
            sender_failed(shared, task, channel, why);
        }
        std::thread::sleep(tick);
    }
}

fn send(shared: &Arc<Shared>, req: &Value) -> Result<Value, Value> {
    let ticket = field(req, "ticket")?;
    let task_id = uint(ticket, "task_id")? as u32;
    let control = field(ticket, "control")?.as_str().ok_or_else(|| error("ticket.control must be ip:port"))?.to_string();
    let channel = uint(req, "channel")?;
    let channel = u16::try_from(channel).map_err(|_| error(format!("channel {channel} is too large")))?;
    let format_name = req.get("format").and_then(Value::as_str).unwrap_or("tuples");
    let format = InputFormat::parse(format_name).ok_or_else(|| error(format!("unknown format {format_name:?} (tuples, text)")))?;
    let path = field(req, "path")?.as_str().ok_or_else(|| error("path must be a string"))?;
    let map = Mapped::open(Path::new(path)).map_err(|e| error(format!("cannot map {path}: {e}")))?;
    // Join at the receiver's daemon (control channel): it checks the task
    // and channel and tells us the task's parameters.
    // The session stays open while we send: it is how the receiver's daemon
    // knows this sender is alive (docs/kv.md §10, failed senders).
    let join = json!({"op": "join", "task_id": task_id, "channel": channel, "control": shared.control_addr.to_string()});
    let unreachable = |e: std::io::Error| error(format!("cannot reach the receiver's daemon at {control}: {e}"));
    let mut session = ControlSession::connect(&control).map_err(unreachable)?;
    let reply = session.call(&join).map_err(unreachable)?;
    if reply["ok"] != json!(true) {
        shared.stats.unknown_task.fetch_add(1, Ordering::Relaxed);
        return Err(error(reply["error"].as_str().unwrap_or("join refused")));
    }
    let params: TaskParams = serde_json::from_value(reply["params"].clone()).map_err(|e| error(format!("bad join reply: {e}")))?;
    let member_key = match reply.get("member_key").and_then(Value::as_str) {
        Some(hex) => Some(Key::from_hex(hex).map_err(|e| error(format!("bad join reply: member_key: {e}")))?),
        None => None,
    };
    let mut sc = SenderConfig::new(task_id, channel, params.layout());
    sc.window = params.window;
    sc.rto = Duration::from_micros(shared.config.rto_us);
    sc.dead_after = Duration::from_millis(shared.config.silence_ms);
    sc.max_key_len = shared.config.max_key_len;
    sc.max_burst = crate::channel::MAX_BURST;
    sc.auth_key = member_key;
    sc.seal_clock_us = wall_clock_us();
    let now = Time::from_nanos(shared.epoch.elapsed().as_nanos() as u64);
    let machine = KvSender::new(sc, now).map_err(error)?;
    let (done, outcome) = mpsc::sync_channel::<SenderOutcome>(1);
    let idx = (shared.next_send.fetch_add(1, Ordering::Relaxed) as usize) % shared.send.len();
    let started = Instant::now();
    let input = Input { map, format, offset: 0 };
    let progress = Arc::new(Mutex::new(machine.progress()));
    let cmd = ChannelCommand::Send { task: task_id, channel, switch: params.switch_addr, machine: Box::new(machine), input, progress: progress.clone(), done };
    let _ = shared.send[idx].send(cmd);
    let interval = Duration::from_millis(params.progress_ms.max(10));
    let mut session = Some(session);
    let mut hints_checked = 0;
    let result = loop {
        match outcome.recv_timeout(interval) {
            Ok(r) => break r,
            Err(mpsc::RecvTimeoutError::Disconnected) => break Err("the data channel stopped".into()),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        let now_progress = *progress.lock().expect("progress");
        if now_progress.unknown_task_hints > hints_checked {
            // Unsealed UnknownTask replies: a keyed machine cannot trust them,
            // so ask the switch over its control API (token-authenticated)
            // instead of waiting out the silence bound (docs/kv.md §10).
            hints_checked = now_progress.unknown_task_hints;
            if let Ok(false) = shared.switch.holds(task_id) {
                let reason = format!("the switch no longer holds task {task_id} (it restarted or released the task; \
                                      confirmed over its control API after an UnknownTask reply)");
                let _ = shared.send[idx].send(ChannelCommand::AbortSender { task: task_id, channel, reason });
            }
        }
        let Some(s) = session.as_mut() else { continue };
        let report = ProgressReport::from(now_progress);
        let msg = json!({"op": "progress", "task_id": task_id, "channel": channel, "progress": report});
        // Declared failed (we were too slow, or our connection was taken
        // for dead): this channel no longer counts, stop. Any other refusal
        // or a broken session only ends the reports: a task that finished
        // while our FIN-ACK was lost must not fail us, and a vanished
        // receiver is the machine's to notice (no acknowledgements).
        match s.call(&msg) {
            Ok(r) if r["ok"] == json!(true) => {}
            Ok(r) if r["declared_failed"] == json!(true) => {
                let reason = r["error"].as_str().unwrap_or("the receiver declared this sender failed").to_string();
                let _ = shared.send[idx].send(ChannelCommand::AbortSender { task: task_id, channel, reason });
                session = None;
            }
            Ok(_) | Err(_) => session = None,
        }
    };
    match result {
        Ok(st) => {
            if let Some(s) = session.as_mut() {
                let _ = s.call(&json!({"op": "finished", "task_id": task_id, "channel": channel}));
            }
            shared.stats.sends_finished.fetch_add(1, Ordering::Relaxed);
            Ok(json!({"ok": true, "task_id": task_id, "channel": channel, "seconds": started.elapsed().as_secs_f64(),
                      "tuples": st.tuples, "long_tuples": st.long_tuples, "packets": st.packets,
                      "retransmissions": st.retransmissions, "acks_from_switch": st.acks_from_switch,
                      "acks_from_receiver": st.acks_from_receiver}))
        }
        Err(reason) => {
            shared.stats.sends_failed.fetch_add(1, Ordering::Relaxed);
            // The receiver would otherwise wait for this channel's FIN.
            let fail = json!({"op": "fail", "task_id": task_id, "channel": channel, "error": reason});
            if session.as_mut().map(|s| s.call(&fail)).is_none_or(|r| r.is_err()) {
                let _ = peer_call(&control, &fail);
            }
            Err(error(format!("task {task_id} channel {channel}: {reason}")))
        }
    }
}

fn stats_json(shared: &Shared) -> Value {
    let s = &shared.stats;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let sum = |f: fn(&ChannelStats) -> &AtomicU64| shared.channel_stats.iter().map(|c| get(f(c))).sum::<u64>();
    json!({"ok": true,
        "tasks_created": get(&s.tasks_created), "tasks_finished": get(&s.tasks_finished),
        "tasks_failed": get(&s.tasks_failed), "tasks_active": shared.tasks.lock().expect("tasks").len(),
        "sends_finished": get(&s.sends_finished), "sends_failed": get(&s.sends_failed),
        "bad_requests": get(&s.bad_requests), "unknown_task": get(&s.unknown_task),
        "regions_released": get(&s.regions_released),
        "tasks_incomplete": get(&s.tasks_incomplete), "senders_failed": get(&s.senders_failed),
        "connections": get(&s.connections), "connections_refused": get(&s.connections_refused),
        "oversized_requests": get(&s.oversized_requests),
        "rx_datagrams": sum(|c| &c.rx_datagrams), "malformed_datagrams": sum(|c| &c.malformed),
        "unroutable_datagrams": sum(|c| &c.unroutable), "tx_datagrams": sum(|c| &c.tx_datagrams),
        "send_errors": sum(|c| &c.send_errors),
        "control_addr": shared.control_addr.to_string(),
        "data_addrs": shared.receive.iter().map(|(_, a)| a.to_string()).collect::<Vec<_>>()})
}

// ---------------------------------------------------- daemon control channel

/// One connection from another daemon. A sender's daemon joins on it and
/// keeps it for the whole send; if it closes before that channel finished,
/// the sender is declared failed.
fn serve_peer(shared: &Arc<Shared>, stream: TcpStream) {
    let Ok(mut writer) = stream.try_clone() else { return };
    let mut joined_here: Vec<(u32, u16)> = Vec::new();
    serve_lines(shared, stream, |s, req| peer_request(s, req, &mut joined_here), &mut writer);
    for (task, channel) in joined_here {
        let reason = "its daemon's control connection closed before its FIN was acknowledged (daemon killed or host gone)";
        sender_failed(shared, task, channel, reason.into());
    }
}

fn peer_request(shared: &Arc<Shared>, req: &Value, joined_here: &mut Vec<(u32, u16)>) -> Value {
    let op = req.get("op").and_then(Value::as_str).unwrap_or("");
    let result = (|| -> Result<Value, Value> {
        let task_id = uint(req, "task_id")? as u32;
        let channel = uint(req, "channel")?;
        match op {
            "join" => {
                let mut tasks = shared.tasks.lock().expect("tasks");
                let Some(t) = tasks.get_mut(&task_id) else {
                    shared.stats.unknown_task.fetch_add(1, Ordering::Relaxed);
                    return Err(error(format!("unknown task {task_id} at the receiver's daemon (never created, finished or aborted)")));
                };
                if channel >= t.params.senders as u64 {
                    return Err(error(format!("channel {channel} is out of range: task {task_id} has {} senders", t.params.senders)));
                }
                if t.joined.contains_key(&(channel as u16)) {
                    return Err(error(format!("channel {channel} of task {task_id} has already joined")));
                }
                let control = req.get("control").and_then(Value::as_str).unwrap_or("").to_string();
                t.joined.insert(channel as u16, SenderLink::new(control, Instant::now()));
                joined_here.push((task_id, channel as u16));
                // The channel's member key travels in clear on this channel:
                // it must be loopback or a trusted network (docs/security.md).
                let member_key = t.key.map(|k| channel_key(&k, task_id, channel as u16).to_hex());
                Ok(json!({"ok": true, "params": t.params, "member_key": member_key}))
            }
            "progress" => {
                let report: ProgressReport = serde_json::from_value(field(req, "progress")?.clone())
                    .map_err(|e| error(format!("bad progress report: {e}")))?;
                let mut tasks = shared.tasks.lock().expect("tasks");
                let gone = || error(format!("task {task_id} is gone at the receiver's daemon (finished or aborted)"));
                let t = tasks.get_mut(&task_id).ok_or_else(gone)?;
                let link = t.joined.get_mut(&(channel as u16)).ok_or_else(|| error(format!("channel {channel} has not joined task {task_id}")))?;
                if let LinkState::Failed { reason } = &link.state {
                    let message = format!("the receiver declared channel {channel} of task {task_id} failed: {reason}");
                    return Err(json!({"ok": false, "error": message, "declared_failed": true}));
                }
                if link.on_progress(report, Instant::now()) {
                    let _ = shared.receive[t.receive_channel].0.send(ChannelCommand::SenderProgress { task: task_id });
                }
                Ok(json!({"ok": true}))
            }
            "finished" => {
                if let Some(link) = shared.tasks.lock().expect("tasks").get_mut(&task_id).and_then(|t| t.joined.get_mut(&(channel as u16))) {
                    link.finish();
                }
                Ok(json!({"ok": true}))
            }
            "fail" => {
                let why = req.get("error").and_then(Value::as_str).unwrap_or("unknown error");
                let found = sender_failed(shared, task_id, channel as u16, format!("the sender failed: {why}"));
                Ok(json!({"ok": found}))
            }
            "abort" => {
                // The receiver's daemon gave up the task (or this channel).
                let reason = req.get("reason").and_then(Value::as_str).unwrap_or("aborted by the receiver");
                let reason = format!("the receiver aborted the task: {reason}");
                for s in &shared.send {
                    let _ = s.send(ChannelCommand::AbortSender { task: task_id, channel: channel as u16, reason: reason.clone() });
                }
                Ok(json!({"ok": true}))
            }
            other => Err(error(format!("unknown control op {other:?}"))),
        }
    })();
    result.unwrap_or_else(|e| e)
}

/// One request/reply on another daemon's control channel.
fn peer_call(addr: &str, msg: &Value) -> std::io::Result<Value> {
    let addr: SocketAddr = addr.parse().map_err(|_| std::io::Error::other(format!("bad address {addr:?}")))?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write_line(&mut stream, msg)?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(std::io::Error::other)
}
