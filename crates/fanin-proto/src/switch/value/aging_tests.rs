//! Exact packet traces of straggler mitigation on one switch shard:
//! aging (Trio-ML's timer scanners, skew-aware expiry), partial results,
//! and the classification of slow sources (docs/stragglers.md). Split
//! from tests.rs, whose packet helpers it uses.

use super::tests::{decode, job, Addr, Pkt};
use super::*;
use crate::transmit::VecTransmit;

const MS: u64 = 1_000_000;

fn at(ms: u64) -> Time {
    Time::from_nanos(ms * MS)
}

/// A switch whose scanners tick every `block_exp / (scanners * checks)`.
fn aging_switch(spec: JobSpec, scanners: u16, checks: u8) -> ValueSwitch<Addr> {
    let mut cfg = ShardConfig::single(1 << 30);
    cfg.aging = AgingConfig { scanners, checks, min_tick: Duration::from_micros(1), ..AgingConfig::default() };
    let mut sw = ValueSwitch::new(cfg);
    sw.add_job(spec).unwrap();
    sw
}

fn send_at(sw: &mut ValueSwitch<Addr>, now: Time, p: Pkt) -> Vec<(Addr, Repr, Vec<i32>)> {
    let mut out = VecTransmit::new();
    let from = 100 + p.repr.src_id as u32;
    assert_eq!(sw.handle_datagram(now, from, &p.bytes(), &mut out), Verdict::Consumed);
    decode(out)
}

/// Sources 0 and 1 of job 1 contribute `[1]` to blocks `0..blocks` at 0 ms;
/// source 2 sends nothing. What the switch sends by the scan at 8 ms,
/// after the blocks aged (the scan at 4 ms first).
fn age_blocks_without_source_2(sw: &mut ValueSwitch<Addr>, blocks: u32) -> Vec<(Addr, Repr, Vec<i32>)> {
    for b in 0..blocks {
        send_at(sw, at(0), Pkt::data(1, 0, b, &[1]));
        send_at(sw, at(0), Pkt::data(1, 1, b, &[1]));
    }
    tick(sw, at(4));
    tick(sw, at(8))
}

fn tick(sw: &mut ValueSwitch<Addr>, now: Time) -> Vec<(Addr, Repr, Vec<i32>)> {
    let mut out = VecTransmit::new();
    sw.handle_timeout(now, &mut out);
    decode(out)
}

fn aging_job(n: u16, slots: u32, exp_ms: u32, k: u32) -> JobSpec {
    let mut spec = job(1, n, slots);
    spec.block_exp_ms = exp_ms;
    spec.slow_after_windows = k;
    spec
}

#[test]
fn blocks_age_at_the_second_visit_of_their_slice_with_trios_single_flag() {
    // 2 scanners, 1 check, block_exp 10 ms: a tick every 5 ms; tick k visits
    // slice k mod 2; slice 0 = slots 0-1, slice 1 = slots 2-3.
    let mut sw = aging_switch(aging_job(3, 4, 10, 0), 2, 1);
    assert_eq!(sw.poll_timeout(), None, "no open block, no scanning");
    for src in 0..2 {
        send_at(&mut sw, at(1), Pkt::data(1, src, 0, &[1, 2]));
        send_at(&mut sw, at(1), Pkt::data(1, src, 2, &[10]));
    }
    assert_eq!(sw.poll_timeout(), Some(at(5)));
    assert!(tick(&mut sw, at(5)).is_empty(), "slice 1: block 2's flag is cleared");
    assert!(tick(&mut sw, at(10)).is_empty(), "slice 0: block 0's flag is cleared");
    let out = tick(&mut sw, at(15));
    assert_eq!(out.len(), 2, "slice 1 again: block 2 ages, result to the two known members");
    for (dest, repr, vals) in &out {
        assert!(*dest == 100 || *dest == 101);
        assert_eq!((repr.block_id, repr.src_cnt, repr.degraded, repr.age_op), (2, 2, true, AGE_OP_AGED));
        assert_eq!(vals, &vec![20]);
    }
    let out = tick(&mut sw, at(20));
    assert_eq!((out.len(), out[0].1.block_id, out[0].2.clone()), (2, 0, vec![2, 4]));
    assert_eq!(sw.poll_timeout(), None);
    let c = sw.counters();
    assert_eq!((c.blocks_aged, c.blocks_degraded, c.blocks_completed, c.scans), (2, 2, 2, 4));
}

