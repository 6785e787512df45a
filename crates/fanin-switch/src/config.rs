//! Daemon configuration (TOML file or JSON), validated with messages that
//! name the offending field.

use std::net::SocketAddr;

use std::time::Duration;

use fanin_proto::auth::Key;
use fanin_proto::job::{FailurePolicy, JobMode, JobSpec, RateLimit, DEFAULT_SLOW_AFTER_WINDOWS};
use fanin_proto::switch::{AgingConfig, MemoryModel};
use fanin_proto::trim::Watermark;
use serde::{Deserialize, Serialize};

/// Where a side service of the switch (control API, metrics) listens.
///
/// `Auto` puts it on 127.0.0.1 at a fixed offset from the data port
/// ([`CONTROL_PORT_OFFSET`], [`METRICS_PORT_OFFSET`]), so a second switch on
/// one machine needs one port changed, not three, and clients can still
/// find it; if that port is taken it takes a free one (the switch prints
/// where). In a file or JSON: `"auto"`, `"off"` (or null), or `"ip:port"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Listen {
    Off,
    #[default]
    Auto,
    At(SocketAddr),
}

/// Control API port = data port + this, when left to `auto`.
pub const CONTROL_PORT_OFFSET: u16 = 100;
/// Metrics port = data port + this, when left to `auto`.
pub const METRICS_PORT_OFFSET: u16 = 101;

impl Listen {
    /// Where to bind, and whether a taken port may fall back to a free one
    /// (only for `Auto`). A data port of 0 (any) gives a free port too.
    pub fn resolve(self, data_addr: SocketAddr, offset: u16) -> Option<(SocketAddr, bool)> {
        match self {
            Listen::Off => None,
            Listen::At(addr) => Some((addr, false)),
            Listen::Auto => {
                let port = match data_addr.port() {
                    0 => 0,
                    p => p.checked_add(offset).unwrap_or(0),
                };
                Some((SocketAddr::from(([127, 0, 0, 1], port)), true))
            }
        }
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        match text.trim() {
            "auto" => Ok(Listen::Auto),
            "off" | "none" => Ok(Listen::Off),
            t => t.parse().map(Listen::At).map_err(|_| {
                format!(
                    "{t:?} is not an address: give \"auto\", \"off\" or ip:port (e.g. 127.0.0.1:9100 for \
                     control_addr, 127.0.0.1:9101 for metrics_addr)"
                )
            }),
        }
    }
}

impl From<Option<SocketAddr>> for Listen {
    fn from(addr: Option<SocketAddr>) -> Self {
        addr.map_or(Listen::Off, Listen::At)
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Off => f.write_str("off"),
            Listen::Auto => f.write_str("auto"),
            Listen::At(a) => write!(f, "{a}"),
        }
    }
}

