//! fanin's versioned control API, `fanin.control.v1` (gRPC, schema in
//! `proto/fanin/control/v1/control.proto` at the workspace root).
//!
//! A controller programs a switch daemon through it: admit and remove jobs,
//! list them, read the switch's identity and its per-reason counters. This
//! crate holds the generated code ([`pb`]), the server, and the glue from
//! gRPC to the daemon: the daemon implements [`ControlPlane`] and calls
//! [`spawn`] (from plain threads) or [`serve`] (inside its own tokio runtime).
//!
//! The server validates every job spec itself ([`JobSpec::validate`]) before
//! the daemon sees it, so the config file, the control API and the Python
//! API reject the same specs with the same words.
//!
//! Status codes: INVALID_ARGUMENT (spec fails validation, member id above
//! 65535, unknown mode, missing spec), ALREADY_EXISTS (duplicate job_id),
//! RESOURCE_EXHAUSTED (no memory for the job), NOT_FOUND (removing an
//! unknown job), UNAUTHENTICATED (missing or wrong token), INTERNAL (the
//! daemon failed otherwise).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use fanin_proto::job::{FailurePolicy, JobMode, JobSpec, JobSpecError, RateLimit, MAX_SOURCES, SWITCH_RANK_BASE};
use fanin_proto::kv::{KvAdmitError, KvCounters, KvTaskSpec, Layout, TaskStats, ValueType};
use fanin_proto::switch::{AdmitError, Counters};
use tonic::metadata::MetadataMap;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// Code generated from `control.proto` (messages, `control_server`,
/// `control_client`).
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("fanin.control.v1");
}

pub use pb::control_client::ControlClient;

/// The API version this crate serves, reported by `GetInfo`.
pub const API_VERSION: &str = "v1";

/// How long a shutdown waits for open connections to finish before it drops
/// them.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Metadata key that carries the token (`authorization: Bearer <token>`).
pub const AUTH_METADATA_KEY: &str = "authorization";

/// Environment variable a daemon or client without a configured control
/// token takes it from (so the secret need not be written into a file).
pub const CONTROL_TOKEN_ENV: &str = "FANIN_CONTROL_TOKEN";

/// `configured`, else the non-empty token in [`CONTROL_TOKEN_ENV`].
pub fn token_or_env(configured: Option<String>) -> Option<String> {
    configured.or_else(|| std::env::var(CONTROL_TOKEN_ENV).ok().filter(|t| !t.is_empty()))
}

/// Identity and memory of a switch, as `GetInfo` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchInfo {
    /// UDP address of shard 0's data-plane socket.
    pub data_addr: SocketAddr,
    pub shard_count: u16,
    /// Changes on every daemon start (a controller re-admits its jobs when it
    /// sees a new one).
    pub incarnation: u32,
    /// Aggregation memory cap and current use, bytes.
    pub memory_limit: u64,
    pub memory_used: u64,
    /// Daemon software version.
    pub version: String,
    /// Most elements one value packet carries over the data port without
    /// IP fragmentation (`u32::MAX`: no limit known).
    pub packet_elems_max: u32,
}

/// A non-root switch's place in a job's aggregation tree, as the control
/// API carries it (`TreeRole` in the .proto).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeRole {
    /// The parent's shard-0 data-plane address; shard `k` listens on port + k.
    pub parent: SocketAddr,
    pub parent_shards: u16,
    /// This switch's source id at the parent.
    pub rank: u16,
}

impl TreeRole {
    /// The parent's data-plane address of each shard.
    pub fn parent_addrs(&self) -> Vec<SocketAddr> {
        (0..self.parent_shards).map(|k| SocketAddr::new(self.parent.ip(), self.parent.port() + k)).collect()
    }
}

/// The next switch on a relayed job's path (`NextHop` in the .proto).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextHop {
    /// Its shard-0 data-plane address; shard `k` listens on port + k.
    pub addr: SocketAddr,
    pub shards: u16,
}

impl NextHop {
    /// Its data-plane address of each shard.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        (0..self.shards).map(|k| SocketAddr::new(self.addr.ip(), self.addr.port() + k)).collect()
    }
}

/// A job as the switch holds it: the spec and, off the root, its tree role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobEntry {
    pub spec: JobSpec,
    pub tree: Option<TreeRole>,
}

/// Why a switch refused a job. Each variant maps to one gRPC status code;
/// the string is the human message sent to the caller unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitFailure {
    /// The spec is not valid (INVALID_ARGUMENT).
    #[error("{0}")]
    Invalid(String),
    /// A job with that id is already admitted (ALREADY_EXISTS).
    #[error("{0}")]
    Duplicate(String),
    /// The job does not fit the switch's free memory (RESOURCE_EXHAUSTED).
    #[error("{0}")]
    OutOfMemory(String),
    /// UpdateJob of a job the switch does not hold (NOT_FOUND).
    #[error("{0}")]
    NotFound(String),
    /// UpdateJob changing a field fixed at admission (FAILED_PRECONDITION).
    #[error("{0}")]
    Immutable(String),
    /// Anything else, e.g. a shard thread is gone (INTERNAL).
    #[error("{0}")]
    Internal(String),
}