/// What a scanner thread does at `now` for scanner `i`'s ticks up to it:
/// visit its slice of every job's board on the schedule, hand the names to
/// the shard.
fn scanner_thread_tick(sw: &mut ValueSwitch<Addr>, i: u64, from: Time, now: Time) -> Vec<(Addr, Repr, Vec<i32>)> {
    let mut out = VecTransmit::new();
    for s in sw.scan_schedules() {
        let mut k = from.as_nanos() / s.tick_ns + 1;
        while k * s.tick_ns <= now.as_nanos() {
            if k % s.slices == i {
                let (lo, hi) = s.board.slice(i, s.slices);
                let mut idle = Vec::new();
                s.board.visit(lo, hi, &mut idle);
                sw.age_idle(Time::from_nanos(k * s.tick_ns), s.job_id, &s.board, &idle, &mut out);
            }
            k += 1;
        }
    }
    decode(out)
}

/// A shard with `scanners` aging scanners run outside it (aging.threads),
/// one check per visit, holding `job`.
fn threaded_scanner_switch(scanners: u16, job: JobSpec) -> ValueSwitch<Addr> {
    let mut cfg = ShardConfig::single(1 << 30);
    cfg.aging = AgingConfig { scanners, checks: 1, min_tick: Duration::from_micros(1), threads: true, ..AgingConfig::default() };
    let mut sw = ValueSwitch::new(cfg);
    sw.add_job(job).unwrap();
    sw
}

#[test]
fn scanner_threads_age_the_same_blocks_at_the_same_ticks_as_inline_scanning() {
    // blocks_age_at_the_second_visit_of_their_slice_with_trios_single_flag,
    // with the two scanners outside the shard (aging.threads)
    let mut sw = threaded_scanner_switch(2, aging_job(3, 4, 10, 0));
    for src in 0..2 {
        send_at(&mut sw, at(1), Pkt::data(1, src, 0, &[1, 2]));
        send_at(&mut sw, at(1), Pkt::data(1, src, 2, &[10]));
    }
    assert!(!matches!(sw.poll_timeout(), Some(t) if t <= at(40)), "the shard keeps no scanner time (only the member timeout)");
    assert!(tick(&mut sw, at(40)).is_empty(), "nor visits");
    let mut outs = Vec::new();
    for t in [5, 10, 15, 20] {
        // scanner 1 ticks at 5 and 15 ms, scanner 0 at 10 and 20 ms
        let out = scanner_thread_tick(&mut sw, (t / 5) % 2, at(t - 5), at(t));
        outs.push(out);
    }
    assert!(outs[0].is_empty() && outs[1].is_empty(), "the flags are cleared first");
    assert_eq!(outs[2].len(), 2, "slice 1 again: block 2 ages");
    assert_eq!((outs[2][0].1.block_id, outs[2][0].1.age_op, outs[2][0].2.clone()), (2, AGE_OP_AGED, vec![20]));
    assert_eq!((outs[3].len(), outs[3][0].1.block_id, outs[3][0].2.clone()), (2, 0, vec![2, 4]));
    let c = sw.counters();
    assert_eq!((c.blocks_aged, c.blocks_degraded, c.blocks_completed), (2, 2, 2));
}

#[test]
fn a_contribution_after_a_scanner_thread_named_the_block_keeps_it_open() {
    let mut sw = threaded_scanner_switch(1, aging_job(3, 2, 4, 0));
    send_at(&mut sw, at(0), Pkt::data(1, 0, 0, &[1]));
    let s = sw.scan_schedules().pop().unwrap();
    let mut idle = Vec::new();
    s.board.visit(0, 2, &mut idle); // clears REF
    s.board.visit(0, 2, &mut idle); // names block 0
    assert_eq!(idle, [(0, 0)]);
    // member 1 contributes before the shard acts on the name: it wins
    send_at(&mut sw, at(5), Pkt::data(1, 1, 0, &[2]));
    let mut out = VecTransmit::new();
    sw.age_idle(at(5), 1, &s.board, &idle, &mut out);
    assert!(out.drain().next().is_none() && sw.counters().blocks_aged == 0, "not aged");
    // names from the board of a job removed and admitted again are ignored
    // (its slots may differ: a stale slot index must not reach them)
    assert!(sw.remove_job(1));
    sw.add_job(aging_job(3, 1, 4, 0)).unwrap();
    send_at(&mut sw, at(6), Pkt::data(1, 0, 0, &[1]));
    sw.age_idle(at(7), 1, &s.board, &[(0, 0), (5, 0)], &mut out);
    assert_eq!(sw.counters().blocks_aged, 0);
}