impl Serialize for Listen {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Listen {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(Listen::Off),
            Some(text) => Listen::parse(&text).map_err(serde::de::Error::custom),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// Data-plane address of shard 0; shard `i` listens on port + i.
    #[serde(default = "default_data_addr")]
    pub data_addr: SocketAddr,
    /// Run-to-completion processing threads, each owning one data port.
    /// Default: half the cores this process may run on, 1 to 8 ([`auto_shards`]).
    #[serde(default = "default_shards")]
    pub shards: u16,
    /// MTU of the data link, which sizes the packets of every job that
    /// leaves it to the switch (no IP fragmentation). 0 (the default): the
    /// MTU of the interface that owns `data_addr` (the smallest of those up
    /// for 0.0.0.0). Set it when a link beyond the switch's own is smaller.
    #[serde(default)]
    pub data_mtu: u32,
    /// gRPC control API: `"auto"` (the default: 127.0.0.1 at the data
    /// port + 100, or a free port if that one is taken), an address, or
    /// `"off"`.
    #[serde(default)]
    pub control_addr: Listen,
    /// Bearer token the control API requires. Required when
    /// `control_addr` is not a loopback address; unset takes
    /// `FANIN_CONTROL_TOKEN` from the environment.
    #[serde(default)]
    pub control_token: Option<String>,
    /// Prometheus text endpoint: `"auto"` (the default: 127.0.0.1 at the
    /// data port + 101, or a free port), an address, or `"off"`.
    #[serde(default)]
    pub metrics_addr: Listen,
    /// Aggregation memory for all jobs together, in MiB.
    #[serde(default = "default_memory_mb")]
    pub memory_mb: u64,
    /// How jobs get that memory (docs/memory.md): `"pooled"` (Trio-ML: a
    /// block record takes a buffer when its block opens and gives it back
    /// when freed; jobs share the memory and their caps, two buffers per
    /// slot, may add up to twice it; a job reserves its record and one
    /// buffer per slot) or `"reserved"` (SwitchML: two buffers per slot
    /// reserved at admission).
    #[serde(default = "default_memory_model")]
    pub memory_model: String,
    /// Key-value (ASK) aggregator memory for all tasks together, in MiB
    /// (one aggregator = `KV_AGGREGATOR_BYTES`), split evenly over shards.
    #[serde(default = "default_kv_memory_mb")]
    pub kv_memory_mb: u64,
    /// Most key-value memory one tenant's tasks may hold together, in MiB
    /// (per shard, as the regions live on one shard each).
    #[serde(default = "default_kv_memory_mb")]
    pub kv_tenant_mb: u64,
    /// Datagrams per receive/send batch.
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// Socket buffer size requested for each data socket, in bytes.
    #[serde(default = "default_socket_buffer")]
    pub socket_buffer: usize,
    /// Explicit Congestion Notification (docs/congestion.md, "ECN"): send
    /// results ECN-capable and read whether contributions arrived marked
    /// Congestion Experienced by a queue on their way (a CE-marked
    /// contribution marks its block's result, as a repaired loss does).
    /// Workers do the same unless their session turns it off.
    #[serde(default = "default_ecn")]
    pub ecn: bool,
    #[serde(default)]
    pub faults: FaultConfig,
    #[serde(default)]
    pub aging: AgingSection,
    #[serde(default)]
    pub trim: TrimSection,
    /// Per-source rate limit for jobs that set none (docs/overload.md);
    /// none = unlimited.
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
    #[serde(default)]
    pub jobs: Vec<JobConfig>,
}

/// The straggler detector (docs/stragglers.md): each job with a
/// `block_exp_ms` is scanned by `scanners` timer scans per visit period,
/// and a block ages after `checks` visits without a new contribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgingSection {
    #[serde(default = "default_scanners")]
    pub scanners: u16,
    #[serde(default = "default_checks")]
    pub checks: u8,
    /// Finest scan tick allowed, in microseconds (software timers).
    #[serde(default = "default_min_tick_us")]
    pub min_tick_us: u64,
    /// Skew-aware expiry's ceiling, in multiples of `block_exp_ms` (1 =
    /// Trio's fixed timeout; docs/stragglers.md).
    #[serde(default = "default_max_factor")]
    pub max_factor: u8,
    /// Run the `scanners` as timer threads of their own (Trio's design),
    /// visiting the shards' scan words from other cores, instead of on
    /// each shard thread between batches (docs/stragglers.md).
    #[serde(default)]
    pub threads: bool,
}

impl Default for AgingSection {
    fn default() -> Self {
        Self {
            scanners: default_scanners(),
            checks: default_checks(),
            min_tick_us: default_min_tick_us(),
            max_factor: default_max_factor(),
            threads: false,
        }
    }
}

impl AgingSection {
    pub fn to_config(&self) -> AgingConfig {
        AgingConfig {
            scanners: self.scanners,
            checks: self.checks,
            min_tick: Duration::from_micros(self.min_tick_us),
            max_factor: self.max_factor,
            threads: self.threads,
        }
    }
}

fn default_max_factor() -> u8 {
    AgingConfig::default().max_factor
}

/// Trimming on overload (docs/trimming-daemon.md): when a shard's receive
/// queue holds more than `watermark` of its buffer behind a batch, the data
/// contributions of that batch are answered with a header-only Trimmed nack
/// instead of being aggregated. Off by default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrimSection {
    #[serde(default)]
    pub enabled: bool,
    /// Fraction of the socket receive buffer (as granted by the kernel).
    #[serde(default = "default_watermark")]
    pub watermark: f64,
    /// Mark instead of trim (ATP's switch-side ECN): a contribution that
    /// arrives to a receive queue deeper than this fraction of the buffer
    /// is handled as if a queue had marked it Congestion Experienced, so
    /// its block's result tells every member to cut its window before the
    /// queue reaches the trim watermark (or the kernel's drop). Nothing is
    /// discarded. Unset: off. Independent of `enabled`; with trimming on it
    /// must lie below `watermark`.
    #[serde(default)]
    pub mark_watermark: Option<f64>,
}

impl Default for TrimSection {
    fn default() -> Self {
        Self { enabled: false, watermark: default_watermark(), mark_watermark: None }
    }
}

