//! Traces of GOAT's on-path filtering (docs/goat.md, "On-path filtering"):
//! real switch programs wired into a small network, workers behind relays.

use super::*;
use crate::transmit::VecTransmit;
use fanin_wire::value::{read_elements, write_elements};

type Addr = u32; // worker n at 100 + n; switches below 100
const T0: Time = Time::ZERO;
const NODE: Addr = 20; // the aggregation node (here the parameter server)
const RELAY: Addr = 10;
const EDGE: Addr = 5; // a relay below RELAY

fn datagram(msg: MessageType, job: u32, src: u16, block: u32, values: &[i32]) -> Vec<u8> {
    let repr = Repr { block_id: block, grad_cnt: values.len() as u16, ..Repr::new(msg, job, src) };
    let mut buf = vec![0; repr.buffer_len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    write_elements(values, p.payload_mut());
    buf
}

fn contribution(job: u32, src: u16, block: u32, values: &[i32]) -> Vec<u8> {
    datagram(MessageType::Contribution, job, src, block, values)
}

/// Switches by address; a datagram to an address without a switch reached a host.
struct Net {
    switches: Vec<(Addr, ValueSwitch<Addr>)>,
    /// (host, message type, src_id, block, values) in arrival order.
    at_hosts: Vec<(Addr, MessageType, u16, u32, Vec<i32>)>,
    /// Every datagram sent, (from, to, bytes).
    wire: Vec<(Addr, Addr, Vec<u8>)>,
    /// The hosts that got a datagram CE-marked in its IP header, in order.
    marked_at_hosts: Vec<Addr>,
    /// A link (from, to) whose queue marks every datagram CE.
    marking: Option<(Addr, Addr)>,
}

impl Net {
    fn new(switches: Vec<(Addr, ValueSwitch<Addr>)>) -> Self {
        Self { switches, at_hosts: Vec::new(), wire: Vec::new(), marked_at_hosts: Vec::new(), marking: None }
    }

    fn sw(&mut self, addr: Addr) -> &mut ValueSwitch<Addr> {
        &mut self.switches.iter_mut().find(|(a, _)| *a == addr).unwrap().1
    }

    /// Deliver `bytes` from `from` to `to` and everything it causes.
    /// What a switch relays CE-marked stays marked on its way on.
    fn send(&mut self, from: Addr, to: Addr, bytes: Vec<u8>) {
        let mut queue = vec![(from, to, bytes, false)];
        while let Some((from, to, bytes, ce)) = queue.pop() {
            let ce = ce || self.marking == Some((from, to));
            self.wire.push((from, to, bytes.clone()));
            if let Some((_, sw)) = self.switches.iter_mut().find(|(a, _)| *a == to) {
                let mut out = VecTransmit::new();
                assert_eq!(sw.handle_datagram_ce(T0, from, &bytes, ce, &mut out), Verdict::Consumed);
                // (no trace here mixes relayed and answered datagrams)
                let marked = out.relayed_ce > 0;
                assert!(!marked || out.relayed_ce == out.len(), "some of one datagram's sends relayed marked");
                let sent: Vec<_> = out.drain().collect();
                // in order: the first sent is delivered first
                for (dest, b) in sent.into_iter().rev() {
                    queue.push((to, dest, b, marked));
                }
            } else {
                if ce {
                    self.marked_at_hosts.push(to);
                }
                let p = Packet::new_checked(&bytes[..]).expect("valid datagrams only");
                let repr = Repr::parse(&p).unwrap();
                let mut vals = vec![0; if repr.msg_type.carries_block() { repr.grad_cnt as usize } else { 0 }];
                read_elements(p.payload(), &mut vals);
                self.at_hosts.push((to, repr.msg_type, repr.src_id, repr.block_id, vals));
            }
        }
    }

    fn take_hosts(&mut self) -> Vec<(Addr, MessageType, u16, u32, Vec<i32>)> {
        std::mem::take(&mut self.at_hosts)
    }

    /// Datagrams that went from `a` to `b`.
    fn count(&self, a: Addr, b: Addr) -> usize {
        self.wire.iter().filter(|(f, t, _)| *f == a && *t == b).count()
    }
}

fn switch() -> ValueSwitch<Addr> {
    ValueSwitch::new(ShardConfig::single(1 << 30))
}

/// The node aggregates job 1 of workers 0, 1, 2; 0 and 1 are behind RELAY,
/// 2 sends to the node directly.
fn one_relay() -> Net {
    let mut node = switch();
    node.add_job(JobSpec::with_sources(1, 3, 4, 64)).unwrap();
    let mut relay = switch();
    relay.add_transit(1, vec![NODE], &[]).unwrap();
    Net::new(vec![(NODE, node), (RELAY, relay)])
}

#[test]
fn a_relay_forwards_up_unchanged_and_fans_each_result_out_once_per_source() {
    let mut net = one_relay();
    let c0 = contribution(1, 0, 0, &[1, 2]);
    net.send(100, RELAY, c0.clone());
    assert_eq!(net.wire.last().unwrap(), &(RELAY, NODE, c0), "the same bytes, to the node");
    net.send(101, RELAY, contribution(1, 1, 0, &[10, 20]));
    assert!(net.take_hosts().is_empty());
    net.send(102, NODE, contribution(1, 2, 0, &[100, 200]));
    // the node sends one copy to the relay for both sources behind it
    assert_eq!(net.count(NODE, RELAY), 1);
    assert_eq!(net.sw(NODE).counters().results_sent, 2, "relay + the direct worker");
    let mut got = net.take_hosts();
    got.sort_by_key(|h| h.0);
    // unchanged: a result's src_id is the node's incarnation tag
    let tag = net.sw(NODE).config().incarnation as u16;
    assert_eq!(
        got,
        vec![
            (100, MessageType::Result, tag, 0, vec![111, 222]),
            (101, MessageType::Result, tag, 0, vec![111, 222]),
            (102, MessageType::Result, tag, 0, vec![111, 222]),
        ]
    );
    let c = net.sw(RELAY).counters().clone();
    assert_eq!((c.transit_up, c.transit_down, c.accepted, c.rx_datagrams), (2, 2, 0, 3));
    assert_eq!(net.sw(RELAY).transit_sources(1), vec![(0, 100), (1, 101)]);
}

#[test]
fn a_ce_mark_passes_through_relays_both_ways() {
    // EDGE -> RELAY -> NODE for worker 0, worker 1 at RELAY, worker 2 at
    // the node: the queue from EDGE to RELAY marks worker 0's contribution,
    // and the node, past RELAY, reads the mark (the block's result is
    // marked for every member)
    let mut net = one_relay();
    let mut edge = switch();
    edge.add_transit(1, vec![RELAY], &[]).unwrap();
    net.switches.push((EDGE, edge));
    net.marking = Some((EDGE, RELAY));
    let c0 = contribution(1, 0, 0, &[1]);
    net.send(100, EDGE, c0.clone());
    assert_eq!(net.wire.last().unwrap(), &(RELAY, NODE, c0), "the same bytes");
    assert_eq!(net.sw(NODE).counters().ecn_ce, 1, "the mark reached the node");
    net.send(101, RELAY, contribution(1, 1, 0, &[2]));
    net.send(102, NODE, contribution(1, 2, 0, &[4]));
    assert_eq!(net.sw(NODE).counters().congestion_marked, 1);
    assert!(net.marked_at_hosts.is_empty(), "the results left the node unmarked");
    assert_eq!(net.take_hosts().len(), 3);
    // the queue from the node to RELAY marks a result: both workers behind
    // RELAY get it marked (EDGE passes it on to worker 0 marked), worker 2
    // not
    net.marking = Some((NODE, RELAY));
    for (src, from, to) in [(0u16, 100, EDGE), (1, 101, RELAY), (2, 102, NODE)] {
        net.send(from, to, contribution(1, src, 1, &[1]));
    }
    assert_eq!(net.take_hosts().len(), 3);
    net.marked_at_hosts.sort_unstable();
    assert_eq!(net.marked_at_hosts, vec![100, 101]);
    // nothing marks: nothing is relayed marked
    net.marking = None;
    net.marked_at_hosts.clear();
    for (src, from, to) in [(0u16, 100, EDGE), (1, 101, RELAY), (2, 102, NODE)] {
        net.send(from, to, contribution(1, src, 2, &[1]));
    }
    assert!(net.marked_at_hosts.is_empty());
    assert_eq!(net.sw(NODE).counters().ecn_ce, 1);
    assert_eq!(net.sw(RELAY).counters().ecn_ce, 2, "one each way");
}

#[test]
fn a_copy_of_a_result_is_dropped_and_a_retransmission_lets_the_answer_through() {
    let mut net = one_relay();
    for (src, from, to) in [(0u16, 100, RELAY), (1, 101, RELAY), (2, 102, NODE)] {
        net.send(from, to, contribution(1, src, 0, &[1]));
    }
    assert_eq!(net.take_hosts().len(), 3);
    // a copy of the same result (as a node that sends per member would)
    let result = net.wire.iter().find(|(f, t, _)| (*f, *t) == (NODE, RELAY)).unwrap().2.clone();
    net.send(NODE, RELAY, result.clone());
    assert!(net.take_hosts().is_empty());
    assert_eq!(net.sw(RELAY).counters().transit_duplicate, 1);
    // worker 1 lost it and asks again: the node answers the relay, which
    // passes the answer down (every source gets it; finished hosts drop it)
    net.send(101, RELAY, datagram(MessageType::Retransmission, 1, 1, 0, &[1]));
    assert_eq!(net.sw(NODE).counters().results_resent, 1);
    let got = net.take_hosts();
    assert_eq!(got.iter().map(|h| (h.0, h.4.clone())).collect::<Vec<_>>(), vec![(100, vec![3]), (101, vec![3])]);
    assert_eq!(net.sw(RELAY).counters().transit_duplicate, 1);
}

#[test]
fn join_answers_and_refusals_go_to_the_source_they_name() {
    let mut net = one_relay();
    net.send(101, RELAY, datagram(MessageType::Join, 1, 1, 0, &[]));
    let got = net.take_hosts();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].0, got[0].1, got[0].2), (101, MessageType::JoinAck, 1));
    // joins to a job the node does not have: each refusal names its
    // worker and reaches that worker alone
    net.sw(RELAY).add_transit(7, vec![NODE], &[]).unwrap();
    net.send(100, RELAY, datagram(MessageType::Join, 7, 0, 0, &[]));
    net.send(101, RELAY, datagram(MessageType::Join, 7, 1, 0, &[]));
    let got = net.take_hosts();
    assert_eq!(got.iter().map(|h| (h.0, h.1, h.2)).collect::<Vec<_>>(), vec![
        (100, MessageType::Nack, 0),
        (101, MessageType::Nack, 1)
    ]);
}