#[test]
fn a_contribution_refreshes_the_flag_and_delays_aging() {
    let mut sw = aging_switch(aging_job(3, 4, 10, 0), 2, 1);
    send_at(&mut sw, at(1), Pkt::data(1, 0, 0, &[1]));
    assert!(tick(&mut sw, at(10)).is_empty()); // ticks 5 (slice 1), 10 (slice 0: clear)
    send_at(&mut sw, at(12), Pkt::data(1, 1, 0, &[1])); // referenced again
    assert!(tick(&mut sw, at(20)).is_empty(), "flag was set again: cleared, not aged");
    // a duplicate does not refresh it: waiting members' retransmissions
    // must not keep a straggler's block alive forever
    send_at(&mut sw, at(22), Pkt::data(1, 1, 0, &[1]).retransmission());
    let out = tick(&mut sw, at(30));
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].1.src_cnt, out[0].1.degraded), (2, true));
}

#[test]
fn more_checks_age_within_a_fraction_of_the_timeout() {
    // 1 scanner, 4 checks, 8 ms: a visit every 2 ms; a block ages between 8
    // and 10 ms after its last contribution.
    let mut sw = aging_switch(aging_job(2, 1, 8, 0), 1, 4);
    send_at(&mut sw, at(1), Pkt::data(1, 0, 0, &[5]));
    for t in [2, 4, 6, 8] {
        assert!(tick(&mut sw, at(t)).is_empty(), "t = {t} ms");
    }
    let out = tick(&mut sw, at(10));
    assert_eq!((out.len(), out[0].1.src_cnt), (1, 1), "aged 9 ms after the contribution");
}

/// Two sources, source 1 `skew_ms` behind source 0, on block `b`, the
/// first block of its own allreduce (generation b + 1), starting at `t` ms,
/// with the scanners ticking every ms up to `until`: whether the block aged
/// (its result went out degraded).
fn skewed_block(sw: &mut ValueSwitch<Addr>, b: u32, t: u64, skew_ms: u64, until: u64) -> bool {
    let mut degraded = false;
    let gen = b as u16 + 1;
    send_at(sw, at(t), Pkt::data(1, 0, b, &[1]).gen(gen));
    for ms in t + 1..=until {
        let mut out = tick(sw, at(ms));
        if ms == t + skew_ms {
            out.extend(send_at(sw, at(ms), Pkt::data(1, 1, b, &[2]).gen(gen)));
        }
        degraded |= out.iter().any(|(_, r, _)| r.block_id == b && r.degraded);
    }
    degraded
}

#[test]
fn a_job_whose_ranks_are_always_apart_learns_to_wait_for_them() {
    // block_exp 4 ms, 1 scanner x 1 check: a visit every 4 ms. Source 1 is
    // 10 ms behind on every block (ranks sharing cores start each allreduce
    // apart): the first block ages, source 1's late arrival is a 10 ms
    // spread sample, and the expiry becomes 2 x 10 ms: the next blocks wait.
    let mut sw = aging_switch(aging_job(2, 8, 4, 0), 1, 1);
    assert!(skewed_block(&mut sw, 0, 0, 10, 20), "the first block ages at the fixed 4 ms");
    for b in 1..6u32 {
        let t = 20 * b as u64;
        assert!(!skewed_block(&mut sw, b, t, 10, t + 19), "block {b} completes with both sources");
    }
    assert_eq!((sw.counters().blocks_aged, sw.counters().late), (1, 1));
}