impl From<AdmitError> for AdmitFailure {
    fn from(e: AdmitError) -> Self {
        let msg = e.to_string();
        match e {
            AdmitError::Invalid(_)
            | AdmitError::AgingTooFine { .. }
            | AdmitError::BadUplink { .. }
            | AdmitError::BadTransit { .. } => {
                AdmitFailure::Invalid(msg)
            }
            AdmitError::Duplicate(_) => AdmitFailure::Duplicate(msg),
            AdmitError::OutOfMemory { .. } => AdmitFailure::OutOfMemory(msg),
            AdmitError::Unknown(_) => AdmitFailure::NotFound(msg),
            AdmitError::Immutable { .. }
            | AdmitError::PartialResultsAdded { .. }
            | AdmitError::WorkersGrown { .. }
            | AdmitError::PlainMemberIntoRunningTree { .. } => {
                AdmitFailure::Immutable(msg)
            }
        }
    }
}

impl From<JobSpecError> for AdmitFailure {
    fn from(e: JobSpecError) -> Self {
        AdmitFailure::Invalid(e.to_string())
    }
}

impl From<AdmitFailure> for Status {
    fn from(e: AdmitFailure) -> Self {
        match e {
            AdmitFailure::Invalid(m) => Status::invalid_argument(m),
            AdmitFailure::Duplicate(m) => Status::already_exists(m),
            AdmitFailure::OutOfMemory(m) => Status::resource_exhausted(m),
            AdmitFailure::NotFound(m) => Status::not_found(m),
            AdmitFailure::Immutable(m) => Status::failed_precondition(m),
            AdmitFailure::Internal(m) => Status::internal(m),
        }
    }
}

impl From<KvAdmitError> for AdmitFailure {
    fn from(e: KvAdmitError) -> Self {
        let msg = e.to_string();
        match e {
            KvAdmitError::Duplicate(_) => AdmitFailure::Duplicate(msg),
            KvAdmitError::Layout(_) | KvAdmitError::BadSize { .. } => AdmitFailure::Invalid(msg),
            KvAdmitError::OutOfMemory { .. } | KvAdmitError::TenantLimit { .. } => AdmitFailure::OutOfMemory(msg),
        }
    }
}

/// A key-value task's region as the switch holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct KvRegion {
    pub spec: KvTaskSpec<SocketAddr>,
    /// The data port of the shard that owns the task.
    pub data_addr: SocketAddr,
    pub stats: TaskStats,
}

/// What the daemon offers the control API. Methods are called from a
/// blocking-task pool (never on the async executor), so they may block
/// briefly, e.g. to hand a job to every shard thread and wait for the
/// answers.
pub trait ControlPlane: Send + Sync + 'static {
    /// Admit a job. The spec has already passed [`JobSpec::validate`].
    /// `fanin_proto::switch::AdmitError` converts with `?` / `.into()`.
    fn admit_job(&self, job: JobEntry) -> Result<(), AdmitFailure>;
    /// Change an admitted job in place (members, workers, tree role);
    /// new members in `awaiting` join a running job (see UpdateJobRequest).
    fn update_job(&self, job: JobEntry, awaiting: Vec<u16>) -> Result<(), AdmitFailure>;
    /// Remove a job; `Err` (with a human message) if the switch does not hold
    /// it, reported as NOT_FOUND.
    fn remove_job(&self, job_id: u32) -> Result<(), String>;
    /// The admitted jobs, in any order (the API sorts them by job_id).
    fn list_jobs(&self) -> Vec<JobEntry>;
    /// Relay `job_id` toward `next` for `sources` (empty: any) (GOAT's
    /// on-path filtering, docs/goat.md). A daemon without a value program
    /// refuses.
    fn install_transit(&self, job_id: u32, next: NextHop, sources: Vec<u16>) -> Result<(), AdmitFailure> {
        let _ = (next, sources);
        Err(AdmitFailure::Internal(format!("job {job_id}: this switch cannot relay jobs")))
    }
    /// Stop relaying `job_id`; `Err` (NOT_FOUND) if it was not relayed.
    fn remove_transit(&self, job_id: u32) -> Result<(), String> {
        Err(format!("job {job_id} is not relayed here"))
    }
    fn info(&self) -> SwitchInfo;
    /// Counters merged over all shards.
    fn counters(&self) -> Counters;
    /// Allocate a key-value task's region; returns the data address its
    /// packets go to. A daemon without the key-value program refuses.
    fn alloc_kv_region(&self, spec: KvTaskSpec<SocketAddr>) -> Result<SocketAddr, AdmitFailure> {
        Err(AdmitFailure::Internal(format!("task {}: this switch has no key-value program", spec.task_id)))
    }
    /// Free a task's region; `Err` (NOT_FOUND) if the switch holds none.
    fn release_kv_region(&self, task_id: u32) -> Result<(), String> {
        Err(format!("task {task_id} has no key-value region"))
    }
    fn list_kv_regions(&self) -> Vec<KvRegion> {
        Vec::new()
    }
    fn kv_counters(&self) -> KvCounters {
        KvCounters::default()
    }
}