impl TrimSection {
    /// The watermark, if trimming is on.
    pub fn watermark(&self) -> Result<Option<Watermark>, ConfigError> {
        let w = Watermark::new(self.watermark).map_err(ConfigError::Invalid)?;
        Ok(self.enabled.then_some(w))
    }

    /// The marking watermark, if set.
    pub fn mark_watermark(&self) -> Result<Option<Watermark>, ConfigError> {
        let Some(m) = self.mark_watermark else { return Ok(None) };
        let w = Watermark::new(m).map_err(|_| {
            ConfigError::Invalid(format!(
                "trim.mark_watermark = {m} is out of range: give a fraction of the receive buffer in 0.0..1.0 \
                 (at 1.0 or above the kernel drops before the switch marks)"
            ))
        })?;
        if self.enabled && m >= self.watermark {
            return Err(ConfigError::Invalid(format!(
                "trim.mark_watermark = {m} is not below trim.watermark = {}: a datagram above the trim \
                 watermark is trimmed, not marked; give a smaller fraction (e.g. half of it)",
                self.watermark
            )));
        }
        Ok(Some(w))
    }
}

fn default_watermark() -> f64 {
    0.5
}

fn default_kv_memory_mb() -> u64 {
    64
}

fn default_scanners() -> u16 {
    AgingConfig::default().scanners
}
fn default_checks() -> u8 {
    AgingConfig::default().checks
}
fn default_min_tick_us() -> u64 {
    AgingConfig::default().min_tick.as_micros() as u64
}
fn default_slow_after_windows() -> u32 {
    DEFAULT_SLOW_AFTER_WINDOWS
}

/// Seeded fault injection on the switch's own ports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FaultConfig {
    /// Probability of dropping each received datagram.
    #[serde(default)]
    pub ingress_drop: f64,
    /// Probability of processing a received datagram twice.
    #[serde(default)]
    pub ingress_duplicate: f64,
    /// Probability of processing a received datagram after the next one of
    /// its receive batch.
    #[serde(default)]
    pub ingress_reorder: f64,
    /// Probability of dropping each datagram the switch sends.
    #[serde(default)]
    pub egress_drop: f64,
    #[serde(default)]
    pub seed: u64,
}

/// A job admitted at start-up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
    pub job_id: u32,
    /// Explicit member source ids ...
    #[serde(default)]
    pub members: Option<Vec<u16>>,
    /// ... or sources 0..n.
    #[serde(default)]
    pub sources: Option<u16>,
    #[serde(default = "default_block_cnt_max")]
    pub block_cnt_max: u32,
    #[serde(default = "default_block_grad_max")]
    pub block_grad_max: u32,
    #[serde(default)]
    pub block_exp_ms: u32,
    #[serde(default = "default_slow_after_windows")]
    pub slow_after_windows: u32,
    #[serde(default)]
    pub mode: JobMode,
    /// Workers in the whole job (aggregation trees); 0 = the member count.
    #[serde(default)]
    pub workers: u16,
    /// The job key as 32 hex digits (docs/security.md); unset = an
    /// unauthenticated job.
    #[serde(default)]
    pub key: Option<String>,
    /// `degrade` or `fail` when a worker dies (docs/failures.md); unset:
    /// `degrade` with `block_exp_ms` > 0, else `fail`
    /// ([`FailurePolicy::default_for`]).
    #[serde(default)]
    pub on_failure: Option<FailurePolicy>,
    /// 0 = the default member timeout.
    #[serde(default)]
    pub member_timeout_ms: u32,
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
    /// "239.1.0.7:47001": the job's completion results go to this IPv4
    /// multicast group once, for the members that listen on it
    /// (docs/protocol.md §4.5); unset = unicast to every member.
    #[serde(default)]
    pub result_group: Option<std::net::SocketAddrV4>,
    /// GOAT's K: a block completes with the first `quorum` members'
    /// contributions (0 = every member; docs/goat.md).
    #[serde(default)]
    pub quorum: u16,
}

