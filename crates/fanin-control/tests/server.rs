//! The control API end to end: a real tonic server on 127.0.0.1:0 over an
//! in-memory fake daemon, called with the generated tonic client.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use fanin_control::pb::{self, JobMode as PbMode};
use fanin_control::{
    spawn, AdmitFailure, ControlClient, ControlError, ControlPlane, ControlServerHandle, JobEntry, SwitchInfo,
    API_VERSION,
};
use fanin_proto::job::JobSpec;
use fanin_proto::switch::{AdmitError, Counters};
use tonic::transport::Channel;
use tonic::{Code, Request};

const MEMORY_LIMIT: u64 = 1 << 20;

/// A switch reduced to its job table, with the daemon's admission rules
/// (duplicates, memory cap) and errors.
#[derive(Default)]
struct FakePlane {
    jobs: Mutex<BTreeMap<u32, JobEntry>>,
}

impl FakePlane {
    fn used(jobs: &BTreeMap<u32, JobEntry>) -> u64 {
        jobs.values().map(|j| j.spec.memory_bytes()).sum()
    }
}

impl ControlPlane for FakePlane {
    fn admit_job(&self, job: JobEntry) -> Result<(), AdmitFailure> {
        let spec = &job.spec;
        spec.validate()?;
        let mut jobs = self.jobs.lock().unwrap();
        if jobs.contains_key(&spec.job_id) {
            return Err(AdmitError::Duplicate(spec.job_id).into());
        }
        let available = MEMORY_LIMIT - Self::used(&jobs);
        if spec.memory_bytes() > available {
            return Err(AdmitError::OutOfMemory {
                job_id: spec.job_id,
                needed: spec.memory_bytes(),
                available,
                limit: MEMORY_LIMIT,
            }
            .into());
        }
        jobs.insert(spec.job_id, job);
        Ok(())
    }

    fn update_job(&self, job: JobEntry, _awaiting: Vec<u16>) -> Result<(), AdmitFailure> {
        let mut jobs = self.jobs.lock().unwrap();
        let Some(entry) = jobs.get_mut(&job.spec.job_id) else {
            return Err(AdmitError::Unknown(job.spec.job_id).into());
        };
        if entry.spec.block_cnt_max != job.spec.block_cnt_max {
            return Err(AdmitError::Immutable { job_id: job.spec.job_id, field: "block_cnt_max" }.into());
        }
        *entry = job;
        Ok(())
    }

    fn remove_job(&self, job_id: u32) -> Result<(), String> {
        match self.jobs.lock().unwrap().remove(&job_id) {
            Some(_) => Ok(()),
            None => Err(format!("job {job_id} is not on this switch")),
        }
    }

    fn list_jobs(&self) -> Vec<JobEntry> {
        // reversed on purpose: the API must sort
        self.jobs.lock().unwrap().values().rev().cloned().collect()
    }

    fn info(&self) -> SwitchInfo {
        SwitchInfo {
            data_addr: "10.0.0.1:9000".parse().unwrap(),
            shard_count: 4,
            incarnation: 0xdead_beef,
            memory_limit: MEMORY_LIMIT,
            memory_used: Self::used(&self.jobs.lock().unwrap()),
            version: "0.1.0-test".into(),
            packet_elems_max: 358,
        }
    }

    fn counters(&self) -> Counters {
        let mut c = Counters { rx_datagrams: 10, accepted: 7, ..Default::default() };
        c.malformed[0] = 3;
        c
    }
}

/// Shut down from async code without blocking the runtime that drives the
/// client's connection (graceful shutdown needs the client to answer).
async fn stop(server: ControlServerHandle) {
    tokio::task::spawn_blocking(move || server.shutdown()).await.unwrap().unwrap();
}

fn start(token: Option<&str>) -> ControlServerHandle {
    spawn("127.0.0.1:0".parse().unwrap(), Arc::new(FakePlane::default()), token.map(String::from)).unwrap()
}

async fn client(addr: SocketAddr) -> ControlClient<Channel> {
    ControlClient::connect(format!("http://{addr}")).await.unwrap()
}

fn spec(job_id: u32, members: Vec<u32>) -> pb::JobSpec {
    pb::JobSpec {
        job_id,
        members,
        block_cnt_max: 8,
        block_grad_max: 256,
        block_exp_ms: 5,
        slow_after_windows: Some(2),
        mode: PbMode::Aggregate as i32,
        workers: None,
        tree: None,
        key: Vec::new(),
        ..Default::default()
    }
}

fn admit(spec: pb::JobSpec) -> pb::AdmitJobRequest {
    pb::AdmitJobRequest { spec: Some(spec) }
}