/// Errors of starting or running the control server.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control API: cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("control API: {0}")]
    Io(#[from] std::io::Error),
    #[error("control API transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("control API server thread panicked")]
    Panicked,
}

/// Serve the API on `addr` until `shutdown` resolves (then let calls in
/// flight finish, for at most [`SHUTDOWN_GRACE`]). With `Some(token)` every
/// call must carry `authorization: Bearer <token>`; others get
/// UNAUTHENTICATED. Must run inside a tokio runtime.
pub async fn serve(
    addr: SocketAddr,
    plane: Arc<dyn ControlPlane>,
    token: Option<String>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ControlError> {
    let listener =
        tokio::net::TcpListener::bind(addr).await.map_err(|source| ControlError::Bind { addr, source })?;
    serve_listener(listener, plane, token, shutdown).await
}

/// [`serve`] on an already bound listener (bind first to learn the port or
/// to report bind errors early).
pub async fn serve_listener(
    listener: tokio::net::TcpListener,
    plane: Arc<dyn ControlPlane>,
    token: Option<String>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ControlError> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let expected = token.map(|t| format!("Bearer {t}"));
    let svc =
        pb::control_server::ControlServer::with_interceptor(Service { plane }, move |req: Request<()>| {
            check_token(expected.as_deref(), req.metadata()).map(|()| req)
        });
    // Graceful shutdown waits for every connection to close, which needs the
    // client's cooperation (HTTP/2 GOAWAY and a ping round trip); a stalled
    // client must not keep the daemon from stopping, so after SHUTDOWN_GRACE
    // the remaining connections are dropped.
    let fired = Arc::new(tokio::sync::Notify::new());
    let signal = {
        let fired = fired.clone();
        async move {
            shutdown.await;
            fired.notify_one();
        }
    };
    let serve = tonic::transport::Server::builder().serve_with_incoming_shutdown(svc, incoming, signal);
    tokio::pin!(serve);
    tokio::select! {
        result = &mut serve => result?,
        () = async {
            fired.notified().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {}
    }
    Ok(())
}

/// Start the API on its own thread (a current-thread tokio runtime) for
/// callers without a runtime. Binding happens before this returns, so a port
/// in use is reported here as [`ControlError::Bind`]. Bind port 0 and read
/// [`ControlServerHandle::local_addr`] for an ephemeral port.
pub fn spawn(
    addr: SocketAddr,
    plane: Arc<dyn ControlPlane>,
    token: Option<String>,
) -> Result<ControlServerHandle, ControlError> {
    let std_listener =
        std::net::TcpListener::bind(addr).map_err(|source| ControlError::Bind { addr, source })?;
    std_listener.set_nonblocking(true)?;
    let local_addr = std_listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new().name("fanin-control".into()).spawn(move || {
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(std_listener)?;
            // A dropped sender (handle dropped) also stops the server.
            let shutdown = async move {
                let _ = stopped.await;
            };
            serve_listener(listener, plane, token, shutdown).await
        })
    })?;
    Ok(ControlServerHandle { local_addr, stop: Some(stop), thread: Some(thread) })
}

/// A running control server started by [`spawn`]. Dropping it also stops the
/// server (and waits for its thread).
#[derive(Debug)]
pub struct ControlServerHandle {
    local_addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), ControlError>>>,
}

impl ControlServerHandle {
    /// The address the server listens on (with the real port if 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stop accepting calls, let calls in flight finish (at most
    /// [`SHUTDOWN_GRACE`]), and join the thread.
    /// Returns the error the server stopped with, if any.
    pub fn shutdown(mut self) -> Result<(), ControlError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), ControlError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(thread) => thread.join().map_err(|_| ControlError::Panicked)?,
            None => Ok(()),
        }
    }
}