fn default_data_addr() -> SocketAddr {
    "127.0.0.1:9000".parse().expect("literal")
}
fn default_shards() -> u16 {
    auto_shards(std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The shard count for a machine of `cores` cores: one per two cores (the
/// other core of each pair is left to the kernel's network stack, which
/// on Linux does the socket work of the same datagrams, and to workers
/// on the same machine), at least 1, at most 8 (past 8 the kernel's UDP
/// receive path, not the shards, is the limit on the machines measured).
pub fn auto_shards(cores: usize) -> u16 {
    (cores / 2).clamp(1, 8) as u16
}
fn default_memory_mb() -> u64 {
    1024
}
fn default_memory_model() -> String {
    "pooled".into()
}
fn default_batch() -> usize {
    64
}
fn default_ecn() -> bool {
    true
}
fn default_socket_buffer() -> usize {
    32 << 20
}
fn default_block_cnt_max() -> u32 {
    fanin_proto::job::DEFAULT_BLOCK_CNT_MAX
}
fn default_block_grad_max() -> u32 {
    fanin_proto::job::DEFAULT_BLOCK_GRAD_MAX
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {msg}")]
    Read { path: String, msg: String },
    #[error("invalid config: {0}")]
    Parse(String),
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Most memory (`memory_mb`, `kv_memory_mb`, `kv_tenant_mb`) a config may
/// give, in MiB (1 PiB): more overflowed the byte count to 0.
pub const MAX_MEMORY_MB: u64 = 1 << 30;

/// A JSON config's error with the field it is about (`jobs[0].sources:
/// invalid value: integer `-1`, expected u16 at line 1 column 384`):
/// serde_json says only where, and the JSON that the Python layers write
/// is one long line, so "line 1 column 384" told a user nothing.
fn json_error(text: &str, e: &serde_json::Error) -> String {
    let message = e.to_string();
    match json_path_at(text, e.line(), e.column(), message.starts_with("missing field")) {
        Some(path) if !path.is_empty() && !message.starts_with("unknown field") => format!("{path}: {message}"),
        _ => message,
    }
}

/// The field path (`faults.egress_drop`, `jobs[1].members[2]`) at `line`
/// and `column` (1-based, as serde_json counts them) of a JSON text: the
/// object keys and array indices that enclose that place; `of_object`: the
/// path of the innermost object there, without the key last read in it
/// (serde_json reports a missing field at its object's end, after the
/// object's last value). None if the place is not in the text.
pub fn json_path_at(text: &str, line: usize, column: usize, of_object: bool) -> Option<String> {
    enum Frame {
        Object { key: Option<String>, at_key: bool },
        Array { index: usize },
    }
    if line == 0 {
        return None;
    }
    let start: usize = text.split_inclusive('\n').take(line - 1).map(str::len).sum();
    // serde_json's column is the byte it stopped at, 1-based; scan up to, not including, it
    let mut end = (start + column.saturating_sub(1)).min(text.len());
    while !text.is_char_boundary(end) {
        end += 1;
    }
    let mut stack: Vec<Frame> = Vec::new();
    let mut string: Option<(String, bool)> = None; // (text so far, is a key)
    let mut escaped = false;
    for c in text[..end].chars() {
        if let Some((buf, is_key)) = string.as_mut() {
            if escaped {
                escaped = false;
                buf.push(c);
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                let (buf, is_key) = (std::mem::take(buf), *is_key);
                string = None;
                if let (true, Some(Frame::Object { key, .. })) = (is_key, stack.last_mut()) {
                    *key = Some(buf);
                }
            } else {
                buf.push(c);
            }
            continue;
        }
        match c {
            '"' => {
                let is_key = matches!(stack.last(), Some(Frame::Object { at_key: true, .. }));
                string = Some((String::new(), is_key));
            }
            '{' => stack.push(Frame::Object { key: None, at_key: true }),
            '[' => stack.push(Frame::Array { index: 0 }),
            '}' | ']' => {
                stack.pop();
            }
            ',' => match stack.last_mut() {
                Some(Frame::Array { index }) => *index += 1,
                Some(Frame::Object { key, at_key }) => {
                    *key = None;
                    *at_key = true;
                }
                None => {}
            },
            ':' => {
                if let Some(Frame::Object { at_key, .. }) = stack.last_mut() {
                    *at_key = false;
                }
            }
            _ => {}
        }
    }
    if of_object {
        if let Some(Frame::Object { key, .. }) = stack.last_mut() {
            *key = None;
        }
    }
    let mut path = String::new();
    for frame in &stack {
        match frame {
            Frame::Object { key: Some(key), .. } => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
            }
            Frame::Object { key: None, .. } => {}
            Frame::Array { index } => path.push_str(&format!("[{index}]")),
        }
    }
    Some(path)
}

impl Default for DaemonConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("every field has a default")
    }
}

pub use fanin_control::CONTROL_TOKEN_ENV;

impl DaemonConfig {
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: Self = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let cfg = cfg.with_env_token();
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: Self = serde_json::from_str(text).map_err(|e| ConfigError::Parse(json_error(text, &e)))?;
        let cfg = cfg.with_env_token();
        cfg.validate()?;
        Ok(cfg)
    }

    /// A config without `control_token` takes `FANIN_CONTROL_TOKEN` from the
    /// environment (so the secret need not be written into a file).
    pub fn with_env_token(mut self) -> Self {
        self.control_token = fanin_control::token_or_env(self.control_token.take());
        self
    }

    pub fn from_file(path: &str) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { path: path.to_string(), msg: e.to_string() })?;
        if path.ends_with(".json") {
            Self::from_json_str(&text)
        } else {
            Self::from_toml_str(&text)
        }
    }

    /// The shards' memory model (`memory_model`).
    pub fn memory_model(&self) -> Result<MemoryModel, ConfigError> {
        match self.memory_model.as_str() {
            "reserved" => Ok(MemoryModel::Reserved),
            "pooled" => Ok(MemoryModel::Pooled),
            other => Err(ConfigError::Invalid(format!(
                "memory_model = {other:?}: use \"pooled\" (Trio-ML, shared) or \"reserved\" (SwitchML, per job)"
            ))),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.shards == 0 || self.shards > 64 {
            return bad(format!("shards = {} is out of range (1..=64)", self.shards));
        }
        if self.data_mtu != 0 && self.data_mtu < 576 {
            return bad(format!("data_mtu = {} is below 576, the least an IPv4 link carries (0 = detect it)", self.data_mtu));
        }
        if self.data_addr.port() as u32 + self.shards as u32 > 65_536 {
            return bad(format!("data_addr port {} + {} shards exceeds 65535", self.data_addr.port(), self.shards));
        }
        if self.batch == 0 || self.batch > 1024 {
            return bad(format!("batch = {} is out of range (1..=1024)", self.batch));
        }
        if self.memory_mb == 0 {
            return bad("memory_mb must be at least 1".into());
        }
        for (name, mb) in [("memory_mb", self.memory_mb), ("kv_memory_mb", self.kv_memory_mb), ("kv_tenant_mb", self.kv_tenant_mb)] {
            if mb > MAX_MEMORY_MB {
                return bad(format!("{name} = {mb} is out of range (at most {MAX_MEMORY_MB} MiB)"));
            }
        }
        self.memory_model()?;
        for (name, p) in [
            ("faults.ingress_drop", self.faults.ingress_drop),
            ("faults.ingress_duplicate", self.faults.ingress_duplicate),
            ("faults.ingress_reorder", self.faults.ingress_reorder),
            ("faults.egress_drop", self.faults.egress_drop),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return bad(format!("{name} = {p} is not a probability (0.0..=1.0)"));
            }
        }
        self.aging.to_config().validate().map_err(ConfigError::Invalid)?;
        if self.aging.min_tick_us == 0 {
            return bad("aging.min_tick_us must be at least 1".into());
        }
        self.trim.watermark()?;
        self.trim.mark_watermark()?;
        // Safe by default: a control API anyone on the network can reach
        // must ask for a token (docs/security.md).
        if self.control_token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return bad("control_token is empty (give a secret, or leave it unset on a loopback control_addr)".into());
        }
        if let Listen::At(addr) = self.control_addr {
            if !addr.ip().is_loopback() && self.control_token.is_none() {
                return bad(format!(
                    "control_addr {addr} is not a loopback address but no control_token is set: anyone who reaches \
                     it could admit jobs and read job keys; set control_token (or FANIN_CONTROL_TOKEN), or bind \
                     the control API to 127.0.0.1"
                ));
            }
        }
        if let Some(limit) = &self.rate_limit {
            limit.validate().map_err(ConfigError::Invalid)?;
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, job) in self.jobs.iter().enumerate() {
            let spec = job.to_spec().map_err(|m| ConfigError::Invalid(format!("jobs[{i}]: {m}")))?;
            spec.validate().map_err(|e| ConfigError::Invalid(format!("jobs[{i}]: {e}")))?;
            if !seen.insert(job.job_id) {
                return bad(format!("jobs[{i}]: job_id {} is defined twice", job.job_id));
            }
        }
        Ok(())
    }
}