#[test]
fn a_straggler_far_beyond_the_learnt_skew_still_ages_and_does_not_move_it() {
    let mut sw = aging_switch(aging_job(2, 8, 4, 0), 1, 1);
    for b in 0..4u32 {
        skewed_block(&mut sw, b, 20 * b as u64, 10, 20 * b as u64 + 19);
    }
    // a 300 ms straggle: the block ages about 20-24 ms after source 0
    assert!(skewed_block(&mut sw, 4, 100, 300, 400), "the straggled block ages");
    let aged = sw.counters().blocks_aged;
    // its 300 ms late sample is one of several: the median stays 10 ms
    for b in 5..9u32 {
        let t = 400 + 20 * (b - 5) as u64;
        assert!(!skewed_block(&mut sw, b, t, 10, t + 19), "block {b}: ordinary skew, waited for");
    }
    assert!(skewed_block(&mut sw, 9, 500, 60, 600), "60 ms is beyond 2 x the median: ages");
    assert_eq!(sw.counters().blocks_aged, aged + 1);
}

#[test]
fn the_learnt_expiry_is_capped_and_max_factor_1_is_trios_fixed_timeout() {
    // a job that is always 200 ms apart: the expiry stops at 16 x 4 ms
    let mut sw = aging_switch(aging_job(2, 8, 4, 0), 1, 1);
    for b in 0..3u32 {
        assert!(skewed_block(&mut sw, b, 300 * b as u64, 200, 300 * b as u64 + 299), "block {b} ages");
    }
    // max_factor 1: the skew is never learnt
    let mut cfg = ShardConfig::single(1 << 30);
    cfg.aging = AgingConfig { scanners: 1, checks: 1, min_tick: Duration::from_micros(1), max_factor: 1, threads: false };
    let mut fixed = ValueSwitch::new(cfg);
    fixed.add_job(aging_job(2, 8, 4, 0)).unwrap();
    for b in 0..4u32 {
        assert!(skewed_block(&mut fixed, b, 20 * b as u64, 10, 20 * b as u64 + 19), "block {b} ages");
    }
}

#[test]
fn a_late_contribution_gets_the_partial_result_and_is_never_added() {
    let mut sw = aging_switch(aging_job(3, 2, 4, 0), 1, 1);
    send_at(&mut sw, at(0), Pkt::data(1, 0, 0, &[1]));
    send_at(&mut sw, at(0), Pkt::data(1, 1, 0, &[2]));
    tick(&mut sw, at(4));
    assert_eq!(tick(&mut sw, at(8)).len(), 2, "aged with sources 0 and 1");
    // the straggler arrives: answered with the partial result, not added
    let out = send_at(&mut sw, at(9), Pkt::data(1, 2, 0, &[100]));
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].1.src_cnt, out[0].1.degraded, out[0].2.clone()), (102, 2, true, vec![3]));
    assert_eq!(sw.counters().late, 1);
    // the next use of the slot (block 2) starts clean
    send_at(&mut sw, at(10), Pkt::data(1, 0, 2, &[1]));
    send_at(&mut sw, at(10), Pkt::data(1, 1, 2, &[1]));
    let out = send_at(&mut sw, at(10), Pkt::data(1, 2, 2, &[1]));
    assert_eq!((out.len(), out[0].1.src_cnt, out[0].1.degraded, out[0].2.clone()), (3, 3, false, vec![3]));
    // every member had block 0's result before contributing to block 2 (the
    // straggler got it with its late reply), so the shadow was freed: a
    // request for block 0 now learns it expired
    let out = send_at(&mut sw, at(12), Pkt::data(1, 2, 0, &[100]).retransmission());
    assert_eq!(out[0].1.msg_type, MessageType::Nack);
    let p = out[0].1;
    assert_eq!((p.block_id, sw.counters().expired), (0, 1));
}

#[test]
fn an_aged_exponent_round_moves_on_with_the_exponents_it_has() {
    let mut sw = aging_switch(aging_job(3, 1, 2, 0), 1, 1);
    send_at(&mut sw, at(0), Pkt::exp_only(1, 0, 0, 3));
    send_at(&mut sw, at(0), Pkt::exp_only(1, 1, 0, 5));
    tick(&mut sw, at(2));
    let out = tick(&mut sw, at(4));
    assert_eq!(out.len(), 2);
    assert!(out[0].1.exp_only && out[0].1.exp == 5);
    // data from the two sources of the round completes the block
    send_at(&mut sw, at(5), Pkt::data(1, 0, 0, &[1]).float(5, EXP_NONE));
    let out = send_at(&mut sw, at(5), Pkt::data(1, 1, 0, &[2]).float(5, EXP_NONE));
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].1.src_cnt, out[0].1.degraded, out[0].1.age_op, out[0].2.clone()), (2, true, AGE_OP_AGED, vec![3]));
}