impl Drop for ControlServerHandle {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

fn check_token(expected: Option<&str>, metadata: &MetadataMap) -> Result<(), Status> {
    let Some(expected) = expected else { return Ok(()) };
    match metadata.get(AUTH_METADATA_KEY) {
        None => Err(Status::unauthenticated("missing token (metadata authorization: Bearer <token>)")),
        Some(got) if constant_time_eq(got.as_bytes(), expected.as_bytes()) => Ok(()),
        Some(_) => Err(Status::unauthenticated("wrong token")),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Convert a wire job spec, rejecting what the Rust type cannot hold
/// (member ids above 65535, unknown modes) instead of truncating, then
/// validate it.
/// The tree role of a wire job spec, checked.
pub fn tree_role_from_pb(spec: &pb::JobSpec) -> Result<Option<TreeRole>, Status> {
    let Some(tree) = &spec.tree else { return Ok(None) };
    let job_id = spec.job_id;
    let parent: SocketAddr = tree.parent_addr.parse().map_err(|_| {
        Status::invalid_argument(format!("job {job_id}: tree.parent_addr {:?} is not ip:port", tree.parent_addr))
    })?;
    let shards = u16::try_from(tree.parent_shards)
        .ok()
        .filter(|&n| n >= 1 && parent.port() as u32 + n as u32 <= 65536)
        .ok_or_else(|| {
            Status::invalid_argument(format!("job {job_id}: tree.parent_shards {} is out of range", tree.parent_shards))
        })?;
    let rank = u16::try_from(tree.rank)
        .ok()
        .filter(|&r| r >= SWITCH_RANK_BASE && (r as usize) < MAX_SOURCES)
        .ok_or_else(|| {
            Status::invalid_argument(format!(
                "job {job_id}: tree.rank {} must lie in {SWITCH_RANK_BASE}..{} (lower ranks name workers)",
                tree.rank,
                MAX_SOURCES
            ))
        })?;
    Ok(Some(TreeRole { parent, parent_shards: shards, rank }))
}

/// A wire job spec with its tree role, checked.
pub fn job_entry_from_pb(spec: pb::JobSpec) -> Result<JobEntry, Status> {
    let tree = tree_role_from_pb(&spec)?;
    Ok(JobEntry { spec: job_spec_from_pb(spec)?, tree })
}

/// Jobs in a `ListJobs` page when the request names no size, and the most
/// it may ask for.
pub const LIST_JOBS_PAGE_DEFAULT: u32 = 100;
/// See [`LIST_JOBS_PAGE_DEFAULT`].
pub const LIST_JOBS_PAGE_MAX: u32 = 1000;
/// A page ends before its encoding passes this, so a listing of jobs with
/// thousands of members each stays inside gRPC's default 4 MB message limit.
pub const LIST_JOBS_PAGE_BYTES: usize = 1 << 20;
const PAGE_TOKEN_PREFIX: &str = "job:";

/// The first job_id of the page a `ListJobs` page token names (0 for none).
/// The token is the next page's first job_id, so jobs admitted or removed
/// between pages never make the listing repeat or skip a job that stays.
fn page_start(token: &str) -> Result<u32, Status> {
    if token.is_empty() {
        return Ok(0);
    }
    token
        .strip_prefix(PAGE_TOKEN_PREFIX)
        .and_then(|id| id.parse::<u32>().ok())
        .ok_or_else(|| Status::invalid_argument(format!(
            "ListJobs page_token {token:?} was not made by this service: pass a response's next_page_token, \
             or an empty token for the first page"
        )))
}

/// One `ListJobs` page: the jobs from job_id `first` on, in job_id order, at
/// most `page_size` of them (0 = the default) and at most
/// [`LIST_JOBS_PAGE_BYTES`] encoded (always at least one job).
pub fn list_jobs_page(mut jobs: Vec<JobEntry>, first: u32, page_size: u32) -> pb::ListJobsResponse {
    use prost::Message;

    jobs.retain(|j| j.spec.job_id >= first);
    jobs.sort_by_key(|j| j.spec.job_id);
    let limit = match page_size {
        0 => LIST_JOBS_PAGE_DEFAULT,
        n => n.min(LIST_JOBS_PAGE_MAX),
    } as usize;
    let mut page = Vec::new();
    let mut bytes = 0;
    let mut next_page_token = String::new();
    for job in &jobs {
        let spec = job_entry_to_pb(job);
        // A repeated message field costs its length, a length prefix and a tag.
        let cost = spec.encoded_len() + 8;
        if page.len() == limit || (!page.is_empty() && bytes + cost > LIST_JOBS_PAGE_BYTES) {
            next_page_token = format!("{PAGE_TOKEN_PREFIX}{}", job.spec.job_id);
            break;
        }
        bytes += cost;
        page.push(spec);
    }
    pb::ListJobsResponse { jobs: page, next_page_token }
}

/// The wire form of a job entry.
pub fn job_entry_to_pb(job: &JobEntry) -> pb::JobSpec {
    pb::JobSpec {
        tree: job.tree.map(|t| pb::TreeRole {
            parent_addr: t.parent.to_string(),
            parent_shards: t.parent_shards.into(),
            rank: t.rank.into(),
        }),
        ..job_spec_to_pb(&job.spec)
    }
}

pub fn job_spec_from_pb(spec: pb::JobSpec) -> Result<JobSpec, Status> {
    let job_id = spec.job_id;
    let members = spec
        .members
        .iter()
        .map(|&m| {
            u16::try_from(m).map_err(|_| {
                Status::invalid_argument(format!(
                    "job {job_id}: member id {m} is too large (source ids must be below {MAX_SOURCES})"
                ))
            })
        })
        .collect::<Result<Vec<u16>, Status>>()?;
    let mode = match pb::JobMode::try_from(spec.mode) {
        Ok(pb::JobMode::Aggregate) => JobMode::Aggregate,
        Ok(pb::JobMode::Forward) => JobMode::Forward,
        Err(_) => return Err(Status::invalid_argument(format!("job {job_id}: unknown mode {}", spec.mode))),
    };
    let spec = JobSpec {
        job_id,
        members,
        block_cnt_max: spec.block_cnt_max,
        block_grad_max: spec.block_grad_max,
        block_exp_ms: spec.block_exp_ms,
        slow_after_windows: spec.slow_after_windows.unwrap_or(fanin_proto::job::DEFAULT_SLOW_AFTER_WINDOWS),
        mode,
        workers: u16::try_from(spec.workers.unwrap_or(0)).map_err(|_| {
            Status::invalid_argument(format!("job {job_id}: workers {} is too large", spec.workers.unwrap_or(0)))
        })?,
        key: match spec.key.len() {
            0 => None,
            _ => Some(fanin_proto::auth::Key::from_slice(&spec.key).map_err(|e| {
                Status::invalid_argument(format!("job {job_id}: key: {e} (empty for an unauthenticated job)"))
            })?),
        },
        on_failure: match spec.on_failure.map(pb::FailurePolicy::try_from) {
            None => FailurePolicy::default_for(spec.block_exp_ms),
            Some(Ok(pb::FailurePolicy::Degrade)) => FailurePolicy::Degrade,
            Some(Ok(pb::FailurePolicy::Fail)) => FailurePolicy::Fail,
            Some(Err(_)) => {
                let code = spec.on_failure.unwrap_or_default();
                return Err(Status::invalid_argument(format!("job {job_id}: unknown failure policy {code}")));
            }
        },
        member_timeout_ms: spec.member_timeout_ms,
        rate_limit: spec.rate_limit.map(|r| RateLimit { pps: r.pps, burst: r.burst }),
        result_group: match spec.result_group.as_str() {
            "" => None,
            text => Some(text.parse().map_err(|_| {
                Status::invalid_argument(format!(
                    "job {job_id}: result_group {text:?} is not an IPv4 address and port (use e.g. 239.1.0.7:47001, or leave it empty)"
                ))
            })?),
        },
        quorum: u16::try_from(spec.quorum)
            .map_err(|_| Status::invalid_argument(format!("job {job_id}: quorum {} is above any job's members", spec.quorum)))?,
        resumed: spec.resumed,
    };
    spec.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok(spec)
}

/// The wire form of a job spec.
pub fn job_spec_to_pb(spec: &JobSpec) -> pb::JobSpec {
    pb::JobSpec {
        job_id: spec.job_id,
        members: spec.members.iter().map(|&m| m as u32).collect(),
        block_cnt_max: spec.block_cnt_max,
        block_grad_max: spec.block_grad_max,
        block_exp_ms: spec.block_exp_ms,
        slow_after_windows: Some(spec.slow_after_windows),
        workers: (spec.workers != 0).then_some(spec.workers.into()),
        tree: None,
        mode: match spec.mode {
            JobMode::Aggregate => pb::JobMode::Aggregate,
            JobMode::Forward => pb::JobMode::Forward,
        } as i32,
        key: spec.key.map_or_else(Vec::new, |k| k.0.to_vec()),
        on_failure: Some(match spec.on_failure {
            FailurePolicy::Degrade => pb::FailurePolicy::Degrade,
            FailurePolicy::Fail => pb::FailurePolicy::Fail,
        } as i32),
        member_timeout_ms: spec.member_timeout_ms,
        rate_limit: spec.rate_limit.map(|r| pb::RateLimit { pps: r.pps, burst: r.burst }),
        result_group: spec.result_group.map_or_else(String::new, |g| g.to_string()),
        quorum: spec.quorum.into(),
        resumed: spec.resumed,
    }
}

/// Counters as the wire list of `{name, reason, value}`, in
/// [`Counters::visit`] order.
pub fn counters_to_pb(counters: &Counters) -> Vec<pb::Counter> {
    visited_to_pb(|f| counters.visit(f))
}

/// The wire list of whatever a counters `visit` walks (value and key-value
/// counters alike).
fn visited_to_pb(visit: impl FnOnce(&mut dyn FnMut(&'static str, Option<&'static str>, u64))) -> Vec<pb::Counter> {
    let mut out = Vec::new();
    visit(&mut |name, reason, value| {
        out.push(pb::Counter { name: name.to_string(), reason: reason.map(str::to_string), value })
    });
    out
}

/// Convert a wire region spec, rejecting values the Rust type cannot hold.
pub fn kv_spec_from_pb(spec: pb::KvRegionSpec) -> Result<KvTaskSpec<SocketAddr>, Status> {
    let id = spec.task_id;
    let receiver: SocketAddr = spec.receiver_addr.parse().map_err(|_| {
        Status::invalid_argument(format!("task {id}: receiver_addr {:?} is not ip:port", spec.receiver_addr))
    })?;
    let narrow = |name: &str, v: u32| {
        u8::try_from(v).map_err(|_| Status::invalid_argument(format!("task {id}: {name} {v} is too large")))
    };
    let layout = Layout {
        short_slots: narrow("short_slots", spec.short_slots)?,
        medium_groups: narrow("medium_groups", spec.medium_groups)?,
        medium_parts: narrow("medium_parts", spec.medium_parts)?,
    };
    layout.validate().map_err(|e| Status::invalid_argument(format!("task {id}: {e}")))?;
    let max_channels = u16::try_from(spec.max_channels)
        .map_err(|_| Status::invalid_argument(format!("task {id}: max_channels {} is too large", spec.max_channels)))?;
    let mut out = KvTaskSpec::new(id, receiver, layout, spec.aa_size);
    out.value_type = match pb::KvValueType::try_from(spec.value_type) {
        Ok(pb::KvValueType::Int64) => ValueType::Int64,
        Ok(pb::KvValueType::Float64) => ValueType::Float64,
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "task {id}: value_type {} is unknown (0 = int64, 1 = float64)",
                spec.value_type
            )))
        }
    };
    out.tenant = spec.tenant;
    out.shadow_copies = spec.shadow_copies;
    out.window = spec.window;
    out.max_channels = max_channels;
    out.idle_timeout = std::time::Duration::from_millis(spec.idle_timeout_ms.into());
    out.key = match spec.key.len() {
        0 => None,
        _ => Some(fanin_proto::auth::Key::from_slice(&spec.key).map_err(|e| {
            Status::invalid_argument(format!("task {id}: key: {e} (empty for an unauthenticated task)"))
        })?),
    };
    Ok(out)
}

