//! Arbitrary datagrams into the key-value machines: the switch program (a
//! task with short slots, one coalesced group and shadow copies), a sender
//! and a receiver of that task.
//! Input: a sequence of [len: u8][who: u8][bytes...] records; `who` picks
//! the source of the datagram at the switch (a sender channel or the
//! receiver) and which host machine also gets it.
//! Oracles: no panic; everything the machines emit is a valid packet; every
//! datagram the switch saw lands in exactly one outcome counter; memory use
//! never exceeds what was admitted.
#![no_main]

use fanin_proto::kv::loopback::Node;
use fanin_proto::kv::{
    KvReceiver, KvSender, KvSwitch, KvSwitchConfig, KvTaskSpec, Layout, ReceiverConfig, SenderConfig,
};
use fanin_proto::{Time, VecTransmit};
use fanin_wire::kv::Packet;
use libfuzzer_sys::fuzz_target;

const LAYOUT: Layout = Layout { short_slots: 2, medium_groups: 1, medium_parts: 2 };

fn check_emitted<A>(out: &mut VecTransmit<A>) {
    for (_, bytes) in out.drain() {
        Packet::new_checked(&bytes[..]).expect("machines emit only valid packets");
    }
}

fuzz_target!(|data: &[u8]| {
    let mut sw = KvSwitch::new(KvSwitchConfig { memory_limit: 64, tenant_limit: 64, ..Default::default() });
    let mut spec = KvTaskSpec::new(1, Node::Receiver, LAYOUT, 4);
    spec.window = 4;
    spec.max_channels = 2;
    sw.add_task(Time::ZERO, spec).unwrap();
    let mut tx = KvSender::new(SenderConfig::new(1, 1, LAYOUT), Time::ZERO).unwrap();
    for k in [&b"a"[..], b"medium-key", b"a-key-too-long-for-any-slot"] {
        tx.push(k, 1).unwrap();
    }
    tx.finish();
    let mut rx = KvReceiver::new(ReceiverConfig::new(1, LAYOUT, 4, 1), Time::ZERO).unwrap();
    let mut out = VecTransmit::new();
    let mut host_out = VecTransmit::new();
    let (mut rest, mut t, mut fed) = (data, 0u64, 0u64);
    while rest.len() >= 2 {
        let (len, who) = (rest[0] as usize, rest[1]);
        rest = &rest[2..];
        let (dgram, tail) = rest.split_at(len.min(rest.len()));
        rest = tail;
        t += 10_000;
        let now = Time::from_nanos(t);
        let from = if who & 1 == 0 { Node::Receiver } else { Node::Sender((who >> 1) as usize % 3) };
        sw.handle_datagram(now, from, dgram, &mut out);
        fed += 1;
        check_emitted(&mut out);
        tx.handle_datagram(now, dgram);
        rx.handle_datagram(now, dgram);
        tx.handle_timeout(now);
        rx.handle_timeout(now);
        sw.handle_timeout(now);
        tx.poll_transmit(now, &mut host_out);
        rx.poll_transmit(now, &mut host_out);
        check_emitted(&mut host_out);
        while tx.poll_event().is_some() {}
        while rx.poll_event().is_some() {}
        assert!(sw.memory_used() <= 64);
    }
    let c = sw.counters();
    assert_eq!(c.rx_datagrams, fed);
    assert_eq!(c.rx_datagrams, c.outcomes());
});