#[test]
fn a_source_missing_for_k_windows_is_declared_slow_then_readmitted() {
    // K = 1 window of 2 slots: missing from 2 aged blocks in a row.
    let mut sw = aging_switch(aging_job(3, 2, 4, 1), 1, 1);
    let out = age_blocks_without_source_2(&mut sw, 2);
    let notices: Vec<_> = out.iter().filter(|o| o.1.msg_type == MessageType::Membership).collect();
    assert_eq!(notices.len(), 2, "both known members are told");
    assert_eq!((notices[0].1.src_id, notices[0].1.age_op, notices[0].1.src_cnt), (2, MEMBERSHIP_SLOW, 2));
    assert_eq!(sw.slow_sources(1), vec![2]);
    // new blocks no longer wait for source 2
    send_at(&mut sw, at(9), Pkt::data(1, 0, 2, &[1]));
    let out = send_at(&mut sw, at(9), Pkt::data(1, 1, 2, &[1]));
    assert_eq!(out.len(), 2, "completed at once, without waiting for the timeout");
    assert_eq!((out[0].1.src_cnt, out[0].1.degraded, out[0].1.age_op), (2, true, 0));
    // source 2 catches up: it adds to an open block and is waited for again
    send_at(&mut sw, at(10), Pkt::data(1, 0, 3, &[1]));
    let out = send_at(&mut sw, at(10), Pkt::data(1, 2, 3, &[5]));
    let notice = out.iter().find(|o| o.1.msg_type == MessageType::Membership).expect("re-admission notice");
    assert_eq!((notice.1.src_id, notice.1.age_op, notice.1.src_cnt), (2, MEMBERSHIP_READMITTED, 3));
    assert!(sw.slow_sources(1).is_empty());
    let out = send_at(&mut sw, at(10), Pkt::data(1, 1, 3, &[1]));
    assert_eq!((out.len(), out[0].1.src_cnt, out[0].1.degraded, out[0].2.clone()), (3, 3, false, vec![7]));
    let c = sw.counters();
    assert_eq!((c.declared_slow, c.readmitted), (1, 1));
}

#[test]
fn declaring_a_source_slow_completes_the_blocks_waiting_only_for_it() {
    // K = 1 window of 4 slots; blocks 0-1 age, blocks 2-3 are open with
    // sources 0 and 1 in them when source 2 is declared slow.
    let mut sw = aging_switch(aging_job(3, 4, 4, 1), 1, 1);
    let out = age_blocks_without_source_2(&mut sw, 4);
    // all four age in this visit (one scanner), source 2 reaches the limit
    // at the fourth; every result went out
    let results = out.iter().filter(|o| o.1.msg_type == MessageType::Result).count();
    assert_eq!(results, 8);
    assert_eq!(sw.slow_sources(1), vec![2]);
}

#[test]
fn a_rejoining_slow_source_is_readmitted() {
    let mut sw = aging_switch(aging_job(2, 1, 2, 1), 1, 1);
    send_at(&mut sw, at(0), Pkt::data(1, 0, 0, &[1]));
    tick(&mut sw, at(2));
    tick(&mut sw, at(4));
    assert_eq!(sw.slow_sources(1), vec![1]);
    let mut join = Pkt::data(1, 1, 0, &[]);
    join.repr.msg_type = MessageType::Join;
    let out = send_at(&mut sw, at(5), join);
    assert!(out.iter().any(|o| o.1.msg_type == MessageType::Membership && o.1.age_op == MEMBERSHIP_READMITTED));
    assert!(out.iter().any(|o| o.1.msg_type == MessageType::JoinAck));
    assert!(sw.slow_sources(1).is_empty());
}