impl JobConfig {
    pub fn to_spec(&self) -> Result<JobSpec, String> {
        let members = match (&self.members, self.sources) {
            (Some(m), None) => m.clone(),
            (None, Some(n)) => (0..n).collect(),
            (Some(_), Some(_)) => return Err("give either `members` or `sources`, not both".into()),
            (None, None) => return Err("missing `members` (list of source ids) or `sources` (count)".into()),
        };
        Ok(JobSpec {
            job_id: self.job_id,
            members,
            block_cnt_max: self.block_cnt_max,
            block_grad_max: self.block_grad_max,
            block_exp_ms: self.block_exp_ms,
            slow_after_windows: self.slow_after_windows,
            mode: self.mode,
            workers: self.workers,
            key: self.key.as_deref().map(Key::from_hex).transpose().map_err(|e| format!("key: {e}"))?,
            on_failure: self.on_failure.unwrap_or(FailurePolicy::default_for(self.block_exp_ms)),
            member_timeout_ms: self.member_timeout_ms,
            rate_limit: self.rate_limit,
            result_group: self.result_group,
            quorum: self.quorum,
            // only a controller re-installing a job after a restart says so
            resumed: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_shard_count_follows_the_cores() {
        assert_eq!([1, 2, 3, 4, 16, 64].map(auto_shards), [1, 1, 1, 2, 8, 8]);
    }

    #[test]
    fn a_control_api_off_loopback_needs_a_token() {
        let open = r#"control_addr = "0.0.0.0:9100""#;
        let err = toml::from_str::<DaemonConfig>(open).unwrap().validate().unwrap_err().to_string();
        assert!(err.contains("not a loopback address but no control_token"), "{err}");
        let with_token = format!("{open}\ncontrol_token = \"s3cret\"");
        assert!(toml::from_str::<DaemonConfig>(&with_token).unwrap().validate().is_ok());
        let empty = format!("{open}\ncontrol_token = \" \"");
        assert!(toml::from_str::<DaemonConfig>(&empty).unwrap().validate().unwrap_err().to_string().contains("empty"));
        // loopback without a token stays the easy default
        assert!(DaemonConfig::default().validate().is_ok());
    }

    #[test]
    fn side_ports_default_to_the_data_port_plus_an_offset() {
        let data = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let cfg = DaemonConfig::default();
        assert_eq!((cfg.control_addr, cfg.metrics_addr), (Listen::Auto, Listen::Auto));
        assert_eq!(cfg.control_addr.resolve(data(9000), CONTROL_PORT_OFFSET), Some((data(9100), true)));
        assert_eq!(cfg.metrics_addr.resolve(data(9010), METRICS_PORT_OFFSET), Some((data(9111), true)));
        assert_eq!(Listen::Auto.resolve(data(0), CONTROL_PORT_OFFSET), Some((data(0), true)), "any data port: any");
        assert_eq!(Listen::Auto.resolve(data(65_500), CONTROL_PORT_OFFSET), Some((data(0), true)));
        let at = Listen::At(data(7));
        assert_eq!(at.resolve(data(9000), CONTROL_PORT_OFFSET), Some((data(7), false)), "an address is kept");
        assert_eq!(Listen::Off.resolve(data(9000), CONTROL_PORT_OFFSET), None);
        let cfg = DaemonConfig::from_toml_str("control_addr = \"off\"\nmetrics_addr = \"127.0.0.1:7\"").unwrap();
        assert_eq!((cfg.control_addr, cfg.metrics_addr), (Listen::Off, at));
        let cfg = DaemonConfig::from_json_str(r#"{"control_addr": null, "metrics_addr": "auto"}"#).unwrap();
        assert_eq!((cfg.control_addr, cfg.metrics_addr), (Listen::Off, Listen::Auto));
        let back: DaemonConfig = serde_json::from_value(serde_json::to_value(&cfg).unwrap()).unwrap();
        assert_eq!(back, cfg);
        let err = DaemonConfig::from_toml_str("control_addr = \"ninety\"").unwrap_err().to_string();
        assert!(err.contains("give \"auto\", \"off\" or ip:port"), "{err}");
    }

    #[test]
    fn a_job_key_is_32_hex_digits() {
        let cfg = DaemonConfig::from_toml_str(
            "[[jobs]]\njob_id = 1\nsources = 2\nkey = \"000102030405060708090a0b0c0d0e0f\"\n",
        )
        .unwrap();
        assert_eq!(cfg.jobs[0].to_spec().unwrap().key.unwrap().0[15], 15);
        let err = DaemonConfig::from_toml_str("[[jobs]]\njob_id = 1\nsources = 2\nkey = \"0102\"\n").unwrap_err();
        assert!(err.to_string().contains("32 hex digits"), "{err}");
    }

    #[test]
    fn defaults_and_a_full_file() {
        let cfg = DaemonConfig::from_toml_str(
            r#"
            data_addr = "127.0.0.1:9500"
            shards = 2
            memory_mb = 64
            [trim]
            enabled = true
            watermark = 0.25
            [faults]
            ingress_drop = 0.05
            seed = 3
            [[jobs]]
            job_id = 1
            sources = 4
            [[jobs]]
            job_id = 2
            members = [0, 5]
            block_cnt_max = 8
            mode = "forward"
            "#,
        )
        .unwrap();
        assert_eq!(cfg.shards, 2);
        assert_eq!(cfg.trim.watermark().unwrap().map(|w| w.fraction()), Some(0.25));
        assert_eq!(DaemonConfig::default().trim.watermark().unwrap(), None, "off by default");
        assert_eq!(DaemonConfig::default().trim.mark_watermark().unwrap(), None, "marking off by default");
        assert!(DaemonConfig::default().ecn, "ECN on by default");
        let marking = TrimSection { mark_watermark: Some(0.1), ..TrimSection::default() };
        assert_eq!(marking.mark_watermark().unwrap().map(|w| w.fraction()), Some(0.1));
        let above = TrimSection { enabled: true, watermark: 0.2, mark_watermark: Some(0.3) };
        assert!(above.mark_watermark().unwrap_err().to_string().contains("is not below trim.watermark"));
        assert_eq!(cfg.jobs[0].to_spec().unwrap().members, vec![0, 1, 2, 3]);
        assert_eq!(cfg.jobs[1].mode, JobMode::Forward);
        assert_eq!(DaemonConfig::default().data_addr.port(), 9000);
    }

    #[test]
    fn errors_say_what_is_wrong() {
        let err = |t: &str| DaemonConfig::from_toml_str(t).unwrap_err().to_string();
        assert!(err("shards = \"two\"").contains("invalid type"), "{}", err("shards = \"two\""));
        assert!(err("shards = 0").contains("shards = 0 is out of range"));
        assert!(err("bogus = 1").contains("unknown field `bogus`"));
        assert!(err("[[jobs]]\nsources = 2").contains("missing field `job_id`"));
        assert!(err("[[jobs]]\njob_id = 1").contains("jobs[0]: missing `members`"));
        assert!(err("[[jobs]]\njob_id = 1\nsources = 2\nblock_grad_max = 99999").contains("jobs[0]: job 1: block_grad_max 99999"));
        assert!(err("[[jobs]]\njob_id = 1\nsources = 2\n[[jobs]]\njob_id = 1\nsources = 2").contains("defined twice"));
        assert!(err("[faults]\ningress_drop = 1.5").contains("not a probability"));
        assert!(err("[aging]\nscanners = 0").contains("aging.scanners 0 is out of range"));
        assert!(err("memory_model = \"shared\"").contains("memory_model = \"shared\": use \"pooled\""));
        assert_eq!(DaemonConfig::default().memory_model().unwrap(), MemoryModel::Pooled, "Trio's model by default");
        let reserved = DaemonConfig::from_toml_str("memory_model = \"reserved\"").unwrap();
        assert_eq!(reserved.memory_model().unwrap(), MemoryModel::Reserved);
        assert!(err("[trim]\nenabled = true\nwatermark = 1.0").contains("trim.watermark = 1 is out of range"));
        assert!(err("[trim]\nwatermark = -0.5").contains("trim.watermark = -0.5 is out of range"));
        assert!(err("[trim]\nenable = true").contains("unknown field `enable`"));
        assert!(err("[aging]\nchecks = 20").contains("aging.checks 20 is out of range"));
        assert!(err("[aging]\nmax_factor = 0").contains("aging.max_factor 0 is out of range (1..=63 with checks 4"));
        assert!(err("[[jobs]]\njob_id = 1\nsources = 2\nblock_exp_ms = 700000").contains("block_exp_ms 700000"));
        assert!(err("[[jobs]]\njob_id = 1\nsources = 2\nslow_after_windows = 20000").contains("slow_after_windows 20000"));
    }
}

#[cfg(test)]
mod json_paths {
    use super::*;

    fn err(json: &str) -> String {
        DaemonConfig::from_json_str(json).unwrap_err().to_string()
    }

    #[test]
    fn a_json_error_names_the_field_not_only_the_column() {
        assert!(err(r#"{"data_addr": "127.0.0.1:0", "shards": -1}"#).starts_with("invalid config: shards: invalid value"));
        let e = err(r#"{"faults": {"seed": 1, "egress_drop": NaN}}"#);
        assert!(e.starts_with("invalid config: faults.egress_drop: expected value"), "{e}");
        let e = err(r#"{"jobs": [{"job_id": 1, "sources": 2}, {"job_id": 2, "sources": -1}]}"#);
        assert!(e.starts_with("invalid config: jobs[1].sources: invalid value: integer `-1`, expected u16"), "{e}");
        let e = err(r#"{"jobs": [{"job_id": 1, "members": [0, 70000]}]}"#);
        assert!(e.starts_with("invalid config: jobs[0].members[1]: invalid value: integer `70000`"), "{e}");
        let e = err(r#"{"data_addr": "nonsense"}"#);
        assert!(e.starts_with("invalid config: data_addr: invalid socket address syntax"), "{e}");
        let e = err("{\n  \"aging\": {\"scanners\": 2},\n  \"metrics_addr\": \"x\"\n}");
        assert!(e.starts_with("invalid config: metrics_addr: \"x\" is not an address") && e.contains("9101"), "{e}");
        // a key with an escaped quote, and the errors that are about no value
        let e = err(r#"{"trim": {"mark_watermark": 0.1, "watermark": "half"}}"#);
        assert!(e.starts_with("invalid config: trim.watermark: invalid type"), "{e}");
        assert!(err(r#"{"bogus": 1}"#).starts_with("invalid config: unknown field `bogus`"));
        let e = err(r#"{"jobs": [{"sources": 2}]}"#);
        assert!(e.starts_with("invalid config: jobs[0]: missing field `job_id`"), "{e}");
        assert_eq!(json_path_at(r#"{"a\"b": [1, {"c": x"#, 1, 18, false).as_deref(), Some("a\"b[1].c"));
    }

    #[test]
    fn memory_that_would_overflow_is_refused() {
        let e = err(r#"{"memory_mb": 17592186044416}"#);
        assert!(e.contains("memory_mb = 17592186044416 is out of range (at most 1073741824 MiB)"), "{e}");
        assert!(err(r#"{"kv_tenant_mb": 1099511627776}"#).contains("kv_tenant_mb = "));
    }
}

#[cfg(test)]
mod example_file {
    #[test]
    fn the_shipped_example_config_is_valid() {
        let cfg = super::DaemonConfig::from_toml_str(include_str!("../../../examples/switch.toml")).unwrap();
        assert_eq!(cfg.shards, 2);
        assert_eq!(cfg.jobs.len(), 1);
    }

    /// Every field of the config and of a job, by section: what the example
    /// file and docs/operations.md claim to list.
    fn every_field() -> Vec<(String, String)> {
        let mut fields = Vec::new();
        let config = serde_json::to_value(super::DaemonConfig::default()).unwrap();
        for (name, value) in config.as_object().unwrap() {
            match (name.as_str(), value) {
                ("jobs", _) => {}
                (section, serde_json::Value::Object(inner)) if section != "rate_limit" => {
                    fields.extend(inner.keys().map(|k| (section.to_string(), k.clone())));
                }
                _ => fields.push((String::new(), name.clone())),
            }
        }
        let job: super::JobConfig = serde_json::from_str(r#"{"job_id": 1, "sources": 1}"#).unwrap();
        let job = serde_json::to_value(job).unwrap();
        fields.extend(job.as_object().unwrap().keys().map(|k| ("jobs".to_string(), k.clone())));
        fields
    }

    #[test]
    fn the_example_config_and_the_operations_doc_name_every_field() {
        let example = include_str!("../../../examples/switch.toml");
        // a line `name = ...`, set or commented out (`# name = ...`), in its section
        let mut section = String::new();
        let mut listed = std::collections::BTreeSet::new();
        for line in example.lines() {
            let line = line.trim();
            if let Some(table) = line.strip_prefix("[[").or(line.strip_prefix('[')) {
                section = table.trim_end_matches(']').split(']').next().unwrap().to_string();
                continue;
            }
            let code = line.trim_start_matches('#').trim_start();
            if let Some((name, _)) = code.split_once('=') {
                listed.insert((section.clone(), name.trim().to_string()));
            }
        }
        let doc = include_str!("../../../docs/operations.md");
        for (section, name) in every_field() {
            assert!(listed.contains(&(section.clone(), name.clone())), "examples/switch.toml lacks [{section}] {name}");
            assert!(doc.contains(&format!("`{name}`")), "docs/operations.md lacks `{name}` ([{section}])");
        }
    }
}