#[tokio::test(flavor = "current_thread")]
async fn every_rpc_round_trips() {
    let server = start(None);
    let mut c = client(server.local_addr()).await;

    let info = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.api_version, API_VERSION);
    assert_eq!(info.api_version, "v1");
    assert_eq!(info.version, "0.1.0-test");
    assert_eq!(info.data_addr, "10.0.0.1:9000");
    assert_eq!(info.shard_count, 4);
    assert_eq!(info.incarnation, 0xdead_beef);
    assert_eq!(info.memory_limit, MEMORY_LIMIT);
    assert_eq!(info.memory_used, 0);
    assert_eq!(info.packet_elems_max, 358);

    c.admit_job(admit(spec(9, vec![0, 1, 2]))).await.unwrap();
    let mut forward = spec(2, vec![3, 1]);
    forward.mode = PbMode::Forward as i32;
    forward.block_exp_ms = 0;
    c.admit_job(admit(forward.clone())).await.unwrap();

    let jobs = c.list_jobs(pb::ListJobsRequest::default()).await.unwrap().into_inner().jobs;
    assert_eq!(jobs, vec![listed(forward), listed(spec(9, vec![0, 1, 2]))], "sorted by job_id, fields intact");

    let info = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.memory_used, JobSpec::with_sources(9, 3, 8, 256).memory_bytes());

    c.remove_job(pb::RemoveJobRequest { job_id: 9 }).await.unwrap();
    let jobs = c.list_jobs(pb::ListJobsRequest::default()).await.unwrap().into_inner().jobs;
    assert_eq!(jobs.iter().map(|j| j.job_id).collect::<Vec<_>>(), vec![2]);

    let counters = c.get_counters(pb::GetCountersRequest {}).await.unwrap().into_inner().counters;
    let mut expected = Vec::new();
    FakePlane::default()
        .counters()
        .visit(|name, reason, value| expected.push((name.to_string(), reason.map(String::from), value)));
    let got: Vec<_> = counters.into_iter().map(|c| (c.name, c.reason, c.value)).collect();
    assert_eq!(got, expected, "every counter, in visit order, reasons kept");
    assert!(got.iter().any(|(n, r, v)| n == "malformed" && r.is_some() && *v == 3));
    assert!(got.contains(&("accepted".into(), None, 7)));

    drop(c);
    stop(server).await;
}

/// ListJobs pages (AIP-158): a listing never exceeds its page size or gRPC's
/// default 4 MB message, the tokens walk the jobs in job_id order, a job
/// removed or admitted between pages neither repeats nor hides another, and
/// a token the service did not make is refused.
#[tokio::test(flavor = "current_thread")]
async fn list_jobs_pages() {
    let server = start(None);
    let mut c = client(server.local_addr()).await;
    for id in [7, 1, 5, 3, 9] {
        c.admit_job(admit(spec(id, vec![0, 1]))).await.unwrap();
    }
    let page = |size: u32, token: &str| pb::ListJobsRequest { page_size: size, page_token: token.into() };
    let first = c.list_jobs(page(2, "")).await.unwrap().into_inner();
    assert_eq!(first.jobs.iter().map(|j| j.job_id).collect::<Vec<_>>(), vec![1, 3]);
    assert!(!first.next_page_token.is_empty());
    // job 3 (listed) leaves, job 4 arrives behind the listing's position and
    // job 8 ahead of it: the listing goes on where it was, and sees job 8
    c.remove_job(pb::RemoveJobRequest { job_id: 3 }).await.unwrap();
    c.admit_job(admit(spec(4, vec![0]))).await.unwrap();
    c.admit_job(admit(spec(8, vec![0]))).await.unwrap();
    let second = c.list_jobs(page(2, &first.next_page_token)).await.unwrap().into_inner();
    assert_eq!(second.jobs.iter().map(|j| j.job_id).collect::<Vec<_>>(), vec![5, 7]);
    let last = c.list_jobs(page(2, &second.next_page_token)).await.unwrap().into_inner();
    assert_eq!(last.jobs.iter().map(|j| j.job_id).collect::<Vec<_>>(), vec![8, 9]);
    assert_eq!(last.next_page_token, "", "the last page says so");
    let all = c.list_jobs(page(0, "")).await.unwrap().into_inner();
    assert_eq!((all.jobs.len(), all.next_page_token.as_str()), (6, ""), "page_size 0 = the default, 100");
    for bad in ["7", "job:", "job:x", "job:-1", "after:3"] {
        let err = c.list_jobs(page(2, bad)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad}");
        assert!(err.message().contains("next_page_token"), "{}", err.message());
    }
    drop(c);
    stop(server).await;
}

