//! The real daemon (in-process threads, real UDP sockets on 127.0.0.1) and
//! real worker sessions, with injected loss.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fanin_host::{HostError, Session, SessionOptions, MAX_LANES};
use fanin_proto::fault::SplitMix64;
use fanin_proto::host::{SessionError, Tensor};
use fanin_proto::job::JobMode;
use fanin_switch::{DaemonConfig, FaultConfig, JobConfig, Listen, SwitchHandle};
use fanin_wire::value::NackReason;

fn job(job_id: u32, sources: u16, mode: JobMode) -> JobConfig {
    JobConfig {
        job_id,
        members: None,
        sources: Some(sources),
        block_cnt_max: 64,
        block_grad_max: 1024,
        block_exp_ms: 0,
        slow_after_windows: 2,
        mode,
        workers: 0,
        key: None,
        on_failure: Default::default(),
        member_timeout_ms: 0,
        rate_limit: None,
        result_group: None,
        quorum: 0,
    }
}

fn start(shards: u16, loss: f64, jobs: Vec<JobConfig>) -> SwitchHandle {
    let config = DaemonConfig {
        data_addr: "127.0.0.1:0".parse().unwrap(),
        shards,
        control_addr: Listen::Off,
        metrics_addr: Listen::At("127.0.0.1:0".parse().unwrap()),
        faults: FaultConfig { ingress_drop: loss, egress_drop: loss / 2.0, seed: 11, ..Default::default() },
        jobs,
        ..DaemonConfig::default()
    };
    SwitchHandle::start(config).expect("switch starts")
}

