//! Property tests: key-value senders, the switch program and the receiver
//! over an in-memory network that loses, duplicates and reorders datagrams.
//! Every tuple must be aggregated exactly once: the receiver's results equal
//! a reference dictionary (sum, count, min, max per key), and the switch
//! region is released at the end.

use std::time::Duration;

use fanin_proto::kv::loopback::{LinkConfig, Loopback, Node, RunOutcome};
use fanin_proto::auth::Key;
use fanin_proto::kv::{
    channel_key, receiver_key, Aggregate, KvReceiver, KvResults, KvSender, KvSwitch, KvSwitchConfig, KvTaskSpec, Layout, ReceiverConfig, SenderConfig,
    ValueType,
};
use fanin_proto::Time;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    layout: Layout,
    aa_size: u32,
    shadow: bool,
    swap_threshold: u64,
    window: u32,
    streams: Vec<Vec<(Vec<u8>, i64)>>,
    link: LinkConfig,
    /// A keyed task (docs/security.md): every datagram sealed; the link's
    /// duplicates are then replays the switch and the hosts refuse.
    keyed: bool,
}

fn key(class: u8, id: u16) -> Vec<u8> {
    match class {
        0 => format!("{id}").into_bytes(),                       // short (<= 5 bytes)
        1 => format!("medium{id:05}").into_bytes(),              // 11 bytes
        _ => format!("long-key-bypassing-the-switch-{id}").into_bytes(),
    }
}

fn case() -> impl Strategy<Value = Case> {
    let layout = (0u8..4, 0u8..3, 2u8..4).prop_filter_map("non-empty layout", |(s, g, m)| {
        let l = Layout { short_slots: s, medium_groups: g, medium_parts: m };
        l.validate().ok().map(|_| l)
    });
    let tuple = (0u8..3, 0u16..40, -1000i64..1000).prop_map(|(c, id, v)| (key(c, id), v));
    let streams = prop::collection::vec(prop::collection::vec(tuple, 0..120), 1..4);
    let link = (0.0f64..0.2, 0.0f64..0.2, 0u64..20_000, any::<u64>())
        .prop_map(|(loss, duplicate, jitter_ns, seed)| LinkConfig { delay_ns: 1_000, jitter_ns, loss, duplicate, seed });
    (layout, 1u32..6, any::<bool>(), 1u64..8, 1u32..12, streams, link, any::<bool>()).prop_map(
        |(layout, aa_size, shadow, swap_threshold, window, streams, link, keyed)| Case {
            layout,
            aa_size,
            shadow,
            swap_threshold,
            window,
            streams,
            link,
            keyed,
        },
    )
}

fn reference(streams: &[Vec<(Vec<u8>, i64)>]) -> KvResults {
    let mut m = KvResults::default();
    for (k, v) in streams.iter().flatten() {
        m.entry(k.clone()).and_modify(|a| _ = a.merge(&Aggregate::of(*v), ValueType::Int64)).or_insert(Aggregate::of(*v));
    }
    m
}

fn run(case: &Case) -> Result<fanin_proto::kv::KvCounters, TestCaseError> {
    const TASK: u32 = 42;
    let mut sw = KvSwitch::new(KvSwitchConfig::default());
    let mut spec = KvTaskSpec::new(TASK, Node::Receiver, case.layout, case.aa_size);
    spec.shadow_copies = case.shadow;
    spec.window = case.window;
    let task_key = case.keyed.then_some(Key([0x5a; 16]));
    spec.key = task_key;
    sw.add_task(Time::ZERO, spec).unwrap();
    let senders = case
        .streams
        .iter()
        .enumerate()
        .map(|(i, stream)| {
            let mut c = SenderConfig::new(TASK, 100 + i as u16, case.layout);
            c.window = case.window;
            c.rto = Duration::from_micros(60);
            c.dead_after = Duration::from_secs(5);
            c.auth_key = task_key.map(|k| channel_key(&k, TASK, 100 + i as u16));
            c.seal_clock_us = 1_000 + i as u64;
            let mut s = KvSender::new(c, Time::ZERO).unwrap();
            for (k, v) in stream {
                s.push(k, *v).unwrap();
            }
            s.finish();
            s
        })
        .collect();
    let mut rc = ReceiverConfig::new(TASK, case.layout, case.aa_size, case.streams.len() as u16);
    rc.shadow_copies = case.shadow;
    rc.swap_threshold = Some(case.swap_threshold);
    rc.window = case.window;
    rc.rto = Duration::from_micros(60);
    rc.linger = Duration::from_millis(5);
    rc.auth_key = task_key.map(|k| receiver_key(&k, TASK));
    let mut lb = Loopback::new(sw, senders, KvReceiver::new(rc, Time::ZERO).unwrap(), case.link.clone());
    lb.wait_for_release = true;
    let outcome = lb.run(Time::from_secs_f64(4.0));
    prop_assert_eq!(outcome, RunOutcome::Finished);
    let expected = reference(&case.streams);
    prop_assert_eq!(lb.receiver.results(), &expected);
    prop_assert_eq!(lb.receiver.stats().undecodable, 0);
    let c = lb.switch.counters();
    prop_assert_eq!(c.rx_datagrams, c.outcomes());
    // Honest datagrams always verify; only the link's duplicates (replays)
    // are refused, and only on a keyed task.
    prop_assert_eq!(c.auth_bad_tag + c.auth_unsealed, 0);
    if !case.keyed || case.link.duplicate == 0.0 {
        prop_assert_eq!(c.auth_replayed, 0);
    }
    prop_assert_eq!(lb.switch.memory_used(), 0);
    // The switch saw every short/medium tuple on a first pass exactly once.
    let through_switch: u64 = case
        .streams
        .iter()
        .flatten()
        .filter(|(k, _)| !matches!(case.layout.classify(k), fanin_proto::kv::KeyClass::Long))
        .count() as u64;
    prop_assert_eq!(c.tuples_in, through_switch);
    Ok(c.clone())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn exactly_once_under_loss_duplication_and_reordering(case in case()) {
        run(&case)?;
    }
}

#[test]
fn heavy_loss_many_swaps() {
    let layout = Layout { short_slots: 4, medium_groups: 1, medium_parts: 2 };
    let streams: Vec<Vec<_>> = (0..3)
        .map(|s| (0..400).map(|i| (key((i % 3) as u8, ((i * 7 + s) % 50) as u16), i as i64 - 200)).collect())
        .collect();
    let link = LinkConfig { delay_ns: 1_000, jitter_ns: 30_000, loss: 0.3, duplicate: 0.3, seed: 7 };
    let case = Case { layout, aa_size: 3, shadow: true, swap_threshold: 3, window: 16, streams, link, keyed: false };
    run(&case).unwrap();
}

#[test]
fn heavy_loss_many_swaps_keyed() {
    let layout = Layout { short_slots: 4, medium_groups: 1, medium_parts: 2 };
    let streams: Vec<Vec<_>> = (0..3)
        .map(|s| (0..400).map(|i| (key((i % 3) as u8, ((i * 7 + s) % 50) as u16), i as i64 - 200)).collect())
        .collect();
    let link = LinkConfig { delay_ns: 1_000, jitter_ns: 30_000, loss: 0.3, duplicate: 0.3, seed: 11 };
    let case = Case { layout, aa_size: 3, shadow: true, swap_threshold: 3, window: 16, streams, link, keyed: true };
    let c = run(&case).unwrap();
    // The link's duplicates were refused as replays (retransmissions, with
    // fresh sequence numbers, still reach the kv window as duplicates), and
    // the result is still exact.
    assert!(c.auth_replayed > 100, "{c:?}");
}