/// The page bounds by themselves: 600 jobs of 4096 members each (~5 MB of
/// specs) come out in pages under 1 MiB, the requested size is capped at
/// 1000, and every job is listed exactly once.
#[test]
fn list_jobs_page_bounds() {
    use fanin_control::{list_jobs_page, LIST_JOBS_PAGE_BYTES, LIST_JOBS_PAGE_MAX};
    use prost::Message;

    let entry = |id: u32, members: u32| fanin_control::job_entry_from_pb(spec(id, (0..members).collect())).unwrap();
    let big: Vec<JobEntry> = (0..600).map(|id| entry(id, 4096)).collect();
    let (mut seen, mut first, mut pages) = (Vec::new(), 0, 0);
    loop {
        let page = list_jobs_page(big.clone(), first, 1000);
        assert!(page.encoded_len() <= LIST_JOBS_PAGE_BYTES + 64, "{} bytes", page.encoded_len());
        assert!(!page.jobs.is_empty());
        seen.extend(page.jobs.iter().map(|j| j.job_id));
        pages += 1;
        if page.next_page_token.is_empty() {
            break;
        }
        first = page.next_page_token.strip_prefix("job:").unwrap().parse().unwrap();
    }
    assert_eq!(seen, (0..600).collect::<Vec<_>>());
    assert!(pages >= 5, "{pages} pages");
    let small: Vec<JobEntry> = (0..1500).map(|id| entry(id, 1)).collect();
    assert_eq!(list_jobs_page(small.clone(), 0, 5000).jobs.len(), LIST_JOBS_PAGE_MAX as usize);
    assert_eq!(list_jobs_page(small, 1490, 0).jobs.len(), 10);
}