#[test]
fn two_relays_deep_each_hop_sends_one_copy_down() {
    // EDGE -> RELAY -> NODE for workers 0 and 1, worker 2 at RELAY directly
    let mut net = one_relay();
    let mut edge = switch();
    edge.add_transit(1, vec![RELAY], &[]).unwrap();
    net.switches.push((EDGE, edge));
    net.send(100, EDGE, contribution(1, 0, 3, &[1]));
    net.send(101, EDGE, contribution(1, 1, 3, &[2]));
    net.send(102, RELAY, contribution(1, 2, 3, &[4]));
    let mut got = net.take_hosts();
    got.sort_by_key(|h| h.0);
    assert_eq!(got.iter().map(|h| (h.0, h.4.clone())).collect::<Vec<_>>(), vec![
        (100, vec![7]),
        (101, vec![7]),
        (102, vec![7])
    ]);
    assert_eq!((net.count(NODE, RELAY), net.count(RELAY, EDGE)), (1, 1));
    // the relay's one address for workers 0 and 1 is EDGE's
    assert_eq!(net.sw(RELAY).transit_sources(1), vec![(0, EDGE), (1, EDGE), (2, 102)]);
}

#[test]
fn a_switch_aggregates_its_members_and_relays_the_same_job_for_others() {
    // GOAT's plan at a ToR: sub-model 1 of workers 0 and 1 is aggregated
    // here, worker 2's goes through to the parameter server, which
    // aggregates the ToR's partial (as rank 2048) with worker 2.
    let rank = SWITCH_RANK_BASE;
    let mut ps = switch();
    ps.add_job(JobSpec { members: vec![2, rank], workers: 3, ..JobSpec::with_sources(1, 0, 4, 64) }).unwrap();
    let mut tor = switch();
    tor.add_job(JobSpec { workers: 3, ..JobSpec::with_sources(1, 2, 4, 64) }).unwrap();
    tor.set_uplink(1, Some(Uplink { parent: vec![NODE], rank })).unwrap();
    tor.add_transit(1, vec![NODE], &[]).unwrap();
    let mut net = Net::new(vec![(NODE, ps), (RELAY, tor)]);
    net.send(100, RELAY, contribution(1, 0, 0, &[1]));
    net.send(102, RELAY, contribution(1, 2, 0, &[100]));
    assert_eq!(net.sw(RELAY).counters().transit_up, 1, "worker 2's, unchanged");
    net.send(101, RELAY, contribution(1, 1, 0, &[10]));
    // the partial (src 2048) and worker 2's contribution share the ToR's
    // address at the PS: one result down, fanned to worker 2 by the transit
    // and to workers 0 and 1 by the job
    assert_eq!(net.count(NODE, RELAY), 1);
    let mut got = net.take_hosts();
    got.sort_by_key(|h| h.0);
    assert_eq!(got.iter().map(|h| (h.0, h.4.clone())).collect::<Vec<_>>(), vec![
        (100, vec![111]),
        (101, vec![111]),
        (102, vec![111])
    ]);
    let c = net.sw(RELAY).counters().clone();
    assert_eq!((c.accepted, c.sent_up, c.transit_up, c.transit_down), (2, 1, 1, 1));
}