/// The wire form of a region spec.
pub fn kv_spec_to_pb(spec: &KvTaskSpec<SocketAddr>) -> pb::KvRegionSpec {
    pb::KvRegionSpec {
        task_id: spec.task_id,
        tenant: spec.tenant,
        receiver_addr: spec.receiver.to_string(),
        short_slots: spec.layout.short_slots.into(),
        medium_groups: spec.layout.medium_groups.into(),
        medium_parts: spec.layout.medium_parts.into(),
        aa_size: spec.aa_size,
        shadow_copies: spec.shadow_copies,
        window: spec.window,
        max_channels: spec.max_channels.into(),
        idle_timeout_ms: spec.idle_timeout.as_millis().min(u32::MAX as u128) as u32,
        key: spec.key.map_or_else(Vec::new, |k| k.0.to_vec()),
        value_type: match spec.value_type {
            ValueType::Int64 => pb::KvValueType::Int64,
            ValueType::Float64 => pb::KvValueType::Float64,
        } as i32,
    }
}

struct Service {
    plane: Arc<dyn ControlPlane>,
}

impl Service {
    /// Run a (possibly blocking) control-plane call off the executor.
    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn ControlPlane) -> T + Send + 'static,
    ) -> Result<T, Status> {
        let plane = self.plane.clone();
        tokio::task::spawn_blocking(move || f(&*plane))
            .await
            .map_err(|e| Status::internal(format!("control plane call failed: {e}")))
    }
}