/// The switch's counters once `ready` holds of them (within 2 s): a shard
/// publishes its counters after it sends a batch, so a worker can hold its
/// last result before the counter that sent it is visible.
fn counters_when(sw: &SwitchHandle, ready: impl Fn(&fanin_proto::switch::Counters) -> bool) -> fanin_proto::switch::Counters {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let c = sw.core().counters();
        if ready(&c) || Instant::now() > deadline {
            return c;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn options(addr: SocketAddr, job: u32, rank: u16, loss: f64) -> SessionOptions {
    let mut o = SessionOptions::new(addr, job, rank);
    o.send_drop = loss;
    o.seed = rank as u64 + 1;
    o.session.rto_initial = Duration::from_millis(5);
    o.session.rto_min = Duration::from_millis(2);
    o
}

fn inputs_i32(rank: u16, len: usize) -> Vec<i32> {
    let mut r = SplitMix64::new(rank as u64 * 7919 + 1);
    (0..len).map(|_| r.next_u64() as i32).collect()
}

fn inputs_f32(rank: u16, len: usize) -> Vec<f32> {
    let mut r = SplitMix64::new(rank as u64 * 104_729 + 3);
    (0..len).map(|i| ((r.next_f64() - 0.5) * 2f64.powi((i % 31) as i32 - 15)) as f32).collect()
}

#[test]
fn four_workers_int32_and_float32_with_loss_and_two_shards() {
    let sw = start(2, 0.05, vec![job(1, 4, JobMode::Aggregate)]);
    let addr = sw.data_addr();
    let len = 300_001;
    let handles: Vec<_> = (0..4u16)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut s = Session::connect(options(addr, 1, rank, 0.05)).unwrap();
                let a = s.allreduce(Tensor::I32(inputs_i32(rank, len))).unwrap();
                let b = s.allreduce(Tensor::F32(inputs_f32(rank, len))).unwrap();
                (a, b)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let mut expected = vec![0i32; len];
    for r in 0..4 {
        for (e, x) in expected.iter_mut().zip(inputs_i32(r, len)) {
            *e = e.wrapping_add(x);
        }
    }
    let first_f = &results[0].1.tensor;
    for (a, b) in &results {
        assert_eq!(a.tensor, Tensor::I32(expected.clone()));
        assert_eq!(&b.tensor, first_f, "float results are bit-identical across workers");
    }
    let Tensor::F32(got) = first_f else { panic!() };
    let ins: Vec<Vec<f32>> = (0..4).map(|r| inputs_f32(r, len)).collect();
    for (blk, chunk) in got.chunks(1024).enumerate() {
        let range = blk * 1024..blk * 1024 + chunk.len();
        let e = ins.iter().map(|v| fanin_proto::bfp::block_exponent(&v[range.clone()]).unwrap()).max().unwrap();
        let bound = fanin_proto::bfp::error_bound(e, 4);
        for (i, g) in range.zip(chunk) {
            let exact: f64 = ins.iter().map(|v| v[i] as f64).sum();
            assert!((*g as f64 - exact).abs() <= bound + (g.abs() * f32::EPSILON) as f64);
        }
    }
    let retrans: u64 = results.iter().map(|(a, b)| a.retransmissions + b.retransmissions).sum();
    assert!(retrans > 0, "5% loss must show as retransmissions");
    let c = sw.core().counters();
    assert!(c.duplicate + c.results_resent > 0);
    assert_eq!(c.malformed_total(), 0);
    let metrics = sw.core().render_metrics();
    assert!(metrics.contains("counter=\"accepted\""));
}

#[test]
fn forward_mode_reflects_through_the_same_daemon() {
    let sw = start(1, 0.0, vec![job(2, 2, JobMode::Forward)]);
    let mut s = Session::connect(options(sw.data_addr(), 2, 1, 0.0)).unwrap();
    let input = inputs_i32(1, 5000);
    let out = s.allreduce(Tensor::I32(input.clone())).unwrap();
    assert_eq!(out.tensor, Tensor::I32(input), "NoAggr returns each worker's own data");
    assert!(counters_when(&sw, |c| c.forwarded >= 5).forwarded >= 5);
}

#[test]
fn unknown_job_and_non_member_fail_fast_with_the_reason() {
    let sw = start(1, 0.0, vec![job(1, 2, JobMode::Aggregate)]);
    let t = Instant::now();
    let err = Session::connect(options(sw.data_addr(), 42, 0, 0.0)).err().unwrap();
    assert!(matches!(err, HostError::Session(SessionError::Refused { reason: NackReason::UnknownJob, .. })), "{err}");
    assert!(err.to_string().contains("unknown job"));
    let err = Session::connect(options(sw.data_addr(), 1, 9, 0.0)).err().unwrap();
    assert!(err.to_string().contains("not a member"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2));
}

#[test]
fn dead_switch_fails_within_the_join_timeout() {
    // a port where nothing listens
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = sock.local_addr().unwrap();
    drop(sock);
    let mut o = options(addr, 1, 0, 0.0);
    o.session.join_timeout = Duration::from_millis(400);
    let t = Instant::now();
    let err = Session::connect(o).err().unwrap();
    // the host answered "port unreachable": the error says nothing listens
    assert!(matches!(err, HostError::Session(SessionError::SwitchGone { .. })), "{err}");
    assert!(err.to_string().contains("nothing listens on the switch's port"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2));
}

#[test]
fn switch_dying_mid_allreduce_fails_the_worker_after_dead_after() {
    let sw = start(1, 0.0, vec![job(1, 1, JobMode::Aggregate)]);
    let mut o = options(sw.data_addr(), 1, 0, 0.0);
    o.session.dead_after = Duration::from_millis(500);
    let mut s = Session::connect(o).unwrap();
    sw.shutdown();
    // the switch is gone: bounded failure, no hang
    let t = Instant::now();
    let err = s.allreduce(Tensor::I32(vec![1; 10_000])).unwrap_err();
    assert!(matches!(err, HostError::Session(SessionError::SwitchSilent { .. })), "{err}");
    assert!(t.elapsed() < Duration::from_secs(3));
}

/// The same with two lanes on two shards: the session reads every lane
/// socket's error queue and fails, bounded, without spinning on one.
#[test]
fn a_switch_gone_mid_allreduce_fails_a_worker_with_two_lanes() {
    let sw = start(2, 0.0, vec![job(1, 1, JobMode::Aggregate)]);
    let mut o = SessionOptions { lanes: 2, ..options(sw.data_addr(), 1, 0, 0.0) };
    o.session.dead_after = Duration::from_millis(500);
    let mut s = Session::connect(o).unwrap();
    assert_eq!(s.lanes(), 2);
    sw.shutdown();
    let t = Instant::now();
    let err = s.allreduce(Tensor::I32(vec![1; 100_000])).unwrap_err();
    assert!(
        matches!(err, HostError::Session(SessionError::SwitchGone { .. } | SessionError::SwitchSilent { .. })),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(s.stats().port_unreachable > 0);
}

#[test]
fn a_job_whose_worker_vanishes_does_not_disturb_another_job() {
    let sw = start(1, 0.0, vec![job(1, 2, JobMode::Aggregate), job(2, 2, JobMode::Aggregate)]);
    let addr = sw.data_addr();
    // job 1: both workers join (the round starts once both did), then
    // worker 1 vanishes and worker 0 sends alone
    let mut o = options(addr, 1, 0, 0.0);
    o.session.dead_after = Duration::from_millis(700);
    let vanishing = std::thread::spawn(move || drop(Session::connect(options(addr, 1, 1, 0.0)).unwrap()));
    let lonely = std::thread::spawn(move || {
        let mut s = Session::connect(o).unwrap();
        s.allreduce(Tensor::I32(vec![3; 50_000])).unwrap_err()
    });
    vanishing.join().unwrap();
    let workers: Vec<_> = (0..2u16)
        .map(|r| {
            std::thread::spawn(move || {
                let mut s = Session::connect(options(addr, 2, r, 0.0)).unwrap();
                s.allreduce(Tensor::I32(vec![r as i32 + 1; 50_000])).unwrap()
            })
        })
        .collect();
    for w in workers {
        assert_eq!(w.join().unwrap().tensor, Tensor::I32(vec![3; 50_000]));
    }
    assert!(matches!(lonely.join().unwrap(), HostError::Session(SessionError::SwitchSilent { .. })));
}

#[test]
fn a_keyed_job_on_two_shards_with_loss_sums_exactly_and_refuses_nothing_honest() {
    let job_key = fanin_proto::auth::Key([0x3c; 16]);
    let keyed = JobConfig { key: Some(job_key.to_hex()), ..job(1, 3, JobMode::Aggregate) };
    let sw = start(2, 0.05, vec![keyed]);
    let addr = sw.data_addr();
    let len = 100_003;
    let handles: Vec<_> = (0..3u16)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut o = options(addr, 1, rank, 0.05);
                o.session.auth_key = Some(fanin_proto::auth::derive_member_key(&job_key, 1, rank));
                let mut s = Session::connect(o).unwrap();
                let out = s.allreduce(Tensor::I32(inputs_i32(rank, len))).unwrap();
                // a keyed reduce-scatter: the withheld results are sealed too
                s.keep_only(shard(rank, 3, len));
                let Tensor::I32(part) = s.allreduce(Tensor::I32(inputs_i32(rank, len))).unwrap().tensor else { panic!() };
                let Tensor::I32(whole) = &out.tensor else { panic!() };
                assert_eq!(part[shard(rank, 3, len)], whole[shard(rank, 3, len)]);
                (out, s.auth_stats())
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let mut expected = vec![0i32; len];
    for r in 0..3 {
        for (e, x) in expected.iter_mut().zip(inputs_i32(r, len)) {
            *e = e.wrapping_add(x);
        }
    }
    for (out, stats) in &results {
        assert_eq!(out.tensor, Tensor::I32(expected.clone()));
        // retransmissions carry fresh numbers, so loss never looks like a replay
        assert_eq!((stats.bad_tag, stats.unsealed), (0, 0), "{stats:?}");
    }
    let c = sw.core().counters();
    assert_eq!((c.auth_bad_tag, c.auth_unsealed, c.auth_replayed), (0, 0, 0), "{c:?}");
    assert!(c.results_without_data > 0, "{c:?}");
}

/// A free UDP port on loopback for a result group (the group address keeps
/// tests apart; the port only has to be unused by unicast sockets).
fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Results on a multicast group through the real daemon: two workers listen
/// on the job's result group and one does not, under loss on every path.
/// Everyone gets the same, correct sum; the listeners' results came on the
/// group (one datagram per block for both), the other's by unicast.
#[test]
fn results_on_a_multicast_group_reach_listeners_once_and_others_by_unicast() {
    let group = std::net::SocketAddrV4::new(std::net::Ipv4Addr::new(239, 77, 2, 1), free_port());
    let spec = JobConfig { result_group: Some(group), ..job(5, 3, JobMode::Aggregate) };
    let sw = start(2, 0.02, vec![spec]);
    let addr = sw.data_addr();
    let len = 200_003;
    let handles: Vec<_> = (0..3u16)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut o = options(addr, 5, rank, 0.02);
                o.result_group = (rank != 1).then_some(group);
                let mut s = Session::connect(o).unwrap();
                assert_eq!(s.params().results_on_group, rank != 1, "rank {rank}");
                let a = s.allreduce(Tensor::I32(inputs_i32(rank, len))).unwrap();
                let b = s.allreduce(Tensor::F32(inputs_f32(rank, len))).unwrap();
                (a, b, s.stats().clone())
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let mut expected = vec![0i32; len];
    for r in 0..3 {
        for (e, x) in expected.iter_mut().zip(inputs_i32(r, len)) {
            *e = e.wrapping_add(x);
        }
    }
    for (rank, (a, b, stats)) in results.iter().enumerate() {
        assert_eq!(a.tensor, Tensor::I32(expected.clone()), "rank {rank}");
        assert_eq!(b.tensor, results[0].1.tensor, "float results are bit-identical across workers");
        if rank == 1 {
            assert_eq!(stats.datagrams_from_group, 0);
        } else {
            // 2 x 196 blocks, most of them (all but a lost few) from the group
            assert!(stats.datagrams_from_group > 300, "rank {rank}: {stats:?}");
        }
    }
    let c = sw.core().counters();
    let blocks = 2 * len.div_ceil(1024) as u64;
    assert!(c.results_to_group >= blocks, "{} group results for {blocks} blocks", c.results_to_group);
    assert!(c.results_sent >= blocks && c.results_sent < 2 * blocks, "unicast results only for rank 1: {}", c.results_sent);
    assert_eq!(c.malformed_total(), 0);
}

#[test]
fn a_result_group_that_is_not_multicast_is_refused_clearly() {
    let sw = start(1, 0.0, vec![job(6, 1, JobMode::Aggregate)]);
    let mut o = options(sw.data_addr(), 6, 0, 0.0);
    o.result_group = Some("127.0.0.1:4000".parse().unwrap());
    let err = Session::connect(o).err().expect("refused");
    assert!(err.to_string().contains("result_group 127.0.0.1:4000: not an IPv4 multicast group"), "{err}");
    // a worker listening on a group the job does not have gets unicast
    let mut o = options(sw.data_addr(), 6, 0, 0.0);
    o.result_group = Some(std::net::SocketAddrV4::new(std::net::Ipv4Addr::new(239, 77, 2, 2), free_port()));
    let mut s = Session::connect(o).unwrap();
    assert!(!s.params().results_on_group);
    let out = s.allreduce(Tensor::I32(vec![3; 5000])).unwrap();
    assert_eq!(out.tensor, Tensor::I32(vec![3; 5000]));
    assert_eq!(s.stats().datagrams_from_group, 0);
}

/// Rank `r`'s shard of a reduce-scatter of `len` elements over `n` ranks.
fn shard(r: u16, n: u16, len: usize) -> std::ops::Range<usize> {
    let k = len / n as usize;
    r as usize * k..if r + 1 == n { len } else { (r as usize + 1) * k }
}

#[test]
fn reduce_scatter_gives_each_rank_its_shard_and_withholds_the_rest() {
    // Shards of 25 000 elements do not line up with 1024-element blocks, so
    // the blocks across a boundary have two owners. First without loss (the
    // counters are exact), then with loss, duplication of resends and two
    // shards: every kept element is the allreduce's, bit for bit.
    for (loss, shards) in [(0.0, 1), (0.05, 2)] {
        let n = 4u16;
        let len = 100_000;
        let sw = start(shards, loss, vec![job(1, n, JobMode::Aggregate)]);
        let addr = sw.data_addr();
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                std::thread::spawn(move || {
                    let mut s = Session::connect(options(addr, 1, rank, loss)).unwrap();
                    let full = s.allreduce(Tensor::F32(inputs_f32(rank, len))).unwrap();
                    s.keep_only(shard(rank, n, len));
                    let scattered = s.allreduce(Tensor::F32(inputs_f32(rank, len))).unwrap();
                    s.keep_only(shard(rank, n, len));
                    let ints = s.allreduce(Tensor::I32(inputs_i32(rank, len))).unwrap();
                    // the range was for one call only: this one is whole again
                    let again = s.allreduce(Tensor::I32(inputs_i32(rank, len))).unwrap();
                    (full, scattered, ints, again, s.elems_per_packet() as usize)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let mut expected = vec![0i32; len];
        for r in 0..n {
            for (e, x) in expected.iter_mut().zip(inputs_i32(r, len)) {
                *e = e.wrapping_add(x);
            }
        }
        let per = results[0].4;
        for (rank, (full, scattered, ints, again, _)) in results.iter().enumerate() {
            let keep = shard(rank as u16, n, len);
            let (Tensor::F32(f), Tensor::F32(s)) = (&full.tensor, &scattered.tensor) else { panic!() };
            assert_eq!(f[keep.clone()], s[keep.clone()], "rank {rank}: its shard is the allreduce's");
            let Tensor::I32(i) = &ints.tensor else { panic!() };
            assert_eq!(i[keep.clone()], expected[keep.clone()]);
            // outside its blocks the in-place tensor still holds its input
            let first_unowned = keep.end.div_ceil(per) * per;
            if first_unowned < len {
                assert_eq!(i[first_unowned..], inputs_i32(rank as u16, len)[first_unowned..], "rank {rank}");
            }
            assert_eq!(again.tensor, Tensor::I32(expected.clone()));
        }
        let blocks = len.div_ceil(per);
        let c = counters_when(&sw, |c| c.blocks_completed >= 4 * blocks as u64);
        let owners: usize = (0..blocks)
            .map(|b| (0..n).filter(|&r| { let k = shard(r, n, len); b * per < k.end && k.start < (b + 1) * per }).count())
            .sum();
        let withheld = 2 * (blocks * n as usize - owners) as u64; // two reduce-scatters
        if loss == 0.0 {
            assert_eq!(c.blocks_completed, 4 * blocks as u64, "{c:?}");
            assert!(c.results_without_data >= withheld && c.results_without_data <= withheld + c.results_resent, "{c:?}");
        } else {
            assert!(c.results_without_data >= withheld / 2, "{c:?}");
        }
        assert_eq!(c.malformed_total(), 0);
    }
}

#[test]
fn a_keep_range_outside_the_tensor_is_refused_and_forgotten() {
    let sw = start(1, 0.0, vec![job(1, 1, JobMode::Aggregate)]);
    let mut s = Session::connect(options(sw.data_addr(), 1, 0, 0.0)).unwrap();
    s.keep_only(10..20);
    let err = s.allreduce(Tensor::I32(vec![1; 5])).unwrap_err();
    assert!(err.to_string().contains("not within the tensor's 5 elements"), "{err}");
    assert_eq!(s.allreduce(Tensor::I32(vec![3; 5])).unwrap().tensor, Tensor::I32(vec![3; 5]));
}

/// The wrapping sum of every rank's `inputs_i32`.
fn expected_i32(ranks: u16, len: usize) -> Tensor {
    let mut sum = vec![0i32; len];
    for r in 0..ranks {
        for (e, x) in sum.iter_mut().zip(inputs_i32(r, len)) {
            *e = e.wrapping_add(x);
        }
    }
    Tensor::I32(sum)
}

// Send lanes (SessionOptions::lanes): a worker's datagrams leave from
// several sockets and threads, one per group of switch shards, and the
// sums are the same.

/// Four workers with three lanes each on a four-shard switch, 5 % loss on
/// every path: lane 0 carries shards 0 and 3, lanes 1 and 2 one shard each,
/// every lane's socket gets the replies of its shards, and the sums are
/// exact, call after call.
#[test]
fn three_lanes_on_four_shards_sum_exactly_under_loss_and_each_lane_carries_its_shards() {
    let sw = start(4, 0.05, vec![job(1, 4, JobMode::Aggregate)]);
    let addr = sw.data_addr();
    let len = 200_003;
    let handles: Vec<_> = (0..4u16)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut s = Session::connect(SessionOptions { lanes: 3, ..options(addr, 1, rank, 0.05) }).unwrap();
                assert_eq!(s.lanes(), 3);
                
                let outs: Vec<_> = (0..3).map(|_| s.allreduce(Tensor::I32(inputs_i32(rank, len))).unwrap()).collect();
                (outs, s.stats().clone())
            })
        })
        .collect();
    let want = expected_i32(4, len);
    for h in handles {
        let (outs, stats) = h.join().unwrap();
        for out in &outs {
            assert_eq!(out.tensor, want);
        }
        let sent = &stats.sent_by_lane;
        assert_eq!(sent.len(), 3, "{stats:?}");
        assert_eq!(sent.iter().sum::<u64>(), stats.datagrams_sent);
        // lane 0 has two shards of four, the others one each (a block's
        // shard is spread evenly; retransmissions blur it a little)
        let total = stats.datagrams_sent as f64;
        assert!((sent[0] as f64 / total - 0.5).abs() < 0.1, "{sent:?}");
        assert!((sent[1] as f64 / total - 0.25).abs() < 0.1, "{sent:?}");
        assert!((sent[2] as f64 / total - 0.25).abs() < 0.1, "{sent:?}");
        // a shard answers the address it heard from: each lane's socket
        // gets its own shards' results
        let got = &stats.received_by_lane;
        assert_eq!(got.len(), 3, "{stats:?}");
        assert!(got.iter().all(|&n| n as f64 > 0.15 * stats.datagrams_received as f64), "{got:?}");
    }
    assert_eq!(sw.core().counters().malformed_total(), 0);
}

/// A keyed job with its results on a multicast group, two lanes: every
/// shard keeps a replay window per member whichever socket the member
/// sends from, so nothing honest is refused, and the listeners' results
/// come on the group.
#[test]
fn two_lanes_in_a_keyed_job_with_results_on_a_group_refuse_nothing_honest() {
    let job_key = fanin_proto::auth::Key([0x5a; 16]);
    let group = std::net::SocketAddrV4::new(std::net::Ipv4Addr::new(239, 77, 3, 2), free_port());
    let spec = JobConfig { key: Some(job_key.to_hex()), result_group: Some(group), ..job(2, 3, JobMode::Aggregate) };
    let sw = start(2, 0.02, vec![spec]);
    let addr = sw.data_addr();
    let len = 100_003;
    let handles: Vec<_> = (0..3u16)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut o = SessionOptions { lanes: 2, ..options(addr, 2, rank, 0.02) };
                o.session.auth_key = Some(fanin_proto::auth::derive_member_key(&job_key, 2, rank));
                o.result_group = Some(group);
                let mut s = Session::connect(o).unwrap();
                let a = s.allreduce(Tensor::I32(inputs_i32(rank, len))).unwrap();
                let b = s.allreduce(Tensor::I32(inputs_i32(rank, len))).unwrap();
                (a, b, s.stats().clone(), s.auth_stats())
            })
        })
        .collect();
    let want = expected_i32(3, len);
    for h in handles {
        let (a, b, stats, auth) = h.join().unwrap();
        assert_eq!((a.tensor, b.tensor), (want.clone(), want.clone()));
        assert_eq!((auth.bad_tag, auth.unsealed), (0, 0), "{auth:?}");
        assert!(stats.sent_by_lane.iter().all(|&n| n > 0), "{stats:?}");
        assert!(stats.datagrams_from_group > 100, "{stats:?}");
    }
    let c = sw.core().counters();
    assert_eq!((c.auth_bad_tag, c.auth_unsealed, c.auth_replayed), (0, 0, 0), "{c:?}");
}

/// More lanes than shards would carry nothing: a session takes at most the
/// job's shard count. A count out of range is refused before anything is
/// sent, saying what is allowed.
#[test]
fn lanes_are_capped_at_the_shard_count_and_a_bad_count_is_refused() {
    let sw = start(2, 0.0, vec![job(3, 1, JobMode::Aggregate)]);
    let mut s = Session::connect(SessionOptions { lanes: 8, ..options(sw.data_addr(), 3, 0, 0.0) }).unwrap();
    assert_eq!(s.lanes(), 2);
    let Tensor::I32(out) = s.allreduce(Tensor::I32(vec![7; 5000])).unwrap().tensor else { panic!() };
    assert_eq!(out, vec![7; 5000]);
    for bad in [0, MAX_LANES + 1] {
        match Session::connect(SessionOptions { lanes: bad, ..options(sw.data_addr(), 3, 0, 0.0) }) {
            Err(HostError::Option(why)) => assert!(why.contains(&format!("lanes {bad} is not 1 to {MAX_LANES}")), "{why}"),
            other => panic!("lanes {bad}: {:?}", other.map(|_| ())),
        }
    }
}