#[test]
fn what_a_relay_cannot_carry_is_refused_and_counted() {
    let mut net = one_relay();
    // a sealed datagram (a keyed job's): its results could not be fanned out
    let mut sealed = contribution(1, 0, 0, &[1]);
    sealed[3] |= 0x80;
    sealed.extend_from_slice(&[0; 16]);
    net.send(100, RELAY, sealed);
    // a result from anyone but the next hop
    net.send(77, RELAY, datagram(MessageType::Result, 1, 0, 0, &[1]));
    assert_eq!(net.sw(RELAY).counters().transit_refused, 2);
    assert_eq!(net.count(RELAY, NODE), 0);
    // garbage is malformed, as anywhere
    net.send(100, RELAY, vec![0xff; 30]);
    assert_eq!(net.sw(RELAY).counters().malformed.iter().sum::<u64>(), 1);
    // a header cut by the network still travels (the node answers it)
    let whole = contribution(1, 0, 0, &[5, 6]);
    net.send(100, RELAY, whole[..HEADER_LEN].to_vec());
    assert_eq!(net.sw(NODE).counters().trimmed_in_network, 1);
    let got = net.take_hosts();
    assert_eq!((got[0].0, got[0].1, got[0].2), (100, MessageType::Nack, 0));
}

#[test]
fn a_transit_needs_one_next_hop_per_shard_and_can_be_moved_and_removed() {
    let mut sw = switch();
    assert!(matches!(sw.add_transit(1, vec![1, 2], &[]), Err(AdmitError::BadTransit { hops: 2, shards: 1, .. })));
    let mut two = ValueSwitch::<Addr>::new(ShardConfig { shard: 1, shard_count: 2, ..ShardConfig::single(1 << 30) });
    two.add_transit(1, vec![30, 31], &[]).unwrap();
    let mut out = VecTransmit::new();
    let _ = two.handle_datagram(T0, 100, &contribution(1, 0, 1, &[1]), &mut out);
    assert_eq!(out.drain().map(|(to, _)| to).collect::<Vec<_>>(), vec![31], "shard 1 to the next hop's shard 1");
    // a plan change moves the sub-model: the sources stay known
    two.add_transit(1, vec![40, 41], &[]).unwrap();
    let _ = two.handle_datagram(T0, 100, &contribution(1, 0, 3, &[1]), &mut out);
    assert_eq!(out.drain().map(|(to, _)| to).collect::<Vec<_>>(), vec![41]);
    assert_eq!(two.transit_sources(1), vec![(0, 100)]);
    assert!(two.remove_transit(1) && !two.remove_transit(1));
    assert_eq!(two.transit_ids().count(), 0);
}