#[tonic::async_trait]
impl pb::control_server::Control for Service {
    async fn get_info(
        &self,
        _request: Request<pb::GetInfoRequest>,
    ) -> Result<Response<pb::GetInfoResponse>, Status> {
        let info = self.call(|p| p.info()).await?;
        Ok(Response::new(pb::GetInfoResponse {
            api_version: API_VERSION.to_string(),
            version: info.version,
            data_addr: info.data_addr.to_string(),
            shard_count: info.shard_count.into(),
            incarnation: info.incarnation,
            memory_limit: info.memory_limit,
            memory_used: info.memory_used,
            packet_elems_max: if info.packet_elems_max == u32::MAX { 0 } else { info.packet_elems_max },
        }))
    }

    async fn admit_job(
        &self,
        request: Request<pb::AdmitJobRequest>,
    ) -> Result<Response<pb::AdmitJobResponse>, Status> {
        let spec =
            request.into_inner().spec.ok_or_else(|| Status::invalid_argument("AdmitJob needs a spec"))?;
        let job = job_entry_from_pb(spec)?;
        self.call(move |p| p.admit_job(job)).await??;
        Ok(Response::new(pb::AdmitJobResponse {}))
    }

    async fn update_job(
        &self,
        request: Request<pb::UpdateJobRequest>,
    ) -> Result<Response<pb::UpdateJobResponse>, Status> {
        let request = request.into_inner();
        let spec = request.spec.ok_or_else(|| Status::invalid_argument("UpdateJob needs a spec"))?;
        let job = job_entry_from_pb(spec)?;
        let awaiting = request
            .awaiting
            .iter()
            .map(|&m| u16::try_from(m).map_err(|_| Status::invalid_argument(format!("awaiting member {m} is too large"))))
            .collect::<Result<Vec<u16>, Status>>()?;
        self.call(move |p| p.update_job(job, awaiting)).await??;
        Ok(Response::new(pb::UpdateJobResponse {}))
    }