#[test]
fn aging_configuration_is_validated() {
    let ok = AgingConfig::default();
    assert!(ok.validate().is_ok());
    let bad = AgingConfig { scanners: 0, ..ok };
    assert!(bad.validate().unwrap_err().contains("aging.scanners 0"));
    let bad = AgingConfig { checks: 16, ..ok };
    assert!(bad.validate().unwrap_err().contains("aging.checks 16"));
    // 1 ms with 100 scanners x 4 checks is a 2.5 us tick: refused, clearly
    let mut cfg = ShardConfig::single(1 << 30);
    cfg.aging = AgingConfig { scanners: 100, checks: 4, min_tick: Duration::from_micros(20), ..AgingConfig::default() };
    let mut sw = ValueSwitch::<Addr>::new(cfg);
    let err = sw.add_job(aging_job(2, 4, 1, 1)).unwrap_err();
    assert!(matches!(err, AdmitError::AgingTooFine { .. }));
    assert!(err.to_string().contains("block_exp_ms 1 with 100 scanners x 4 checks"), "{err}");
}

#[test]
fn a_slow_source_one_step_behind_the_others_is_readmitted() {
    // Declared slow, it then sends the current block of its slot just after
    // the others completed it: it is within a window, so it caught up.
    let mut sw = aging_switch(aging_job(3, 2, 4, 1), 1, 1);
    age_blocks_without_source_2(&mut sw, 2);
    assert_eq!(sw.slow_sources(1), vec![2]);
    send_at(&mut sw, at(9), Pkt::data(1, 0, 2, &[1]));
    send_at(&mut sw, at(9), Pkt::data(1, 1, 2, &[1])); // block 2 done without source 2
    let out = send_at(&mut sw, at(9), Pkt::data(1, 2, 2, &[1]));
    assert!(out.iter().any(|o| o.1.msg_type == MessageType::Result && o.1.src_cnt == 2), "late: the partial result");
    assert!(out.iter().any(|o| o.1.msg_type == MessageType::Membership && o.1.age_op == MEMBERSHIP_READMITTED));
    // but a contribution for a shadow (two steps behind) does not re-admit
    let mut sw = aging_switch(aging_job(3, 2, 4, 1), 1, 1);
    age_blocks_without_source_2(&mut sw, 2);
    for s in 0..2 {
        send_at(&mut sw, at(9), Pkt::data(1, s, 2, &[1]));
    }
    let out = send_at(&mut sw, at(9), Pkt::data(1, 2, 0, &[1]));
    assert!(out.iter().all(|o| o.1.msg_type != MessageType::Membership));
    assert_eq!(sw.slow_sources(1), vec![2]);
}

#[test]
fn a_data_phase_without_contributions_is_never_emitted_empty() {
    // Block 0's exponent round ages with only source 0; source 0 is then
    // declared slow (missing from blocks 1 and 3). Block 0's data phase now
    // waits for nobody, but has nothing to emit: it stays open until data
    // arrives, and its result then sums that data.
    let mut sw = aging_switch(aging_job(3, 2, 2, 1), 1, 1);
    let mut all = Vec::new();
    send_at(&mut sw, at(0), Pkt::exp_only(1, 0, 0, 4));
    for s in 1..3 {
        send_at(&mut sw, at(0), Pkt::data(1, s, 1, &[1]));
    }
    for t in [2, 4] {
        all.extend(tick(&mut sw, at(t)));
    }
    for s in 1..3 {
        all.extend(send_at(&mut sw, at(5), Pkt::data(1, s, 3, &[1])));
    }
    for t in [6, 8, 10] {
        all.extend(tick(&mut sw, at(t)));
    }
    assert_eq!(sw.slow_sources(1), vec![0]);
    all.extend(send_at(&mut sw, at(11), Pkt::data(1, 1, 0, &[7]).float(4, EXP_NONE)));
    for t in [12, 14, 16] {
        all.extend(tick(&mut sw, at(t)));
    }
    let results: Vec<_> = all.iter().filter(|o| o.1.msg_type == MessageType::Result && !o.1.exp_only).collect();
    assert!(results.iter().all(|o| o.1.src_cnt > 0), "no result sums zero sources");
    let block0: Vec<_> = results.iter().filter(|o| o.1.block_id == 0).collect();
    assert!(!block0.is_empty(), "block 0 was emitted once data arrived");
    assert_eq!((block0[0].1.src_cnt, block0[0].2.clone()), (1, vec![7]));
}