#[test]
fn a_tree_nodes_expiry_refusal_reaches_every_host_behind_a_relay() {
    // EDGE relays job 1 to a tree node at RELAY (members 0 and 1, parent
    // NODE, here a bare address). The parent refuses the node's partial as
    // expired; the node passes the refusal to its members with its own rank
    // as src_id, which names no source behind EDGE: every host gets it.
    let rank = SWITCH_RANK_BASE;
    let mut tree = switch();
    tree.add_job(JobSpec { workers: 4, ..JobSpec::with_sources(1, 2, 4, 64) }).unwrap();
    tree.set_uplink(1, Some(Uplink { parent: vec![NODE], rank })).unwrap();
    let mut edge = switch();
    edge.add_transit(1, vec![RELAY], &[]).unwrap();
    let mut net = Net::new(vec![(RELAY, tree), (EDGE, edge)]);
    net.send(100, EDGE, contribution(1, 0, 0, &[1]));
    net.send(101, EDGE, contribution(1, 1, 0, &[2]));
    let partial = net.take_hosts();
    assert_eq!((partial.len(), partial[0].0, partial[0].2), (1, NODE, rank), "one partial up, from the node's rank");
    let mut nack = datagram(MessageType::Nack, 1, rank, 0, &[]);
    nack.truncate(HEADER_LEN);
    nack.extend_from_slice(&[0; Nack::LEN]);
    Nack { reason: NackReason::BlockExpired, detail: 0 }.emit(&mut nack[HEADER_LEN..]);
    net.send(NODE, RELAY, nack);
    let got = net.take_hosts();
    assert_eq!(got.iter().map(|h| (h.0, h.1, h.2)).collect::<Vec<_>>(), vec![
        (100, MessageType::Nack, rank),
        (101, MessageType::Nack, rank)
    ]);
    assert_eq!(net.count(RELAY, EDGE), 1, "one copy for both members behind EDGE");
}