    async fn install_transit(
        &self,
        request: Request<pb::InstallTransitRequest>,
    ) -> Result<Response<pb::InstallTransitResponse>, Status> {
        let request = request.into_inner();
        let job_id = request.job_id;
        let next = request.next.ok_or_else(|| Status::invalid_argument(format!("job {job_id}: InstallTransit needs next")))?;
        let addr: SocketAddr = next
            .addr
            .parse()
            .map_err(|_| Status::invalid_argument(format!("job {job_id}: next.addr {:?} is not ip:port", next.addr)))?;
        let shards = u16::try_from(next.shards)
            .ok()
            .filter(|&n| n >= 1 && addr.port() as u32 + n as u32 <= 65536)
            .ok_or_else(|| Status::invalid_argument(format!("job {job_id}: next.shards {} is out of range", next.shards)))?;
        let sources = request
            .sources
            .iter()
            .map(|&s| {
                u16::try_from(s).ok().filter(|&s| (s as usize) < MAX_SOURCES).ok_or_else(|| {
                    Status::invalid_argument(format!("job {job_id}: source {s} must lie below {MAX_SOURCES}"))
                })
            })
            .collect::<Result<Vec<u16>, Status>>()?;
        self.call(move |p| p.install_transit(job_id, NextHop { addr, shards }, sources)).await??;
        Ok(Response::new(pb::InstallTransitResponse {}))
    }

    async fn remove_transit(
        &self,
        request: Request<pb::RemoveTransitRequest>,
    ) -> Result<Response<pb::RemoveTransitResponse>, Status> {
        let job_id = request.into_inner().job_id;
        self.call(move |p| p.remove_transit(job_id)).await?.map_err(Status::not_found)?;
        Ok(Response::new(pb::RemoveTransitResponse {}))
    }

    async fn remove_job(
        &self,
        request: Request<pb::RemoveJobRequest>,
    ) -> Result<Response<pb::RemoveJobResponse>, Status> {
        let job_id = request.into_inner().job_id;
        self.call(move |p| p.remove_job(job_id)).await?.map_err(Status::not_found)?;
        Ok(Response::new(pb::RemoveJobResponse {}))
    }

    async fn list_jobs(
        &self,
        request: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        let request = request.into_inner();
        let first = page_start(&request.page_token)?;
        let jobs = self.call(|p| p.list_jobs()).await?;
        Ok(Response::new(list_jobs_page(jobs, first, request.page_size)))
    }

    async fn get_counters(
        &self,
        _request: Request<pb::GetCountersRequest>,
    ) -> Result<Response<pb::GetCountersResponse>, Status> {
        let counters = self.call(|p| p.counters()).await?;
        Ok(Response::new(pb::GetCountersResponse { counters: counters_to_pb(&counters) }))
    }

    async fn alloc_kv_region(
        &self,
        request: Request<pb::AllocKvRegionRequest>,
    ) -> Result<Response<pb::AllocKvRegionResponse>, Status> {
        let spec = request
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("AllocKvRegion needs a spec"))?;
        let spec = kv_spec_from_pb(spec)?;
        let memory_bytes = spec.memory() * KV_AGGREGATOR_BYTES;
        let addr = self.call(move |p| p.alloc_kv_region(spec)).await??;
        Ok(Response::new(pb::AllocKvRegionResponse { data_addr: addr.to_string(), memory_bytes }))
    }

    async fn release_kv_region(
        &self,
        request: Request<pb::ReleaseKvRegionRequest>,
    ) -> Result<Response<pb::ReleaseKvRegionResponse>, Status> {
        let task_id = request.into_inner().task_id;
        self.call(move |p| p.release_kv_region(task_id)).await?.map_err(Status::not_found)?;
        Ok(Response::new(pb::ReleaseKvRegionResponse {}))
    }

    async fn list_kv_regions(
        &self,
        _request: Request<pb::ListKvRegionsRequest>,
    ) -> Result<Response<pb::ListKvRegionsResponse>, Status> {
        let mut regions = self.call(|p| p.list_kv_regions()).await?;
        regions.sort_by_key(|r| r.spec.task_id);
        let regions = regions
            .iter()
            .map(|r| pb::KvRegion {
                spec: Some(kv_spec_to_pb(&r.spec)),
                data_addr: r.data_addr.to_string(),
                tuples_in: r.stats.tuples_in,
                tuples_aggregated: r.stats.tuples_aggregated,
                packets_acked: r.stats.packets_acked,
                packets_forwarded: r.stats.packets_forwarded,
                swaps: r.stats.swaps,
            })
            .collect();
        Ok(Response::new(pb::ListKvRegionsResponse { regions }))
    }

    async fn get_kv_counters(
        &self,
        _request: Request<pb::GetCountersRequest>,
    ) -> Result<Response<pb::GetCountersResponse>, Status> {
        let counters = self.call(|p| p.kv_counters()).await?;
        Ok(Response::new(pb::GetCountersResponse { counters: visited_to_pb(|f| counters.visit(f)) }))
    }
}