#[tokio::test(flavor = "current_thread")]
async fn errors_map_to_status_codes() {
    let server = start(None);
    let mut c = client(server.local_addr()).await;

    // validation: the same words as fanin_proto's JobSpec::validate
    let err = c.admit_job(admit(spec(1, vec![]))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(err.message(), "job 1: members is empty (a job needs at least one source)");
    let err = c.admit_job(admit(spec(1, vec![0, 0]))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("listed twice"), "{}", err.message());
    let mut bad = spec(1, vec![0]);
    bad.block_grad_max = 0;
    assert_eq!(c.admit_job(admit(bad)).await.unwrap_err().code(), Code::InvalidArgument);
    // member ids beyond u16 are rejected, not truncated (65536 would be 0)
    let err = c.admit_job(admit(spec(1, vec![1, 65536]))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("65536"), "{}", err.message());
    let mut bad = spec(1, vec![0]);
    bad.mode = 7;
    assert_eq!(c.admit_job(admit(bad)).await.unwrap_err().code(), Code::InvalidArgument);
    let err = c.admit_job(pb::AdmitJobRequest { spec: None }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(c.list_jobs(pb::ListJobsRequest::default()).await.unwrap().into_inner().jobs.is_empty());

    // duplicate
    c.admit_job(admit(spec(1, vec![0, 1]))).await.unwrap();
    let err = c.admit_job(admit(spec(1, vec![0, 1]))).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    assert_eq!(err.message(), "job 1 already exists");

    // out of memory: 2 * 1024 slots * 1024 elements * 4 bytes > 1 MiB
    let mut big = spec(2, vec![0]);
    big.block_cnt_max = 1024;
    big.block_grad_max = 1024;
    let err = c.admit_job(admit(big.clone())).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(err.message().contains("aggregation memory"), "{}", err.message());
    // a forwarding job holds no memory, so the same shape fits
    big.mode = PbMode::Forward as i32;
    c.admit_job(admit(big)).await.unwrap();

    // unknown job
    let err = c.remove_job(pb::RemoveJobRequest { job_id: 77 }).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(err.message(), "job 77 is not on this switch");

    drop(c);
    stop(server).await;
}

#[tokio::test(flavor = "current_thread")]
async fn token_is_required_when_set() {
    let server = start(Some("s3cret"));
    let mut c = client(server.local_addr()).await;

    let err = c.get_info(pb::GetInfoRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    let mut req = Request::new(pb::ListJobsRequest::default());
    req.metadata_mut().insert("authorization", "Bearer wrong".parse().unwrap());
    assert_eq!(c.list_jobs(req).await.unwrap_err().code(), Code::Unauthenticated);

    let mut req = Request::new(pb::ListJobsRequest::default());
    req.metadata_mut().insert("authorization", "s3cret".parse().unwrap());
    assert_eq!(c.list_jobs(req).await.unwrap_err().code(), Code::Unauthenticated, "scheme required");

    // mutating calls are refused too, and have no effect
    let err = c.admit_job(admit(spec(1, vec![0]))).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    let mut req = Request::new(pb::GetInfoRequest {});
    req.metadata_mut().insert("authorization", "Bearer s3cret".parse().unwrap());
    assert_eq!(c.get_info(req).await.unwrap().into_inner().api_version, "v1");

    let mut req = Request::new(pb::ListJobsRequest::default());
    req.metadata_mut().insert("authorization", "Bearer s3cret".parse().unwrap());
    assert!(c.list_jobs(req).await.unwrap().into_inner().jobs.is_empty());

    drop(c);
    stop(server).await;
}

#[test]
fn spawn_reports_address_in_use_synchronously() {
    let first = start(None);
    let err = spawn(first.local_addr(), Arc::new(FakePlane::default()), None).unwrap_err();
    match &err {
        ControlError::Bind { addr, source } => {
            assert_eq!(*addr, first.local_addr());
            assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
        }
        other => panic!("expected a bind error, got {other:?}"),
    }
    assert!(err.to_string().contains(&first.local_addr().to_string()), "{err}");
    first.shutdown().unwrap();
}

#[test]
fn shutdown_is_not_held_up_by_a_stalled_client() {
    let server = start(None);
    let addr = server.local_addr();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut c = rt.block_on(client(addr));
    rt.block_on(c.get_info(pb::GetInfoRequest {})).unwrap();

    // the client's runtime is not running: it cannot take part in a graceful
    // close, so shutdown must give up on it after the grace period
    let t = std::time::Instant::now();
    server.shutdown().unwrap();
    let took = t.elapsed();
    assert!(took < fanin_control::SHUTDOWN_GRACE * 3, "shutdown took {took:?}");
    assert!(rt.block_on(c.get_info(pb::GetInfoRequest {})).is_err());
    // the port is free again
    drop(spawn(addr, Arc::new(FakePlane::default()), None).unwrap());
}

#[tokio::test(flavor = "current_thread")]
async fn serve_runs_inside_a_callers_runtime() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(fanin_control::serve_listener(
        listener,
        Arc::new(FakePlane::default()),
        None,
        async move {
            let _ = stopped.await;
        },
    ));
    let mut c = client(addr).await;
    let mut s = spec(4, vec![0, 1]);
    s.mode = PbMode::Forward as i32;
    c.admit_job(admit(s)).await.unwrap();
    let jobs = c.list_jobs(pb::ListJobsRequest::default()).await.unwrap().into_inner().jobs;
    assert_eq!(jobs[0].mode, PbMode::Forward as i32);
    drop(c);
    // serve() on a taken address fails with a bind error
    let err = fanin_control::serve(addr, Arc::new(FakePlane::default()), None, async {}).await.unwrap_err();
    assert!(matches!(err, ControlError::Bind { .. }), "{err:?}");
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}

/// A spec as the switch lists it: the failure policy resolved (unset: fail,
/// or degrade for a job with aging).
fn listed(mut spec: pb::JobSpec) -> pb::JobSpec {
    let default = if spec.block_exp_ms > 0 { pb::FailurePolicy::Degrade } else { pb::FailurePolicy::Fail };
    spec.on_failure.get_or_insert(default as i32);
    spec
}

#[tokio::test]
async fn tree_roles_are_checked_kept_and_updated() {
    let server = start(None);
    let mut c = client(server.local_addr()).await;
    let tree = |addr: &str, rank: u32| pb::TreeRole { parent_addr: addr.into(), parent_shards: 2, rank };
    let mut leaf = spec(3, vec![0, 1]);
    leaf.workers = Some(4);
    leaf.tree = Some(tree("10.1.0.1:9000", 2048));
    c.admit_job(admit(leaf.clone())).await.unwrap();
    let jobs = c.list_jobs(pb::ListJobsRequest::default()).await.unwrap().into_inner().jobs;
    assert_eq!(jobs, vec![listed(leaf.clone())]);
    // a worker rank for a switch, or an address that is not one: refused
    for bad in [tree("10.1.0.1:9000", 5), tree("nowhere", 2048)] {
        let mut s = spec(4, vec![0]);
        s.tree = Some(bad);
        assert_eq!(c.admit_job(admit(s)).await.unwrap_err().code(), Code::InvalidArgument);
    }
    // membership changes in place; fixed fields do not
    let mut grown = leaf.clone();
    grown.members = vec![0, 1, 2];
    grown.tree = None;
    c.update_job(pb::UpdateJobRequest { spec: Some(grown.clone()), awaiting: vec![2] }).await.unwrap();
    let jobs = c.list_jobs(pb::ListJobsRequest::default()).await.unwrap().into_inner().jobs;
    assert_eq!(jobs, vec![listed(grown.clone())]);
    let mut resized = grown.clone();
    resized.block_cnt_max = 16;
    let err = c.update_job(pb::UpdateJobRequest { spec: Some(resized), awaiting: vec![] }).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    let err = c.update_job(pb::UpdateJobRequest { spec: Some(spec(99, vec![0])), awaiting: vec![] }).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    stop(server).await;
}
