//! The daemon's client of the switch control API (gRPC): allocate and
//! release key-value regions (ASK steps 3 and 12). Blocking calls on a
//! private current-thread runtime; the daemon calls them from its API
//! threads, never from a data channel.

use std::net::SocketAddr;
use std::sync::Mutex;

use fanin_control::pb;
use fanin_control::ControlClient;
use fanin_proto::kv::KvTaskSpec;

pub struct SwitchControl {
    endpoint: String,
    token: Option<String>,
    runtime: Mutex<tokio::runtime::Runtime>,
}

/// Why the switch refused or could not be reached.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("switch control API {endpoint}: {message}")]
pub struct ControlCallError {
    pub endpoint: String,
    pub code: Option<i32>,
    pub message: String,
}

impl ControlCallError {
    pub fn already_exists(&self) -> bool {
        self.code == Some(tonic::Code::AlreadyExists as i32)
    }
    pub fn not_found(&self) -> bool {
        self.code == Some(tonic::Code::NotFound as i32)
    }
}

impl SwitchControl {
    pub fn new(addr: SocketAddr, token: Option<String>) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        Ok(Self { endpoint: format!("http://{addr}"), token, runtime: Mutex::new(runtime) })
    }

    fn error(&self, code: Option<i32>, message: String) -> ControlCallError {
        ControlCallError { endpoint: self.endpoint.clone(), code, message }
    }

    async fn connect(&self) -> Result<ControlClient<tonic::transport::Channel>, ControlCallError> {
        let channel = tonic::transport::Endpoint::from_shared(self.endpoint.clone())
            .map_err(|e| self.error(None, e.to_string()))?
            .connect_timeout(std::time::Duration::from_secs(3))
            .connect()
            .await
            .map_err(|e| self.error(None, format!("cannot connect: {e}")))?;
        Ok(ControlClient::new(channel))
    }

    fn status(&self, s: tonic::Status) -> ControlCallError {
        self.error(Some(s.code() as i32), s.message().to_string())
    }

    fn request<M>(&self, message: M) -> tonic::Request<M> {
        let mut req = tonic::Request::new(message);
        if let Some(t) = &self.token {
            if let Ok(v) = format!("Bearer {t}").parse() {
                req.metadata_mut().insert(fanin_control::AUTH_METADATA_KEY, v);
            }
        }
        req
    }

    /// Allocate a region; returns the switch data address for the task.
    pub fn alloc(&self, spec: &KvTaskSpec<SocketAddr>) -> Result<SocketAddr, ControlCallError> {
        let req = self.request(pb::AllocKvRegionRequest { spec: Some(fanin_control::kv_spec_to_pb(spec)) });
        let rt = self.runtime.lock().expect("runtime lock");
        let reply = rt.block_on(async {
            let mut c = self.connect().await?;
            c.alloc_kv_region(req).await.map_err(|s| self.status(s))
        })?;
        let reply = reply.into_inner();
        reply.data_addr.parse().map_err(|_| ControlCallError {
            endpoint: self.endpoint.clone(),
            code: None,
            message: format!("bad data_addr {:?} in reply", reply.data_addr),
        })
    }

    /// Free a region (teardown). NOT_FOUND means it is already gone.
    /// Whether the switch holds a region for `task_id` (a keyed sender's
    /// check of an unsealed UnknownTask hint).
    pub fn holds(&self, task_id: u32) -> Result<bool, ControlCallError> {
        let req = self.request(pb::ListKvRegionsRequest {});
        let rt = self.runtime.lock().expect("runtime lock");
        rt.block_on(async {
            let mut c = self.connect().await?;
            c.list_kv_regions(req).await.map_err(|s| self.status(s))
        })
        .map(|r| r.into_inner().regions.iter().any(|region| region.spec.as_ref().is_some_and(|s| s.task_id == task_id)))
    }

    pub fn release(&self, task_id: u32) -> Result<(), ControlCallError> {
        let req = self.request(pb::ReleaseKvRegionRequest { task_id });
        let rt = self.runtime.lock().expect("runtime lock");
        rt.block_on(async {
            let mut c = self.connect().await?;
            c.release_kv_region(req).await.map_err(|s| self.status(s))
        })
        .map(|_| ())
    }
}