#[test]
fn a_source_that_became_a_member_here_is_answered_by_the_job_not_the_transit() {
    // worker 2 was relayed (its node was the PS); a plan change made it a
    // member of this switch's own job. A JoinAck from the PS naming it is
    // then the job's (a sync answer), not the transit's to pass on.
    let mut relay = switch();
    relay.add_transit(1, vec![NODE], &[]).unwrap();
    let mut out = VecTransmit::new();
    let _ = relay.handle_datagram(T0, 102, &contribution(1, 2, 0, &[1]), &mut out);
    assert_eq!(relay.transit_sources(1), vec![(2, 102)]);
    relay.add_job(JobSpec { members: vec![2], workers: 3, ..JobSpec::with_sources(1, 0, 4, 64) }).unwrap();
    let mut out = VecTransmit::new();
    let _ = relay.handle_datagram(T0, NODE, &datagram(MessageType::JoinAck, 1, 2, 0, &[]), &mut out);
    assert!(out.drain().all(|(to, _)| to != 102), "not relayed to the member");
    assert_eq!(relay.counters().transit_down, 0);
}

#[test]
fn the_distinct_addresses_follow_sources_that_move() {
    let mut net = one_relay();
    net.send(100, RELAY, contribution(1, 0, 0, &[1]));
    net.send(100, RELAY, contribution(1, 1, 0, &[1])); // two sources behind one address (a NAT)
    net.send(105, RELAY, contribution(1, 1, 1, &[1])); // source 1 moved
    net.send(102, NODE, contribution(1, 2, 0, &[1]));
    let got = net.take_hosts();
    assert_eq!(got.iter().filter(|h| h.1 == MessageType::Result).map(|h| h.0).collect::<Vec<_>>(), vec![100, 105, 102]);
}