/// Bytes of one key-value aggregator on the switch (key part u64, count
/// u32, sum, min and max i64, padded to 8 bytes).
pub const KV_AGGREGATOR_BYTES: u64 = 40;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_member_ids_are_rejected_not_truncated() {
        let spec = pb::JobSpec {
            job_id: 7,
            members: vec![0, 65536 + 1],
            block_cnt_max: 4,
            block_grad_max: 16,
            ..Default::default()
        };
        let err = job_spec_from_pb(spec).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("member id 65537"), "{}", err.message());
    }

    #[test]
    fn specs_round_trip() {
        let mut spec = JobSpec::with_sources(3, 5, 8, 256);
        spec.mode = JobMode::Forward;
        spec.block_exp_ms = 20;
        assert_eq!(job_spec_from_pb(job_spec_to_pb(&spec)).unwrap(), spec);
        spec.on_failure = FailurePolicy::Fail;
        spec.member_timeout_ms = 1500;
        spec.rate_limit = Some(RateLimit { pps: 1000, burst: 16 });
        assert_eq!(job_spec_from_pb(job_spec_to_pb(&spec)).unwrap(), spec);
        spec.result_group = Some("239.1.0.7:47001".parse().unwrap());
        assert_eq!(job_spec_from_pb(job_spec_to_pb(&spec)).unwrap(), spec);
        for (text, says) in [("239.1.0.7", "not an IPv4 address and port"), ("10.0.0.1:5", "not an IPv4 multicast group")] {
            let mut bad = job_spec_to_pb(&spec);
            bad.result_group = text.into();
            let err = job_spec_from_pb(bad).unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument);
            assert!(err.message().contains(says), "{}", err.message());
        }
    }

    #[test]
    fn kv_specs_round_trip_with_and_without_key() {
        let layout = Layout { short_slots: 4, medium_groups: 2, medium_parts: 2 };
        let mut spec = KvTaskSpec::new(77, "127.0.0.1:5000".parse().unwrap(), layout, 64);
        assert_eq!(kv_spec_from_pb(kv_spec_to_pb(&spec)).unwrap(), spec);
        spec.key = Some(fanin_proto::auth::Key([9; 16]));
        assert_eq!(kv_spec_from_pb(kv_spec_to_pb(&spec)).unwrap(), spec);
        let mut bad = kv_spec_to_pb(&spec);
        bad.key = vec![1; 15];
        let err = kv_spec_from_pb(bad).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("key"), "{}", err.message());
        spec.value_type = ValueType::Float64;
        assert_eq!(kv_spec_from_pb(kv_spec_to_pb(&spec)).unwrap(), spec);
        let mut bad = kv_spec_to_pb(&spec);
        bad.value_type = 7;
        let err = kv_spec_from_pb(bad).unwrap_err();
        assert!(err.message().contains("value_type 7 is unknown"), "{}", err.message());
    }

    #[test]
    fn unknown_mode_is_invalid() {
        let mut spec = job_spec_to_pb(&JobSpec::with_sources(3, 2, 8, 256));
        spec.mode = 9;
        assert_eq!(job_spec_from_pb(spec).unwrap_err().code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn token_check() {
        let mut md = MetadataMap::new();
        assert!(check_token(None, &md).is_ok());
        assert_eq!(check_token(Some("Bearer s"), &md).unwrap_err().code(), tonic::Code::Unauthenticated);
        md.insert("authorization", "Bearer t".parse().unwrap());
        assert_eq!(check_token(Some("Bearer s"), &md).unwrap_err().code(), tonic::Code::Unauthenticated);
        assert!(check_token(Some("Bearer t"), &md).is_ok());
    }

    #[test]
    fn counters_carry_reasons() {
        let mut c = Counters { accepted: 5, ..Default::default() };
        c.malformed[0] = 2;
        let list = counters_to_pb(&c);
        assert!(list.iter().any(|x| x.name == "accepted" && x.reason.is_none() && x.value == 5));
        assert!(list.iter().any(|x| x.name == "malformed" && x.reason.is_some() && x.value == 2));
    }
}