/// Timers walk the jobs in job_id order, so a switch holding several jobs
/// emits the same datagrams in the same order every run (the simulator is
/// reproducible from its seed). Two switches fed the same datagrams, with
/// the jobs admitted in opposite orders, age out their blocks in one order:
/// with a hash map of jobs, each map's own random state ordered them.
#[test]
fn aging_emits_in_job_order_whatever_the_admission_order() {
    let specs: Vec<JobSpec> = (1..=24).map(|id| JobSpec { job_id: id, ..aging_job(2, 4, 10, 0) }).collect();
    let run = |order: &mut dyn Iterator<Item = &JobSpec>| {
        let mut cfg = ShardConfig::single(1 << 30);
        cfg.aging = AgingConfig { scanners: 1, checks: 1, min_tick: Duration::from_micros(1), ..AgingConfig::default() };
        let mut sw = ValueSwitch::new(cfg);
        for spec in order {
            sw.add_job(spec.clone()).unwrap();
        }
        for spec in &specs {
            send_at(&mut sw, at(1), Pkt::data(spec.job_id, 0, 0, &[spec.job_id as i32]));
        }
        let mut out = Vec::new();
        for ms in [10, 20, 30] {
            out.extend(tick(&mut sw, at(ms)).into_iter().map(|(a, r, v)| (a, r.job_id, r.block_id, v)));
        }
        out
    };
    let forward = run(&mut specs.iter());
    let backward = run(&mut specs.iter().rev());
    assert_eq!(forward.len(), 24, "every job's block aged once: {forward:?}");
    assert_eq!(forward, backward);
    let jobs: Vec<u32> = forward.iter().map(|o| o.1).collect();
    assert!(jobs.windows(2).all(|w| w[0] < w[1]), "in job_id order: {jobs:?}");
}

#[test]
fn a_leaf_that_aged_a_block_passes_its_subtrees_mark_up_and_the_roots_verdict_down() {
    // a leaf of 3 workers under a parent; worker 2 is slow, so the leaf
    // ages its blocks; worker 0's contribution to block 0 arrived CE-marked
    const PARENT: Addr = 1;
    let rank = SWITCH_RANK_BASE;
    let mut sw = aging_switch(JobSpec { workers: 6, ..aging_job(3, 4, 2, 0) }, 1, 1);
    sw.set_uplink(1, Some(Uplink { parent: vec![PARENT], rank })).unwrap();
    let mut out = VecTransmit::new();
    sw.handle_datagram_ce(at(0), 100, &Pkt::data(1, 0, 0, &[1]).bytes(), true, &mut out);
    send_at(&mut sw, at(0), Pkt::data(1, 1, 0, &[1]));
    send_at(&mut sw, at(0), Pkt::data(1, 0, 1, &[1]));
    send_at(&mut sw, at(0), Pkt::data(1, 1, 1, &[1]));
    tick(&mut sw, at(4));
    let up = tick(&mut sw, at(8));
    // aged here, yet the partial says what the root acts on: the mark
    let up: Vec<_> = up.iter().map(|(a, r, _)| (*a, r.block_id, r.age_op)).collect();
    assert_eq!(up, vec![(PARENT, 0, AGE_OP_CONGESTED), (PARENT, 1, 0)]);
    // the root's verdicts come down as they are, not as "aged": marked for
    // block 0, unmarked for block 1, as every other subtree reads them
    for (b, verdict) in [(0, AGE_OP_CONGESTED), (1, 0)] {
        let mut result = Pkt::data(1, 0, b, &[5]);
        result.repr.msg_type = MessageType::Result;
        result.repr.src_cnt = 5;
        result.repr.age_op = verdict;
        let mut out = VecTransmit::new();
        assert_eq!(sw.handle_datagram(at(9), PARENT, &result.bytes(), &mut out), Verdict::Consumed);
        let down = decode(out);
        assert_eq!(down.len(), 2, "to workers 0 and 1");
        assert!(down.iter().all(|(_, r, v)| r.age_op == verdict && v == &vec![5]), "block {b}: {down:?}");
    }
}
