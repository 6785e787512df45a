//! Members that go slow, come back, or die (docs/stragglers.md, docs/failures.md).

use super::*;

/// Declare the sources in `newly_slow` permanently slow: notify every
/// member, and stop waiting for them in every open block of this shard
/// (which may complete blocks, and so declare more sources slow).
pub(super) fn settle_slow_sources<A: Copy + PartialEq>(
    job: &mut Job<A>,
    newly_slow: &mut Vec<usize>,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    scratch: &mut Vec<u8>,
) {
    while let Some(src) = newly_slow.pop() {
        // The job always waits for someone: the last active source stays.
        if !job.active.contains(src) || job.active.count() <= 1 {
            continue;
        }
        job.active.remove(src);
        job.missed_streak[src] = 0;
        counters.declared_slow += 1;
        let block_id = latest_block(job);
        notify_membership(job, src, MEMBERSHIP_SLOW, block_id, counters, out, scratch);
        let quorum = job.spec.quorum;
        for local in 0..job.slots.len() {
            let Some(block) = job.slots[local].cur.as_mut() else { continue };
            if !block.aggregating() {
                continue;
            }
            block.forget(src);
            if block.satisfied(quorum) {
                close_phase(job, local, counters, out, scratch, newly_slow);
            }
        }
    }
}

/// A permanently slow source caught up (or rejoined): wait for it again, in
/// the open blocks and in every block created from now on.
pub(super) fn readmit<A: Copy + PartialEq>(
    job: &mut Job<A>,
    src: usize,
    block_id: u32,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    scratch: &mut Vec<u8>,
) {
    job.active.insert(src);
    job.missed_streak[src] = 0;
    counters.readmitted += 1;
    // It caught up: the open blocks wait for it too (it is about to send
    // them), so it is not left out of the rest of the current window.
    for block in job.slots.iter_mut().filter_map(|s| s.cur.as_mut()).filter(|b| b.aggregating()) {
        block.expect(src);
    }
    notify_membership(job, src, MEMBERSHIP_READMITTED, block_id, counters, out, scratch);
}

/// Tell every member that `src`'s status changed.
pub(super) fn notify_membership<A: Copy + PartialEq>(
    job: &mut Job<A>,
    src: usize,
    status: u8,
    block_id: u32,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    scratch: &mut Vec<u8>,
) {
    let repr = Repr {
        age_op: status,
        src_cnt: job.active.count() as u16,
        block_id,
        ..Repr::new(MessageType::Membership, job.spec.job_id, src as u16)
    };
    scratch.clear();
    scratch.resize(repr.buffer_len(), 0);
    repr.emit(&mut Packet::new_unchecked(&mut scratch[..]));
    broadcast(&job.members, &job.addrs, job.auth.as_mut(), out, scratch, &mut counters.notices_sent);
}

/// The member timeout check (docs/failures.md): a member silent for the
/// timeout that an open block has waited that long for is dead. Policy
/// `degrade` declares it permanently slow (blocks complete without it);
/// `fail` fails the job and tells every member which source died.
pub(super) fn check_members<A: Copy + PartialEq>(
    job: &mut Job<A>,
    now: Time,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    scratch: &mut Vec<u8>,
) {
    if job.spec.mode != JobMode::Aggregate {
        return;
    }
    let fail = job.spec.on_failure == FailurePolicy::Fail;
    let timeout = job.liveness.timeout;
    let mut dead = Vec::new();
    for m in job.members.iter() {
        // A slow source is no longer waited for; under `fail` it still
        // counts if it is silent (it died after being declared slow).
        let waited_for = |b: &Block| if fail { !job.awaiting.contains(m) } else { b.expected.contains(m) };
        if !job.liveness.silent(m, now) || (!fail && !job.active.contains(m)) {
            continue;
        }
        let blocked = job.slots.iter().filter_map(|s| s.cur.as_ref()).any(|b| {
            b.aggregating() && !b.rcvd.contains(m) && waited_for(b) && now.saturating_since(b.start_time) >= timeout
        });
        if blocked {
            dead.push(m);
        }
    }
    if dead.is_empty() {
        return;
    }
    counters.members_timed_out += dead.len() as u64;
    if fail {
        fail_job(job, dead[0], counters, out, scratch);
    } else {
        settle_slow_sources(job, &mut dead, counters, out, scratch);
    }
}

/// Policy `fail`: the job takes nothing more (contributions and joins get a
/// JobFailed nack naming `dead`) until the control plane re-admits it; its
/// blocks are dropped, its memory stays reserved until it is removed.
pub(super) fn fail_job<A: Copy + PartialEq>(job: &mut Job<A>, dead: usize, counters: &mut Counters, out: &mut impl Transmit<A>, scratch: &mut Vec<u8>) {
    job.liveness.failed = Some(dead as u16);
    counters.jobs_failed += 1;
    let block_id = latest_block(job);
    notify_membership(job, dead, MEMBERSHIP_FAILED, block_id, counters, out, scratch);
    drop_blocks(job);
}

/// The latest block this shard holds, in stream order (ids wrap), for a
/// Membership notice; 0 if it holds none.
fn latest_block<A>(job: &Job<A>) -> u32 {
    let space = job.space;
    job.slots.iter().filter_map(|s| s.cur.as_ref()).map(|b| b.block_id).reduce(|a, b| space.later(a, b)).unwrap_or(0)
}