#[test]
fn a_transit_told_its_sources_relays_no_one_else_and_forgets_those_taken_off() {
    let mut net = one_relay();
    net.sw(RELAY).add_transit(1, vec![NODE], &[0, 1]).unwrap();
    // a forged source (not behind this switch in the plan) adds no address
    net.send(66, RELAY, contribution(1, 2, 0, &[1]));
    assert_eq!((net.count(RELAY, NODE), net.sw(RELAY).counters().transit_refused), (0, 1));
    assert!(net.sw(RELAY).transit_sources(1).is_empty());
    net.send(100, RELAY, contribution(1, 0, 0, &[1]));
    net.send(101, RELAY, contribution(1, 1, 0, &[1]));
    assert_eq!(net.sw(RELAY).transit_sources(1), vec![(0, 100), (1, 101)]);
    // a plan change leaves only source 0 behind this switch
    net.sw(RELAY).add_transit(1, vec![NODE], &[0]).unwrap();
    assert_eq!(net.sw(RELAY).transit_sources(1), vec![(0, 100)]);
    net.send(102, NODE, contribution(1, 2, 0, &[1]));
    let got = net.take_hosts();
    assert_eq!(got.iter().map(|h| h.0).collect::<Vec<_>>(), vec![100, 102], "101 is no longer fanned to");
}

/// Transits installed by hand in a cycle (A -> B -> C -> A, none of them
/// aggregating the job): a worker's contribution goes around once and the
/// first relay it comes back to drops it (`transit_loops`), instead of the
/// three relaying it for ever; the worker's own retransmission is still
/// relayed (it comes from the worker's address), and is cut the same way.
#[test]
fn a_contribution_sent_around_a_cycle_of_relays_is_cut_after_one_turn() {
    const A: Addr = 1;
    const B: Addr = 2;
    const C: Addr = 3;
    let mut switches = Vec::new();
    for (me, next) in [(A, B), (B, C), (C, A)] {
        let mut sw = switch();
        sw.add_transit(7, vec![next], &[]).unwrap();
        switches.push((me, sw));
    }
    let mut net = Net::new(switches);
    // bounded delivery: on a relay without the check this never ends
    let deliver_all = |net: &mut Net, first: Vec<(Addr, Addr, Vec<u8>)>| {
        // first in, first delivered: datagrams in flight take turns
        let mut queue: std::collections::VecDeque<_> = first.into();
        let mut hops = 0;
        while let Some((from, to, bytes)) = queue.pop_front() {
            hops += 1;
            assert!(hops <= 50, "still circling after 50 hops");
            let mut out = VecTransmit::new();
            let _ = net.sw(to).handle_datagram(T0, from, &bytes, &mut out);
            queue.extend(out.drain().map(|(dest, b)| (to, dest, b)));
        }
        hops
    };
    let deliver = |net: &mut Net, first: (Addr, Addr, Vec<u8>)| deliver_all(net, vec![first]);
    let c = contribution(7, 0, 0, &[1, 2]);
    assert_eq!(deliver(&mut net, (100, A, c.clone())), 4, "A, B, C, and back at A");
    assert_eq!(net.sw(A).counters().transit_loops, 1);
    assert_eq!(net.sw(A).counters().transit_up + net.sw(B).counters().transit_up + net.sw(C).counters().transit_up, 3);
    // the worker retransmits: relayed again from its own address, cut again
    let r = datagram(MessageType::Retransmission, 7, 0, 0, &[1, 2]);
    assert_eq!(deliver(&mut net, (100, A, r)), 4);
    assert_eq!(net.sw(A).counters().transit_loops, 2);
    // and the very same bytes twice from the worker are both relayed (a
    // repeat from the source's own address is no loop)
    assert_eq!(deliver(&mut net, (100, A, c.clone())), 4);
    assert_eq!(deliver(&mut net, (100, A, c)), 4);
    assert_eq!(net.sw(A).counters().transit_loops, 4);
    // a window of blocks in flight at once, around the cycle together:
    // each one is known again when it comes back
    let window: Vec<_> = (1..=8).map(|b| (100, A, contribution(7, 0, b, &[b as i32]))).collect();
    assert_eq!(deliver_all(&mut net, window), 8 * 4);
    assert_eq!(net.sw(A).counters().transit_loops, 12);
}
